"""The names of what oomdoctor can simulate, importable without torch (the CLI builds its options
from them before any command decides whether it needs torch)."""

PRECISIONS = ("fp32", "fp16", "bf16", "bf16-pure", "fp16-pure")
# Pure precisions: the weights themselves are 16-bit (model.to(dtype) / model.half()), no
# autocast, no GradScaler; the optimizer's state takes the weights' dtype. The value is the
# torch dtype's name (this module imports no torch; oomdoctor.models.casting.pure_dtype maps it).
PURE_PRECISIONS = {"bf16-pure": "bfloat16", "fp16-pure": "float16"}
# Trace-only: a wrapper casts every parameter to 16 bits for the compute - FSDP's
# MixedPrecisionPolicy(param_dtype) on each unit it gathers, DeepSpeed's engine (module.bfloat16()
# / .half()) - so LoRA adapters compute in 16 bits too, where a plain peft model in pure bf16
# keeps them fp32 (get_peft_model's autocast_adapter_dtype). Traced as the pure precision
# otherwise; the wrapper's own fp32 copies are the parallel planner's (oomdoctor.plans.parallel).
WRAPPER_CASTS = {"bf16-cast": "bfloat16", "fp16-cast": "float16"}
TRACE_PRECISIONS = PRECISIONS + tuple(WRAPPER_CASTS)
# Which precision every command prefers when two fit equally well: bf16 AMP where the card has
# it (fp16's range needs a GradScaler and can still overflow), then fp16 AMP, fp32, and the pure
# 16-bit ones whose numerics are not neutral. probe's recommendation and recommend's ranking
# both follow it.
PRECISION_PREFERENCE = ("bf16", "fp16", "fp32", "bf16-pure", "fp16-pure")

# What a pure precision costs in quality. bf16 keeps fp32's 8 exponent bits and 8 bits of
# mantissa; fp16 has 11 bits of mantissa (finer steps: updates down to ~1/2048 of a weight
# survive) but 5 exponent bits: nothing above 65504, normals from 6.1e-5, subnormals to 6e-8
# (torch.finfo(torch.float16)). The AdamW failure was checked on torch 2.13 (CPU, foreach and
# single-tensor): fp16 weight 1.0, gradient 1e-3, lr 1e-3 -> -inf with eps=1e-8, 0.990 with
# eps=1e-4; a zero gradient -> NaN. Mixed-precision training (Micikevicius et al. 2018,
# arXiv:1710.03740) keeps fp32 master weights and scales the loss for exactly these reasons.
PURE_QUALITY = {
    "bf16-pure": "pure bf16 is not neutral: weights and Adam moments keep 8 mantissa bits, so "
                 "updates smaller than ~1/256 of a weight are lost; prefer AMP if it fits, or an "
                 "optimizer with fp32 master weights / Kahan summation",
    "fp16-pure": "pure fp16 is the riskiest precision: with no GradScaler, gradients below 6e-8 "
                 "flush to zero (below 6.1e-5 they lose bits) and activations or logits above "
                 "65504 overflow to inf, so the loss can turn NaN; AdamW's first second "
                 "moment, 0.001 g^2, flushes to zero for gradients below ~5e-3 and its default "
                 "eps=1e-8 rounds to 0, so such a weight steps by m/0: -inf, or NaN where g = 0 "
                 "(set eps=1e-4: finite, but those steps are still too large). Prefer fp16 AMP "
                 "(fp32 master weights + GradScaler) or bf16 if either fits",
}


OPTIMIZERS = ("adamw", "adamw-fused", "adam", "sgd", "sgd-momentum", "rmsprop", "adagrad",
              "adafactor",
              "torchao-adamw8bit", "torchao-adamw4bit")
MAX_BATCH = 1 << 16   # the probe stops searching here; a model this light fits "at least" this
# When the training loop drops its gradients:
# after-step: step(); zero_grad(set_to_none=True) - the torch >= 2.0 default loop;
# after-forward: forward; zero_grad(); backward; step() - last step's gradients live through
#   the forward (common in tutorials and in scripts that zero right before backward);
# in-place: zero_grad(set_to_none=False), the default before torch 2.0 and in older HF Trainer
#   versions - gradients are never freed.
ZERO_GRAD_MODES = ("after-step", "after-forward", "in-place")
# What --checkpointing recomputes in each wrapped block (oomdoctor.models.checkpointing):
# full: the whole block (torchtitan's FullAC, transformers' gradient_checkpointing_enable);
# op: torchtitan's per-op selective policy - matmul (every other one), attention and max
#   outputs kept, the rest recomputed (torchtitan's SelectiveAC, its default "op" option).
CHECKPOINT_POLICIES = ("full", "op")
# Multi-GPU strategies (oomdoctor.plans.parallel.STRATEGIES, plus "fsdp" as a name for zero3).
# The heads a Hugging Face model can be built with (oomdoctor.models.huggingface.TASKS maps each to its
# transformers auto class).
# --quantize: bitsandbytes 4-bit weight formats (oomdoctor.models.adapters)
QUANTIZATIONS = ("nf4", "fp4", "int8")
# transformers' attention implementations a Hugging Face model can be built with (--attn)
ATTENTIONS = ("eager", "sdpa", "flash_attention_2")
# --weights-dtype: the dtype a Hugging Face model's weights are loaded in (auto: its config's, as
# from_pretrained(dtype="auto") loads a checkpoint)
WEIGHTS_DTYPES = {"auto": None, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TASKS = ("causal-lm", "seq-cls", "masked-lm", "token-cls", "seq2seq-lm", "image-cls",
         "speech-seq2seq")
STRATEGY_CHOICES = ("single", "ddp", "dp", "zero1", "zero2", "zero3", "pipeline2", "fsdp")
# recommend and smoke also take hsdp (hybrid sharding, oomdoctor.plans.parallel.NODE_STRATEGIES), a
# plan for several nodes (--nodes N).
NODE_STRATEGY_CHOICES = STRATEGY_CHOICES + ("hsdp",)
# parallel also takes DeepSpeed's ZeRO stages as DeepSpeed runs them
# (oomdoctor.plans.parallel.DEEPSPEED_STRATEGIES), named on request or by --ds-config.
DEEPSPEED_CHOICES = ("ds0", "ds1", "ds2", "ds3")

# The model-file protocol, as `--help` prints it (the errors of oomdoctor.models.loader point here).
MODEL_PROTOCOL = """\b
MODEL is a Python model file, a Hugging Face id / config folder / config.json
(--task, --seq-len), or timm:NAME / torchvision:NAME (--image-size, --num-classes).
A model file defines:
  build_model() -> nn.Module       no weights from the network, no .cuda()
  make_batch(batch_size)           a tensor, tuple or dict of tensors (default device)
  loss_fn(model, batch) -> loss    optional; else model(*batch) / model(**batch) /
                                   model(batch), whose output or .loss is the loss
  make_optimizer(params)           optional; else AdamW(lr=1e-4), foreach as on CUDA
Everything runs on fake tensors: no .item() or data-dependent shapes in your code."""


def install_hint(extra: str) -> str:
    """The command that installs an optional integration, for both ways people install
    oomdoctor: from PyPI, and from a clone as the README does (``pip install -e .``)."""
    return f"pip install 'oomdoctor[{extra}]' (from a clone: pip install -e '.[{extra}]')"


def param_width(precision: str) -> int:
    """Bytes per trained parameter (and per gradient, per Adam moment) under ``precision``:
    2 for the pure 16-bit precisions, 4 otherwise (AMP keeps fp32 master weights)."""
    return 2 if precision in PURE_PRECISIONS or precision in WRAPPER_CASTS else 4


def needs_bf16(precision: str) -> bool:
    """Whether ``precision`` computes in bf16, which needs compute capability >= 8.0 (fp16,
    pure or AMP, runs on any CUDA card: the T4s and V100s where people reach for it)."""
    return precision in ("bf16", "bf16-pure")


def leanest_precision(allowed: list[str]) -> str:
    """The allowed precision with the fewest bytes of model states: a pure one (bf16-pure
    before fp16-pure, whose range is riskier), else the last named."""
    return next((p for p in PURE_PRECISIONS if p in allowed), allowed[-1])


def no_bf16_fix(precision: str) -> str:
    """What to run instead of a bf16 ``precision`` on a card without bf16."""
    if precision == "bf16-pure":
        return ("use --precision fp16 (AMP + GradScaler), or fp16-pure for pure 16-bit weights "
                "at fp16's risk: no loss scaler, so small gradients underflow to zero")
    return "use --precision fp16"


def checkpointing_label(every: int = 1, policy: str = "full") -> str:
    """How a report names a checkpointing setting: "checkpointing", "checkpointing every 2nd
    block", "per-op checkpointing", ..."""
    label = "per-op checkpointing" if policy == "op" else "checkpointing"
    if every > 1:
        label += f" every {ordinal(every)} block"
    return label


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
