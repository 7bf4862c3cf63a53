"""timm and torchvision models by name: ``timm:NAME`` and ``torchvision:NAME``.

    oomdoctor probe timm:convnext_base --image-size 384 --num-classes 10

Built by their libraries' own constructors (``timm.create_model``,
``torchvision.models.get_model``) with no weights, and trained as an image classifier
(torchvision's segmentation models as a per-pixel one): a batch of random images at the model's
own input size (``--image-size`` to change it) and class labels, cross-entropy loss.
Needs ``pip install oomdoctor[vision]``.
"""
from __future__ import annotations

import warnings
from typing import Any

from oomdoctor.configs import install_hint
from oomdoctor.models.spec import ModelFileError, ModelSpec, import_failure, not_installed


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
    except ImportError as e:
        if not_installed(library, e):
            raise ModelFileError(f"{source}: needs {library}: {install_hint('vision')}"
                                 ) from None
        raise import_failure(source, library, e) from None
    except RuntimeError as e:
        # torchvision's compiled ops built for another torch fail at import
        raise import_failure(source, library, e) from None


def _close(names: list[str]) -> str:
    return f"; close names: {', '.join(names[:6])}" if names else ""
