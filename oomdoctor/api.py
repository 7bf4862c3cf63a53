"""The Python API: ``oomdoctor.estimate`` and ``oomdoctor.probe`` for notebooks and scripts.

    import oomdoctor
    e = oomdoctor.estimate("sample_models/gpt2_small.py", batch_size=8, precision="bf16")
    print(e.fits, e.peak_reserved_bytes)
    r = oomdoctor.probe(lambda: MyNet(), lambda b: torch.randn(b, 3, 224, 224), gpu="rtx3090")
    e = oomdoctor.estimate(script="train.py", args=["--lr", "3e-4"], gpu="rtx3090")

``model`` is anything the command line accepts (a model file, a Hugging Face id or config
folder), a :class:`oomdoctor.models.spec.ModelSpec`, or a zero-argument factory of an
``nn.Module`` together with ``batch`` (a factory of one batch from its size). Or, instead of a
model, ``script=`` a training script and ``args=`` its arguments: it runs as it is on a fake GPU
(``oomdoctor estimate -- python train.py ARGS``); its prints go where it prints them. The results are
the objects the CLI renders (``Estimate``, ``ProbeResult``), with bytes as ints and ``to_json()``.
Nothing is printed.
"""
from __future__ import annotations

from typing import Any, Callable

from oomdoctor.sim.gpus import card_for_arch, get_profile


def _spec(model: Any, batch: Callable[[int], Any] | None, loss_fn: Callable | None,
          task: str | None, seq_len: int | None, lora: int | None,
          lora_targets: tuple[str, ...] | None, quantize: str | None,
          image_size: int | None = None, num_classes: int | None = None,
          attn: str | None = None, weights_dtype: str | None = None):
    """The ModelSpec, trained with LoRA (QLoRA with ``quantize``) when ``lora`` is a rank."""
    import dataclasses
    spec = _base_spec(model, batch, loss_fn, task, seq_len, image_size, num_classes, attn,
                      weights_dtype)
    if lora is None:
        if quantize or lora_targets:
            raise ValueError("quantize= and lora_targets= need lora=RANK")
        return spec
    from oomdoctor.models.adapters import Adapters
    return dataclasses.replace(spec, adapters=Adapters(
        lora, tuple(lora_targets) if lora_targets else None, quantize=quantize))


def _base_spec(model: Any, batch: Callable[[int], Any] | None, loss_fn: Callable | None,
               task: str | None, seq_len: int | None, image_size: int | None,
               num_classes: int | None, attn: str | None = None,
               weights_dtype: str | None = None):
    from oomdoctor.models.loader import load_model
    from oomdoctor.models.spec import ModelSpec
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return load_model(model, task=task, seq_len=seq_len, image_size=image_size,
                          num_classes=num_classes, attn=attn, weights_dtype=weights_dtype)
    if callable(model):
        if batch is None:
            raise ValueError("a model factory needs batch=, a function of the batch size that "
                             "returns one batch (a tensor, tuple or dict of tensors)")
        name = getattr(model, "__name__", "model")
        return ModelSpec(path=f"<{name}>", build_model=model, make_batch=batch,
                         loss_fn=loss_fn, make_optimizer=None,
                         label=name if name != "<lambda>" else "model")
    raise TypeError(f"model must be a path, a Hugging Face id, a ModelSpec or a factory of an "
                    f"nn.Module, not {type(model).__name__}")


def _budget(gpu: str | None, memory: int | None, margin: float, overhead: int | None,
            other: int, arch: str | None = None):
    from oomdoctor.plans.estimate import Budget
    if gpu and memory:
        raise ValueError("give gpu= or memory=, not both")
    if arch and not memory:
        raise ValueError("arch= goes with memory= (a gpu= profile has its own architecture)")
    card = card_for_arch(memory, arch) if memory else get_profile(gpu or "rtx3090")
    return Budget(card, margin, overhead, other)


def _script(script: str, args: Any, model: Any):
    """The ScriptSpec of ``script=`` / ``args=`` (and no model)."""
    from oomdoctor.models.script import parse_command
    if model is not None:
        raise ValueError("give a model or script=, not both")
    if isinstance(args, str):
        raise TypeError("args= is a list of the script's arguments, e.g. ['--lr', '3e-4']")
    return parse_command(["python", script, *map(str, args)])


def _version(text: str | None):
    """``torch=`` as a TorchVersion (None: the installed torch)."""
    from oomdoctor.sim.versions import parse_version
    return parse_version(text) if text else None


def _granularity(checkpointing: bool | None, every: int, policy: str) -> dict:
    """TraceConfig's checkpoint_every and checkpoint_policy; a ValueError when they are given
    with checkpointing off."""
    if checkpointing is False and (every, policy) != (1, "full"):
        raise ValueError("checkpoint_every and checkpoint_policy say how checkpointing wraps "
                         "the blocks, and checkpointing is off: pass checkpointing=True")
    return {"checkpoint_every": every, "checkpoint_policy": policy}


def _default_zero_grad(version) -> str:
    from oomdoctor.sim.versions import default_zero_grad
    return default_zero_grad(version)


def estimate(model: Any = None, batch_size: int | None = None, *,
             script: str | None = None, args: Any = (), steps: int = 2,
             batch: Callable[[int], Any] | None = None,
             loss_fn: Callable | None = None, precision: str = "fp32",
             checkpointing: bool = False, checkpoint_class: str | None = None,
             grad_accum: int = 1, optimizer: str | None = None, gpu: str | None = None,
             memory: int | None = None, margin: float = 0.05, overhead: int | None = None,
             other: int = 0, alloc_conf: str = "", task: str | None = None,
             seq_len: int | None = None, zero_grad: str | None = None,
             lora: int | None = None, lora_targets: tuple[str, ...] | None = None,
             quantize: str | None = None, arch: str | None = None,
             image_size: int | None = None, num_classes: int | None = None,
             torch: str | None = None, attn: str | None = None, checkpoint_every: int = 1,
             checkpoint_policy: str = "full", weights_dtype: str | None = None):
    """Peak GPU memory of one training configuration (``oomdoctor estimate``): an
    :class:`oomdoctor.plans.estimate.Estimate`. ``gpu`` is a profile name (default rtx3090) or
    ``memory`` a card's capacity in bytes; ``overhead`` and ``other`` are bytes too.
    ``lora=RANK`` (with ``lora_targets=`` names, ``quantize="nf4"``) trains LoRA/QLoRA;
    ``arch="sm89"`` gives a ``memory=`` card its architecture; ``image_size`` and
    ``num_classes`` shape a ``"timm:NAME"`` / ``"torchvision:NAME"`` model's batch and head.
    ``script=`` (with ``args=``) runs a training script instead, for ``steps`` optimizer steps;
    ``batch_size`` then sets its DataLoaders' (and ``{batch}``), ``seq_len`` its ``{seq}``,
    and the options of a model file's loop (precision, checkpointing, ...) do not apply.
    ``torch="2.3.1"`` models that release's CUDA facts (``--torch``; default: the installed
    torch), and ``zero_grad`` then defaults to what its ``optimizer.zero_grad()`` does.
    ``attn`` sets a Hugging Face model's attention implementation (``--attn``),
    ``weights_dtype`` the dtype its weights load in (``--weights-dtype``).
    ``checkpoint_every=N`` and ``checkpoint_policy="op"`` say how ``checkpointing=True``
    wraps the blocks (``--checkpoint-every``, ``--checkpoint-policy``)."""
    from oomdoctor.plans import estimate as estimate_mod
    from oomdoctor.sim.allocator import AllocatorConfig
    from oomdoctor.sim.trace import TraceConfig
    alloc = AllocatorConfig.from_env(alloc_conf) if alloc_conf else AllocatorConfig()
    version = _version(torch)
    if script is not None:
        return estimate_mod.estimate_script(
            _script(script, args, model), TraceConfig(batch_size or 1, steps=steps,
                                                      torch=version),
            _budget(gpu, memory, margin, overhead, other, arch), alloc, batch_size=batch_size,
            seq_len=seq_len)
    if model is None or batch_size is None:
        raise ValueError("estimate() needs a model and batch_size=, or script=")
    spec = _spec(model, batch, loss_fn, task, seq_len, lora, lora_targets, quantize,
                 image_size, num_classes, attn, weights_dtype)
    cfg = TraceConfig(batch_size, precision, checkpointing, checkpoint_class, grad_accum,
                      optimizer, zero_grad=zero_grad or _default_zero_grad(version),
                      steps=steps, torch=version,
                      **_granularity(checkpointing, checkpoint_every, checkpoint_policy))
    budget = _budget(gpu, memory, margin, overhead, other, arch)
    return estimate_mod.estimate(spec, cfg, budget, alloc)


def probe(model: Any = None, batch: Callable[[int], Any] | None = None, *,
          script: str | None = None, args: Any = (),
          loss_fn: Callable | None = None, precisions: tuple[str, ...] | None = None,
          checkpointing: bool | None = None, checkpoint_class: str | None = None,
          grad_accum: int = 1, optimizer: str | None = None, gpu: str | None = None,
          memory: int | None = None, margin: float = 0.05, overhead: int | None = None,
          other: int = 0, alloc_conf: str = "", task: str | None = None,
          seq_len: int | None = None, jobs: int = 1, max_batch_size: int | None = None,
          progress: Callable[[str], None] | None = None, lora: int | None = None,
          lora_targets: tuple[str, ...] | None = None, quantize: str | None = None,
          arch: str | None = None, image_size: int | None = None,
          num_classes: int | None = None, torch: str | None = None, attn: str | None = None,
          checkpoint_every: int = 1, checkpoint_policy: str = "full",
          weights_dtype: str | None = None):
    """The largest batch that fits per precision x checkpointing (``oomdoctor probe``): a
    :class:`oomdoctor.plans.probe.ProbeResult`; ``oomdoctor.plans.probe.recommended(result)``
    picks the configuration to train with. ``progress`` hears one line per step of the search;
    ``lora=RANK`` (``lora_targets=``, ``quantize=``), ``image_size`` and ``num_classes`` as
    in :func:`estimate`. ``script=`` (with ``args=``): the largest batch a training script
    fits, by running it (a :class:`oomdoctor.plans.script_probe.ScriptProbe`). ``torch=``,
    ``weights_dtype=``, ``checkpoint_every=`` and ``checkpoint_policy=`` as in :func:`estimate` (the latter two
    for the checkpointed configurations)."""
    from oomdoctor.plans import probe as probe_mod
    from oomdoctor.sim.allocator import AllocatorConfig
    from oomdoctor.configs import MAX_BATCH
    from oomdoctor.sim.trace import TraceConfig
    if script is not None:
        from oomdoctor.plans.script_probe import probe_script
        alloc = AllocatorConfig.from_env(alloc_conf) if alloc_conf else AllocatorConfig()
        return probe_script(_script(script, args, model), TraceConfig(1, torch=_version(torch)),
                            _budget(gpu, memory, margin, overhead, other, arch), alloc,
                            max_batch=max_batch_size or MAX_BATCH, seq_len=seq_len,
                            progress=progress)
    if model is None:
        raise ValueError("probe() needs a model, or script=")
    spec = _spec(model, batch, loss_fn, task, seq_len, lora, lora_targets, quantize,
                 image_size, num_classes, attn, weights_dtype)
    budget = _budget(gpu, memory, margin, overhead, other, arch)
    configs = probe_mod.matrix(budget.gpu, precisions or (), checkpointing)
    version = _version(torch)
    base = TraceConfig(1, "fp32", False, checkpoint_class, grad_accum, optimizer,
                       zero_grad=_default_zero_grad(version), torch=version,
                       **_granularity(checkpointing, checkpoint_every, checkpoint_policy))
    alloc = AllocatorConfig.from_env(alloc_conf) if alloc_conf else AllocatorConfig()
    return probe_mod.probe(spec, base, budget, configs, alloc,
                           progress=progress or (lambda _: None),
                           max_batch=max_batch_size or MAX_BATCH, jobs=jobs)
