"""The probe's result as text: the configuration matrix with its breakdowns, what
checkpointing bought, and the configuration to train with (``oomdoctor probe``'s output)."""
from __future__ import annotations

from oomdoctor.configs import PURE_QUALITY, checkpointing_label
from oomdoctor.plans.probe import (CKPT_WORTH, CheckpointingEffect, ProbeResult,
                                   checkpointing_effect, recommended)


def render_table(r: ProbeResult) -> str:
    """The configuration matrix as a table, with the breakdown at each maximum."""
    from tabulate import tabulate

    from oomdoctor.sim.allocator import format_size

    def gib(n: int) -> str:
        return f"{n / 2**30:.2f}"

    rows = []
    for c in r.results:
        e = c.estimate
        label = c.precision + (" + ckpt" if c.checkpointing else "")
        if c.error:
            rows.append((label, "-", *[""] * 7, c.error))
            continue
        best = "none" if c.max_batch_size is None else (
            f">= {c.max_batch_size}" if c.capped else str(c.max_batch_size))
        if e is None:     # a multi-GPU strategy: the fullest GPU's peak
            pg = c.per_gpu
            rows.append((label, best, gib(pg.peak_device_bytes), *[""] * 6,
                         f"{pg.strategy} x{pg.num_gpus}, fullest GPU incl. context "
                         f"({sum(t.method == 'traced' for t in c.trials)} traces)"))
            continue
        b = e.breakdown
        rows.append((label, best, gib(e.peak_reserved_bytes), gib(b["parameters"]),
                     gib(b["gradients"]), gib(b["optimizer_state"]),
                     gib(b["activations"]), gib(b["temporaries"]),
                     gib(b["allocator_overhead"]), f"{e.peak_phase} "
                     f"({sum(t.method == 'traced' for t in c.trials)} traces)"))
    head = (f"{r.model} on {r.gpu}: {format_size(r.device_total_bytes)} capacity, "
            f"{format_size(r.budget_bytes)} for the allocator after the CUDA context and a "
            f"{r.margin:.0%} margin; PYTORCH_CUDA_ALLOC_CONF "
            + (f"={r.allocator}" if r.allocator else "unset (PyTorch's defaults)"))
    table = tabulate(rows, headers=("config", "max batch", "reserved", "params", "grads",
                                    "optim", "activ", "temp", "alloc ovh", "peak in"),
                     colalign=("left", "right") + ("right",) * 7 + ("left",))
    text = f"{head}\n{table}\n(GiB at the largest batch that fits; at batch 1 when none fits)"
    ck = checkpointing_effect(r)
    if ck is not None:
        text += "\n" + render_checkpointing(ck)
    return text


def render_checkpointing(ck: CheckpointingEffect) -> str:
    how = checkpointing_label(ck.every, ck.policy)
    line = (f"ckpt: {ck.blocks} blocks of class {ck.block_class} (--checkpoint-class NAME for "
            "others" + (f"; {how}" if how != "checkpointing" else "") + ")")
    if ck.frees:
        line += "; frees " + ", ".join(f"{f:.0%} in {p}" for p, f in ck.frees) + \
            " of the activations per sample"
        if max(f for _, f in ck.frees) < CKPT_WORTH:
            line += (f"\nwarning: checkpointing {ck.block_class} frees under "
                     f"{CKPT_WORTH:.0%} of the activations: it costs about a third more compute "
                     "for almost nothing; name larger blocks with --checkpoint-class")
    return line


def render_recommendation(r: ProbeResult) -> str:
    """The configuration to train with on one card, what it costs and what would buy more."""
    best = recommended(r)
    if best is None:
        return ("recommended: nothing fits one card, even at batch 1 - see "
                "`oomdoctor recommend` for sharding (ZeRO/FSDP) or a two-GPU split"
                + ("" if "LoRA r" in r.model else ", or train adapters: probe it again with "
                   "--lora 16 (and --quantize nf4 for QLoRA)"))
    name = {"fp32": "fp32", "fp16": "fp16 AMP (autocast + GradScaler)", "bf16": "bf16 AMP "
            "(autocast)", "bf16-pure": "pure bf16 (model.to(torch.bfloat16))",
            "fp16-pure": "pure fp16 (model.half(), no GradScaler)"}[best.precision]
    ckpt = " with activation checkpointing" if best.checkpointing else ""
    size = (f"at least {best.max_batch_size} (the search cap; --max-batch-size to search "
            "further)" if best.capped else f"{best.max_batch_size} (the largest that fits)")
    lines = [f"recommended: {name}{ckpt}, micro-batch {size}; reach a larger effective batch with gradient accumulation (no quality "
             "cost), and scale the learning rate with the effective batch"]
    if best.precision in PURE_QUALITY:      # ranked last: recommended when nothing else fits
        others = any(c.precision not in PURE_QUALITY for c in r.results)
        lines.append("  " + ("nothing that keeps fp32 master weights fits; " if others else "")
                     + PURE_QUALITY[best.precision])
    other = [c for c in r.results if c.precision == best.precision
             and c.checkpointing != best.checkpointing and c.max_batch_size]
    if other and not best.checkpointing and other[0].max_batch_size > best.max_batch_size:
        lines.append(f"  checkpointing would allow micro-batch {other[0].max_batch_size} at "
                     "about a third more compute per step")
    gain = r.allocator_gain
    if gain is not None:
        lines.append(f"  PYTORCH_CUDA_ALLOC_CONF={gain.setting} would allow micro-batch "
                     f"{gain.batch_size} instead of {gain.default_batch_size}, the same step with "
                     f"less fragmentation (allocator overhead {gain.overhead_bytes / 2**30:.2f} GiB there): set "
                     "it in the environment of the training run")
    return "\n".join(lines)
