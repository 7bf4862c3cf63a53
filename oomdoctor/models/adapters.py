"""LoRA and QLoRA: the model as parameter-efficient fine-tuning trains it, with the real libraries.

    oomdoctor estimate meta-llama/Llama-3.1-8B --lora 16 --quantize nf4 -b 1 --seq-len 4096

``--lora RANK`` wraps the model with ``peft.get_peft_model`` (peft's default target modules for
a Hugging Face architecture, every ``nn.Linear`` of a model file, or ``--lora-targets``);
``--quantize nf4|fp4`` first swaps the linear layers for bitsandbytes ``Linear4bit`` and
quantizes their weights on the meta device - the library's own code lays out the packed 4-bit
weight and its block-wise absmax (and, with ``--double-quant``, the 8-bit absmax and its fp32
second-level statistics), so the sizes are the library's, not a formula's. ``--quantize int8``
swaps them for ``Linear8bitLt`` as ``load_in_8bit=True`` does (LLM.int8, arXiv:2208.07339: int8
weights with one fp32 scale per output row, outlier threshold 6.0).

What the recipes do, and what this module follows:

- Frozen base weights need no fp32 master copy, so LoRA recipes load them 16-bit
  (``torch_dtype=torch.bfloat16``) and train with autocast: under fp16/bf16 AMP the base model
  is cast to that dtype before the adapters are added. peft then keeps the adapters in fp32
  (``autocast_adapter_dtype=True``, its default).
- QLoRA (arXiv:2305.14314; peft's quantization guide) loads 4-bit base weights and calls
  ``peft.prepare_model_for_kbit_training``, which freezes everything and casts the remaining
  16-bit parameters (embeddings, norms, the output layer) to fp32; the 4-bit matmuls compute in
  the AMP dtype (``bnb_4bit_compute_dtype``). With ``bf16-pure`` nothing is upcast (the
  unsloth-style setup): everything that is not 4-bit stays bf16 (``fp16-pure``: fp16).
- Which linear layers stay unquantized follows transformers' rule (``get_keys_to_not_convert``):
  the output embeddings, weights tied to another parameter, and the module holding the model's
  last parameter.

On the GPU a 4-bit matmul over many tokens dequantizes the whole weight to the compute dtype
and runs a dense matmul (bitsandbytes ``backends/cuda/ops.py``, ``_dequant_linear_fallback``):
those temporaries are what :func:`gemm_4bit_as_cuda` puts back into a meta trace, where the
library's fake kernel would only return the output. An int8 matmul quantizes its input row-wise,
multiplies into int32 and dequantizes to fp16 (:func:`int8_as_cuda`); its backward dequantizes
the whole weight to the input's dtype.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass

import torch

from oomdoctor.configs import QUANTIZATIONS, WRAPPER_CASTS, install_hint
from oomdoctor.models.casting import pure_dtype, to_dtype
from oomdoctor.models.spec import ModelFileError, first_line, not_installed, root_cause

_BLOCKSIZE_4BIT = 64          # bitsandbytes Linear4bit / Params4bit default blocksize
_INT8_THRESHOLD = 6.0         # transformers BitsAndBytesConfig(llm_int8_threshold=6.0)


class AdapterError(ModelFileError):
    """LoRA/QLoRA cannot be applied as asked (a missing library, no matching module)."""


@dataclass(frozen=True)
class Adapters:
    """How the base model is adapted for training: LoRA on top, 4-bit weights underneath."""

    lora_rank: int
    lora_targets: tuple[str, ...] | None = None    # module names (suffixes); None: defaults
    lora_dropout: float = 0.0                      # peft's default
    quantize: str | None = None                    # nf4 | fp4 | int8
    double_quant: bool = False                     # transformers' BitsAndBytesConfig default

    def __post_init__(self) -> None:
        if self.lora_rank < 1:
            raise ValueError(f"--lora must be a rank >= 1, got {self.lora_rank}")
        if self.quantize is not None and self.quantize not in QUANTIZATIONS:
            raise ValueError(f"unknown --quantize {self.quantize!r}; choose one of "
                             f"{', '.join(QUANTIZATIONS)}")
        if self.double_quant and self.quantize == "int8":
            raise ValueError("--double-quant applies to 4-bit weights (nf4, fp4), not int8")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")

    @property
    def label(self) -> str:
        """' + QLoRA r16 (nf4)': what the model's name gets, so outputs say what was estimated."""
        if not self.quantize:
            return f" + LoRA r{self.lora_rank}"
        if self.quantize == "int8":
            return f" + LoRA r{self.lora_rank} (int8 base)"
        return f" + QLoRA r{self.lora_rank} ({self.quantize}{'+dq' if self.double_quant else ''})"


def adapt(model: torch.nn.Module, adapters: Adapters, precision: str
          ) -> tuple[torch.nn.Module, list[str]]:
    """The model as ``adapters`` trains it, and notes saying what was done.

    ``model`` comes cast for ``precision`` (a pure precision: already 16-bit) and in train mode."""
    notes: list[str] = []
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    pure = pure_dtype(precision)
    compute = pure or amp or torch.float32
    if adapters.quantize:
        from torch._subclasses.fake_tensor import is_fake
        if any(is_fake(p) for p in model.parameters()):
            # bitsandbytes' Params4bit cannot wrap a FakeTensor (Tensor._make_subclass refuses).
            raise AdapterError("quantized weights trace on the meta device only (the CUDA "
                               "emulation), not on fake CPU tensors")
        n, skipped = _quantize_linears(model, adapters, compute)
        int8 = adapters.quantize == "int8"
        if not int8:
            register_4bit_flops()
        if int8:
            # MatMul8bitLt logs a warning at every call whose input is not fp16 (all of them
            # under bf16 or fp32): the same line hundreds of times per trace, and about speed.
            logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
        how = (f"(LLM.int8: a scale per row, outlier threshold {_INT8_THRESHOLD}; outlier "
               "columns assumed few, their fp16 copies not counted; its matmul keeps its input "
               "on ctx, outside autograd's saved tensors, so under a non-reentrant checkpoint - "
               "oomdoctor's, TRL's default - every layer's stays until the backward ends)"
               if int8 else
               f"{'with double quantization ' if adapters.double_quant else ''}(blocks of "
               f"{_BLOCKSIZE_4BIT}), computing in {str(compute).removeprefix('torch.')}")
        notes.append(f"{n} linear layers stored as bitsandbytes {adapters.quantize} {how}"
                     + (f"; kept unquantized: {', '.join(skipped)}" if skipped else ""))
        if pure is None:
            peft = _import("peft", "QLoRA")
            # QLoRA's recipe: freeze, and upcast what is not quantized to fp32.
            setattr(model, "is_loaded_in_8bit" if int8 else "is_loaded_in_4bit", True)
            with warnings.catch_warnings():        # deprecation chatter between the libraries
                warnings.simplefilter("ignore", FutureWarning)
                peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    elif amp is not None:
        # Frozen weights loaded 16-bit, as LoRA recipes do; the adapters stay fp32 (below).
        to_dtype(model, amp)
    peft = _import("peft", "LoRA")
    targets = _targets(model, adapters)
    config = peft.LoraConfig(r=adapters.lora_rank, lora_alpha=adapters.lora_rank,
                             lora_dropout=adapters.lora_dropout, target_modules=targets)
    try:
        with _identity_moves_skipped(model), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = peft.get_peft_model(model, config)
    except ValueError as e:
        raise AdapterError(f"peft could not apply LoRA: {str(e).splitlines()[0].rstrip('.')}; name the "
                           "layers with --lora-targets q_proj,v_proj (module name suffixes)"
                           ) from e
    if precision in WRAPPER_CASTS:
        to_dtype(model, pure)   # FSDP's param_dtype / DeepSpeed's engine: adapters too
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(logical_numel(p) for p in model.parameters())
    notes.append(f"LoRA r={adapters.lora_rank} on {', '.join(targets)}: {n_train:,} trainable "
                 f"parameters ({100 * n_train / max(n_all, 1):.2f}% of {n_all:,})")
    return model, notes


def quant_states(model: torch.nn.Module) -> list[torch.Tensor]:
    """Tensors a quantized model holds outside its parameters and buffers (bitsandbytes'
    ``QuantState``: absmax, codebook, double-quantization statistics). They live on the GPU as
    long as the weights do."""
    return [t for _, t in named_quant_states(model)]


def named_quant_states(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """:func:`quant_states` in the same order, each named after its weight
    (``layers.0.q_proj.weight.absmax``), so the multi-GPU layout can place them with it."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        scb = getattr(p, "SCB", None)      # Int8Params: one fp32 scale per output row
        if isinstance(scb, torch.Tensor):
            out.append((f"{name}.SCB", scb))
        state = getattr(p, "quant_state", None)
        while state is not None:
            out += [(f"{name}.{attr}", t) for attr in ("absmax", "code", "offset")
                    if isinstance(t := getattr(state, attr, None), torch.Tensor)]
            state = getattr(state, "state2", None) if getattr(state, "nested", False) else None
            name += ".state2"
    return out


def gemm_4bit_as_cuda(func, args, kwargs):
    """``bitsandbytes::gemm_4bit`` as the CUDA build runs it in training.

    Past 512 rows (tokens) the CUDA dispatch takes its unfused fallback: rebuild the fp32
    absmax (when double-quantized), dequantize the whole weight to the compute dtype, then a
    dense ``F.linear`` (bitsandbytes ``backends/cuda/ops.py``: ``_gemm_4bit_use_custom_cuda``,
    "custom wins up to M=512", and ``_dequant_linear_fallback``). The meta kernel returns only
    the output; these are the same allocations, made with plain tensors. Below that the custom
    kernel reads the 4-bit weight directly and allocates only the output (fp32 inputs take the
    fallback from 8 rows; small weights on an A100 keep the custom kernel to 1536 rows, and
    their temporaries are small)."""
    names = ("A", "B", "shapeB", "absmax", "blocksize", "quant_type", "bias", "absmax_8bit",
             "absmax_code", "absmax_offset")
    bound = dict(zip(names, args), **kwargs)
    a = bound["A"]
    rows = a.numel() // a.shape[-1]
    # fp32 has no tensor-core kernel: the custom one only wins below 8 rows.
    if rows < 8 or (rows <= 512 and a.dtype != torch.float32):
        return func(*args, **kwargs)
    absmax_8bit = bound.get("absmax_8bit")
    scales = []         # live, like the fallback's locals, until the matmul is done
    if absmax_8bit is not None:
        rebuilt = torch.empty(absmax_8bit.shape, dtype=torch.float32, device=a.device)
        scales = [rebuilt, rebuilt + bound["absmax_offset"]]
    weight = torch.empty(tuple(bound["shapeB"]), dtype=a.dtype, device=a.device)
    out = torch.nn.functional.linear(a, weight, bound.get("bias"))
    del scales, weight
    return out


INT8_OPS = ("int8_vectorwise_quant", "int8_mixed_scaled_mm", "int8_scaled_mm")


def int8_as_cuda(name: str, args: tuple, kwargs: dict):
    """bitsandbytes' LLM.int8 ops as its CUDA backend allocates (``backends/cuda/ops.py`` and
    the composite ``backends/default/ops.py``), for a meta trace.

    - ``int8_vectorwise_quant(A, threshold)``: the row stats (fp32) and the int8 copy of A; with
      a threshold, ``A.abs() >= threshold`` (an fp16 then a bool temporary of A's size) finds
      the outlier columns. Which columns hold outliers depends on the values; LLM.int8 found
      them in a handful of feature dimensions (arXiv:2208.07339, section 4), so the trace takes
      none: their fp16 slice, saved for backward, is tokens x a few columns.
    - ``int8_mixed_scaled_mm`` with no outlier columns is ``int8_scaled_mm``: an int32 product,
      dequantized to fp16 (the kernel only writes fp16), then cast to the input's dtype.
    The library's fake kernels would return the outputs alone, with data-dependent sizes."""
    name = name.removesuffix(".default")
    if name == "int8_vectorwise_quant":
        a = args[0]
        threshold = args[1] if len(args) > 1 else kwargs.get("threshold", 0.0)
        row_stats = a.new_empty(a.numel() // a.shape[-1], dtype=torch.float32)
        out_row = torch.empty_like(a, dtype=torch.int8)
        cols = None
        if threshold > 0.0:
            outliers = a.abs() >= threshold       # noqa: F841  (alive until the return)
            cols = a.new_empty(0, dtype=torch.int64)
        return out_row, row_stats, cols
    names = ("A", "CA", "CB", "SCA", "SCB", "outlier_cols", "bias") \
        if name == "int8_mixed_scaled_mm" else ("CA", "CB", "SCA", "SCB", "bias", "dtype")
    b = dict(zip(names, args), **kwargs)
    ca, cb, bias = b["CA"], b["CB"], b.get("bias")
    dtype = b["A"].dtype if "A" in b else (b.get("dtype") or torch.float16)
    product = ca.new_empty((*ca.shape[:-1], cb.shape[0]), dtype=torch.int32)
    out = torch.empty_like(product, dtype=torch.float16)
    del product
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    out = out.to(dtype)
    if name == "int8_mixed_scaled_mm":
        return out, b["A"].new_empty(0)
    return out


# --- internals ---------------------------------------------------------------------------------

def _import(name: str, what: str):
    try:
        return __import__(name)
    except ImportError as e:
        raise AdapterError(missing_library(name, what, e)) from e


def missing_library(name: str, what: str, error: BaseException) -> str:
    """Why `name` did not import: not installed (install the extra), or installed but broken by
    something it imports - e.g. peft -> transformers -> a torchvision built for another torch,
    which no extra fixes."""
    if not_installed(name, error):
        return f"{what} needs the {name} package, which is not installed; " \
               + install_hint("peft")
    return (f"{what} needs {name}, which is installed but does not import "
            f"({first_line(root_cause(error))}); "
            f"run `python -c 'import {name}'` to see why")


@contextlib.contextmanager
def _identity_moves_skipped(model: torch.nn.Module):
    """peft moves each new adapter to its base layer's device and dtype with ``Module.to``. On
    fake tensors ``Module.to`` swaps every tensor, even onto itself, which torch refuses for a
    tensor other code holds; a move that changes nothing is skipped instead (meta and real
    tensors need no help)."""
    first = next(model.parameters(), None)
    from torch._subclasses.fake_tensor import is_fake
    if first is None or not is_fake(first):
        yield
        return
    original = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if all((device is None or t.device == device) and (dtype is None or t.dtype == dtype
                                                           or not t.is_floating_point())
               for t in (*self.parameters(), *self.buffers())):
            return self
        return original(self, *args, **kwargs)
    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


def logical_numel(p: torch.Tensor) -> int:
    # A packed 4-bit weight holds two parameters per byte: count the layer's parameters.
    state = getattr(p, "quant_state", None)
    return int(torch.Size(state.shape).numel()) if state is not None else p.numel()


def _linear_names(model: torch.nn.Module) -> set[str]:
    types = (torch.nn.Linear, *_bnb_linear_types())
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
            if isinstance(m, types) and name}


def _bnb_linear_types() -> tuple[type, ...]:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return ()
    return (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)


def _targets(model: torch.nn.Module, adapters: Adapters):
    """peft's target modules: the user's, peft's per-architecture default for a transformers
    model (its mapping by ``config.model_type``), else every linear layer of a model file."""
    if adapters.lora_targets:
        return list(adapters.lora_targets)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "model_type", None):
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
        found = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(config.model_type)
        if found:
            return list(found)
    names = _linear_names(model)
    if not names:
        raise AdapterError("the model has no nn.Linear layer for LoRA; name the layers to "
                           "adapt with --lora-targets")
    return sorted(names)        # peft matches these as suffixes of the module names


def _skipped_modules(model: torch.nn.Module) -> set[str]:
    """transformers' ``get_keys_to_not_convert`` rule, for any module: output embeddings,
    tied weights, and the module that holds the last parameter."""
    skip: set[str] = set()
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = name.rsplit(".", 1)[0]
        key = p.untyped_storage()._cdata if p.device.type != "meta" else id(p)
        if key in seen:
            skip |= {owner, seen[key]}
        seen.setdefault(key, owner)
    names = [n for n, _ in model.named_parameters()]
    if names:
        skip.add(names[-1].rsplit(".", 1)[0])
    for name, m in model.named_modules():
        if out is not None and m is out:
            skip.add(name)
    return skip


def _quantize_linears(model: torch.nn.Module, adapters: Adapters, compute: torch.dtype
                      ) -> tuple[int, list[str]]:
    _import("bitsandbytes", "--quantize")
    from bitsandbytes.nn import Int8Params, Linear4bit, Linear8bitLt, Params4bit
    import bitsandbytes.functional as bnb_f
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
    skip = _skipped_modules(model)
    done = 0
    kept = []
    # Double quantization's 8-bit code map is built from real numbers (.tolist()) and cached on
    # the device of the first call; on CUDA every layer then shares that one map. Build it on
    # the CPU, hand the layers one copy on this device, and put the cache back afterwards.
    cached = bnb_f.name2qmap.get("dynamic")
    with unset_fake_temporarily(), torch.device("cpu"):
        cpu_map = cached if cached is not None and cached.device.type == "cpu" \
            else bnb_f.create_dynamic_map()
    first = next(model.parameters())
    device = first.device
    shared = (torch.empty(cpu_map.shape, dtype=cpu_map.dtype, device=device)
              if device.type == "meta" or is_fake(first) else cpu_map.to(device))
    bnb_f.name2qmap["dynamic"] = shared          # values only matter to real runs
    try:
        for name, module in list(model.named_modules()):
            if not isinstance(module, torch.nn.Linear) or isinstance(module, (Linear4bit,
                                                                              Linear8bitLt)):
                continue
            if name in skip:
                kept.append(name)
                continue
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if adapters.quantize == "int8":
                # transformers' load_in_8bit: has_fp16_weights=False, llm_int8_threshold 6.0;
                # the fp16 checkpoint weight is quantized row-wise as it moves to the GPU.
                q = Linear8bitLt(module.in_features, module.out_features,
                                 bias=module.bias is not None, has_fp16_weights=False,
                                 threshold=_INT8_THRESHOLD, device="meta")
                weight = Int8Params(module.weight.detach().to(torch.float16),
                                    requires_grad=False, has_fp16_weights=False)
            else:
                q = Linear4bit(module.in_features, module.out_features,
                               bias=module.bias is not None, compute_dtype=compute,
                               compress_statistics=adapters.double_quant,
                               quant_type=adapters.quantize, device="meta")
                weight = Params4bit(module.weight.detach().to(compute), requires_grad=False,
                                    blocksize=_BLOCKSIZE_4BIT,
                                    compress_statistics=adapters.double_quant,
                                    quant_type=adapters.quantize)
            q.weight = weight._quantize(device)          # the library's packing on this device
            if module.bias is not None:
                q.bias = torch.nn.Parameter(module.bias.detach(), requires_grad=False)
            setattr(parent, child, q)
            done += 1
    finally:
        if cached is None:
            bnb_f.name2qmap.pop("dynamic", None)
        else:
            bnb_f.name2qmap["dynamic"] = cached
    if not done:
        raise AdapterError("--quantize found no nn.Linear layer to quantize")
    return done, kept



# peft's PeftModel holds the base model as ``base_model.model``: every module name of a LoRA
# model starts with it (peft/peft_model.py, peft/tuners/tuners_utils.py BaseTuner).
PEFT_PREFIX = "base_model.model."


def base_model_names(names: dict[str, int]) -> dict[str, int]:
    """A device map of a peft-wrapped model with the base model's names, the ones
    ``from_pretrained(..., device_map=...)`` places before ``get_peft_model`` wraps it."""
    return {k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k: v
            for k, v in names.items()}


def wrapped_model_names(model: torch.nn.Module, names: dict[str, int]) -> dict[str, int]:
    """The inverse for a peft-wrapped ``model``: base-model names get peft's prefix (a map
    written for ``from_pretrained`` used to dispatch the wrapped model); others pass."""
    if not any(n.startswith(PEFT_PREFIX) for n, _ in model.named_modules()):
        return names
    return {k if k.startswith(PEFT_PREFIX) else PEFT_PREFIX + k: v for k, v in names.items()}


def register_4bit_flops() -> None:
    """Give ``bitsandbytes::gemm_4bit`` its matmul FLOPs in torch's FLOP registry (what the
    trace and the multi-GPU layout count by, oomdoctor.sim.flops): a custom op has no formula,
    so a QLoRA step counted none of its base model's matmuls and ranked faster than LoRA. The
    op multiplies the input (..., K) by the dequantized (N, K) weight: 2 x rows x N x K."""
    from torch.utils import flop_counter
    op = getattr(getattr(torch.ops, "bitsandbytes", None), "gemm_4bit", None)
    if op is None or op in flop_counter.flop_registry:
        return

    def gemm_4bit_flop(a_shape, b_shape, shape_b, *args, out_shape=None, **kwargs) -> int:
        rows = 1
        for d in a_shape[:-1]:
            rows *= d
        return 2 * rows * int(shape_b[0]) * int(shape_b[1])
    flop_counter.register_flop_formula(op)(gemm_4bit_flop)

