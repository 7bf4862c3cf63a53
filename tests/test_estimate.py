"""estimate and probe: the budget, the breakdown, and the probe's boundary checked by direct traces."""
import os

import pytest

from oomdoctor.sim.allocator import AllocatorConfig, replay, round_size
from oomdoctor.plans.estimate import Budget, device_events, estimate, estimate_trace
from oomdoctor.sim.gpus import MiB, PROFILES, custom_profile, get_profile, parse_size
from oomdoctor.models.loader import load_model_file
from oomdoctor.plans.probe import _Extrapolation, default_matrix, matrix, probe, probe_config
from oomdoctor.sim.trace import TraceConfig, trace_training

ROOT = os.path.dirname(os.path.dirname(__file__))
MLP = load_model_file(os.path.join(ROOT, "sample_models", "tiny_mlp.py"))
LORA = os.path.join(ROOT, "sample_models", "lora_gpt.py")


def small_card(total_mib: int) -> Budget:
    return Budget(custom_profile(total_mib * MiB), margin=0.0, context_bytes=0)


def test_budget_arithmetic():
    b = Budget(get_profile("rtx3090"), margin=0.05, context_bytes=500 * MiB, other_bytes=MiB)
    total = get_profile("rtx3090").total_bytes
    assert b.limit_bytes == total - 500 * MiB - MiB - int(0.05 * total)
    assert Budget(custom_profile(10 * MiB), context_bytes=20 * MiB).limit_bytes == 0


def test_profiles_cover_the_design_card():
    for name in ("rtx3060-12", "rtx3090", "rtx4090", "a10", "l4", "t4", "v100-16", "v100-32",
                 "a100-40", "a100-80", "h100-80", "a6000"):
        p = PROFILES[name]
        assert p.total_bytes > p.context_bytes > 0 and p.tflops_16 > 0 and p.interconnect
        # bf16 tensor cores come with compute capability 8.0.
        assert p.bf16 == (p.compute_capability >= (8, 0))
    # The capacity CUDA reports for a "24 GB" RTX 3090 is 23.69 GiB (OOM messages).
    assert f"{PROFILES['rtx3090'].total_bytes / 2**30:.2f}" == "23.69"


def test_parse_size():
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("1.5 MiB") == 1572864
    assert parse_size("512") == 512
    with pytest.raises(ValueError, match="ambiguous"):
        parse_size("24GB")


def test_breakdown_sums_and_model_state_is_exact():
    e = estimate(MLP, TraceConfig(64), small_card(1024))
    assert sum(e.breakdown.values()) == e.peak_reserved_bytes + e.breakdown["cuda_context"]
    assert e.peak_reserved_bytes >= e.peak_allocated_bytes
    # tiny_mlp: 399,370 fp32 parameters (sample_models/README.md).
    assert e.parameter_bytes == 399_370 * 4
    assert e.gradient_bytes == 399_370 * 4
    assert e.optimizer_state_bytes == 2 * 399_370 * 4          # AdamW exp_avg + exp_avg_sq


def test_allocated_peak_is_rounded_live_peak():
    """max_memory_allocated counts 512-byte-rounded blocks (plus unsplit remainders): it is at
    least the rounded live peak and at most a segment-rounding above it."""
    trace = trace_training(MLP, TraceConfig(64))
    e = estimate_trace(trace, small_card(1024))
    rounded = live = 0
    for is_alloc, _, n in device_events(trace, custom_profile(MiB)).events:
        live += round_size(n) if is_alloc else -round_size(n)
        rounded = max(rounded, live)
    assert rounded <= e.peak_allocated_bytes <= rounded + 2 * MiB * 4


def test_probe_boundary_matches_direct_traces():
    """The probe's answer b must fit and b+1 must not, each checked by its own trace."""
    budget = small_card(40)
    r = probe_config(MLP, TraceConfig(1), budget)
    b = r.max_batch_size
    assert b is not None and b > 2
    assert estimate(MLP, TraceConfig(b), budget).fits
    assert not estimate(MLP, TraceConfig(b + 1), budget).fits
    assert [t.method for t in r.trials].count("traced") == 3   # batch 1, 2 and the answer


def test_extrapolated_events_equal_a_trace():
    spec = load_model_file(LORA)
    t1, t2, t5 = (trace_training(spec, TraceConfig(b)) for b in (1, 2, 5))
    ext = _Extrapolation(t1, t2)
    assert [n for _, _, n in t5.events] == ext.sizes(5)


def test_nothing_fits():
    r = probe_config(MLP, TraceConfig(1), small_card(2))
    assert r.max_batch_size is None and r.estimate is not None and not r.estimate.fits


def test_probe_matrix_and_parallel_workers_agree():
    budget = small_card(64)
    configs = [("fp32", False), ("bf16", False)]
    serial = probe(MLP, TraceConfig(1), budget, configs, jobs=1)
    forked = probe(MLP, TraceConfig(1), budget, configs, jobs=2)
    assert [r.max_batch_size for r in serial.results] == [r.max_batch_size for r in forked.results]
    assert default_matrix(False) == [("fp32", False), ("fp32", True), ("fp16", False),
                                     ("fp16", True)]
    assert len(default_matrix(True)) == 8
    # pure fp16 only when named, and on any card (fp16 needs no compute capability 8.0)
    assert all(p != "fp16-pure" for p, _ in default_matrix(True) + default_matrix(False))
    assert matrix(get_profile("t4"), ["fp16-pure"]) == [("fp16-pure", False), ("fp16-pure", True)]
    with pytest.raises(ValueError, match=r"no bf16 support; drop --precision bf16-pure .*fp16"):
        matrix(get_profile("t4"), ["bf16-pure"])


def test_fp16_pure_on_a_card_without_bf16_holds_2_2_4_bytes_per_parameter():
    """model.half() on a T4 (compute capability 7.5): fp16 weights and gradients, AdamW's
    exp_avg and exp_avg_sq in fp16 - 2 + 2 + 2 x 2 bytes per parameter. tiny_mlp's count from
    its layers: Linear(256, 512), Linear(512, 512), Linear(512, 10), weights and biases."""
    n = (256 * 512 + 512) + (512 * 512 + 512) + (512 * 10 + 10)
    e = estimate(MLP, TraceConfig(8, precision="fp16-pure"), Budget(get_profile("t4")))
    b = e.breakdown
    assert (b["parameters"], b["gradients"], b["optimizer_state"]) == (2 * n, 2 * n, 4 * n)
    assert e.fits and e.peak_phase == "optimizer"
    with pytest.raises(ValueError, match="t4 has no bf16 support.*fp16-pure"):
        estimate(MLP, TraceConfig(8, precision="bf16-pure"), Budget(get_profile("t4")))


def test_checkpointing_without_repeated_blocks_is_reported():
    r = probe(MLP, TraceConfig(1), small_card(64), [("fp32", True)], jobs=1)
    # tiny_mlp is one Sequential of distinct layers: either it finds repeated Linear layers or
    # it says why it cannot checkpoint; it never crashes the probe.
    assert r.results[0].error is None or "repeated blocks" in r.results[0].error


def test_expandable_segments_never_reserve_more_here():
    trace = trace_training(load_model_file(LORA), TraceConfig(4, precision="bf16"))
    plain = estimate_trace(trace, small_card(8192))
    expandable = estimate_trace(trace, small_card(8192), AllocatorConfig(expandable_segments=True))
    # Expandable segments split any block (remainder >= 512 B), so no unsplit remainders are
    # counted as allocated either.
    assert expandable.peak_allocated_bytes <= plain.peak_allocated_bytes
    assert expandable.peak_reserved_bytes <= plain.peak_reserved_bytes
    assert expandable.breakdown["allocator_overhead"] < plain.breakdown["allocator_overhead"]


def test_bf16_refused_on_cards_without_it():
    with pytest.raises(ValueError, match="no bf16 support"):
        estimate(MLP, TraceConfig(8, precision="bf16"), Budget(get_profile("t4")))


def test_oom_retry_frees_cache_instead_of_failing():
    """Under a tight limit the allocator releases cached segments and retries, as PyTorch does:
    a budget just above the unlimited run's peak allocated (but below its peak reserved) can
    still fit."""
    trace = trace_training(load_model_file(LORA), TraceConfig(4))
    dev = device_events(trace, custom_profile(MiB)).events
    free_run = replay(dev)
    assert free_run.peak_reserved_bytes >= free_run.peak_allocated_bytes
    tight = replay(dev, limit_bytes=free_run.peak_reserved_bytes)
    assert tight.oom is None


@pytest.mark.parametrize("mode,grads_alive", [("after-step", False), ("after-forward", True),
                                              ("in-place", True)])
def test_zero_grad_modes(mode, grads_alive):
    """Where the loop drops gradients decides whether last step's gradients (4 B x 399,370
    tiny_mlp parameters) are alive during the second step's forward."""
    from oomdoctor.sim.trace import Category, Phase
    tr = trace_training(MLP, TraceConfig(64, zero_grad=mode))
    fwd2 = next(m for m in tr.marks if m.phase is Phase.FORWARD and m.iteration == 1)
    live = sum(s.nbytes for s in tr.live_at(fwd2.start) if s.category is Category.GRADIENTS)
    assert live == (4 * 399_370 if grads_alive else 0)


def test_spliced_optimizer_steps_equal_a_full_trace():
    """The probe reuses the batch-1 trace's optimizer steps at other batch sizes: the result must
    be exactly what running step() gives."""
    from oomdoctor.sim.trace import SpliceMismatch
    spec = load_model_file(LORA)
    t1 = trace_training(spec, TraceConfig(1, precision="fp16"))
    full = trace_training(spec, TraceConfig(3, precision="fp16"))
    spliced = trace_training(spec, TraceConfig(3, precision="fp16"), optimizer_from=t1)
    assert spliced.events == full.events
    assert spliced.optimizer_state_bytes == full.optimizer_state_bytes
    assert {h: s.category for h, s in spliced.storages.items()} == \
        {h: s.category for h, s in full.storages.items()}
    # A trace of another configuration does not line up and says so.
    with pytest.raises(SpliceMismatch):
        trace_training(spec, TraceConfig(3, precision="fp32", checkpointing=True),
                       optimizer_from=t1)


def test_probe_with_strategies_orders_as_the_memory_does():
    """DDP never lowers per-GPU memory (each rank holds the model plus a bucket copy of the
    gradients), so its largest micro-batch is at most the single GPU's; ZeRO-3 shards the model
    state, so its largest micro-batch is at least the single GPU's. Each answer is checked by
    the strategy estimate of its own trace: b fits, b + 1 does not. (On a card of a few tens
    of MiB it need not: FSDP2's all-gather and reduce-scatter buffers live on their own streams,
    each a segment of at least 20 MiB that the default stream cannot use; tiny_mlp on 48 MiB
    gets 512 under ZeRO-3 and 640 on one GPU.)"""
    from oomdoctor.plans import parallel as par
    from oomdoctor.plans.probe import probe_strategy
    budget = small_card(160)
    single = probe_config(MLP, TraceConfig(1), budget).max_batch_size
    ddp = probe_strategy(MLP, TraceConfig(1), budget, "ddp", 2)
    zero3 = probe_strategy(MLP, TraceConfig(1), budget, "zero3", 2)
    assert ddp.max_batch_size <= single <= zero3.max_batch_size
    layout = par.model_layout(MLP)
    for r, name in ((ddp, "ddp"), (zero3, "zero3")):
        b = r.max_batch_size
        at = [par.estimate_strategy(trace_training(MLP, TraceConfig(x)), layout,
                                    par.Strategy(name, 2), budget).fits for x in (b, b + 1)]
        assert at == [True, False], (name, b)
