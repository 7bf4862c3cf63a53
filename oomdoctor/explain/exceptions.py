"""The last exception of a log that holds no known error: its type and message, and whether it is
memory-related and why (so a traceback never reads as "no known error")."""
from __future__ import annotations

import re

from .diagnosis import _QUALITY_NONE, _SPEED_NONE, _Ctx, _Out
from .draft import _Draft
from .results import Kind, Phase

# "ValueError: ...", "torch.distributed.DistBackendError: ...", "Error: ...". Not KeyboardInterrupt: a
# person stopped the run (DataParallel's hang is the one Ctrl-C explain reads, formats/launch.py).
_EXCEPTION_LINE = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*(?:[A-Za-z_]\w*)?(?:Error|Exception|Failure))"
                             r"(?::\s?(?P<message>.*)|\s*)$")
# Launchers' wrappers around a rank's failure: the rank's own exception is the one to explain.
_WRAPPERS = re.compile(r"ChildFailedError|CalledProcessError|ProcessExitedException|SubprocessError$")
# Words of a memory shortage in an exception's type or message that no known format matched.
_MEMORY_WORDS = re.compile(r"out of memory|\bOOM\b|memory|alloc|RESOURCE_EXHAUSTED|ENOMEM|errno 12|killed",
                           re.I)


def _exception_line(body: str) -> re.Match | None:
    """The line, when it is an exception's last line (not a launcher's wrapper)."""
    if "Error" not in body and "Exception" not in body and "Failure" not in body:
        return None
    m = _EXCEPTION_LINE.match(body.strip())
    return m if m and not _WRAPPERS.search(m.group("type")) else None


def _exception_draft(m: re.Match) -> _Draft:
    d = _Draft(Kind.EXCEPTION)
    d.details["exception"] = m.group("type")[:120]
    message = (m.group("message") or "").strip()
    if message:
        d.details["message"] = message[:300]
    words = _MEMORY_WORDS.search(m.group(0))
    d.details["memory_related"] = "possibly" if words else "no"
    if words:
        d.details["memory_words"] = words.group(0)
    d.sig = (d.details["exception"], message[:300])
    return d


def _cut_traceback_draft() -> _Draft:
    """A Python traceback whose exception line is not in the log (the excerpt stops inside it)."""
    d = _Draft(Kind.EXCEPTION)
    d.details["exception"] = "a Python traceback cut before its exception line"
    d.details["memory_related"] = "unknown"
    d.sig = ("cut traceback",)
    return d


def _diag_exception(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    exc, words = d.details.get("exception", "the exception"), d.details.get("memory_words")
    where = f" The innermost frame is {d.frames[-1].func}() in {d.frames[-1].file}." if d.frames else ""
    if d.details.get("memory_related") == "unknown":
        out.diag("traceback_cut", "The log has a Python traceback, but the excerpt stops before its last line - "
                 "the exception's type and message, which say what failed." + where)
        out.fix("paste_exception_line", "Get the lines after the last frame (the full log, or the rank's own "
                "output) and run explain on them: the exception line decides whether this is a memory error",
                None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0, primary=True)
        return
    if words:
        out.diag("unrecognised_possibly_memory", f"The log ends in {exc}, which is not one of the out-of-memory "
                 f"messages explain knows, but its text says '{words}': it may be a memory error in a wording "
                 "this version does not read." + where)
        out.fix("read_exception", "Check the message against the GPU and host memory at the time (nvidia-smi, "
                "free -h); if it is a memory error, the fixes of a CUDA OOM apply", None, None, _SPEED_NONE,
                _QUALITY_NONE, "Please report the message so explain learns it.", cost=0, primary=True)
        return
    out.diag("not_memory_related", f"The log's last error is {exc}, and neither its type nor its message "
             "mentions memory, allocation, OOM or a kill: it is not an out-of-memory error but a program or "
             "data error, and the message says what went wrong." + where)
    out.fix("read_exception", "Fix what the message says at the innermost frame of your own code; "
            "rerun with one process (no launcher) to see it without other ranks' output", None, None, _SPEED_NONE,
            _QUALITY_NONE, "", cost=0, primary=True)
