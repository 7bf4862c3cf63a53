"""Reading one line: ANSI codes and prefixes (ranks, timestamps, log levels) off, and the keyword pre-filter."""
from __future__ import annotations

import bisect
import re
from itertools import accumulate

# --- line normalisation ----------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")
_WS = re.compile(r"\s+")
_RANK_SPLIT = re.compile(r"(?=\[(?:rank|default)\d+\]:)")
# The prefixes at the start of a line, up to 8 of them, each one of these alternatives; named
# groups carry a rank. One match() takes them all: the repeat never has to backtrack (nothing
# follows it), so it makes the same choices as matching one prefix at a time, without a call and
# a copy of the line per prefix (10-25% less time per line, measured on the test logs and the
# bench log: the reader's hot path).
_PREFIXES = re.compile(
    r"""(?:
      [ \t\u00a0]+                                          # indentation
    | \[(?:rank|default)\s?(?P<r1>\d+)\]:?                  # [rank3]: / torchrun --tee [default0]:
    | \[(?:PG\ [^\]\[]{0,60}?)?Rank\s?(?P<r2>\d+)\]:?          # [Rank 0] (NCCL, DeepSpeed log_dist), [PG 0 Rank 1]
    | \[\d+,(?P<r3>\d+)\]<std(?:out|err)>:                  # OpenMPI --tag-output
    | \[(?P<r5>\d+)\]<std(?:out|err)>:                       # horovodrun: [1]<stderr>:
    | std(?:out|err):\ ?                                    # stderr: (Ray job logs, wrappers)
    | (?:stdout|stderr)\ [FP]\                              # Kubernetes CRI log: <time> stderr F
    | [a-z0-9][\w.\-]*?[-_]\d+\s+\|\ ?                      # docker compose: trainer-1  |
    | \((?:[\w.]+\s+)?pid=\d+(?:,\s*ip=[\d.:a-f]+)?\)       # Ray (pid=123) (Worker pid=1, ip=..)
    | (?P<r4>\d{1,4}):\s                                    # srun --label "3: "
    | \[\d{1,9}\]                                           # [123] line numbers or pids
    | \[\s*\d+\.\d+\]                                        # dmesg: [86400.000037]
    | \[[A-Z][a-z]{2}\ [A-Z][a-z]{2}\s+\d{1,2}\ [\d:]{8}\ \d{4}\]  # dmesg -T: [Tue Mar 12 14:02:31 2024]
    # syslog (RFC 3164) and journalctl -o short-iso: time, host, tag[pid]:
    | (?:[A-Z][a-z]{2}\s+\d{1,2}\ [\d:]{8}|\d{4}-\d\d-\d\dT[\d:]{8}(?:[.,]\d+)?[+-]\d\d:?\d\d)
      \ [\w.\-]+\ [\w.\-/@]+(?:\[\d+\])?:\ ?
    | \d{4}-\d\d-\d\d[T\ ]\d\d:\d\d:\d\d(?:[.,]\d+)?Z?(?:\s?[+-]\d\d:?\d\d)?(?:\s?[-|:])?  # ISO time
    | \[\d{4}-\d\d-\d\d[T\ ][\d:.,]+\]                      # [2023-10-13 17:40:02,544]
    | \d\d:\d\d:\d\d(?:[.,]\d+)?(?=\s)                      # 23:34:07.661
    | [IWEF]\d{3,4}\ [\d:.]+\s+\d+\s[^\]\s]+\]              # glog: E0325 20:57:27.620000 2606 api.py:869]
    | \[[IWEF]\d{3,4}\ [\d:.]+\ [^\]]*\]                    # [E1206 18:44:12.715 ProcessGroupNCCL.cpp:607],
                                                            # c10's unpadded month: [E429 13:55:49.384 ...]
    | \[[IWEF]\ [\w.]+:\d+\]                                # [E ProcessGroupNCCL.cpp:737]
    | [IWEF]\ [\w/\\.:\-]+:\d+\]                            # I tensorflow/core/...cc:692]
    | \[(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\]  # [ERROR]
    | (?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)(?::[\w.<>]*:|\s*[:|\-]\s|\s)  # ERROR:root:
    | \|\s*(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*\|[^|]*?-\s  # loguru | ERROR | mod:fn:1 -
    | [\w.<>]+:[\w.<>]+:\d+\ -\                              # loguru's location: mod:fn:12 -
    | [\w.]+\ -\ (?=(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\ -\ )  # logging: %(name)s - %(levelname)s -
    | E\ {2,}|E\t                                           # pytest
    | >\ ?                                                  # quoted markdown
    | [│┃|]\ ?                                              # rich/box drawing frames
    | SUBPROCESS:\s?
    | !!!\s?Exception\ during\ processing\s?!!!             # ComfyUI
    ){0,8}""",
    re.X,
)


def _strip_prefixes(text: str) -> tuple[int | None, str]:
    m = _PREFIXES.match(text)
    # Each alternative holds at most one capturing group, a named rank: the group closed last is
    # the rank of the last prefix that named one, without asking each name.
    rank = int(m.group(m.lastgroup)) if m.lastgroup is not None else None
    return rank, text[m.end():]


# --- the pre-filter --------------------------------------------------------------------------

# Lower-case substrings; a line without any of them cannot start a message (a region, once open,
# stays open for a tail of quiet lines). Found by find() and by one anchored regex (_ANCHORED
# below), not by an alternation of them all, which tries every keyword at every character (about
# 7x slower than find(), measured). Kept short on purpose: each costs ~0.5 ns/byte of log, and
# words common in healthy multi-GPU logs ("nccl", "p2p" in NCCL INFO lines) would send whole
# logs down the slow path.
_KEYWORDS = (
    "memory", "allocat", "oom", "exhausted", "cublas", "cudnn", "bad_alloc", "killed", "sigkill",
    "signal 9", "exit", "return code", "bus error", "unexpectedly", "paging file", "1455", "keyerror",
    "not set", "ordinal", "device_count", "watchdog", "already in use", "errno", "eacces", "peer",
    "illegal", "device-side", "misaligned", "assertion", "inuse", "params", "parameters =",
    "parameters:", "batch size", "batch_size",
    "accumulat", "world_size", "world size", "nproc", "unable to write", "unable to find", "tried to",
    "'local_rank'", "keyboardinterrupt", "gpu0", "not supported", "10048", "calloc", "rtx 4000",
    # (gates below: keep each keyword's gate a substring of it)
    # NCCL's generic failures (formats/nccl.py): "unhandled cuda/system error", "NCCL error in:",
    # "NCCL Error 1:", and its WARN lines, which name the failed call; a GPU model to weigh causes by
    "unhandled", "nccl error", "nccl failure", "nccl warn", "geforce",
    # any "...Error:" line ("ncclSystemError:", "NCCL_ERROR_REMOTE_ERROR:"), and the last exception of a
    # log that has no known error (explain/exceptions.py)
    "error:", "exception:",
    # mp.spawn's "process 0 terminated with exit code 1" / "... with signal SIGSEGV" (formats/kills.py)
    "terminated with",
    # issue 33: launchers stopping their workers, signals caught in native code (formats/signals.py), NCCL's
    # heartbeat monitor, torchrun's OMP_NUM_THREADS warning, NCCL's P2P lines, the TPU runtime's
    # "Attempting to reserve/allocate", a consumer card named as people write it ("4x RTX 4090")
    "killing subprocess", "caught signal", "backtrace (tid", "fatal python error", "segmentation fault",
    "heartbeat monitor", "omp_num_threads", "enable p2p", "attempting to", "rtx ", "*** sig", "received signal",
)
_TRACEBACK_HINTS = ("Traceback (most recent", 'File "', "File ~", "Cell In[", ".py:")

# Keywords that share a substring rare in healthy logs are searched only when the text has it: one
# find() instead of several for most of a log (the search is the largest part of explain's time on a
# big log).
_GATES = {"kill": ("killed", "sigkill", "killing subprocess"),
          "error": ("bus error", "nccl error", "error:", "keyerror"),
          "not s": ("not set", "not supported"), "param": ("params", "parameters =", "parameters:"),
          "world": ("world_size", "world size"), "unable to ": ("unable to write", "unable to find"),
          "device": ("device_count", "device-side")}
_GATED: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    [(gate, members) for gate, members in _GATES.items()]
    + [(k, (k,)) for k in _KEYWORDS if not any(k in members for members in _GATES.values())])
assert all(gate in k for gate, members in _GATED for k in members) and \
    {k for _, members in _GATED for k in members} == set(_KEYWORDS)

# Keywords with a letter rare in English text and in logs are found together, by one regex whose
# every alternative starts at that letter: re skips from one of these letters to the next in a
# tight loop over the set of first characters (it does so for any pattern whose alternatives all
# start with a literal), and only there checks the rest of the keyword, behind and ahead (fixed-
# width lookarounds). One pass over the text instead of a find() per keyword: on the bench log
# (benchmarks/bench_explain.py) and on prose (docs, test logs) the whole search takes about 30%
# less time. Text dense in these letters (base64) makes the pass slower, never its answer different.
_RARE = "xzqjkvbwyg"    # rarest first: a keyword is anchored at the first of these it has


def _anchor(k: str) -> int:
    """Where `k` has its rarest letter of _RARE; -1 when it has none."""
    return next((k.index(c) for c in _RARE if c in k), -1)


def _anchored(k: str) -> str:
    """`k` as an alternative that starts at its anchor letter: "k(?<=sigk)(?=ill)" for "sigkill"."""
    i = _anchor(k)
    behind, ahead = re.escape(k[:i + 1]), re.escape(k[i + 1:])
    return re.escape(k[i]) + (f"(?<={behind})" if i else "") + (f"(?={ahead})" if ahead else "")


_ANCHORED = tuple(k for k in _KEYWORDS if _anchor(k) >= 0)
_ANCHORED_RX = re.compile("|".join(map(_anchored, _ANCHORED)))
# The others, each searched with find() (behind its gate while the gate has several of them).
_GATED_REST: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (gate, rest) for gate, members in _GATED if (rest := tuple(k for k in members if k not in _ANCHORED)))


def _has_keyword(text: str) -> bool:
    low = text.lower()
    for gate, members in _GATED:
        if gate in low:
            for k in members:
                if k in low:
                    return True
    return False


def _keyword_offsets(text: str) -> list[int] | None:
    """Where keywords are in `text`: at least one offset in each line that holds one, unordered.
    One pass of the anchored regex and one find() pass per other keyword over the whole text,
    instead of a search per line. None when lower-casing changed the text's length (rare Unicode)
    and the text holds a keyword: offsets cannot then be mapped to lines."""
    low = text.lower()
    if len(low) != len(text):
        return None if _has_keyword(text) else []
    # A match takes only its anchor letter, so every keyword is found at its own anchor, whatever
    # overlaps it (and two keywords anchored at one letter are on one line).
    positions = [m.start() for m in _ANCHORED_RX.finditer(low)]
    for gate, members in _GATED_REST:
        if len(members) > 1 and gate not in low:
            continue
        for k in members:
            _find_all(low, k, positions)
    return positions


def _line_starts(lines: list[str]) -> list[int]:
    """Where each of `lines` starts in "\n".join(lines), and one more: the end plus one."""
    return [0, *accumulate(len(line) + 1 for line in lines)]


def _hit_lines(offsets: list[int] | None, starts: list[int]) -> list[int] | None:
    """The indices of the lines (starting at `starts`) that hold the keyword `offsets`, in order."""
    if not offsets:
        return offsets
    return sorted({bisect.bisect_right(starts, pos) - 1 for pos in offsets})


def _has_traceback(text: str, start: int = 0, end: int | None = None) -> bool:
    """Whether text[start:end] holds a traceback hint: bounds, not a slice, so a sub-batch of a
    block is checked without copying it (no hint spans a newline)."""
    for h in _TRACEBACK_HINTS:
        if text.find(h, start, end) >= 0:
            return True
    return False


def _find_all(low: str, k: str, positions: list[int]) -> None:
    """The first position of `k` in each line of `low` that has it."""
    pos = low.find(k)
    while pos >= 0:
        positions.append(pos)
        end = low.find("\n", pos)
        pos = low.find(k, end + 1) if end >= 0 else -1


def _contains(sorted_values: list[int], value: int) -> bool:
    i = bisect.bisect_left(sorted_values, value)
    return i < len(sorted_values) and sorted_values[i] == value
