"""A strategy's per-GPU estimate: build each GPU's event list, replay it through the allocator."""
from __future__ import annotations

import bisect
from dataclasses import replace
from typing import Callable

from oomdoctor.sim.allocator import AllocatorConfig, replay
from oomdoctor.plans.estimate import Budget
from oomdoctor.sim.gpus import GpuProfile
from oomdoctor.plans.parallel import deepspeed as ds_mod
from oomdoctor.plans.parallel.data_parallel import _ddp, _dp, _zero
from oomdoctor.plans.parallel.events import _Context, _Gpu, _single
from oomdoctor.plans.parallel.layout import Layout
from oomdoctor.plans.parallel.model_states import (deepspeed_zero2_gpu_bytes,
                                             deepspeed_zero3_gpu_bytes,
                                             deepspeed_state_floor, model_state_floor)
from oomdoctor.plans.parallel.pipeline import _Pipeline
from oomdoctor.plans.parallel.results import BREAKDOWN_KEYS, GpuMemory, Partition, StrategyEstimate
from oomdoctor.plans.parallel.strategy import Strategy
from oomdoctor.plans.parallel.timeline import Sizes
from oomdoctor.sim.trace import Phase, Trace


def _measure(ctx: _Context, g: _Gpu, budget: Budget, alloc: AllocatorConfig) -> GpuMemory:
    events, positions = g.events()
    limited = replay(events, alloc, budget.limit_bytes, g.streams)
    fits = limited.oom is None
    result = limited if fits else replay(events, alloc, None, g.streams)
    at = result.peak_allocated_index
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
    live: dict[int, int] = {}
    for is_alloc, h, n in events[:at + 1]:
        if is_alloc:
            live[h] = n
        else:
            live.pop(h, None)
    for h, n in live.items():
        breakdown[g.keys[h]] += n
    used = sum(breakdown.values())
    breakdown["allocator_overhead"] = result.peak_reserved_bytes - used
    breakdown["cuda_context"] = budget.cuda_context_bytes
    phase = ctx.timing.phase_of(positions[at]).value if positions else "setup"
    state = breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_state"]
    return GpuMemory(g.label, result.peak_allocated_bytes, result.peak_reserved_bytes,
                     result.peak_reserved_bytes + budget.cuda_context_bytes, fits, breakdown,
                     phase, state, _resting_state(ctx, g.keys, events, positions))


def _resting_state(ctx: _Context, keys: dict[int, str], events: list, positions: list) -> int:
    """Parameters + gradients + optimizer state alive when the last optimizer step ends (before
    zero_grad): the model states DeepSpeed's estimators count, without the layer in flight."""
    opt = [stop for _, stop, m in ctx.timing.phases if m.phase is Phase.OPTIMIZER]
    if not opt:
        return 0
    until = bisect.bisect_left(positions, opt[-1] - 0.5)
    live: dict[int, int] = {}
    for is_alloc, h, n in events[:until]:
        if is_alloc:
            live[h] = n
        else:
            live.pop(h, None)
    return sum(n for h, n in live.items()
               if keys[h] in ("parameters", "gradients", "optimizer_state"))


def _build(trace: Trace, layout: Layout, strategy: Strategy, gpu: GpuProfile,
           sizes: Sizes | None, batch: int | None,
           choose_cut: Callable[["_Pipeline"], int] | None = None, workspaces: bool = True
           ) -> tuple[_Context, list[_Gpu], list[str], "Partition | None"]:
    sizes = sizes or Sizes.of(trace)
    b = batch or trace.config.batch_size
    dp_sizes = sizes.at(b * strategy.num_gpus) if strategy.name == "dp" else None
    tr = trace if b == trace.config.batch_size else _rebatched(trace, b)
    ctx = _Context(tr, layout, gpu, sizes.at(b), dp_sizes, workspaces)
    partition = None
    notes: list[str] = []
    if strategy.name == "single":
        gpus = _single(ctx)
    elif strategy.name == "ddp":
        gpus, notes = _ddp(ctx, strategy)
    elif strategy.name == "dp":
        gpus, notes = _dp(ctx, strategy)
    elif strategy.name in ("zero1", "zero2", "zero3"):
        gpus, notes = _zero(ctx, strategy, int(strategy.name[-1]))
    elif strategy.is_deepspeed:
        gpus, notes = ds_mod.deepspeed(ctx, strategy)
    elif strategy.name == "hsdp":
        # Each node is one ZeRO-3 group; the cross-node all-reduce runs on the reduce-scattered
        # shard in place (FSDP HYBRID_SHARD), so a GPU's memory is ZeRO-3's over its node.
        gpus, notes = _zero(ctx, replace(strategy, name="zero3", num_gpus=strategy.per_node,
                                         nodes=1), 3)
        notes.append(f"hybrid sharding: model states sharded over the {strategy.per_node} GPUs "
                     f"of each node and replicated on each of the {strategy.nodes} nodes; "
                     "only gradients cross the inter-node link")
    else:
        pipe = _Pipeline(ctx)
        if pipe.nblocks < 2:
            raise ValueError(f"{layout.model} has a single block ({layout.blocks[0]!r}); there "
                             "is nothing to split across two GPUs - use zero3 (FSDP)")
        cut = choose_cut(pipe) if choose_cut else min(
            range(1, pipe.nblocks), key=lambda c: (max(pipe.live_peak(c)), c))
        gpus = pipe.gpus(cut)
        partition = pipe.partition(cut)
        notes = [f"naive split, no micro-batch pipelining: one GPU idles while the other works; "
                 f"expected utilisation GPU 0 {partition.utilisation[0]:.0%}, GPU 1 "
                 f"{partition.utilisation[1]:.0%} (the pair does the work of one GPU, at most)"]
    return ctx, gpus, notes, partition


def strategy_events(trace: Trace, layout: Layout, strategy: Strategy, gpu: GpuProfile,
                    sizes: Sizes | None = None, batch: int | None = None,
                    workspaces: bool = True) -> list[tuple[str, list[tuple[bool, int, int]]]]:
    """Each GPU's (label, allocator event list) under ``strategy`` - what
    :func:`estimate_strategy` replays; without ``workspaces`` the cuBLAS workspaces are left out
    (to compare with a CPU run). The split's cut is the best by live bytes."""
    _, gpus, _, _ = _build(trace, layout, strategy, gpu, sizes, batch, workspaces=workspaces)
    return [(g.label, g.events()[0]) for g in gpus]


def live_peak(events: list[tuple[bool, int, int]]) -> int:
    """Peak of live bytes of an event list (no allocator rounding): what a CPU run measures."""
    live = peak = 0
    for is_alloc, _, n in events:
        live += n if is_alloc else -n
        peak = max(peak, live)
    return peak


def estimate_strategy(trace: Trace, layout: Layout, strategy: Strategy, budget: Budget,
                      alloc: AllocatorConfig = AllocatorConfig(), sizes: Sizes | None = None,
                      batch: int | None = None, grad_accum: int = 1,
                      cut: int | None = None) -> StrategyEstimate:
    """Per-GPU peaks of ``strategy`` for the traced configuration at micro-batch ``batch``
    (default: the trace's) per data-parallel rank; the split at ``cut`` (the execution index
    of the second stage's first block; default: the best)."""
    ctx, gpus, notes, partition = _build(
        trace, layout, strategy, budget.gpu, sizes, batch,
        choose_cut=lambda pipe: _best_cut(pipe, budget, alloc) if cut is None else cut)
    measured = tuple(_measure(ctx, g, budget, alloc) for g in gpus)
    b = ctx.trace.config.batch_size
    cfg = trace.config
    master = strategy.state_scale                   # fp32 sharded state under a policy
    if strategy.is_deepspeed:
        floor = deepspeed_state_floor(trace.parameter_bytes, trace.gradient_bytes,
                                         trace.optimizer_state_bytes, strategy)
    else:
        floor = model_state_floor(trace.parameter_bytes * master, trace.gradient_bytes * master,
                                  trace.optimizer_state_bytes * master, strategy)
    if strategy.cpu_offload:
        floor = 0                                   # every model state on the host
    ds = _deepspeed_estimate(layout, strategy)
    d = strategy.data_parallel
    return StrategyEstimate(
        model=layout.model, strategy=strategy.name, num_gpus=strategy.num_gpus,
        precision=cfg.precision, checkpointing=cfg.checkpointing, micro_batch=b,
        grad_accum=grad_accum, effective_batch=b * grad_accum * d, gpu=budget.gpu.name,
        device_total_bytes=budget.gpu.total_bytes, budget_bytes=budget.limit_bytes,
        gpus=measured, fits=all(g.fits for g in measured), model_state_floor_bytes=floor,
        deepspeed_bytes=ds, partition=partition, notes=tuple(notes))


def _deepspeed_estimate(layout: Layout, strategy: Strategy) -> int | None:
    """DeepSpeed's own estimator of the model states per GPU, with the offload the strategy
    runs (FSDP2's CPUOffloadPolicy offloads what ZeRO-3's optimizer and parameter offload do);
    None for a LoRA run, whose frozen weights the estimators count as trained."""
    if layout.num_trainable < layout.num_parameters:
        return None
    ds = strategy.deepspeed
    opt = strategy.cpu_offload or bool(ds and ds.offload_optimizer)
    params = strategy.cpu_offload or bool(ds and ds.offload_param)
    if strategy.name in ("zero2", "ds2"):
        return deepspeed_zero2_gpu_bytes(layout.num_parameters, strategy.num_gpus, opt)
    if strategy.name in ("zero3", "hsdp", "ds3"):
        return deepspeed_zero3_gpu_bytes(layout.num_parameters, layout.largest_leaf_params,
                                         strategy.shard_group, opt, params)
    return None


def _rebatched(trace: Trace, b: int) -> Trace:
    return replace(trace, config=replace(trace.config, batch_size=b))


def _best_cut(pipe: _Pipeline, budget: Budget, alloc: AllocatorConfig) -> int:
    """The cut whose larger stage peak is smallest: every cut by live bytes, the best three
    replayed through the allocator."""
    scored = sorted(range(1, pipe.nblocks), key=lambda c: (max(pipe.live_peak(c)), c))
    best, best_peak = scored[0], None
    for cut in scored[:3]:
        peak = max(_measure(pipe.ctx, g, budget, alloc).peak_reserved_bytes
                   for g in pipe.gpus(cut))
        if best_peak is None or peak < best_peak:
            best, best_peak = cut, peak
    return best
