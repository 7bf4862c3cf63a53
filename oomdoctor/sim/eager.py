"""Keep a fake trace eager and cheap: ``torch._dynamo`` left unloaded, ``torch.compile`` a no-op,
random initialisation free of data-dependent loops.

:func:`fake_trace` enters them all around a fake trace (oomdoctor.sim.trace.trace_training); each
restores everything it patches when it ends.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import types
import weakref
from typing import Callable, ContextManager, Iterator

import torch

# Functions torch handed to torch._dynamo.disable during our traces (weak: checkpoint decorates a
# fresh closure per call).
_DISABLE_SEEN: "weakref.WeakSet" = weakref.WeakSet()
_CACHE = "__dynamo_disable"      # where torch._compile._disable_dynamo caches the disabled function


def _identity_disable(fn=None, *args, **kwargs):
    """``torch._dynamo.disable`` for eager-only code: the function itself."""
    if fn is None:                                   # used as @disable(recursive=...)
        return _identity_disable
    _DISABLE_SEEN.add(fn)
    return fn


@contextlib.contextmanager
def compile_as_eager(calls: list, fused: Callable[[], ContextManager] | None = None
                     ) -> Iterator[None]:
    """``torch.compile`` (and ``nn.Module.compile``, which calls it) returns what it was given:
    the trace follows eager kernels, and compiling would run dynamo on fake tensors for every
    trial. ``calls`` collects one ``(where, mode)`` per call for the notes; ``where`` is "step"
    for a call made inside an optimizer step (torchao's low-bit optimizers compile their
    per-parameter update there), else "model".

    A compiled step function runs inside ``fused()``: its update is a chain of elementwise ops
    and per-block reductions, which Inductor fuses into a few kernels, so most of what the
    eager run allocates and frees inside it is not memory the compiled step uses (the recorder
    keeps only what Inductor materializes; see oomdoctor.sim.trace)."""
    from oomdoctor.sim import stepping
    real = torch.compile

    def eager(model=None, **kwargs):
        where = "step" if stepping.in_step() else "model"
        calls.append((where, kwargs.get("mode") or "default"))

        def wrap(fn):
            if fused is None or where != "step" or isinstance(fn, torch.nn.Module) \
                    or not callable(fn):
                return fn

            @functools.wraps(fn)
            def compiled(*args, **kw):
                with fused():
                    return fn(*args, **kw)
            return compiled
        return wrap if model is None else wrap(model)
    torch.compile = eager
    try:
        yield
    finally:
        torch.compile = real


def _stand_in_getattr(real_module):
    """The stand-in's module ``__getattr__``: any public name imports the real module.

    Dunder names do not: ``inspect.getmodule`` reads ``__file__`` of every module in
    ``sys.modules``, and torch calls it while registering custom ops at import time
    (``torch/_library/utils.py::get_source``). Importing the real ``torch._dynamo`` from there,
    half-way through ``import torch.distributed.tensor`` (transformers imports it when a model
    class loads lazily inside ``build_model()``), is a circular import. A module without
    ``__file__`` is what the stand-in is. ``__path__`` is the exception: the import system
    reads it to import a submodule (``torch._dynamo._trace_wrapped_higher_order_op``, imported
    by transformers' generation code), which needs the real package."""
    def getattr_(name: str):
        if name == "__path__":
            return real_module().__path__
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(real_module(), name)
    return getattr_


@contextlib.contextmanager
def dynamo_left_unloaded() -> Iterator[None]:
    """Keep ``torch._dynamo`` out of a fake trace: importing it costs ~1.9 s, a third of an
    ``estimate`` on a 2-core runner, and its ``disable`` wrappers add ~10% to every trace after.

    torch marks some of its functions (the meta/fake kernels behind ``nn.init`` and the refs,
    optimizer methods, checkpoint) with ``torch._compile._disable_dynamo``, whose wrapper imports
    ``torch._dynamo`` on the first call only to wrap the function in ``torch._dynamo.disable``
    and cache the result on it as ``fn.__dynamo_disable``; ``Optimizer.step`` calls
    ``torch._dynamo.graph_break()``. Both change nothing in eager mode, and a trace never runs
    under ``torch.compile``. So while the trace runs, ``disable`` answers with the function itself
    and ``graph_break`` with nothing — through a stand-in module when ``torch._dynamo`` is not
    loaded, by patching the real one when it is (checkpointing reads ``torch._dynamo.config``,
    which imports it) — and afterwards every cache is put back as it was: calls outside the trace
    go through the real ``torch._dynamo.disable``. Any other use of ``torch._dynamo`` imports the
    real module on the spot, so this can cost speed, never correctness. Not thread-safe: a
    ``torch.compile`` running in another thread during a trace would see undisabled functions.
    """
    stashed = {}
    for fn in list(_DISABLE_SEEN):                   # real wrappers cached between traces
        cached = fn.__dict__.get(_CACHE)
        if cached is not None and cached is not fn:
            stashed[fn] = cached
            fn.__dict__[_CACHE] = fn
    patched = []                                     # real modules whose disable we replaced

    def patch(real):
        if real.__dict__.get("disable") is not _identity_disable:
            patched.append((real, real.__dict__.get("disable")))
            real.disable = _identity_disable
        return real

    stand_in = None
    if "torch._dynamo" in sys.modules:
        patch(sys.modules["torch._dynamo"])
    else:
        stand_in = types.ModuleType("torch._dynamo", "stand-in; see oomdoctor.sim.eager")

        def real_module():
            if sys.modules.get("torch._dynamo") is stand_in:
                del sys.modules["torch._dynamo"]
                torch.__dict__.pop("_dynamo", None)
            import torch._dynamo as real
            return patch(real)

        stand_in.disable = _identity_disable
        # Optimizer.step calls torch._dynamo.graph_break() around every step; eagerly a no-op.
        stand_in.graph_break = lambda msg="": None
        stand_in.__getattr__ = _stand_in_getattr(real_module)
        sys.modules["torch._dynamo"] = stand_in
    try:
        yield
    finally:
        if stand_in is not None and sys.modules.get("torch._dynamo") is stand_in:
            del sys.modules["torch._dynamo"]
            if torch.__dict__.get("_dynamo") is stand_in:
                del torch._dynamo
        for real, disable in patched:
            real.disable = disable
        for fn in list(_DISABLE_SEEN):
            if fn.__dict__.get(_CACHE) is fn:
                del fn.__dict__[_CACHE]
        for fn, cached in stashed.items():
            fn.__dict__[_CACHE] = cached


@contextlib.contextmanager
def fake_trace(compiled: list, fused: Callable[[], ContextManager]) -> Iterator[None]:
    """Everything a fake trace patches (see the module's docstring)."""
    with dynamo_left_unloaded(), compile_as_eager(compiled, fused), init_without_data():
        yield


@contextlib.contextmanager
def init_without_data() -> Iterator[None]:
    """``nn.init.trunc_normal_`` draws until no sample lies outside the bounds (torch/nn/init.py,
    ``_no_grad_trunc_normal_``: ``if not mask.any()``), a question about values that fake
    tensors cannot answer; transformers' ViT initialises its weights with it, so building the
    model failed on fake CPU tensors (the meta device skips initialisation). An initialisation's
    values never reach a memory trace: on a fake tensor it fills in place from ``normal_`` and
    clamps to the bounds instead (same tensor, no question). The module global is patched, since
    ``trunc_normal_`` looks it up per call however the caller reached ``trunc_normal_``."""
    from torch._subclasses.fake_tensor import FakeTensor
    init = torch.nn.init
    real = init._no_grad_trunc_normal_

    def trunc_normal(tensor, mean, std, a, b, generator=None):
        if not isinstance(tensor, FakeTensor):
            return real(tensor, mean, std, a, b, generator=generator)
        with torch.no_grad():
            return tensor.normal_(mean, std, generator=generator).clamp_(a, b)
    init._no_grad_trunc_normal_ = trunc_normal
    try:
        yield
    finally:
        init._no_grad_trunc_normal_ = real
