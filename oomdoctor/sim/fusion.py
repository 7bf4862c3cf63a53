"""What a compiled step function allocates: the eager trace of it, less what Inductor fuses away.

torchao's low-bit optimizers compile their per-parameter update (``torch.compile`` inside
``step()``), which the trace runs eagerly (oomdoctor.sim.eager). The eager update makes a dozen
full-precision temporaries per parameter (the dequantized state, the update, the new state);
Inductor fuses elementwise chains into kernels that keep their intermediates in registers. What
it must write to memory is a value read on both sides of a reduction: a kernel cannot run past
a reduction whose result its later ops need, so the value is stored and read back (torchao's
re-quantization: the new state's block absmax, then the state divided by it). So of the
storages an eager compiled call makes and frees, those read before and after a reduction stay;
the rest are dropped.

Measured on a real CPU run where Inductor compiles the step (tests/test_torchao.py). On CUDA,
Inductor can fuse a reduction over small blocks with its consumers (a persistent reduction),
which would keep even those in registers: there the estimate is high by up to two copies of the
largest parameter in fp32 while it steps, which we have not measured on a GPU.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

# aten reductions, by overload-packet name
_REDUCTIONS = frozenset({"amax", "amin", "max", "min", "sum", "mean", "norm", "linalg_vector_norm",
                         "var", "std", "var_mean", "std_mean", "prod", "argmax", "argmin",
                         "aminmax", "logsumexp", "cumsum", "cumprod"})


class Fusion:
    """The compiled calls of one trace: their event ranges and the ops run inside them."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []
        self.ops: list[tuple[int, bool, tuple[int, ...]]] = []   # (event index, reduction, inputs)
        self.depth = 0

    @contextlib.contextmanager
    def region(self, position) -> Iterator[None]:
        """A compiled call; ``position()`` is the event count now."""
        start = position()
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            self.spans.append((start, position()))

    def note(self, func: Any, args: tuple, kwargs: dict, position: int, handle_of) -> None:
        """One op inside a compiled call, with the storages it read. Writing into a tensor
        subclass (``copy_`` into torchao's quantized state quantizes: block absmax first) runs
        its own ops out of the trace's sight; it counts as a reduction. (Reading one
        dequantizes, elementwise.)"""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = tuple(h for t in tensors for h in (handle_of(t),) if h is not None)
        name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
        writes_subclass = (name.endswith("_") and bool(args) and isinstance(args[0], torch.Tensor)
                           and is_traceable_wrapper_subclass(args[0]))
        self.ops.append((position, name in _REDUCTIONS or writes_subclass, inputs))

    def fused_away(self, storages: dict, raw: list) -> set[int]:
        """Handles of the storages that Inductor would not write to memory."""
        gone: set[int] = set()
        for start, end in self.spans:
            transient = {h for a, h, _ in raw[start:end] if a and storages[h].t_free is not None
                         and storages[h].t_free <= end}
            ops = [op for op in self.ops if start <= op[0] <= end]
            reductions = [i for i, op in enumerate(ops) if op[1]]
            reads: dict[int, list[int]] = {}
            for i, (_, _, inputs) in enumerate(ops):
                for h in inputs:
                    reads.setdefault(h, []).append(i)
            # read by a reduction's kernel and needed after it, or read at all by one
            kept = {h for h in transient if h in reads and any(
                reads[h][0] <= r < reads[h][-1] or r in reads[h] for r in reductions)}
            gone |= transient - kept
        return gone
