"""One precision x checkpointing configuration of the search: its traces at batch 2 and 3, and
every strategy's largest fitting micro-batch with its step time (oomdoctor.plans.recommend.search
runs these, in forked workers, and ranks what they find)."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from oomdoctor.models.spec import ModelSpec
from oomdoctor.plans.estimate import Budget, trace_for
from oomdoctor.plans.parallel import (Layout, Sizes, StrategyEstimate, Strategy, default_policy,
                                      estimate_strategy, model_layout, trace_precision)
from oomdoctor.plans.recommend.cost import StepTime, step_time
from oomdoctor.plans.recommend.internode import node_step_time
from oomdoctor.plans.recommend.machine import Hardware
from oomdoctor.plans.recommend.records import Candidate
from oomdoctor.plans.recommend.render import _duration
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.sim.gpus import GpuProfile
from oomdoctor.sim.trace import Trace, TraceConfig

Progress = Callable[[str], None]

# Numerics: 0 keeps fp32 weights and updates (fp32, or autocast AMP with fp32 master weights);
# 1 stores weights and optimizer state in bf16 (small updates are lost to rounding);
# 2 stores them in fp16 with no loss scaling: fp16's range (6e-8 to 65504) loses small
# gradients to underflow and large activations to overflow, the riskiest of all.
NUMERICS = {"fp32": 0, "fp16": 0, "bf16": 0, "bf16-pure": 1, "fp16-pure": 2}
NUMERICS_PENALTY = 1.25           # a pure precision's score (shown) carries this; it ranks last


def _divisors(n: int) -> list[int]:
    return sorted({d for i in range(1, int(math.isqrt(n)) + 1) if n % i == 0
                   for d in (i, n // i)})


def _largest_fitting(try_batch: Callable[[int], StrategyEstimate], batches: list[int]
                     ) -> tuple[int, StrategyEstimate] | None:
    """Largest b in ``batches`` (ascending) that fits, by bisection (fitting is monotone in b);
    the smallest is tried only when every larger one fails."""
    lo, hi = 0, len(batches) - 1
    found = None
    while lo <= hi:
        mid = (lo + hi) // 2
        e = try_batch(batches[mid])
        if e.fits:
            found = (batches[mid], e)
            lo = mid + 1
        else:
            hi = mid - 1
    return found


def _numerics(precision: str) -> str:
    return {"fp32": "fp32: unchanged",
            "fp16": "fp16 AMP + GradScaler: practically neutral",
            "bf16": "bf16 AMP: practically neutral",
            "bf16-pure": "pure bf16 weights + optimizer state: small updates round away",
            "fp16-pure": "pure fp16, no loss scaling: gradients underflow, activations overflow"
            }[precision]


def _search_config(spec: ModelSpec, precision: str, checkpointing: bool, hw: Hardware,
                   budget: Budget, alloc: AllocatorConfig, target: int,
                   strategies: list[Strategy], base: TraceConfig, progress: Progress
                   ) -> tuple[list[Candidate], list[str]]:
    """Trace one precision x checkpointing at batch 2 and 3 (batch 1 can differ in strides, so
    it is traced only when needed; see probe.py), then find every strategy's largest fitting
    micro-batch among the divisors of the per-rank batch."""
    label = f"{precision}{' + checkpointing' if checkpointing else ''}"
    cfg = replace(base, batch_size=2, precision=precision, checkpointing=checkpointing)
    used = {trace_precision(default_policy(st, precision), precision) for st in strategies}
    runs = {p: _Traces(spec, replace(cfg, precision=p), hw.gpu) for p in {precision, *used}}
    try:
        progress(f"{label}: tracing batch 2 and 3")
        for p, r in runs.items():
            # the configuration's own precision gives every step time its layout and batch-2
            # trace; its slope only where a strategy replays it
            r.prepare(slope=p in used)
    except ValueError as e:
        return [], [f"{label}: {e}"]
    exact = runs[precision].exact
    layout = runs[precision].layout
    out: list[Candidate] = []
    for st in strategies:
        d = st.data_parallel
        if target % d:
            continue
        batches = _divisors(target // d)
        st = default_policy(st, precision)
        run = runs[trace_precision(st, precision)]

        def try_batch(b: int, st=st, run=run) -> StrategyEstimate:
            return run.estimate(st, b, target // (d * b), budget, alloc)
        try:
            hit = _largest_fitting(try_batch, batches)
        except ValueError as e:
            progress(f"{label}: {st.name}: {e}")
            continue
        if hit is None:
            progress(f"{label}: {st.name} x{st.num_gpus}: even micro-batch 1 does not fit")
            continue
        b, e = hit
        k = target // (d * b)
        if hw.nodes > 1:
            t = node_step_time(layout, exact[2], st, hw, precision, checkpointing, b, k)
        else:
            t = step_time(layout, exact[2], st, hw, precision, checkpointing, b, k,
                          e.partition.boundary_bytes if e.partition else 0)
        progress(f"{label}: {st.name} x{st.num_gpus}: micro-batch {b} x {k} accumulation, "
                 f"{e.peak_device_bytes / 2**30:.2f} GiB on the fullest GPU, "
                 f"~{_duration(t.seconds)} per step")
        out.append(candidate(st, precision, checkpointing, b, k, target, e, t,
                             extrapolated=b not in run.exact))
    return out, []


def candidate(st: Strategy, precision: str, checkpointing: bool, b: int, k: int, target: int,
              e: StrategyEstimate, t: StepTime, extrapolated: bool) -> Candidate:
    """A plan: ``st`` at micro-batch ``b`` x ``k`` accumulation, its estimate and step time."""
    return Candidate(
        st.name, st.num_gpus, precision, checkpointing, b, k, target,
        e.peak_device_bytes, tuple(g.device_peak_bytes for g in e.gpus), t.seconds,
        t.compute_seconds, t.communication_seconds, target / t.seconds if t.seconds else 0,
        _numerics(precision), t.seconds * (NUMERICS_PENALTY if NUMERICS[precision] else 1.0),
        extrapolated=extrapolated, traffic_bytes=t.traffic_bytes, nodes=st.nodes,
        device_map=e.partition.device_map if e.partition else None,
        main_device=e.partition.main_stage if e.partition else 0)


class _Traces:
    """One precision's traces at batch 2 and 3 (batch 1 can differ in strides, so it is traced
    only when needed; see probe.py), their per-storage slope, and the layout."""

    def __init__(self, spec: ModelSpec, cfg: TraceConfig, gpu: GpuProfile) -> None:
        self.spec, self.cfg, self.gpu = spec, cfg, gpu
        self.exact: dict[int, Trace] = {}
        self.sizes: Sizes | None = None
        self.layout: Layout | None = None

    def traced(self, b: int) -> Trace:
        if b not in self.exact:
            self.exact[b] = trace_for(self.spec, replace(self.cfg, batch_size=b), self.gpu)
        return self.exact[b]

    def prepare(self, slope: bool = True) -> None:
        if slope:
            self.sizes = Sizes.affine(self.traced(2), self.traced(3))
        else:
            self.traced(2)
        self.layout = model_layout(self.spec, self.cfg.precision)

    def estimate(self, st: Strategy, b: int, k: int, budget: Budget, alloc: AllocatorConfig
                 ) -> StrategyEstimate:
        """``st`` at micro-batch ``b`` and ``k`` accumulation steps: from the trace at ``b``
        when there is one (a candidate is marked extrapolated exactly when there is not)."""
        if self.sizes is not None and b >= 2 and b not in self.exact:
            return estimate_strategy(self.exact[2], self.layout, st, budget, alloc, self.sizes,
                                     batch=b, grad_accum=k)
        return estimate_strategy(self.traced(b), self.layout, st, budget, alloc, grad_accum=k)


_WORKER: tuple | None = None     # (spec, ...) inherited by forked workers
