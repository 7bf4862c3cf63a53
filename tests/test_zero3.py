"""oomdoctor.sim.zero3: DeepSpeed ZeRO-3's module hooks and F.linear in a traced step. The
memory they change is checked against the H200 records (tests/test_deepspeed_gpu.py: the
stage-3 runs of DeepSpeedExamples' transformer, whose nn.MultiheadAttention they unpack, within
0.2% allocated); here, that the stand-ins compute what they replace."""
import torch
import torch.nn.functional as F

from oomdoctor.sim import zero3


def test_the_linear_function_computes_f_linear_and_its_gradients():
    """DeepSpeed's LinearFunctionForZeroStage3 against torch's own F.linear, on real CPU
    tensors: outputs and every gradient, for 2-D and 3-D inputs, with and without a bias."""
    torch.manual_seed(0)
    for shape in ((5, 8), (3, 5, 8)):
        for with_bias in (True, False):
            x = torch.randn(*shape, requires_grad=True)
            w = torch.randn(6, 8, requires_grad=True)
            b = torch.randn(6, requires_grad=True) if with_bias else None
            ours = zero3.linear(input=x, weight=w, bias=b)   # F.linear's keywords too
            theirs = F.linear(x, w, b)
            assert torch.allclose(ours, theirs, atol=1e-5)
            g = torch.randn_like(theirs)
            got = torch.autograd.grad(ours, [t for t in (x, w, b) if t is not None], g)
            want = torch.autograd.grad(theirs, [t for t in (x, w, b) if t is not None], g)
            assert all(torch.allclose(a, c, atol=1e-4) for a, c in zip(got, want))


def test_hooks_unpack_multihead_attention_and_are_undone():
    """Under the hooks nn.MultiheadAttention's self-attention no longer sees query is key (it
    projects q, k and v apart, through the patched F.linear), with the same result; after
    the block F.linear and the module's hooks are as they were."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 4, 8)
    plain = mha(x, x, x)[0]
    calls = []
    original = F.linear
    with zero3.applied(mha):
        assert F.linear is zero3.linear
        patched = F.linear

        def counting(*a, **k):
            calls.append(a[0].shape)
            return patched(*a, **k)
        F.linear = counting
        try:
            hooked = mha(x, x, x)[0]
        finally:
            F.linear = patched
    assert F.linear is original and not mha._forward_pre_hooks
    assert len(calls) == 4               # q, k and v apart, then the output projection
    assert torch.allclose(plain, hooked, atol=1e-5)


def test_a_view_the_linear_saves_is_marked_on_its_parameter():
    """nn.MultiheadAttention under the hooks passes views of its packed in_proj_weight to
    F.linear; the stand-in marks that parameter's traced storage (the backward holds it after
    DeepSpeed releases it), and not the out projection's, passed whole."""
    from oomdoctor.sim.recorder import Category, Recorder
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 3, 8)
    rec = Recorder()
    with rec:
        h_in = rec.add(mha.in_proj_weight.untyped_storage(), Category.PARAMETERS, "parameter")
        h_out = rec.add(mha.out_proj.weight.untyped_storage(), Category.PARAMETERS, "parameter")
        with zero3.applied(mha, rec=rec):
            mha(x, x, x)[0].sum().backward()
    assert rec.storages[h_in].view_saved and not rec.storages[h_out].view_saved


# DeepSpeed's coordinator (oomdoctor.plans.parallel.zero3_coordinator) on
# ds_simple_transformer's modules at the held-out 1.4B size (hidden 2048, 24 layers): each
# layer's attention (its packed projection and, registered with it, out_proj), norm, the two
# feed-forward linears and norm, between the embeddings and the output projection.
def _ds_simple_modules(hidden=2048, layers=24, vocab=50000, seq=512):
    from oomdoctor.plans.parallel.zero3_coordinator import Module
    names, mods = [], []

    def module(block, *numels):
        params = []
        for name, n in numels:
            params.append((len(names), n))
            names.append(name)
        mods.append(Module(block, tuple(params)))
    module(-1, ("embedding", vocab * hidden))
    module(-1, ("pos", seq * hidden))
    for i in range(layers):
        h = hidden
        module(i, (f"{i}.in_proj", 3 * h * h), (f"{i}.in_bias", 3 * h), (f"{i}.out_proj", h * h),
               (f"{i}.out_bias", h))
        module(i, (f"{i}.norm1", h), (f"{i}.norm1_bias", h))
        module(i, (f"{i}.ff0", 4 * h * h), (f"{i}.ff0_bias", 4 * h))
        module(i, (f"{i}.ff2", 4 * h * h), (f"{i}.ff2_bias", h))
        module(i, (f"{i}.norm2", h), (f"{i}.norm2_bias", h))
    module(-1, ("output", vocab * hidden), ("output_bias", vocab))
    return names, mods


def test_the_coordinator_keeps_the_last_18_layers_as_measured():
    """Measured on an H200 (benchmarks/results/deepspeed/traces/zero3-bf16-offload-all-1.4b-*):
    after the second forward the last 18 of the 24 layers' weights stayed gathered. The
    coordinator's defaults (prefetch bucket 5e7, live and reuse limits 1e9) keep those 18,
    where the reuse distance alone would keep the last 10."""
    from oomdoctor.plans.parallel.zero3_coordinator import coordinate
    names, mods = _ds_simple_modules()
    n = len(mods)
    held = coordinate(mods + mods[::-1], 50_000_000, 1_000_000_000, 1_000_000_000)
    through = {names[h.handle].split(".")[0] for h in held
               if h.gathered < n and (h.released is None or h.released >= n)}
    layers = sorted(int(x) for x in through if x.isdigit())
    assert layers == list(range(6, 24))
    assert "output" in through and "embedding" not in through
    # every parameter is released by the end of the backward, each use gathered once
    assert all(h.released is not None for h in held)


def test_the_coordinator_while_it_records_keeps_nothing_and_prefetches_nothing():
    from oomdoctor.plans.parallel.zero3_coordinator import coordinate
    names, mods = _ds_simple_modules(hidden=64, layers=3, vocab=100, seq=8)
    steps = mods + mods[::-1]
    held = coordinate(steps, 50_000_000, 1_000_000_000, 1_000_000_000, complete=False)
    assert all(h.gathered == h.released for h in held)
    assert len(held) == 2 * sum(len(m.params) for m in mods)
    # with the trace recorded, a model under the reuse distance stays gathered throughout
    kept = coordinate(steps, 50_000_000, 1_000_000_000, 1_000_000_000)
    assert len(kept) == len(names) and all(h.released >= len(mods) for h in kept)


def test_a_checkpointed_block_is_fetched_again_for_its_recomputation():
    """Under activation checkpointing a block's forward runs again at the start of its
    backward, and its modules' forward hooks fetch again: DeepSpeed's trace has the block's
    modules in forward order, then in reverse; a block not checkpointed only in reverse."""
    from types import SimpleNamespace

    from oomdoctor.plans.parallel.layout import MAIN
    from oomdoctor.plans.parallel.zero3_coordinator import Module
    from oomdoctor.plans.parallel.zero3_gathers import _backward
    mods = [Module(MAIN, ((0, 10),), leading=True), Module(0, ((1, 5),)), Module(0, ((2, 5),)),
            Module(1, ((3, 5),)), Module(1, ((4, 5),)), Module(MAIN, ((5, 10),))]
    ctx = SimpleNamespace(trace=SimpleNamespace(checkpointed=("layers.1",)),
                          layout=SimpleNamespace(blocks=("layers.0", "layers.1")))
    order = [(mod.params[0][0], again) for mod, again in _backward(ctx, mods)]
    assert order == [(5, False), (3, True), (4, True), (4, False), (3, False), (2, False),
                     (1, False), (0, False)]


def test_a_tied_weight_is_fetched_again_by_its_other_module(monkeypatch):
    """gpt2_small ties lm_head.weight to wte.weight: DeepSpeed fetches that one parameter for
    the embedding at the forward's start and again for lm_head at its end (each module's
    own parameters, partitioned_param_coordinator.py), so the coordinator's module order has
    the tied weight in both (the layout's param_aliases)."""
    import oomdoctor.plans.parallel.zero3_gathers as gathers
    from click.testing import CliRunner

    from oomdoctor.cli import cli
    seen = []
    original = gathers._modules

    def spy(ctx, m, at):
        mods = original(ctx, m, at)
        seen.append([(mod.path, ctx.layout.param_names[ctx.param_index[h]])
                     for mod in mods for h, _ in mod.params])
        return mods
    monkeypatch.setattr(gathers, "_modules", spy)
    r = CliRunner().invoke(cli, ["parallel", "sample_models/gpt2_small.py", "--gpus", "2",
                                 "--strategy", "ds3", "-b", "1", "--gpu", "rtx3090", "--json"])
    assert r.exit_code == 0, r.output
    assert seen[0][0] == ("wte", "wte.weight")
    assert seen[0][-1] == ("lm_head", "wte.weight")
