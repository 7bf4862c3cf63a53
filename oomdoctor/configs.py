"""The names of what oomdoctor can simulate, importable without torch (the CLI builds its options
from them before any command decides whether it needs torch)."""

PRECISIONS = ("fp32", "fp16", "bf16", "bf16-pure")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "rmsprop", "adagrad", "adafactor",
              "torchao-adamw8bit", "torchao-adamw4bit")
MAX_BATCH = 1 << 16   # the probe stops searching here; a model this light fits "at least" this
# When the training loop drops its gradients:
# after-step: step(); zero_grad(set_to_none=True) - the torch >= 2.0 default loop;
# after-forward: forward; zero_grad(); backward; step() - last step's gradients live through
#   the forward (common in tutorials and in scripts that zero right before backward);
# in-place: zero_grad(set_to_none=False), the default before torch 2.0 and in older HF Trainer
#   versions - gradients are never freed.
ZERO_GRAD_MODES = ("after-step", "after-forward", "in-place")
# Multi-GPU strategies (oomdoctor.plans.parallel.STRATEGIES, plus "fsdp" as a name for zero3).
# The heads a Hugging Face model can be built with (oomdoctor.models.huggingface.TASKS maps each to its
# transformers auto class).
# --quantize: bitsandbytes 4-bit weight formats (oomdoctor.models.adapters)
QUANTIZATIONS = ("nf4", "fp4", "int8")
TASKS = ("causal-lm", "seq-cls", "masked-lm", "token-cls", "seq2seq-lm", "image-cls",
         "speech-seq2seq")
STRATEGY_CHOICES = ("single", "ddp", "dp", "zero1", "zero2", "zero3", "pipeline2", "fsdp")
# recommend and smoke also take hsdp (hybrid sharding, oomdoctor.plans.parallel.NODE_STRATEGIES), a
# plan for several nodes (--nodes N).
NODE_STRATEGY_CHOICES = STRATEGY_CHOICES + ("hsdp",)

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
