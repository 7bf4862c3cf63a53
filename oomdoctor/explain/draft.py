"""A finding under construction (_Draft) and how repeats of the same error are merged into one."""
from __future__ import annotations

from .frames import _Frame
from .limits import _MAX_RANKS
from .results import Collective, Kind, ProcessUse


class _Draft:
    """A finding under construction; equal drafts (same error repeated) are merged."""

    __slots__ = ("kind", "line", "excerpt", "numbers", "details", "processes", "collectives",
                 "ranks", "gpus", "frames", "occurrences", "sig")

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self.line = 0
        self.excerpt = ""
        self.numbers: dict[str, int] = {}
        self.details: dict[str, str] = {}
        self.processes: list[ProcessUse] = []
        self.collectives: list[Collective] = []
        self.ranks: list[int] = []
        self.gpus: list[int] = []
        self.frames: list[_Frame] = []
        self.occurrences = 1
        self.sig: tuple = ()


def _compatible(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    shared = False
    for x, y in zip(a, b):
        if x is not None and y is not None:
            if x != y:
                return False
            shared = True
    return shared or all(x is None for x in a + b)


def _seq(c: Collective) -> int:
    return -1 if c.seq is None else c.seq


def _merge(into: _Draft, other: _Draft) -> None:
    """Fold a repeat of the same error into `into`; the earliest occurrence's figures win
    (regions of different ranks are not necessarily parsed in line order)."""
    if (other.line, min(other.ranks, default=-1)) < (into.line, min(into.ranks, default=-1)):
        into.line, other.line = other.line, into.line
        into.excerpt, other.excerpt = other.excerpt, into.excerpt
        into.numbers, other.numbers = other.numbers, into.numbers
        into.details, other.details = other.details, into.details
        into.processes, other.processes = other.processes, into.processes
        into.frames, other.frames = other.frames, into.frames
    into.occurrences += 1
    for r in other.ranks:
        if r not in into.ranks and len(into.ranks) < _MAX_RANKS:
            into.ranks.append(r)
    for g in other.gpus:
        if g not in into.gpus and len(into.gpus) < 64:
            into.gpus.append(g)
    for k, v in other.numbers.items():
        into.numbers.setdefault(k, v)
    for k, v in other.details.items():
        into.details.setdefault(k, v)
    if into.details.get("format") in ("torch>=2.1", "unknown (truncated)") and \
            other.details.get("format") not in (None, "torch>=2.1", "unknown (truncated)"):
        into.details["format"] = other.details["format"]
    if not into.processes:
        into.processes = other.processes
    if not into.frames:
        into.frames = other.frames
    if len(into.collectives) < 64:
        into.collectives.extend(other.collectives[:64 - len(into.collectives)])
        into.collectives.sort(key=lambda c: (c.rank is None, c.rank or 0, _seq(c)))
