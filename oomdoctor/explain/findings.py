"""From the scanner's drafts to findings: title, phase, each kind's diagnosis and ranked fixes, the result."""
from __future__ import annotations

from .diagnosis import _Ctx, _Out
from .draft import _Draft
from .evidence import _dataparallel_diag
from .formats import _DIAGNOSE, _EXPLAINED_BY
from .frames import _phase_of
from .results import _KIND_INFO, REPORT_KINDS, Category, ExplainResult, Finding, Kind
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
    elif d.kind is Kind.JAX_OOM and d.details.get("device") == "TPU":
        base = "XLA out of TPU memory (HBM, RESOURCE_EXHAUSTED)"
    elif d.kind is Kind.NCCL_TIMEOUT and d.details.get("heartbeat") and not d.collectives:
        base = "NCCL watchdog stuck: the heartbeat monitor aborted the process"
    fmt = d.details.get("format")
    if fmt and not fmt.startswith("unknown"):
        base += f" ({fmt} message)"
    for key in ("status", "variable", "signal"):
        if key in d.details and d.kind not in (Kind.SHARED_MEMORY,):
            base += f": {d.details[key]}"
            break
    return base


def _launcher_reports(drafts: list[_Draft]) -> list[_Draft]:
    """A launcher's stop without an exit code ("Killing subprocess", a bare ChildFailedError) says less than
    a report with one: it is left out when the log has one, and the ranks it names go to it."""
    coded = [d for d in drafts if d.kind is Kind.RANK_FAILED and (d.numbers or d.details.get("signal"))]
    if not coded:
        return drafts
    return [d for d in drafts if d.kind is not Kind.RANK_FAILED or d in coded]


def _adopt_failed_ranks(drafts: list[_Draft], dropped: list[_Draft]) -> None:
    """The only error of a log that names no rank takes the ranks the launcher's failure report names (the
    report itself is left out: the error explains it)."""
    errors = [d for d in drafts if d.kind not in REPORT_KINDS]
    ranks = sorted({r for d in dropped if d.kind is Kind.RANK_FAILED for r in d.ranks})
    if len(errors) == 1 and not errors[0].ranks and ranks:
        errors[0].ranks = ranks


def _finalise(scanner: _Scanner) -> ExplainResult:
    drafts = _launcher_reports(sorted((d for ds in scanner.by_kind.values() for d in ds), key=lambda d: d.line))
    kinds = {d.kind for d in drafts}
    kept = [d for d in drafts if not kinds & _EXPLAINED_BY.get(d.kind, frozenset())]
    _adopt_failed_ranks(kept, [d for d in drafts if d not in kept])
    # Reports (a memory summary, torchrun's OMP warning) after the errors.
    drafts = sorted(kept, key=lambda d: (d.kind in REPORT_KINDS, d.line))
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
        _dataparallel_diag(d, ctx, out)
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
