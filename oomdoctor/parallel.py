"""Per-GPU memory of multi-GPU training: DDP, DataParallel, ZeRO-1/2/3 (FSDP), a naive 2-GPU split.

    oomdoctor parallel sample_models/gpt2_small.py --gpus 2 --gpu rtx3090 -b 8 --precision bf16
    oomdoctor split sample_models/llama7b.py --gpus 2 --gpu rtx3090 --precision bf16-pure

Every strategy starts from the single-GPU trace of one rank's micro-batch (:mod:`oomdoctor.trace`)
and rewrites its storage list into the event list each GPU's caching allocator would see, which is
then replayed by :mod:`oomdoctor.allocator`, exactly as :mod:`oomdoctor.estimate` does for one GPU:

- **DDP**: the single-GPU list plus the reducer's gradient buckets (one more copy of the gradients
  unless ``gradient_as_bucket_view=True``), its 250 MiB-chunked parameter broadcast at start-up and
  the buffer broadcast before each forward. DDP never lowers per-GPU memory; it multiplies
  throughput.
- **DataParallel**: GPU 0 holds the optimizer, the whole batch, the gathered outputs and the loss
  over the whole batch; the other GPUs get fresh parameter replicas every forward.
- **ZeRO-1** (PyTorch: DDP + ``ZeroRedundancyOptimizer``): optimizer state and the optimizer's
  temporaries only for the parameters a rank owns (whole parameters, greedy by size, as
  ``ZeroRedundancyOptimizer._partition_parameters`` does). **ZeRO-2**: also the gradients, full
  size while their block's backward runs, then a 1/N shard. **ZeRO-3 / FSDP FULL_SHARD**: also the
  parameters, a 1/N shard at rest, each block all-gathered for its forward and its backward (and
  the next block prefetched). Model states are cross-checked against DeepSpeed's estimators.
- **pipeline2**: the model's blocks, in execution order, split into two contiguous stages on
  cuda:0 and cuda:1 (accelerate's ``dispatch_model``); every storage goes to the stage of the
  block that made it, tensors crossing the cut are copied to the consumer's device, and the cut
  is the one whose larger stage peak is smallest. No micro-batch pipelining: one GPU idles while
  the other computes.

Blocks, parameter ownership, the tensors each block receives and FLOPs per block come from one
extra fake forward + backward (:func:`model_layout`). Backward storages are attributed to blocks
by *windows*: a block's backward is over when its parameters' last gradient is made.

Known limitations:
- NCCL/gloo buffers live outside the caching allocator and are not counted (a few hundred MiB
  per GPU with NCCL); neither are DeepSpeed's own bucket sizes (``reduce_bucket_size``).
- ZeRO-2 keeps the parameters replicated (DeepSpeed's stage 2); PyTorch FSDP's SHARD_GRAD_OP
  additionally keeps a 1/N parameter shard.
- The split assumes the blocks run in one sequence; models that re-enter an earlier block (weight
  sharing across stages) keep the tied blocks on one GPU and pay an extra crossing.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterable

import torch

from oomdoctor.allocator import AllocatorConfig, replay
from oomdoctor.estimate import Budget, trace_for
from oomdoctor.gpus import GpuProfile, MiB
from oomdoctor.loader import ModelSpec
from oomdoctor.trace import Category, Phase, Trace, TraceConfig

STRATEGIES = ("single", "ddp", "dp", "zero1", "zero2", "zero3", "pipeline2")
ALIASES = {"fsdp": "zero3", "dataparallel": "dp", "pipeline": "pipeline2", "split": "pipeline2",
           "naive-pipeline": "pipeline2", "zero": "zero3"}
DESCRIPTIONS = {
    "single": "one GPU",
    "ddp": "DistributedDataParallel: full replica per GPU",
    "dp": "nn.DataParallel: one process, GPU 0 gathers",
    "zero1": "ZeRO-1: optimizer state sharded (DDP + ZeroRedundancyOptimizer)",
    "zero2": "ZeRO-2: + gradients sharded",
    "zero3": "ZeRO-3 / FSDP FULL_SHARD: + parameters sharded",
    "pipeline2": "naive 2-GPU split: stages on cuda:0 and cuda:1",
}

# DDP constants (torch/nn/parallel/distributed.py, torch 2.x): buckets of 25 MiB
# (_DEFAULT_BUCKET_CAP_MB), the first one 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) once buckets are
# rebuilt in gradient-ready order after the first iteration; before that a single bucket holds
# every gradient (compute_bucket_size_limits: [sys.maxsize] unless find_unused_parameters).
# Reducer::initialize_buckets clears the old buckets before allocating the new ones.
DDP_FIRST_BUCKET_BYTES = 1 * MiB
DDP_BUCKET_BYTES = 25 * MiB
# DistributedDataParallel.__init__: self.broadcast_bucket_size = 250 * 1024 * 1024, used by
# _sync_module_states at start-up and by the buffer broadcast before every forward.
DDP_BROADCAST_BUCKET_BYTES = 250 * MiB
# torch/nn/parallel/comm.py: broadcast_coalesced / reduce_add_coalesced(buffer_size=10485760).
DP_COALESCE_BYTES = 10 * 1024 * 1024

BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries",
                  "communication", "allocator_overhead", "cuda_context")
_CATEGORY_KEY = {
    Category.PARAMETERS: "parameters", Category.BUFFERS: "parameters",
    Category.GRADIENTS: "gradients", Category.OPTIMIZER_STATE: "optimizer_state",
    Category.ACTIVATIONS: "activations", Category.INPUTS: "activations",
    Category.TEMPORARIES: "temporaries",
}
MAIN = -1          # attribution: the main device (accelerate's io_same_device root), not a block

Progress = Callable[[str], None]


def parse_strategy(name: str) -> str:
    key = name.lower().replace("_", "").replace(" ", "")
    key = ALIASES.get(key, key)
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)} "
                         f"(aliases: {', '.join(ALIASES)})")
    return key


@dataclass(frozen=True)
class Strategy:
    """One way to use ``num_gpus`` GPUs."""

    name: str
    num_gpus: int = 1
    bucket_view: bool = False       # DDP/ZeRO-1 gradient_as_bucket_view=True

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.name!r}")
        if self.name == "single" and self.num_gpus != 1:
            object.__setattr__(self, "num_gpus", 1)
        if self.name == "pipeline2" and self.num_gpus != 2:
            raise ValueError("pipeline2 splits the model over exactly 2 GPUs; for more GPUs use "
                             "zero3 (FSDP)")
        if self.num_gpus < 1:
            raise ValueError(f"--num-gpus must be >= 1, got {self.num_gpus}")

    @property
    def data_parallel(self) -> int:
        """Ranks that each see a different micro-batch."""
        return 1 if self.name in ("single", "pipeline2") else self.num_gpus

    @property
    def processes(self) -> int:
        """Processes the launcher starts (DataParallel and the split run in one process)."""
        return self.num_gpus if self.name in ("ddp", "zero1", "zero2", "zero3") else 1


# ---------------------------------------------------------------------------------------------
# Model layout: blocks, ownership, what crosses between blocks, FLOPs
# ---------------------------------------------------------------------------------------------

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

    from oomdoctor import emulate
    from oomdoctor.loader import build_for_training, compute_loss, make_configured_batch

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


# ---------------------------------------------------------------------------------------------
# Sizes: one trace, or two traces whose every storage is affine in the batch size
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sizes:
    """Bytes of every trace storage (by handle) at any batch: ``base + slope * (b - batch)``."""

    batch: int
    base: tuple[int, ...]
    slope: tuple[int, ...] | None = None

    @classmethod
    def of(cls, trace: Trace) -> "Sizes":
        n = max(trace.storages, default=-1) + 1
        base = [0] * n
        for h, s in trace.storages.items():
            base[h] = s.nbytes
        return cls(trace.config.batch_size, tuple(base))

    @classmethod
    def affine(cls, t1: Trace, t2: Trace) -> "Sizes | None":
        """Per-storage slope from two traces of the same ops, None if they differ."""
        b1, b2 = t1.config.batch_size, t2.config.batch_size
        if b1 == b2 or [(a, h) for a, h, _ in t1.events] != [(a, h) for a, h, _ in t2.events] \
                or set(t1.storages) != set(t2.storages):
            return None
        one, two = cls.of(t1), cls.of(t2)
        slope = []
        for s1, s2 in zip(one.base, two.base):
            d, r = divmod(s2 - s1, b2 - b1)
            if r:
                return None
            slope.append(d)
        return cls(b1, one.base, tuple(slope))

    def at(self, batch: int) -> list[int]:
        if batch == self.batch:
            return list(self.base)
        if self.slope is None:
            # One trace only: scale what grows with the batch proportionally (inputs, outputs).
            return [s * batch // self.batch for s in self.base]
        k = batch - self.batch
        return [max(0, s + d * k) for s, d in zip(self.base, self.slope)]


# ---------------------------------------------------------------------------------------------
# Timing: phases, block forward spans, backward windows
# ---------------------------------------------------------------------------------------------

class _Timing:
    """Where each block runs on the trace's timeline (raw event indices)."""

    def __init__(self, trace: Trace, layout: Layout) -> None:
        self.trace = trace
        self.layout = layout
        nblocks = len(layout.blocks)
        end = 1 + max((max(s.t_alloc, s.t_free or 0) for s in trace.storages.values()),
                      default=0)
        self.end = end
        marks = list(trace.marks)
        self.phases = [(m.start, marks[i + 1].start if i + 1 < len(marks) else end, m)
                       for i, m in enumerate(marks)]
        self._starts = [p[0] for p in self.phases]
        lookup = _block_lookup(layout)
        self.block: dict[int, int | None] = {
            h: (lookup(s.module) if s.module else None) for h, s in trace.storages.items()}
        # Forward: each block's first and last allocation per forward phase, and which block ran
        # last at each allocation (root-level code runs on that block's device).
        self.fwd_spans: dict[int, dict[int, list[int]]] = defaultdict(dict)
        self._fwd_last: dict[int, tuple[list[int], list[int]]] = {}
        by_alloc = sorted(trace.storages.values(), key=lambda s: s.t_alloc)
        for s in by_alloc:
            ph = self.phase_index(s.t_alloc)
            if self.phases[ph][2].phase is not Phase.FORWARD:
                continue
            b = self.block[s.handle]
            if b is None or b < 0:
                continue
            span = self.fwd_spans[ph].setdefault(b, [s.t_alloc, s.t_alloc])
            span[1] = s.t_alloc
            pos, blk = self._fwd_last.setdefault(ph, ([], []))
            if not blk or blk[-1] != b:
                pos.append(s.t_alloc)
                blk.append(b)
        # Backward: a block's backward ends with its parameters' gradients (the weight gradient
        # of its first op comes last). Each gradient is matched to the latest-registered
        # trainable parameter of its size still without one: backward runs the blocks in reverse.
        setup = sorted((s for s in trace.storages.values() if s.phase is Phase.SETUP),
                       key=lambda s: s.t_alloc)
        self.grad_owner: dict[int, int] = {}        # gradient handle -> parameter index
        by_phase: dict[int, list] = defaultdict(list)
        for s in by_alloc:
            if s.category is Category.GRADIENTS:
                by_phase[self.phase_index(s.t_alloc)].append(s)
        self.bwd_windows: dict[int, list[tuple[float, float, int]]] = {}
        template: tuple[int, list[tuple[int, int]]] | None = None   # (phase, [(ordinal, block)])
        allocs: dict[int, list[int]] = defaultdict(list)
        for s in by_alloc:
            allocs[self.phase_index(s.t_alloc)].append(s.t_alloc)
        for ph, (start, stop, mark) in enumerate(self.phases):
            if mark.phase is not Phase.BACKWARD:
                continue
            grads = by_phase.get(ph, [])
            ends: dict[int, float] = {}
            if grads:
                free: dict[int, list[int]] = defaultdict(list)
                for i, p in enumerate(setup[:layout.num_param_storages]):
                    if layout.param_trainable[i]:
                        free[p.nbytes].append(i)
                for g in grads:
                    stack = free.get(g.nbytes)
                    if not stack:
                        continue
                    i = stack.pop()
                    self.grad_owner[g.handle] = i
                    b = layout.param_owner[i]
                    if b >= 0:
                        ends[b] = max(ends.get(b, -1), g.t_alloc)
                ordinals = allocs[ph]
                template = (ph, [(bisect.bisect_right(ordinals, e), b)
                                 for b, e in ends.items()])
            elif template is not None:
                # No new gradients (accumulation into existing ones): the same ops allocate in
                # the same order as in the template's backward, so map the boundaries by the
                # allocation ordinal.
                ordinals = allocs[ph]
                for k, b in template[1]:
                    if ordinals:
                        ends[b] = ordinals[min(k, len(ordinals)) - 1] if k else start
            wins: list[tuple[float, float, int]] = []
            prev: float = start
            for b in range(nblocks - 1, -1, -1):
                e = ends.get(b)
                if e is not None and e + 0.5 > prev:
                    wins.append((prev, e + 0.5, b))
                    prev = e + 0.5
            # What runs after the earliest block's last gradient belongs to block 0.
            if wins and wins[-1][2] == 0:
                lo, _, _ = wins.pop()
                wins.append((lo, stop, 0))
            else:
                wins.append((prev, stop, 0))
            self.bwd_windows[ph] = wins

    def phase_index(self, pos: float) -> int:
        return max(0, bisect.bisect_right(self._starts, pos) - 1)

    def phase_of(self, pos: float) -> Phase:
        return self.phases[self.phase_index(pos)][2].phase

    def window(self, pos: float) -> tuple[int, int, int] | None:
        """(start, stop, block) of the backward window containing ``pos``."""
        wins = self.bwd_windows.get(self.phase_index(pos))
        if not wins:
            return None
        i = bisect.bisect_right([w[0] for w in wins], pos) - 1
        return wins[max(i, 0)]

    def block_window(self, ph: int, block: int) -> tuple[int, int] | None:
        for lo, hi, b in self.bwd_windows.get(ph, ()):
            if b == block:
                return lo, hi
        return None

    def last_block_at(self, pos: float) -> int:
        """The block whose forward allocated most recently before ``pos`` (MAIN if none)."""
        ph = self.phase_index(pos)
        pos_list, blocks = self._fwd_last.get(ph, ([], []))
        i = bisect.bisect_right(pos_list, pos) - 1
        return blocks[i] if i >= 0 else MAIN

    def backward_of(self, fwd_ph: int) -> int | None:
        """The backward phase that follows forward phase ``fwd_ph``."""
        for ph in range(fwd_ph + 1, len(self.phases)):
            kind = self.phases[ph][2].phase
            if kind is Phase.BACKWARD:
                return ph
            if kind is Phase.FORWARD:
                return None
        return None

    def marks_of(self, phase: Phase) -> list[int]:
        return [i for i, p in enumerate(self.phases) if p[2].phase is phase]


# ---------------------------------------------------------------------------------------------
# Event lists per GPU
# ---------------------------------------------------------------------------------------------

class _Gpu:
    """One GPU's allocations on the trace's timeline, to be sorted into an event list."""

    def __init__(self, label: str, first_handle: int) -> None:
        self.label = label
        self.items: list[tuple[float, int, bool, int, int]] = []
        self.keys: dict[int, str] = {}
        self._next = first_handle

    def add(self, key: str, nbytes: int, t_alloc: float, t_free: float | None,
            handle: int | None = None) -> int:
        if handle is None:
            handle = self._next
            self._next += 1
        self.keys[handle] = key
        self.items.append((t_alloc, len(self.items), True, handle, nbytes))
        if t_free is not None:
            self.items.append((t_free, len(self.items), False, handle, nbytes))
        return handle

    def events(self) -> tuple[list[tuple[bool, int, int]], list[float]]:
        items = sorted(self.items)
        return [(a, h, n) for _, _, a, h, n in items], [p for p, *_ in items]


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's predicted peak under a strategy. Bytes are ints."""

    label: str
    peak_allocated_bytes: int           # torch.cuda.max_memory_allocated()
    peak_reserved_bytes: int            # torch.cuda.max_memory_reserved()
    device_peak_bytes: int              # reserved + CUDA context (nvidia-smi at the peak)
    fits: bool
    breakdown: dict[str, int]
    peak_phase: str
    model_state_bytes: int              # parameters + gradients + optimizer state at the peak
    resting_state_bytes: int = 0        # the same at the end of the last optimizer step


@dataclass(frozen=True)
class Partition:
    """A two-stage split: which blocks run on which GPU."""

    stages: tuple[tuple[str, ...], ...]
    main_stage: int                     # where the inputs, the root and the loss live
    device_map: dict[str, int]          # accelerate device map (module/param name -> GPU)
    flops_share: tuple[float, ...]      # share of the step's compute per stage
    boundary_bytes: int                 # bytes copied across per micro-batch, forward

    @property
    def utilisation(self) -> tuple[float, ...]:
        """Busy fraction of each GPU with no micro-batch pipelining."""
        return self.flops_share


@dataclass(frozen=True)
class StrategyEstimate:
    """Per-GPU memory of one strategy at one configuration."""

    model: str
    strategy: str
    num_gpus: int
    precision: str
    checkpointing: bool
    micro_batch: int                    # per GPU (per data-parallel rank)
    grad_accum: int
    effective_batch: int
    gpu: str
    device_total_bytes: int
    budget_bytes: int
    gpus: tuple[GpuMemory, ...]
    fits: bool
    model_state_floor_bytes: int        # params + grads + optimizer state per GPU, no activations
    deepspeed_bytes: int | None = None  # DeepSpeed's estimator for this stage (its dtypes)
    partition: Partition | None = None
    notes: tuple[str, ...] = ()

    @property
    def peak_device_bytes(self) -> int:
        return max(g.device_peak_bytes for g in self.gpus)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["peak_device_bytes"] = self.peak_device_bytes
        d["notes"] = list(self.notes)
        if self.partition is not None:
            d["partition"]["utilisation"] = list(self.partition.utilisation)
        return d


class _Context:
    """What every strategy builder needs: the trace, its timing, sizes at this batch."""

    def __init__(self, trace: Trace, layout: Layout, gpu: GpuProfile, sizes: list[int],
                 sizes_dp: list[int] | None = None, workspaces: bool = True) -> None:
        self.trace = trace
        self.layout = layout
        self.gpu = gpu
        self.timing = _Timing(trace, layout)
        self.size = sizes
        self.size_dp = sizes_dp or sizes
        self.storages = sorted((s for s in trace.storages.values() if not s.host),
                               key=lambda s: s.t_alloc)
        self.first_handle = len(sizes) + 16
        self.with_workspaces = workspaces
        setup = [s for s in self.storages if s.phase is Phase.SETUP]
        if len(setup) != len(layout.param_owner):
            raise ValueError(f"{layout.model}: the trace registered {len(setup)} parameter/buffer "
                             f"storages, the layout {len(layout.param_owner)}; trace and layout "
                             "must come from the same model file and precision")
        self.param_index = {s.handle: i for i, s in enumerate(setup)}
        self.setup_end = min((m.start for m in trace.marks if m.phase is not Phase.SETUP),
                             default=self.timing.end)
        self.opt_param = _optimizer_params(self)

    def key(self, h: int) -> str:
        return _CATEGORY_KEY[self.trace.storages[h].category]

    def workspaces(self, g: _Gpu) -> None:
        # One cuBLAS workspace per thread's handle: the forward thread's and autograd's
        # (see estimate.device_events), allocated before the first forward / backward matmul.
        if not self.with_workspaces:
            return
        for mark in self.trace.marks:
            if mark.iteration == 0 and mark.micro == 0 and mark.phase in (Phase.FORWARD,
                                                                          Phase.BACKWARD):
                g.add("temporaries", self.gpu.cublas_workspace_bytes, mark.start - 0.5, None)

    def param_bytes(self, owner: int | None = None) -> int:
        total = 0
        for s in self.storages:
            if s.phase is not Phase.SETUP or s.category is not Category.PARAMETERS:
                continue
            if owner is None or self.layout.param_owner[self.param_index[s.handle]] == owner:
                total += self.size[s.handle]
        return total

    def gradients_in_order(self) -> list[int]:
        """Sizes of the gradients of the first backward, in the order they were made."""
        first = [ph for ph in self.timing.marks_of(Phase.BACKWARD)][:1]
        if not first:
            return []
        lo, hi, _ = self.timing.phases[first[0]]
        return [self.size[s.handle] for s in self.storages
                if s.category is Category.GRADIENTS and lo <= s.t_alloc < hi]


def _optimizer_params(ctx: _Context) -> dict[int, int]:
    """For optimizer-phase storages: the index (in layout.param_* order) of the parameter each
    belongs to. Runs of consecutive allocations by one op whose sizes follow the trainable
    parameters (``_foreach_*`` lists, ``zeros_like`` per state slot) are matched element-wise;
    otherwise a pointer walks the parameters by size (for-loop optimizers)."""
    lay = ctx.layout
    params = [i for i in range(lay.num_param_storages) if lay.param_trainable[i]]
    handle_of = {i: h for h, i in ctx.param_index.items()}
    psize = [ctx.trace.storages[handle_of[i]].nbytes for i in params]
    opt = [s for s in ctx.storages if s.phase is Phase.OPTIMIZER]
    out: dict[int, int] = {}
    if not params:
        return out
    runs: list[list] = []
    for s in opt:
        if runs and (runs[-1][0].op, runs[-1][0].iteration) == (s.op, s.iteration):
            runs[-1].append(s)
        else:
            runs.append([s])
    ptr = 0
    n = len(params)
    for run in runs:
        sizes = [s.nbytes for s in run]
        if len(run) % n == 0:
            k = len(run) // n
            # k state slots per parameter (zeros_like for exp_avg, exp_avg_sq) or k lists
            # of one _foreach_* op after another.
            for index in (lambda j: j // k, lambda j: j % n):
                if all(sizes[j] == psize[index(j)] for j in range(len(run))):
                    for j, s in enumerate(run):
                        out[s.handle] = params[index(j)]
                    break
            else:
                index = None
            if index is not None:
                continue
        for s in run:
            if s.nbytes == psize[ptr % n]:
                out[s.handle] = params[ptr % n]
            elif s.nbytes == psize[(ptr + 1) % n]:
                ptr += 1
                out[s.handle] = params[ptr % n]
    return out


def _base(ctx: _Context, g: _Gpu, keep: Callable[[Any], bool] = lambda s: True,
          size: Callable[[Any], int] | None = None) -> None:
    for s in ctx.storages:
        if keep(s):
            g.add(ctx.key(s.handle), size(s) if size else ctx.size[s.handle], s.t_alloc,
                  s.t_free, s.handle)


def _single(ctx: _Context) -> list[_Gpu]:
    g = _Gpu("GPU 0", ctx.first_handle)
    ctx.workspaces(g)
    _base(ctx, g)
    return [g]


def _chunks(sizes: Iterable[int], cap: int) -> list[int]:
    """Greedy coalescing chunks (comm.cpp take_tensors): a chunk closes once it reaches cap."""
    out, cur = [], 0
    for n in sizes:
        if cur and cur + n > cap:
            out.append(cur)
            cur = 0
        cur += n
    if cur:
        out.append(cur)
    return out


def ddp_buckets(grad_sizes: list[int], first: int = DDP_FIRST_BUCKET_BYTES,
                cap: int = DDP_BUCKET_BYTES) -> list[int]:
    """Rebuilt DDP buckets (reducer.cpp compute_bucket_assignment_by_size): gradients in the order
    they become ready, a bucket closes when it reaches its limit - 1 MiB for the first, then
    25 MiB."""
    out, cur = [], 0
    for n in grad_sizes:
        cur += n
        if cur >= (first if not out else cap):
            out.append(cur)
            cur = 0
    if cur:
        out.append(cur)
    return out


def _add_ddp(ctx: _Context, g: _Gpu, bucket_view: bool) -> list[str]:
    """DDP's own allocations on one rank."""
    notes = []
    grads = ctx.gradients_in_order()
    if not grads:
        return notes
    t0 = ctx.setup_end - 0.5
    # Start-up: parameters and buffers broadcast from rank 0 in 250 MiB coalesced chunks.
    states = [ctx.size[s.handle] for s in ctx.storages if s.phase is Phase.SETUP]
    for n in _chunks(states, DDP_BROADCAST_BUCKET_BYTES):
        g.add("communication", n, t0, t0)
    # One bucket with every gradient until the buckets are rebuilt before the second forward.
    fwd = ctx.timing.marks_of(Phase.FORWARD)
    second = next((ctx.timing.phases[ph][0] for ph in fwd
                   if ctx.timing.phases[ph][2].iteration == 1), None)
    rebuild_at = second - 0.5 if second is not None else None
    g.add("communication", sum(grads), t0, rebuild_at)
    if rebuild_at is not None:
        for n in ddp_buckets(grads):
            g.add("communication", n, rebuild_at, None)
    # Buffers are broadcast before every forward (broadcast_buffers=True).
    buffers = [ctx.size[s.handle] for s in ctx.storages
               if s.phase is Phase.SETUP and s.category is Category.BUFFERS]
    if buffers:
        for ph in fwd:
            start = ctx.timing.phases[ph][0] - 0.4
            for n in _chunks(buffers, DDP_BROADCAST_BUCKET_BYTES):
                g.add("communication", n, start, start)
    if bucket_view:
        notes.append("gradient_as_bucket_view=True: gradients are views into the buckets")
    else:
        notes.append(f"DDP gradient buckets hold a second copy of the gradients "
                     f"({_gib(sum(grads))}); pass gradient_as_bucket_view=True to DDP to drop it")
    return notes


def _ddp(ctx: _Context, strategy: Strategy) -> tuple[list[_Gpu], list[str]]:
    g = _Gpu("each GPU", ctx.first_handle)
    ctx.workspaces(g)
    _base(ctx, g, keep=lambda s: not (strategy.bucket_view
                                      and s.category is Category.GRADIENTS))
    notes = _add_ddp(ctx, g, strategy.bucket_view)
    notes.append(f"DDP does not lower per-GPU memory: each of the {strategy.num_gpus} GPUs holds "
                 "the whole model, its gradients and optimizer state; it multiplies throughput "
                 f"(effective batch = micro-batch x {strategy.num_gpus} x accumulation)")
    return [g], notes


def _dp(ctx: _Context, strategy: Strategy) -> tuple[list[_Gpu], list[str]]:
    n = strategy.num_gpus
    tl = ctx.timing
    g0 = _Gpu("GPU 0", ctx.first_handle)
    ctx.workspaces(g0)

    def outside(s) -> bool:       # runs on GPU 0 for the whole batch
        return s.phase is Phase.DATA or (s.phase is Phase.FORWARD and not s.module)

    _base(ctx, g0, size=lambda s: ctx.size_dp[s.handle] if outside(s) else ctx.size[s.handle])
    lay = ctx.layout
    out_b = max(0, lay.output_bytes_at_1 + lay.output_bytes_per_sample
                * (ctx.trace.config.batch_size - 1))
    params = ctx.param_bytes()
    grads = sum(ctx.gradients_in_order())
    for ph in tl.marks_of(Phase.FORWARD):
        start, stop, _ = tl.phases[ph]
        # Replicas each forward: broadcast_coalesced flattens 10 MiB chunks on GPU 0.
        g0.add("communication", min(DP_COALESCE_BYTES, params), start - 0.3, start - 0.3)
        # Gathered outputs of all replicas, used by the loss on GPU 0.
        g0.add("activations", out_b * n, stop - 0.6, stop - 0.2)
    for ph in tl.marks_of(Phase.BACKWARD):
        _, stop, _ = tl.phases[ph]
        # Gradients summed onto GPU 0 (ReduceAddCoalesced, 10 MiB chunks per device).
        g0.add("communication", min(DP_COALESCE_BYTES, grads) * n, stop - 0.5, stop - 0.5)
    gk = _Gpu("GPU 1..", ctx.first_handle)
    ctx.workspaces(gk)
    fwd_phases = tl.marks_of(Phase.FORWARD)
    replicas = [ctx.size[s.handle] for s in ctx.storages if s.phase is Phase.SETUP]
    for ph in fwd_phases:
        start = tl.phases[ph][0]
        bw = tl.backward_of(ph)
        end = tl.phases[bw][1] - 0.5 if bw is not None else tl.phases[ph][1]
        for nb in replicas:
            gk.add("parameters", nb, start - 0.2, end)
    for s in ctx.storages:
        if s.phase in (Phase.SETUP, Phase.OPTIMIZER, Phase.ZERO_GRAD):
            continue
        if s.phase is Phase.FORWARD and not s.module:
            continue                            # the loss runs on GPU 0
        free = s.t_free
        if s.category is Category.GRADIENTS:
            bw = tl.phase_index(s.t_alloc)
            free = tl.phases[bw][1] - 0.4       # summed onto GPU 0 at the end of backward
        gk.add(ctx.key(s.handle), ctx.size[s.handle], s.t_alloc, free, s.handle)
    notes = [f"DataParallel puts the optimizer, the whole batch, the {n} gathered outputs and the "
             "loss on GPU 0 and copies the parameters to every GPU each forward: GPU 0 "
             "carries the most; use DistributedDataParallel (one process per GPU, no GPU-0 "
             "hot spot, does not need P2P: DataParallel hangs or crawls on boards whose GPUs "
             "report P2P 'Not Supported')"]
    return [g0, gk], notes


def zero_partition(numels: list[int], world: int) -> list[int]:
    """Rank of each parameter under ZeroRedundancyOptimizer: largest first, each to the rank with
    the fewest elements so far (zero_redundancy_optimizer.py _partition_parameters)."""
    sizes = [0] * world
    rank = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        r = min(range(world), key=lambda r: sizes[r])
        rank[i] = r
        sizes[r] += numels[i]
    return rank


def _shard(n: int, world: int) -> int:
    return -(-n // world)


def _zero(ctx: _Context, strategy: Strategy, stage: int) -> tuple[list[_Gpu], list[str]]:
    n = strategy.num_gpus
    tl = ctx.timing
    lay = ctx.layout
    notes: list[str] = []
    if stage == 1:
        # Whole parameters per rank: the ranks differ, so each is its own event list.
        trainable = [i for i in range(lay.num_param_storages) if lay.param_trainable[i]]
        ranks = zero_partition([lay.param_numel[i] for i in trainable], n)
        owner_rank = dict(zip(trainable, ranks))
        gpus = []
        for r in range(n):
            g = _Gpu(f"GPU {r}", ctx.first_handle)
            ctx.workspaces(g)

            def keep(s, r=r):
                if s.phase is not Phase.OPTIMIZER:
                    return True
                p = ctx.opt_param.get(s.handle)
                return p is None or owner_rank.get(p, 0) == r
            _base(ctx, g, keep=keep)
            notes = _add_ddp(ctx, g, strategy.bucket_view)
            gpus.append(g)
        notes.append("ZeRO-1 as PyTorch runs it: DDP (with its buckets) + ZeroRedundancyOptimizer, "
                     "which gives each rank whole parameters (largest first), so ranks differ")
        return gpus, notes

    g = _Gpu("each GPU", ctx.first_handle)
    ctx.workspaces(g)
    reduce_at: dict[float, int] = defaultdict(int)       # window end -> unsharded gradient bytes
    for s in ctx.storages:
        h, size = s.handle, ctx.size[s.handle]
        key = ctx.key(h)
        if s.phase is Phase.OPTIMIZER or s.category is Category.OPTIMIZER_STATE:
            g.add(key, _shard(size, n), s.t_alloc, s.t_free, h)
        elif s.category is Category.GRADIENTS and tl.phase_of(s.t_alloc) is Phase.BACKWARD:
            # Full size until its block's backward is done, then reduce-scattered to a shard.
            ph = tl.phase_index(s.t_alloc)
            owner = tl.grad_owner.get(h)
            win = tl.block_window(ph, lay.param_owner[owner]) if owner is not None else None
            win = win or tl.window(s.t_alloc)
            done = win[1] if win else tl.phases[ph][1]
            if s.t_free is not None and s.t_free <= done:
                g.add(key, size, s.t_alloc, s.t_free, h)
                continue
            g.add(key, size, s.t_alloc, done - 0.2, h)
            g.add(key, _shard(size, n), done - 0.2, s.t_free)
            reduce_at[done] += size
        elif stage == 3 and s.phase is Phase.SETUP and s.category is Category.PARAMETERS:
            g.add(key, _shard(size, n), s.t_alloc, s.t_free, h)
        else:
            g.add(key, size, s.t_alloc, s.t_free, h)
    # FSDP's foreach_reduce copies a block's unsharded gradients into one reduce-scatter input
    # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) while they are still alive.
    for done, nbytes in reduce_at.items():
        g.add("communication", _shard(nbytes, n) * n, done - 0.3, done - 0.1)
    if stage == 3:
        _gather_units(ctx, g, n)
        notes.append("FSDP/ZeRO-3: each block is all-gathered for its forward and again for its "
                     "backward (the next one prefetched); wrap every block, e.g. "
                     "fully_shard(block) for each, then fully_shard(model)")
    else:
        notes.append("ZeRO-2 as DeepSpeed runs it: parameters replicated, gradients reduce-"
                     "scattered block by block, optimizer state sharded")
    return [g], notes


def _gather_units(ctx: _Context, g: _Gpu, world: int) -> None:
    """ZeRO-3: unsharded parameters of each block during its forward and its backward window,
    with the next block prefetched; root-level parameters stay gathered for the whole step.
    FSDP2's all-gather lands in one flat buffer (foreach_all_gather) that is copied out into the
    parameters (foreach_all_gather_copy_out) and then freed: twice the block, briefly."""
    tl = ctx.timing
    nblocks = len(ctx.layout.blocks)
    unit = [ctx.param_bytes(b) for b in range(nblocks)]
    root = ctx.param_bytes(MAIN)

    def gather(nbytes: int, start: float, stop: float) -> None:
        g.add("communication", _shard(nbytes, world) * world, start - 0.3, start - 0.2)
        g.add("parameters", nbytes, start - 0.25, stop)

    for ph in tl.marks_of(Phase.FORWARD):
        spans = tl.fwd_spans.get(ph, {})
        order = sorted(spans, key=lambda b: spans[b][0])
        bw = tl.backward_of(ph)
        fstart, fstop, _ = tl.phases[ph]
        bstop = tl.phases[bw][1] if bw is not None else fstop
        if root:
            gather(root, fstart + 0.2, bstop - 0.1)
        for i, b in enumerate(order):
            # Gathered when the previous block starts (prefetch), freed when this one ends.
            start = spans[order[i - 1]][0] if i else spans[b][0]
            if unit[b]:
                gather(unit[b], start, spans[b][1] + 0.5)
        if bw is None:
            continue
        wins = tl.bwd_windows.get(bw, [])
        for i, (lo, hi, b) in enumerate(wins):
            start = wins[i - 1][0] if i else lo
            if unit[b]:
                gather(unit[b], start, hi - 0.25)


# ---------------------------------------------------------------------------------------------
# pipeline2
# ---------------------------------------------------------------------------------------------

class _Pipeline:
    """Every storage attributed to a block (or MAIN), plus the potential boundary copies, so that
    any cut's two event lists are a filter of one table."""

    def __init__(self, ctx: _Context) -> None:
        self.ctx = ctx
        tl = ctx.timing
        lay = ctx.layout
        self.nblocks = len(lay.blocks)
        rows = []          # (t_alloc, t_free, handle, size, key, attr, producer)
        for s in ctx.storages:
            h = s.handle
            if s.phase is Phase.SETUP:
                attr = lay.param_owner[ctx.param_index[h]]
            elif s.phase is Phase.DATA:
                attr = MAIN
            elif s.phase is Phase.FORWARD:
                b = tl.block[h]
                attr = MAIN if b is None else (b if b >= 0 else tl.last_block_at(s.t_alloc))
            elif s.phase is Phase.BACKWARD:
                owner = tl.grad_owner.get(h)
                win = tl.window(s.t_alloc)
                attr = (lay.param_owner[owner] if owner is not None
                        else win[2] if win else MAIN)
            elif s.phase is Phase.OPTIMIZER:
                p = ctx.opt_param.get(h)
                attr = lay.param_owner[p] if p is not None else MAIN
            else:
                attr = MAIN
            rows.append((s.t_alloc, s.t_free, h, ctx.size[h], ctx.key(h), attr, None))
        # Tensors handed to a block on another GPU are copied there by accelerate's hook
        # (send_to_device) before the block runs, and live until the block's backward is done;
        # their gradient comes back as a transient copy on the producer's GPU.
        batch = ctx.trace.config.batch_size
        handle = ctx.first_handle
        for ph in tl.marks_of(Phase.FORWARD):
            spans = tl.fwd_spans.get(ph, {})
            bw = tl.backward_of(ph)
            for inp in lay.inputs:
                span = spans.get(inp.block)
                nbytes = inp.bytes(batch)
                if span is None or nbytes == 0:
                    continue
                win = tl.block_window(bw, inp.block) if bw is not None else None
                end = (win[1] - 0.5) if win else tl.phases[ph][1] - 0.5
                rows.append((span[0] - 0.5, end, handle, nbytes, "activations", inp.block,
                             inp.producer))
                handle += 1
                if inp.requires_grad and win:
                    rows.append((win[1] - 0.45, win[1] - 0.45, handle, nbytes, "temporaries",
                                 inp.producer, inp.block))
                    handle += 1
        self.rows = rows
        self.handle_end = handle
        self.ws = []
        for mark in ctx.trace.marks if ctx.with_workspaces else ():
            if mark.iteration == 0 and mark.micro == 0 and mark.phase in (Phase.FORWARD,
                                                                          Phase.BACKWARD):
                self.ws.append(mark.start - 0.5)

    def stages(self, cut: int) -> list[int]:
        """Stage of each block (index nblocks: MAIN) for a cut before execution index ``cut``;
        tied blocks follow the first of their group; MAIN is the last block's stage."""
        st = [0 if b < cut else 1 for b in range(self.nblocks)]
        for group in self.ctx.layout.tied:
            for b in group[1:]:
                st[b] = st[group[0]]
        st.append(st[-1])
        return st

    def _table(self):
        """All rows as one time-ordered array of +/- 512-rounded sizes (built once)."""
        import numpy as np
        if getattr(self, "_arrays", None) is None:
            ev = []
            for t0, t1, _, n, _, attr, prod in self.rows:
                r = -(-n // 512) * 512 if n else 0
                p = -2 if prod is None else prod
                ev.append((t0, 0, r, attr, p))
                if t1 is not None:
                    ev.append((t1, 1, -r, attr, p))
            ev.sort(key=lambda e: (e[0], e[1]))
            arr = np.array([(d, a, p) for _, _, d, a, p in ev], dtype=np.int64).reshape(-1, 3)
            self._arrays = (arr[:, 0], arr[:, 1], arr[:, 2])
        return self._arrays

    def live_peak(self, cut: int) -> tuple[int, ...]:
        """Peak of live bytes (512-rounded) per stage, without the allocator: for the search."""
        import numpy as np
        delta, attr, prod = self._table()
        st = np.array(self.stages(cut), dtype=np.int64)
        stage = st[attr]
        crossing = (prod == -2) | (st[np.where(prod == -2, 0, prod)] != stage)
        peaks = []
        for k in range(2):
            d = np.where((stage == k) & crossing, delta, 0)
            peaks.append(int(np.cumsum(d).max(initial=0)) if len(d) else 0)
        return tuple(peaks)

    def gpus(self, cut: int) -> list[_Gpu]:
        st = self.stages(cut)
        out = [_Gpu(f"GPU {k} (stage {k})", self.handle_end) for k in range(2)]
        for g in out:
            for pos in self.ws:
                g.add("temporaries", self.ctx.gpu.cublas_workspace_bytes, pos, None)
        for t0, t1, h, n, key, attr, prod in self.rows:
            if prod is not None and st[prod] == st[attr]:
                continue
            out[st[attr]].add(key, n, t0, t1, h)
        return out

    def partition(self, cut: int) -> Partition:
        lay = self.ctx.layout
        st = self.stages(cut)
        stages = tuple(tuple(b for i, b in enumerate(lay.blocks) if st[i] == k) for k in range(2))
        dmap = {b: st[i] for i, b in enumerate(lay.blocks) if b}
        main = st[self.nblocks]
        for i, name in enumerate(lay.param_names):
            if lay.param_owner[i] == MAIN and lay.persistent[i]:
                dmap[name] = main
        fl = [0.0, 0.0]
        for i, f in enumerate(lay.block_flops):
            fl[st[i]] += f
        total = sum(fl) or 1.0
        batch = self.ctx.trace.config.batch_size
        cross = sum(inp.bytes(batch) for inp in lay.inputs
                    if st[inp.producer] != st[inp.block])
        return Partition(stages, main, dmap, (fl[0] / total, fl[1] / total), cross)


# ---------------------------------------------------------------------------------------------
# Replay and results
# ---------------------------------------------------------------------------------------------

def _measure(ctx: _Context, g: _Gpu, budget: Budget, alloc: AllocatorConfig) -> GpuMemory:
    events, positions = g.events()
    limited = replay(events, alloc, budget.limit_bytes)
    fits = limited.oom is None
    result = limited if fits else replay(events, alloc, None)
    at = result.peak_allocated_index
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0)
    live: dict[int, int] = {}
    for is_alloc, h, n in events[:at + 1]:
        if is_alloc:
            live[h] = n
        else:
            live.pop(h, None)
    for h, n in live.items():
        breakdown[g.keys[h]] += n
    used = sum(breakdown.values())
    breakdown["allocator_overhead"] = result.peak_reserved_bytes - used
    breakdown["cuda_context"] = budget.cuda_context_bytes
    phase = ctx.timing.phase_of(positions[at]).value if positions else "setup"
    state = breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_state"]
    return GpuMemory(g.label, result.peak_allocated_bytes, result.peak_reserved_bytes,
                     result.peak_reserved_bytes + budget.cuda_context_bytes, fits, breakdown,
                     phase, state, _resting_state(ctx, g.keys, events, positions))


def _resting_state(ctx: _Context, keys: dict[int, str], events: list, positions: list) -> int:
    """Parameters + gradients + optimizer state alive when the last optimizer step ends (before
    zero_grad): the model states DeepSpeed's estimators count, without the layer in flight."""
    opt = [stop for _, stop, m in ctx.timing.phases if m.phase is Phase.OPTIMIZER]
    if not opt:
        return 0
    until = bisect.bisect_left(positions, opt[-1] - 0.5)
    live: dict[int, int] = {}
    for is_alloc, h, n in events[:until]:
        if is_alloc:
            live[h] = n
        else:
            live.pop(h, None)
    return sum(n for h, n in live.items()
               if keys[h] in ("parameters", "gradients", "optimizer_state"))


def _gib(n: float) -> str:
    """IEC size for prose: GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _unit(largest: int) -> tuple[Callable[[int], str], str]:
    """A column formatter and its unit for a table whose largest value is ``largest``."""
    if largest >= 2**30:
        return (lambda n: f"{n / 2**30:.2f}"), "GiB"
    return (lambda n: f"{n / 2**20:.1f}"), "MiB"


def deepspeed_zero2_gpu_bytes(total_params: int, num_gpus: int,
                              offload_optimizer: bool = False) -> int:
    """DeepSpeed's ZeRO-2 model-state estimate per GPU (deepspeed/runtime/zero/stage_1_and_2.py,
    estimate_zero2_model_states_mem_needs): 2P + 18P/N - 2 B of 16-bit parameters replicated;
    16-bit and 32-bit gradients, 32-bit master weights and Adam's two moments sharded. With the
    optimizer offloaded to the CPU: 2P."""
    if offload_optimizer:
        return 2 * total_params
    return 2 * total_params + int(18 * total_params / num_gpus)


def deepspeed_zero3_gpu_bytes(total_params: int, largest_layer_params: int, num_gpus: int,
                              offload_optimizer: bool = False, offload_params: bool = False
                              ) -> int:
    """DeepSpeed's ZeRO-3 estimate per GPU (deepspeed/runtime/zero/stage3.py,
    estimate_zero3_model_states_mem_needs): 4L + 18P/N, L the largest layer's parameters
    (16-bit parameters + gradients of the layer being computed); 4L + 2P/N with the optimizer
    offloaded; 4L with parameters offloaded too."""
    layer = 4 * largest_layer_params
    if offload_optimizer and offload_params:
        return layer
    if offload_optimizer:
        return layer + int(2 * total_params / num_gpus)
    return layer + int(18 * total_params / num_gpus)


def model_state_floor(param_bytes: int, grad_bytes: int, optim_bytes: int, strategy: Strategy
                      ) -> int:
    """Parameters + gradients + optimizer state one GPU must hold under ``strategy`` - a lower
    bound of its peak (activations, temporaries and buffers come on top)."""
    n = strategy.num_gpus
    if strategy.name in ("single", "ddp", "dp"):
        return param_bytes + grad_bytes + optim_bytes
    if strategy.name == "zero1":
        return param_bytes + grad_bytes + optim_bytes // n
    if strategy.name == "zero2":
        return param_bytes + (grad_bytes + optim_bytes) // n
    if strategy.name == "zero3":
        return (param_bytes + grad_bytes + optim_bytes) // n
    return (param_bytes + grad_bytes + optim_bytes) // 2      # pipeline2: at best half each


def _build(trace: Trace, layout: Layout, strategy: Strategy, gpu: GpuProfile,
           sizes: Sizes | None, batch: int | None,
           choose_cut: Callable[["_Pipeline"], int] | None = None, workspaces: bool = True
           ) -> tuple[_Context, list[_Gpu], list[str], "Partition | None"]:
    sizes = sizes or Sizes.of(trace)
    b = batch or trace.config.batch_size
    dp_sizes = sizes.at(b * strategy.num_gpus) if strategy.name == "dp" else None
    tr = trace if b == trace.config.batch_size else _rebatched(trace, b)
    ctx = _Context(tr, layout, gpu, sizes.at(b), dp_sizes, workspaces)
    partition = None
    notes: list[str] = []
    if strategy.name == "single":
        gpus = _single(ctx)
    elif strategy.name == "ddp":
        gpus, notes = _ddp(ctx, strategy)
    elif strategy.name == "dp":
        gpus, notes = _dp(ctx, strategy)
    elif strategy.name in ("zero1", "zero2", "zero3"):
        gpus, notes = _zero(ctx, strategy, int(strategy.name[-1]))
    else:
        pipe = _Pipeline(ctx)
        if pipe.nblocks < 2:
            raise ValueError(f"{layout.model} has a single block ({layout.blocks[0]!r}); there "
                             "is nothing to split across two GPUs - use zero3 (FSDP)")
        cut = choose_cut(pipe) if choose_cut else min(
            range(1, pipe.nblocks), key=lambda c: (max(pipe.live_peak(c)), c))
        gpus = pipe.gpus(cut)
        partition = pipe.partition(cut)
        notes = [f"naive split, no micro-batch pipelining: one GPU idles while the other works; "
                 f"expected utilisation GPU 0 {partition.utilisation[0]:.0%}, GPU 1 "
                 f"{partition.utilisation[1]:.0%} (the pair does the work of one GPU, at most)"]
    return ctx, gpus, notes, partition


def strategy_events(trace: Trace, layout: Layout, strategy: Strategy, gpu: GpuProfile,
                    sizes: Sizes | None = None, batch: int | None = None,
                    workspaces: bool = True) -> list[tuple[str, list[tuple[bool, int, int]]]]:
    """Each GPU's (label, allocator event list) under ``strategy`` - what
    :func:`estimate_strategy` replays; without ``workspaces`` the cuBLAS workspaces are left out
    (to compare with a CPU run). The split's cut is the best by live bytes."""
    _, gpus, _, _ = _build(trace, layout, strategy, gpu, sizes, batch, workspaces=workspaces)
    return [(g.label, g.events()[0]) for g in gpus]


def live_peak(events: list[tuple[bool, int, int]]) -> int:
    """Peak of live bytes of an event list (no allocator rounding): what a CPU run measures."""
    live = peak = 0
    for is_alloc, _, n in events:
        live += n if is_alloc else -n
        peak = max(peak, live)
    return peak


def estimate_strategy(trace: Trace, layout: Layout, strategy: Strategy, budget: Budget,
                      alloc: AllocatorConfig = AllocatorConfig(), sizes: Sizes | None = None,
                      batch: int | None = None, grad_accum: int = 1) -> StrategyEstimate:
    """Per-GPU peaks of ``strategy`` for the traced configuration at micro-batch ``batch``
    (default: the trace's) per data-parallel rank."""
    ctx, gpus, notes, partition = _build(
        trace, layout, strategy, budget.gpu, sizes, batch,
        choose_cut=lambda pipe: _best_cut(pipe, budget, alloc))
    measured = tuple(_measure(ctx, g, budget, alloc) for g in gpus)
    b = ctx.trace.config.batch_size
    cfg = trace.config
    floor = model_state_floor(trace.parameter_bytes, trace.gradient_bytes,
                              trace.optimizer_state_bytes, strategy)
    ds = None
    if strategy.name == "zero2":
        ds = deepspeed_zero2_gpu_bytes(layout.num_parameters, strategy.num_gpus)
    elif strategy.name == "zero3":
        ds = deepspeed_zero3_gpu_bytes(layout.num_parameters, layout.largest_leaf_params,
                                       strategy.num_gpus)
    d = strategy.data_parallel
    return StrategyEstimate(
        model=layout.model, strategy=strategy.name, num_gpus=strategy.num_gpus,
        precision=cfg.precision, checkpointing=cfg.checkpointing, micro_batch=b,
        grad_accum=grad_accum, effective_batch=b * grad_accum * d, gpu=budget.gpu.name,
        device_total_bytes=budget.gpu.total_bytes, budget_bytes=budget.limit_bytes,
        gpus=measured, fits=all(g.fits for g in measured), model_state_floor_bytes=floor,
        deepspeed_bytes=ds, partition=partition, notes=tuple(notes))


def _rebatched(trace: Trace, b: int) -> Trace:
    return replace(trace, config=replace(trace.config, batch_size=b))


def _best_cut(pipe: _Pipeline, budget: Budget, alloc: AllocatorConfig) -> int:
    """The cut whose larger stage peak is smallest: every cut by live bytes, the best three
    replayed through the allocator."""
    scored = sorted(range(1, pipe.nblocks), key=lambda c: (max(pipe.live_peak(c)), c))
    best, best_peak = scored[0], None
    for cut in scored[:3]:
        peak = max(_measure(pipe.ctx, g, budget, alloc).peak_reserved_bytes
                   for g in pipe.gpus(cut))
        if best_peak is None or peak < best_peak:
            best, best_peak = cut, peak
    return best


# ---------------------------------------------------------------------------------------------
# The `parallel` and `split` commands' library entry points
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParallelReport:
    """Every requested strategy at one configuration."""

    model: str
    gpu: str
    num_gpus: int
    device_total_bytes: int
    budget_bytes: int
    micro_batch: int
    precision: str
    checkpointing: bool
    num_parameters: int
    estimates: tuple[StrategyEstimate, ...]
    errors: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.gpu, "num_gpus": self.num_gpus,
                "device_total_bytes": self.device_total_bytes, "budget_bytes": self.budget_bytes,
                "micro_batch": self.micro_batch, "precision": self.precision,
                "checkpointing": self.checkpointing, "num_parameters": self.num_parameters,
                "strategies": [e.to_json() for e in self.estimates],
                "errors": [{"strategy": s, "error": m} for s, m in self.errors]}


def estimate_strategies(spec: ModelSpec, cfg: TraceConfig, budget: Budget, num_gpus: int,
                        strategies: Iterable[str] = STRATEGIES,
                        alloc: AllocatorConfig = AllocatorConfig(), bucket_view: bool = False,
                        progress: Progress = lambda _: None) -> ParallelReport:
    """Trace ``cfg`` (its batch_size is the micro-batch per GPU) and estimate every strategy."""
    if cfg.precision in ("bf16", "bf16-pure") and not budget.gpu.bf16:
        raise ValueError(f"{budget.gpu.name} has no bf16 support; use --precision fp16")
    names = [parse_strategy(s) for s in strategies]
    progress(f"tracing {spec.name} at micro-batch {cfg.batch_size} ({cfg.precision}"
             f"{', checkpointing' if cfg.checkpointing else ''})")
    trace = trace_for(spec, cfg, budget.gpu)
    sizes = Sizes.of(trace)
    if "dp" in names and num_gpus > 1:
        progress(f"tracing micro-batch {cfg.batch_size * num_gpus} for DataParallel's GPU 0")
        big = trace_for(spec, replace(cfg, batch_size=cfg.batch_size * num_gpus), budget.gpu)
        sizes = Sizes.affine(trace, big) or sizes
    progress("laying out blocks, block inputs and FLOPs")
    layout = model_layout(spec, cfg.precision)
    out, errors = [], []
    for name in names:
        if name == "pipeline2" and num_gpus != 2:
            errors.append((name, "the naive split uses exactly 2 GPUs"))
            continue
        n = 1 if name == "single" else num_gpus
        progress(f"{name}: replaying {n} GPU(s)")
        try:
            out.append(estimate_strategy(trace, layout, Strategy(name, n, bucket_view), budget,
                                         alloc, sizes, grad_accum=cfg.grad_accum))
        except ValueError as e:
            errors.append((name, str(e)))
    return ParallelReport(spec.name, budget.gpu.name, num_gpus, budget.gpu.total_bytes,
                          budget.limit_bytes, cfg.batch_size, cfg.precision, cfg.checkpointing,
                          layout.num_parameters, tuple(out), tuple(errors))


def render_report(r: ParallelReport) -> str:
    """Per-GPU memory of each strategy, one row per GPU role."""
    from tabulate import tabulate

    gib, unit = _unit(max((g.device_peak_bytes for e in r.estimates for g in e.gpus),
                          default=0))
    head = (f"{r.model} ({r.num_parameters:,} parameters), micro-batch {r.micro_batch} per GPU, "
            f"{r.precision}{', checkpointing' if r.checkpointing else ''}, on {r.num_gpus} x "
            f"{r.gpu} ({_gib(r.device_total_bytes)}, {_gib(r.budget_bytes)} for the "
            "allocator)")
    rows = []
    for e in r.estimates:
        for i, g in enumerate(e.gpus):
            b = g.breakdown
            rows.append((f"{e.strategy} x{e.num_gpus}" if i == 0 else "", g.label,
                         "yes" if g.fits else "NO", gib(g.device_peak_bytes),
                         gib(b["parameters"]), gib(b["gradients"]), gib(b["optimizer_state"]),
                         gib(b["activations"]), gib(b["temporaries"]), gib(b["communication"]),
                         g.peak_phase, e.effective_batch if i == 0 else ""))
    table = tabulate(rows, headers=("strategy", "GPU", "fits", "peak", "params", "grads",
                                    "optim", "activ", "temp", "comm", "peak in", "samples/step"),
                     colalign=("left", "left", "left") + ("right",) * 7 + ("left", "right"))
    lines = [head, table, f"({unit} per GPU at its peak; peak = max_memory_reserved + CUDA "
             "context)"]
    for e in r.estimates:
        if e.deepspeed_bytes is not None:
            rest = max(g.resting_state_bytes for g in e.gpus)
            lines.append(f"{e.strategy}: parameters + gradients + optimizer state per GPU "
                         f"{_gib(rest)} after the step (this model's dtypes); DeepSpeed's "
                         f"estimator {_gib(e.deepspeed_bytes)} (it assumes 16-bit weights plus "
                         "fp32 master weights and gradients: 18 B/param sharded)")
        for note in e.notes:
            lines.append(f"{e.strategy}: {note}")
        if e.partition is not None:
            p = e.partition
            lines.append(f"{e.strategy}: GPU 0 runs {_span(p.stages[0])}, GPU 1 runs "
                         f"{_span(p.stages[1])}; {_gib(p.boundary_bytes)} cross per micro-batch")
    for s, m in r.errors:
        lines.append(f"{s}: not estimated - {m}")
    return "\n".join(lines)


def _span(names: tuple[str, ...]) -> str:
    if not names:
        return "nothing"
    if len(names) <= 3:
        return ", ".join(names)
    return f"{names[0]} .. {names[-1]} ({len(names)} blocks)"


@dataclass(frozen=True)
class SplitPlan:
    """The `split` command's result: the partition and both stages' memory."""

    estimate: StrategyEstimate
    partition: Partition
    layout_blocks: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        p = self.partition
        return {"model": self.estimate.model, "gpu": self.estimate.gpu,
                "micro_batch": self.estimate.micro_batch,
                "precision": self.estimate.precision,
                "checkpointing": self.estimate.checkpointing,
                "fits": self.estimate.fits,
                "stages": [{"gpu": k, "modules": list(p.stages[k]),
                            "utilisation": p.utilisation[k],
                            **asdict(self.estimate.gpus[k])} for k in range(2)],
                "main_device": p.main_stage, "device_map": p.device_map,
                "boundary_bytes": p.boundary_bytes, "notes": list(self.estimate.notes)}


def plan_split(spec: ModelSpec, cfg: TraceConfig, budget: Budget,
               alloc: AllocatorConfig = AllocatorConfig(),
               progress: Progress = lambda _: None) -> SplitPlan:
    """Trace ``cfg`` and find the two-GPU split whose larger stage peak is smallest."""
    if cfg.precision in ("bf16", "bf16-pure") and not budget.gpu.bf16:
        raise ValueError(f"{budget.gpu.name} has no bf16 support; use --precision fp16")
    progress(f"tracing {spec.name} at batch {cfg.batch_size}")
    trace = trace_for(spec, cfg, budget.gpu)
    progress("laying out blocks and what crosses between them")
    layout = model_layout(spec, cfg.precision)
    progress(f"trying {max(len(layout.blocks) - 1, 0)} cuts")
    e = estimate_strategy(trace, layout, Strategy("pipeline2", 2), budget, alloc,
                          grad_accum=cfg.grad_accum)
    assert e.partition is not None
    return SplitPlan(e, e.partition, layout.blocks)


def render_split(plan: SplitPlan) -> str:
    from tabulate import tabulate
    e, p = plan.estimate, plan.partition
    gib, unit = _unit(e.peak_device_bytes)
    head = (f"{e.model}: naive 2-GPU split, batch {e.micro_batch}, {e.precision}"
            f"{', checkpointing' if e.checkpointing else ''}, 2 x {e.gpu} "
            f"({_gib(e.device_total_bytes)} each)")
    verdict = ("FITS" if e.fits else "DOES NOT FIT") + \
        f": larger stage peak {_gib(e.peak_device_bytes)} of {_gib(e.device_total_bytes)}"
    rows = []
    for k in range(2):
        g = e.gpus[k]
        b = g.breakdown
        rows.append((f"cuda:{k}", _span(p.stages[k]), "yes" if g.fits else "NO",
                     gib(g.device_peak_bytes), gib(b["parameters"]), gib(b["gradients"]),
                     gib(b["optimizer_state"]), gib(b["activations"]), gib(b["temporaries"]),
                     f"{p.utilisation[k]:.0%}"))
    table = tabulate(rows, headers=("GPU", "modules", "fits", "peak", "params", "grads", "optim",
                                    "activ", "temp", "busy"),
                     colalign=("left", "left", "left") + ("right",) * 7)
    lines = [head, verdict, "", table, f"({unit}; peak = max_memory_reserved + CUDA context)",
             "",
             f"inputs, root-level tensors and the loss on cuda:{p.main_stage} (accelerate's main "
             f"device); {_gib(p.boundary_bytes)} cross between the GPUs per forward",
             *[f"note: {n}" for n in e.notes]]
    return "\n".join(lines)
