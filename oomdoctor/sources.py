"""Models the way users have them: a Hugging Face model id, a folder with ``config.json``, or the
``config.json`` itself - built from the config alone, never with weights; or a timm or
torchvision model by name.

    oomdoctor estimate meta-llama/Llama-3.1-8B --seq-len 4096 -b 1 --precision bf16
    oomdoctor probe ./my-finetune/ --task seq-cls --seq-len 512
    oomdoctor probe timm:convnext_base --image-size 384 --num-classes 10

The architecture comes from ``transformers.AutoConfig`` and the ``AutoModelFor...`` class of the
task, built with random initialisation on oomdoctor's fake tensors (``from_config``): only the
small ``config.json`` is read, from the folder, the file, or the Hub (online, or from the local
Hugging Face cache offline). The text batch follows the model: ``input_ids`` and an all-ones
``attention_mask`` of ``seq_len`` tokens, and ``labels`` as the task's loss wants them; the loss
is the model's own (``outputs.loss``), as the HF Trainer computes it. Image classifiers
(``image-cls``) get ``pixel_values`` and class labels instead, Whisper (``speech-seq2seq``) a
log-mel window and label tokens. Needs ``pip install oomdoctor[hf]``.

``timm:NAME`` and ``torchvision:NAME`` are built by their libraries' own constructors
(``timm.create_model``, ``torchvision.models.get_model``) with no weights, and trained as an image
classifier (torchvision's segmentation models as a per-pixel one): a batch of random images at
the model's own input size (``--image-size`` to change it) and class labels, cross-entropy loss.
Needs ``pip install oomdoctor[vision]``.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

from oomdoctor import configs
from oomdoctor.loader import ModelFileError, ModelSpec, first_line

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
            image_size: int | None = None, num_classes: int | None = None) -> ModelSpec:
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
    if task in IMAGE_TASKS or image_size or num_classes:
        return _hf_images(source, config, task, auto, seq_len, image_size, num_classes)
    if task == "speech-seq2seq":
        return _hf_speech(source, config, auto, seq_len)
    tokens = _tokens(source, config, seq_len)
    vocab = config.vocab_size
    num_labels = getattr(config, "num_labels", 2)

    build_model = _builder(auto, config)

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
               image_size: int | None, num_classes: int | None) -> ModelSpec:
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
    build_model = _builder(auto, config)

    def make_batch(batch_size: int) -> dict[str, Any]:
        import torch
        return {"pixel_values": torch.randn(batch_size, channels, size, size),
                "labels": torch.randint(0, classes, (batch_size,))}
    return ModelSpec(path=source, build_model=build_model, make_batch=make_batch, loss_fn=None,
                     make_optimizer=None,
                     label=f"{_label(source)} ({task}, {size}x{size}, {classes} classes)")


def _hf_speech(source: str, config: Any, auto: Any, seq_len: int | None) -> ModelSpec:
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
    return ModelSpec(path=source, build_model=_builder(auto, config), make_batch=make_batch,
                     loss_fn=None, make_optimizer=None,
                     label=f"{_label(source)} (speech-seq2seq, {2 * frames} frames, "
                           f"{tokens} tokens)")


def _builder(auto: Any, config: Any):
    def build_model():
        # SDPA where the architecture has it (what transformers picks on a GPU), else eager.
        try:
            return auto.from_config(config, attn_implementation="sdpa")
        except (ValueError, ImportError):
            # named: the refused attempt has already written "sdpa" into the config
            return auto.from_config(config, attn_implementation="eager")
    return build_model


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
               "fetch the config once with `huggingface-cli download ID config.json` (gated "
               "models need `huggingface-cli login` first)")) from None
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


# --- timm and torchvision -------------------------------------------------------------------

VISION_PREFIXES = ("timm:", "torchvision:")
DEFAULT_NUM_CLASSES = 1000     # both libraries' ImageNet heads
DEFAULT_IMAGE_SIZE = 224


def is_vision(source: str) -> bool:
    return source.startswith(VISION_PREFIXES)


def load_vision(source: str, image_size: int | None = None,
                num_classes: int | None = None) -> ModelSpec:
    """A :class:`ModelSpec` for ``timm:NAME`` or ``torchvision:NAME``: the library's
    constructor without weights, random images and labels, cross-entropy loss."""
    library, _, name = source.partition(":")
    if not name:
        raise ModelFileError(f"{source}: name the model, e.g. {library}:resnet50")
    make, size, segmentation = (_timm if library == "timm" else _torchvision)(name, source)
    size = image_size or size
    kwargs = {} if num_classes is None else {"num_classes": num_classes}
    # Vision transformers fix their position embeddings to one input size at construction
    # (timm's img_size, torchvision's image_size); convolutional nets take any size and refuse
    # the argument. Which kind this is, is found once here, on the meta device.
    size_arg = {"timm": "img_size", "torchvision": "image_size"}[library]
    if image_size is not None:
        import torch
        with torch.device("meta"):
            try:
                make(**kwargs, **{size_arg: size})
                kwargs[size_arg] = size
            except TypeError:
                pass
    classes = num_classes or _num_classes(make, kwargs, segmentation)

    def build_model():
        return make(**kwargs)

    def make_batch(batch_size: int):
        import torch
        images = torch.randn(batch_size, 3, size, size)
        shape = (batch_size, size, size) if segmentation else (batch_size,)
        return images, torch.randint(0, classes, shape)

    return ModelSpec(path=source, build_model=build_model, make_batch=make_batch,
                     loss_fn=_classification_loss, make_optimizer=None,
                     label=f"{name} ({size}x{size}, {classes} classes)")


def _classification_loss(model: Any, batch: Any) -> Any:
    """Cross-entropy on every head the model returns in training: one logits tensor; an
    Inception's (logits, aux_logits) pair; a segmentation model's {"out", "aux"} maps, which
    torchvision's reference recipes weigh 1 and 0.5 (weights scale the loss, not memory)."""
    import torch.nn.functional as F
    images, labels = batch
    out = model(images)
    if isinstance(out, dict):
        heads = list(out.values())
    elif isinstance(out, tuple):
        heads = [o for o in out if o is not None]
    else:
        heads = [out]
    return sum(F.cross_entropy(h, labels) for h in heads)


def _num_classes(make: Any, kwargs: dict, segmentation: bool) -> int:
    """The head's width: timm's ``num_classes``; else the last classifier layer's outputs
    (a Linear, or a segmentation model's 1x1 Conv2d)."""
    import torch
    with torch.device("meta"):
        model = make(**kwargs)
    if getattr(model, "num_classes", None):
        return model.num_classes
    kind = torch.nn.Conv2d if segmentation else torch.nn.Linear
    heads = [m for m in model.modules() if isinstance(m, kind)]
    return (heads[-1].out_channels if segmentation else heads[-1].out_features) if heads \
        else DEFAULT_NUM_CLASSES


def _timm(name: str, source: str) -> tuple[Any, int, bool]:
    timm = _import("timm", source)
    if not timm.is_model(name):
        raise ModelFileError(f"{source}: timm has no model {name!r}"
                             + _close(timm.list_models(f"*{name.split('.')[0]}*")))
    cfg = timm.get_pretrained_cfg(name)
    size = (getattr(cfg, "input_size", None) or (3, DEFAULT_IMAGE_SIZE))[-1]

    def make(**kwargs):
        model = timm.create_model(name, pretrained=False, **kwargs)
        if model.num_classes == 0 and "num_classes" not in kwargs:
            # a pretraining tag without a head (e.g. *.mim_in22k): train an ImageNet one
            model = timm.create_model(name, pretrained=False, num_classes=DEFAULT_NUM_CLASSES)
        return model
    return make, size, False


def _torchvision(name: str, source: str) -> tuple[Any, int, bool]:
    tv = _import("torchvision", source)
    models = tv.models
    if name not in models.list_models():
        raise ModelFileError(f"{source}: torchvision has no model {name!r}"
                             + _close(models.list_models(include=f"*{name}*")))
    kinds = {"segmentation": models.list_models(module=models.segmentation)}
    for kind in ("detection", "video", "optical_flow", "quantization"):
        module = getattr(models, kind, None)
        if module is not None and name in models.list_models(module=module):
            raise ModelFileError(
                f"{source}: a torchvision {kind.replace('_', ' ')} model; oomdoctor builds "
                "image classifiers and segmentation models by name. Write a model file whose "
                "make_batch gives this model the inputs it trains on (see `oomdoctor probe "
                "--help`)")
    segmentation = name in kinds["segmentation"]
    size = DEFAULT_IMAGE_SIZE
    try:
        crop = models.get_model_weights(name).DEFAULT.transforms().crop_size
        size = crop[0] if crop else size
    except (ValueError, AttributeError, TypeError):
        pass
    builder = models.get_model_builder(name)
    import inspect
    # Segmentation (and detection) builders would download an ImageNet backbone by default.
    extra = ({"weights_backbone": None}
             if "weights_backbone" in inspect.signature(builder).parameters else {})

    def make(**kwargs):
        with warnings.catch_warnings():
            # inception_v3 / googlenet warn that their default init will change (not memory)
            warnings.simplefilter("ignore", FutureWarning)
            return builder(weights=None, **extra, **kwargs)
    return make, size, segmentation


def _import(library: str, source: str) -> Any:
    import importlib
    try:
        return importlib.import_module(library)
    except ImportError:
        raise ModelFileError(f"{source}: needs {library}: pip install 'oomdoctor[vision]'"
                             ) from None
    except RuntimeError as e:
        # torchvision's compiled ops built for another torch (e.g. the PyPI CUDA wheel next to
        # a CPU-only torch) fail at import with "operator torchvision::nms does not exist".
        import torch
        raise ModelFileError(f"{source}: {library} does not load with this torch "
                             f"{torch.__version__} ({first_line(e)}); install the torchvision "
                             "release built for it (see pytorch.org/get-started)") from None


def _close(names: list[str]) -> str:
    return f"; close names: {', '.join(names[:6])}" if names else ""
