"""Plans that do what they say: the launch snippet and environment a user copies.

Each snippet is compiled (valid Python) and checked for the detail that made it wrong before:
DataParallel scatters the loader batch over the GPUs, so the loader must load micro-batch x
GPUs; the non-distributed snippets used DataLoader without importing it; DataParallel on a board
without P2P is the seed users' hang; OMP_NUM_THREADS planned on a laptop is the laptop's.
"""
from __future__ import annotations

from pathlib import Path

from oomdoctor.plans import recommend as rec
from oomdoctor.sim.gpus import get_profile
from oomdoctor.models.loader import load_model_file

MLP = load_model_file(str(Path(__file__).resolve().parent.parent / "sample_models" / "tiny_mlp.py"))
RTX3090 = get_profile("rtx3090")


def _candidate(**kw):
    """test_recommend's candidate, as DataParallel at bf16 with micro-batch 128 by default."""
    from test_recommend import _candidate as candidate
    return candidate(**{**dict(strategy="dp", precision="bf16", checkpointing=False,
                               micro_batch=128, grad_accum=1), **kw})


def _launch(c, link="pcie-no-p2p", detected=False):
    hw = rec.Hardware(RTX3090, c.num_gpus, link, 12.5, cores=16, detected=detected)
    return rec._launch(c, hw, MLP, rec._Facts(10, 10, 2, False, "layers"))


def test_dataparallel_loads_the_micro_batch_of_every_gpu():
    s = _launch(_candidate()).snippet
    assert "batch_size=256" in s and "128 per GPU x 2 GPUs" in s
    assert "from torch.utils.data import DataLoader" in s
    compile(s, "snippet", "exec")


def test_dataparallel_on_a_board_without_p2p_says_it_can_hang():
    assert "broadcast_coalesced" in _launch(_candidate(), link="pcie-no-p2p").snippet
    assert "broadcast_coalesced" not in _launch(_candidate(), link="pcie").snippet


def test_single_gpu_snippet_imports_what_it_uses():
    s = _launch(_candidate(strategy="single", num_gpus=1, effective_batch=128)).snippet
    assert "from torch.utils.data import DataLoader" in s and "batch_size=128" in s
    compile(s, "snippet", "exec")


def test_omp_threads_planned_elsewhere_are_said_to_be_this_machines():
    lc = _launch(_candidate(strategy="ddp"), detected=False)
    assert lc.env["OMP_NUM_THREADS"] == "8"
    assert "this machine's 16 cores / 2 processes" in lc.env_note
    assert _launch(_candidate(strategy="ddp"), detected=True).env_note == ""


def test_amp_is_the_plan_even_when_pure_bf16_is_faster_and_the_note_says_why():
    from oomdoctor.plans.recommend.search import faster_pure_bf16_note, rank
    amp = _candidate(strategy="ddp", precision="bf16", step_seconds=2.0, score=2.0)
    pure = _candidate(strategy="ddp", precision="bf16-pure", step_seconds=1.0, score=1.25)
    ranked = rank([pure, amp])
    assert [c.precision for c in ranked] == ["bf16", "bf16-pure"]
    note = faster_pure_bf16_note(ranked[0], ranked)
    assert "would step 2.0x faster" in note and "not neutral" in note and "keeps bf16" in note
    assert rank([pure])[0] is pure                       # the plan when nothing else fits
    assert faster_pure_bf16_note(amp, [amp]) is None


def test_recommend_prints_a_dataparallel_plan_that_does_what_it_says():
    from click.testing import CliRunner

    from oomdoctor.cli import EXIT_OK, cli
    r = CliRunner().invoke(cli, ["recommend", MLP.path, "--gpu", "rtx3090", "--gpus", "2",
                                 "--strategy", "dp", "--link", "pcie-no-p2p", "--quick", "-j",
                                 "1", "--precision", "bf16", "--target-batch", "256"])
    assert r.exit_code == EXIT_OK, r.output
    out = r.stdout
    assert "RECOMMENDED: dp on 2 GPU(s), bf16, micro-batch 128 x 1" in out
    assert "batch_size=256" in out and "128 per GPU x 2 GPUs" in out
    assert "from torch.utils.data import DataLoader" in out
    assert "(broadcast_coalesced) can hang or crawl here" in out
    assert "on the training server use its cores" in out


def test_pure_fp16_ranks_after_pure_bf16_and_its_plan_guards_adamw():
    from oomdoctor.plans.recommend.search import faster_pure_bf16_note, rank
    amp = _candidate(strategy="ddp", precision="fp16", step_seconds=2.0, score=2.0)
    bf16 = _candidate(strategy="ddp", precision="bf16-pure", step_seconds=1.0, score=1.25)
    fp16 = _candidate(strategy="ddp", precision="fp16-pure", step_seconds=0.5, score=0.625)
    assert [c.precision for c in rank([fp16, bf16, amp])] == ["fp16", "bf16-pure", "fp16-pure"]
    note = faster_pure_bf16_note(amp, [amp, fp16])
    assert note.startswith("pure fp16 (ddp") and "loss scaling" in note
    lc = _launch(_candidate(strategy="single", num_gpus=1, precision="fp16-pure",
                            effective_batch=128))
    s = lc.snippet
    assert "model = model.half()" in s and "GradScaler(" not in s and "autocast" not in s
    assert "g['eps'] = 1e-4" in s and "t.to(torch.float16)" in s
    compile(s, "snippet", "exec")
    assert any("riskiest precision" in q for q in lc.quality_notes)


def test_the_pure_fp16_quality_note_is_what_torch_does():
    """The note's claims, on real fp16 tensors: AdamW's default eps is 0 in fp16, so a gradient
    of 1e-3 (second moment 1e-9: underflows) sends its weight to -inf and a zero gradient to
    NaN; eps=1e-4 keeps both finite. fp16's range: 65504 and 6e-8."""
    import torch
    assert torch.finfo(torch.float16).max == 65504
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0.0
    assert torch.tensor(6e-8, dtype=torch.float16).item() > 0.0
    for eps, finite in ((1e-8, False), (1e-4, True)):
        w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
        opt = torch.optim.AdamW([w], lr=1e-3, eps=eps)
        w.grad = torch.tensor([1e-3, 0.0], dtype=torch.float16)
        opt.step()
        assert bool(torch.isfinite(w).all()) is finite, (eps, w)
        if not finite:
            assert w[0].item() == float("-inf") and torch.isnan(w[1])
