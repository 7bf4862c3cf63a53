"""`probe --plot` and `recommend --plot`: one stacked bar per configuration or strategy.

    oomdoctor probe sample_models/gpt2_small.py --gpu rtx3090 --plot probe.png
    oomdoctor recommend sample_models/gpt2_small.py --gpu rtx3090 --num-gpus 2 --plot gpus.svg

:func:`probe_bars` and :func:`strategy_bars` are the data (tested: each bar is the result's own
peak reserved, its stacks the result's breakdown); :func:`bar_figure` draws any :class:`Bars`
with matplotlib, and :func:`write_bars` writes it through :mod:`~oomdoctor.plans.figures`.
Bars are what the allocator reserves at the peak, the quantity the budget line bounds; the CUDA
context sits outside the budget, so it is said in the caption rather than stacked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from oomdoctor.plans.figures import plot_format, pyplot, write_figure
from oomdoctor.plans.parallel.results import BREAKDOWN_KEYS, prose_size
from oomdoctor.plans.probe import ProbeResult
from oomdoctor.plans.recommend.records import Recommendation

# Stacked bottom to top in this order; cuda_context is left out (see the module docstring).
STACKED = tuple(k for k in BREAKDOWN_KEYS if k != "cuda_context")


@dataclass(frozen=True)
class Bars:
    """Stacked bars against a budget. Per bar: its label, the text above it, whether it fits;
    per category (bottom first) the bytes of every bar. A bar's stacks sum to its total."""

    title: str
    labels: tuple[str, ...]
    stacks: dict[str, tuple[int, ...]]     # only the categories some bar has
    totals: tuple[int, ...]                # peak reserved per bar
    notes: tuple[str, ...]                 # above each bar: "batch 24", "does not fit"
    fits: tuple[bool, ...]
    budget_bytes: int
    caption: str = ""


def _bars(title: str, rows: Sequence[tuple[str, str, bool, dict[str, int] | None]],
          budget_bytes: int, caption: str) -> Bars:
    """``rows``: (label, note, fits, breakdown or None for a bar with nothing to show)."""
    stacks = {k: tuple((b or {}).get(k, 0) for *_, b in rows) for k in STACKED}
    stacks = {k: v for k, v in stacks.items() if any(v)}
    totals = tuple(sum(stacks[k][i] for k in stacks) for i in range(len(rows)))
    return Bars(title, tuple(r[0] for r in rows), stacks, totals, tuple(r[1] for r in rows),
                tuple(r[2] for r in rows), budget_bytes, caption)


def probe_bars(r: ProbeResult) -> Bars:
    """Each configuration's peak reserved at its largest batch (at batch 1 when none fits),
    labelled with that batch; with --strategy, the fullest GPU's."""
    rows = []
    context = 0
    for c in r.results:
        label = c.precision + ("\n+ ckpt" if c.checkpointing else "")
        if c.error or (c.estimate is None and c.per_gpu is None):
            rows.append((label, "not probed", False, None))
            continue
        if c.estimate is not None:
            breakdown = c.estimate.breakdown
        else:
            breakdown = max(c.per_gpu.gpus, key=lambda g: g.device_peak_bytes).breakdown
        context = breakdown.get("cuda_context", context)
        note = ("none fits\n(batch 1)" if c.max_batch_size is None
                else f"batch >= {c.max_batch_size}" if c.capped else f"batch {c.max_batch_size}")
        rows.append((label, note, c.max_batch_size is not None, breakdown))
    return _bars(f"{r.model} on {r.gpu}: the largest batch per configuration", rows,
                 r.budget_bytes, _context_caption(context))


def strategy_bars(r: Recommendation) -> Bars:
    """Per-GPU peak reserved of each strategy at the recommendation's reference configuration
    (``by_strategy``), one bar per GPU where a strategy's GPUs differ. ValueError when the
    search traced none (nothing can fit whatever the batch: see its alternatives)."""
    if not r.by_strategy:
        raise ValueError("recommend --plot: no strategy was traced (nothing can fit these "
                         "GPUs whatever the batch, or --quick skipped the per-strategy table), "
                         "so there is nothing to draw; drop --quick or see the alternatives")
    rows = []
    context = 0
    for e in r.by_strategy:
        for g in e.gpus:
            label = (f"{e.strategy}\n{g.label}" if len(e.gpus) > 1 else e.strategy)
            note = prose_size(g.peak_reserved_bytes) + ("" if g.fits else "\ndoes not fit")
            context = g.breakdown.get("cuda_context", context)
            rows.append((label, note, g.fits, g.breakdown))
    return _bars(f"{r.model} on {r.num_gpus} x {r.gpu}: per-GPU memory at "
                 f"{r.by_strategy_config}", rows, r.budget_bytes, _context_caption(context))


def _context_caption(context: int) -> str:
    return (f"bars: what the allocator reserves at the peak; the CUDA context "
            f"({prose_size(context)}) is outside the budget") if context else \
        "bars: what the allocator reserves at the peak"


def bar_figure(b: Bars) -> Any:
    """The matplotlib Figure (GiB or MiB on the y axis; bytes stay ints in ``b``)."""
    plt = pyplot()
    top = max(b.totals, default=0)
    unit, scale = ("GiB", 2.0 ** 30) if top >= 2 ** 30 else ("MiB", 2.0 ** 20)
    fig, ax = plt.subplots(figsize=(max(8.5, 1.1 * len(b.labels) + 3), 5))
    x = range(len(b.labels))
    bottom = [0.0] * len(b.labels)
    for k, values in b.stacks.items():
        heights = [v / scale for v in values]
        ax.bar(x, heights, bottom=bottom, label=k.replace("_", " "), alpha=0.85)
        bottom = [s + h for s, h in zip(bottom, heights)]
    near = b.budget_bytes <= 2 * top          # else the line would flatten the bars
    budget = f"budget {prose_size(b.budget_bytes)}"
    if near:
        ax.axhline(b.budget_bytes / scale, color="tab:red", ls="--", lw=1, label=budget)
    for i, (total, note, fits) in enumerate(zip(b.totals, b.notes, b.fits)):
        ax.text(i, total / scale, note, ha="center", va="bottom", fontsize=8,
                color="black" if fits else "tab:red",      # readable over the budget line
                bbox={"fc": "white", "ec": "none", "alpha": 0.8, "pad": 1})
    ax.set_ylim(0, 1.18 * max(top, b.budget_bytes if near else 0, 1) / scale)
    ax.set_xticks(list(x))
    ax.set_xticklabels(b.labels, fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(b.title + ("" if near else f"\n({budget}, far above)"), fontsize=10)
    if b.caption:
        ax.set_xlabel(b.caption, fontsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def write_bars(b: Bars, path: str, title: str) -> None:
    """PNG, SVG, or one HTML page with the SVG inline, by the file's extension."""
    plot_format(path)                 # before drawing: a bad name fails fast
    write_figure(bar_figure(b), path, title)
