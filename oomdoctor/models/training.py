"""One training configuration's model, batch, loss and optimizer, from a :class:`ModelSpec`.

The same calls build what the trace, the measured probe and the smoke run train: the model in
train mode (pure bf16/fp16, LoRA/4-bit weights, checkpointed blocks as configured), the batch, the
protocol's loss and the optimizer. A failure inside the user's functions becomes a one-line
:class:`ModelFileError` that names the function and the fix.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Callable, Iterator

import torch

from oomdoctor.models.casting import cast_floats, pure_dtype, to_dtype
from oomdoctor.models.spec import (DataDependentError, ModelFileError, ModelSpec, first_line,
                                   library_frame,
                                   moves_to_gpu, user_frame)


def build_checked_model(spec: ModelSpec) -> torch.nn.Module:
    """Call ``build_model()`` and check what it returns."""
    with placement_left_to_oomdoctor():
        model = _call(spec, "build_model", spec.build_model)
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(f"{spec.path}: build_model() returned {type(model).__name__}, "
                             "expected a torch.nn.Module; return the model instance")
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelFileError(f"{spec.path}: build_model() returned a model with no trainable "
                             "parameters; there is nothing to train (set requires_grad=True on "
                             "the parameters to fine-tune)")
    return model


@contextlib.contextmanager
def placement_left_to_oomdoctor() -> Iterator[None]:
    """A model file written for a GPU machine moves its model there in ``build_model``
    (``model.cuda()``, ``.to("cuda")``, ``.to("cuda", torch.bfloat16)``). oomdoctor places the
    model itself - fake tensors in a trace, the chosen device in a measured run - so those
    calls keep their dtype and drop the CUDA device. A tensor moved by hand still fails, named
    where it is (_moves_to_gpu_error)."""
    module = torch.nn.Module
    real_to, real_cuda = module.to, module.cuda

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is None or device.type != "cuda":
            return real_to(self, *args, **kwargs)
        return self if dtype is None else real_to(self, dtype, non_blocking=non_blocking)
    module.to = to
    module.cuda = lambda self, device=None: self
    try:
        yield
    finally:
        module.to, module.cuda = real_to, real_cuda


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
        from oomdoctor.models import optimizers
        return optimizers.build_optimizer(override, model)
    return make_optimizer(spec, model)



def build_for_training(spec: ModelSpec, precision: str = "fp32", checkpointing: bool = False,
                       checkpoint_class: str | None = None, *, preserve_rng_state: bool = True,
                       notes: list[str] | None = None, checkpoint_every: int = 1,
                       checkpoint_policy: str = "full"
                       ) -> tuple[torch.nn.Module, tuple[str, ...]]:
    """The file's model as a configuration trains it, under the caller's device or fake-tensor
    context: in train mode, cast to 16 bits for a pure precision, LoRA/4-bit weights if the spec asks,
    repeated blocks checkpointed (every ``checkpoint_every``-th, whole or per op:
    oomdoctor.models.checkpointing). Returns the model and the checkpointed blocks' names; what
    the adapters and the checkpointing did is appended to ``notes``."""
    model = build_checked_model(spec)
    model.train()
    pure = pure_dtype(precision)
    if pure is not None:
        to_dtype(model, pure)
    if spec.adapters is not None:
        from oomdoctor.models import adapters
        model, said = adapters.adapt(model, spec.adapters, precision)
        if notes is not None:
            notes += said
    checkpointed: tuple[str, ...] = ()
    if checkpointing:
        from oomdoctor.models import checkpointing as ckpt
        checkpointed = ckpt.apply_checkpointing(model, checkpoint_class,
                                                preserve_rng_state=preserve_rng_state,
                                                every=checkpoint_every, policy=checkpoint_policy)
        said = ckpt.granularity_note(checkpoint_every, checkpoint_policy,
                                     len(ckpt.find_repeated_blocks(model, checkpoint_class)))
        if notes is not None and said:
            notes.append(said)
        if notes is not None and _holds_batchnorm(model, checkpointed):
            notes.append(BATCHNORM_RECOMPUTED)
    return model, checkpointed


# torch.utils.checkpoint re-runs the block's forward in backward, in train mode, so a BatchNorm
# inside updates running_mean/running_var a second time per step (num_batches_tracked too):
# the statistics move with twice the momentum. Memory is unaffected; the model's eval numbers
# are not.
BATCHNORM_RECOMPUTED = (
    "checkpointed blocks hold BatchNorm: the recomputed forward updates its running statistics "
    "a second time each step (twice the momentum); keep BatchNorm outside the checkpointed "
    "blocks, halve its momentum, or save and restore running_mean/var around the backward")


def _holds_batchnorm(model: torch.nn.Module, blocks: tuple[str, ...]) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
               for name in blocks for m in model.get_submodule(name).modules())


def make_configured_batch(spec: ModelSpec, batch_size: int, precision: str = "fp32") -> Any:
    """The file's batch; a pure precision feeds 16-bit inputs (as ``model.half()`` scripts
    cast their float inputs)."""
    batch = make_checked_batch(spec, batch_size)
    pure = pure_dtype(precision)
    return cast_floats(batch, pure) if pure is not None else batch


# Errors raised by fake tensors when the file does something only real data can answer.
_DATA_DEPENDENT = ("DataDependentOutputException", "DynamicOutputShapeException",
                   "GuardOnDataDependentSymNode", "UnsupportedOperatorException")


_DATA_DEPENDENT_TEXT = ("data-dependent", "item()", "on meta tensors", "register_meta",
                        "nonzero", "masked_select", "unique")


def _call(spec: ModelSpec, name: str, fn: Callable, *args: Any) -> Any:
    try:
        return fn(*args)
    except (ModelFileError, torch.OutOfMemoryError):
        raise     # a real device's OOM is the measured probe's answer, not the file's fault
    except Exception as e:
        kind = type(e).__name__
        text = str(e)
        # Fake CPU tensors raise DataDependentOutputException & co; meta tensors raise
        # "Tensor.item() cannot be called on meta tensors" or an unimplemented meta kernel
        # for ops whose output shape depends on the data (nonzero, masked_select, unique).
        if moves_to_gpu(e):
            raise _moves_to_gpu_error(spec, name, e) from e
        if kind in _DATA_DEPENDENT or any(s in text for s in _DATA_DEPENDENT_TEXT):
            raise _data_dependent_error(spec, name, e) from e
        # the CLI adds "(--debug for the traceback)" to every such error
        raise ModelFileError(f"{spec.path}: {name} raised {kind}: {first_line(e)}") from e


def _data_dependent_error(spec: ModelSpec, name: str, e: BaseException) -> DataDependentError:
    """A question about tensor values the trace could not answer, blamed where it was asked: a
    library's own check (transformers 4.x's padding warning) is not the user's to remove."""
    what = f"{type(e).__name__}: {first_line(e)}"
    lib = library_frame(e)
    if lib is not None:
        package, where = lib
        version = getattr(sys.modules.get(package), "__version__", "")
        return DataDependentError(
            f"{spec.path}: {name}: {package} {version} asks about tensor values at {where} "
            f"({what}) on a tensor oomdoctor could not give the batch's values; this is "
            f"oomdoctor's gap, not your code's: please report it with the {package} version")
    where = user_frame(e)
    return DataDependentError(
        f"{spec.path}: {name} uses a value computed from tensor data"
        f"{f' at {where}' if where else ''} ({what}), which a fake-tensor trace cannot "
        "follow; remove .item()/.tolist()/data-dependent shapes from the training step")


def _moves_to_gpu_error(spec: ModelSpec, name: str, e: BaseException) -> ModelFileError:
    """A ``.cuda()`` in the user's code, named where it is, with the fix for that place:
    build_model and make_batch leave placement to oomdoctor; code that runs inside the step
    (forward, a loss) makes its tensors on its inputs' device."""
    where = user_frame(e)
    at = f" at {where}" if where else ""
    if name in ("build_model", "make_batch"):
        fix = ("oomdoctor places the model and the batch itself (on fake tensors, or on the "
               f"GPU with --device cuda): remove .cuda() / .to('cuda') / device='cuda' from "
               f"{name}")
    else:
        fix = ("code that runs in the training step should make its tensors where its inputs "
               "are: device=x.device or .to(x.device) instead of .cuda() / device='cuda', "
               "which also keeps it right on any GPU index")
    return ModelFileError(f"{spec.path}: {name} moves tensors to the GPU{at} "
                          f"({type(e).__name__}: {first_line(e)}); {fix}")


def _describe(obj: Any) -> str:
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {', '.join(type(x).__name__ for x in obj[:4]) or 'nothing'}"
    return "None" if obj is None else f"a {type(obj).__name__}"
