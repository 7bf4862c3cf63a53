"""Peak GPU memory of one training configuration: trace, add CUDA's extras, replay the allocator.

    oomdoctor estimate sample_models/gpt2_small.py --batch-size 8 --precision bf16 --json

The trace (:mod:`oomdoctor.sim.trace`) gives every tensor storage the step allocates and frees, in
order. Here we add what only exists on a CUDA device - cuBLAS workspaces, allocated through the
caching allocator by the first matmul of the forward thread and of autograd's backward thread -
replay the sequence through :mod:`oomdoctor.sim.allocator` under the card's budget, and attribute the
peak to categories. The card's CUDA context lives outside the allocator and is added on top.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from oomdoctor.configs import checkpointing_label, needs_bf16, no_bf16_fix
from oomdoctor.sim import rocm, versions
from oomdoctor.sim.allocator import AllocatorConfig, ReplayResult, replay
from oomdoctor.sim.gpus import GpuProfile
from oomdoctor.sim.libraries import versions_text
from oomdoctor.models.script import ScriptSpec
from oomdoctor.models.spec import ModelFileError, ModelSpec, kept_for
from oomdoctor.sim.trace import Category, Trace, TraceConfig, trace_training
from oomdoctor.sim.versions import TorchVersion
from oomdoctor.sim.workspaces import (CUBLASLT_WORKSPACE_BYTES, conv_note, conv_workspaces,
                                      norm_upcasts, reduction_scratch, workspace_points)

# The JSON contract's breakdown keys, in display order.
BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries",
                  "allocator_overhead", "cuda_context")
_CATEGORY_KEY = {
    Category.PARAMETERS: "parameters", Category.BUFFERS: "parameters",
    Category.GRADIENTS: "gradients", Category.OPTIMIZER_STATE: "optimizer_state",
    Category.ACTIVATIONS: "activations", Category.INPUTS: "activations",
    Category.TEMPORARIES: "temporaries",
}
DEFAULT_MARGIN = 0.05


@dataclass(frozen=True)
class Budget:
    """What the allocator may reserve on one card."""

    gpu: GpuProfile
    margin: float = DEFAULT_MARGIN       # safety margin, a fraction of the card's capacity
    context_bytes: int | None = None     # None: the profile's CUDA-context estimate
    other_bytes: int = 0                 # memory other processes hold on the card

    @property
    def cuda_context_bytes(self) -> int:
        return self.gpu.context_bytes if self.context_bytes is None else self.context_bytes

    @property
    def limit_bytes(self) -> int:
        # Never negative: a card whose overheads exceed it has nothing left for the allocator.
        return max(0, self.gpu.total_bytes - self.cuda_context_bytes - self.other_bytes
                   - int(self.margin * self.gpu.total_bytes))


@dataclass(frozen=True)
class Estimate:
    """One configuration's predicted peak, with the numbers behind it. Bytes are ints."""

    model: str
    batch_size: int
    precision: str
    checkpointing: bool
    grad_accum: int
    effective_batch_size: int
    gpu: str
    device_total_bytes: int
    budget_bytes: int                   # what the allocator may reserve (capacity - context - other - margin)
    peak_allocated_bytes: int           # torch.cuda.max_memory_allocated()
    peak_reserved_bytes: int            # torch.cuda.max_memory_reserved()
    fits: bool
    breakdown: dict[str, int]           # at the peak; sums to peak_reserved + cuda_context
    peak_phase: str
    peak_step: int                      # the training step of the peak, from 1 (as text and progress count)
    num_parameters: int
    num_trainable_parameters: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    allocator: str                      # PYTORCH_CUDA_ALLOC_CONF the replay used
    num_alloc_retries: int
    top_activations: tuple[tuple[str, int], ...] = ()   # (module, bytes) live at the peak
    notes: tuple[str, ...] = ()
    other_bytes: int = 0                # memory other processes hold (--other), in the budget
    # (name, version) of torch/transformers/peft/bitsandbytes as traced: the installed code
    # decides the answer (oomdoctor.sim.libraries); JSON: {"torch": "2.13.0", ...}
    traced_with: tuple[tuple[str, str], ...] = ()
    # --torch when it names another release than the installed one (sim.versions), else ""
    # (JSON: the key only then)
    modelled_torch: str = ""
    processes: int = 1                  # data-parallel processes (a launched script's)
    autocast_dtype: str = ""            # "bfloat16", "float16"; "" without autocast
    # the weights' dtypes, trainable and frozen (JSON: {"trainable": [...], "frozen": [...]})
    weight_dtypes: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    # with checkpointing: every N-th block, whole ("full") or per op ("op")
    checkpoint_every: int = 1
    checkpoint_policy: str = "full"

    @property
    def device_peak_bytes(self) -> int:
        """What nvidia-smi would show at the peak: reserved + CUDA context."""
        return self.peak_reserved_bytes + self.breakdown["cuda_context"]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["top_activations"] = [{"module": m, "bytes": b} for m, b in self.top_activations]
        d["notes"] = list(self.notes)
        d["traced_with"] = dict(self.traced_with)
        d["weight_dtypes"] = {"trainable": list(self.weight_dtypes[0]),
                              "frozen": list(self.weight_dtypes[1])}
        if not self.modelled_torch:
            del d["modelled_torch"]
        return d


def allocator_conf_string(cfg: AllocatorConfig) -> str:
    parts = []
    if cfg.expandable_segments:
        parts.append("expandable_segments:True")
    if cfg.max_split_size is not None:
        parts.append(f"max_split_size_mb:{cfg.max_split_size // 2**20}")
    return ",".join(parts)


@dataclass(frozen=True)
class DeviceEvents:
    """The trace's events as the CUDA allocator sees them, with cuBLAS workspaces and
    reductions' scratch buffers added."""

    events: list[tuple[bool, int, int]]
    trace_index: list[int]          # for each device event, the trace event index it follows
    workspace_handles: frozenset[int] = field(default_factory=frozenset)
    scratch_handles: frozenset[int] = field(default_factory=frozenset)
    conv_workspaces: dict[int, int] = field(default_factory=dict)   # sim.workspaces


def device_events(trace: Trace, gpu: GpuProfile, sizes: list[int] | None = None,
                  batch: int | None = None) -> DeviceEvents:
    """Insert one BLAS workspace in the first forward and one in the first backward that run
    a matmul, after that matmul's output (each thread's handle gets its own, kept; see
    :mod:`oomdoctor.sim.workspaces` and :func:`blas_workspaces`), and after each reduction
    whose CUDA kernel stages partial sums in global memory its buffer and semaphores, allocated
    and freed (semaphores first: gpu_reduce_kernel's DataPtr locals, Reduce.cuh), and after
    each convolution pass its cuDNN workspace, allocated and freed. ``sizes`` replaces the
    trace's event sizes (the probe's extrapolation to ``batch``: the scratch keeps the traced
    batch's geometry, the convolutions' workspaces are sized at ``batch``)."""
    insert_at: dict[int, list[tuple[int, int]]] = {}
    next_handle = max((h for _, h, _ in trace.events), default=-1) + 1
    for start, size in blas_workspaces(trace, gpu):
        insert_at.setdefault(start, []).append((next_handle, size))
        next_handle += 1
    scratch = reduction_scratch(trace, gpu)
    conv = conv_workspaces(trace, gpu, batch)
    transient = dict(conv)             # allocated after an output, freed at once
    for i, n in norm_upcasts(trace, gpu, batch).items():
        transient[i] = transient.get(i, 0) + n
    scratch_handles: list[int] = []
    events: list[tuple[bool, int, int]] = []
    index: list[int] = []
    for i, (is_alloc, handle, nbytes) in enumerate(trace.events):
        for h, ws_bytes in insert_at.get(i, ()):
            events.append((True, h, ws_bytes))
            index.append(max(i - 1, 0))
        events.append((is_alloc, handle, nbytes if sizes is None else sizes[i]))
        index.append(i)
        if i in scratch:
            buf, sem = next_handle, next_handle + 1
            next_handle += 2
            scratch_handles += (buf, sem)
            events += [(True, buf, scratch[i][0]), (True, sem, scratch[i][1]),
                       (False, sem, scratch[i][1]), (False, buf, scratch[i][0])]
            index += [i] * 4
        if i in transient:
            scratch_handles.append(next_handle)
            events += [(True, next_handle, transient[i]), (False, next_handle, transient[i])]
            index += [i] * 2
            next_handle += 1
    return DeviceEvents(events, index, frozenset(h for hs in insert_at.values() for h, _ in hs),
                        frozenset(scratch_handles), conv)


def blas_workspaces(trace: Trace, gpu: GpuProfile) -> list[tuple[int, int]]:
    """(trace event index, bytes) of each BLAS workspace the step allocates: one cuBLAS
    workspace per thread's handle, and until torch 2.12 cuBLASLt's own where a phase runs a
    GEMM through cuBLASLt (getCUDABlasLtWorkspace, CublasHandlePool.cpp). None for a release
    whose BLAS kept its workspace outside the allocator."""
    ws = workspace_bytes(gpu, trace.config.torch)
    if not ws:
        return []
    out = [(at, ws) for at in workspace_points(trace)]
    if not gpu.is_rocm and not versions.has(trace.config.torch,
                                            versions.CUBLASLT_WORKSPACE_SHARED):
        out += [(at, CUBLASLT_WORKSPACE_BYTES) for at in workspace_points(trace, lt=True)]
    return sorted(out, key=lambda x: x[0])


def workspace_bytes(gpu: GpuProfile, torch_version: TorchVersion | None) -> int:
    """One thread's BLAS workspace from the caching allocator under that torch release."""
    if gpu.is_rocm:
        return rocm.release_workspace_bytes(gpu.arch, gpu.cublas_workspace_bytes, torch_version)
    return gpu.cublas_workspace_bytes


def estimate_trace(trace: Trace, budget: Budget, alloc: AllocatorConfig = AllocatorConfig(),
                   model: str = "", sizes: list[int] | None = None,
                   batch: int | None = None) -> Estimate:
    """Replay a trace under the budget and explain the peak (``sizes``: its events' sizes at
    ``batch``, the probe's extrapolation)."""
    dev = device_events(trace, budget.gpu, sizes, batch)
    limited = replay(dev.events, alloc, budget.limit_bytes)
    fits = limited.oom is None
    # When it does not fit, report what it would need: replay without the limit.
    result: ReplayResult = limited if fits else replay(dev.events, alloc, None)
    at = result.peak_allocated_index
    size_of = {h: n for is_alloc, h, n in dev.events if is_alloc}
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
    live: dict[int, int] = {}
    for is_alloc, h, _ in dev.events[:at + 1]:
        if is_alloc:
            live[h] = size_of[h]
        else:
            live.pop(h, None)
    by_module: dict[str, int] = {}
    for h, n in live.items():
        if h in dev.workspace_handles or h in dev.scratch_handles:
            breakdown["temporaries"] += n
            continue
        s = trace.storages[h]
        breakdown[_CATEGORY_KEY[s.category]] += n
        if s.category is Category.ACTIVATIONS and s.module:
            # Group by the block a storage came from: "transformer.h.3.attn" -> "transformer.h.3"
            key = ".".join(s.module.split(".")[:3])
            by_module[key] = by_module.get(key, 0) + n
    used = sum(breakdown.values())
    breakdown["allocator_overhead"] = result.peak_reserved_bytes - used
    breakdown["cuda_context"] = budget.cuda_context_bytes
    mark = trace.phase_at(dev.trace_index[at]) if dev.trace_index else trace.marks[0]
    cfg = trace.config
    notes = list(trace.notes)
    gpu = budget.gpu
    if gpu.is_rocm and dev.workspace_handles:
        lib = "hipBLASLt" if rocm.prefers_hipblaslt(gpu.arch) else "hipBLAS"
        notes.append(f"ROCm ({gpu.arch}): {len(dev.workspace_handles)} x "
                     f"{workspace_bytes(gpu, cfg.torch) // 2**20} MiB {lib} workspace from the caching "
                     "allocator, one per thread that runs a matmul (PyTorch's default BLAS "
                     "library on this target)")
    modelled = versions.modelled_note(cfg.torch, gpu.is_rocm)
    notes += [n for n in (conv_note(dev.conv_workspaces), modelled) if n]
    if not fits and limited.oom is not None:
        notes.append(f"out of memory in the {trace.phase_at(dev.trace_index[limited.oom_index]).phase.value}"
                     f" of step {trace.phase_at(dev.trace_index[limited.oom_index]).iteration + 1}")
    return Estimate(
        model=model, batch_size=cfg.batch_size, precision=cfg.precision,
        checkpointing=cfg.checkpointing, grad_accum=cfg.grad_accum,
        effective_batch_size=cfg.batch_size * cfg.grad_accum * trace.processes,
        gpu=budget.gpu.name,
        device_total_bytes=budget.gpu.total_bytes, budget_bytes=budget.limit_bytes,
        peak_allocated_bytes=result.peak_allocated_bytes,
        peak_reserved_bytes=result.peak_reserved_bytes, fits=fits, breakdown=breakdown,
        peak_phase=mark.phase.value, peak_step=mark.iteration + 1,
        num_parameters=trace.num_parameters,
        num_trainable_parameters=trace.num_trainable_parameters,
        parameter_bytes=trace.parameter_bytes + trace.buffer_bytes,
        gradient_bytes=trace.gradient_bytes, optimizer_state_bytes=trace.optimizer_state_bytes,
        allocator=allocator_conf_string(alloc), num_alloc_retries=result.num_alloc_retries,
        top_activations=tuple(sorted(by_module.items(), key=lambda kv: -kv[1])[:5]),
        notes=tuple(notes), other_bytes=budget.other_bytes, traced_with=trace.libraries,
        modelled_torch=str(cfg.torch) if modelled else "", processes=trace.processes,
        autocast_dtype=trace.autocast, weight_dtypes=trace.weight_dtypes,
        checkpoint_every=cfg.checkpoint_every, checkpoint_policy=cfg.checkpoint_policy)


def trace_for(spec: ModelSpec, cfg: TraceConfig, gpu: GpuProfile,
              optimizer_from: Trace | None = None, progress=None) -> Trace:
    """Trace with the SDPA kernel choice of the target card. A trace depends on nothing but
    its spec and configuration, so the last few of each spec are kept while the spec lives:
    recommend asks again for the configuration it verifies, and probe's check of expandable
    segments and its plan on several GPUs for the configuration it recommends."""
    cfg = replace(cfg, compute_capability=gpu.compute_capability, gpu_arch=gpu.arch)
    traces = kept_for(_TRACES, spec)
    if cfg not in traces:
        # optimizer_from splices in another trace's optimizer steps, which is the same trace
        # made faster (trace_training raises SpliceMismatch where it would not be): kept too
        traces[cfg] = trace_training(spec, cfg, optimizer_from=optimizer_from, progress=progress)
        while len(traces) > _KEEP_TRACES:
            traces.pop(next(iter(traces)))
    return traces[cfg]


# id(spec) -> (a weak reference to it, its last traces by configuration, oldest first)
_TRACES: dict[int, tuple] = {}
_KEEP_TRACES = 12


def estimate(spec: ModelSpec, cfg: TraceConfig, budget: Budget,
             alloc: AllocatorConfig = AllocatorConfig(), progress=None) -> Estimate:
    """Trace ``cfg`` and estimate its peak on ``budget.gpu``. ``progress(message)`` is told
    which step and phase the trace has reached (see trace.trace_training)."""
    if needs_bf16(cfg.precision) and not budget.gpu.bf16:
        why = (f"{budget.gpu.arch} has no bf16 matrix instructions" if budget.gpu.is_rocm else
               f"compute capability {budget.gpu.compute_capability[0]}."
               f"{budget.gpu.compute_capability[1]} < 8.0")
        raise ValueError(f"{budget.gpu.name} has no bf16 support ({why}); "
                         f"{no_bf16_fix(cfg.precision)}")
    return estimate_trace(trace_for(spec, cfg, budget.gpu, progress=progress), budget, alloc,
                          spec.name)


def script_trace(script: ScriptSpec, cfg: TraceConfig, budget: Budget, *,
                 batch_size: int | None = None, seq_len: int | None = None,
                 progress=None) -> Trace:
    """Run a training script on a fake ``budget.gpu`` for ``cfg.steps`` optimizer steps (see
    :mod:`oomdoctor.sim.script`). ``batch_size`` sets every DataLoader's (and fills
    ``{batch}``); ``seq_len`` fills ``{seq}``."""
    from oomdoctor.sim.fakecuda import FakeGpu
    from oomdoctor.sim.script import trace_script
    gpu = budget.gpu
    fake = FakeGpu(gpu.name, gpu.total_bytes, gpu.compute_capability,
                   max(script.processes, visible_gpus()))
    cfg = replace(cfg, compute_capability=gpu.compute_capability, gpu_arch=gpu.arch)
    return trace_script(script, cfg, fake, batch_size=batch_size, seq_len=seq_len,
                        progress=progress)


def visible_gpus() -> int:
    """GPUs a one-process script sees: those CUDA_VISIBLE_DEVICES names (a DataParallel or a
    split script spreads over them), else one."""
    names = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return max(len(names), 1)


def estimate_script(script: ScriptSpec, cfg: TraceConfig, budget: Budget,
                    alloc: AllocatorConfig = AllocatorConfig(), *, batch_size: int | None = None,
                    seq_len: int | None = None, progress=None) -> Estimate:
    """A training script's peak, as :func:`estimate` gives a model file's (see
    :func:`script_trace`)."""
    trace = script_trace(script, cfg, budget, batch_size=batch_size, seq_len=seq_len,
                         progress=progress)
    refuse_sharded(trace, script, "a one-GPU estimate")
    return estimate_trace(trace, budget, alloc, script.name)


def refuse_sharded(trace: Trace, script: ScriptSpec, what: str) -> None:
    """A script that shards itself with FSDP ran whole on one fake GPU (sim.sharding): only
    its per-GPU replay (`oomdoctor estimate -- ...`) is its memory, never ``what`` of the run."""
    if spreads_itself(trace):
        raise ModelFileError(f"{script.name} {how_it_spreads(trace)}: its memory is per GPU, "
                             "which `oomdoctor estimate -- <this command>` gives; "
                             f"{what} of it is not simulated yet (it would count the whole "
                             "model on one GPU)")


def spreads_itself(trace: Trace) -> bool:
    """Whether a script's run spread its model over GPUs itself (FSDP, DeepSpeed, DataParallel,
    a split): it ran whole on one fake GPU, and only a per-GPU replay is its memory."""
    return any(getattr(trace.model, k, None) is not None
               for k in ("sharding", "spread", "deepspeed"))


def how_it_spreads(trace: Trace) -> str:
    """'shards its model with FSDP', as the script does it."""
    spread = getattr(trace.model, "spread", None)
    if getattr(trace.model, "deepspeed", None) is not None:
        return "runs DeepSpeed's engine (deepspeed.initialize)"
    if spread is None:
        return "shards its model with FSDP"
    if spread.kind == "dp":
        return f"runs DataParallel over {len(spread.devices)} GPUs"
    return "splits its model over two GPUs (dispatch_model)"


def budget_text(e: Estimate) -> str:
    """'22.12 GiB budget (23.69 GiB card - 0.39 GiB CUDA context - 1.18 GiB margin)'."""
    from oomdoctor.sim.allocator import format_size
    context = e.breakdown["cuda_context"]
    margin = e.device_total_bytes - context - e.other_bytes - e.budget_bytes
    other = f" - {format_size(e.other_bytes)} other processes" if e.other_bytes else ""
    return (f"{format_size(e.budget_bytes)} budget ({format_size(e.device_total_bytes)} card - "
            f"{format_size(context)} CUDA context{other} - {format_size(max(margin, 0))} margin)")


def render_text(e: Estimate) -> str:
    """A terminal report of one estimate."""
    from tabulate import tabulate

    from oomdoctor.sim.allocator import format_size

    batch = f"batch {e.batch_size}"
    if e.grad_accum > 1 or e.processes > 1:
        batch = (f"micro-batch {e.batch_size} x {e.grad_accum} accumulation"
                 + (f" x {e.processes} processes" if e.processes > 1 else ""))
    ckpt = (", " + checkpointing_label(e.checkpoint_every, e.checkpoint_policy)
            if e.checkpointing else "")
    head = (f"{e.model}: {batch} (effective {e.effective_batch_size}), "
            f"{e.precision}{ckpt} on {e.gpu} "
            f"({format_size(e.device_total_bytes)})")
    verdict = (f"FITS: peak {format_size(e.peak_reserved_bytes)} reserved" if e.fits else
               f"DOES NOT FIT: needs {format_size(e.peak_reserved_bytes)} reserved") + \
        f" of the {budget_text(e)}; {format_size(e.device_peak_bytes)} on the card with the context"
    rows = [(k.replace("_", " "), format_size(v),
             f"{100 * v / max(e.device_peak_bytes, 1):.1f}%") for k, v in e.breakdown.items()]
    rows.append(("total on the card", format_size(e.device_peak_bytes), "100.0%"))
    lines = [head, verdict, "",
             f"peak allocated {format_size(e.peak_allocated_bytes)} "
             f"(torch.cuda.max_memory_allocated), reserved {format_size(e.peak_reserved_bytes)} "
             f"(max_memory_reserved), in the {e.peak_phase} of step {e.peak_step}",
             f"budget for the allocator {format_size(e.budget_bytes)} (capacity - CUDA context "
             "- safety margin)", "",
             tabulate(rows, headers=("at the peak", "bytes", "share"),
                      colalign=("left", "right", "right")), ""]
    lines.append(f"{e.num_parameters:,} parameters ({e.num_trainable_parameters:,} trainable): "
                 f"weights {format_size(e.parameter_bytes)}, gradients "
                 f"{format_size(e.gradient_bytes)}, optimizer state "
                 f"{format_size(e.optimizer_state_bytes)}")
    lines.append(dtypes_text(e))
    if e.top_activations:
        lines.append("largest activations at the peak: " + ", ".join(
            f"{m or '(top level)'} {format_size(b)}" for m, b in e.top_activations))
    lines += [f"note: {n}" for n in e.notes]
    if e.traced_with:
        lines.append(traced_with_text(e.traced_with))
    return "\n".join(lines)


def dtypes_text(e: Estimate) -> str:
    """'weights float32 (trainable); autocast to bfloat16': what the step computed in."""
    trainable, frozen = e.weight_dtypes
    kinds = [f"{', '.join(d)} ({what})" for d, what in ((trainable, "trainable"),
                                                      (frozen, "frozen")) if d]
    return (f"weights {' and '.join(kinds) or 'none'}; "
            + (f"autocast to {e.autocast_dtype}" if e.autocast_dtype else "no autocast"))


def traced_with_text(versions: tuple[tuple[str, str], ...]) -> str:
    """The line that says which library releases the answer holds for."""
    return (f"traced with {versions_text(versions)}: other releases can allocate differently; "
            "plan with the releases the training uses (a laptop with the same versions will do)")
