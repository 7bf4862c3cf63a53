"""Hugging Face models the way users have them: a model id, a folder with ``config.json``, or
the ``config.json`` itself - built from the config alone, never with weights.

    oomdoctor estimate meta-llama/Llama-3.1-8B --seq-len 4096 -b 1 --precision bf16
    oomdoctor probe ./my-finetune/ --task seq-cls --seq-len 512

The architecture comes from ``transformers.AutoConfig`` and the ``AutoModelFor...`` class of the
task, built with random initialisation on oomdoctor's fake tensors (``from_config``): only the
small ``config.json`` is read, from the folder, the file, or the Hub (online, or from the local
Hugging Face cache offline). The text batch follows the model: ``input_ids`` and an all-ones
``attention_mask`` of ``seq_len`` tokens, and ``labels`` as the task's loss wants them; the loss
is the model's own (``outputs.loss``), as the HF Trainer computes it. Image classifiers
(``image-cls``) get ``pixel_values`` and class labels instead, Whisper (``speech-seq2seq``) a
log-mel window and label tokens. Needs ``pip install oomdoctor[hf]``.
"""
from __future__ import annotations

import copy
import re

import os
from typing import Any

from oomdoctor import configs
from oomdoctor.models.spec import (ModelFileError, ModelSpec, failed_import, import_failure,
                                   not_installed)

# task name (configs.TASKS, what --task offers) -> (the transformers auto class, the
# architecture-name suffixes that imply it)
TASKS = dict(zip(configs.TASKS, [
    ("AutoModelForCausalLM", ("ForCausalLM", "LMHeadModel")),
    ("AutoModelForSequenceClassification", ("ForSequenceClassification",)),
    ("AutoModelForMaskedLM", ("ForMaskedLM", "ForPreTraining")),
    ("AutoModelForTokenClassification", ("ForTokenClassification",)),
    ("AutoModelForSeq2SeqLM", ("ForConditionalGeneration",)),
    ("AutoModelForImageClassification", ("ForImageClassification",)),
    # told apart from seq2seq-lm by the config's model type (_task_of): both are
    # ...ForConditionalGeneration
    ("AutoModelForSpeechSeq2Seq", ()),
], strict=True))
IMAGE_TASKS = ("image-cls",)    # a batch of images (--image-size, --num-classes), not tokens
DEFAULT_SEQ_LEN = 1024      # tokens, capped at the model's max_position_embeddings


def is_model_file(source: str) -> bool:
    return source.endswith(".py")


def load_hf(source: str, task: str | None = None, seq_len: int | None = None,
            image_size: int | None = None, num_classes: int | None = None,
            attn: str | None = None, weights_dtype: str | None = None) -> ModelSpec:
    """A :class:`ModelSpec` for a Hugging Face id, config folder or ``config.json``; ``attn``:
    transformers' ``attn_implementation`` (default: SDPA where the architecture has it);
    ``weights_dtype`` (configs.WEIGHTS_DTYPES): the dtype the weights load in (default: what the
    installed release's ``from_pretrained`` loads, :func:`loaded_dtype`)."""
    try:
        import transformers
    except ImportError as e:
        if not not_installed("transformers", e):
            raise import_failure(source, "transformers", e) from None
        raise ModelFileError(f"{source}: not a .py model file, and reading it as a Hugging Face "
                             "model needs transformers: " + configs.install_hint("hf")) from None
    # transformers' warnings about a from-scratch model (an unset loss_type, generation
    # defaults) concern inference and weights, which oomdoctor never uses; they would repeat
    # around every estimate. Only its errors are let through from here on in this process.
    transformers.utils.logging.set_verbosity_error()
    try:
        # transformers imports each architecture's modules on first use: a dependency that
        # does not load (a torchvision built for another torch) fails here, not at the import
        config = _config(transformers, source)
        dtype = loaded_dtype(transformers, config, weights_dtype)
        task = task or _task_of(config, source)
        auto_name, _ = TASKS[task]
        auto = getattr(transformers, auto_name)
    except (ImportError, RuntimeError) as e:
        if not failed_import(e):
            raise
        raise import_failure(source, f"transformers {transformers.__version__}", e) from None
    if task in IMAGE_TASKS or image_size or num_classes:
        return _hf_images(source, config, task, auto, seq_len, image_size, num_classes, attn,
                          dtype)
    if task == "speech-seq2seq":
        return _hf_speech(source, config, auto, seq_len, attn, dtype)
    tokens = _tokens(source, config, seq_len)
    vocab = config.vocab_size
    num_labels = getattr(config, "num_labels", 2)

    build_model = _builder(source, auto, config, attn, dtype)

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

    return ModelSpec(path=source, build_model=build_model, make_batch=make_batch, loss_fn=None,
                     make_optimizer=None, label=f"{_label(source)} ({task}, {tokens} tokens)")


def _hf_images(source: str, config: Any, task: str, auto: Any, seq_len: int | None,
               image_size: int | None, num_classes: int | None, attn: str | None,
               dtype: tuple[dict, str]) -> ModelSpec:
    """An image classifier from its config (ViT, ConvNeXt, Swin, ...): ``pixel_values`` at the
    config's ``image_size`` (or the one asked for) and class ``labels``; the model's own loss."""
    if task not in IMAGE_TASKS:
        raise ModelFileError(f"{source}: --image-size and --num-classes apply to image models "
                             f"(--task {'|'.join(IMAGE_TASKS)}), not to {task}")
    if seq_len:
        raise ModelFileError(f"{source}: --seq-len applies to text models; an image model takes "
                             "--image-size")
    size = getattr(config, "image_size", None) or 224
    size = image_size or (size[0] if isinstance(size, (list, tuple)) else size)
    channels = getattr(config, "num_channels", None) or 3
    if image_size and hasattr(config, "image_size"):
        # built for that size (ViT's position embeddings), as a fine-tune at a new resolution
        config.image_size = image_size
    if num_classes:
        config.num_labels = num_classes       # the head to train, as from_pretrained(num_labels=)
    classes = config.num_labels
    build_model = _builder(source, auto, config, attn, dtype)

    def make_batch(batch_size: int) -> dict[str, Any]:
        import torch
        return {"pixel_values": torch.randn(batch_size, channels, size, size),
                "labels": torch.randint(0, classes, (batch_size,))}
    return ModelSpec(path=source, build_model=build_model, make_batch=make_batch, loss_fn=None,
                     make_optimizer=None,
                     label=f"{_label(source)} ({task}, {size}x{size}, {classes} classes)")


def _hf_speech(source: str, config: Any, auto: Any, seq_len: int | None, attn: str | None,
               dtype: tuple[dict, str]) -> ModelSpec:
    """Whisper-style speech-to-text: ``input_features``, the log-mel spectrogram of a 30 s
    window (``num_mel_bins`` x twice ``max_source_positions`` frames: the encoder's strided
    convolution halves them), and ``labels`` of ``seq_len`` tokens (default and at most
    ``max_target_positions``)."""
    mels, frames = (getattr(config, "num_mel_bins", None),
                    getattr(config, "max_source_positions", None))
    if not mels or not frames:
        raise ModelFileError(f"{source}: oomdoctor builds speech batches for Whisper-style "
                             "models (log-mel input_features); for this one write a model file "
                             "with its make_batch (see --help)")
    tokens = _tokens(source, config, seq_len)

    def make_batch(batch_size: int) -> dict[str, Any]:
        import torch
        return {"input_features": torch.randn(batch_size, mels, 2 * frames),
                "labels": torch.randint(0, config.vocab_size, (batch_size, tokens))}
    return ModelSpec(path=source, build_model=_builder(source, auto, config, attn, dtype),
                     make_batch=make_batch,
                     loss_fn=None, make_optimizer=None,
                     label=f"{_label(source)} (speech-seq2seq, {2 * frames} frames, "
                           f"{tokens} tokens)")


def _builder(source: str, auto: Any, base_config: Any, attn: str | None,
             dtype: tuple[dict, str] = ({}, "")):
    def build_model():
        kwargs, note = dtype
        # Each build gets its own config, as each from_pretrained does: checkpointing turns the
        # model's config.use_cache off (transformers' switch, models/checkpointing.py), which
        # on a shared config leaked into every later build - a trace without checkpointing then
        # lost the KV cache its forward allocates (recommend's check of a plan 3% low).
        config = copy.deepcopy(base_config)
        if attn is not None:
            model = _with_attention(source, auto, config, attn, kwargs)
        else:
            # SDPA where the architecture has it (what transformers picks on a GPU), else eager.
            try:
                model = auto.from_config(config, attn_implementation="sdpa", **kwargs)
            except (ValueError, ImportError):
                # named: the refused attempt has already written "sdpa" into the config
                model = auto.from_config(config, attn_implementation="eager", **kwargs)
        model._oomdoctor_weights_note = note      # read by oomdoctor.sim.libraries
        return model
    return build_model


def _with_attention(source: str, auto: Any, config: Any, attn: str, kwargs: dict) -> Any:
    """The model with the attention implementation asked for, or a one-line refusal."""
    try:
        return auto.from_config(config, attn_implementation=attn, **kwargs)
    except (ValueError, ImportError) as e:
        why = str(e).strip().splitlines()[0]
        fix = ("flash-attn is not importable here; --attn sdpa traces CUDA's flash kernel, "
               "which keeps the same per-row log-sum-exp in 16-bit training"
               if attn == "flash_attention_2" else "pass --attn eager or sdpa")
        raise ModelFileError(f"{source}: transformers cannot build it with "
                             f"attn_implementation={attn!r} ({why}); {fix}") from None


def loaded_dtype(transformers: Any, config: Any, weights_dtype: str | None
                 ) -> tuple[dict, str]:
    """(from_config's dtype keyword, the note saying which dtype the weights load in and why).

    ``from_pretrained`` loads a checkpoint in its config's dtype by default since transformers
    5 (``dtype="auto"``) and in float32 before it (modeling_utils.py); ``from_config`` follows
    the same rule in each release, so the default passes nothing. ``weights_dtype`` names one
    (``auto``: the config's, as ``dtype="auto"`` does)."""
    import torch
    release = transformers.__version__
    major_minor = tuple(int(x) for x in re.findall(r"\d+", release)[:2])
    keyword = "dtype" if major_minor >= (4, 56) else "torch_dtype"   # renamed in 4.56
    own = getattr(config, "dtype", None) if major_minor >= (4, 56) else None
    own = own or getattr(config, "torch_dtype", None)
    named = str(own).removeprefix("torch.") if own is not None else None
    change = "; --weights-dtype fp32|bf16|fp16|auto sets it"
    if weights_dtype is None:
        if major_minor >= (5, 0):
            loaded = named or "float32"
            why = (f"its config's dtype, which transformers {release}'s from_pretrained loads "
                   "by default (dtype='auto')" if named else
                   f"its config names no dtype, and transformers {release} loads float32")
        else:
            loaded = "float32"
            why = (f"transformers {release}'s from_pretrained loads float32 unless given "
                   f"torch_dtype" + (f" (the config's is {named})" if named else ""))
        return {}, f"weights loaded as {loaded}: {why}{change}"
    if weights_dtype not in configs.WEIGHTS_DTYPES:
        raise ModelFileError(f"unknown --weights-dtype {weights_dtype!r}; choose one of "
                             f"{', '.join(configs.WEIGHTS_DTYPES)}")
    loaded = configs.WEIGHTS_DTYPES[weights_dtype] or named or "float32"
    why = ("its config's dtype (--weights-dtype auto, from_pretrained(dtype='auto'))"
           if weights_dtype == "auto" else f"--weights-dtype {weights_dtype}")
    return {keyword: getattr(torch, loaded)}, f"weights loaded as {loaded}: {why}"


def _label(source: str) -> str:
    label = source.rstrip("/").split("/")[-1]
    if label == "config.json":
        label = os.path.basename(os.path.dirname(os.path.abspath(source)))
    return label


def max_tokens(source: str) -> int:
    """The longest sequence the model takes (see :func:`_max_len`)."""
    import transformers
    return _max_len(_config(transformers, source))[1]


def _max_len(config: Any) -> tuple[str, int]:
    """(the config field, the longest sequence the model takes): ``max_position_embeddings``,
    or a decoder's ``max_target_positions`` (Whisper); 1024 if neither is set."""
    for field in ("max_position_embeddings", "max_target_positions"):
        if getattr(config, field, None):
            return field, getattr(config, field)
    return "max_position_embeddings", DEFAULT_SEQ_LEN


def _tokens(source: str, config: Any, seq_len: int | None) -> int:
    """--seq-len, or the default capped at the model's longest."""
    field, max_len = _max_len(config)
    tokens = seq_len or min(DEFAULT_SEQ_LEN, max_len)
    if tokens > max_len:
        raise ModelFileError(f"{source}: --seq-len {tokens} is beyond the model's {field} "
                             f"({max_len})")
    return tokens


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
               "fetch the config once with `hf download ID config.json` (gated models need "
               "`hf auth login` first; huggingface_hub before 0.34 calls it huggingface-cli)"
               )) from None
    except ValueError as e:
        raise ModelFileError(f"{source}: transformers cannot read this config "
                             f"({str(e).strip().splitlines()[0]}); upgrade transformers or "
                             "write a model file") from None


def _task_of(config: Any, source: str) -> str:
    from transformers.models.auto import modeling_auto as auto
    if getattr(config, "model_type", None) in auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return "speech-seq2seq"
    for arch in getattr(config, "architectures", None) or ():
        for task, (_, suffixes) in TASKS.items():
            if arch.endswith(suffixes):
                return task
    raise ModelFileError(f"{source}: the config does not say what the model is trained for "
                         f"(architectures: {getattr(config, 'architectures', None)}); pass "
                         f"--task {'|'.join(TASKS)}")
