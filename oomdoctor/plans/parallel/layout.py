"""Model layout: blocks in execution order, who owns each parameter, block inputs, FLOPs."""
from __future__ import annotations

import contextlib
import gc
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oomdoctor.models.spec import ModelSpec
from oomdoctor.sim.device import dispatch_with_values, mirrored_batch


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
    with _rebuilt_model(spec, precision) as model:
        root = type(model).__name__
        defined = execution_blocks(model)
        st = _storages(model, defined)
        calls2, order, out2, counts, first_use = _run(spec, model, precision, defined,
                                                      st.owner_by_key, batch_size, True)
        calls1, _, out1, _, _ = _run(spec, model, precision, defined, st.owner_by_key, 1, False)
        model.zero_grad(set_to_none=True)
    exec_defs = _execution_order(len(defined), order, st.owner_by_key, first_use)
    to_exec = {d: e for e, d in enumerate(exec_defs)}

    def ex(i: int) -> int:
        return MAIN if i < 0 else to_exec[i]

    inputs = _block_inputs(calls1, calls2, batch_size, ex)
    block_flops = _block_flops(counts, root, [defined[d] for d in exec_defs], batch_size)
    total = sum(counts.get("Global", {}).values()) / batch_size
    out_slope = (out2 - out1) // (batch_size - 1) if batch_size > 1 else 0
    return Layout(
        model=spec.name, precision=precision, root=root,
        blocks=tuple(defined[d] for d in exec_defs),
        block_params=tuple(st.block_numel[d] for d in exec_defs),
        param_names=tuple(st.names), param_owner=tuple(ex(o) for o in st.owners_def),
        param_trainable=tuple(st.trainable), param_numel=tuple(st.numel),
        num_param_storages=len(st.param_keys),
        persistent=tuple(n in st.persistent_names for n in st.names),
        tied=tuple(tuple(sorted(ex(i) for i in g)) for g in st.tied_def),
        inputs=tuple(inputs), output_bytes_at_1=out1, output_bytes_per_sample=out_slope,
        block_flops=tuple(block_flops), flops_per_sample=total,
        num_parameters=sum(t.numel() for t in st.tensors.values()),
        num_trainable=sum(t.numel() for t in st.tensors.values() if t.requires_grad),
        largest_leaf_params=st.largest_leaf, has_batchnorm=st.has_bn)


@contextlib.contextmanager
def _rebuilt_model(spec: ModelSpec, precision: str) -> Iterator[torch.nn.Module]:
    """The model built again from the spec, seeded, on the meta device as the trace builds it
    (oomdoctor.sim.device: on fake CPU tensors a user's or peft's ``Module.to`` failed to swap
    tensors, and 4-bit weights could not be built): the layout's passes run there too."""
    from oomdoctor.models.training import build_for_training
    from oomdoctor.sim.device import on_meta

    gc.collect()
    torch.manual_seed(0)
    with on_meta():
        model, _ = build_for_training(spec, precision)
        yield model


@dataclass
class _Storages:
    """The model's parameter and buffer storages, by storage key, and who owns them (blocks in
    definition order)."""

    param_keys: list[int]                    # parameter storages, then ...
    keys: list[int]                          # ... the buffers' after them
    tensors: dict[int, torch.Tensor]         # parameter storage -> a tensor on it
    names: list[str]
    owners_def: list[int]                    # per key: owning block (definition index) or MAIN
    owner_by_key: dict[int, int]
    tied_def: list[tuple[int, ...]]
    trainable: list[bool]
    numel: list[int]
    block_numel: list[int]
    persistent_names: set[str]
    largest_leaf: int
    has_bn: bool


def _storages(model: torch.nn.Module, defined: list[str]) -> _Storages:
    """Parameter and buffer storages in the order trace.py registers them, their owners, and
    the parameter counts per block."""
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
    # bitsandbytes' quantization statistics, registered by the trace as buffers (same order)
    from oomdoctor.models.adapters import named_quant_states
    for n, b in (*model.named_buffers(), *named_quant_states(model)):
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
    return _Storages(param_keys, keys, tensors, names, owners_def, owner_by_key, tied_def,
                     trainable, numel, block_numel, persistent_names, largest_leaf, has_bn)


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


def _run(spec: ModelSpec, model: torch.nn.Module, precision: str, defined: list[str],
         owner_by_key: dict[int, int], b: int, backward: bool):
    """One step at batch ``b`` (forward only under no_grad unless ``backward``): each block's
    inputs (def block, producer, bytes, requires_grad), the blocks in call order, the model's
    output bytes, FLOPs per module (with ``backward``) and each parameter's first use."""
    from torch.utils.flop_counter import FlopCounterMode

    from oomdoctor.sim import emulate
    from oomdoctor.models.training import compute_loss, make_configured_batch

    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    tagger = _Tagger(owner_by_key)
    calls: list[tuple[int, int, int, bool]] = []      # (def block, producer, bytes, rg)
    order: list[int] = []
    out_bytes = [0]
    handles = _hooks(model, defined, owner_by_key, tagger, calls, order, out_bytes)
    flops = FlopCounterMode(display=False) if backward else contextlib.nullcontext()
    try:
        with flops, tagger:
            batch = mirrored_batch(lambda: make_configured_batch(spec, b, precision),
                                   tagger.shadows)
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


def _hooks(model: torch.nn.Module, defined: list[str], owner_by_key: dict[int, int],
           tagger: _Tagger, calls: list, order: list[int], out_bytes: list[int]) -> list:
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

    for i, name in enumerate(defined):
        mod = model.get_submodule(name)
        handles.append(mod.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(mod.register_forward_hook(post(i), always_call=True))

    def root_out(_m, _a, out):
        out_bytes[0] = sum(t.numel() * t.element_size() for t in _leaves(out))
    handles.append(model.register_forward_hook(root_out))
    return handles


def _execution_order(num_defined: int, order: list[int], owner_by_key: dict[int, int],
                     first_use: dict[int, int]) -> list[int]:
    """Definition indices in execution order."""
    # Execution order. A block that is never called but whose weight the parent code uses
    # directly (BERT's `token_type_embeddings.weight[0]`) goes where that use happens; blocks
    # never used at all go last.
    exec_defs = list(order)
    for d in range(num_defined):
        if d in order:
            continue
        uses = [first_use[k] for k, o in owner_by_key.items() if o == d and k in first_use]
        if not uses:
            continue
        ctx = uses[0]
        exec_defs.insert(0 if ctx == MAIN else exec_defs.index(ctx) + 1, d)
    exec_defs += [i for i in range(num_defined) if i not in exec_defs]
    return exec_defs


def _block_inputs(calls1: list, calls2: list, batch_size: int,
                  ex: Callable[[int], int]) -> list[BlockInput]:
    """Block inputs, affine in the batch from the batch-1 and ``batch_size`` passes."""
    inputs = []
    if len(calls1) == len(calls2):
        for (c, p, n2, rg), (_, _, n1, _) in zip(calls2, calls1):
            slope = (n2 - n1) // (batch_size - 1) if batch_size > 1 else 0
            inputs.append(BlockInput(ex(c), ex(p), n1, slope, rg))
    else:   # data-dependent structure: scale the batch_size pass linearly
        inputs = [BlockInput(ex(c), ex(p), n // batch_size, n // batch_size, rg)
                  for c, p, n, rg in calls2]
    return inputs


def _block_flops(counts: dict, root: str, blocks: list[str], batch_size: int) -> list[float]:
    """Forward + backward FLOPs per sample of each block (``blocks``: module paths)."""
    block_flops = []
    for block in blocks:
        name = f"{root}.{block}" if block else root
        block_flops.append(sum(counts.get(name, {}).values()) / batch_size)
    return block_flops
