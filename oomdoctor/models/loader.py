"""Load a user's model file and check it follows oomdoctor's model-file protocol.

    oomdoctor estimate sample_models/tiny_mlp.py --batch-size 8

A model file is plain Python that defines:

- ``build_model() -> torch.nn.Module`` - called under oomdoctor's fake-tensor context, so it
  must create its parameters with default factories and must not load weights from the network.
- ``make_batch(batch_size: int)`` - returns a tensor, a tuple/list or a dict of tensors built with
  default-device factory calls (``torch.randn``, ``torch.randint``); oomdoctor sets the device.
- optional ``loss_fn(model, batch) -> Tensor`` - a scalar loss. Without it oomdoctor calls
  ``model(*batch)`` for a tuple, ``model(**batch)`` for a dict, ``model(batch)`` otherwise, and the
  output must be a scalar loss or have a ``.loss`` attribute.
- optional ``make_optimizer(params) -> torch.optim.Optimizer``; the default is
  ``torch.optim.AdamW(params, lr=1e-4)`` as it runs on CUDA (the ``foreach`` implementation).

Everything is traced on fake tensors: the file must not call ``.item()``, ``.tolist()`` or
make shapes depend on tensor values. Problems are reported as :class:`ModelFileError`, a one-line
message naming the file, the function and the fix.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import shlex
import sys
import uuid
from typing import Any, Callable

from oomdoctor.models import huggingface, vision
from oomdoctor.models.spec import ModelFileError, ModelSpec, first_line, moves_to_gpu, user_frame


def load_model(source: str, *, task: str | None = None, seq_len: int | None = None,
               adapters: Any = None, image_size: int | None = None,
               num_classes: int | None = None, keep_outputs: bool = False,
               attn: str | None = None, weights_dtype: str | None = None) -> ModelSpec:
    """A model file (``.py``), a Hugging Face id / config folder / ``config.json`` (``task``
    and ``seq_len`` apply to those; ``image_size`` and ``num_classes`` to its image
    classifiers), or ``timm:NAME`` / ``torchvision:NAME`` (``image_size``, ``num_classes``);
    see :mod:`oomdoctor.models.huggingface` and :mod:`oomdoctor.models.vision`. ``adapters``
    (:class:`oomdoctor.models.adapters.Adapters`): train it with LoRA / on 4-bit weights.
    ``keep_outputs``: the loop keeps last step's outputs (as the file's KEEP_OUTPUTS does).
    ``attn``: a Hugging Face model's attention implementation (eager, sdpa,
    flash_attention_2); ``weights_dtype``: the dtype its weights load in (configs.WEIGHTS_DTYPES;
    default: what the installed transformers loads)."""
    is_vision = vision.is_vision(source)
    if attn is not None and (is_vision or source.endswith(".py")):
        raise ModelFileError(f"{source}: --attn sets a Hugging Face model's attention "
                             "implementation; a model file or a timm/torchvision model builds "
                             "its own")
    if weights_dtype is not None and (is_vision or source.endswith(".py")):
        raise ModelFileError(f"{source}: --weights-dtype sets the dtype a Hugging Face model "
                             "loads in; a model file or a timm/torchvision model builds its own "
                             "(cast it in build_model, or train with --precision bf16-pure)")
    if (task or seq_len) and is_vision:
        raise ModelFileError(f"{source}: --task and --seq-len apply to Hugging Face models; "
                             "an image model takes --image-size and --num-classes")
    if (image_size or num_classes) and source.endswith(".py"):
        raise ModelFileError(f"{source}: --image-size and --num-classes apply to timm:, "
                             "torchvision: and Hugging Face image models; a model file makes "
                             "its own batch in make_batch(batch_size)")
    if is_vision:
        spec = vision.load_vision(source, image_size, num_classes)
    elif source.endswith(".py") or (os.path.isfile(source) and not source.endswith(".json")):
        if task or seq_len:
            raise ModelFileError(f"{source}: --task and --seq-len apply to Hugging Face models; "
                                 "a model file makes its own batch in make_batch(batch_size)")
        spec = load_model_file(source)
    else:
        spec = huggingface.load_hf(source, task, seq_len, image_size, num_classes, attn,
                                   weights_dtype)
    keep = spec.keep_outputs or keep_outputs
    return dataclasses.replace(spec, adapters=adapters, keep_outputs=keep,
                               origin=(source, task, seq_len, image_size, num_classes, keep,
                                       attn, weights_dtype))


def for_process(spec: ModelSpec, start_method: str) -> ModelSpec | tuple:
    """What a child process needs to have ``spec`` (see :func:`in_process`): a forked child
    inherits the spec itself; a spawned one gets load_model's arguments, since the spec's
    closures do not pickle."""
    if start_method == "fork":
        return spec
    if spec.origin is None:
        raise ModelFileError(f"{spec.name} was not loaded from a file or a Hugging Face id, so "
                             "a spawned process cannot rebuild it; run it in one process")
    return spec.origin, spec.adapters


def command_line(spec: ModelSpec) -> str:
    """The MODEL argument and the options that built ``spec`` (--task, --seq-len, ...), as a
    suggested command needs them to rebuild the same model (adapters excluded: the suggestion
    says its own)."""
    if spec.origin is None:
        return spec.path
    source, task, seq_len, image_size, num_classes, keep, attn, dtype = spec.origin
    flags = [("--task", task), ("--seq-len", seq_len), ("--image-size", image_size),
             ("--num-classes", num_classes), ("--attn", attn), ("--weights-dtype", dtype)]
    return " ".join([shlex.quote(source)] + [f"{k} {v}" for k, v in flags if v is not None]
                    + (["--keep-outputs"] if keep else []))


def in_process(source: ModelSpec | tuple) -> ModelSpec:
    """The spec in a child process, from :func:`for_process`."""
    if isinstance(source, ModelSpec):
        return source
    (path, task, seq_len, image_size, num_classes, keep, attn, dtype), adapters = source
    return load_model(path, task=task, seq_len=seq_len, adapters=adapters,
                      image_size=image_size, num_classes=num_classes, keep_outputs=keep,
                      attn=attn, weights_dtype=dtype)


def load_model_file(path: str) -> ModelSpec:
    """Import ``path`` as a fresh module and pick out the protocol's functions."""
    if not os.path.exists(path):
        raise ModelFileError(f"{path}: no such file; pass the path of a Python model file "
                             "(see `oomdoctor probe --help` for the protocol)")
    if os.path.isdir(path) or not path.endswith(".py"):
        raise ModelFileError(f"{path}: not a Python file; pass a .py file that defines "
                             "build_model() and make_batch(batch_size)")
    # A unique module name so two loads of the same file (or two files named model.py) never
    # share state through sys.modules.
    mod_name = f"oomdoctor_model_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    # Let the file import its neighbours, as `python model.py` would.
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ModelFileError(f"{path}:{e.lineno}: syntax error: {e.msg}; fix the file so "
                             f"`python {path}` runs") from e
    except Exception as e:  # anything the file's top level raises
        if moves_to_gpu(e):
            # It runs on a GPU machine; it is the top level's .cuda() that needs one here.
            where = user_frame(e)
            raise ModelFileError(
                f"{path}: importing the file moves tensors to the GPU"
                + (f" at {where}" if where else "") + f" ({type(e).__name__}: {first_line(e)}), "
                "which needs a GPU this machine does not have; build tensors inside "
                "build_model/make_batch without .cuda() (oomdoctor places them), or run on a "
                "GPU machine with --device cuda") from e
        raise ModelFileError(f"{path}: importing the file raised {type(e).__name__}: {e}; "
                             f"fix the file so `python {path}` runs") from e
    finally:
        sys.path.remove(folder)

    def required(name: str, signature: str) -> Callable:
        fn = getattr(module, name, None)
        if fn is None:
            raise ModelFileError(f"{path}: no `{name}` function; define `def {signature}:` "
                                 "(see the model-file protocol in `oomdoctor probe --help`), or "
                                 "if it is a training script, run it as it is: `oomdoctor "
                                 f"estimate -- python {path} ARGS`")
        if not callable(fn):
            raise ModelFileError(f"{path}: `{name}` is a {type(fn).__name__}, not a function; "
                                 f"define `def {signature}:`")
        return fn

    def optional(name: str, nargs: int) -> Callable | None:
        fn = getattr(module, name, None)
        if fn is None:
            return None
        if not callable(fn):
            raise ModelFileError(f"{path}: `{name}` is a {type(fn).__name__}, not a function")
        try:
            inspect.signature(fn).bind(*([None] * nargs))
        except TypeError as e:
            raise ModelFileError(f"{path}: `{name}` must take {nargs} argument(s): {e}") from e
        except ValueError:  # builtins without a signature
            pass
        return fn

    return ModelSpec(
        path=path,
        build_model=required("build_model", "build_model() -> torch.nn.Module"),
        make_batch=required("make_batch", "make_batch(batch_size: int)"),
        loss_fn=optional("loss_fn", 2),
        make_optimizer=optional("make_optimizer", 1),
        keep_outputs=bool(getattr(module, "KEEP_OUTPUTS", False)),
    )
