"""Kills in every form, matched by meaning: shells' job reports, launchers' exit codes (-9, 137, SIGKILL),
the kernel OOM killer's wordings since 3.x and its cgroup forms; and rank failures that are not kills
(exit codes 1, -6, -11, ...), with what each code means and where the rank's real error is."""
from __future__ import annotations

import re

from ..diagnosis import _QUALITY_NONE, _SPEED_NONE, _Ctx, _Out
from ..draft import _Draft
from ..evidence import _host_memory_diag
from ..results import Kind, Phase
from .patterns import _I, _AnchorSpec

# --- shells (matched per unsquashed line by the scanner) ---------------------------------------

# What a shell prints for a child killed by SIGKILL: bash "./run.sh: line 7: 48213 Killed   python x.py"
# and its job table "[1]+  Killed   python x.py", dash "./run.sh: 3: Killed", zsh "zsh: killed  python
# x.py" and "[1]  + 48213 killed  python x.py", macOS "Killed: 9", Slurm "srun: error: node: task 0:
# Killed", and a bare "Killed" - also right after a progress bar that had no newline.
_KILLED_LINE = re.compile(
    r"^(?:.*?:\s+(?:line\s\d+:\s+)?(?:\d+:\s+)?(?:task\s\d+:\s+)?(?:\d+\s+)?"   # "<who>: [line N:] [PID]"
    r"|\[\d+\]\s*[+-]?\s+(?:\d+\s+)?|[+-]\s+(?:\d+\s+)?|\d+\s+"                               # job tables, PIDs
    r"|.*?(?:it/s|s/it|\d%|\||\])\]?\s*"                                         # after a progress bar
    r")?[Kk]illed(?::\s?9)?"
    r"(?:\s{2,}\S.*|\s+(?:python\d?(?:\.\d+)?|torchrun|accelerate|deepspeed|srun|bash|sh|\./\S+|\S+\.py)\b.*)?$")
# fish: "fish: Job 1, 'python train.py' terminated by signal SIGKILL (Forced quit)" is an anchor below.

# --- message anchors (squashed text) -----------------------------------------------------------

# torchrun's exit codes that other kinds own: -9/137 SIGKILL (OOM_KILLER), -7 SIGBUS (SHARED_MEMORY).
_NOT_A_FAILURE = r"(?!-9(?!\d)|-7(?!\d)|137(?!\d)|0(?!\d))"


def _x_launcher_stop(span: str, pre: str, m: re.Match) -> _Draft:
    """A launcher stopping its workers, the exit code not in the region (merged into a coded report, or
    left out for one, by findings.py)."""
    d = _Draft(Kind.RANK_FAILED)
    if m.group(0).lower().startswith("killing"):
        who = "DeepSpeed's launcher" if "sigkill_handler" in pre[-60:].lower() else "the launcher"
        d.details["source"] = f"{who} killed the other workers ('Killing subprocess N')"
    else:
        d.details["source"] = "torchrun raised ChildFailedError (its failure table is not in the log)"
    d.sig = (None,)
    return d


_ANCHORS: tuple[_AnchorSpec, ...] = (
    _AnchorSpec(Kind.OOM_KILLER, ("outofmemory", "killedprocess", "killprocess", "sigkill", "out_of_memory",
                                  "killed:9", "exitstatus-9"), re.compile(
        # the kernel (mm/oom_kill.c): 3.x-4.x "Out of memory: Kill process N (comm) score S or sacrifice
        # child" + "Killed process N (comm) total-vm:..."; 4.19+ "Out of memory: Killed process N ...";
        # the cgroup forms "Memory cgroup out of memory: Kill(ed) process ..."; a lone "Killed process" line
        # (no guard before a lone "Killed process": the line before it, squashed onto it, may end in a letter)
        r"(?:Memorycgroup)?outofmemory:Kill(?:ed)?process|Killedprocess\d+,?(?:UID:?\d+,?)?\("
        # Python's subprocess (accelerate launch), fish, Slurm's task and job state, macOS shells
        r"|diedwith<Signals\.SIGKILL:9>|returnednon-zeroexitstatus-9(?!\d)|terminatedbysignalSIGKILL"
        r"|task\d+:OutOfMemory|(?<!ERROR_)(?<!STATUS_)OUT_OF_MEMORY|(?<![A-Za-z])Killed:9(?!\d)", _I), absorb=120),
    # Rank failures that are not kills: torchrun's line and table, DeepSpeed's launcher, mp.spawn,
    # accelerate's CalledProcessError.
    _AnchorSpec(Kind.RANK_FAILED, ("exitcode", "returncode", "exitstatus", "terminatedwith", "receivedbypid"),
                re.compile(
        rf"failed\(exitcode:{_NOT_A_FAILURE}(?P<a>-?\d+)\)|exitcode:{_NOT_A_FAILURE}(?P<b>-?\d+)\(pid:"
        rf"|exitswithreturncode=?{_NOT_A_FAILURE}(?P<c>-?\d+)|terminatedwithexitcode{_NOT_A_FAILURE}(?P<d>\d+)"
        rf"|returnednon-zeroexitstatus{_NOT_A_FAILURE}(?P<e>-?\d+)"
        r"|terminatedwithsignal(?P<s>SIG(?!KILL)[A-Z]+)|Signal(?P<n>\d+)\((?P<t>SIG(?!KILL|BUS)[A-Z]+)\)"
        r"receivedbyPID", _I), absorb=600),
    # The launcher's report that a worker exited, when the line with its exit code is not in the log:
    # DeepSpeed's and torch.distributed.launch's "Killing subprocess N" (their sigkill_handler stops the
    # other workers), torchrun's ChildFailedError. Only where no exit code is in the same region.
    _AnchorSpec(Kind.RANK_FAILED, ("killingsubprocess", "childfailederror"), re.compile(
        r"Killingsubprocess(?=\d)|(?<![A-Za-z])ChildFailedError(?![A-Za-z])", _I), absorb=3000, fallback=True,
        extract=_x_launcher_stop),
)

# --- evidence from the region's lines -------------------------------------------------------

_CGROUP = re.compile(r"memory: usage (\d+)\s?kB, limit (\d+)\s?kB", re.I)
_OOM_TASK = re.compile(r"oom-kill:constraint=(\w+).*?task=([^,]{1,64}),pid=(\d+)", re.I)
_SCORE = re.compile(r"Kill process (\d+) \(([^)]{1,64})\) score (\d+)", re.I)
_RSS = re.compile(r"Killed process (\d+),? (?:UID:? ?\d+,? )?\(([^)]{1,64})\),? (?:UID:? ?\d+,? )?"
                  r"total[-_]vm[:=]\s?([\d,]+)\s?kB,? anon[-_]rss[:=]\s?([\d,]+)\s?kB", re.I)


def _add_kill_evidence(d: _Draft, lines: list[tuple[int, str]]) -> None:
    """The kernel's dump around the kill: the cgroup's usage and limit, the constraint, the victim."""
    for _, body in lines:
        if (m := _CGROUP.search(body)) and "cgroup_limit" not in d.numbers:
            d.numbers["cgroup_usage"], d.numbers["cgroup_limit"] = int(m.group(1)) * 1024, int(m.group(2)) * 1024
        if (m := _OOM_TASK.search(body)) and "constraint" not in d.details:
            d.details["constraint"] = m.group(1)
            d.details.setdefault("process", m.group(2))
            d.numbers.setdefault("pid", int(m.group(3)))
        if (m := _SCORE.search(body)) and "oom_score" not in d.numbers:
            d.numbers.setdefault("pid", int(m.group(1)))
            d.details.setdefault("process", m.group(2))
            d.numbers["oom_score"] = int(m.group(3))
        if (m := _RSS.search(body)) and "anon_rss" not in d.numbers:
            d.numbers.setdefault("pid", int(m.group(1)))
            d.details.setdefault("process", m.group(2))
            d.numbers["total_vm"] = int(m.group(3).replace(",", "")) * 1024
            d.numbers["anon_rss"] = int(m.group(4).replace(",", "")) * 1024
    if d.details.get("constraint", "").upper() == "CONSTRAINT_MEMCG" or "cgroup_limit" in d.numbers:
        d.details["source"] = "kernel OOM killer inside a cgroup (container/Slurm/Kubernetes memory limit)"


# --- rank failures ---------------------------------------------------------------------------

# POSIX signal numbers (signal(7)); torchrun reports a child killed by signal N as exitcode -N, a shell
# or container as 128 + N.
_SIGNALS = {1: "SIGHUP", 2: "SIGINT", 4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL",
            11: "SIGSEGV", 13: "SIGPIPE", 15: "SIGTERM"}
_MEANING = {
    "1": "the rank's Python process exited on an uncaught exception (or sys.exit(1))",
    "2": "the script exited with a usage error (argparse prints it just above)",
    "SIGABRT": "the process aborted: a C++ exception or failed check in native code (\"terminate called after "
               "throwing an instance of ...\", a CUDA or NCCL error raised from a background thread)",
    "SIGSEGV": "a segmentation fault in native code: a crash in a compiled extension, a library or the driver "
               "- not a Python error and not a memory shortage",
    "SIGTERM": "the launcher or scheduler stopped it: torchrun terminates every other rank when one fails, and "
               "Slurm/Kubernetes send SIGTERM at a time limit or eviction",
    "SIGINT": "it was interrupted (Ctrl-C)",
    "SIGFPE": "a floating-point exception in native code (an integer division by zero)",
    "SIGILL": "an illegal instruction: a binary built for a newer CPU than this one",
}
_CODE = re.compile(r"-?\d+")


# torchrun's failure table, one entry per failed rank: "rank : 2 (local_rank: 2) exitcode : 1 (pid: 3167)".
_TABLE_ENTRY = re.compile(r"(?<![A-Za-z_])rank:(\d+)\(local_rank:\d+\)exitcode:(-?\d+)\(pid")


def _x_rank_failed(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.RANK_FAILED)
    code = next((m.group(g) for g in "abcde" if m.group(g) is not None), None)
    signal = m.group("s") or m.group("t")
    if code is not None:
        value = int(code)
        d.numbers["exit_code"] = value
        number = -value if value < 0 else value - 128 if 128 < value < 160 else None
        signal = signal or _SIGNALS.get(number or 0)
    if signal:
        d.details["signal"] = signal.upper()
    rank = re.search(r"local_rank[:=](\d+)|rank:(\d+)\(local_rank|[Pp]rocess(\d+)terminated", pre[-80:] + span[:200])
    if rank is None and m.group("c") is not None:
        # DeepSpeed's line names the worker in its command before the code: "[..., '--local_rank=1', ...] exits"
        rank = re.search(r"--local_rank=(\d+)", pre[-600:])
    if rank:
        d.ranks.append(int(next(g for g in rank.groups() if g is not None)))
    # The other entries of the same table, which this one absorbed: every rank that failed the same way.
    for entry in _TABLE_ENTRY.finditer(span[:4000]):
        if code is not None and int(entry.group(2)) == int(code) and int(entry.group(1)) not in d.ranks:
            d.ranks.append(int(entry.group(1)))
    d.sig = (d.details.get("signal") or d.numbers.get("exit_code"),)
    return d


def _diag_rank_failed(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    code, signal = d.numbers.get("exit_code"), d.details.get("signal")
    if code is None and signal is None:
        _diag_launcher_stop(d, ctx, out)
        return
    meaning = _MEANING.get(signal or "") or _MEANING.get(str(code), "the rank's process ended with an error")
    what = f"exit code {code}" if code is not None else signal
    ranks = ("Rank(s) " + ", ".join(map(str, d.ranks))) if d.ranks else "The failed rank"
    out.diag("rank_failed_not_the_error", f"This line is the launcher's summary, not the error: {what} "
             f"{'(' + signal + ') ' if signal and code is not None else ''}means {meaning}. {ranks} "
             "printed the real error - its traceback is above in this log, or in that rank's own log when "
             "output was redirected; the other ranks' SIGTERM is the launcher stopping them.")
    out.fix("find_rank_traceback", "Find rank " + (str(d.ranks[0]) if d.ranks else "N") + "'s own traceback: "
            "search this log for 'Traceback' with that rank's prefix; with torchrun --redirects 3 --log-dir logs "
            "each rank's stderr is in logs/<run id>/attempt_0/<rank>/stderr.log", None, None, _SPEED_NONE,
            _QUALITY_NONE, "", cost=0, primary=True)
    out.fix("record_decorator", "Make torchrun's failure table carry the traceback: decorate main with @record "
            "(from torch.distributed.elastic.multiprocessing.errors import record), which writes it to "
            "TORCHELASTIC_ERROR_FILE", None, None, _SPEED_NONE, _QUALITY_NONE, "The table's error_file and "
            "traceback fields then show the exception instead of <N/A>.", cost=0)
    if signal == "SIGSEGV":
        out.fix("faulthandler", "Rerun with python -X faulthandler (or PYTHONFAULTHANDLER=1) to print the Python "
                "stack at the crash", None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0)


def _diag_launcher_stop(d: _Draft, ctx: _Ctx, out: _Out) -> None:
    out.diag("rank_failed_not_the_error", f"The run was stopped: {d.details.get('source', 'a worker failed')}. "
             "That is the launcher's report that one worker exited, not the error; the line with its exit code is "
             "not in this log (cut off, or not pasted). The worker printed its own error above, in its output; if "
             "it printed none, it was killed - most often by the kernel's OOM killer when host RAM ran out.")
    _host_memory_diag(d, ctx, out)
    out.fix("find_rank_traceback", "Find the failed worker's own traceback or exit code: search the full log for "
            "'Traceback' and 'exits with return code' / 'exitcode'; with torchrun --redirects 3 --log-dir logs "
            "each rank's stderr is in logs/<run id>/attempt_0/<rank>/stderr.log", None, None, _SPEED_NONE,
            _QUALITY_NONE, "", cost=0, primary=True)
    out.fix("confirm_kill", "Check for a kill on that machine: dmesg -T | grep -i 'killed process' (or journalctl "
            "-k); a return code of -9 means the worker was killed", None, None, _SPEED_NONE, _QUALITY_NONE, "",
            cost=0, primary=True)
