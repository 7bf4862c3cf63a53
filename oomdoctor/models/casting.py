"""Casting a model and a batch to another dtype in ways fake tensors allow (pure bf16/fp16)."""
from __future__ import annotations

from typing import Any

import torch

from oomdoctor.configs import PURE_PRECISIONS, WRAPPER_CASTS


def pure_dtype(precision: str) -> torch.dtype | None:
    """The dtype a pure precision casts the weights and the batch to (bf16-pure:
    ``torch.bfloat16``, fp16-pure: ``torch.float16``); None for fp32 and the AMP precisions,
    whose weights stay fp32."""
    name = PURE_PRECISIONS.get(precision) or WRAPPER_CASTS.get(precision)
    return getattr(torch, name) if name else None


def to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` that keeps tied weights tied. (Module.to swaps tensors in place for
    fake tensors, which refuses tensors that have weakrefs; rebuilding the Parameters avoids it.)"""
    memo: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for store, wrap in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in store.items():
                if t is None or not t.is_floating_point():
                    continue
                if id(t) not in memo:
                    new = t.detach().to(dtype)
                    memo[id(t)] = torch.nn.Parameter(new, t.requires_grad) if wrap else new
                store[name] = memo[id(t)]


def cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    """A batch (tensor, tuple/list or dict) with its floating tensors cast to ``dtype``
    (a pure precision feeds 16-bit inputs); integer tensors such as token ids are left alone."""
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    if isinstance(batch, dict):
        return {k: cast(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(cast(t) for t in batch)
    return cast(batch)
