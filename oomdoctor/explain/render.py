"""Rendering an ExplainResult: terminal text (render_text) and a JSON-ready dict (to_json)."""
from __future__ import annotations

import textwrap

from tabulate import tabulate

from .results import BYTE_KEYS, REPORT_KINDS, Category, ExplainResult, Finding
from .sizes import format_bytes

_LABELS = {
    "requested": "requested", "capacity": "total capacity", "free": "free on the GPU",
    "allocated": "allocated by PyTorch", "reserved": "reserved by PyTorch",
    "reserved_unallocated": "reserved but unallocated", "private_pools": "in private pools (CUDA Graphs)",
    "this_process": "this process, incl. non-PyTorch", "limit": "allowed (limit)",
    "other_allocations": "other allocations", "in_use": "in use", "max_in_use": "peak in use",
    "total_allocation": "program total", "temp_allocation": "temporaries", "parameter_allocation": "parameters",
    "other_processes": "other processes", "outside_allocator": "used outside this allocator",
    "non_pytorch_in_process": "non-PyTorch memory in process", "shortfall": "short by (at least)",
    "model_states": "model states (est.)", "activations": "activations (est.)",
    "timeout_ms": "timeout", "elapsed_ms": "ran for", "port": "port", "device": "device index",
    "device_count": "visible devices", "anon_rss": "anon-rss (process RAM)", "total_vm": "total-vm",
    "file_rss": "file-rss", "shmem_rss": "shmem-rss", "pid": "killed PID",
    "nccl_result": "NCCL result code (ncclResult_t)", "exit_code": "exit code", "oom_score": "OOM score",
    "cgroup_usage": "cgroup memory usage", "cgroup_limit": "cgroup memory limit",
    "allocated_peak": "allocated at the peak", "reserved_peak": "reserved at the peak",
    "non_releasable": "non-releasable (free in split segments)",
    "non_releasable_peak": "non-releasable at the peak", "cuda_ooms": "CUDA OOMs so far",
    "alloc_retries": "cudaMalloc retries", "segments": "reserved segments",
    "segments_peak": "reserved segments at the peak",
    "reserved_over_allocated_peak": "reserved peak above allocated peak",
    "releasable_cache": "cached in whole free segments", "fragmentation": "unusable reserve near the peak",
    "host_used": "host RAM in use (last report)", "host_total": "host RAM total",
    "heartbeat_timeout_s": "watchdog stalled for", "nproc_per_node": "processes per node",
    "signal": "signal number", "hbm_capacity": "HBM capacity (TPU core)", "hbm_free": "HBM free",
    "hbm_allocated": "HBM held by live buffers", "hbm_reserved": "HBM reserved (top of memory)",
    "hbm_reservable": "HBM reservable in one piece",
}


_DETAILED_FIXES = 3   # the text output explains the top fixes; --json has every detail


def _fmt_number(key: str, value: int) -> str:
    if key in BYTE_KEYS:
        return format_bytes(value)
    if key.endswith("_ms"):
        return f"{value:,} ms"
    if key.endswith("_s"):
        return f"{value:,} s"
    return str(value)


def _wrap(text: str, indent: str, hang: int = 2, width: int = 100) -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent + " " * hang,
                         break_on_hyphens=False) or [indent]


def render_text(result: ExplainResult, headline: str | None = None,
                fix_effects: dict[str, str] | None = None) -> str:
    """Terminal text: per finding a title line, the numbers (IEC units), the diagnosis, and the
    fixes ranked by what they buy with their speed and quality trade-offs. ASCII only.
    ``headline`` (explain --model: the simulated answer) follows the first line; ``fix_effects``
    (fix id -> what the simulator says it buys) stands in where the log cannot tell."""
    if not result.findings:
        return f"No known error found in {result.lines_read:,} lines.\n"
    notes = sum(f.kind in REPORT_KINDS for f in result.findings)
    out = [f"Found {len(result.findings) - notes} error(s)" + (f" and {notes} note(s) that are not errors"
                                                               if notes else "")
           + f" in {result.lines_read:,} lines."]
    if headline:
        out.extend(_wrap(headline, ""))
    for i, f in enumerate(result.findings, 1):
        out.append("")
        out.append(f"[{i}] {f.title}")
        where = [f"line {f.line}"]
        if f.gpus:
            where.append("GPU " + ", ".join(map(str, f.gpus)))
        if f.ranks:
            where.append(("rank " if len(f.ranks) == 1 else "ranks ") + _ranges(f.ranks))
        if f.occurrences > 1:
            where.append(f"seen {f.occurrences} times")
        if f.phase:
            where.append("during " + f.phase.value.replace("_", " "))
        if f.category is Category.NOT_OOM and f.details.get("memory_related") != "possibly":
            where.append("NOT an out-of-memory error")
        out.append("    " + " | ".join(where))
        out.append("    > " + (f.excerpt if len(f.excerpt) <= 96 else f.excerpt[:93] + "..."))
        rows = [(_LABELS.get(k, k), _fmt_number(k, v)) for k, v in f.numbers.items()]
        rows += [(_LABELS.get(k, k) + " (derived)", _fmt_number(k, v)) for k, v in f.derived.items()]
        rows += [(f"process {p.pid}", format_bytes(p.bytes)) for p in f.processes]
        if rows:
            out.append("  Numbers")
            table = tabulate(rows, tablefmt="plain", colalign=("left", "right"))
            out.extend("    " + line for line in table.splitlines())
        for c in f.collectives[:8]:
            out.append(f"    rank {c.rank if c.rank is not None else '?'}: {c.op}"
                       + (f" SeqNum={c.seq}" if c.seq is not None else "")
                       + (f" numel={c.numel:,}" if c.numel is not None else "")
                       + f" ran {c.elapsed_ms:,} ms (timeout {c.timeout_ms:,} ms)")
        if f.diagnosis:
            out.append("  Diagnosis")
            for dg in f.diagnosis:
                out.extend(_wrap("- " + dg.text, "    "))
        if f.fixes:
            out.append("  Fixes, ranked by what they buy")
            for j, fx in enumerate(f.fixes, 1):
                out.extend(_wrap(f"{j}. {fx.title}", "    ", hang=len(f"{j}. ")))
                pad = " " * (4 + len(f"{j}. "))
                trade = f"speed: {fx.speed} | quality: {fx.quality}"
                if fx.effect_bytes is not None:
                    trade = f"frees: {fx.effect_bound} {format_bytes(fx.effect_bytes)} | {trade}"
                elif fix_effects and fx.id in fix_effects:
                    trade = f"{fix_effects[fx.id]} | {trade}"
                elif fix_effects is not None and f.category is Category.GPU_MEMORY:
                    trade = f"frees: see the simulated answer at the top | {trade}"
                elif f.category is Category.GPU_MEMORY:
                    trade = f"frees: not computable from this log | {trade}"
                out.extend(_wrap(trade, pad))
                if fx.detail and j <= _DETAILED_FIXES:
                    out.extend(_wrap(fx.detail, pad, hang=0))
        for note in f.notes:
            out.extend(_wrap("Note: " + note, "  "))
    if result.dropped_findings:
        out.append("")
        out.append(f"({result.dropped_findings} further distinct errors not shown.)")
    if result.skipped_regions:
        out.append("")
        out.append(f"({result.skipped_regions} part(s) of the log could not be parsed; please report this.)")
    return "\n".join(out) + "\n"


def _ranges(values: tuple[int, ...]) -> str:
    parts: list[str] = []
    start = prev = None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = v
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ", ".join(parts)


def to_json(result: ExplainResult) -> dict:
    """JSON-ready dict: numbers in bytes (ints), diagnosis and fixes as structured data."""
    return {
        "lines_read": result.lines_read,
        "findings": [_finding_json(f) for f in result.findings],
        "context": dict(result.context),
        "dropped_findings": result.dropped_findings,
        "skipped_regions": result.skipped_regions,
    }


def _finding_json(f: Finding) -> dict:
    return {
        "kind": f.kind.value,
        "category": f.category.value,
        "title": f.title,
        "cause": f.cause,
        "line": f.line,
        "occurrences": f.occurrences,
        "ranks": list(f.ranks),
        "gpu": f.gpu,
        "gpus": list(f.gpus),
        "phase": f.phase.value if f.phase else None,
        "numbers": dict(f.numbers),
        "derived": dict(f.derived),
        "processes": [{"pid": p.pid, "bytes": p.bytes} for p in f.processes],
        "collectives": [{"rank": c.rank, "seq": c.seq, "op": c.op, "numel": c.numel,
                         "timeout_ms": c.timeout_ms, "elapsed_ms": c.elapsed_ms} for c in f.collectives],
        "details": dict(f.details),
        "diagnosis": [{"cause": d.cause, "text": d.text} for d in f.diagnosis],
        "fixes": [{"id": x.id, "title": x.title, "effect_bytes": x.effect_bytes, "effect_bound": x.effect_bound,
                   "speed": x.speed, "quality": x.quality, "detail": x.detail} for x in f.fixes],
        "notes": list(f.notes),
        "excerpt": f.excerpt,
    }
