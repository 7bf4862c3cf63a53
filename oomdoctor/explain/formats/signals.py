"""Signals caught in native code: UCX's "Caught signal N (...)" and its "==== backtrace" block, absl/glog's
"*** SIGSEGV received by PID", faulthandler's "Fatal Python error: Segmentation fault", a shell's
"Segmentation fault (core dumped)". Which library the backtrace runs through; a bus error is /dev/shm
(formats/host.py explains it), any other signal a native crash."""
from __future__ import annotations

import re

from ..diagnosis import _QUALITY_NONE, _SPEED_NONE, _Ctx, _Out
from ..draft import _Draft
from ..results import Kind, Phase
from .kills import _SIGNALS
from .patterns import _I, _AnchorSpec

_NAMES = {"buserror": 7, "segmentationfault": 11, "aborted": 6, "floatingpointexception": 8,
          "illegalinstruction": 4}

_ANCHORS: tuple[_AnchorSpec, ...] = (
    # UCX (linked into NCCL's IB plugin, MPI, PyTorch builds with UCC) installs handlers that print
    # "[host:pid:0:tid] Caught signal 7 (Bus error: nonexistent physical address)" and a backtrace.
    _AnchorSpec(Kind.NATIVE_CRASH, ("caughtsignal", "backtrace(tid", "received", "fatalpythonerror"), re.compile(
        r"Caughtsignal(?P<n>\d+)\((?P<t>[A-Za-z]+)"
        # absl/glog failure signal handler: "*** SIGSEGV received at time=..." or "*** SIGSEGV (@0x0)
        # received by PID 123 (TID ...)"; glog's older "*** Aborted at 1600000000 (unix time)"
        r"|\*\*\*(?P<s>SIG[A-Z]+)(?:\(@0x[0-9a-f]+\))?receivedby(?:PID|time)|\*\*\*(?P<s2>SIG[A-Z]+)receivedattime"
        # Open MPI's handler: "*** Process received signal ***" then "Signal: Segmentation fault (11)"
        r"|\*\*\*Processreceivedsignal\*\*\*(?:\[[^\]]{0,80}\])?Signal:[A-Za-z]+\((?P<o>\d+)\)"
        # Python's faulthandler
        r"|FatalPythonerror:(?P<f>Segmentationfault|Buserror|Aborted|Floatingpointexception|Illegalinstruction)"
        # a backtrace block whose signal line was cut off
        r"|====backtrace\(tid:\d+\)====", _I), absorb=3000),
)

# Matched per (unsquashed) line by the scanner, like a shell's "Bus error": its meaning depends on being alone.
# bash: "./run.sh: line 4: 1234 Segmentation fault      (core dumped) python train.py"
_SEGFAULT_LINE = re.compile(r"^(?:.*\s)?Segmentation fault(?:\s+\(core dumped\))?"
                            r"(?:\s+(?:python\d?(?:\.\d+)?|torchrun|accelerate|deepspeed|bash|sh|\./\S+|\S+\.py)\b.*)?"
                            r"\.?$")

# A frame of a backtrace that names a library or an NCCL call, and a host name that is a Docker
# container id (12 hex digits: Docker's default hostname) in UCX's or NCCL's line prefix.
_LIB = re.compile(r"/(lib(?!pthread|c\.|dl\.)[\w+-]+)\.so(?:\.[\d.]+)?\b")
_CALL_NAME = re.compile(r"\b((?:cublas|cudnn|nccl|cuda)[A-Z]\w+)\(")
_CONTAINER_HOST = re.compile(r"^\[?([0-9a-f]{12}):\d+")


def _x_signal(span: str, pre: str, m: re.Match) -> _Draft:
    number = int(m.group("n") or m.group("o")) if m.group("n") or m.group("o") else None
    name = (m.group("s") or m.group("s2") or "").upper()
    if number is None and m.group("f"):
        number = _NAMES.get(m.group("f").lower())
    if number is None and name:
        number = next((n for n, s in _SIGNALS.items() if s == name), None)
    if number is None and m.group("t"):
        number = _NAMES.get(m.group("t").lower())
    signal = name or _SIGNALS.get(number or 0, f"signal {number}" if number else "a signal (its line cut off)")
    d = _Draft(Kind.SHARED_MEMORY if signal == "SIGBUS" else Kind.NATIVE_CRASH)
    d.details["signal"] = signal
    d.details["caught"] = "by a signal handler in native code"
    if number is not None:
        d.numbers["signal"] = number
    d.sig = () if d.kind is Kind.SHARED_MEMORY else (signal,)
    return d


_LIBRARY_OF = {"nccl": "libnccl (NCCL)", "cublas": "libcublas (cuBLAS)", "cudnn": "libcudnn (cuDNN)",
               "cuda": "the CUDA runtime/driver"}


def _add_backtrace_evidence(d: _Draft, lines: list[tuple[int, str]]) -> None:
    """The library the backtrace runs through (named by its calls - NCCL's, cuBLAS's - or its .so), and a
    Docker container's host name in the line prefixes."""
    calls: list[str] = []
    libs: list[str] = []
    for _, body in lines:
        calls += [c for c in _CALL_NAME.findall(body) if c not in calls]
        libs += [lib for lib in _LIB.findall(body) if lib not in libs]
        if "container_host" not in d.details and (host := _CONTAINER_HOST.match(body.strip())):
            if any(c.isalpha() for c in host.group(1)) and any(c.isdigit() for c in host.group(1)):
                d.details["container_host"] = host.group(1)
        if "NCCL INFO" in body:
            d.details["nccl_debug_output"] = "yes"
    named = [lib for lib in libs if any(lib.startswith("lib" + k) for k in _LIBRARY_OF)]
    if calls:
        prefix = next(k for k in _LIBRARY_OF if calls[0].startswith(k))
        d.details["library"] = f"{_LIBRARY_OF[prefix]}, in " + ", ".join(c for c in calls[:4] if c.startswith(prefix))
    elif named or libs:
        d.details["library"] = ", ".join((named or libs)[:3])


def _diag_native_crash(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    signal = d.details.get("signal", "a signal").split(" (")[0]
    lib = d.details.get("library")
    where = f" inside {lib}" if lib else ""
    meaning = {"SIGSEGV": "a segmentation fault: native code read or wrote memory it does not own",
               "SIGABRT": "an abort: a C++ exception or a failed check in native code",
               "SIGFPE": "an arithmetic fault in native code (an integer division by zero)",
               "SIGILL": "an illegal instruction: a binary built for a newer CPU than this one"}.get(
        signal, "the process was stopped by a signal in native code")
    out.diag("native_crash", f"The process received {signal}{where} - {meaning}. It is a crash in a compiled "
             "library (or the driver), not a Python error and not a memory shortage"
             + ("; the backtrace names where it happened." if d.details.get("caught") else "."))
    if "NCCL" in (lib or ""):
        out.fix("nccl_debug_info", "Rerun with NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=ALL for more): NCCL's WARN "
                "lines name the call and its error; check that only one NCCL is loaded (the one bundled with the "
                "torch wheel, not a system libnccl via LD_LIBRARY_PATH)", None, None, _SPEED_NONE, _QUALITY_NONE,
                "", cost=0, primary=True)
    out.fix("faulthandler", "Rerun with python -X faulthandler (PYTHONFAULTHANDLER=1) to print the Python stack "
            "at the crash, and update the library the backtrace names (or the driver) to a version built for "
            "this torch", None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0, primary=not lib)
