"""A deep model's stack of identical blocks, traced cut to 2, 3 and 4 blocks and unrolled.

A Llama-3-70B traces its 80 layers one after the other: 20-40 s on two cores, most of it per
layer. The layers are one block repeated - same class, same parameter shapes, dtypes and
adapters, same settings - and so is what each allocates and frees. So the model is built once,
its stack is checked block by block (:func:`repeated_stack`), the step is traced with the stack
cut to its first 2, 3 and 4 blocks, and :mod:`oomdoctor.sim.unroll` extends those streams to all
of them, storage identities and lifetimes included. Every figure of the trace that is a sum over
blocks (parameter bytes, gradient bytes, a note's block count) is affine in the block count and
must be so across the three traces. A stack whose blocks differ in anything (a sliding-window
layer among global ones, a block with other adapters, every N-th block checkpointed: a wrapped
block has its own ``forward``, which :func:`signature` compares) is not cut; nor is a shallow one.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch

from oomdoctor.sim.labels import phase_ends
from oomdoctor.sim.recorder import Category, Phase
from oomdoctor.sim.stepping import foreach_measured
from oomdoctor.sim.unroll import Short, Unrolled, UnrollError, unroll

MIN_BLOCKS = 16        # below this, three short traces cost about what the full one does
CUTS = (2, 3, 4)
# Attributes that number a block and may differ between identical ones (transformers'
# layer_idx names the block's KV-cache slot; training runs without a cache).
_INDEX = re.compile(r"(^|_)(idx|index|id)$")
_PATH_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")
_PRIMITIVE = (bool, int, float, str, type(None), torch.dtype, torch.device)
# The trace's figures that add up over blocks.
SUMS = ("parameter_bytes", "trainable_parameter_bytes", "num_parameters",
        "num_trainable_parameters", "buffer_bytes", "gradient_bytes", "optimizer_state_bytes",
        "flops")


def _value(v: Any, depth: int = 0) -> Any:
    """What an attribute says about a block's behaviour, comparable across blocks."""
    if isinstance(v, str):
        # a module path naming the block (peft's target_name "model.layers.3.self_attn.q_proj")
        return _PATH_INDEX.sub("#", v)
    if isinstance(v, _PRIMITIVE):
        return v
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    if isinstance(v, (tuple, list)) and depth < 2:
        return tuple(_value(x, depth + 1) for x in v)
    if isinstance(v, dict) and depth < 2:
        return tuple(sorted((str(k), _value(x, depth + 1)) for k, x in v.items()))
    # an object (a shared config, a bound method, a closure): its kind, not its identity
    return ("object", type(v).__qualname__, getattr(v, "__qualname__", ""))


def signature(block: torch.nn.Module) -> tuple:
    """Everything about a block that could change what it allocates: its modules' classes,
    settings and hooks, its parameters' and buffers' shapes, dtypes and kinds."""
    out = []
    for name, m in block.named_modules():
        attrs = tuple(sorted((k, _value(v)) for k, v in vars(m).items()
                             if not k.startswith("_") and not _INDEX.search(k)))
        hooks = tuple(len(getattr(m, h, ())) for h in (
            "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
            "_backward_pre_hooks", "_state_dict_hooks"))
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad, type(p).__qualname__)
                       for n, p in m.named_parameters(recurse=False))
        buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers(recurse=False))
        forward = m.__dict__.get("forward")
        out.append((name, type(m).__qualname__, attrs, hooks, params, buffers,
                    getattr(forward, "__qualname__", None)))
    return tuple(out)


# The containers a stack of blocks is kept in. Each keeps its children in ``_modules``, and a
# ModuleList's len and indexing, a Sequential's forward and a ModuleDict's items all read it: so
# the stack is cut by changing what ``_modules`` holds, in place (names and module objects
# kept), whatever the container's constructor takes.
CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def children(container: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The container's (name, block) pairs in order, repeats included (``named_children``
    drops a module held twice)."""
    return list(container._modules.items())


def repeated_stack(model: torch.nn.Module, min_blocks: int = MIN_BLOCKS
                   ) -> tuple[str, tuple[str, ...]] | None:
    """(path, block names) of the container (ModuleList, Sequential, ModuleDict) of identical
    blocks holding the most parameters, if it has at least ``min_blocks``; None otherwise."""
    best: tuple[int, str, tuple[str, ...]] | None = None
    for path, mod in model.named_modules():
        if not isinstance(mod, CONTAINERS) or not path:
            continue
        kids = children(mod)
        if len(kids) < min_blocks or any(b is None for _, b in kids) \
                or len({id(b) for _, b in kids}) != len(kids):
            continue
        first = signature(kids[0][1])
        if any(signature(b) != first for _, b in kids[1:]):
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size and (best is None or size > best[0]):
            best = (size, path, tuple(n for n, _ in kids))
    return None if best is None else best[1:]


def cut(container: torch.nn.Module, blocks: list[tuple[str, torch.nn.Module]], k: int) -> None:
    """Leave the first ``k`` of ``blocks`` (the container's (name, block) pairs, in order) in
    ``container``: the same names and module objects, so their parameters keep their storages;
    ``k = len(blocks)`` restores it."""
    held = container._modules
    held.clear()
    held.update(blocks[:k])


class Stack:
    """Builds the model once and hands the trace the stack cut to ``k`` blocks."""

    def __init__(self, min_blocks: int = MIN_BLOCKS) -> None:
        self.min_blocks = min_blocks
        self.model: torch.nn.Module | None = None
        self.built: tuple = ()
        self.notes: list[str] = []
        self.path: str | None = None
        self.blocks: list[tuple[str, torch.nn.Module]] = []     # (name, block) in order

    def cut(self, k: int) -> Callable:
        """A builder for trace.trace_training: ``builder(build, notes)``."""
        def builder(build: Callable[[], tuple], notes: list[str]) -> tuple:
            if self.model is None:
                start = len(notes)
                self.built = build()
                self.model, self.notes = self.built[0], notes[start:]
                found = repeated_stack(self.model, self.min_blocks)
                if found is None:
                    return self.built          # nothing to cut: this is the full trace
                self.path = found[0]
                self.blocks = children(self.model.get_submodule(self.path))
            else:
                notes += self.notes
            if self.path is not None:
                self._cut(k)
            return self.built
        return builder

    def _cut(self, k: int) -> None:
        for p in self.model.parameters():
            p.grad = None                     # a previous cut's gradients
        cut(self.model.get_submodule(self.path), self.blocks, k)

    def full(self, traces: list) -> Any:
        """The trace of the whole stack from the traces cut to 2, 3 and 4 blocks (trace.Trace
        objects; raises UnrollError where they do not extend exactly)."""
        n = len(self.blocks)
        shorts = [Short(k, t.raw_events, t.storages, t.marks) for k, t in zip(CUTS, traces)]
        got: Unrolled = unroll(shorts, n, self.path, tuple(name for name, _ in self.blocks))
        sums = {f: affine([getattr(t, f) for t in traces], n) for f in SUMS}
        for f in ("checkpointed", "libraries", "config"):
            if len({getattr(t, f) for t in traces}) != 1:
                raise UnrollError(f"{f} differs between the short traces")
        events = tuple((a, h, 0) if got.storages[h].host else (a, h, b) for a, h, b in got.raw)
        return dict(sums, events=events, raw_events=got.raw, storages=got.storages,
                    marks=got.marks, notes=_notes(traces, n, got, events, sums))


def _notes(traces: list, n: int, got: Unrolled, events, sums: dict[str, int]
           ) -> tuple[str, ...]:
    """The notes at ``n`` blocks; the foreach notes measured again on the whole stream, as
    trace._result measures them."""
    defaults = traces[-1].foreach_notes

    def unmeasured(note: str) -> str:
        return next((d for d in defaults if note.startswith(d + " (")), note)
    notes = notes_for([tuple(unmeasured(x) for x in t.notes) for t in traces], n)
    ends = phase_ends(list(got.marks), len(events))
    steps = [(m.start, ends[m.start]) for m in got.marks
             if m.phase is Phase.OPTIMIZER and m.start < len(ends)]
    return tuple(dict.fromkeys(foreach_measured(
        list(notes), list(defaults), steps, events, sums["parameter_bytes"],
        lambda h: got.storages[h].category is Category.TEMPORARIES)))


def affine(values: list[int], n: int) -> int:
    """The value at ``n`` blocks of a figure traced at 2, 3 and 4 blocks."""
    a, b, c = values
    if c - b != b - a:
        raise UnrollError("a figure is not affine in the block count")
    return a + (n - CUTS[0]) * (b - a)


def notes_for(notes: list[tuple[str, ...]], n: int) -> tuple[str, ...]:
    """The notes at ``n`` blocks: equal ones as they are, whole numbers that grow with the
    block count (not digits of a decimal) extended."""
    if len({len(x) for x in notes}) != 1:
        raise UnrollError("the notes differ between the short traces")
    out = []
    for texts in zip(*notes):
        parts = [re.split(r"(\d+)", t) for t in texts]
        if len({len(p) for p in parts}) != 1:
            raise UnrollError(f"a note differs: {texts[0]!r}")
        merged = []
        for i, pieces in enumerate(zip(*parts)):
            around = parts[0][i - 1][-1:] + (parts[0][i + 1][:1] if i + 1 < len(parts[0]) else "")
            if len(set(pieces)) == 1:
                merged.append(pieces[0])
            elif i % 2 and "." not in around:
                merged.append(str(affine([int(x) for x in pieces], n)))
            else:
                raise UnrollError(f"a note differs: {texts[0]!r}")
        out.append("".join(merged))
    return tuple(out)
