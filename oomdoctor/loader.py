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
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch


class ModelFileError(Exception):
    """The model file is missing, broken, or does not follow the protocol."""


@dataclass(frozen=True)
class ModelSpec:
    """The protocol's functions, loaded from one file."""

    path: str
    build_model: Callable[[], torch.nn.Module]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None
    label: str | None = None           # the name to show, when not the file's (Hub ids, configs)
    adapters: Any = None               # LoRA / 4-bit weights (oomdoctor.adapters.Adapters)
    origin: tuple | None = None        # load_model's arguments, to rebuild it in a new process

    @property
    def name(self) -> str:
        base = self.label or os.path.splitext(os.path.basename(self.path))[0]
        return base + (self.adapters.label if self.adapters is not None else "")


def load_model(source: str, *, task: str | None = None, seq_len: int | None = None,
               adapters: Any = None, image_size: int | None = None,
               num_classes: int | None = None) -> ModelSpec:
    """A model file (``.py``), a Hugging Face id / config folder / ``config.json`` (``task``
    and ``seq_len`` apply to those; ``image_size`` and ``num_classes`` to its image
    classifiers), or ``timm:NAME`` / ``torchvision:NAME`` (``image_size``, ``num_classes``);
    see :mod:`oomdoctor.sources`. ``adapters``
    (:class:`oomdoctor.adapters.Adapters`): train it with LoRA / on 4-bit weights."""
    from oomdoctor import sources
    vision = sources.is_vision(source)
    if (task or seq_len) and vision:
        raise ModelFileError(f"{source}: --task and --seq-len apply to Hugging Face models; "
                             "an image model takes --image-size and --num-classes")
    if (image_size or num_classes) and source.endswith(".py"):
        raise ModelFileError(f"{source}: --image-size and --num-classes apply to timm:, "
                             "torchvision: and Hugging Face image models; a model file makes "
                             "its own batch in make_batch(batch_size)")
    if vision:
        spec = sources.load_vision(source, image_size, num_classes)
    elif source.endswith(".py") or (os.path.isfile(source) and not source.endswith(".json")):
        if task or seq_len:
            raise ModelFileError(f"{source}: --task and --seq-len apply to Hugging Face models; "
                                 "a model file makes its own batch in make_batch(batch_size)")
        spec = load_model_file(source)
    else:
        spec = sources.load_hf(source, task, seq_len, image_size, num_classes)
    return dataclasses.replace(spec, adapters=adapters,
                               origin=(source, task, seq_len, image_size, num_classes))


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


def in_process(source: ModelSpec | tuple) -> ModelSpec:
    """The spec in a child process, from :func:`for_process`."""
    if isinstance(source, ModelSpec):
        return source
    (path, task, seq_len, image_size, num_classes), adapters = source
    return load_model(path, task=task, seq_len=seq_len, adapters=adapters,
                      image_size=image_size, num_classes=num_classes)


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
        raise ModelFileError(f"{path}: importing the file raised {type(e).__name__}: {e}; "
                             f"fix the file so `python {path}` runs") from e
    finally:
        sys.path.remove(folder)

    def required(name: str, signature: str) -> Callable:
        fn = getattr(module, name, None)
        if fn is None:
            raise ModelFileError(f"{path}: no `{name}` function; define `def {signature}:` "
                                 "(see the model-file protocol in `oomdoctor probe --help`)")
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
    )


def build_checked_model(spec: ModelSpec) -> torch.nn.Module:
    """Call ``build_model()`` and check what it returns."""
    model = _call(spec, "build_model", spec.build_model)
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(f"{spec.path}: build_model() returned {type(model).__name__}, "
                             "expected a torch.nn.Module; return the model instance")
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelFileError(f"{spec.path}: build_model() returned a model with no trainable "
                             "parameters; there is nothing to train (set requires_grad=True on "
                             "the parameters to fine-tune)")
    return model


def make_checked_batch(spec: ModelSpec, batch_size: int) -> Any:
    """Call ``make_batch(batch_size)`` and check it returns tensors."""
    batch = _call(spec, "make_batch", spec.make_batch, batch_size)
    leaves = batch.values() if isinstance(batch, dict) else (
        batch if isinstance(batch, (tuple, list)) else [batch])
    if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
        raise ModelFileError(f"{spec.path}: make_batch({batch_size}) returned "
                             f"{_describe(batch)}; return a tensor, a tuple of tensors or a dict "
                             "of tensors")
    return batch


def compute_loss(spec: ModelSpec, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The protocol's loss: ``loss_fn(model, batch)`` or the model's own output."""
    if spec.loss_fn is not None:
        out = _call(spec, "loss_fn", spec.loss_fn, model, batch)
        where = "loss_fn(model, batch)"
    else:
        if isinstance(batch, dict):
            how, args, kwargs = (f"model(**batch) with the keys {', '.join(map(str, batch))}",
                                 (), batch)
        elif isinstance(batch, (tuple, list)):
            how, args, kwargs = f"model(*batch) with {len(batch)} tensors", tuple(batch), {}
        else:
            how, args, kwargs = "model(batch) with one tensor", (batch,), {}
        try:
            inspect.signature(model.forward).bind(*args, **kwargs)
        except TypeError as e:
            # The batch does not fit forward's signature: say how oomdoctor called it.
            raise ModelFileError(
                f"{spec.path}: without loss_fn, oomdoctor calls {how} (what make_batch "
                f"returns), which forward does not take ({e}); define loss_fn(model, batch) "
                "to call the model your way and return the loss") from e
        except ValueError:          # no signature to check (a builtin): just call it
            pass
        out = _call(spec, "model.forward", lambda: model(*args, **kwargs))
        where = "the model's output"
        if not isinstance(out, torch.Tensor) and hasattr(out, "loss"):
            out = out.loss
    if not isinstance(out, torch.Tensor):
        raise ModelFileError(f"{spec.path}: {where} is {_describe(out)}, not a tensor; define "
                             "loss_fn(model, batch) returning a scalar loss")
    if out.dim() != 0:
        raise ModelFileError(f"{spec.path}: {where} has shape {tuple(out.shape)}, expected a "
                             "scalar loss; reduce it (e.g. .mean()) or define loss_fn(model, batch)")
    return out


def make_optimizer(spec: ModelSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The file's optimizer, or AdamW over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if spec.make_optimizer is None:
        return torch.optim.AdamW(params, lr=1e-4)
    opt = _call(spec, "make_optimizer", spec.make_optimizer, model.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        raise ModelFileError(f"{spec.path}: make_optimizer(params) returned "
                             f"{_describe(opt)}; return a torch.optim.Optimizer")
    return opt


def make_configured_optimizer(spec: ModelSpec, model: torch.nn.Module,
                              override: str | None = None) -> torch.optim.Optimizer:
    """The ``--optimizer`` override if given, else the file's optimizer (or AdamW)."""
    if override:
        from oomdoctor import optimizers
        return optimizers.build_optimizer(override, model)
    return make_optimizer(spec, model)


# --- one training configuration, the same for the trace, the measured probe and the smoke run --

def build_for_training(spec: ModelSpec, precision: str = "fp32", checkpointing: bool = False,
                       checkpoint_class: str | None = None, *, preserve_rng_state: bool = True,
                       notes: list[str] | None = None
                       ) -> tuple[torch.nn.Module, tuple[str, ...]]:
    """The file's model as a configuration trains it, under the caller's device or fake-tensor
    context: in train mode, cast to bf16 for pure bf16, LoRA/4-bit weights if the spec asks,
    repeated blocks checkpointed. Returns the model and the checkpointed blocks' names; what
    the adapters did is appended to ``notes``."""
    model = build_checked_model(spec)
    model.train()
    if precision == "bf16-pure":
        to_dtype(model, torch.bfloat16)
    if spec.adapters is not None:
        from oomdoctor import adapters
        model, said = adapters.adapt(model, spec.adapters, precision)
        if notes is not None:
            notes += said
    checkpointed: tuple[str, ...] = ()
    if checkpointing:
        from oomdoctor.checkpointing import apply_checkpointing
        checkpointed = apply_checkpointing(model, checkpoint_class,
                                           preserve_rng_state=preserve_rng_state)
    return model, checkpointed


def make_configured_batch(spec: ModelSpec, batch_size: int, precision: str = "fp32") -> Any:
    """The file's batch; pure bf16 feeds bf16 inputs."""
    batch = make_checked_batch(spec, batch_size)
    return cast_floats(batch, torch.bfloat16) if precision == "bf16-pure" else batch


def to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` that keeps tied weights tied. (Module.to swaps tensors in place for
    fake tensors, which refuses tensors that have weakrefs; rebuilding the Parameters avoids it.)"""
    memo: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for store, wrap in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in store.items():
                if t is None or not t.is_floating_point():
                    continue
                if id(t) not in memo:
                    new = t.detach().to(dtype)
                    memo[id(t)] = torch.nn.Parameter(new, t.requires_grad) if wrap else new
                store[name] = memo[id(t)]


class DataDependentError(ModelFileError):
    """The step asked a question only real data can answer (``.item()``, ``bool(t)``, a
    data-dependent shape). The trace retries with the batch's real values (oomdoctor.values)
    before this reaches the user."""


# Errors raised by fake tensors when the file does something only real data can answer.
_DATA_DEPENDENT = ("DataDependentOutputException", "DynamicOutputShapeException",
                   "GuardOnDataDependentSymNode", "UnsupportedOperatorException")


# What moving a fake/meta tensor to CUDA raises: a CPU-only build, or a meta tensor's copy.
_TO_CUDA_TEXT = ("Torch not compiled with CUDA enabled", "Cannot copy out of meta tensor",
                 "Found no NVIDIA driver")

_DATA_DEPENDENT_TEXT = ("data-dependent", "item()", "on meta tensors", "register_meta",
                        "nonzero", "masked_select", "unique")


def _call(spec: ModelSpec, name: str, fn: Callable, *args: Any) -> Any:
    try:
        return fn(*args)
    except ModelFileError:
        raise
    except Exception as e:
        kind = type(e).__name__
        text = str(e)
        # Fake CPU tensors raise DataDependentOutputException & co; meta tensors raise
        # "Tensor.item() cannot be called on meta tensors" or an unimplemented meta kernel
        # for ops whose output shape depends on the data (nonzero, masked_select, unique).
        if any(s in text for s in _TO_CUDA_TEXT):
            raise ModelFileError(
                f"{spec.path}: {name} moves tensors to the GPU ({kind}: {first_line(e)}); "
                "oomdoctor places the model and the batch itself (on fake tensors, or on the "
                "GPU with --device cuda): remove .cuda() / .to('cuda') / device='cuda' from "
                "build_model and make_batch") from e
        if kind in _DATA_DEPENDENT or any(s in text for s in _DATA_DEPENDENT_TEXT):
            raise DataDependentError(
                f"{spec.path}: {name} uses a value computed from tensor data ({kind}: "
                f"{first_line(e)}), which a fake-tensor trace cannot follow; remove "
                ".item()/.tolist()/data-dependent shapes from the training step") from e
        # the CLI adds "(--debug for the traceback)" to every such error
        raise ModelFileError(f"{spec.path}: {name} raised {kind}: {first_line(e)}") from e


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


def _describe(obj: Any) -> str:
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {', '.join(type(x).__name__ for x in obj[:4]) or 'nothing'}"
    return "None" if obj is None else f"a {type(obj).__name__}"


def cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    """A batch (tensor, tuple/list or dict) with its floating tensors cast to ``dtype``
    (pure bf16 feeds bf16 inputs); integer tensors such as token ids are left alone."""
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    if isinstance(batch, dict):
        return {k: cast(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(cast(t) for t in batch)
    return cast(batch)
