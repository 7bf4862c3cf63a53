"""Models the way users have them: a Hugging Face model id, a folder with ``config.json``, or the
``config.json`` itself - built from the config alone, never with weights.

    oomdoctor estimate meta-llama/Llama-3.1-8B --seq-len 4096 -b 1 --precision bf16
    oomdoctor probe ./my-finetune/ --task seq-cls --seq-len 512

The architecture comes from ``transformers.AutoConfig`` and the ``AutoModelFor...`` class of the
task, built with random initialisation on oomdoctor's fake tensors (``from_config``): only the
small ``config.json`` is read, from the folder, the file, or the Hub (online, or from the local
Hugging Face cache offline). The batch follows the model: ``input_ids`` and an all-ones
``attention_mask`` of ``seq_len`` tokens, and ``labels`` as the task's loss wants them; the loss
is the model's own (``outputs.loss``), as the HF Trainer computes it. Needs ``pip install
oomdoctor[hf]``.
"""
from __future__ import annotations

import os
from typing import Any

from oomdoctor import configs
from oomdoctor.loader import ModelFileError, ModelSpec

# task name (configs.TASKS, what --task offers) -> (the transformers auto class, the
# architecture-name suffixes that imply it)
TASKS = dict(zip(configs.TASKS, [
    ("AutoModelForCausalLM", ("ForCausalLM", "LMHeadModel")),
    ("AutoModelForSequenceClassification", ("ForSequenceClassification",)),
    ("AutoModelForMaskedLM", ("ForMaskedLM", "ForPreTraining")),
    ("AutoModelForTokenClassification", ("ForTokenClassification",)),
    ("AutoModelForSeq2SeqLM", ("ForConditionalGeneration",)),
], strict=True))
DEFAULT_SEQ_LEN = 1024      # tokens, capped at the model's max_position_embeddings


def is_model_file(source: str) -> bool:
    return source.endswith(".py")


def load_hf(source: str, task: str | None = None, seq_len: int | None = None) -> ModelSpec:
    """A :class:`ModelSpec` for a Hugging Face id, config folder or ``config.json``."""
    try:
        import transformers
    except ImportError:
        raise ModelFileError(f"{source}: not a .py model file, and reading it as a Hugging Face "
                             "model needs transformers: pip install 'oomdoctor[hf]'") from None
    # transformers' warnings about a from-scratch model (an unset loss_type, generation
    # defaults) concern inference and weights, which oomdoctor never uses; they would repeat
    # around every estimate. Only its errors are let through from here on in this process.
    transformers.utils.logging.set_verbosity_error()
    config = _config(transformers, source)
    task = task or _task_of(config, source)
    auto_name, _ = TASKS[task]
    auto = getattr(transformers, auto_name)
    max_len = getattr(config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN
    tokens = seq_len or min(DEFAULT_SEQ_LEN, max_len)
    if tokens > max_len:
        raise ModelFileError(f"{source}: --seq-len {tokens} is beyond the model's "
                             f"max_position_embeddings ({max_len})")
    vocab = config.vocab_size
    num_labels = getattr(config, "num_labels", 2)

    def build_model():
        # SDPA where the architecture has it (what transformers picks on a GPU), else eager.
        try:
            return auto.from_config(config, attn_implementation="sdpa")
        except (ValueError, ImportError):
            return auto.from_config(config)

    def make_batch(batch_size: int) -> dict[str, Any]:
        import torch
        ids = torch.randint(0, vocab, (batch_size, tokens))
        batch = {"input_ids": ids, "attention_mask": torch.ones(batch_size, tokens,
                                                                dtype=torch.long)}
        if task == "seq-cls":
            batch["labels"] = torch.randint(0, num_labels, (batch_size,))
        elif task == "token-cls":
            batch["labels"] = torch.randint(0, num_labels, (batch_size, tokens))
        else:                      # language modelling: the model shifts the labels itself
            batch["labels"] = ids
        return batch

    label = source.rstrip("/").split("/")[-1]
    if label == "config.json":
        label = os.path.basename(os.path.dirname(os.path.abspath(source)))
    return ModelSpec(path=source, build_model=build_model, make_batch=make_batch, loss_fn=None,
                     make_optimizer=None, label=f"{label} ({task}, {tokens} tokens)")


def max_tokens(source: str) -> int:
    """The longest sequence the model takes (``max_position_embeddings``; 1024 if unset)."""
    import transformers
    config = _config(transformers, source)
    return getattr(config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN


def _config(transformers: Any, source: str) -> Any:
    if source.endswith(".json") and not os.path.isfile(source):
        raise ModelFileError(f"{source}: no such file")
    try:
        # a folder, a config.json file, or a Hub id (the Hub, or its local cache offline)
        return transformers.AutoConfig.from_pretrained(source)
    except OSError as e:
        local = os.path.exists(source)
        raise ModelFileError(
            f"{source}: could not read its config ({str(e).strip().splitlines()[0]}); "
            + ("the folder needs a config.json" if local else
               "pass a model file (.py), a folder with config.json, or a Hub id; offline, "
               "fetch the config once with `huggingface-cli download ID config.json` (gated "
               "models need `huggingface-cli login` first)")) from None
    except ValueError as e:
        raise ModelFileError(f"{source}: transformers cannot read this config "
                             f"({str(e).strip().splitlines()[0]}); upgrade transformers or "
                             "write a model file") from None


def _task_of(config: Any, source: str) -> str:
    for arch in getattr(config, "architectures", None) or ():
        for task, (_, suffixes) in TASKS.items():
            if arch.endswith(suffixes):
                return task
    raise ModelFileError(f"{source}: the config does not say what the model is trained for "
                         f"(architectures: {getattr(config, 'architectures', None)}); pass "
                         f"--task {'|'.join(TASKS)}")
