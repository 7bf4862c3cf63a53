"""Real values for the small tensors a library asks data-dependent questions about during a trace.

A fake or meta trace knows shapes, not values, so ``bool(t)`` / ``t.item()`` fails. Libraries
ask such questions about the *batch*, not the weights: transformers checks whether the attention
mask has padding (``masking_utils._ignore_causal_mask_sdpa``: ``padding_mask.all()``) to decide
whether the GPU run materialises a ``(B, 1, T, T)`` mask or calls the flash kernel with
``is_causal=True``, and those two differ in memory. The answer must be the real batch's.

So, only when a trace has failed on such a question (:class:`oomdoctor.models.spec.DataDependentError`),
the trace is run again with a :class:`Shadows`: the batch is also made for real on the CPU, and
every ATen op whose tensor inputs all have real values (the batch's tensors, what is computed
from them alone, small constant factories such as ``arange``) is also run on those values. A
scalar question about a traced tensor is then answered from its real counterpart. Weights never
get values (they have none on the meta device), so the work stays with the small integer and
boolean tensors that masks and labels are made of; outputs over :data:`MAX_NUMEL` elements are
not mirrored, and a question about a tensor without real values fails as before.

Some tensors are made from Python data where the dispatcher shows no op to mirror: indexing
with a list (``input_ids[:, [-1, 0]]``, transformers 4.x's
``modeling_utils.warn_if_padding_and_no_attention_mask``) and ``torch.tensor(data, device=...)``
copy the data onto the meta device with the Python dispatch key excluded
(``torch/csrc/utils/tensor_new.cpp``). :class:`Calls` follows those at the Python level, one
``torch`` function or ``Tensor`` method at a time: a call whose inputs all have real values and
whose output came back without any (or whose in-place ops the dispatch level could not follow)
is run again on the real values; a call that fails on the meta tensor but has a plain Python
answer on the real values (``Tensor.tolist()``) gets that answer.

Random factories called from Python (``torch.rand``) get values from a forked generator: one
possible draw, as any GPU run's is. Known limitations: random ops below the Python level
(dropout's mask) get no values; data-dependent *shapes* (``nonzero``,
``masked_select``) are not answered, only data-dependent Python values.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

MAX_NUMEL = 1 << 24        # 16 Mi elements: a (64, 1, 512, 512) bool mask, not a weight

_aten = torch.ops.aten
# The questions: what Tensor.item(), bool(t), int(t) and float(t) dispatch to.
SCALAR_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default}
# Factories whose values do not depend on random state or uninitialised memory.
_CONSTANT_FACTORIES = {
    _aten.arange.default, _aten.arange.start, _aten.arange.start_step,
    _aten.full.default, _aten.ones.default, _aten.zeros.default, _aten.scalar_tensor.default,
    _aten.eye.default, _aten.eye.m, _aten.lift_fresh.default, _aten.lift_fresh_copy.default,
}


def _tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
    """The tensors among an op's arguments, as ``tree_flatten`` would list them, for the flat
    arguments ATen ops and torch functions take (tensors, scalars, lists of them); None for a
    nested structure, which ``tree_flatten`` must walk. A trace asks this of every op, and
    ``tree_flatten`` was a third of a deep model's time with values mirrored."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    out.append(x)
                elif isinstance(x, (list, tuple, dict)):
                    return None
        elif isinstance(a, dict):
            return None
    return out


class Shadows:
    """Real CPU values mirrored next to traced tensors, for answering scalar questions."""

    def __init__(self) -> None:
        self.values = WeakTensorKeyDictionary()
        self.answered = 0
        # ops the dispatch level could not mirror although an input had values (see Calls)
        self.missed = 0

    def attach(self, traced: Any, real: Any) -> None:
        """Mirror a batch: ``real`` is the same structure as ``traced``, made on the CPU."""
        t_leaves, t_spec = tree_flatten(traced)
        r_leaves, r_spec = tree_flatten(real)
        if t_spec != r_spec:
            return
        for t, r in zip(t_leaves, r_leaves):
            if (isinstance(t, torch.Tensor) and isinstance(r, torch.Tensor)
                    and t.shape == r.shape and t.dtype == r.dtype and r.numel() <= MAX_NUMEL):
                self.values[t] = r

    def _real(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if _is_real(x):
            return x                                       # a real CPU tensor is its own value
        return self.values.get(x)

    def answer(self, func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """(True, the real answer) for a scalar question about a mirrored tensor; the trace
        asks only after the fake/meta tensor failed to answer."""
        if func not in SCALAR_READS or not args:
            return False, None
        real = self.values.get(args[0]) if isinstance(args[0], torch.Tensor) else None
        if real is None:
            return False, None
        with _disable_current_modes():
            value = func(real)
        self.answered += 1
        return True, value

    def mirror(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Run ``func`` on the real values of its inputs, if they all have some."""
        quick = _tensors_in(args, kwargs)
        if quick is not None and quick and not all(_is_real(x) for x in quick):
            lacking = [self._real(x) is None for x in quick]
            if any(lacking):             # the common case (weights): decided without flattening
                if not all(lacking) or func in _CONSTANT_FACTORIES:
                    self.missed += 1
                return
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors and func not in _CONSTANT_FACTORIES:
            return
        if tensors and all(_is_real(x) for x in tensors):
            return            # the op ran on real tensors already (host-side counters): once only
        real_leaves = [self._real(x) for x in leaves]
        lacking = [r is None for x, r in zip(leaves, real_leaves) if isinstance(x, torch.Tensor)]
        if any(lacking):
            if not all(lacking) or func in _CONSTANT_FACTORIES:
                self.missed += 1       # a tensor from Python data among valued ones: Calls
            return
        outs, _ = tree_flatten(out)
        if any(isinstance(o, torch.Tensor) and o.numel() > MAX_NUMEL for o in outs):
            return
        r_args, r_kwargs = tree_unflatten(real_leaves, spec)
        if func in (torch.Tensor.cuda, torch.Tensor.to):
            return _moved(r_args, r_kwargs)
        if "device" in r_kwargs:
            r_kwargs = dict(r_kwargs, device=torch.device("cpu"))
        try:
            with _disable_current_modes(), torch.device("cpu"):
                real_out = func(*r_args, **r_kwargs)
        except Exception:             # an op the CPU refuses: those outputs get no values
            return
        real_outs, _ = tree_flatten(real_out)
        if len(real_outs) != len(outs):
            return
        for o, r in zip(outs, real_outs):
            if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and o.shape == r.shape:
                self.values[o] = r


# Python calls that make tensors from Python data: their output is never mirrored below them.
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
# Random factories get values from their own generator, so the trace's RNG is untouched: a
# question about a draw gets one possible answer, as one GPU run does. OPT's LayerDrop in
# transformers 4.x asks ``torch.rand([]) < self.layerdrop`` in every layer (modeling_opt.py,
# OPTDecoder.forward), whose answer is the same for every draw at the default layerdrop=0.
_RANDOM = {torch.rand, torch.randn, torch.randint, torch.randperm}


class Calls(TorchFunctionMode):
    """The Python-level half of the mirror (see the module docstring): ``torch`` functions and
    ``Tensor`` methods whose values the dispatch level could not follow."""

    def __init__(self, shadows: Shadows) -> None:
        super().__init__()
        self.shadows = shadows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        missed = self.shadows.missed
        try:
            out = func(*args, **kwargs)
        except Exception:
            real_out = self._run_real(func, args, kwargs)
            if real_out is None or any(isinstance(x, torch.Tensor)
                                       for x in tree_flatten(real_out)[0]):
                raise        # only a plain Python answer (tolist) can stand in for the call
            self.shadows.answered += 1
            return real_out
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if func in _FROM_DATA or func in _RANDOM or self.shadows.missed != missed or any(
                self.shadows._real(o) is None for o in outs):
            self._follow(func, args, kwargs, outs)
        return out

    def _follow(self, func: Any, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> None:
        """Run the call again on real values and give its tensor outputs those values. An
        in-place call (``t[:, idx] = 0``) redoes, on the real tensor, the op the dispatch level
        skipped."""
        if any(o.numel() > MAX_NUMEL for o in outs):
            return
        real_out = self._run_real(func, args, kwargs)
        if real_out is None:
            return
        real_outs = [r for r in tree_flatten(real_out)[0] if isinstance(r, torch.Tensor)]
        if len(real_outs) != len(outs):
            return
        for o, r in zip(outs, real_outs):
            if o.shape == r.shape and not _is_real(o):
                self.shadows.values[o] = r

    def _run_real(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` on the real values of its inputs, on the CPU; None if an input has none or
        the CPU refuses."""
        quick = _tensors_in(args, kwargs)
        if quick is not None and any(self.shadows._real(x) is None for x in quick):
            return None                  # an input without values (weights): nothing to run
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if not tensors and func not in _FROM_DATA and func not in _RANDOM:
            return None
        real_leaves = [self.shadows._real(x) for x in leaves]
        if any(r is None for x, r in zip(leaves, real_leaves) if isinstance(x, torch.Tensor)):
            return None
        r_args, r_kwargs = tree_unflatten(real_leaves, spec)
        if func in (torch.Tensor.cuda, torch.Tensor.to):
            return _moved(r_args, r_kwargs)
        if "device" in r_kwargs:
            r_kwargs = dict(r_kwargs, device=torch.device("cpu"))
        try:
            # below every mode: the trace's device (meta), its recorder, this mode
            with _disable_current_modes(), torch._C.DisableTorchFunction(), \
                    torch.random.fork_rng(devices=[]):
                return func(*r_args, **r_kwargs)
        except Exception:
            return None


def _moved(args: tuple, kwargs: dict) -> Any:
    """A move's real value (``.cuda()``, ``.to(device, dtype)``): the same values on the CPU,
    in the dtype asked for. Running the move itself would initialise CUDA in a CPU build
    under the fake device's answers (torch.cuda.is_initialized is true there), which leaves
    every later ``.cuda()`` of the process failing as "not linked with CUDA" instead of
    "not compiled with CUDA" (the message a model file's misplaced .cuda() is told by)."""
    real = args[0]
    if len(args) > 1 and isinstance(args[1], torch.Tensor):
        return real.to(args[1].dtype)
    dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)),
                                        None)
    return real if dtype is None else real.to(dtype)


# The Shadows of the trace now running, for code outside the dispatch mode that needs a batch
# tensor's values (emulate: pack_padded_sequence's lengths).
_ACTIVE: list[Shadows] = []


@contextlib.contextmanager
def active(shadows: Shadows | None) -> Iterator[None]:
    """Make ``shadows`` answer :func:`real_value` and follow Python-level calls (:class:`Calls`)
    while the block runs (None: nothing)."""
    if shadows is None:
        yield
        return
    _ACTIVE.append(shadows)
    try:
        with Calls(shadows):
            yield
    finally:
        _ACTIVE.remove(shadows)


def real_value(t: torch.Tensor) -> torch.Tensor | None:
    """The real CPU value mirrored for a traced tensor, if a trace with values is running."""
    if _is_real(t):
        return t
    return _ACTIVE[-1]._real(t) if _ACTIVE else None


def placeholder(t: torch.Tensor) -> Any:
    """A stand-in answer for a scalar read whose value moves no memory (see trace.py)."""
    if t.dtype == torch.bool:
        return True
    return 1.0 if t.is_floating_point() or t.is_complex() else 1


def _is_real(t: torch.Tensor) -> bool:
    """A tensor with data: on the CPU and not a FakeTensor (meta tensors have none)."""
    return t.device.type == "cpu" and not isinstance(t, _fake_tensor())


def _fake_tensor() -> type:
    global _FAKE
    if _FAKE is None:
        from torch._subclasses.fake_tensor import FakeTensor
        _FAKE = FakeTensor
    return _FAKE


_FAKE: type | None = None


def real_batch(make: Any) -> Any:
    """``make()`` for real on the CPU, outside every mode, without touching the trace's RNG."""
    with _disable_current_modes(), torch.device("cpu"), torch.random.fork_rng(devices=[]):
        return make()
