"""The dispatch mode that records each storage a step allocates and frees: what, when, where."""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from oomdoctor.sim import convolution, normalization, reductions, values
from oomdoctor.sim.flops import op_flops
from oomdoctor.sim.fusion import Fusion


class Category(str, Enum):
    """What a storage holds. Model state first, then what the step creates."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    INPUTS = "inputs"
    ACTIVATIONS = "activations"      # made in the forward and still alive when it ends
    TEMPORARIES = "temporaries"      # everything else: freed within its phase


class Phase(str, Enum):
    SETUP = "setup"          # model.to(device): parameters and buffers
    DATA = "data"            # make_batch and its move/cast to the device
    FORWARD = "forward"      # forward + loss (under autocast for AMP)
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"  # (unscale +) optimizer.step()
    ZERO_GRAD = "zero_grad"


@dataclass
class Storage:
    """One storage's life: what, when, where."""

    handle: int
    nbytes: int
    category: Category
    phase: Phase
    iteration: int
    module: str
    op: str
    t_alloc: int                 # index of its alloc event
    t_free: int | None = None    # index of its free event; None = alive at the end
    host: bool = False           # lives on the host on CUDA (Adam's `step` counters)
    # What the model calls it, where known: a parameter's qualified name, "NAME.grad",
    # "AdamW.step: exp_avg of NAME" (for memory snapshots' frames, oomdoctor.plans.snapshot).
    name: str = ""
    # A sum/mean's geometry: CUDA's kernel stages partial sums in scratch memory from the
    # caching allocator, sized per card at replay (oomdoctor.sim.reductions)
    reduce: Any = None
    blas_lt: bool = False        # a GEMM through cuBLASLt (see cublaslt_call)
    # A convolution pass's geometry: cuDNN's workspace follows this output (sim.convolution)
    conv: Any = None
    upcast: int = 0              # a batch norm input's elements: a CUDA fp32 copy (normalization)
    view_saved: bool = False     # ZeRO-3's F.linear saved a view of it for backward (sim.zero3)


@dataclass(frozen=True)
class PhaseMark:
    start: int                   # first event index of the phase
    phase: Phase
    iteration: int               # optimizer step (0-based)
    micro: int                   # micro-batch within the step


# Ops whose CUDA kernel allocates its outputs in another order than it returns them: the output
# indices in allocation order. The order decides which cached block each one takes.
# native_dropout: dropout_cuda makes the bool mask before the output (aten/src/ATen/native/cuda/
# Dropout.cu: `Tensor mask = at::empty_like(self, ...)`, then `Tensor ret = at::empty_like(self)`);
# the meta kernel returns (output, mask). Measured (issue 34, benchmarks/results/newpaths/traces/
# gpt2_small-bf16-pure-ck1-b441): the mask takes the front of the block the embedding freed.
CUDA_ALLOCATION_ORDER: dict[str, tuple[int, ...]] = {"native_dropout.default": (1, 0)}


class Recorder(TorchDispatchMode):
    """Sees every ATen op; records fresh output storages and, via weakrefs, their frees."""

    def __init__(self) -> None:
        super().__init__()
        self.raw: list[tuple[bool, int, int]] = []
        self.storages: dict[int, Storage] = {}
        self.live: dict[int, int] = {}          # storage key -> handle
        self.external: set[int] = set()         # storages made before tracing, not ours
        self.phase = Phase.SETUP
        self.iteration = 0
        self.module_stack: list[str] = []
        self.closed = False
        self._next = 0
        self._fresh: dict[Any, tuple[bool, ...]] = {}
        self.shadows: values.Shadows | None = None   # real values of the batch, see values.py
        self.placeholders = 0                  # scalar reads in step() answered with 1
        self.progress: Callable[[str], None] | None = None   # told each phase (trace_training)
        self.steps = 0
        self.fusion = Fusion()                 # compiled step functions (oomdoctor.sim.fusion)
        # A training script's run (oomdoctor.sim.script): only the fake GPU's (meta) storages
        # are device memory; its data pipeline computes on real CPU tensors.
        self.device_only = False
        # FLOPs of the forward and backward ops, when asked for (a script's run: its step time)
        self.count_flops = False
        self.flops = 0
        self.module_flops: dict[str, int] = {}  # forward FLOPs by the innermost module's label

    def fused(self):
        return self.fusion.region(lambda: len(self.raw))

    # -- bookkeeping -------------------------------------------------------------------------
    def add(self, storage: torch.UntypedStorage, category: Category | None, op: str) -> int:
        key = storage._cdata
        handle = self._next
        self._next += 1
        nbytes = storage.nbytes()
        if category is None:
            category = Category.INPUTS if self.phase is Phase.DATA else Category.TEMPORARIES
        self.storages[handle] = Storage(
            handle, nbytes, category, self.phase, self.iteration,
            self.module_stack[-1] if self.module_stack else "", op, len(self.raw))
        self.raw.append((True, handle, nbytes))
        self.live[key] = handle
        weakref.finalize(storage, self._on_free, key, handle)
        return handle

    def _on_free(self, key: int, handle: int) -> None:
        if self.closed or self.live.get(key) != handle:
            return
        del self.live[key]
        s = self.storages[handle]
        s.t_free = len(self.raw)
        self.raw.append((False, handle, s.nbytes))

    def handle_of(self, t: torch.Tensor) -> int | None:
        return self.live.get(t.untyped_storage()._cdata)

    def relabel(self, t: torch.Tensor, category: Category, host: bool = False,
                name: str = "") -> None:
        h = self.handle_of(t)
        if h is not None:
            self.storages[h].category = category
            self.storages[h].host = host
            if name:
                self.storages[h].name = name

    def _fresh_outputs(self, func: Any) -> tuple[bool, ...]:
        # An output with no alias annotation in the schema (`Tensor` rather than `Tensor(a)`)
        # is a new allocation; views, in-place and out= ops return existing storages.
        fresh = self._fresh.get(func)
        if fresh is None:
            try:
                fresh = tuple(r.alias_info is None for r in func._schema.returns)
            except AttributeError:
                fresh = ()
            self._fresh[func] = fresh
        return fresh

    # -- the mode ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            out = func(*args, **(kwargs or {}))
        except Exception:
            if self.phase is Phase.OPTIMIZER and func in values.SCALAR_READS:
                # Inside optimizer.step() a scalar read sizes the update, not memory:
                # Adafactor's relative step and update clipping read p.norm().item() and
                # update.norm().item() (torch/optim/_adafactor.py) and only multiply by them.
                self.placeholders += 1
                return values.placeholder(args[0])
            # A question the fake/meta tensor cannot answer: the real batch's answer, if the
            # tensor was computed from the batch alone (see oomdoctor.sim.values).
            if self.shadows is None:
                raise
            answered, value = self.shadows.answer(func, args, kwargs or {})
            if not answered:
                raise
            return value
        if self.shadows is not None:
            self.shadows.mirror(func, args, kwargs or {}, out)
        if self.count_flops and self.phase in (Phase.FORWARD, Phase.BACKWARD):
            flops = op_flops(func, args, kwargs or {}, out)
            self.flops += flops
            if self.phase is Phase.FORWARD and flops:   # where the forward spends them
                where = self.module_stack[-1] if self.module_stack else ""
                self.module_flops[where] = self.module_flops.get(where, 0) + flops
        if self.fusion.depth:
            self.fusion.note(func, args, kwargs or {}, len(self.raw), self.handle_of)
        fresh = self._fresh_outputs(func)
        shape = reductions.reduce_shape(func.__name__, args, kwargs or {})
        convs = convolution.conv_calls(func.__name__, args, kwargs or {})
        upcast = normalization.upcast_elements(func.__name__, args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        order = CUDA_ALLOCATION_ORDER.get(func.__name__)
        if order is None or len(order) != len(outs):
            order = range(len(outs))
        for i in order:
            o = outs[i]
            is_fresh = fresh[i] if i < len(fresh) else True
            for t in tree_leaves(o) if isinstance(o, (tuple, list)) else (o,):
                if not isinstance(t, torch.Tensor) or t.is_sparse or (
                        self.device_only and t.device.type != "meta"):
                    continue
                st = t.untyped_storage()
                key = st._cdata
                if key in self.live:
                    # resize_ and friends can grow a storage in place: a new allocation.
                    h = self.live[key]
                    if st.nbytes() > self.storages[h].nbytes:
                        self._on_free(key, h)
                        self.add(st, None, func.__name__)
                    continue
                if is_fresh:
                    h = self.add(st, None, func.__name__)
                    self.storages[h].reduce = shape
                    self.storages[h].conv = convs.get(i)
                    self.storages[h].upcast = upcast if i == 0 else 0
                    self.storages[h].blas_lt = cublaslt_call(func.__name__, args, kwargs or {})
                else:
                    # A view of a storage made before tracing began (not ours to count).
                    self.external.add(key)
        return out


def cublaslt_call(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether CUDA runs this op through cuBLASLt (at::cuda::blas::gemm_and_bias): addmm with a
    contiguous bias vector as wide as the output, beta 1, a floating dtype and both of mat2's
    sizes over 1 (addmm_out_cuda_impl's useLtInterface in aten/src/ATen/native/cuda/Blas.cpp,
    CUDA >= 12.1), and _addmm_activation, which exists for that path."""
    if name == "_addmm_activation.default":
        return True
    if name != "addmm.default" or len(args) < 3 or kwargs.get("beta", 1) != 1:
        return False
    bias, mat2 = args[0], args[2]
    return (isinstance(bias, torch.Tensor) and isinstance(mat2, torch.Tensor)
            and bias.dim() == 1 and mat2.dim() == 2 and bias.is_contiguous()
            and bias.shape[0] == mat2.shape[1] and min(mat2.shape) > 1
            and bias.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16))


def module_hooks(model: torch.nn.Module, rec: Recorder) -> list:
    handles = []
    for name, mod in model.named_modules():
        def pre(_m, _a, name=name):
            rec.module_stack.append(name or type(model).__name__)

        def post(_m, _a, _o):
            if rec.module_stack:
                rec.module_stack.pop()
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    return handles


@contextlib.contextmanager
def in_phase(rec: Recorder, marks: list[PhaseMark], phase: Phase, it: int, micro: int
             ) -> Iterator[None]:
    if rec.progress is not None:
        rec.progress(f"step {it + 1}/{rec.steps}: {phase.value}"
                     + (f" (micro-batch {micro + 1})" if micro else ""))
    rec.phase = phase
    rec.iteration = it
    marks.append(PhaseMark(len(rec.raw), phase, it, micro))
    yield
