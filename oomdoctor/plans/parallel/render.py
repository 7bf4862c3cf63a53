"""Text of the `parallel` and `split` reports: per-GPU tables, sizes in GiB/MiB, block spans."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from oomdoctor.plans.parallel.results import prose_size

if TYPE_CHECKING:
    from oomdoctor.plans.parallel.report import ParallelReport, SplitPlan


def _unit(largest: int) -> tuple[Callable[[int], str], str]:
    """A column formatter and its unit for a table whose largest value is ``largest``."""
    if largest >= 2**30:
        return (lambda n: f"{n / 2**30:.2f}"), "GiB"
    return (lambda n: f"{n / 2**20:.1f}"), "MiB"


def render_report(r: ParallelReport) -> str:
    """Per-GPU memory of each strategy, one row per GPU role."""
    from tabulate import tabulate

    gib, unit = _unit(max((g.device_peak_bytes for e in r.estimates for g in e.gpus),
                          default=0))
    head = (f"{r.model} ({r.num_parameters:,} parameters), micro-batch {r.micro_batch} per GPU, "
            f"{r.precision}{', checkpointing' if r.checkpointing else ''}, on {r.num_gpus} x "
            f"{r.gpu} ({prose_size(r.device_total_bytes)}, {prose_size(r.budget_bytes)} for the "
            "allocator)")
    rows = []
    verdict = render_verdict(r)
    for e in r.estimates:
        for i, g in enumerate(e.gpus):
            b = g.breakdown
            rows.append((f"{e.strategy} x{e.num_gpus}" if i == 0 else "", g.label,
                         "yes" if g.fits else "NO", gib(g.device_peak_bytes),
                         gib(b["parameters"]), gib(b["gradients"]), gib(b["optimizer_state"]),
                         gib(b["activations"]), gib(b["temporaries"]), gib(b["communication"]),
                         g.peak_phase, e.effective_batch if i == 0 else ""))
    table = tabulate(rows, headers=("strategy", "GPU", "fits", "peak", "params", "grads",
                                    "optim", "activ", "temp", "comm", "peak in", "samples/step"),
                     colalign=("left", "left", "left") + ("right",) * 7 + ("left", "right"))
    conf = (f"PYTORCH_CUDA_ALLOC_CONF={r.allocator}" if r.allocator
            else "PYTORCH_CUDA_ALLOC_CONF unset (PyTorch's defaults)")
    link = f"; GPUs linked by {r.link}" if r.link else ""
    lines = [head, verdict, f"allocator: {conf}{link}", "", table,
             f"({unit} per GPU at its peak; peak = max_memory_reserved + CUDA context)"]
    for s, peak in r.expandable_fits:
        lines.append(f"{s}: would fit with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                     f"({prose_size(peak)} on the fullest GPU; less fragmentation): set it in "
                     "the training run's environment, as `oomdoctor recommend`'s launch line does")
    for e in r.estimates:
        if e.deepspeed_bytes is not None:
            rest = max(g.resting_state_bytes for g in e.gpus)
            offloaded = any("CPUOffloadPolicy" in n or "ZeRO-Offload" in n for n in e.notes)
            lines.append(f"{e.strategy}: parameters + gradients + optimizer state per GPU "
                         f"{prose_size(rest)} after the step (this model's dtypes); DeepSpeed's "
                         f"estimator {prose_size(e.deepspeed_bytes)} " + (
                             "(with offload: ZeRO-2 2P; ZeRO-3 4L + 2P/N, 4L with the parameters "
                             "offloaded too - L the largest layer)" if offloaded else
                             "(it assumes 16-bit weights plus fp32 master weights and gradients: "
                             "18 B/param sharded)"))
        for note in e.notes:
            lines.append(f"{e.strategy}: {note}")
        if e.partition is not None:
            p = e.partition
            lines.append(f"{e.strategy}: GPU 0 runs {_span(p.stages[0])}, GPU 1 runs "
                         f"{_span(p.stages[1])}; {prose_size(p.boundary_bytes)} cross per micro-batch")
    if r.link == "pcie-no-p2p" and any(e.strategy == "dp" for e in r.estimates):
        lines.append("dp: these GPUs have no peer-to-peer access (--link pcie-no-p2p): "
                     "DataParallel's per-step weight broadcast from GPU 0 hangs or crawls here; "
                     "DDP needs no P2P")
    for s, m in r.errors:
        lines.append(f"{s}: not estimated - {m}")
    return "\n".join(lines)


def render_verdict(r: ParallelReport) -> str:
    """The headline: which strategies fit the per-GPU budget, which do not, the best."""
    budget = f"the {prose_size(r.budget_bytes)} per-GPU budget"
    if not r.estimates:
        return "NOTHING ESTIMATED: see the errors below"
    if r.best is None:
        return (f"NOTHING FITS {budget}: {', '.join(r.not_fitting)} "
                "(`oomdoctor recommend` searches micro-batches, precisions and checkpointing)")
    rest = f"; does not fit: {', '.join(r.not_fitting)}" if r.not_fitting else ""
    return (f"FITS {budget}: {', '.join(r.fitting)}{rest}; best: {r.best} (most samples per "
            "step, least communication; `oomdoctor recommend` ranks by step time)")


def _span(names: tuple[str, ...]) -> str:
    if not names:
        return "nothing"
    if len(names) <= 3:
        return ", ".join(names)
    return f"{names[0]} .. {names[-1]} ({len(names)} blocks)"


def render_split(plan: SplitPlan) -> str:
    from tabulate import tabulate
    e, p = plan.estimate, plan.partition
    gib, unit = _unit(e.peak_device_bytes)
    head = (f"{e.model}: naive 2-GPU split, batch {e.micro_batch}, {e.precision}"
            f"{', checkpointing' if e.checkpointing else ''}, 2 x {e.gpu} "
            f"({prose_size(e.device_total_bytes)} each)")
    verdict = ("FITS" if e.fits else "DOES NOT FIT") + \
        f": larger stage peak {prose_size(e.peak_device_bytes)} of {prose_size(e.device_total_bytes)}"
    rows = []
    for k in range(2):
        g = e.gpus[k]
        b = g.breakdown
        rows.append((f"cuda:{k}", _span(p.stages[k]), "yes" if g.fits else "NO",
                     gib(g.device_peak_bytes), gib(b["parameters"]), gib(b["gradients"]),
                     gib(b["optimizer_state"]), gib(b["activations"]), gib(b["temporaries"]),
                     f"{p.utilisation[k]:.0%}"))
    table = tabulate(rows, headers=("GPU", "modules", "fits", "peak", "params", "grads", "optim",
                                    "activ", "temp", "busy"),
                     colalign=("left", "left", "left") + ("right",) * 7)
    lines = [head, verdict, "", table, f"({unit}; peak = max_memory_reserved + CUDA context)",
             "",
             f"inputs, root-level tensors and the loss on cuda:{p.main_stage} (accelerate's main "
             f"device); {prose_size(p.boundary_bytes)} cross between the GPUs per forward",
             *[f"note: {n}" for n in e.notes]]
    return "\n".join(lines)
