"""The search: every precision x checkpointing x strategy x micro-batch that fits, ranked."""
from __future__ import annotations

import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Callable

from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.plans.estimate import Budget, trace_for
from oomdoctor.models.spec import ModelSpec
from oomdoctor.plans.parallel import (STRATEGIES, Sizes, StrategyEstimate, Strategy,
                                deepspeed_zero3_gpu_bytes, estimate_strategy, model_layout)
from oomdoctor.plans.recommend.cost import step_time, throughput
from oomdoctor.plans.recommend.facts import (_Facts, floor_bytes, model_facts,
                                       tensor_parallel_bytes)
from oomdoctor.plans.recommend.finetune import adapter_alternative
from oomdoctor.plans.recommend.internode import node_step_time
from oomdoctor.plans.recommend.launch import _launch
from oomdoctor.plans.recommend.machine import Hardware
from oomdoctor.plans.recommend.offload import offload_plans
from oomdoctor.plans.recommend.records import Candidate, Floor, Recommendation, TensorParallelPlan
from oomdoctor.plans.recommend.render import _duration
from oomdoctor.sim.trace import Trace, TraceConfig


Progress = Callable[[str], None]


# Numerics: 0 keeps fp32 weights and updates (fp32, or autocast AMP with fp32 master weights);
# 1 stores weights and optimizer state in bf16 (small updates are lost to rounding).
NUMERICS = {"fp32": 0, "fp16": 0, "bf16": 0, "bf16-pure": 1}
# The order a user would rather run them in, all else being equal.
SIMPLICITY = ("single", "ddp", "zero1", "zero2", "zero3", "pipeline2", "dp", "hsdp")
# Several nodes: one process per GPU on every node (DataParallel and the split stay inside one).
NODE_SEARCH = ("single", "ddp", "zero1", "zero2", "zero3", "hsdp")
NUMERICS_PENALTY = 1.25           # pure bf16's score (shown) carries this; it ranks after the rest


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
            "bf16-pure": "pure bf16 weights + optimizer state: small updates round away"
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
    exact: dict[int, Trace] = {}

    def traced(b: int) -> Trace:
        if b not in exact:
            exact[b] = trace_for(spec, replace(cfg, batch_size=b), hw.gpu)
        return exact[b]
    try:
        progress(f"{label}: tracing batch 2 and 3")
        sizes = Sizes.affine(traced(2), traced(3))
        layout = model_layout(spec, precision)
    except ValueError as e:
        return [], [f"{label}: {e}"]
    out: list[Candidate] = []
    for st in strategies:
        d = st.data_parallel
        if target % d:
            continue
        batches = _divisors(target // d)

        def try_batch(b: int, st=st) -> StrategyEstimate:
            k = target // (d * b)
            if sizes is not None and b >= 2:
                return estimate_strategy(exact[2], layout, st, budget, alloc, sizes, batch=b,
                                         grad_accum=k)
            return estimate_strategy(traced(b), layout, st, budget, alloc, grad_accum=k)
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
        out.append(Candidate(
            st.name, st.num_gpus, precision, checkpointing, b, k, target,
            e.peak_device_bytes, tuple(g.device_peak_bytes for g in e.gpus), t.seconds,
            t.compute_seconds, t.communication_seconds, target / t.seconds if t.seconds else 0,
            _numerics(precision),
            t.seconds * (NUMERICS_PENALTY if NUMERICS[precision] else 1.0),
            extrapolated=b not in exact, traffic_bytes=t.traffic_bytes, nodes=st.nodes))
    return out, []


_WORKER: tuple | None = None     # (spec, ...) inherited by forked workers


def _worker(precision: str, checkpointing: bool, strategies: list[Strategy]
            ) -> tuple[list[Candidate], list[str]]:
    assert _WORKER is not None
    spec, hw, budget, alloc, target, base = _WORKER
    return _search_config(spec, precision, checkpointing, hw, budget, alloc, target, strategies,
                          base, lambda _: None)


def recommend(spec: ModelSpec, hw: Hardware, target_batch: int, budget: Budget,
              precisions: list[str] | None = None, strategies: list[str] | None = None,
              alloc: AllocatorConfig = AllocatorConfig(), base: TraceConfig = TraceConfig(1),
              checkpointing: list[bool] | None = None, jobs: int = 1, top: int = 8,
              detail: bool = True, progress: Progress = lambda _: None,
              host_ram: int | None = None, host_ram_source: str = "") -> Recommendation:
    """Search, rank, and explain. ``detail`` traces one configuration to show every strategy's
    per-GPU memory even when the lower bound already rules everything out. ``host_ram``: each
    node's RAM, to check the CPU offload plans against (None: unknown)."""
    global _WORKER
    if target_batch < 1:
        raise ValueError(f"--target-batch must be >= 1, got {target_batch}")
    gpu = hw.gpu
    allowed = precisions or (["fp32", "fp16", "bf16", "bf16-pure"] if gpu.bf16
                             else ["fp32", "fp16"])
    bad = [p for p in allowed if p.startswith("bf16") and not gpu.bf16]
    if bad:
        raise ValueError(f"{gpu.name} has no bf16 support (compute capability "
                         f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]} < 8.0); drop "
                         f"--precision {bad[0]}")
    world = hw.num_gpus * hw.nodes
    if hw.nodes > 1:
        names = [s for s in strategies or NODE_SEARCH if s in NODE_SEARCH]
    else:
        names = strategies or [s for s in STRATEGIES if hw.num_gpus > 1 or s == "single"]
    if "hsdp" in names and hw.nodes == 1:
        raise ValueError("hsdp (hybrid sharding) spans several nodes: give --nodes N, or use "
                         "--strategy zero3 on one node")
    strats = []
    for s in names:
        if s == "pipeline2" and hw.num_gpus != 2:
            continue
        strats.append(Strategy(s, 1, nodes=1) if s == "single"
                      else Strategy(s, world, nodes=hw.nodes))
    progress(f"building {spec.name} on fake tensors")
    facts = model_facts(spec)
    floors = [Floor(st.name, p, floor_bytes(facts, p, st),
                    floor_bytes(facts, p, st) <= budget.limit_bytes)
              for p in allowed for st in strats]
    feasible = {(f.precision, f.strategy) for f in floors if f.fits}
    ckpts = checkpointing if checkpointing is not None else (
        [False, True] if facts.has_blocks else [False])
    configs = [(p, ck) for p in allowed for ck in ckpts
               if any((p, st.name) in feasible for st in strats)]
    for p in allowed:
        if not any((p, st.name) in feasible for st in strats):
            best = min((f for f in floors if f.precision == p), key=lambda f: f.bytes)
            progress(f"{p}: parameters + gradients + optimizer state alone need "
                     f"{best.bytes / 2**30:.2f} GiB per GPU even with {best.strategy}; "
                     f"over the {budget.limit_bytes / 2**30:.2f} GiB budget - not traced")
    candidates: list[Candidate] = []
    errors: list[str] = []
    if configs:
        def strategies_for(p: str) -> list[Strategy]:
            return [st for st in strats if (p, st.name) in feasible]
        if jobs > 1 and len(configs) > 1 and "fork" in multiprocessing.get_all_start_methods():
            progress(f"searching {len(configs)} precision x checkpointing configurations in "
                     f"{min(jobs, len(configs))} processes")
            _WORKER = (spec, hw, budget, alloc, target_batch, base)
            try:
                with ProcessPoolExecutor(min(jobs, len(configs)),
                                         mp_context=multiprocessing.get_context("fork")) as pool:
                    futures = [pool.submit(_worker, p, ck, strategies_for(p))
                               for p, ck in configs]
                    results = [f.result() for f in futures]
            finally:
                _WORKER = None
            for cands, errs in results:
                candidates += cands
                errors += errs
        else:
            for p, ck in configs:
                cands, errs = _search_config(spec, p, ck, hw, budget, alloc, target_batch,
                                             strategies_for(p), base, progress)
                candidates += cands
                errors += errs
    candidates = rank(candidates)
    candidates = _verified(spec, candidates, hw, budget, alloc, base, progress)
    best = candidates[0] if candidates else None
    # Per-GPU memory of every strategy for one configuration: the best's, else the one with the
    # lowest lower bound (to show how far each strategy is from fitting).
    by_strategy: tuple[StrategyEstimate, ...] = ()
    ref = ""
    per_sample = None          # seconds of GPU compute per sample at the reference config
    if detail:
        if best is not None:
            p, ck, b = best.precision, best.checkpointing, best.micro_batch
        else:
            p = min(allowed, key=lambda q: min(f.bytes for f in floors if f.precision == q))
            ck, b = facts.has_blocks, 1
        ref = f"{p}{' + checkpointing' if ck else ''}, micro-batch {b} per GPU"
        progress(f"per-GPU memory of every strategy at {ref}")
        try:
            by_strategy, flops = _every_strategy(spec, replace(base, batch_size=b, precision=p,
                                                               checkpointing=ck), hw, budget,
                                                 alloc, strats)
            # A card known only by its memory (--memory) has no FLOP/s: no slowdown ratio.
            if (gpu.tflops_fp32 if p == "fp32" else gpu.tflops_16) > 0:
                per_sample = flops * (1 + ck / 3) / throughput(gpu, p)
        except ValueError as e:
            errors.append(str(e))
    alternatives = [] if best is not None else _alternatives(facts, hw, budget, allowed,
                                                            by_strategy)
    if best is None and spec.adapters is None:
        alternatives.append(adapter_alternative(spec, facts, hw, budget, base, alloc, progress))
    offload = ()
    if best is None:
        offload = offload_plans(facts, hw, budget, _zero3_extra(by_strategy), host_ram,
                                per_sample * target_batch / world if per_sample else None)
    launch = _launch(best, hw, spec, facts) if best is not None else None
    speedup = None
    if best is not None and best.num_gpus > 1:
        one = [c for c in candidates if c.strategy == "single" and c.precision == best.precision
               and c.checkpointing == best.checkpointing]
        if one and best.step_seconds:
            speedup = one[0].step_seconds / best.step_seconds
    notes = [n for n in [faster_pure_bf16_note(best, candidates)] if n]
    if "ddp" in names and hw.num_gpus > 1:
        ddp = [e for e in by_strategy if e.strategy == "ddp"]
        one = [e for e in by_strategy if e.strategy == "single"]
        if ddp and one:
            notes.append(f"DDP needs {ddp[0].peak_device_bytes / 2**30:.2f} GiB per GPU against "
                         f"{one[0].peak_device_bytes / 2**30:.2f} GiB on one GPU: it replicates "
                         "the model, so it never lowers per-GPU memory - it multiplies "
                         "throughput")
        if not any(f.fits for f in floors if f.strategy == "ddp"):
            notes.append("DDP cannot train this model on these cards: every GPU would hold all "
                         "parameters, gradients and optimizer state")
    return Recommendation(
        spec.name, gpu.name, hw.num_gpus, hw.link, hw.link_gbps, target_batch, gpu.total_bytes,
        budget.limit_bytes, facts.num_parameters, tuple(candidates[:top]), best, launch,
        by_strategy, ref, tuple(floors), tuple(alternatives), tuple(notes), tuple(errors),
        speedup, hw.nodes, hw.inter_node, hw.inter_node_gbps,
        _tensor_parallel(facts, hw, budget, allowed) if hw.nodes > 1 else (), offload,
        host_ram, host_ram_source)


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Best first. Pure bf16 comes after every plan that keeps fp32 master weights, whatever
    its speed: its quality note says it is not neutral, so it is the plan only when nothing
    else fits (faster_pure_bf16_note says what speed it would buy)."""
    # Step times equal to the three digits the table shows (typically: compute hides all
    # communication) are a tie - the estimate is not finer than that. Ties go to the plan that
    # moves fewer bytes, then to the simpler strategy (DDP before the ZeRO stages: fewer
    # moving parts, plain checkpoints), then to the one with more headroom.
    return sorted(candidates, key=lambda c: (NUMERICS[c.precision], float(f"{c.score:.3g}"),
                                             c.traffic_bytes, SIMPLICITY.index(c.strategy),
                                             c.peak_device_bytes))


def faster_pure_bf16_note(best: Candidate | None, candidates: list[Candidate]) -> str | None:
    """When a pure bf16 plan would step faster than the recommended one: by how much, and why
    the plan keeps fp32 master weights."""
    faster = [c for c in candidates if NUMERICS[c.precision] and best is not None
              and not NUMERICS[best.precision] and c.step_seconds < best.step_seconds]
    if not faster:
        return None
    f = faster[0]
    return (f"pure bf16 ({f.strategy} x{f.num_gpus}, micro-batch {f.micro_batch}) would step "
            f"{best.step_seconds / f.step_seconds:.1f}x faster, but it is not neutral for "
            "quality (bf16 weights and optimizer state lose small updates); the plan keeps "
            f"{best.precision} with fp32 master weights")


def _verified(spec: ModelSpec, candidates: list[Candidate], hw: Hardware, budget: Budget,
              alloc: AllocatorConfig, base: TraceConfig, progress: Progress) -> list[Candidate]:
    """The ranking with its head checked by a direct trace at its micro-batch when the sizes were
    extrapolated (as the probe checks its maximum); candidates that fail the check are dropped."""
    out = list(candidates)
    for _ in range(3):
        if not out or not out[0].extrapolated:
            break
        c = out.pop(0)
        progress(f"checking {c.strategy} {c.precision} micro-batch {c.micro_batch} with a trace")
        cfg = replace(base, batch_size=c.micro_batch, precision=c.precision,
                      checkpointing=c.checkpointing)
        e = estimate_strategy(trace_for(spec, cfg, hw.gpu), model_layout(spec, c.precision),
                              Strategy(c.strategy, c.num_gpus, nodes=c.nodes), budget, alloc,
                              grad_accum=c.grad_accum)
        if e.fits:
            out.insert(0, replace(c, peak_device_bytes=e.peak_device_bytes,
                                  per_gpu_bytes=tuple(g.device_peak_bytes for g in e.gpus),
                                  extrapolated=False))
            break
        progress(f"{c.strategy} {c.precision} micro-batch {c.micro_batch} does not fit when "
                 "traced directly; trying the next")
    return out


def _every_strategy(spec: ModelSpec, cfg: TraceConfig, hw: Hardware, budget: Budget,
                    alloc: AllocatorConfig, strats: list[Strategy]
                    ) -> tuple[tuple[StrategyEstimate, ...], float]:
    """Every strategy's estimate at one configuration, and the FLOPs of one sample's step."""
    trace = trace_for(spec, cfg, hw.gpu)
    layout = model_layout(spec, cfg.precision)
    out = []
    for st in strats:
        try:
            out.append(estimate_strategy(trace, layout, st, budget, alloc,
                                         grad_accum=cfg.grad_accum))
        except ValueError:
            continue
    return tuple(out), layout.flops_per_sample


def _zero3_extra(by_strategy: tuple[StrategyEstimate, ...]) -> int | None:
    """What the traced configuration holds besides model states (activations, temporaries,
    allocator overhead) on ZeRO-3's fullest GPU; None when it was not traced."""
    zero3 = [e for e in by_strategy if e.strategy == "zero3"]
    if not zero3:
        return None
    g = max(zero3[0].gpus, key=lambda g: g.peak_reserved_bytes)
    return g.peak_reserved_bytes - g.model_state_bytes


def _tensor_parallel(facts: _Facts, hw: Hardware, budget: Budget, allowed: list[str]
                     ) -> tuple[TensorParallelPlan, ...]:
    """Tensor parallelism of each degree that divides a node's GPUs, DDP across the rest: model
    states per GPU in the leanest allowed precision."""
    p = "bf16-pure" if "bf16-pure" in allowed else allowed[-1]
    world = hw.num_gpus * hw.nodes
    out = []
    for t in range(2, hw.num_gpus + 1):
        if hw.num_gpus % t:
            continue
        need = tensor_parallel_bytes(facts, p, t)
        out.append(TensorParallelPlan(t, world // t, need, need <= budget.limit_bytes))
    return tuple(out)


def _alternatives(facts: _Facts, hw: Hardware, budget: Budget, allowed: list[str],
                  by_strategy: tuple[StrategyEstimate, ...]) -> list[str]:
    """What would fit when nothing does, each with its numbers."""
    out = []
    lim = budget.limit_bytes
    p = "bf16-pure" if "bf16-pure" in allowed else allowed[-1]
    # What the traced configuration holds besides model states (activations, temporaries,
    # allocator overhead) on the leanest strategy: a realistic margin for the suggestions.
    extra = _zero3_extra(by_strategy) or 0
    zero3 = [e for e in by_strategy if e.strategy == "zero3"]
    world = hw.num_gpus * hw.nodes
    for n in range(hw.num_gpus * hw.nodes + 1, 65):
        need = floor_bytes(facts, p, Strategy("zero3", n)) + extra
        if need <= lim:
            what = (f"model states / {n} + {extra / 2**30:.1f} GiB of activations and "
                    "temporaries" if zero3 else
                    f"model states / {n}; activations and temporaries come on top - not "
                    "traced here")
            out.append(f"more GPUs: ZeRO-3/FSDP over {n} x {hw.gpu.name} needs about "
                       f"{need / 2**30:.1f} GiB per GPU ({p}: {what})")
            break
    for slots, name in ((0, "plain SGD (no momentum: no optimizer state)"),
                        (1, "SGD with momentum or Adafactor-like state (1 slot)")):
        for st in (Strategy("zero3", world),) + ((Strategy("pipeline2", 2),)
                                                 if world == 2 else ()):
            need = floor_bytes(facts, p, st, slots) + extra
            if need <= lim:
                out.append(f"a lighter optimizer: {name} with {st.name} on {world} GPUs "
                           f"needs about {need / 2**30:.1f} GiB per GPU in {p}"
                           + ("" if zero3 else " before activations"))
                break
        else:
            continue
        break
    temps = max((g.breakdown["temporaries"] for e in zero3 for g in e.gpus), default=0)
    if temps > lim // 8:
        out.append(f"a fused optimizer: torch.optim.AdamW(..., fused=True) steps without the "
                   f"foreach implementation's temporaries ({temps / 2**30:.1f} GiB per GPU at "
                   "ZeRO-3's peak here)")
    ds = deepspeed_zero3_gpu_bytes(facts.num_parameters, facts.largest_leaf_params, world,
                                   offload_optimizer=True)
    cpu = int(facts.num_parameters * 16 / hw.nodes * 1.5)
    out.append(f"CPU offload (the plans above): DeepSpeed ZeRO-3 with offload_optimizer=cpu "
               f"keeps about {ds / 2**30:.1f} GiB of model states per GPU (its estimator: "
               f"4L + 2P/N) but needs about {cpu / 2**30:.0f} GiB of host RAM per node "
               "(16P x 1.5) and runs the optimizer on the CPU (slow)")
    return out
