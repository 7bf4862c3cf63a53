"""Model layout: blocks in execution order, who owns each parameter, block inputs, FLOPs."""
from __future__ import annotations

import contextlib
import gc
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from oomdoctor.models.spec import ModelSpec


MAIN = -1          # attribution: the main device (accelerate's io_same_device root), not a block


@dataclass(frozen=True)
class BlockInput:
    """A tensor handed to a block: who made it and how big it is at batch b (a + s*(b-1))."""

    block: int                  # consumer, execution index
    producer: int               # execution index of the block that made it, MAIN for the inputs
    bytes_at_1: int
    bytes_per_sample: int
    requires_grad: bool

    def bytes(self, batch: int) -> int:
        return max(0, self.bytes_at_1 + self.bytes_per_sample * (batch - 1))


@dataclass(frozen=True)
class Layout:
    """The model's blocks in execution order, who owns each parameter, FLOPs per sample."""

    model: str
    precision: str
    root: str                                # the root module's class name (trace label)
    blocks: tuple[str, ...]                  # module paths, execution order
    block_params: tuple[int, ...]            # parameters owned per block (count)
    param_names: tuple[str, ...]             # per parameter/buffer storage, trace order
    param_owner: tuple[int, ...]             # ... owning block (execution index) or MAIN
    param_trainable: tuple[bool, ...]
    param_numel: tuple[int, ...]
    num_param_storages: int                  # the first storages are parameters, then buffers
    persistent: tuple[bool, ...]             # in state_dict (accelerate's device map needs it)
    tied: tuple[tuple[int, ...], ...]        # blocks that share a parameter
    inputs: tuple[BlockInput, ...]
    output_bytes_at_1: int                   # the model's output (DataParallel gathers it)
    output_bytes_per_sample: int
    block_flops: tuple[float, ...]           # forward + backward FLOPs per sample, per block
    flops_per_sample: float                  # the whole step, forward + backward
    num_parameters: int
    num_trainable: int
    largest_leaf_params: int                 # DeepSpeed's "largest layer" (direct params)
    has_batchnorm: bool

    def block_of(self, module: str) -> int | None:
        """Execution index of the block a module path belongs to; MAIN for root-level code,
        None for code outside the model."""
        if not module:
            return None
        return _block_lookup(self)(module)


def _block_lookup(layout: Layout) -> Callable[[str], int]:
    """module path -> block execution index (MAIN for root-level code), cached on the layout."""
    fn = layout.__dict__.get("_lookup")
    if fn is None:
        index = {name: i for i, name in enumerate(layout.blocks)}
        cache: dict[str, int] = {}

        def fn(module: str) -> int:
            hit = cache.get(module)
            if hit is None:
                hit = MAIN
                parts = module.split(".")
                for k in range(len(parts), 0, -1):
                    i = index.get(".".join(parts[:k]))
                    if i is not None:
                        hit = i
                        break
                cache[module] = hit
            return hit
        object.__setattr__(layout, "_lookup", fn)      # frozen dataclass: a private cache
    return fn


_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def execution_blocks(model: torch.nn.Module) -> list[str]:
    """The units a split or FSDP places: the leaves of the module tree after expanding the root,
    containers (ModuleList/Sequential/ModuleDict) and wrappers around a list of repeated blocks
    (a GPT's `transformer`); a residual block with a small Sequential inside stays whole."""
    out: list[str] = []

    def repeated(c: torch.nn.Module) -> bool:
        kinds = [type(x) for x in c.children()]
        return isinstance(c, _CONTAINERS) and any(kinds.count(k) >= 2 for k in kinds)

    def holds_blocks(m: torch.nn.Module) -> bool:
        return any(repeated(c) for c in m.modules() if c is not m)

    def visit(name: str, mod: torch.nn.Module, root: bool) -> None:
        children = list(mod.named_children())
        if children and (root or isinstance(mod, _CONTAINERS) or holds_blocks(mod)):
            for child_name, child in children:
                visit(f"{name}.{child_name}" if name else child_name, child, False)
        elif not root:
            out.append(name)
    visit("", model, True)
    return out or [""]


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


def model_layout(spec: ModelSpec, precision: str = "fp32", batch_size: int = 2) -> Layout:
    """Build the model on fake tensors, run one forward + backward at ``batch_size`` (FLOPs,
    execution order, block inputs) and one forward at batch 1 (the batch-independent part of
    each block input)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from oomdoctor.sim import emulate
    from oomdoctor.models.training import build_for_training, compute_loss, make_configured_batch

    gc.collect()
    torch.manual_seed(0)
    with FakeTensorMode():
        model, _ = build_for_training(spec, precision)
        root = type(model).__name__
        defined = execution_blocks(model)
        def_index = {n: i for i, n in enumerate(defined)}

        def owner_of(names: list[str]) -> int:
            for name in names:
                parts = name.split(".")[:-1]
                for k in range(len(parts), 0, -1):
                    i = def_index.get(".".join(parts[:k]))
                    if i is not None:
                        return i
            return MAIN

        # Parameter and buffer storages in the order trace.py registers them.
        names_by_key: dict[int, list[str]] = defaultdict(list)
        for n, p in model.named_parameters(remove_duplicate=False):
            names_by_key[p.untyped_storage()._cdata].append(n)
        param_keys: list[int] = []
        tensors: dict[int, torch.Tensor] = {}
        for p in model.parameters():
            k = p.untyped_storage()._cdata
            if k not in tensors:
                tensors[k] = p
                param_keys.append(k)
        buffer_names: dict[int, str] = {}
        persistent_names = set(model.state_dict().keys())
        for n, b in model.named_buffers():
            k = b.untyped_storage()._cdata
            if k not in tensors and k not in buffer_names:
                buffer_names[k] = n
        keys = param_keys + list(buffer_names)
        names = [names_by_key[k][0] if k in names_by_key else buffer_names[k] for k in keys]
        owners_def = [owner_of(names_by_key[k] if k in names_by_key else [buffer_names[k]])
                      for k in keys]
        tied_def = []
        for k in param_keys:
            group = sorted({owner_of([n]) for n in names_by_key[k]})
            if len(group) > 1:
                tied_def.append(tuple(group))
        trainable = [bool(k in names_by_key and tensors[k].requires_grad) for k in keys]
        numel = [tensors[k].numel() if k in tensors else 0 for k in keys]
        block_numel = [0] * len(defined)
        for k, o in zip(param_keys, owners_def[:len(param_keys)]):
            if o >= 0:
                block_numel[o] += tensors[k].numel()
        owner_by_key = dict(zip(keys, owners_def))
        largest_leaf = max((sum(p.numel() for p in m.parameters(recurse=False))
                            for m in model.modules()), default=0)
        has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())

        amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)

        class Tagger(TorchDispatchMode):
            """Tags every fresh storage with the block running (or last run) when it was made."""

            def __init__(self) -> None:
                super().__init__()
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
                        if k in owner_by_key and k not in self.first_use:
                            self.first_use[k] = tag
                out = func(*args, **(kwargs or {}))
                fresh = _fresh(func, self.cache)
                outs = out if isinstance(out, (tuple, list)) else (out,)
                for i, o in enumerate(outs):
                    if isinstance(o, torch.Tensor) and (fresh[i] if i < len(fresh) else True):
                        self.tags[o.untyped_storage()._cdata] = tag
                return out

        def run(b: int, backward: bool):
            tagger = Tagger()
            calls: list[tuple[int, int, int, bool]] = []      # (def block, producer, bytes, rg)
            order: list[int] = []
            out_bytes = [0]
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

            for i, name in enumerate(defined):
                mod = model.get_submodule(name)
                handles.append(mod.register_forward_pre_hook(pre(i), with_kwargs=True))
                handles.append(mod.register_forward_hook(post(i), always_call=True))

            def root_out(_m, _a, out):
                out_bytes[0] = sum(t.numel() * t.element_size() for t in _leaves(out))
            handles.append(model.register_forward_hook(root_out))
            flops = FlopCounterMode(display=False) if backward else contextlib.nullcontext()
            try:
                with flops, tagger:
                    batch = make_configured_batch(spec, b, precision)
                    with contextlib.ExitStack() as stack:
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
            return calls, order, out_bytes[0], counts, tagger.first_use

        calls2, order, out2, counts, first_use = run(batch_size, True)
        calls1, _, out1, _, _ = run(1, False)
        model.zero_grad(set_to_none=True)

    # Execution order. A block that is never called but whose weight the parent code uses
    # directly (BERT's `token_type_embeddings.weight[0]`) goes where that use happens; blocks
    # never used at all go last.
    exec_defs = list(order)
    for d in range(len(defined)):
        if d in order:
            continue
        uses = [first_use[k] for k, o in owner_by_key.items() if o == d and k in first_use]
        if not uses:
            continue
        ctx = uses[0]
        exec_defs.insert(0 if ctx == MAIN else exec_defs.index(ctx) + 1, d)
    exec_defs += [i for i in range(len(defined)) if i not in exec_defs]
    to_exec = {d: e for e, d in enumerate(exec_defs)}

    def ex(i: int) -> int:
        return MAIN if i < 0 else to_exec[i]

    inputs = []
    if len(calls1) == len(calls2):
        for (c, p, n2, rg), (_, _, n1, _) in zip(calls2, calls1):
            slope = (n2 - n1) // (batch_size - 1) if batch_size > 1 else 0
            inputs.append(BlockInput(ex(c), ex(p), n1, slope, rg))
    else:   # data-dependent structure: scale the batch_size pass linearly
        inputs = [BlockInput(ex(c), ex(p), n // batch_size, n // batch_size, rg)
                  for c, p, n, rg in calls2]
    block_flops = []
    for d in exec_defs:
        name = f"{root}.{defined[d]}" if defined[d] else root
        block_flops.append(sum(counts.get(name, {}).values()) / batch_size)
    total = sum(counts.get("Global", {}).values()) / batch_size
    out_slope = (out2 - out1) // (batch_size - 1) if batch_size > 1 else 0
    return Layout(
        model=spec.name, precision=precision, root=root,
        blocks=tuple(defined[d] for d in exec_defs),
        block_params=tuple(block_numel[d] for d in exec_defs),
        param_names=tuple(names), param_owner=tuple(ex(o) for o in owners_def),
        param_trainable=tuple(trainable), param_numel=tuple(numel),
        num_param_storages=len(param_keys),
        persistent=tuple(n in persistent_names for n in names),
        tied=tuple(tuple(sorted(ex(i) for i in g)) for g in tied_def),
        inputs=tuple(inputs), output_bytes_at_1=out1, output_bytes_per_sample=out_slope,
        block_flops=tuple(block_flops), flops_per_sample=total,
        num_parameters=sum(t.numel() for t in tensors.values()),
        num_trainable=sum(t.numel() for t in tensors.values() if t.requires_grad),
        largest_leaf_params=largest_leaf, has_batchnorm=has_bn)
