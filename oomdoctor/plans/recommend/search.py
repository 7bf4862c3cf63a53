"""The search: every precision x checkpointing x strategy x micro-batch that fits, ranked."""
from __future__ import annotations

import multiprocessing
from dataclasses import replace
from typing import Callable

from oomdoctor.configs import PRECISION_PREFERENCE, leanest_precision, needs_bf16
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.plans.estimate import Budget, allocator_conf_string, trace_for
from oomdoctor.sim.gpus import GpuProfile
from oomdoctor.models.spec import ModelSpec
from oomdoctor.plans.parallel import (STRATEGIES, Layout, StrategyEstimate, Strategy,
                                      default_policy, estimate_strategy, model_layout,
                                      trace_precision)
from oomdoctor.plans.recommend.alternatives import what_would_fit
from oomdoctor.plans.recommend.config_search import NUMERICS, _search_config
from oomdoctor.plans.recommend.cost import throughput
from oomdoctor.plans.recommend.facts import (_Facts, floor_bytes, model_facts,
                                       tensor_parallel_bytes)
from oomdoctor.plans.recommend.finetune import adapter_alternative
from oomdoctor.plans.recommend.launch import _launch
from oomdoctor.plans.recommend.machine import Hardware
from oomdoctor.plans.recommend.offload import offload_plans, offload_summary, replay_offload
from oomdoctor.plans.recommend.offload_code import OffloadSetting
from oomdoctor.plans.recommend.records import (Candidate, Floor, OffloadPlan, Recommendation,
                                         TensorParallelPlan)
from oomdoctor.plans.recommend.sharing import other_process_note
from oomdoctor.plans.workers import forked_pool
from oomdoctor.sim.trace import Trace, TraceConfig


Progress = Callable[[str], None]


# The order a user would rather run them in, all else being equal.
SIMPLICITY = ("single", "ddp", "zero1", "zero2", "zero3", "pipeline2", "dp", "hsdp")
# Several nodes: one process per GPU on every node (DataParallel and the split stay inside one).
NODE_SEARCH = ("single", "ddp", "zero1", "zero2", "zero3", "hsdp")
# The allocator a plan launches with when the user names none: expandable segments map more
# physical memory into one segment instead of caching fixed ones, which ends most fragmentation
# (c10/cuda/CUDACachingAllocator.cpp, ExpandableSegment). The plan's numbers are computed with
# the setting its launch line sets (issue #24: they assumed the default while the line set this).
LAUNCH_ALLOCATOR = AllocatorConfig(expandable_segments=True)


def _worker(precision: str, checkpointing: bool, strategies: list[Strategy]
            ) -> tuple[list[Candidate], list[str]]:
    assert _WORKER is not None
    spec, hw, budget, alloc, target, base = _WORKER
    return _search_config(spec, precision, checkpointing, hw, budget, alloc, target, strategies,
                          base, lambda _: None)


def recommend(spec: ModelSpec, hw: Hardware, target_batch: int, budget: Budget,
              precisions: list[str] | None = None, strategies: list[str] | None = None,
              alloc: AllocatorConfig | None = None, base: TraceConfig = TraceConfig(1),
              checkpointing: list[bool] | None = None, jobs: int = 1, top: int = 8,
              detail: bool = True, progress: Progress = lambda _: None,
              host_ram: int | None = None, host_ram_source: str = "") -> Recommendation:
    """Search, rank, and explain. ``detail`` traces one configuration to show every strategy's
    per-GPU memory even when the lower bound already rules everything out. ``host_ram``: each
    node's RAM, to check the CPU offload plans against (None: unknown). ``alloc``: the
    PYTORCH_CUDA_ALLOC_CONF to plan for and launch with; None: LAUNCH_ALLOCATOR."""
    if target_batch < 1:
        raise ValueError(f"--target-batch must be >= 1, got {target_batch}")
    alloc = LAUNCH_ALLOCATOR if alloc is None else alloc
    gpu = hw.gpu
    allowed = _allowed_precisions(gpu, precisions, spec.adapters is not None)
    names = _strategy_names(hw, strategies)
    strats = _strategies(names, hw)
    progress(f"building {spec.name} on fake tensors")
    facts = model_facts(spec, allowed)
    floors = _floors(facts, allowed, strats, budget)
    fitting = {(f.precision, f.strategy) for f in floors if f.fits}
    # The strategies worth tracing in each precision: those whose lower bound fits the budget.
    feasible = {p: [st for st in strats if (p, st.name) in fitting] for p in allowed}
    _report_untraced(allowed, floors, feasible, budget, progress)
    ckpts = checkpointing if checkpointing is not None else (
        [False, True] if facts.has_blocks else [False])
    configs = [(p, ck) for p in allowed for ck in ckpts if feasible[p]]
    candidates, errors = _search(spec, hw, budget, alloc, target_batch, base, configs,
                                 feasible, jobs, progress)
    candidates = _verified(spec, rank(candidates, hw.link == "pcie-no-p2p"), hw, budget, alloc,
                           base, progress)
    best = candidates[0] if candidates else None
    by_strategy: tuple[StrategyEstimate, ...] = ()
    ref = ""
    per_sample = None          # seconds of GPU compute per sample at the reference config
    reference: tuple[Trace, Layout] | None = None
    if detail or best is None:
        p, ck, b = _reference_point(best, allowed, floors, facts)
        ref = f"{p}{' + checkpointing' if ck else ''}, micro-batch {b} per GPU"
        progress(f"per-GPU memory of every strategy at {ref}" if detail
                 else f"tracing {ref} to count the GPUs that would fit")
        # with the plan's accumulation, as _verified checks it: the table shows what the
        # recommended run holds (and reuses that check's trace)
        k = min(best.grad_accum, 2) if best is not None else 1
        try:
            reference = _traced(spec, replace(base, batch_size=b, precision=p, checkpointing=ck,
                                              grad_accum=k), hw)
        except ValueError as e:
            errors.append(str(e))
        if detail and reference is not None:
            by_strategy = _every_strategy(*reference, budget, alloc, strats, spec)
            per_sample = _seconds_per_sample(gpu, p, ck, reference[1].flops_per_sample)
        if not detail:
            ref = ""
    alternatives: list[str] = []
    offload: tuple[OffloadPlan, ...] = ()
    if best is None:
        alternatives = what_would_fit(facts, hw, budget, alloc, allowed, by_strategy, reference,
                                       progress)
        if spec.adapters is None:       # an adapter's optimizer state is too small to move
            offload = _offload(spec, facts, hw, budget, alloc, reference, host_ram,
                               per_sample * target_batch if per_sample else None, target_batch,
                               progress)
            alternatives.append(offload_summary(offload))
            alternatives.append(adapter_alternative(spec, facts, hw, budget, base, alloc,
                                                    progress))
    return Recommendation(
        spec.name, gpu.name, hw.num_gpus, hw.link, hw.link_gbps, target_batch, gpu.total_bytes,
        budget.limit_bytes, facts.num_parameters, tuple(candidates[:top]), best,
        _launch(best, hw, spec, facts, allocator_conf_string(alloc)) if best is not None
        else None,
        by_strategy, ref, tuple(floors), tuple(alternatives),
        tuple(_notes(best, candidates, names, hw, by_strategy, floors)
              + [n for n in [other_process_note(budget)] if n]
              + ([FP16_SKIPPED] if gpu.bf16 and not precisions else [])
              + ([FP32_SKIPPED] if "fp32" not in allowed and not precisions else [])),
        tuple(errors),
        _speedup(best, candidates), hw.nodes, hw.inter_node, hw.inter_node_gbps,
        _tensor_parallel(facts, hw, budget, allowed) if hw.nodes > 1 else (), offload,
        host_ram, host_ram_source, allocator_conf_string(alloc))


def _offload(spec: ModelSpec, facts: _Facts, hw: Hardware, budget: Budget,
             alloc: AllocatorConfig, reference: tuple[Trace, Layout] | None,
             host_ram: int | None, compute: float | None, target_batch: int,
             progress: Progress) -> tuple[OffloadPlan, ...]:
    """The CPU offload plans at the reference point's precision and checkpointing, micro-batch 1
    accumulated to the target batch; their per-GPU figures replayed from traces of their own
    step where the reference point was traced (``compute``: GPU seconds of a step's work)."""
    world = hw.num_gpus * hw.nodes
    cfg = reference[0].config if reference is not None else None
    setting = OffloadSetting(cfg.precision if cfg else "bf16",
                             cfg.checkpointing if cfg else facts.has_blocks,
                             max(1, target_batch // world), facts.blocks_parent,
                             allocator_conf_string(alloc), facts.num_parameters)
    replayed = None
    if cfg is not None:
        progress("replaying the CPU offload plans (DeepSpeed ZeRO-Offload, FSDP2 "
                 "CPUOffloadPolicy) at micro-batch 1")
        replayed = replay_offload(spec, cfg, hw, budget, alloc, setting)
    return offload_plans(facts, hw, budget, setting, host_ram, replayed,
                         compute / world if compute else None)


FP16_SKIPPED = ("fp16 AMP not searched: on this card bf16 AMP takes the same memory, steps as "
                "fast and needs no GradScaler (--precision fp16 to search it too)")


FP32_SKIPPED = ("fp32 not searched: with LoRA/QLoRA adapters bf16 AMP holds less (16-bit "
                "frozen weights and activations) and steps faster (--precision fp32 to search "
                "it too)")


def _allowed_precisions(gpu: GpuProfile, precisions: list[str] | None,
                        adapters: bool = False) -> list[str]:
    """The precisions to search: the ones asked for, else every one the card supports."""
    # fp16-pure only when asked for: where bf16 exists bf16-pure holds the same bytes with
    # fp32's range, and without it pure fp16 with no loss scaling is a risk the user takes
    # knowingly (see quality_notes), not one a search volunteers.
    # fp16 AMP too only where there is no bf16: on a card with it, bf16 AMP holds the same
    # bytes (fp16 adds its GradScaler's few), steps as fast, needs no loss scaling and wins
    # every tie (configs.PRECISION_PREFERENCE) - searching it doubled the work for rows that
    # always ranked second (FP16_SKIPPED says so; --precision fp16 searches it).
    # fp32 with adapters only when asked for, on a card with bf16: the LoRA recipe's base is
    # 16-bit under AMP (fp32 would hold it in fp32), every activation is larger in fp32 and
    # every matmul slower, so bf16 AMP fits whatever fp32 fits, faster (FP32_SKIPPED).
    if precisions:
        allowed = precisions
    elif gpu.bf16:
        allowed = ["bf16", "bf16-pure"] if adapters else ["fp32", "bf16", "bf16-pure"]
    else:
        allowed = ["fp32", "fp16"]
    bad = [p for p in allowed if needs_bf16(p) and not gpu.bf16]
    if bad:
        raise ValueError(f"{gpu.name} has no bf16 support (compute capability "
                         f"{gpu.compute_capability[0]}.{gpu.compute_capability[1]} < 8.0); drop "
                         f"--precision {bad[0]}")
    return allowed


# What `explain` says of a `nvidia-smi topo -p2p r` table with "NS" and of a Ctrl-C'd
# DataParallel hang (explain/formats/launch.py): DataParallel copies the weights GPU to GPU every
# forward (torch/nn/parallel/replicate.py -> comm.broadcast_coalesced), which hangs or crawls
# without peer access. The plans agree with it: on such a link DataParallel is not searched.
DP_WITHOUT_P2P = ("these GPUs have no peer-to-peer access (--link pcie-no-p2p; `nvidia-smi "
                  "topo -p2p r` shows NS), where DataParallel's per-step weight broadcast from "
                  "GPU 0 hangs or crawls; DDP needs no P2P")


def _strategy_names(hw: Hardware, strategies: list[str] | None) -> list[str]:
    """The strategies to search: the ones asked for (those that span nodes, on several), else
    every one that applies to the machine (DataParallel only where the GPUs have P2P)."""
    if hw.nodes > 1:
        names = [s for s in strategies or NODE_SEARCH if s in NODE_SEARCH]
    else:
        names = strategies or [s for s in STRATEGIES if (hw.num_gpus > 1 or s == "single")
                               and not (s == "dp" and hw.link == "pcie-no-p2p")]
    if "hsdp" in names and hw.nodes == 1:
        raise ValueError("hsdp (hybrid sharding) spans several nodes: give --nodes N, or use "
                         "--strategy zero3 on one node")
    return names


def _strategies(names: list[str], hw: Hardware) -> list[Strategy]:
    """Each strategy over every GPU of every node (single: one GPU; the two-GPU split only on
    two GPUs)."""
    world = hw.num_gpus * hw.nodes
    strats = []
    for s in names:
        if s == "pipeline2" and hw.num_gpus != 2:
            continue
        strats.append(Strategy(s, 1, nodes=1) if s == "single"
                      else Strategy(s, world, nodes=hw.nodes))
    return strats


def _floors(facts: _Facts, allowed: list[str], strats: list[Strategy], budget: Budget
            ) -> list[Floor]:
    """Each precision x strategy's lower bound: model states alone, before any activation."""
    floors = []
    for p in allowed:
        for st in strats:
            need = floor_bytes(facts, p, st)
            floors.append(Floor(st.name, p, need, need <= budget.limit_bytes))
    return floors


def _report_untraced(allowed: list[str], floors: list[Floor],
                     feasible: dict[str, list[Strategy]], budget: Budget, progress: Progress
                     ) -> None:
    """Say which precisions are ruled out by their lower bound alone, and by how much."""
    for p in allowed:
        if not feasible[p]:
            least = min((f for f in floors if f.precision == p), key=lambda f: f.bytes)
            progress(f"{p}: parameters + gradients + optimizer state alone need "
                     f"{least.bytes / 2**30:.2f} GiB per GPU even with {least.strategy}; "
                     f"over the {budget.limit_bytes / 2**30:.2f} GiB budget - not traced")


def _search(spec: ModelSpec, hw: Hardware, budget: Budget, alloc: AllocatorConfig,
            target: int, base: TraceConfig, configs: list[tuple[str, bool]],
            feasible: dict[str, list[Strategy]], jobs: int, progress: Progress
            ) -> tuple[list[Candidate], list[str]]:
    """Every precision x checkpointing configuration's candidates and errors, in the order of
    ``configs``: in forked processes when ``jobs`` allows and the platform can fork."""
    fork = jobs > 1 and "fork" in multiprocessing.get_all_start_methods()
    if fork and len(configs) > 1:
        progress(f"searching {len(configs)} precision x checkpointing configurations in "
                 f"{min(jobs, len(configs))} processes")
        results = _search_forked(spec, hw, budget, alloc, target, base, configs, feasible,
                                 min(jobs, len(configs)))
    elif fork and len(configs) == 1 and len(_by_trace(*configs[0], feasible)) > 1:
        results = [_search_split(spec, hw, budget, alloc, target, base, configs[0], feasible,
                                 jobs, progress)]
    else:
        results = [_search_config(spec, p, ck, hw, budget, alloc, target, feasible[p], base,
                                  progress) for p, ck in configs]
    candidates: list[Candidate] = []
    errors: list[str] = []
    for cands, errs in results:
        candidates += cands
        errors += errs
    return candidates, errors


def _search_forked(spec: ModelSpec, hw: Hardware, budget: Budget, alloc: AllocatorConfig,
                   target: int, base: TraceConfig, configs: list[tuple[str, bool]],
                   feasible: dict[str, list[Strategy]], processes: int
                   ) -> list[tuple[list[Candidate], list[str]]]:
    """_search_config of each configuration in a pool of forked workers, which inherit the
    model and settings through _WORKER rather than pickling them."""
    global _WORKER
    _WORKER = (spec, hw, budget, alloc, target, base)
    try:
        with forked_pool(processes) as pool:
            futures = {tuple(group): pool.submit(_worker_group, group, feasible)
                       for group in _shared_traces(configs)}
            done = {c: r for group, f in futures.items() for c, r in zip(group, f.result())}
            return [done[c] for c in configs]
    finally:
        _WORKER = None


def _by_trace(precision: str, checkpointing: bool, feasible: dict[str, list[Strategy]]
              ) -> list[list[Strategy]]:
    """One configuration's strategies grouped by the precision they replay (the plain one, a
    policy's pure bf16, DeepSpeed's 16-bit mode)."""
    groups: dict[str, list[Strategy]] = {}
    for st in feasible[precision]:
        p = trace_precision(default_policy(st, precision), precision)
        groups.setdefault(p, []).append(st)
    return list(groups.values())


def _search_split(spec: ModelSpec, hw: Hardware, budget: Budget, alloc: AllocatorConfig,
                  target: int, base: TraceConfig, config: tuple[str, bool],
                  feasible: dict[str, list[Strategy]], jobs: int, progress: Progress
                  ) -> tuple[list[Candidate], list[str]]:
    """One configuration searched in forked workers, one per precision its strategies replay
    (each traces its own): `probe --num-gpus N`'s plan of the recommended configuration."""
    global _WORKER
    groups = _by_trace(*config, feasible)
    progress(f"searching {len(groups)} traced precisions in {min(jobs, len(groups))} processes")
    _WORKER = (spec, hw, budget, alloc, target, base)
    try:
        with forked_pool(min(jobs, len(groups))) as pool:
            parts = [pool.submit(_worker_verified, *config, group, hw.link == "pcie-no-p2p")
                     .result for group in groups]
            done = [part() for part in parts]
    finally:
        _WORKER = None
    return ([c for cands, _ in done for c in cands], [e for _, errs in done for e in errs])


def _shared_traces(configs: list[tuple[str, bool]]) -> list[list[tuple[str, bool]]]:
    """The configurations in groups that one worker searches in turn: bf16 and bf16-pure at
    the same checkpointing share their pure-bf16 traces (FSDP's bf16 policy computes the pure
    step; trace_for keeps it), every other configuration alone. Largest groups first."""
    groups: dict[tuple, list[tuple[str, bool]]] = {}
    for p, ck in configs:
        key = ("bf16", ck) if p in ("bf16", "bf16-pure") else (p, ck)
        groups.setdefault(key, []).append((p, ck))
    return sorted(groups.values(), key=len, reverse=True)


def _worker_verified(precision: str, checkpointing: bool, strategies: list[Strategy],
                     no_p2p: bool) -> tuple[list[Candidate], list[str]]:
    """_worker, with its best candidate checked by a direct trace where its traces are (the
    overall best is one group's best, so the check in the parent finds it done)."""
    assert _WORKER is not None
    spec, hw, budget, alloc, _, base = _WORKER
    cands, errors = _worker(precision, checkpointing, strategies)
    return _verified(spec, rank(cands, no_p2p), hw, budget, alloc, base, lambda _: None), errors


def _worker_group(group: list[tuple[str, bool]], feasible: dict[str, list[Strategy]]
                  ) -> list[tuple[list[Candidate], list[str]]]:
    return [_worker(p, ck, feasible[p]) for p, ck in group]


def _reference_point(best: Candidate | None, allowed: list[str], floors: list[Floor],
                     facts: _Facts) -> tuple[str, bool, int]:
    """Precision, checkpointing and micro-batch at which to show every strategy's per-GPU
    memory: the best's, else the precision with the lowest lower bound (to show how far each
    strategy is from fitting)."""
    if best is not None:
        return best.precision, best.checkpointing, best.micro_batch
    p = min(allowed, key=lambda q: min(f.bytes for f in floors if f.precision == q))
    return p, facts.has_blocks, 1


def _seconds_per_sample(gpu: GpuProfile, precision: str, checkpointing: bool, flops: float
                        ) -> float | None:
    """GPU compute seconds per sample of ``flops`` (recomputation included)."""
    # A card known only by its memory (--memory) has no FLOP/s: no slowdown ratio.
    if (gpu.tflops_fp32 if precision == "fp32" else gpu.tflops_16) > 0:
        return flops * (1 + checkpointing / 3) / throughput(gpu, precision)
    return None


def _speedup(best: Candidate | None, candidates: list[Candidate]) -> float | None:
    """The best plan's throughput over one GPU's in the same precision and checkpointing."""
    if best is None or best.num_gpus <= 1:
        return None
    one = [c for c in candidates if c.strategy == "single" and c.precision == best.precision
           and c.checkpointing == best.checkpointing]
    if one and best.step_seconds:
        return one[0].step_seconds / best.step_seconds
    return None


def _notes(best: Candidate | None, candidates: list[Candidate], names: list[str],
           hw: Hardware, by_strategy: tuple[StrategyEstimate, ...], floors: list[Floor]
           ) -> list[str]:
    """Notes under the tables: what pure bf16 would buy, and why DDP does not save memory."""
    notes = [n for n in [faster_pure_bf16_note(best, candidates)] if n]
    if hw.link == "pcie-no-p2p" and hw.num_gpus > 1 and hw.nodes == 1:
        notes.append(f"DataParallel ranks last: {DP_WITHOUT_P2P}" if "dp" in names else
                     f"DataParallel left out: {DP_WITHOUT_P2P} (--strategy dp ranks it anyway, "
                     "last)")
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
    return notes


def rank(candidates: list[Candidate], no_p2p: bool = False) -> list[Candidate]:
    """Best first. Pure bf16 comes after every plan that keeps fp32 master weights, whatever
    its speed, and pure fp16 after pure bf16: their quality notes say they are not neutral, so
    one is the plan only when nothing else fits (faster_pure_bf16_note says what speed it
    would buy). ``no_p2p``: DataParallel,
    which hangs or crawls without peer access (DP_WITHOUT_P2P), comes after everything."""
    # Step times equal to the three digits the table shows (typically: compute hides all
    # communication) are a tie - the estimate is not finer than that. Ties go to the plan that
    # moves fewer bytes, then to the simpler strategy (DDP before the ZeRO stages: fewer
    # moving parts, plain checkpoints), then to the preferred precision (bf16 before fp16, as
    # probe recommends), then to the one with more headroom.
    return sorted(candidates, key=lambda c: (no_p2p and c.strategy == "dp",
                                             NUMERICS[c.precision], float(f"{c.score:.3g}"),
                                             c.traffic_bytes, SIMPLICITY.index(c.strategy),
                                             PRECISION_PREFERENCE.index(c.precision),
                                             c.peak_device_bytes))


def faster_pure_bf16_note(best: Candidate | None, candidates: list[Candidate]) -> str | None:
    """When a pure 16-bit plan would step faster than the recommended one: by how much, and why
    the plan keeps fp32 master weights."""
    faster = [c for c in candidates if NUMERICS[c.precision] and best is not None
              and not NUMERICS[best.precision] and c.step_seconds < best.step_seconds]
    if not faster:
        return None
    f = faster[0]
    dtype = f.precision.removesuffix("-pure")
    why = ("bf16 weights and optimizer state lose small updates" if dtype == "bf16" else
           "fp16 without loss scaling loses small gradients and overflows on large activations")
    return (f"pure {dtype} ({f.strategy} x{f.num_gpus}, micro-batch {f.micro_batch}) would step "
            f"{best.step_seconds / f.step_seconds:.1f}x faster, but it is not neutral for "
            f"quality ({why}); the plan keeps {best.precision} with fp32 master weights")


def _verified(spec: ModelSpec, candidates: list[Candidate], hw: Hardware, budget: Budget,
              alloc: AllocatorConfig, base: TraceConfig, progress: Progress) -> list[Candidate]:
    """The ranking with its head checked by a direct trace at its micro-batch and accumulation
    when the search's sizes were extrapolated or traced without accumulation (as the probe
    checks its maximum); candidates that fail the check are dropped."""
    out = list(candidates)
    for _ in range(3):
        if not out or out[0].verified or not (out[0].extrapolated or out[0].grad_accum > 1):
            break
        c = out.pop(0)
        progress(f"checking {c.strategy} {c.precision} micro-batch {c.micro_batch} with a trace")
        # with the plan's accumulation: from the second micro-batch on, the gradients (or
        # their shards) of the first are alive through the forward and backward (two
        # micro-batches show all of it; the launch line's --grad-accum K repeats it)
        cfg = replace(base, batch_size=c.micro_batch, precision=c.precision,
                      checkpointing=c.checkpointing, grad_accum=min(c.grad_accum, 2))
        st = default_policy(Strategy(c.strategy, c.num_gpus, nodes=c.nodes), c.precision)
        cfg = replace(cfg, precision=trace_precision(st, c.precision))
        e = estimate_strategy(*_traced(spec, cfg, hw), st, budget, alloc,
                              grad_accum=c.grad_accum)
        if e.fits:
            out.insert(0, replace(c, peak_device_bytes=e.peak_device_bytes,
                                  per_gpu_bytes=tuple(g.device_peak_bytes for g in e.gpus),
                                  extrapolated=False, verified=True))
            break
        progress(f"{c.strategy} {c.precision} micro-batch {c.micro_batch} does not fit when "
                 "traced directly; trying the next")
    return out


def _traced(spec: ModelSpec, cfg: TraceConfig, hw: Hardware) -> tuple[Trace, Layout]:
    """One configuration's trace and layout: what every strategy's estimate is built from."""
    return trace_for(spec, cfg, hw.gpu), model_layout(spec, cfg.precision)


def _every_strategy(trace: Trace, layout: Layout, budget: Budget, alloc: AllocatorConfig,
                    strats: list[Strategy], spec: ModelSpec) -> tuple[StrategyEstimate, ...]:
    """Every strategy's estimate at one traced configuration (FSDP's bf16 under its
    mixed-precision policy, from a pure-bf16 trace of the same step)."""
    out = []
    for st in strats:
        st = default_policy(st, trace.config.precision)
        tr, lay = trace, layout
        if st.mixed_precision:
            cfg = replace(trace.config, precision=trace_precision(st, trace.config.precision))
            tr, lay = trace_for(spec, cfg, budget.gpu), model_layout(spec, cfg.precision)
        try:
            out.append(estimate_strategy(tr, lay, st, budget, alloc,
                                         grad_accum=trace.config.grad_accum))
        except ValueError:
            continue
    return tuple(out)


def _tensor_parallel(facts: _Facts, hw: Hardware, budget: Budget, allowed: list[str]
                     ) -> tuple[TensorParallelPlan, ...]:
    """Tensor parallelism of each degree that divides a node's GPUs, DDP across the rest: model
    states per GPU in the leanest allowed precision."""
    p = leanest_precision(allowed)
    world = hw.num_gpus * hw.nodes
    out = []
    for t in range(2, hw.num_gpus + 1):
        if hw.num_gpus % t:
            continue
        need = tensor_parallel_bytes(facts, p, t)
        out.append(TensorParallelPlan(t, world // t, need, need <= budget.limit_bytes))
    return tuple(out)
