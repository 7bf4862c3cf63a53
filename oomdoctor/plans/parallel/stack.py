"""A deep stack's layout passes from the stack cut to 3 and 4 blocks.

The layout runs the model forward and backward at batch 2 and forward at batch 1 (passes.py),
every block of it: on a Llama-3-70B config's 80 layers that was half of a `parallel` run. The
blocks of a stack of identical ones (sim.repeat.repeated_stack) are handed the same inputs by
the same kind of producer and do the same FLOPs. So the passes run with the stack cut to its
first 3 and then 4 blocks, and each record is put in the stack's terms: a block input made by
"the block before this one", a parameter first used "in its own block". Both cuts must then tell
the same story - the stack's first block, every later block alike, the same records before and
after the stack, the total FLOPs growing by one block's per block - and the passes are written
out for the whole stack. Where the cuts disagree in anything, the layout runs in full.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from oomdoctor.plans.parallel.passes import Pass
from oomdoctor.sim import repeat

CUTS = (3, 4)


class NotExtendable(Exception):
    """The cut passes do not describe one repeated block."""


@dataclass(frozen=True)
class Span:
    """The stack among the layout's blocks (definition indices base .. base + n - 1)."""

    path: str
    base: int
    n: int
    blocks: tuple[tuple[str, torch.nn.Module], ...]     # (name in the container, block)
    keys: tuple[tuple[int, ...], ...]      # each block's parameter and buffer storages, in order
    outside: tuple[int, ...]               # the other storages

    def index(self, block: int) -> int | None:
        """The stack position of a definition index, None outside the stack."""
        i = block - self.base
        return i if 0 <= i < self.n else None


def span_of(model: torch.nn.Module, defined: list[str], storages, min_blocks: int | None
            ) -> Span | None:
    """The model's deep stack of identical blocks if each of them is a layout block."""
    if min_blocks is None:
        return None
    found = repeat.repeated_stack(model, min_blocks)
    if found is None:
        return None
    path, kids = found
    n = len(kids)
    names = [f"{path}.{name}" for name in kids]
    if names[0] not in defined:
        return None
    base = defined.index(names[0])
    if defined[base:base + n] != names:
        return None
    keys: list[list[int]] = [[] for _ in range(n)]
    outside = []
    for key, owner in zip(storages.keys, storages.owners_def):
        j = owner - base
        (keys[j] if 0 <= j < n else outside).append(key)
    if len({len(k) for k in keys}) != 1:
        return None
    return Span(path, base, n, tuple(repeat.children(model.get_submodule(path))),
                tuple(tuple(k) for k in keys), tuple(outside))


def cut_passes(model: torch.nn.Module, span: Span, run: Callable[[int, bool], Pass],
               batch_size: int) -> tuple[Pass, Pass] | None:
    """The passes at ``batch_size`` (with backward) and at batch 1 (forward) of the whole model,
    from the stack cut to 3 and 4 blocks; None where the cuts do not extend."""
    cuts = {}
    container = model.get_submodule(span.path)
    try:
        for k in CUTS:
            repeat.cut(container, list(span.blocks), k)
            cuts[k] = (run(batch_size, True), run(1, False))
    except Exception:       # the model cannot run cut (it indexes its blocks by a count)
        return None
    finally:
        repeat.cut(container, list(span.blocks), span.n)
        for p in model.parameters():
            p.grad = None
    try:
        return tuple(_extended(span, {k: c[i] for k, c in cuts.items()}) for i in (0, 1))
    except NotExtendable:
        return None


def _extended(span: Span, passes: dict[int, Pass]) -> Pass:
    (k3, p3), (k4, p4) = sorted(passes.items())
    shape = _shape(span, p3, k3)
    if _shape(span, p4, k4) != shape:
        raise NotExtendable("the cut passes differ")
    block = shape.middle_flops
    if p4.total_flops - p3.total_flops != block:
        raise NotExtendable("the FLOPs do not grow by one block's per block")
    return _written_out(span, shape, p3.total_flops + (span.n - k3) * block)


@dataclass(frozen=True)
class _Shape:
    """A pass in the stack's terms: references into the stack relative to the block at hand
    (("S", offset)), or from outside it to its first or last block; others as they are."""

    before: tuple
    first: tuple
    middle: tuple
    after: tuple
    order: tuple
    out_bytes: int
    counted: bool                          # a pass with FLOPs (the one with backward)
    flops_outside: tuple
    first_flops: float                     # the first block's backward may skip its input's
    middle_flops: float                    # gradient (LoRA: the embedding is frozen)
    use_outside: tuple
    use_first: tuple
    use_middle: tuple


def _shape(span: Span, p: Pass, k: int) -> _Shape:
    def rel(x: int, j: int):
        i = span.index(x)
        return ("S", i - j) if i is not None else ("A", x)

    def outside(x: int):
        i = span.index(x)
        if i is None:
            return ("A", x)
        if i in (0, k - 1):
            return ("first",) if i == 0 else ("last",)
        raise NotExtendable("code outside the stack uses a middle block")

    groups: list[list[tuple]] = [[] for _ in range(k)]
    before, after = [], []
    seen = -1
    for c, prod, nbytes, rg in p.calls:
        j = span.index(c)
        if j is None:
            (before if seen < 0 else after).append((outside(c), outside(prod), nbytes, rg))
            continue
        if j < seen or after:
            raise NotExtendable("the stack's blocks are not called one after the other")
        seen = j
        groups[j].append((rel(prod, j), nbytes, rg))
    first_at = p.order.index(span.base) if span.base in p.order else -1
    if first_at < 0 or list(p.order[first_at:first_at + k]) != list(
            range(span.base, span.base + k)) or any(
            span.index(x) is not None for x in p.order[first_at + k:]):
        raise NotExtendable("the stack's blocks do not run one after the other")
    order = tuple(outside(x) for x in p.order[:first_at]) + ("stack",) + tuple(
        outside(x) for x in p.order[first_at + k:])
    flops = [p.block_flops.get(span.base + j) for j in range(k)]
    uses = [tuple(_use(p, key, lambda x, j=j: rel(x, j)) for key in span.keys[j])
            for j in range(k)]
    return _Shape(
        before=tuple(before), first=tuple(groups[0]), middle=_alike(groups[1:]),
        after=tuple(after), order=order, out_bytes=p.out_bytes, counted=bool(p.block_flops),
        flops_outside=tuple(sorted((outside(b), f) for b, f in p.block_flops.items()
                                   if span.index(b) is None)),
        first_flops=flops[0] or 0.0, middle_flops=_alike(flops[1:]) or 0.0,
        use_outside=tuple(_use(p, key, outside) for key in span.outside),
        use_first=uses[0], use_middle=_alike(uses[1:]))


def _use(p: Pass, key: int, ref: Callable) -> tuple | None:
    tag = p.first_use.get(key)
    return None if tag is None else ref(tag)


def _alike(items: list):
    """The one value every block shares."""
    if any(x != items[0] for x in items[1:]):
        raise NotExtendable("blocks of the stack differ")
    return tuple(items[0]) if isinstance(items[0], list) else items[0]


def _written_out(span: Span, shape: _Shape, total_flops: float) -> Pass:
    """The pass over all ``span.n`` blocks."""
    last = span.base + span.n - 1

    def at(ref, j: int = 0) -> int:
        kind = ref[0]
        if kind == "S":
            return span.base + j + ref[1]
        return {"A": ref[-1], "first": span.base, "last": last}[kind]

    calls = [(at(c), at(p), b, rg) for c, p, b, rg in shape.before]
    for j in range(span.n):
        group = shape.first if j == 0 else shape.middle
        calls += [(span.base + j, at(p, j), b, rg) for p, b, rg in group]
    calls += [(at(c), at(p), b, rg) for c, p, b, rg in shape.after]
    order: list[int] = []
    for x in shape.order:
        order += range(span.base, span.base + span.n) if x == "stack" else [at(x)]
    flops = {at(b): f for b, f in shape.flops_outside}
    if shape.counted:
        flops.update({span.base + j: shape.middle_flops if j else shape.first_flops
                      for j in range(span.n)})
    first_use = {key: at(u) for key, u in zip(span.outside, shape.use_outside) if u}
    for j, keys in enumerate(span.keys):
        uses = shape.use_first if j == 0 else shape.use_middle
        first_use.update({key: at(u, j) for key, u in zip(keys, uses) if u})
    return Pass(tuple(calls), tuple(order), shape.out_bytes, flops, total_flops, first_use)
