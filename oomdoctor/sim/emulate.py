"""What CUDA does differently from a CPU trace, applied to fake CPU tensors.

A CPU-only PyTorch cannot make fake ``cuda`` tensors (see docs/simulator.md), so the trace runs
on fake CPU tensors and this module makes the CPU behave, memory-wise, like CUDA:

- :class:`CudaAutocast` applies CUDA's autocast op policy (``aten/src/ATen/autocast_mode.cpp``,
  the ``KERNEL_CUDA`` registrations) and its weight cast cache. CPU autocast has other lists.
- :class:`CudaKernels` replaces ``scaled_dot_product_attention`` with the fused kernel CUDA would
  pick (flash or memory-efficient: they save ``out`` + ``logsumexp``, never the T x T matrix)
  and ``dropout`` with CUDA's fused ``native_dropout`` (a 1-byte bool mask; the CPU path keeps a
  mask in the input's dtype).
- Optimizers and the GradScaler as CUDA runs them are :mod:`oomdoctor.sim.cudaoptim`.
- :class:`CudaKernels` also runs ``torch.lstm``/``gru``/``rnn_*`` as cuDNN's fused call
  (:mod:`oomdoctor.sim.rnn`).

Checkpointing (which blocks, and wrapping them) is :mod:`oomdoctor.models.checkpointing`; checkpoints
recompute under these modes through :mod:`oomdoctor.sim.recompute`.
"""
from __future__ import annotations

import contextlib
import math
import types
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from oomdoctor.models import adapters, checkpointing
from oomdoctor.sim import recompute, rnn, rocm, versions

# CUDA autocast policy, by the Python-visible name of the function (torch.*, Tensor.*,
# torch.nn.functional.*). Source: the KERNEL_CUDA(..., lower_precision_fp / fp32 /
# fp32_set_opt_dtype / promote) registrations in aten/src/ATen/autocast_mode.cpp; the tests
# check these sets against torch/testing/_internal/autocast_test_lists.py (CUDA lists).
LOWER_PRECISION = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "cudnn_convolution",
    "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "__matmul__",
    "__rmatmul__", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention",
})
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus",
    "layer_norm", "native_layer_norm", "group_norm", "rms_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "interpolate", "upsample", "upsample_nearest", "upsample_bilinear",
})
# Run in fp32 unless the caller passed a dtype: CUDA passes dtype=float32 to the op instead of
# copying the input (the WrapFunction for CastPolicy::fp32_set_opt_dtype).
FP32_SET_OPT_DTYPE = frozenset({"prod", "softmax", "log_softmax", "cumprod", "cumsum",
                                "linalg_vector_norm", "linalg_matrix_norm", "sum", "norm"})
PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot",
                     "grid_sampler", "grid_sample", "index_put", "scatter_add", "tensordot",
                     "cat", "stack", "index_copy"})

# Our modes that are active, outermost first: a checkpointed block re-enters them when it
# recomputes during backward, as torch.utils.checkpoint re-enters real autocast.
_ACTIVE: list[TorchFunctionMode] = []


def _eligible(t: Any) -> bool:
    # autocast casts floating tensors except float64 (is_eligible in autocast_mode.h)
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _OurMode(TorchFunctionMode):
    def __enter__(self):
        if not _ACTIVE:         # checkpoints recompute under these modes (oomdoctor.sim.recompute)
            recompute.install(lambda: list(_ACTIVE), _reenter)
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        # Remove the innermost entry: a mode re-entered by _passthrough is on the list twice,
        # and the outer order must survive for checkpoint recomputation to replay it.
        del _ACTIVE[len(_ACTIVE) - 1 - _ACTIVE[::-1].index(self)]
        if not _ACTIVE:
            recompute.uninstall()
        return super().__exit__(*exc)

    def _passthrough(self, func, args, kwargs):
        """Run ``func`` with this mode still watching the calls inside it.

        A mode is switched off while it handles a call, so a Python composite such as
        ``F.multi_head_attention_forward`` (nn.MultiheadAttention, torchvision's ViT) would hide
        the ``linear`` and ``scaled_dot_product_attention`` calls it makes. For Python functions
        of torch.nn.functional we run a copy whose ``has_torch_function*`` checks say no (so it
        does not hand itself back to us) with the mode re-entered."""
        inner = _transparent(func)
        if inner is None:
            return func(*args, **kwargs)
        with self:
            return inner(*args, **kwargs)


class CudaAutocast(_OurMode):
    """``torch.autocast("cuda", dtype)`` for fake CPU tensors.

    Casts are ordinary autograd-recorded ``.to`` calls made before the op, so autograd saves the
    16-bit copies, as CUDA autocast does. Casts of leaf tensors that require grad (the weights)
    are cached until the outermost autocast region exits (``cached_cast`` in autocast_mode.cpp),
    so a weight used twice is cast once; frozen weights are cast on every use.
    """

    _depth = 0

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.cache: dict[int, torch.Tensor] = {}

    def __enter__(self):
        CudaAutocast._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        CudaAutocast._depth -= 1
        if CudaAutocast._depth == 0:
            self.cache.clear()   # torch.clear_autocast_cache() on leaving the outermost region
        return super().__exit__(*exc)

    def _to_lower(self, t: Any) -> Any:
        if not _eligible(t) or t.dtype == self.dtype:
            return t
        if t.requires_grad and t.is_leaf and not t._is_view() and t.dtype == torch.float32:
            cached = self.cache.get(id(t))
            if cached is None:
                cached = self.cache[id(t)] = t.to(self.dtype)
            return cached
        return t.to(self.dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _Off.depth:                            # inside torch.autocast(..., enabled=False)
            return self._passthrough(func, args, kwargs)
        if name in LOWER_PRECISION:
            args, kwargs = tree_map(self._to_lower, (args, kwargs))
        elif name in FP32:
            args, kwargs = tree_map(_to_fp32, (args, kwargs))
        elif name == "cross_entropy":
            return _cross_entropy(func, args, kwargs)
        elif name in FP32_SET_OPT_DTYPE:
            if kwargs.get("dtype") is None and any(
                    _eligible(a) and a.dtype != torch.float32 for a in args[:1]):
                if name in ("softmax", "log_softmax") and args[0].dtype == torch.float16:
                    out = _half_to_float_softmax(name, args, kwargs)
                    if out is not None:
                        return out
                kwargs = {**kwargs, "dtype": torch.float32}
        elif name in PROMOTE:
            floats = [a for a in _flat(args) if _eligible(a)]
            if len({a.dtype for a in floats}) > 1:
                widest = torch.float32 if any(a.dtype == torch.float32 for a in floats) \
                    else floats[0].dtype
                args, kwargs = tree_map(lambda t: t.to(widest) if _eligible(t) else t,
                                        (args, kwargs))
        else:
            return self._passthrough(func, args, kwargs)
        return func(*args, **kwargs)


class _Off:
    """``torch.autocast(device_type="meta", enabled=False)``: CUDA autocast off in the block."""

    depth = 0

    def __enter__(self):
        _Off.depth += 1

    def __exit__(self, *exc):
        _Off.depth -= 1


@contextlib.contextmanager
def autocast_on_meta() -> Iterator[None]:
    """Let the model open ``torch.autocast(device_type=x.device.type)`` on the meta device, as
    it would for ``"cuda"`` on the GPU.

    transformers 4.x's rotary embeddings compute their angles in fp32 inside
    ``torch.autocast(device_type=x.device.type, enabled=False)`` (modeling_llama.py,
    LlamaRotaryEmbedding.forward, 4.40-4.4x); torch has no autocast state for "meta" and raised
    "unsupported scalarType". Here "meta" stands for "cuda": ``enabled=False`` pauses the
    emulated CUDA autocast, ``enabled=True`` enters it with the given dtype."""
    real = torch.autocast

    def autocast(device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None):
        if device_type != "meta":
            return real(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        return CudaAutocast(dtype or torch.float16) if enabled else _Off()
    torch.autocast = autocast
    try:
        with autocast_queries():
            yield
    finally:
        torch.autocast = real


@contextlib.contextmanager
def autocast_queries() -> Iterator[None]:
    """``torch.is_autocast_enabled()`` / ``get_autocast_dtype`` for CUDA (no argument, "cuda" or
    the fake GPU's "meta") answer with the emulated autocast: peft's 4-bit LoRA casts its
    adapters' input and output only when autocast is off (tuners/lora/bnb.py)."""
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

    def current() -> torch.dtype | None:
        on = [m for m in _ACTIVE if isinstance(m, CudaAutocast)]
        return on[-1].dtype if on and not _Off.depth else None

    def is_autocast_enabled(device_type: str | None = None) -> bool:
        if device_type in (None, "cuda", "meta"):     # no argument: CUDA's (torch's meaning)
            return current() is not None
        return enabled(device_type)

    def get_autocast_dtype(device_type: str) -> torch.dtype:
        if device_type in ("cuda", "meta"):
            return current() or torch.float16          # CUDA autocast's default dtype
        return dtype(device_type)
    torch.is_autocast_enabled, torch.get_autocast_dtype = is_autocast_enabled, get_autocast_dtype
    try:
        yield
    finally:
        torch.is_autocast_enabled, torch.get_autocast_dtype = enabled, dtype


_TRANSPARENT: dict[Any, Any] = {}


def _no_torch_function(*_args: Any, **_kwargs: Any) -> bool:
    return False


def _transparent(func: Any) -> Any:
    if func in _TRANSPARENT:
        return _TRANSPARENT[func]
    inner = None
    # Only functions written in torch/nn/functional.py itself, whose own code makes the
    # has_torch_function* check (wrappers such as boolean_dispatch live elsewhere and would
    # keep handing the call back to us).
    if (isinstance(func, types.FunctionType)
            and func.__globals__ is torch.nn.functional.__dict__
            and any(n.startswith("has_torch_function") for n in func.__code__.co_names)):
        env = dict(func.__globals__, has_torch_function=_no_torch_function,
                   has_torch_function_unary=_no_torch_function,
                   has_torch_function_variadic=_no_torch_function)
        inner = types.FunctionType(func.__code__, env, func.__name__, func.__defaults__,
                                   func.__closure__)
        inner.__kwdefaults__ = func.__kwdefaults__
    _TRANSPARENT[func] = inner
    return inner


def _half_to_float_softmax(name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """fp16 softmax/log_softmax with dtype=float32 as CUDA runs it: SoftMax.cpp reads the half
    input directly (``half_to_float``) when ``input.is_cuda()``; the CPU would first copy the
    input to fp32. (bf16 takes the copy on CUDA too.)"""
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if not isinstance(dim, int):
        return None
    op = torch.ops.aten._softmax if name == "softmax" else torch.ops.aten._log_softmax
    return op(args[0], dim, True)


def _cross_entropy(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``F.cross_entropy`` under CUDA autocast. ``cross_entropy_loss`` has no autocast rule; its
    composite (LossNLL.cpp) calls ``log_softmax(self, 1, self.scalar_type())`` - an explicit
    dtype, so the log-probabilities stay 16-bit - and ``nll_loss`` (fp32 policy) casts them to
    fp32: 2 + 4 bytes per logit are saved for backward. Label smoothing and probability
    targets are left to the op (with the logits cast to fp32)."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
             "label_smoothing")
    b = {"weight": None, "ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0,
         **dict(zip(names, args)), **kwargs}
    x, target = b["input"], b["target"]
    if (not _eligible(x) or x.dtype == torch.float32 or b["label_smoothing"]
            or target.is_floating_point() or b.get("size_average") is not None
            or b.get("reduce") is not None):
        args, kwargs = tree_map(_to_fp32, (args, kwargs))
        return func(*args, **kwargs)
    logp = torch.log_softmax(x, 1 if x.dim() > 1 else 0, dtype=x.dtype)
    weight = b["weight"].float() if isinstance(b["weight"], torch.Tensor) else None
    return torch.nn.functional.nll_loss(logp.float(), target, weight,
                                        ignore_index=b["ignore_index"], reduction=b["reduction"])


def _to_fp16(t: Any) -> Any:
    return t.to(torch.float16) if _eligible(t) and t.dtype != torch.float16 else t


def _to_fp32(t: Any) -> Any:
    return t.to(torch.float32) if _eligible(t) and t.dtype != torch.float32 else t


def _flat(args: Any) -> list:
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def sdpa_kernel(q: torch.Tensor, attn_mask: Any, dropout_p: float,
                compute_capability: tuple[int, int], arch: str = "",
                k: torch.Tensor | None = None) -> str:
    """The kernel CUDA's ``select_sdp_backend`` (sdp_utils.cpp) would pick: flash, efficient
    or math. Flash needs sm80+, fp16/bf16, no explicit mask, head dim <= 256; memory-efficient
    works from sm50 in fp32/fp16 (bf16 from sm80) with masks; head dims not a multiple of 8 are
    padded by SDPA since 2.1, so they do not force the math path. An AMD ``arch`` (gfx90a)
    asks ROCm's AOTriton rules instead (:func:`oomdoctor.sim.rocm.sdpa_kernel`)."""
    head_dim = q.shape[-1]
    if arch:
        mask_dtype = (str(attn_mask.dtype).removeprefix("torch.")
                      if isinstance(attn_mask, torch.Tensor) else None)
        same_heads = k is None or k.shape[-3:-2] == q.shape[-3:-2]
        return rocm.sdpa_kernel(arch, str(q.dtype).removeprefix("torch."),
                                attn_mask is not None, mask_dtype, head_dim, same_heads)
    sm = compute_capability
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89: no flash backward for
    # head dims above 192 on consumer Ampere/Ada.
    big_head_on_consumer = sm in ((8, 6), (8, 9)) and head_dim > 192 and q.requires_grad
    if (sm >= (8, 0) and q.dtype in (torch.float16, torch.bfloat16) and attn_mask is None
            and head_dim <= 256 and not big_head_on_consumer):
        return "flash"
    if sm >= (5, 0) and (q.dtype != torch.bfloat16 or sm >= (8, 0)) and head_dim <= 512:
        return "efficient"
    return "math"


def _attention_outputs(q: torch.Tensor, v: torch.Tensor, lse_t: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """What CUDA's fused attention kernels allocate in the forward: ``out`` ((B, T, H, D) for
    4-d inputs, which the caller transposes: attention.cu) and the fp32 ``logsumexp``."""
    if q.dim() == 4:
        out = q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]))
    else:
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
    return out, q.new_empty(q.shape[:-2] + (lse_t,), dtype=torch.float32)


def _register_attention_op():
    """:func:`_attention_outputs` as one op, ``oomdoctor::fused_attention``: a selective
    checkpointing policy sees it where a GPU runs ``_scaled_dot_product_flash_attention`` (or
    the memory-efficient kernel), and torchtitan's keeps it as it keeps those (it is
    registered with oomdoctor.models.checkpointing as their stand-in). Before torch 2.4 (no
    ``torch.library.custom_op``) the plain function."""
    if not hasattr(torch.library, "custom_op"):
        return _attention_outputs
    op = torch.library.custom_op("oomdoctor::fused_attention", mutates_args=())(
        _attention_outputs)
    op.register_fake(_attention_outputs)
    checkpointing.STAND_INS.add(torch.ops.oomdoctor.fused_attention.default)
    return op


_FUSED_ATTENTION = _register_attention_op()


class _FusedAttention(torch.autograd.Function):
    """Memory-faithful stand-in for CUDA's fused attention on fake tensors.

    Forward allocates ``out`` and the fp32 ``logsumexp`` and saves q, k, v, out, lse (what
    ``_scaled_dot_product_flash_attention`` / ``_efficient_attention_forward`` save; flash's lse
    is (B, H, T), memory-efficient pads T to a multiple of 32). Backward allocates dq, dk, dv and
    the fp32 scratch the kernels use: flash-attention-2 keeps a dq accumulator (B, H, T128, D)
    and softmax_d (B, H, T128) with T rounded up to 128; memory-efficient keeps delta (B, H, T).
    On ROCm (``rocm``) both are AOTriton kernels: lse (B, H, T) unpadded, and backward scratch
    softmax_d and delta, two (B, H, T) fp32 vectors, with no dq accumulator (mha_bwd_aot).
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, kernel, rocm_kernels=False):
        t = q.shape[-2]
        lse_t = t if kernel == "flash" or rocm_kernels else math.ceil(t / 32) * 32
        out, lse = _FUSED_ATTENTION(q, v, lse_t)
        if q.dim() == 4:   # (B, H, T, D): the model's `y.transpose(1, 2).contiguous()` is free
            out = out.transpose(1, 2)
        ctx.kernel = kernel
        ctx.rocm_kernels = rocm_kernels
        ctx.save_for_backward(q, k, v, out, lse, mask if isinstance(mask, torch.Tensor) else None)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        t = q.shape[-2]
        if ctx.rocm_kernels:
            scratch = [q.new_empty(q.shape[:-2] + (t,), dtype=torch.float32) for _ in range(2)]
        elif ctx.kernel == "flash":
            t128 = math.ceil(t / 128) * 128
            scratch = [q.new_empty(q.shape[:-2] + (t128, q.shape[-1]), dtype=torch.float32),
                       q.new_empty(q.shape[:-2] + (t128,), dtype=torch.float32)]
        else:
            scratch = [q.new_empty(q.shape[:-2] + (t,), dtype=torch.float32)]
        if ctx.kernel == "flash" and k.shape[-3:-2] != q.shape[-3:-2]:
            # grouped-query: the kernel writes dK and dV for every query head, (B, Tk, H, D)
            # each, and sums them over the group into dk and dv (flash_api.cpp, mha_bwd:
            # dk_expanded / dv_expanded)
            b, h, _, d = q.shape
            scratch += [q.new_empty((b, k.shape[-2], h, d)) for _ in range(2)]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del scratch
        return dq, dk, dv, None, None, None


def _is_int8_op(func: Any, name: str) -> bool:
    """Whether ``func`` is one of bitsandbytes' LLM.int8 ops."""
    return name.removesuffix(".default") in adapters.INT8_OPS and "bitsandbytes" in (
        getattr(func, "namespace", None), getattr(func, "_qualified_op_name", "")[:12])


class Int8Kernels(_OurMode):
    """bitsandbytes' LLM.int8 ops as its CUDA backend allocates them, and nothing else: their
    meta kernels ask for a data-dependent outlier count that a meta tensor cannot give, so a
    pass that runs the model without :class:`CudaKernels` (the multi-GPU layout) needs them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _is_int8_op(func, name):
            return adapters.int8_as_cuda(name, args, kwargs)
        return func(*args, **kwargs)


class CudaKernels(_OurMode):
    """Pick CUDA's kernels where their memory differs from the CPU's: fused SDPA, fused dropout."""

    def __init__(self, compute_capability: tuple[int, int], notes: list[str] | None = None,
                 arch: str = "", torch_version: "versions.TorchVersion | None" = None):
        super().__init__()
        self.cc = compute_capability
        self.arch = arch            # an AMD target: ROCm's kernels (oomdoctor.sim.rocm)
        # the release's attention (oomdoctor.sim.versions; None: the installed torch's)
        self.fused_sdpa = versions.has(torch_version, versions.FUSED_SDPA)
        self.native_gqa = versions.has(torch_version, versions.GQA_SDPA)
        self.notes = notes if notes is not None else []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "scaled_dot_product_attention":
            return self._sdpa(func, args, kwargs)
        if name == "dropout":
            return self._dropout(func, args, kwargs)
        if name == "gemm_4bit.default":              # bitsandbytes' 4-bit matmul
            return adapters.gemm_4bit_as_cuda(func, args, kwargs)
        if _is_int8_op(func, name):
            return adapters.int8_as_cuda(name, args, kwargs)
        if name in rnn.FUNCTIONS:        # nn.LSTM/GRU/RNN: cuDNN's one fused call
            # Under CUDA autocast, _cudnn_rnn runs in fp16 whatever the autocast dtype, with a
            # fresh fp16 flat copy of the weights each call (aten/src/ATen/cudnn/
            # AutocastRNN.cpp, _cudnn_rnn_cast_reflatten: kHalf is hard-coded).
            amp = any(isinstance(m, CudaAutocast) for m in _ACTIVE)
            return rnn.run(func, name, args, kwargs, self.notes, _to_fp16 if amp else None)
        if name in ("_pack_padded_sequence", "cpu"):
            return rnn.with_real_lengths(func, name, args, kwargs)
        return self._passthrough(func, args, kwargs)

    def _sdpa(self, func, args, kwargs):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                 "enable_gqa")
        bound = dict(zip(names, args), **kwargs)
        q, k, v = bound["query"], bound["key"], bound["value"]
        mask = bound.get("attn_mask")
        # Grouped-query attention (fewer key/value heads, enable_gqa=True): CUDA's flash kernel
        # takes it as it is (check_batch_size_and_num_heads_dense<true /*supports GQA*/> in
        # sdp_utils.cpp, torch 2.5+); the memory-efficient one does not, so CUDA falls back to
        # the math path, which expands k and v - what the op does on the meta device too.
        grouped = k.shape[-3:-2] != q.shape[-3:-2]
        if grouped and not self.native_gqa and bound.get("enable_gqa"):
            # before 2.5 the model repeats k and v itself (transformers' repeat_kv: a copy per
            # query head, each kept for backward), then attends as multi-head
            groups = q.shape[-3] // k.shape[-3]
            k, v = (x.repeat_interleave(groups, dim=-3) for x in (k, v))
            args, kwargs = (q, k, v), {n: x for n, x in bound.items()
                                       if n not in ("query", "key", "value", "enable_gqa")}
            grouped = False
        kernel = (sdpa_kernel(q, mask, bound.get("dropout_p", 0.0), self.cc, self.arch, k)
                  if self.fused_sdpa else "math")
        dtype = str(q.dtype).removeprefix("torch.")
        if self.arch:
            self.notes.append(f"scaled_dot_product_attention: ROCm would use the {kernel} kernel "
                              f"({self.arch}, AOTriton, {dtype})")
        else:
            self.notes.append(f"scaled_dot_product_attention: CUDA would use the {kernel} kernel "
                              f"(sm{self.cc[0]}{self.cc[1]}, {dtype})")
        if kernel == "math" or (grouped and (kernel != "flash" or self.arch)):
            return func(*args, **kwargs)
        return _FusedAttention.apply(q, k, v, mask, kernel, bool(self.arch))

    def _dropout(self, func, args, kwargs):
        names = ("input", "p", "training", "inplace")
        bound = {"p": 0.5, "training": True, "inplace": False, **dict(zip(names, args)),
                 **kwargs}
        x, p = bound["input"], bound["p"]
        if not bound["training"] or bound["inplace"] or not 0 < p < 1 or x.numel() == 0:
            return func(*args, **kwargs)
        # CUDA's dropout takes the fused path (is_fused_kernel_acceptable in Dropout.cpp):
        # native_dropout saves a bool mask; the CPU path saves a float mask.
        out, _mask = torch.native_dropout(x, p, True)
        return out


@contextlib.contextmanager
def _reenter(modes: list[TorchFunctionMode]):
    """Enter again those of ``modes`` that are not on the function-mode stack now: backward
    runs with an empty stack, even when it was called inside the modes (a training script runs
    inside CudaKernels, oomdoctor.sim.script), while a recompute nested in another keeps
    them."""
    from torch.overrides import _get_current_function_mode_stack
    current = _get_current_function_mode_stack()
    with contextlib.ExitStack() as stack:
        for m in modes:
            if not any(a is m for a in current):
                stack.enter_context(m)
        yield
