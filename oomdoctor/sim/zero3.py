"""What DeepSpeed ZeRO-3 changes in the model's own step, beyond sharding.

Stage 3 hooks every module and replaces ``torch.nn.functional.linear``, and both change which
tensors a training step keeps (measured on an H200, benchmarks/results/deepspeed/traces/
zero3-bf16-offload-*: an ``nn.MultiheadAttention`` layer kept its q, k and v projections as
three 4 MiB tensors, without the input copies a plain ``F.linear`` of a transposed input
saves, where the plain model keeps one packed 12 MiB projection):

- :func:`input_hooks`: the forward pre-hook on every module passes each tensor input through
  an autograd Function (parameter_offload.py ``_post_backward_module_hook``:
  ``apply_to_tensors_only(module.post_bwd_fn.apply, inputs)``), so a module gets new tensor
  objects of the same storage; ``self.attention(x, x, x)`` no longer sees ``query is key``.
- :func:`linear_patched`: ``F.linear`` is ``zero3_linear_wrap`` (zero/linear.py,
  ``LinearFunctionForZeroStage3``), an autograd Function that saves its input, weight and
  bias as given and computes ``input.matmul(weight.t())`` (``addmm`` for a 2-D input with a
  bias), its backward ``grad_output.matmul(weight)`` and a flattened matmul for the weight.
  A weight it saves as a view (``nn.MultiheadAttention``'s q, k and v chunks of its packed
  ``in_proj_weight``) holds the gathered parameter's storage until that backward, after the
  coordinator has released the parameter: the traced storage is marked ``view_saved``
  (measured: every layer's ``in_proj_weight`` stayed gathered through the forward).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def input_hooks(model: torch.nn.Module) -> list:
    """The forward pre-hooks, one per module (a view stands for the Function's output: no
    memory, a new object); their handles."""
    def alias(_m, args):
        return tuple(a.view_as(a) if isinstance(a, torch.Tensor) else a for a in args)
    return [mod.register_forward_pre_hook(alias) for mod in model.modules()]


class _Linear(torch.autograd.Function):
    """LinearFunctionForZeroStage3, as DeepSpeed 0.19 computes it."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x, weight, bias)
        if x.dim() == 2 and bias is not None:
            return torch.addmm(bias, x, weight.t())
        out = x.matmul(weight.t())
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        dim = grad.dim()
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
                      if dim > 2 else grad.t().matmul(x) if dim == 2
                      else grad.unsqueeze(-1) * x.unsqueeze(0))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = grad.sum(list(range(dim - 1))) if dim > 2 else \
                grad.sum(0) if dim == 2 else grad
        return grad_x, grad_w, grad_b


_recorders: list = []      # the recorder of the trace under way (linear_patched's)


def _note_views(*saved) -> None:
    """Mark the storage of each view the stand-in saves (its base's, a parameter's)."""
    rec = _recorders[-1] if _recorders else None
    for t in saved:
        if rec is not None and t is not None and t._base is not None:
            h = rec.handle_of(t)
            if h is not None:
                rec.storages[h].view_saved = True


def linear(input, weight, bias=None):   # noqa: A002 - F.linear's own names, for keyword calls
    """``zero3_linear_wrap``. Only a call that records the graph saves anything (a
    checkpointed block's first forward runs without)."""
    if torch.is_grad_enabled():
        _note_views(weight, bias)
    return _Linear.apply(input, weight, bias)


@contextlib.contextmanager
def linear_patched(rec=None) -> Iterator[None]:
    """``torch.nn.functional.linear`` is :func:`linear` for the block; ``rec`` (the
    trace's recorder) gets the saved views marked."""
    original = torch.nn.functional.linear
    torch.nn.functional.linear = linear
    _recorders.append(rec)
    try:
        yield
    finally:
        _recorders.pop()
        torch.nn.functional.linear = original


@contextlib.contextmanager
def applied(model: torch.nn.Module, on: bool = True, rec=None) -> Iterator[None]:
    """Both, for the block (nothing where ``on`` is False): a traced step under ZeRO-3."""
    if not on:
        yield
        return
    handles = input_hooks(model)
    try:
        with linear_patched(rec):
            yield
    finally:
        for h in handles:
            h.remove()
