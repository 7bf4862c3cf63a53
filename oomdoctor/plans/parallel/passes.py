"""The layout's fake passes: one step of the model with hooks on its blocks, recording what each
block is handed and by whom, the order blocks run in, FLOPs per block and each parameter's first
use."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oomdoctor.models.spec import ModelSpec
from oomdoctor.sim.device import dispatch_with_values, mirrored_batch

MAIN = -1          # attribution: the main device (accelerate's io_same_device root), not a block


@dataclass(frozen=True)
class Pass:
    """One pass, blocks named by their definition index (MAIN: the root's own code)."""

    calls: tuple[tuple[int, int, int, bool], ...]   # (block, producer, bytes, requires_grad)
    order: tuple[int, ...]                          # blocks in the order first called
    out_bytes: int                                  # the model's output
    block_flops: dict[int, float]                   # forward + backward, with backward only
    total_flops: float
    first_use: dict[int, int]                       # parameter storage -> block context


def _fresh(func: Any, cache: dict) -> tuple[bool, ...]:
    hit = cache.get(func)
    if hit is None:
        try:
            hit = tuple(r.alias_info is None for r in func._schema.returns)
        except AttributeError:
            hit = ()
        cache[func] = hit
    return hit


def _leaves(obj: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list, dict)):
        return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
    if hasattr(obj, "__dict__"):       # ModelOutput-like objects
        return [t for t in vars(obj).values() if isinstance(t, torch.Tensor)]
    return []


class _Tagger(TorchDispatchMode):
    """Tags every fresh storage with the block running (or last run) when it was made."""

    def __init__(self, owner_by_key: dict[int, int]) -> None:
        from oomdoctor.sim.values import Shadows
        super().__init__()
        self.owner_by_key = owner_by_key
        self.shadows = Shadows()                # the batch's real values (sim.device)
        self.tags: dict[int, int] = {}
        self.stack: list[int] = []
        self.last = MAIN
        self.cache: dict = {}
        self.first_use: dict[int, int] = {}     # parameter storage -> block context

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tag = self.stack[-1] if self.stack else self.last
        for a in args:
            if isinstance(a, torch.Tensor):
                k = a.untyped_storage()._cdata
                if k in self.owner_by_key and k not in self.first_use:
                    self.first_use[k] = tag
        out = dispatch_with_values(self.shadows, func, args, kwargs or {})
        fresh = _fresh(func, self.cache)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and (fresh[i] if i < len(fresh) else True):
                self.tags[o.untyped_storage()._cdata] = tag
        return out


def run_pass(spec: ModelSpec, model: torch.nn.Module, precision: str, defined: list[str],
             owner_by_key: dict[int, int], b: int, backward: bool) -> Pass:
    """One step at batch ``b`` (forward only under no_grad unless ``backward``). Blocks of
    ``defined`` that are not in ``model`` (a cut stack's) are skipped."""
    from torch.utils.flop_counter import FlopCounterMode

    from oomdoctor.sim import emulate, values
    from oomdoctor.models.training import compute_loss, make_configured_batch

    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    tagger = _Tagger(owner_by_key)
    calls: list[tuple[int, int, int, bool]] = []
    order: list[int] = []
    out_bytes = [0]
    blocks = _present(model, defined)
    handles = _hooks(model, blocks, owner_by_key, tagger, calls, order, out_bytes)
    flops = FlopCounterMode(display=False) if backward else contextlib.nullcontext()
    try:
        with flops, tagger:
            batch = mirrored_batch(lambda: make_configured_batch(spec, b, precision),
                                   tagger.shadows)
            with contextlib.ExitStack() as stack:
                # Python-level random draws (transformers 4.x's layerdrop `torch.rand([]) <
                # p`) get values, as in the trace (sim.values.Calls)
                stack.enter_context(values.active(tagger.shadows))
                stack.enter_context(emulate.Int8Kernels())
                if amp is not None:
                    stack.enter_context(emulate.CudaAutocast(amp))
                if not backward:
                    stack.enter_context(torch.no_grad())
                loss = compute_loss(spec, model, batch)
            if backward:
                loss.backward()
    finally:
        for h in handles:
            h.remove()
    counts = flops.get_flop_counts() if backward else {}
    root = type(model).__name__
    block_flops = {i: float(sum(counts.get(f"{root}.{defined[i]}" if defined[i] else root,
                                           {}).values()))
                   for i, _ in blocks} if backward else {}
    return Pass(tuple(calls), tuple(order), out_bytes[0], block_flops,
                float(sum(counts.get("Global", {}).values())), tagger.first_use)


def _present(model: torch.nn.Module, defined: list[str]) -> list[tuple[int, torch.nn.Module]]:
    out = []
    for i, name in enumerate(defined):
        try:
            out.append((i, model.get_submodule(name)))
        except AttributeError:          # a block of the stack cut away
            continue
    return out


def _hooks(model: torch.nn.Module, blocks: list[tuple[int, torch.nn.Module]],
           owner_by_key: dict[int, int], tagger: _Tagger, calls: list, order: list[int],
           out_bytes: list[int]) -> list:
    """Hooks that record each block's inputs and call order into ``calls`` and ``order``, keep
    ``tagger``'s block stack, and put the model's output bytes in ``out_bytes``."""
    handles = []

    def pre(i):
        def hook(_m, args, kwargs):
            if i not in order:
                order.append(i)
            for t in _leaves(list(args) + list(kwargs.values())):
                k = t.untyped_storage()._cdata
                prod = owner_by_key[k] if k in owner_by_key else tagger.tags.get(k, MAIN)
                calls.append((i, prod, t.numel() * t.element_size(), t.requires_grad))
            tagger.stack.append(i)
        return hook

    def post(i):
        def hook(_m, _a, _o):
            if tagger.stack:
                tagger.stack.pop()
            tagger.last = i
        return hook

    for i, mod in blocks:
        handles.append(mod.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(mod.register_forward_hook(post(i), always_call=True))

    def root_out(_m, _a, out):
        out_bytes[0] = sum(t.numel() * t.element_size() for t in _leaves(out))
    handles.append(model.register_forward_hook(root_out))
    return handles
