"""Storage sizes at any batch, and where each block runs on the trace's timeline."""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

from oomdoctor.plans.parallel.layout import MAIN, Layout, _block_lookup
from oomdoctor.sim.trace import Category, Phase, Trace


# ---------------------------------------------------------------------------------------------
# Sizes: one trace, or two traces whose every storage is affine in the batch size
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sizes:
    """Bytes of every trace storage (by handle) at any batch: ``base + slope * (b - batch)``."""

    batch: int
    base: tuple[int, ...]
    slope: tuple[int, ...] | None = None

    @classmethod
    def of(cls, trace: Trace) -> "Sizes":
        n = max(trace.storages, default=-1) + 1
        base = [0] * n
        for h, s in trace.storages.items():
            base[h] = s.nbytes
        return cls(trace.config.batch_size, tuple(base))

    @classmethod
    def affine(cls, t1: Trace, t2: Trace) -> "Sizes | None":
        """Per-storage slope from two traces of the same ops, None if they differ."""
        b1, b2 = t1.config.batch_size, t2.config.batch_size
        if b1 == b2 or [(a, h) for a, h, _ in t1.events] != [(a, h) for a, h, _ in t2.events] \
                or set(t1.storages) != set(t2.storages):
            return None
        one, two = cls.of(t1), cls.of(t2)
        slope = []
        for s1, s2 in zip(one.base, two.base):
            d, r = divmod(s2 - s1, b2 - b1)
            if r:
                return None
            slope.append(d)
        return cls(b1, one.base, tuple(slope))

    def at(self, batch: int) -> list[int]:
        if batch == self.batch:
            return list(self.base)
        if self.slope is None:
            # One trace only: scale what grows with the batch proportionally (inputs, outputs).
            return [s * batch // self.batch for s in self.base]
        k = batch - self.batch
        return [max(0, s + d * k) for s, d in zip(self.base, self.slope)]


# ---------------------------------------------------------------------------------------------
# Timing: phases, block forward spans, backward windows
# ---------------------------------------------------------------------------------------------

def setup_storages(trace: Trace, layout: Layout) -> list:
    """The model's parameter and buffer storages in the layout's order: by their names where
    the trace names each one as the layout does (a script moves them to the GPU module by
    module, buffers among parameters), else in allocation order (a model file's trace
    registers them in the layout's order)."""
    setup = sorted((s for s in trace.storages.values() if s.phase is Phase.SETUP
                    and s.category in (Category.PARAMETERS, Category.BUFFERS)),
                   key=lambda s: s.t_alloc)
    index = {n: i for i, n in enumerate(layout.param_names)}
    names = [s.name for s in setup]
    if len(setup) == len(index) and set(names) == set(index):
        return sorted(setup, key=lambda s: index[s.name])
    return setup


class _Timing:
    """Where each block runs on the trace's timeline (raw event indices)."""

    def __init__(self, trace: Trace, layout: Layout) -> None:
        self.trace = trace
        self.layout = layout
        end = 1 + max((max(s.t_alloc, s.t_free or 0) for s in trace.storages.values()),
                      default=0)
        self.end = end
        marks = list(trace.marks)
        self.phases = [(m.start, marks[i + 1].start if i + 1 < len(marks) else end, m)
                       for i, m in enumerate(marks)]
        self._starts = [p[0] for p in self.phases]
        lookup = _block_lookup(layout)
        self.block: dict[int, int | None] = {
            h: (lookup(s.module) if s.module else None) for h, s in trace.storages.items()}
        by_alloc = sorted(trace.storages.values(), key=lambda s: s.t_alloc)
        self._forward_spans(by_alloc)
        self._backward_windows(by_alloc)

    def _forward_spans(self, by_alloc: list) -> None:
        """``fwd_spans`` and ``_fwd_last`` from the storages in allocation order."""
        # Forward: each block's first and last allocation per forward phase, and which block ran
        # last at each allocation (root-level code runs on that block's device).
        self.fwd_spans: dict[int, dict[int, list[int]]] = defaultdict(dict)
        self._fwd_last: dict[int, tuple[list[int], list[int]]] = {}
        for s in by_alloc:
            ph = self.phase_index(s.t_alloc)
            if self.phases[ph][2].phase is not Phase.FORWARD:
                continue
            b = self.block[s.handle]
            if b is None or b < 0:
                continue
            span = self.fwd_spans[ph].setdefault(b, [s.t_alloc, s.t_alloc])
            span[1] = s.t_alloc
            pos, blk = self._fwd_last.setdefault(ph, ([], []))
            if not blk or blk[-1] != b:
                pos.append(s.t_alloc)
                blk.append(b)

    def _backward_windows(self, by_alloc: list) -> None:
        """``grad_owner`` and ``bwd_windows`` from the storages in allocation order."""
        # Backward: a block's backward ends with its parameters' gradients (the weight gradient
        # of its first op comes last). Each gradient is matched to the latest-registered
        # trainable parameter of its size still without one: backward runs the blocks in reverse.
        setup = setup_storages(self.trace, self.layout)
        self.grad_owner: dict[int, int] = {}        # gradient handle -> parameter index
        by_phase: dict[int, list] = defaultdict(list)
        for s in by_alloc:
            if s.category is Category.GRADIENTS:
                by_phase[self.phase_index(s.t_alloc)].append(s)
        self.bwd_windows: dict[int, list[tuple[float, float, int]]] = {}
        template: tuple[int, list[tuple[int, int]]] | None = None   # (phase, [(ordinal, block)])
        allocs: dict[int, list[int]] = defaultdict(list)
        for s in by_alloc:
            allocs[self.phase_index(s.t_alloc)].append(s.t_alloc)
        for ph, (start, stop, mark) in enumerate(self.phases):
            if mark.phase is not Phase.BACKWARD:
                continue
            grads = by_phase.get(ph, [])
            ends: dict[int, float] = {}
            if grads:
                ends = self._gradient_ends(grads, setup)
                ordinals = allocs[ph]
                template = (ph, [(bisect.bisect_right(ordinals, e), b)
                                 for b, e in ends.items()])
            elif template is not None:
                # No new gradients (accumulation into existing ones): the same ops allocate in
                # the same order as in the template's backward, so map the boundaries by the
                # allocation ordinal.
                ordinals = allocs[ph]
                for k, b in template[1]:
                    if ordinals:
                        ends[b] = ordinals[min(k, len(ordinals)) - 1] if k else start
            self.bwd_windows[ph] = self._windows(ends, start, stop)

    def _gradient_ends(self, grads: list, setup: list) -> dict[int, float]:
        """Block -> allocation of its last gradient in one backward phase (``grads``, in
        allocation order); records each gradient's parameter in ``grad_owner``."""
        layout = self.layout
        ends: dict[int, float] = {}
        free: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(setup[:layout.num_param_storages]):
            if layout.param_trainable[i]:
                free[p.nbytes].append(i)
        for g in grads:
            stack = free.get(g.nbytes)
            if not stack:
                continue
            i = stack.pop()
            self.grad_owner[g.handle] = i
            b = layout.param_owner[i]
            if b >= 0:
                ends[b] = max(ends.get(b, -1), g.t_alloc)
        return ends

    def _windows(self, ends: dict[int, float], start: float, stop: float
                 ) -> list[tuple[float, float, int]]:
        """One backward phase's (start, stop, block) windows, last block first."""
        wins: list[tuple[float, float, int]] = []
        prev: float = start
        for b in range(len(self.layout.blocks) - 1, -1, -1):
            e = ends.get(b)
            if e is not None and e + 0.5 > prev:
                wins.append((prev, e + 0.5, b))
                prev = e + 0.5
        # What runs after the earliest block's last gradient belongs to block 0.
        if wins and wins[-1][2] == 0:
            lo, _, _ = wins.pop()
            wins.append((lo, stop, 0))
        else:
            wins.append((prev, stop, 0))
        return wins

    def phase_index(self, pos: float) -> int:
        return max(0, bisect.bisect_right(self._starts, pos) - 1)

    def phase_of(self, pos: float) -> Phase:
        return self.phases[self.phase_index(pos)][2].phase

    def window(self, pos: float) -> tuple[int, int, int] | None:
        """(start, stop, block) of the backward window containing ``pos``."""
        wins = self.bwd_windows.get(self.phase_index(pos))
        if not wins:
            return None
        i = bisect.bisect_right([w[0] for w in wins], pos) - 1
        return wins[max(i, 0)]

    def block_window(self, ph: int, block: int) -> tuple[int, int] | None:
        for lo, hi, b in self.bwd_windows.get(ph, ()):
            if b == block:
                return lo, hi
        return None

    def last_block_at(self, pos: float) -> int:
        """The block whose forward allocated most recently before ``pos`` (MAIN if none)."""
        ph = self.phase_index(pos)
        pos_list, blocks = self._fwd_last.get(ph, ([], []))
        i = bisect.bisect_right(pos_list, pos) - 1
        return blocks[i] if i >= 0 else MAIN

    def backward_of(self, fwd_ph: int) -> int | None:
        """The backward phase that follows forward phase ``fwd_ph``."""
        for ph in range(fwd_ph + 1, len(self.phases)):
            kind = self.phases[ph][2].phase
            if kind is Phase.BACKWARD:
                return ph
            if kind is Phase.FORWARD:
                return None
        return None

    def marks_of(self, phase: Phase) -> list[int]:
        return [i for i, p in enumerate(self.phases) if p[2].phase is phase]
