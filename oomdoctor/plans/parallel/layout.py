"""Model layout: blocks in execution order, who owns each parameter, block inputs, FLOPs."""
from __future__ import annotations

import bisect
import contextlib
import gc
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from oomdoctor.models.blocks import execution_blocks
from oomdoctor.models.spec import ModelSpec, kept_for
from oomdoctor.plans.parallel.passes import MAIN, Pass, run_pass
from oomdoctor.plans.parallel.stack import cut_passes, span_of
from oomdoctor.sim.repeat import MIN_BLOCKS
from oomdoctor.sim.trace import Category, Phase, Trace


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
    # weights stored 4-bit (bitsandbytes): each matmul dequantizes them to 16 bits first
    dequantized_params: int = 0
    # per parameter storage, its other names (a tied weight: lm_head.weight beside
    # model.embed_tokens.weight): the modules that use it besides its owner's
    param_aliases: tuple[tuple[str, ...], ...] = ()

    def block_of(self, module: str) -> int | None:
        """Execution index of the block a module path belongs to; MAIN for root-level code,
        None for code outside the model."""
        if not module:
            return None
        return _block_lookup(self)(module)


def _defining_block(module: str, lookup: dict[str, int]) -> int | None:
    """The block a module path belongs to (its longest prefix in ``lookup``: block path ->
    index), if any."""
    parts = module.split(".")
    for k in range(len(parts), 0, -1):
        i = lookup.get(".".join(parts[:k]))
        if i is not None:
            return i
    return None


def _block_lookup(layout: Layout) -> Callable[[str], int]:
    """module path -> block execution index (MAIN for root-level code), cached on the layout."""
    fn = layout.__dict__.get("_lookup")
    if fn is None:
        index = {name: i for i, name in enumerate(layout.blocks)}
        cache: dict[str, int] = {}

        def fn(module: str) -> int:
            hit = cache.get(module)
            if hit is None:
                found = _defining_block(module, index)
                hit = cache[module] = MAIN if found is None else found
            return hit
        object.__setattr__(layout, "_lookup", fn)      # frozen dataclass: a private cache
    return fn


def model_layout(spec: ModelSpec, precision: str = "fp32", batch_size: int = 2, *,
                 min_blocks: int | None = MIN_BLOCKS) -> Layout:
    """Build the model on fake tensors, run one forward + backward at ``batch_size`` (FLOPs,
    execution order, block inputs) and one forward at batch 1 (the batch-independent part of
    each block input).

    A stack of ``min_blocks`` or more identical blocks (None: never) runs cut to a few blocks and
    is extended to all of them (:mod:`oomdoctor.plans.parallel.stack`): the same layout, to the
    byte and FLOP. A Layout is immutable and depends on nothing else, so each spec keeps its
    own while it lives: `recommend` asks for the same one for each checkpointing setting and
    each candidate it checks."""
    key = (precision, batch_size, min_blocks)
    layouts = kept_for(_KEPT, spec)
    if key not in layouts:
        layouts[key] = _layout(spec, precision, batch_size, min_blocks)
    return layouts[key]


# id(spec) -> (a weak reference to it, its layouts by (precision, batch size, min_blocks))
_KEPT: dict[int, tuple] = {}


def _layout(spec: ModelSpec, precision: str, batch_size: int, min_blocks: int | None
            ) -> Layout:
    with _rebuilt_model(spec, precision) as model:
        root = type(model).__name__
        defined = execution_blocks(model)
        st = _storages(model, defined)

        def run(b: int, backward: bool) -> Pass:
            return run_pass(spec, model, precision, defined, st.owner_by_key, b, backward)
        span = span_of(model, defined, st, min_blocks)
        found = cut_passes(model, span, run, batch_size) if span else None
        p2, p1 = found or (run(batch_size, True), run(1, False))
        model.zero_grad(set_to_none=True)
    exec_defs = _execution_order(len(defined), list(p2.order), st.owner_by_key, p2.first_use)
    to_exec = {d: e for e, d in enumerate(exec_defs)}

    def ex(i: int) -> int:
        return MAIN if i < 0 else to_exec[i]

    inputs = _block_inputs(p1.calls, p2.calls, batch_size, ex)
    block_flops = [p2.block_flops.get(d, 0.0) / batch_size for d in exec_defs]
    out_slope = (p2.out_bytes - p1.out_bytes) // (batch_size - 1) if batch_size > 1 else 0
    return Layout(
        model=spec.name, precision=precision, root=root,
        blocks=tuple(defined[d] for d in exec_defs),
        block_params=tuple(st.block_numel[d] for d in exec_defs),
        param_names=tuple(st.names), param_owner=tuple(ex(o) for o in st.owners_def),
        param_trainable=tuple(st.trainable), param_numel=tuple(st.numel),
        num_param_storages=len(st.param_keys),
        persistent=tuple(n in st.persistent_names for n in st.names),
        tied=tuple(tuple(sorted(ex(i) for i in g)) for g in st.tied_def),
        inputs=tuple(inputs), output_bytes_at_1=p1.out_bytes, output_bytes_per_sample=out_slope,
        block_flops=tuple(block_flops), flops_per_sample=p2.total_flops / batch_size,
        num_parameters=sum(t.numel() for t in st.tensors.values()),
        num_trainable=sum(t.numel() for t in st.tensors.values() if t.requires_grad),
        largest_leaf_params=st.largest_leaf, has_batchnorm=st.has_bn,
        dequantized_params=st.four_bit, param_aliases=tuple(st.aliases))


def script_layout(trace: Trace, name: str) -> Layout:
    """The layout of a training script's model, from its run (``trace.model``, the module it
    trained, and the trace's module labels): blocks, parameter ownership and execution order
    as a model file's. The tensors handed between blocks are the first forward's positional
    arguments (sim.script.TrainedModel), taken as proportional to the batch (one run); the
    FLOPs per block are the step's shared by the blocks' parameters."""
    if trace.model is None:
        raise ValueError(f"{name}: the run trained no module oomdoctor saw")
    if trace.model.others:
        from oomdoctor.sim.script import ScriptError
        raise ScriptError(
            f"{name} trains more than one model: {type(trace.model.module).__name__} and "
            f"{', '.join(trace.model.others)}; splitting or sharding a script's model is "
            "planned for one model only - `oomdoctor estimate` and `probe` measure the whole "
            "run on one GPU")
    model = trace.model.module
    defined = execution_blocks(model)
    # the quantization statistics the run saw made on the GPU (a codebook built from a Python
    # list, torch.tensor(..., device=...), is made outside the dispatcher: 64 bytes unseen)
    seen = {s.name for s in trace.storages.values() if s.phase is Phase.SETUP and s.name}
    st = _storages(model, defined, seen)
    first: dict[int, int] = {}
    lookup = {n: i for i, n in enumerate(defined)}
    for s in sorted(trace.storages.values(), key=lambda s: s.t_alloc):
        if s.module and s.phase is Phase.FORWARD:
            d = _defining_block(s.module, lookup)
            if d is not None:
                first.setdefault(d, s.t_alloc)
    # the first forward's block calls, in the order they ran (sim.script records each block's
    # first call); a block that allocates nothing of its own (an in-place ReLU, an identity
    # dropout) is placed by them, not sent last
    called = list(dict.fromkeys(b for b, _ in trace.model.calls))
    order = called + [d for d in sorted(first, key=first.get) if d not in called]
    exec_defs = _execution_order(len(defined), order, st.owner_by_key, {})
    to_exec = {d: e for e, d in enumerate(exec_defs)}
    batch = max(trace.config.batch_size * trace.config.grad_accum, 1)
    per_sample = trace.flops / batch
    total = max(sum(st.block_numel), 1)
    return Layout(
        model=name, precision=trace.config.precision, root=type(model).__name__,
        blocks=tuple(defined[d] for d in exec_defs),
        block_params=tuple(st.block_numel[d] for d in exec_defs),
        param_names=tuple(st.names),
        param_owner=tuple(MAIN if o < 0 else to_exec[o] for o in st.owners_def),
        param_trainable=tuple(st.trainable), param_numel=tuple(st.numel),
        num_param_storages=len(st.param_keys),
        persistent=tuple(n in st.persistent_names for n in st.names),
        tied=tuple(tuple(sorted(to_exec[i] for i in g)) for g in st.tied_def),
        inputs=_script_inputs(trace, st, lookup, to_exec),
        # the output, proportional to the batch (one run): a + s(b - 1) with a = s
        output_bytes_at_1=trace.model.output_bytes // max(trace.config.batch_size, 1),
        output_bytes_per_sample=trace.model.output_bytes // max(trace.config.batch_size, 1),
        block_flops=_script_block_flops(trace, [defined[d] for d in exec_defs],
                                        [st.block_numel[d] / total for d in exec_defs],
                                        per_sample),
        flops_per_sample=per_sample,
        num_parameters=sum(t.numel() for t in st.tensors.values()),
        num_trainable=sum(t.numel() for t in st.tensors.values() if t.requires_grad),
        largest_leaf_params=st.largest_leaf, has_batchnorm=st.has_bn,
        dequantized_params=st.four_bit, param_aliases=tuple(st.aliases))


def _script_block_flops(trace: Trace, blocks: list[str], by_params: list[float],
                        per_sample: float) -> tuple[float, ...]:
    """Each block's share of the step's FLOPs per sample: its modules' share of the forward's
    (the backward follows the forward op by op), else - no FLOPs counted - its share of the
    parameters (a convolution's compute is not its parameter count: a ResNet's first stage
    is a few percent of the parameters and a fifth of the FLOPs)."""
    counted = dict(trace.module_flops)
    total = sum(counted.values())
    if not total:
        return tuple(per_sample * share for share in by_params)
    return tuple(per_sample * sum(f for name, f in counted.items()
                                  if name == b or name.startswith(b + ".")) / total
                 for b in blocks)


def _script_inputs(trace: Trace, st: "_Storages", lookup: dict[str, int],
                   to_exec: dict[int, int]) -> tuple[BlockInput, ...]:
    """What the script's blocks were handed, each made by the block whose code allocated it
    (a parameter: its owner; the batch and the root's own code: MAIN)."""
    b = max(trace.config.batch_size, 1)
    owner_by_name = dict(zip(st.names, st.owners_def))
    # root-level code's tensors belong to the block that ran last, as a model file's pass
    # tags them (passes._Tagger); the batch, made before any block, to MAIN
    ran = sorted((s.t_alloc, d) for s in trace.storages.values() if s.module
                 and (d := _defining_block(s.module, lookup)) is not None)
    at = [t for t, _ in ran]

    def producer(s) -> int | None:
        if s.category in (Category.PARAMETERS, Category.BUFFERS):
            return owner_by_name.get(s.name)
        d = _defining_block(s.module, lookup) if s.module else None
        if d is None and s.module:
            i = bisect.bisect_left(at, s.t_alloc) - 1
            d = ran[i][1] if i >= 0 else None
        return d

    def ex(d: int | None) -> int:
        return MAIN if d is None or d < 0 else to_exec[d]
    out = []
    for block, args in trace.model.calls:
        for handle, nbytes, grad in args:
            s = trace.storages.get(handle) if handle is not None else None
            if s is not None:
                out.append(BlockInput(ex(block), ex(producer(s)), nbytes // b, nbytes // b,
                                      grad))
    return tuple(out)


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
    aliases: list[tuple[str, ...]]           # per parameter key: its names after the first
    trainable: list[bool]
    numel: list[int]
    block_numel: list[int]
    persistent_names: set[str]
    largest_leaf: int
    has_bn: bool
    four_bit: int = 0                        # parameters of 4-bit weights (two per byte)


def _storages(model: torch.nn.Module, defined: list[str],
              quant_seen: set[str] | None = None) -> _Storages:
    """Parameter and buffer storages in the order trace.py registers them, their owners, and
    the parameter counts per block; ``quant_seen``: the quantization statistics to count, by
    name (None: all)."""
    def_index = {n: i for i, n in enumerate(defined)}

    def owner_of(names: list[str]) -> int:
        for name in names:           # a tensor's name: its module's path, then its own
            module = name.rpartition(".")[0]
            i = _defining_block(module, def_index) if module else None
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
    # bitsandbytes' quantization statistics, registered by the trace as buffers (same order)
    from oomdoctor.models.adapters import named_quant_states
    quant_states = [(n, t) for n, t in named_quant_states(model)
                    if quant_seen is None or n in quant_seen]
    persistent_names = _saved_names(model) | {n for n, _ in quant_states}
    for n, b in (*model.named_buffers(), *quant_states):
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
    aliases = [tuple(names_by_key[k][1:]) for k in param_keys]
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
    from oomdoctor.models.adapters import logical_numel
    four_bit = sum(logical_numel(t) for t in tensors.values()
                   if getattr(t, "quant_state", None) is not None)
    return _Storages(param_keys, keys, tensors, names, owners_def, owner_by_key, tied_def,
                     aliases, trainable, numel, block_numel, persistent_names, largest_leaf,
                     has_bn, four_bit)


def _saved_names(model: torch.nn.Module) -> set[str]:
    """The parameters and buffers ``model.state_dict()`` saves, read from the modules rather
    than by calling it: state_dict runs library hooks that read values (bitsandbytes'
    ``QuantState.as_dict`` calls ``.item()`` on a double-quantized weight's offset, which a
    meta tensor has none of). A buffer registered ``persistent=False`` is not saved."""
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for prefix, m in model.named_modules(remove_duplicate=False):
        skip = m._non_persistent_buffers_set
        names.update(f"{prefix}.{n}" if prefix else n for n, b in m._buffers.items()
                     if b is not None and n not in skip)
    return names


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
