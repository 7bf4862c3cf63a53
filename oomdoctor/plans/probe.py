"""The largest batch that fits, per configuration, with as few traces as possible.

    oomdoctor probe sample_models/gpt2_small.py --gpu rtx3090

A static training step runs the same ops at every batch size; only tensor sizes change, and each
storage's size is affine in the batch size (``B * T * C * 4`` and the like). So two traces, at
batch 1 and 2, give every allocation's size at any batch: ``size(b) = s1 + (s2 - s1) * (b - 1)``.
The allocator is then replayed on those extrapolated events - milliseconds per batch size - to
find the boundary by doubling and bisection, and one more trace at the predicted maximum checks
that the extrapolation is exact there. Models whose ops change with the batch size (or whose sizes
are not affine) fall back to tracing every trial, Lightning-tuner style: double, then bisect.
"""
from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import as_completed
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.configs import MAX_BATCH, needs_bf16, no_bf16_fix
from oomdoctor.plans.estimate import Budget, Estimate, allocator_conf_string, estimate_trace, trace_for
from oomdoctor.sim.gpus import GpuProfile
from oomdoctor.models.spec import ModelSpec
from oomdoctor.plans.workers import forked_pool
from oomdoctor.sim.trace import SpliceMismatch, Trace, TraceConfig

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Trial:
    batch_size: int
    fits: bool
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    method: str             # "traced" or "extrapolated" (allocator replay on extrapolated sizes)


@dataclass(frozen=True)
class ConfigResult:
    precision: str
    checkpointing: bool
    max_batch_size: int | None          # None: even batch 1 does not fit
    estimate: Estimate | None           # at max_batch_size (at batch 1 when nothing fits)
    trials: tuple[Trial, ...]
    capped: bool = False                # the search stopped at MAX_BATCH
    error: str | None = None            # why this configuration could not be probed
    per_gpu: Any = None                 # with --strategy: the parallel.StrategyEstimate there

    def to_json(self) -> dict[str, Any]:
        e = self.estimate
        if self.per_gpu is not None or (e is None and self.error is None and self.trials):
            return {"precision": self.precision, "checkpointing": self.checkpointing,
                    "max_batch_size": self.max_batch_size, "capped": self.capped,
                    "error": self.error, "strategy": self.per_gpu and self.per_gpu.to_json(),
                    "trials": [vars(t) for t in self.trials]}
        return {
            "precision": self.precision, "checkpointing": self.checkpointing,
            "max_batch_size": self.max_batch_size,
            "peak_allocated_bytes": e.peak_allocated_bytes if e else None,
            "peak_reserved_bytes": e.peak_reserved_bytes if e else None,
            "breakdown": e.breakdown if e else None,
            "peak_phase": e.peak_phase if e else None,
            "capped": self.capped, "error": self.error,
            "trials": [vars(t) for t in self.trials],
        }


@dataclass(frozen=True)
class AllocatorGain:
    """A larger micro-batch for the recommended configuration from an allocator setting."""
    setting: str                # the PYTORCH_CUDA_ALLOC_CONF value that buys it
    batch_size: int             # the recommended configuration's max batch with it
    default_batch_size: int     # ... with the setting the table assumes
    overhead_bytes: int         # allocator overhead at batch_size with the setting


@dataclass(frozen=True)
class ProbeResult:
    model: str
    gpu: str
    device_total_bytes: int
    budget_bytes: int
    margin: float
    grad_accum: int
    results: tuple[ConfigResult, ...]
    allocator: str = ""                      # the PYTORCH_CUDA_ALLOC_CONF the numbers assume
    allocator_gain: AllocatorGain | None = None

    @property
    def traced_with(self) -> tuple[tuple[str, str], ...]:
        """The library releases the traces ran (the same for every configuration)."""
        return next((c.estimate.traced_with for c in self.results if c.estimate), ())

    def to_json(self) -> dict[str, Any]:
        best = recommended(self)
        ck = checkpointing_effect(self)
        return {"model": self.model, "gpu": self.gpu,
                "device_total_bytes": self.device_total_bytes,
                "budget_bytes": self.budget_bytes, "margin": self.margin,
                "grad_accum": self.grad_accum,
                "allocator": self.allocator or None,
                "allocator_gain": None if self.allocator_gain is None else vars(self.allocator_gain),
                "results": [r.to_json() for r in self.results],
                "traced_with": dict(self.traced_with),
                "checkpointing": ck.to_json() if ck is not None else None,
                "recommended": None if best is None else {
                    "precision": best.precision, "checkpointing": best.checkpointing,
                    "batch_size": best.max_batch_size, "capped": best.capped,
                    "batch_size_meaning": ("at least this: the search cap (--max-batch-size), "
                                           "not the largest that fits") if best.capped
                    else "the largest that fits"}}


def _pattern(trace: Trace) -> list[tuple[bool, int]]:
    return [(a, h) for a, h, _ in trace.events]


def _trace(spec: ModelSpec, cfg: TraceConfig, budget: Budget, ref: Trace | None) -> Trace:
    """Trace ``cfg``, reusing the optimizer steps of the batch-1 trace when they line up."""
    if ref is not None:
        try:
            return trace_for(spec, cfg, budget.gpu, optimizer_from=ref)
        except SpliceMismatch:
            pass
    return trace_for(spec, cfg, budget.gpu)


BASE = 2   # the probe's first trace; its optimizer steps are spliced into the others


class _Extrapolation:
    """Per-event affine sizes from traces at batch ``base`` and ``base + 1``."""

    def __init__(self, ta: Trace, tb: Trace, base: int = 1) -> None:
        self.base = base
        self.s1 = [n for _, _, n in ta.events]
        self.d = [n2 - n1 for (_, _, n1), (_, _, n2) in zip(ta.events, tb.events)]

    def sizes(self, b: int) -> list[int]:
        k = b - self.base
        return [max(0, s + d * k) for s, d in zip(self.s1, self.d)]


def probe_config(spec: ModelSpec, cfg: TraceConfig, budget: Budget,
                 alloc: AllocatorConfig = AllocatorConfig(),
                 progress: Progress = lambda _: None, max_batch: int = MAX_BATCH
                 ) -> ConfigResult:
    """Largest batch size of ``cfg`` (its batch_size is ignored) that fits ``budget``."""
    label = f"{cfg.precision}{' + checkpointing' if cfg.checkpointing else ''}"
    trials: list[Trial] = []
    traces: dict[int, Trace] = {}
    estimates: dict[int, Estimate] = {}

    def traced(b: int) -> Estimate:
        if b not in estimates:
            progress(f"{label}: tracing batch size {b}")
            traces[b] = _trace(spec, replace(cfg, batch_size=b), budget, traces.get(BASE))
            e = estimates[b] = estimate_trace(traces[b], budget, alloc, spec.name)
            trials.append(Trial(b, e.fits, e.peak_allocated_bytes, e.peak_reserved_bytes,
                                "traced"))
            progress(f"{label}: batch size {b} {'fits' if e.fits else 'does not fit'} "
                     f"({e.peak_reserved_bytes / 2**30:.2f} GiB reserved)")
        return estimates[b]

    def result(best: int | None, capped: bool = False) -> ConfigResult:
        est = traced(best if best is not None else 1)
        return ConfigResult(cfg.precision, cfg.checkpointing, best, est, tuple(trials), capped)

    # Batch 1 is a special case for strides (a size-1 dimension makes some transposes
    # contiguous, so a .contiguous() copies at B >= 2 but not at B = 1): extrapolate from 2 and 3.
    if not traced(BASE).fits:
        return result(1 if traced(1).fits else None)
    if max_batch <= BASE or not traced(BASE + 1).fits:
        return result(BASE)
    lo = BASE + 1
    if _pattern(traces[BASE]) == _pattern(traces[lo]):
        ext = _Extrapolation(traces[BASE], traces[lo], BASE)

        def fits(b: int) -> bool:
            e = estimate_trace(traces[BASE], budget, alloc, spec.name, sizes=ext.sizes(b),
                               batch=b)
            trials.append(Trial(b, e.fits, e.peak_allocated_bytes, e.peak_reserved_bytes,
                                "extrapolated"))
            return e.fits
        best, capped = _search(fits, lo, max_batch)
        if best == lo:
            return result(best, capped)
        # Check the extrapolation where it matters: trace the predicted maximum.
        e = traced(best)
        exact = (_pattern(traces[best]) == _pattern(traces[BASE])
                 and [n for _, _, n in traces[best].events] == ext.sizes(best))
        if exact and e.fits:
            return result(best, capped)
        progress(f"{label}: extrapolation was not exact at batch {best}; tracing around it")
        best, capped = _search_near(lambda b: traced(b).fits, best, lo, max_batch)
        return result(best, capped)
    progress(f"{label}: the ops change with the batch size; tracing each trial")
    best, capped = _search(lambda b: traced(b).fits, lo, max_batch)
    return result(best, capped)


def _search_near(fits: Callable[[int], bool], guess: int, lo: int, max_batch: int
                 ) -> tuple[int, bool]:
    """Largest b with fits(b), given fits(lo) and a good guess: gallop from the guess, then
    bisect - a few trials when the guess is close."""
    if fits(guess):
        lo, step = guess, 1
        while lo + step <= max_batch and fits(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
        if hi > max_batch:
            return (lo, True) if lo == max_batch else _bisect(fits, lo, max_batch + 1)
        return _bisect(fits, lo, hi)
    hi, step = guess, 1
    while hi - step > lo and not fits(hi - step):
        hi, step = hi - step, step * 2
    return _bisect(fits, max(lo, hi - step), hi)


def bisect_largest(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest b in [lo, hi) with fits(b), given fits(lo) and not fits(hi) (the measured probe
    in measure.py searches with it too)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> tuple[int, bool]:
    return bisect_largest(fits, lo, hi), False


def _search(fits: Callable[[int], bool], lo: int, max_batch: int) -> tuple[int, bool]:
    """Largest b in [lo, max_batch] with fits(b), given fits(lo): double, then bisect."""
    hi = lo * 2
    while hi <= max_batch and fits(hi):
        lo, hi = hi, hi * 2
    if hi > max_batch:
        if lo < max_batch and fits(max_batch):
            return max_batch, True
        hi = max_batch
    return _bisect(fits, lo, hi)


def default_matrix(bf16: bool) -> list[tuple[str, bool]]:
    """The design card's matrix: fp32, fp16 AMP, bf16 AMP, pure bf16 x checkpointing off/on.
    Pure fp16 only with --precision fp16-pure: two more traced configurations per probe for a
    precision that holds the bytes of pure bf16 with a riskier range (configs.PURE_QUALITY)."""
    precisions = ["fp32", "fp16"] + (["bf16", "bf16-pure"] if bf16 else [])
    return [(p, ck) for p in precisions for ck in (False, True)]


def matrix(gpu: GpuProfile, precisions: Sequence[str] = (),
           checkpointing: bool | None = None) -> list[tuple[str, bool]]:
    """The configurations to probe: the default matrix, or these precisions; with or without
    checkpointing only when ``checkpointing`` says. bf16 on a card without it is a ValueError."""
    configs = default_matrix(gpu.bf16)
    if precisions:
        bad = [p for p in precisions if needs_bf16(p) and not gpu.bf16]
        if bad:
            raise ValueError(f"{gpu.name} has no bf16 support; drop --precision {bad[0]} "
                             f"({no_bf16_fix(bad[0]).removeprefix('use ')} instead)")
        configs = [(p, ck) for p in precisions for ck in (False, True)]
    if checkpointing is not None:
        configs = [(p, ck) for p, ck in configs if ck == checkpointing]
    return configs


def probe_strategy(spec: ModelSpec, cfg: TraceConfig, budget: Budget, strategy: str,
                   num_gpus: int, alloc: AllocatorConfig = AllocatorConfig(),
                   progress: Progress = lambda _: None, max_batch: int = MAX_BATCH,
                   mixed_precision: bool = False, cpu_offload: bool = False) -> ConfigResult:
    """Largest micro-batch per GPU of a multi-GPU strategy: traces at batch 2 and 3 give every
    storage's size at any batch (parallel.Sizes.affine); each trial replays the strategy's
    per-GPU event lists; the answer is checked with a trace of its own. ``mixed_precision``:
    FSDP2's bf16 MixedPrecisionPolicy (zero3), traced as it computes, in pure bf16;
    ``cpu_offload``: FSDP2's CPUOffloadPolicy (zero3)."""
    from oomdoctor.plans import parallel as par
    label = f"{strategy} x{num_gpus}, {cfg.precision}{' + checkpointing' if cfg.checkpointing else ''}"
    # the policy is bf16's: the other rows of a probe's matrix run as they are
    st = par.Strategy(par.parse_strategy(strategy), num_gpus,
                      mixed_precision=mixed_precision and cfg.precision == "bf16",
                      cpu_offload=cpu_offload)
    precision = cfg.precision
    cfg = par.trace_config(st, cfg)
    layout = par.model_layout(spec, cfg.precision)
    exact: dict[int, Trace] = {}
    trials: list[Trial] = []
    found: dict[int, Any] = {}

    def traced(b: int) -> Trace:
        if b not in exact:
            progress(f"{label}: tracing batch size {b}")
            exact[b] = trace_for(spec, replace(cfg, batch_size=b), budget.gpu)
        return exact[b]

    sizes = par.Sizes.affine(traced(BASE), traced(BASE + 1))

    def fits(b: int, method: str | None = None) -> bool:
        if sizes is not None and b >= BASE and method is None:
            e, how = par.estimate_strategy(exact[BASE], layout, st, budget, alloc, sizes,
                                           batch=b), "extrapolated"
        else:
            e, how = par.estimate_strategy(traced(b), layout, st, budget, alloc), "traced"
        found[b] = e
        peak = e.peak_device_bytes
        trials.append(Trial(b, e.fits, peak, peak, how))
        return e.fits

    if not fits(BASE, "traced"):
        best = 1 if fits(1, "traced") else None
        return ConfigResult(precision, cfg.checkpointing, best, None, tuple(trials),
                            per_gpu=found[best or 1])
    best, capped = _search(fits, BASE, max_batch)
    if best > BASE + 1 and not fits(best, "traced"):   # the check trace disagrees: walk down
        best, capped = _search_near(lambda b: fits(b, "traced"), best - 1, BASE, max_batch)
    return ConfigResult(precision, cfg.checkpointing, best, None, tuple(trials), capped,
                        per_gpu=found[best])


def _probe_one(spec: ModelSpec, cfg: TraceConfig, budget: Budget, alloc: AllocatorConfig,
               progress: Progress, max_batch: int, strategy: str = "single",
               num_gpus: int = 1, mixed_precision: bool = False,
               cpu_offload: bool = False) -> ConfigResult:
    try:
        if strategy != "single":
            return probe_strategy(spec, cfg, budget, strategy, num_gpus, alloc, progress,
                                  max_batch, mixed_precision, cpu_offload)
        return probe_config(spec, cfg, budget, alloc, progress, max_batch)
    except ValueError as e:   # e.g. no repeated blocks to checkpoint
        return ConfigResult(cfg.precision, cfg.checkpointing, None, None, (), error=str(e))


# The spec of the probe in progress, inherited by forked workers: the model file's functions
# live in a module made at run time, which pickle cannot send to a worker by name.
_WORKER_SPEC: ModelSpec | None = None


def _worker(cfg: TraceConfig, budget: Budget, alloc: AllocatorConfig, max_batch: int,
            strategy: str = "single", num_gpus: int = 1,
            mixed_precision: bool = False, cpu_offload: bool = False) -> ConfigResult:
    assert _WORKER_SPEC is not None
    return _probe_one(_WORKER_SPEC, cfg, budget, alloc, lambda _: None, max_batch, strategy,
                      num_gpus, mixed_precision, cpu_offload)


def default_jobs() -> int:
    """Worker processes for a probe: one per core (traces are single-threaded Python)."""
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1, 8))


def probe(spec: ModelSpec, base: TraceConfig, budget: Budget,
          configs: list[tuple[str, bool]], alloc: AllocatorConfig = AllocatorConfig(),
          progress: Progress = lambda _: None, max_batch: int = MAX_BATCH,
          jobs: int = 1, strategy: str = "single", num_gpus: int = 1,
          mixed_precision: bool = False, cpu_offload: bool = False) -> ProbeResult:
    """Probe every (precision, checkpointing) configuration, in ``jobs`` processes
    (``mixed_precision``, ``cpu_offload``: zero3 under FSDP2's bf16 policy, CPU offload;
    probe_strategy)."""
    global _WORKER_SPEC
    cfgs = [replace(base, precision=p, checkpointing=ck, batch_size=1) for p, ck in configs]
    results: list[ConfigResult | None] = [None] * len(cfgs)
    if jobs > 1 and len(cfgs) > 1 and "fork" in multiprocessing.get_all_start_methods():
        _WORKER_SPEC = spec
        try:
            with forked_pool(min(jobs, len(cfgs))) as pool:
                futures = {pool.submit(_worker, c, budget, alloc, max_batch, strategy,
                                       num_gpus, mixed_precision, cpu_offload): i
                           for i, c in enumerate(cfgs)}
                progress(f"probing {len(cfgs)} configurations in {min(jobs, len(cfgs))} "
                         "processes")
                for fut in as_completed(futures):
                    r = results[futures[fut]] = fut.result()
                    label = f"{r.precision}{' + checkpointing' if r.checkpointing else ''}"
                    found = (f"max batch size {r.max_batch_size}" if r.max_batch_size
                             else "does not fit even at batch 1")
                    progress(f"{label}: {found} "
                             f"({sum(t.method == 'traced' for t in r.trials)} traces)")
        finally:
            _WORKER_SPEC = None
    else:
        for i, c in enumerate(cfgs):
            results[i] = _probe_one(spec, c, budget, alloc, progress, max_batch, strategy,
                                    num_gpus, mixed_precision, cpu_offload)
    result = ProbeResult(spec.name, budget.gpu.name, budget.gpu.total_bytes,
                         budget.limit_bytes, budget.margin, base.grad_accum, tuple(results),
                         allocator_conf_string(alloc))
    if strategy != "single" or recommended(result) is None or alloc.expandable_segments:
        return result
    progress("checking what expandable segments would buy the recommended configuration")
    return replace(result, allocator_gain=allocator_gain(spec, result, base, budget, alloc,
                                                         max_batch))


def allocator_gain(spec: ModelSpec, r: ProbeResult, base: TraceConfig, budget: Budget,
                   alloc: AllocatorConfig, max_batch: int = MAX_BATCH) -> AllocatorGain | None:
    """What expandable segments would buy the recommended configuration, when the probe
    assumed they are off and they allow a larger micro-batch (one more probe of that one
    configuration). Fragmentation left between the caching allocator's fixed-size segments is
    what they remove (docs: "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF")."""
    best = recommended(r)
    if best is None or best.capped or alloc.expandable_segments:
        return None
    # No setting of the allocator makes room where one sample more needs more than the budget
    # in allocated bytes alone (its trial replayed without the limit): skip the second probe.
    one_more = next((t for t in best.trials if t.batch_size == best.max_batch_size + 1), None)
    if one_more is not None and one_more.peak_allocated_bytes > budget.limit_bytes:
        return None
    cfg = replace(base, precision=best.precision, checkpointing=best.checkpointing, batch_size=1)
    other = probe_config(spec, cfg, budget, replace(alloc, expandable_segments=True),
                         max_batch=max_batch)
    if not other.max_batch_size or other.max_batch_size <= best.max_batch_size:
        return None
    return AllocatorGain(allocator_conf_string(replace(alloc, expandable_segments=True)),
                         other.max_batch_size, best.max_batch_size,
                         other.estimate.breakdown["allocator_overhead"])


_CKPT_NOTE = re.compile(r"^checkpointing (\d+) blocks of class (\S+)$")
# Below this share of the activations (per sample) freed, checkpointing is not worth the third
# more compute it costs.
CKPT_WORTH = 0.05


@dataclass(frozen=True)
class CheckpointingEffect:
    """Which blocks the checkpointed configurations wrapped, and what that freed."""

    block_class: str
    blocks: int
    # (precision, share of the activation memory per sample that checkpointing frees), from
    # the estimates at each configuration's largest batch: activations grow with the batch, so
    # per sample they compare configurations searched to different batch sizes.
    frees: tuple[tuple[str, float], ...]
    every: int = 1                  # every N-th block (--checkpoint-every)
    policy: str = "full"            # whole blocks or per op (--checkpoint-policy)

    def to_json(self) -> dict[str, Any]:
        return {"class": self.block_class, "blocks": self.blocks,
                "frees_activations_per_sample": dict(self.frees), "every": self.every,
                "policy": self.policy}


def checkpointing_effect(r: ProbeResult) -> CheckpointingEffect | None:
    """The checkpointed class, and per precision the share of the saved activations (per
    sample) that checkpointing it frees."""
    found = None
    for c in r.results:
        for n in (c.estimate.notes if c.checkpointing and c.estimate else ()):
            m = _CKPT_NOTE.match(n)
            found = found or (m and (m.group(2), int(m.group(1)), c.estimate.checkpoint_every,
                                     c.estimate.checkpoint_policy))
    if found is None:
        return None
    by = {(c.precision, c.checkpointing): c for c in r.results
          if c.error is None and c.max_batch_size and c.estimate is not None}

    def per_sample(c: ConfigResult) -> float:
        return c.estimate.breakdown["activations"] / c.max_batch_size

    frees = tuple((p, 1 - per_sample(c) / per_sample(by[(p, False)]))
                  for (p, ck), c in by.items()
                  if ck and (p, False) in by and per_sample(by[(p, False)]) > 0)
    return CheckpointingEffect(found[0], found[1], frees, found[2], found[3])


# Preference among configurations that fit, best first: AMP keeps fp32 master weights and is
# practically neutral for quality while running on tensor cores; bf16 needs no loss scaling;
# checkpointing costs about a third more compute; pure bf16 changes numerics (bf16 weights and
# optimizer state) and comes last but one; pure fp16 (no loss scaling, fp16's narrow range)
# is the riskiest and comes last.
# configs.PRECISION_PREFERENCE, without checkpointing before with it (for the 16-bit AMPs)
_PREFERENCE = [("bf16", False), ("fp16", False), ("bf16", True), ("fp16", True),
               ("fp32", False), ("fp32", True), ("bf16-pure", False), ("bf16-pure", True),
               ("fp16-pure", False), ("fp16-pure", True)]


def recommended(r: ProbeResult) -> ConfigResult | None:
    """The configuration to train with on one card: the most preferred one that fits."""
    fitting = {(c.precision, c.checkpointing): c for c in r.results if c.max_batch_size}
    for key in _PREFERENCE:
        if key in fitting:
            return fitting[key]
    return None
