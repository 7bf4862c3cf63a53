"""Parameter-efficient fine-tuning as a remedy: when full fine-tuning fits nowhere, what LoRA and
QLoRA need on one card, traced with the real peft and bitsandbytes (oomdoctor.models.adapters).

The configuration is the recipes': rank 16, AMP in the card's 16-bit type, activation
checkpointing, micro-batch 1 (reach the batch with gradient accumulation). LoRA is traced first;
QLoRA (nf4) only when LoRA does not fit - one or two traces, not a search.
"""
from __future__ import annotations

import dataclasses

from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.plans.estimate import Budget, estimate
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
        return f" --memory {hw.gpu.total_bytes}"
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
    tried = []
    for quantize in (None, "nf4"):
        adapted = dataclasses.replace(spec, adapters=Adapters(RANK, quantize=quantize))
        kind = "QLoRA (nf4)" if quantize else "LoRA"
        progress(f"tracing {kind} r{RANK} at micro-batch 1 ({how})")
        try:
            e = estimate(adapted, cfg, budget, alloc)
        except (ModelFileError, ValueError) as err:   # e.g. no layer peft can adapt
            return f"train adapters instead (LoRA/QLoRA): could not be traced here ({err})"
        flags = f"--lora {RANK}" + (f" --quantize {quantize}" if quantize else "")
        tried.append(f"{kind} {e.peak_reserved_bytes / 2**30:.1f} GiB")
        if e.fits:
            return (f"train adapters instead: {kind} r{RANK} ({how}, "
                    f"micro-batch 1) needs {e.peak_reserved_bytes / 2**30:.1f} GiB on one "
                    f"{hw.gpu.name} (traced with peft/bitsandbytes); find its largest batch "
                    f"with `oomdoctor probe {command_line(spec)}{_gpu_flag(hw)} {flags}`; it "
                    "changes what is trained")
    return (f"train adapters instead: does not fit one {hw.gpu.name} either at micro-batch 1 "
            f"({how}; {', '.join(tried)} reserved)")
