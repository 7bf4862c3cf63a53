"""Recommend a configuration: precision x checkpointing x strategy x micro-batch x accumulation.

    oomdoctor recommend sample_models/gpt2_small.py --gpu rtx3090 --num-gpus 2 --target-batch 256

For the effective batch the user wants (``micro-batch x accumulation x data-parallel ranks``),
every combination is checked against the card's budget with :mod:`oomdoctor.parallel` (two traces
per precision x checkpointing, every storage extrapolated to any batch, the allocator replayed per
GPU), what does not fit is dropped, and the rest is ranked by estimated step time:

- compute: the step's FLOPs (``torch.utils.flop_counter`` on the fake forward + backward) over the
  card's datasheet throughput for the precision at :data:`COMPUTE_EFFICIENCY`, +1/3 with
  activation checkpointing (the forward runs twice);
- communication: gradient / parameter bytes over the GPU link (NVLink, PCIe with P2P, or PCIe
  without P2P where NCCL stages through host memory), overlapped with the backward where the
  strategy allows it;
- numerics: configurations that keep fp32 master weights (fp32, AMP) are preferred over pure bf16.

Before tracing, a lower bound - parameters + gradients + optimizer state per GPU - rules out what
cannot fit whatever the batch, so a 7B model on two 24 GiB cards costs no traces at all; the
report then says what would fit (more GPUs, a lighter optimizer, CPU offload, adapters).

Known limitations: times are for ranking, not promises (one efficiency for every kernel, no data
loading, no optimizer-step time); NCCL buffers and DeepSpeed's own buckets are not counted.
"""
from __future__ import annotations

import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

from oomdoctor.allocator import AllocatorConfig
from oomdoctor.estimate import Budget, trace_for
from oomdoctor.gpus import GpuProfile
from oomdoctor.loader import ModelSpec
from oomdoctor.parallel import (STRATEGIES, Layout, Sizes, StrategyEstimate, Strategy,
                                deepspeed_zero3_gpu_bytes, estimate_strategy, model_layout,
                                model_state_floor)
from oomdoctor.trace import Trace, TraceConfig

Progress = Callable[[str], None]

# Share of the datasheet peak that eager PyTorch training reaches on matmul-heavy models (model
# FLOPs utilisation is typically 30-50% without fused kernels); one number for every kernel, so
# the ranking of compute against communication is only indicative.
COMPUTE_EFFICIENCY = 0.4
CHECKPOINT_RECOMPUTE = 1 / 3      # the forward is about a third of forward + backward
BACKWARD_SHARE = 2 / 3            # what an all-reduce can hide behind

# Per-direction GB/s between two GPUs. PCIe 4.0 x16 moves ~25 GB/s; without peer-to-peer access
# (GeForce cards, many consumer boards: `nvidia-smi topo -p2p r` says "NS") NCCL stages through
# pinned host memory, i.e. two PCIe hops - about half. The RTX 3090 / A6000 NVLink bridge is
# 112.5 GB/s both directions (NVIDIA datasheets); data-centre NVLink comes from the profile.
LINKS = ("pcie-no-p2p", "pcie", "nvlink")
_BRIDGE_NVLINK_GBPS = {"rtx3090": 56.25, "a6000": 56.25}

# Numerics: 0 keeps fp32 weights and updates (fp32, or autocast AMP with fp32 master weights);
# 1 stores weights and optimizer state in bf16 (small updates are lost to rounding).
NUMERICS = {"fp32": 0, "fp16": 0, "bf16": 0, "bf16-pure": 1}
# The order a user would rather run them in, all else being equal.
SIMPLICITY = ("single", "ddp", "zero1", "zero2", "zero3", "pipeline2", "dp")
NUMERICS_PENALTY = 1.25           # pure bf16 must be this much faster to be recommended

# Optimizer state per trainable element, in the parameters' dtype, for the lower bound
# (torch/optim/*.py _init_group): Adam/AdamW exp_avg + exp_avg_sq (+ max_exp_avg_sq), SGD with
# momentum a momentum buffer, RMSprop square_avg (+ momentum, grad_avg), Adagrad sum.
def _state_slots(opt: Any) -> int:
    import torch
    d = opt.defaults
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if d.get("amsgrad") else 2
    if isinstance(opt, torch.optim.SGD):
        return 1 if d.get("momentum", 0) else 0
    if isinstance(opt, torch.optim.RMSprop):
        return 1 + bool(d.get("momentum", 0)) + bool(d.get("centered"))
    if isinstance(opt, torch.optim.Adagrad):
        return 1
    return 0        # unknown or factored (Adafactor): keep the bound a bound


@dataclass(frozen=True)
class Hardware:
    """The GPUs to plan for."""

    gpu: GpuProfile
    num_gpus: int
    link: str                   # pcie-no-p2p | pcie | nvlink
    link_gbps: float            # per direction, GB/s (10^9)
    cores: int                  # CPU cores for OMP_NUM_THREADS
    detected: bool = False


def _has_nvlink(gpu: GpuProfile) -> bool:
    return "NVLink" in gpu.interconnect and "no NVLink" not in gpu.interconnect


def default_link(gpu: GpuProfile) -> str:
    """GeForce cards have no PCIe P2P; data-centre cards with NVLink use it; the rest P2P PCIe.
    An optional bridge (RTX 3090, A6000) is not assumed: pass --link nvlink if it is fitted."""
    if _has_nvlink(gpu) and "optional" not in gpu.interconnect:
        return "nvlink"
    if gpu.name.startswith("rtx") or "no P2P" in gpu.interconnect:
        return "pcie-no-p2p"
    return "pcie"


def link_gbps(gpu: GpuProfile, link: str) -> float:
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; choose one of {', '.join(LINKS)}")
    pcie = 12.0 if "PCIe 3.0" in gpu.interconnect else 25.0
    if link == "nvlink":
        if gpu.name in _BRIDGE_NVLINK_GBPS:
            return _BRIDGE_NVLINK_GBPS[gpu.name]
        if _has_nvlink(gpu):
            return gpu.link_gbps
        raise ValueError(f"{gpu.name} has no NVLink; use --link pcie or pcie-no-p2p")
    return pcie if link == "pcie" else pcie / 2


def hardware(gpu: GpuProfile, num_gpus: int, link: str | None = None,
             detected: bool = False) -> Hardware:
    link = link or default_link(gpu)
    return Hardware(gpu, num_gpus, link, link_gbps(gpu, link), os.cpu_count() or 1, detected)


def detect_hardware() -> tuple[GpuProfile, int, str | None] | None:
    """The local CUDA GPUs (profile, count, link), or None without CUDA. Touches CUDA only when
    called, never at import."""
    import torch
    if not torch.cuda.is_available():
        return None
    from oomdoctor.gpus import PROFILES, custom_profile
    props = torch.cuda.get_device_properties(0)
    profile = next((p for p in PROFILES.values()
                    if abs(p.total_bytes - props.total_memory) < 2**30
                    and p.compute_capability == (props.major, props.minor)), None)
    profile = profile or custom_profile(props.total_memory, props.major >= 8,
                                        (props.major, props.minor))
    n = torch.cuda.device_count()
    link = None
    if n > 1:
        link = "pcie" if torch.cuda.can_device_access_peer(0, 1) else "pcie-no-p2p"
    return profile, n, link


# ---------------------------------------------------------------------------------------------
# Step time
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepTime:
    seconds: float
    compute_seconds: float
    communication_seconds: float      # not hidden behind compute
    # Bytes each GPU sends per optimizer step, hidden or not: the tie-break when compute hides
    # every strategy's communication (ZeRO-3 then moves 1.5x DDP's volume per micro-batch for
    # the same step time - more link contention, more NCCL buffers, for nothing).
    traffic_bytes: int = 0


def throughput(gpu: GpuProfile, precision: str) -> float:
    """FLOP/s one GPU sustains: fp32 matmuls run without TF32 by default in PyTorch
    (torch.backends.cuda.matmul.allow_tf32 is False since 1.12), 16-bit ones on tensor cores."""
    peak = gpu.tflops_fp32 if precision == "fp32" else gpu.tflops_16
    return max(peak, 1e-3) * 1e12 * COMPUTE_EFFICIENCY


def step_time(layout: Layout, trace: Trace, strategy: Strategy, hw: Hardware, precision: str,
              checkpointing: bool, micro_batch: int, grad_accum: int,
              boundary_bytes: int = 0) -> StepTime:
    """Seconds per optimizer step (``micro_batch x grad_accum x data-parallel ranks`` samples)."""
    flops = layout.flops_per_sample * micro_batch * (1 + CHECKPOINT_RECOMPUTE * checkpointing)
    t_micro = flops / throughput(hw.gpu, precision)
    bw = hw.link_gbps * 1e9
    n = strategy.num_gpus
    grads = trace.gradient_bytes
    params = trace.parameter_bytes
    ring = (n - 1) / n if n > 1 else 0.0
    compute = grad_accum * t_micro
    comm = 0.0
    traffic = 0.0
    name = strategy.name
    if name == "ddp":
        # Bucketed all-reduce (2(n-1)/n of the gradients per GPU) overlaps the last backward;
        # earlier micro-batches run under no_sync.
        traffic = 2 * ring * grads
        comm = max(0.0, traffic / bw - BACKWARD_SHARE * t_micro)
    elif name == "zero1":
        traffic = 2 * ring * grads + ring * params
        comm = max(0.0, 2 * ring * grads / bw - BACKWARD_SHARE * t_micro) + ring * params / bw
    elif name == "zero2":
        # Gradients reduce-scattered every micro-batch (sharded gradients cannot wait), updated
        # parameters all-gathered once per step.
        traffic = grad_accum * ring * grads + ring * params
        comm = grad_accum * max(0.0, ring * grads / bw - BACKWARD_SHARE * t_micro) \
            + ring * params / bw
    elif name == "zero3":
        # Parameters all-gathered for forward and backward, gradients reduce-scattered: 3x the
        # parameter volume per micro-batch (ZeRO paper, 1.5x DDP), prefetched behind compute.
        traffic = grad_accum * 3 * ring * params
        comm = grad_accum * max(0.0, 3 * ring * params / bw - t_micro)
    elif name == "dp":
        # Replicas broadcast from GPU 0 and gradients reduced onto it every micro-batch, from one
        # Python thread per GPU; nothing overlaps.
        traffic = grad_accum * (n - 1) * (params + grads)
        comm = traffic / bw
    elif name == "pipeline2":
        # Activations forward and their gradients back across the cut, each micro-batch.
        traffic = grad_accum * 2 * boundary_bytes
        comm = traffic / bw
    return StepTime(compute + comm, compute, comm, round(traffic))


# ---------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    """One configuration that fits, with its predicted cost."""

    strategy: str
    num_gpus: int
    precision: str
    checkpointing: bool
    micro_batch: int
    grad_accum: int
    effective_batch: int
    peak_device_bytes: int            # the fullest GPU: reserved + CUDA context
    per_gpu_bytes: tuple[int, ...]
    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    samples_per_second: float
    numerics: str
    score: float                      # step time with the numerics penalty; lower is better
    extrapolated: bool = True         # sizes from the batch-1/2 traces (False: traced directly)
    traffic_bytes: int = 0            # sent per GPU per step (StepTime.traffic_bytes)


@dataclass(frozen=True)
class Floor:
    """Model states alone per GPU: if this exceeds the budget, no batch size can fit."""

    strategy: str
    precision: str
    bytes: int
    fits: bool


@dataclass(frozen=True)
class Launch:
    command: str
    env: dict[str, str]
    snippet: str
    quality_notes: tuple[str, ...]


@dataclass(frozen=True)
class Recommendation:
    model: str
    gpu: str
    num_gpus: int
    link: str
    link_gbps: float
    target_batch: int
    device_total_bytes: int
    budget_bytes: int
    num_parameters: int
    candidates: tuple[Candidate, ...]          # best first
    best: Candidate | None
    launch: Launch | None
    by_strategy: tuple[StrategyEstimate, ...]  # per-GPU memory of every strategy, one config
    by_strategy_config: str
    floors: tuple[Floor, ...]
    alternatives: tuple[str, ...]              # what would fit, when nothing does
    notes: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    # The best plan's samples/s over one GPU's at the same precision and checkpointing (the
    # same effective batch through accumulation); None when one GPU cannot run it.
    speedup: float | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["by_strategy"] = [e.to_json() for e in self.by_strategy]
        return d


@dataclass(frozen=True)
class _Facts:
    """What the lower bound needs, from the model built on fake tensors."""

    num_parameters: int
    num_trainable: int
    state_slots: int
    has_blocks: bool
    blocks_parent: str = ""        # the container of the repeated blocks, e.g. "layers"
    has_batchnorm: bool = False
    largest_leaf_params: int = 0   # DeepSpeed's "largest layer"


def model_facts(spec: ModelSpec) -> _Facts:
    import gc

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomdoctor import emulate
    from oomdoctor.loader import build_checked_model, make_optimizer
    gc.collect()
    with FakeTensorMode():
        model = build_checked_model(spec)
        opt = make_optimizer(spec, model)
        try:
            names = emulate.find_repeated_blocks(model)
            parent = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
        except ValueError:
            names, parent = [], ""
        seen: dict[int, torch.nn.Parameter] = {}
        for p in model.parameters():
            seen.setdefault(p.untyped_storage()._cdata, p)
        bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
        leaf = max((sum(p.numel() for p in m.parameters(recurse=False))
                    for m in model.modules()), default=0)
        return _Facts(sum(p.numel() for p in seen.values()),
                      sum(p.numel() for p in seen.values() if p.requires_grad),
                      _state_slots(opt), bool(names), parent, bn, leaf)


def floor_bytes(facts: _Facts, precision: str, strategy: Strategy,
                state_slots: int | None = None) -> int:
    width = 2 if precision == "bf16-pure" else 4
    slots = facts.state_slots if state_slots is None else state_slots
    return model_state_floor(facts.num_parameters * width, facts.num_trainable * width,
                             facts.num_trainable * width * slots, strategy)


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
            extrapolated=b not in exact, traffic_bytes=t.traffic_bytes))
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
              detail: bool = True, progress: Progress = lambda _: None) -> Recommendation:
    """Search, rank, and explain. ``detail`` traces one configuration to show every strategy's
    per-GPU memory even when the lower bound already rules everything out."""
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
    names = strategies or [s for s in STRATEGIES
                           if hw.num_gpus > 1 or s == "single"]
    strats = []
    for s in names:
        if s == "pipeline2" and hw.num_gpus != 2:
            continue
        strats.append(Strategy(s, 1 if s == "single" else hw.num_gpus))
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
    # Step times equal to the three digits the table shows (typically: compute hides all
    # communication) are a tie - the estimate is not finer than that. Ties go to the plan that
    # moves fewer bytes, then to the simpler strategy (DDP before the ZeRO stages: fewer
    # moving parts, plain checkpoints), then to the one with more headroom.
    candidates.sort(key=lambda c: (float(f"{c.score:.3g}"), c.traffic_bytes,
                                   SIMPLICITY.index(c.strategy), c.peak_device_bytes))
    candidates = _verified(spec, candidates, hw, budget, alloc, base, progress)
    best = candidates[0] if candidates else None
    # Per-GPU memory of every strategy for one configuration: the best's, else the one with the
    # lowest lower bound (to show how far each strategy is from fitting).
    by_strategy: tuple[StrategyEstimate, ...] = ()
    ref = ""
    if detail:
        if best is not None:
            p, ck, b = best.precision, best.checkpointing, best.micro_batch
        else:
            p = min(allowed, key=lambda q: min(f.bytes for f in floors if f.precision == q))
            ck, b = facts.has_blocks, 1
        ref = f"{p}{' + checkpointing' if ck else ''}, micro-batch {b} per GPU"
        progress(f"per-GPU memory of every strategy at {ref}")
        try:
            by_strategy = _every_strategy(spec, replace(base, batch_size=b, precision=p,
                                                        checkpointing=ck), hw, budget, alloc,
                                          strats)
        except ValueError as e:
            errors.append(str(e))
    alternatives = () if best is not None else _alternatives(facts, hw, budget, allowed,
                                                            by_strategy)
    launch = _launch(best, hw, spec, facts) if best is not None else None
    speedup = None
    if best is not None and best.num_gpus > 1:
        one = [c for c in candidates if c.strategy == "single" and c.precision == best.precision
               and c.checkpointing == best.checkpointing]
        if one and best.step_seconds:
            speedup = one[0].step_seconds / best.step_seconds
    notes = []
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
        speedup)


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
                              Strategy(c.strategy, c.num_gpus), budget, alloc,
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
                    ) -> tuple[StrategyEstimate, ...]:
    trace = trace_for(spec, cfg, hw.gpu)
    layout = model_layout(spec, cfg.precision)
    out = []
    for st in strats:
        try:
            out.append(estimate_strategy(trace, layout, st, budget, alloc,
                                         grad_accum=cfg.grad_accum))
        except ValueError:
            continue
    return tuple(out)


def _alternatives(facts: _Facts, hw: Hardware, budget: Budget, allowed: list[str],
                  by_strategy: tuple[StrategyEstimate, ...]) -> list[str]:
    """What would fit when nothing does, each with its numbers."""
    out = []
    lim = budget.limit_bytes
    p = "bf16-pure" if "bf16-pure" in allowed else allowed[-1]
    # What the traced configuration holds besides model states (activations, temporaries,
    # allocator overhead) on the leanest strategy: a realistic margin for the suggestions.
    extra = 0
    zero3 = [e for e in by_strategy if e.strategy == "zero3"]
    if zero3:
        g = max(zero3[0].gpus, key=lambda g: g.peak_reserved_bytes)
        extra = g.peak_reserved_bytes - g.model_state_bytes
    for n in range(hw.num_gpus + 1, 65):
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
        for st in (Strategy("zero3", hw.num_gpus),) + ((Strategy("pipeline2", 2),)
                                                       if hw.num_gpus == 2 else ()):
            need = floor_bytes(facts, p, st, slots) + extra
            if need <= lim:
                out.append(f"a lighter optimizer: {name} with {st.name} on {hw.num_gpus} GPUs "
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
    ds = deepspeed_zero3_gpu_bytes(facts.num_parameters, facts.largest_leaf_params, hw.num_gpus,
                                   offload_optimizer=True)
    cpu = int(facts.num_parameters * 16 * 1.5)
    out.append(f"CPU offload: DeepSpeed ZeRO-3 with offload_optimizer=cpu keeps about "
               f"{ds / 2**30:.1f} GiB of model states per GPU (its estimator: 4L + 2P/N) but "
               f"needs about {cpu / 2**30:.0f} GiB of host RAM (16P x 1.5) and runs the "
               "optimizer on the CPU (slow)")
    frozen = facts.num_parameters * 2
    out.append(f"train adapters instead (LoRA, see sample_models/lora_gpt.py): frozen bf16 "
               f"weights are {frozen / 2**30:.1f} GiB "
               f"({frozen / hw.num_gpus / 2**30:.1f} GiB per GPU split over {hw.num_gpus}), "
               "with gradients and optimizer state only for the adapters")
    return out


# ---------------------------------------------------------------------------------------------
# What to run
# ---------------------------------------------------------------------------------------------

def _launch(c: Candidate, hw: Hardware, spec: ModelSpec, facts: _Facts) -> Launch:
    st = Strategy(c.strategy, c.num_gpus) if c.strategy != "pipeline2" else Strategy(
        "pipeline2", 2)
    procs = st.processes
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           "OMP_NUM_THREADS": str(max(1, hw.cores // procs))}
    gpus = ",".join(str(i) for i in range(c.num_gpus))
    env["CUDA_VISIBLE_DEVICES"] = gpus
    args = f"train.py --batch-size {c.micro_batch} --grad-accum {c.grad_accum}"
    if procs > 1:
        command = f"torchrun --standalone --nproc_per_node={procs} {args}"
    else:
        command = f"python {args}"
    return Launch(command, env, snippet(c, facts.blocks_parent, facts.has_batchnorm),
                  quality_notes(c, facts))


def snippet(c: Candidate, blocks: str = "", batchnorm: bool = False) -> str:
    """The training-loop changes for this configuration, as a short code sketch."""
    distributed = c.strategy in ("ddp", "zero1", "zero2", "zero3")
    lines = ["import os, torch"]
    if distributed:
        lines += ["import torch.distributed as dist",
                  "from torch.utils.data import DataLoader, DistributedSampler",
                  "dist.init_process_group('nccl')                  # torchrun sets RANK etc.",
                  "local_rank = int(os.environ['LOCAL_RANK'])",
                  "torch.cuda.set_device(local_rank)",
                  "device = torch.device('cuda', local_rank)"]
    elif c.strategy == "pipeline2":
        lines += ["from accelerate import dispatch_model",
                  "import json"]
    else:
        lines += ["device = torch.device('cuda', 0)"]
    lines.append("model = build_model()")
    if c.precision == "bf16-pure":
        lines.append("model = model.to(torch.bfloat16)             # pure bf16: weights too")
    where = f"model.{blocks}" if blocks else "model.layers"
    if c.checkpointing:
        lines += ["from torch.utils.checkpoint import checkpoint",
                  "class Checkpointed(torch.nn.Module):           # recompute in backward",
                  "    def __init__(self, block):",
                  "        super().__init__()",
                  "        self.block = block",
                  "    def forward(self, *args, **kwargs):",
                  "        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)",
                  f"for i, block in enumerate({where}):",
                  f"    {where}[i] = Checkpointed(block)"]
    if distributed and batchnorm and c.num_gpus > 1:
        lines.append("model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # global BN")
    ddp = ["model = torch.nn.parallel.DistributedDataParallel(",     # ZeRO-1 is DDP + sharded Adam
           "    model.to(device), device_ids=[local_rank], gradient_as_bucket_view=True)"]
    if c.strategy == "ddp":
        lines += [*ddp, "opt = torch.optim.AdamW(model.parameters(), lr=lr)"]
    elif c.strategy == "zero1":
        lines += ["from torch.distributed.optim import ZeroRedundancyOptimizer", *ddp,
                  "opt = ZeroRedundancyOptimizer(model.parameters(),",
                  "                              optimizer_class=torch.optim.AdamW, lr=lr)"]
    elif c.strategy in ("zero2", "zero3"):
        reshard = "True" if c.strategy == "zero3" else "False"
        lines += ["from torch.distributed.fsdp import fully_shard   # FSDP2, torch >= 2.6",
                  "model.to(device)",
                  f"for block in {where}:         # each block; embeddings and head too",
                  f"    fully_shard(block, reshard_after_forward={reshard})",
                  f"fully_shard(model, reshard_after_forward={reshard})",
                  "opt = torch.optim.AdamW(model.parameters(), lr=lr)"]
    elif c.strategy == "dp":
        lines += ["# prefer DDP (torchrun, one process per GPU); DataParallel loads GPU 0",
                  "model = torch.nn.DataParallel(model.to(device))",
                  "opt = torch.optim.AdamW(model.parameters(), lr=lr)"]
    elif c.strategy == "pipeline2":
        lines += ["# map from: oomdoctor split model.py --gpus 2 --device-map map.json",
                  "plan = json.load(open('map.json'))",
                  "model = dispatch_model(model, device_map=plan['device_map'],",
                  "                       main_device=plan['main_device'])",
                  "device = torch.device('cuda', plan['main_device'])   # inputs go here",
                  "opt = torch.optim.AdamW(model.parameters(), lr=lr)"]
    else:
        lines += ["model.to(device)", "opt = torch.optim.AdamW(model.parameters(), lr=lr)"]
    amp = {"fp16": "torch.float16", "bf16": "torch.bfloat16"}.get(c.precision)
    if c.precision == "fp16":
        lines.append("scaler = torch.amp.GradScaler('cuda')")
    if distributed:
        lines += ["sampler = DistributedSampler(dataset, shuffle=True)",
                  f"loader = DataLoader(dataset, batch_size={c.micro_batch}, sampler=sampler,",
                  "                    num_workers=4, pin_memory=True)"]
    else:
        lines.append(f"loader = DataLoader(dataset, batch_size={c.micro_batch}, shuffle=True, "
                     "num_workers=4, pin_memory=True)")
    lines += [f"K = {c.grad_accum}                             # micro-batches per step",
              "for epoch in range(epochs):"]
    if distributed:
        lines.append("    sampler.set_epoch(epoch)                    # a new shuffle per epoch")
    lines += ["    for i, batch in enumerate(loader):",
              "        batch = [t.to(device, non_blocking=True) for t in batch]",
              "        last = (i + 1) % K == 0"]
    sync = "model.no_sync() if not last else contextlib.nullcontext()" \
        if c.strategy in ("ddp", "zero1") else None
    indent = "        "
    if sync:
        lines.append(f"{indent}with {sync}:      # skip the all-reduce until the last")
        indent += "    "
    if amp:
        lines.append(f"{indent}with torch.autocast('cuda', dtype={amp}):")
        lines.append(f"{indent}    loss = loss_fn(model, batch) / K")
    else:
        lines.append(f"{indent}loss = loss_fn(model, batch) / K")
    lines.append(f"{indent}{'scaler.scale(loss)' if c.precision == 'fp16' else 'loss'}.backward()")
    lines += ["        if last:"]
    if c.precision == "fp16":
        lines += ["            scaler.step(opt)", "            scaler.update()"]
    else:
        lines.append("            opt.step()")
    lines.append("            opt.zero_grad(set_to_none=True)")
    if sync:
        lines.insert(1, "import contextlib")
    return "\n".join(lines)


def quality_notes(c: Candidate, facts: _Facts | None = None) -> tuple[str, ...]:
    """What the configuration changes in training quality, in the users' terms."""
    e = c.effective_batch
    notes = [f"effective batch {e} = micro-batch {c.micro_batch} x {c.grad_accum} accumulation "
             f"x {Strategy(c.strategy, c.num_gpus).data_parallel} data-parallel GPU(s). If your "
             f"learning rate was tuned at batch B, scale it with {e}/B: linearly for SGD (Goyal "
             "et al. 2017, with a few epochs of warm-up), about the square root for Adam/AdamW",
             "gradient accumulation: practically neutral - the summed gradient equals the large "
             "batch's up to float rounding"
             + (" (BatchNorm sees micro-batches only: statistics from "
                f"{c.micro_batch} samples; use SyncBatchNorm or GroupNorm)"
                if facts is not None and getattr(facts, "has_batchnorm", False)
                and c.grad_accum > 1 else ""),
             ]
    if c.precision in ("fp16", "bf16"):
        notes.append(f"{c.precision} AMP: practically neutral (weights, gradients and optimizer "
                     "state stay fp32" + ("; keep the GradScaler - fp16 gradients underflow "
                                          "without it)" if c.precision == "fp16" else ")"))
    elif c.precision == "bf16-pure":
        notes.append("pure bf16 is not neutral: weights and Adam moments keep 8 mantissa bits, "
                     "so updates smaller than ~1/256 of a weight are lost; prefer AMP if it "
                     "fits, or an optimizer with fp32 master weights / Kahan summation")
    else:
        notes.append("fp32: numerics unchanged")
    if c.checkpointing:
        notes.append("activation checkpointing: numerically identical (the forward is re-run, "
                     "about +1/3 compute; dropout RNG state is restored)")
    notes.append("a smaller effective batch is not neutral: noisier gradients, retune the "
                 "learning rate - which is why the plan keeps the batch you asked for")
    if c.strategy in ("ddp", "zero1", "zero2", "zero3"):
        notes.append("data parallelism is neutral in theory: every rank sees a different shard "
                     "(DistributedSampler + set_epoch), gradients are averaged")
        if facts is not None and getattr(facts, "has_batchnorm", False) and c.num_gpus > 1:
            notes.append(f"BatchNorm: without SyncBatchNorm each GPU normalises over its own "
                         f"{c.micro_batch} samples, not the global batch; the snippet converts "
                         "it (one all-reduce per BN layer in the forward, a little slower). "
                         "With large micro-batches plain BatchNorm is usually fine")
    return tuple(notes)


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------

def _duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def render_text(r: Recommendation) -> str:
    from tabulate import tabulate

    def gib(n: int) -> str:
        return f"{n / 2**30:.2f}"
    lines = [f"{r.model} ({r.num_parameters:,} parameters) on {r.num_gpus} x {r.gpu} "
             f"({gib(r.device_total_bytes)} GiB each, {gib(r.budget_bytes)} GiB for the "
             f"allocator), link {r.link} (~{r.link_gbps:g} GB/s), target effective batch "
             f"{r.target_batch}", ""]
    if r.candidates:
        rows = [(i + 1, f"{c.strategy} x{c.num_gpus}", c.precision,
                 "yes" if c.checkpointing else "no", c.micro_batch, c.grad_accum,
                 gib(c.peak_device_bytes), _duration(c.step_seconds),
                 f"{c.samples_per_second:,.0f}", c.numerics.split(":")[0])
                for i, c in enumerate(r.candidates)]
        lines += ["configurations that fit, best first:",
                  tabulate(rows, headers=("#", "strategy", "precision", "ckpt", "micro", "accum",
                                          "GiB/GPU", "step", "samples/s", "numerics"),
                           colalign=("right", "left", "left", "left", "right", "right", "right",
                                     "right", "right", "left")),
                  "(GiB on the fullest GPU incl. CUDA context; times are estimates for ranking: "
                  f"{COMPUTE_EFFICIENCY:.0%} of datasheet FLOP/s, link as above)", ""]
    else:
        lines += [f"NOTHING FITS: no strategy trains {r.model} on {r.num_gpus} x {r.gpu} at any "
                  "micro-batch with the allowed precisions.", ""]
    if r.by_strategy:
        rows = []
        for e in r.by_strategy:
            for i, g in enumerate(e.gpus):
                rows.append((f"{e.strategy} x{e.num_gpus}" if i == 0 else "", g.label,
                             "yes" if g.fits else "NO", gib(g.device_peak_bytes),
                             gib(g.model_state_bytes), gib(g.breakdown["activations"]),
                             gib(g.breakdown["temporaries"] + g.breakdown["communication"])))
        lines += [f"per-GPU memory of each strategy at {r.by_strategy_config}:",
                  tabulate(rows, headers=("strategy", "GPU", "fits", "peak GiB", "model states",
                                          "activations", "temp+comm"),
                           colalign=("left", "left", "left", "right", "right", "right",
                                     "right")), ""]
    if r.floors and not r.candidates:
        precs = list(dict.fromkeys(f.precision for f in r.floors))
        table: dict[str, dict[str, str]] = {}
        for f in r.floors:
            table.setdefault(f"{f.strategy} x{1 if f.strategy == 'single' else r.num_gpus}",
                             {})[f.precision] = gib(f.bytes) + ("" if f.fits else " NO")
        rows = [(s, *[cells.get(p, "") for p in precs]) for s, cells in table.items()]
        lines += [f"parameters + gradients + optimizer state per GPU, GiB (a lower bound; NO: "
                  f"over the {gib(r.budget_bytes)} GiB budget whatever the batch):",
                  tabulate(rows, headers=("strategy", *precs),
                           colalign=("left",) + ("right",) * len(precs)), ""]
    lines += [f"note: {n}" for n in r.notes]
    if r.best is not None and r.launch is not None:
        c, lc = r.best, r.launch
        lines += ["", f"RECOMMENDED: {c.strategy} on {c.num_gpus} GPU(s), {c.precision}"
                  f"{', activation checkpointing' if c.checkpointing else ''}, micro-batch "
                  f"{c.micro_batch} x {c.grad_accum} accumulation = effective batch "
                  f"{c.effective_batch}; {gib(c.peak_device_bytes)} GiB on the fullest GPU, "
                  f"~{_duration(c.step_seconds)} per step"
                  + (f", up to ~{r.speedup:.1f}x the throughput of one GPU (communication "
                     "hidden where it can be; real runs also lose time to synchronisation and "
                     "the data pipeline)" if r.speedup else ""),
                  "",
                  " ".join(f"{k}={v}" for k, v in lc.env.items()) + " \\",
                  f"  {lc.command}", "", "code changes:", "",
                  *["    " + ln for ln in lc.snippet.splitlines()], "", "quality:",
                  *[f"- {n}" for n in lc.quality_notes]]
    if r.alternatives:
        lines += ["", "what would fit:", *[f"- {a}" for a in r.alternatives]]
    lines += [f"error: {e}" for e in r.errors]
    return "\n".join(lines)
