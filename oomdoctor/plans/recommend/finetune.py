"""Parameter-efficient fine-tuning as a remedy: when full fine-tuning fits nowhere, what LoRA and
QLoRA need on one card, else sharded over the machine's GPUs, traced with the real peft and
bitsandbytes (oomdoctor.models.adapters).

The configuration is the recipes': rank 16, AMP in the card's 16-bit type, activation
checkpointing, micro-batch 1 (reach the batch with gradient accumulation). LoRA is traced first;
QLoRA (nf4) only when LoRA does not fit - one or two traces, not a search.
"""
from __future__ import annotations

import dataclasses

from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.plans.estimate import Budget, allocator_conf_string, estimate
from oomdoctor.models.loader import command_line
from oomdoctor.models.spec import ModelFileError, ModelSpec
from oomdoctor.plans.recommend.facts import _Facts
from oomdoctor.plans.recommend.machine import Hardware
from oomdoctor.sim.trace import TraceConfig

RANK = 16


def _gpu_flag(hw: Hardware) -> str:
    """The card as the suggested command names it: --gpu NAME, or --memory for one known only
    by its capacity."""
    if hw.gpu.name == "custom":
        return f" --memory {hw.gpu.total_bytes}B"      # --memory refuses a bare number
    return f" --gpu {hw.gpu.name}"


def adapter_alternative(spec: ModelSpec, facts: _Facts, hw: Hardware, budget: Budget,
                        base: TraceConfig, alloc: AllocatorConfig, progress) -> str:
    """One line for "what would fit": LoRA's (else QLoRA's) traced peak on one GPU."""
    from oomdoctor.models.adapters import Adapters, missing_library
    try:
        import peft  # noqa: F401  (the trace needs it; say so here rather than fail there)
    except ImportError as e:
        frozen = facts.num_parameters * 2
        return (f"train adapters instead (LoRA): frozen bf16 weights are {frozen / 2**30:.1f} "
                "GiB, with gradients and optimizer state only for the adapters; "
                + missing_library("peft", "tracing it (--lora 16)", e))
    amp = "bf16" if hw.gpu.bf16 else "fp16"
    # A model without repeated blocks has nothing to checkpoint: trace it without.
    ck = facts.has_blocks or base.checkpoint_class is not None
    cfg = dataclasses.replace(base, batch_size=1, precision=amp, checkpointing=ck,
                              grad_accum=1)
    how = f"{amp}{', checkpointing' if ck else ''}"
    conf = allocator_conf_string(alloc)
    same = (f" --precision {amp}{' --checkpointing' if ck else ''} -b 1"
            + (f" --alloc-conf {conf}" if conf else ""))
    tried = []
    for quantize in (None, "nf4"):
        adapted = dataclasses.replace(spec, adapters=Adapters(RANK, quantize=quantize))
        kind = "QLoRA (nf4)" if quantize else "LoRA"
        progress(f"tracing {kind} r{RANK} at micro-batch 1 ({how})")
        try:
            e = estimate(adapted, cfg, budget, alloc)
            sharded = None if e.fits or hw.num_gpus < 2 else _sharded(adapted, cfg, hw, budget,
                                                                       alloc, progress)
        except (ModelFileError, ValueError) as err:   # e.g. no layer peft can adapt
            return f"train adapters instead (LoRA/QLoRA): could not be traced here ({err})"
        flags = f"--lora {RANK}" + (f" --quantize {quantize}" if quantize else "")
        model = f"{command_line(spec)}{_gpu_flag(hw)} {flags}"
        tried.append(f"{kind} {e.peak_reserved_bytes / 2**30:.1f} GiB")
        if e.fits:
            return (f"train adapters instead: {kind} r{RANK} ({how}, micro-batch 1) needs "
                    f"{e.peak_reserved_bytes / 2**30:.2f} GiB reserved on one {hw.gpu.name} "
                    f"(`oomdoctor estimate {model}{same}`; traced with peft/bitsandbytes); its "
                    f"largest batch: `oomdoctor probe {model}`; it changes what is trained")
        if sharded is not None and sharded.fits:
            return (f"train adapters instead: {kind} r{RANK} ({how}, micro-batch 1) does not "
                    f"fit one {hw.gpu.name} ({e.peak_reserved_bytes / 2**30:.2f} GiB reserved) "
                    f"but fits the {hw.num_gpus} under FSDP (zero3): "
                    f"{sharded.peak_device_bytes / 2**30:.2f} GiB on the fullest GPU "
                    f"(`oomdoctor parallel {model}{same} --gpus {hw.num_gpus} --strategy zero3`);"
                    " it changes what is trained")
    return (f"train adapters instead: does not fit one {hw.gpu.name} either at micro-batch 1 "
            f"({how}; {', '.join(tried)} reserved)")


def _sharded(adapted: ModelSpec, cfg: TraceConfig, hw: Hardware, budget: Budget,
             alloc: AllocatorConfig, progress):
    """The adapted model under zero3 (FSDP) over every GPU, as `parallel` estimates it."""
    from oomdoctor.plans.parallel import estimate_strategies, policy_applies
    progress(f"tracing it under FSDP on {hw.num_gpus} GPUs")
    report = estimate_strategies(adapted, cfg, budget, hw.num_gpus, ["zero3"], alloc,
                                 mixed_precision=policy_applies("zero3", cfg.precision))
    return report.estimates[0] if report.estimates else None
