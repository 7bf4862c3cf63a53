"""From the scanner's drafts to findings: title, phase, each kind's diagnosis and ranked fixes, the result."""
from __future__ import annotations

from .diagnosis import _Ctx, _Out
from .draft import _Draft
from .formats import _DIAGNOSE, _EXPLAINED_BY
from .frames import _phase_of
from .results import _KIND_INFO, Category, ExplainResult, Finding, Kind
from .scanner import _Scanner


def _title(d: _Draft) -> str:
    base = _KIND_INFO[d.kind][1]
    if d.kind is Kind.CUDA_ERROR_OOM and d.details.get("platform") == "ROCm/HIP":
        # The same error from AMD's runtime (hipErrorOutOfMemory); the kind name stays stable.
        base = base.replace("CUDA", "HIP (ROCm)")
    if d.kind is Kind.SHARED_MEMORY and d.details.get("reason") == "permission denied":
        base = "Shared memory (/dev/shm) not writable"
    elif d.kind is Kind.SHARED_MEMORY and d.details.get("reason") == "cannot open":
        base = "Shared memory segment could not be opened"
    elif d.kind is Kind.TF_OOM and d.details.get("severity", "").startswith("warning"):
        base = "TensorFlow allocator warning: ran out of memory for an optional workspace (not a failure)"
    elif d.kind is Kind.CUDA_ERROR_OOM and d.details.get("source", "").startswith("driver: pinned host"):
        base = "CUDA error: out of memory pinning host RAM (not GPU memory)"
    fmt = d.details.get("format")
    if fmt and not fmt.startswith("unknown"):
        base += f" ({fmt} message)"
    for key in ("status", "variable", "signal"):
        if key in d.details and d.kind not in (Kind.SHARED_MEMORY,):
            base += f": {d.details[key]}"
            break
    return base


def _finalise(scanner: _Scanner) -> ExplainResult:
    drafts = sorted((d for ds in scanner.by_kind.values() for d in ds), key=lambda d: d.line)
    kinds = {d.kind for d in drafts}
    drafts = [d for d in drafts if not kinds & _EXPLAINED_BY.get(d.kind, frozenset())]
    kinds = {d.kind for d in drafts}
    # A TensorFlow/XLA driver warning is explained by the framework error that follows it.
    if kinds & {Kind.TF_OOM, Kind.JAX_OOM}:
        drafts = [d for d in drafts if not (d.kind is Kind.CUDA_ERROR_OOM
                                            and d.details.get("source", "").startswith("driver"))]
    memory_ranks = [r for d in drafts if _KIND_INFO[d.kind][0] in (Category.GPU_MEMORY, Category.HOST_MEMORY)
                    for r in d.ranks]
    world = scanner.facts.get("world_size")
    if scanner.ranks_seen:
        world = max(world or 0, max(scanner.ranks_seen) + 1)
    ctx = _Ctx(scanner.facts, world, kinds, memory_ranks, scanner.gpu_model)
    findings = []
    for d in drafts:
        memory = _KIND_INFO[d.kind][0] in (Category.GPU_MEMORY, Category.HOST_MEMORY)
        phase, no_grad = _phase_of(d.frames) if d.frames and memory else (None, False)
        out = _Out()
        _DIAGNOSE[d.kind](d, ctx, phase, no_grad, out)
        held = [v for k in ("this_process", "reserved", "allocated", "in_use")
                if (v := d.numbers.get(k, out.derived.get(k))) is not None]
        out.held = max(held) if held else None
        findings.append(Finding(
            kind=d.kind, title=_title(d), line=d.line, occurrences=d.occurrences,
            ranks=tuple(sorted(d.ranks)), gpus=tuple(sorted(d.gpus)), phase=phase,
            numbers=dict(d.numbers), derived=dict(out.derived), processes=tuple(d.processes),
            collectives=tuple(d.collectives), details=dict(d.details), diagnosis=out.ordered_diagnosis(),
            fixes=out.ranked(), notes=tuple(out.notes), excerpt=d.excerpt))
    return ExplainResult(tuple(findings), scanner.lineno, dict(scanner.facts), scanner.dropped, scanner.skipped)
