"""`estimate --plot`: allocated memory over the step stacked by category, reserved, the budget.

    oomdoctor estimate sample_models/gpt2_small.py -b 8 --gpu rtx3090 --plot step.png

:func:`step_series` is the data (tested: at the peak the stacks are the estimate's breakdown);
:func:`write_plot` draws it with matplotlib (the ``plot`` extra) as PNG, SVG or a self-contained
HTML page (the SVG inline). The replay has no limit, so a step that does not fit shows what it
would need above the budget line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oomdoctor.plans.estimate import _CATEGORY_KEY, Budget, Estimate, device_events
from oomdoctor.plans.figures import plot_format, pyplot, write_figure
from oomdoctor.sim.allocator import AllocatorConfig, CachingAllocator
from oomdoctor.sim.trace import Trace

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


@dataclass(frozen=True)
class StepSeries:
    """Bytes after each allocator event. ``categories`` sum the live requests (as the
    estimate's breakdown does), ``allocated`` the blocks (max_memory_allocated), ``reserved``
    the segments."""

    categories: dict[str, list[int]]
    allocated: list[int]
    reserved: list[int]
    phases: tuple[tuple[int, str], ...]       # (first event, "forward 1")
    budget_bytes: int
    peak_index: int                           # first event at the allocated peak
    peak_live: tuple[tuple[str, int], ...]    # categories live at the peak, largest first


def step_series(trace: Trace, budget: Budget,
                alloc: AllocatorConfig = AllocatorConfig()) -> StepSeries:
    dev = device_events(trace, budget.gpu)
    cat_of = {h: "temporaries" if h in dev.workspace_handles or h in dev.scratch_handles
              else _CATEGORY_KEY[trace.storages[h].category]
              for is_alloc, h, _ in dev.events if is_alloc}
    cache = CachingAllocator(alloc, None)
    live = dict.fromkeys(CATEGORIES, 0)
    size: dict[int, int] = {}
    series: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    allocated, reserved = [], []
    for is_alloc, h, n in dev.events:
        if is_alloc:
            cache.malloc(h, n)
            size[h] = n
            live[cat_of[h]] += n
        else:
            cache.free(h)
            live[cat_of[h]] -= size.pop(h)
        for c in CATEGORIES:
            series[c].append(live[c])
        allocated.append(cache.allocated_bytes)
        reserved.append(cache.reserved_bytes)
    peak = allocated.index(max(allocated)) if allocated else 0
    first = {}                    # the device event where each phase mark starts
    for i, t in enumerate(dev.trace_index):
        first.setdefault(t, i)
    phases = tuple((first.get(m.start, len(dev.events)), f"{m.phase.value} {m.iteration + 1}")
                   for m in trace.marks)
    at_peak = sorted(((c, series[c][peak]) for c in CATEGORIES if allocated and series[c][peak]),
                     key=lambda kv: -kv[1])
    return StepSeries(series, allocated, reserved, phases, budget.limit_bytes, peak,
                      tuple(at_peak))


def figure(s: StepSeries, e: Estimate) -> Any:
    """The matplotlib Figure (GiB on the y axis; bytes stay ints in the series)."""
    plt = pyplot()
    from oomdoctor.sim.allocator import format_size
    top = max(s.reserved, default=0)
    unit, scale = ("GiB", 2.0 ** 30) if top >= 2 ** 30 else ("MiB", 2.0 ** 20)
    fig, ax = plt.subplots(figsize=(11, 5.5))
    x = range(len(s.allocated))
    ax.stackplot(x, *[[v / scale for v in s.categories[c]] for c in CATEGORIES],
                 labels=[c.replace("_", " ") for c in CATEGORIES], alpha=0.85)
    ax.plot(x, [v / scale for v in s.allocated], color="black", lw=0.8, label="allocated")
    ax.plot(x, [v / scale for v in s.reserved], color="tab:red", lw=1.2, label="reserved")
    budget = f"budget {format_size(s.budget_bytes)}"
    if s.budget_bytes <= 2 * top:        # else it would flatten the step: said in the title
        ax.axhline(s.budget_bytes / scale, color="tab:red", ls="--", lw=1, label=budget)
    ax.set_ylim(0, 1.12 * max(top, s.budget_bytes if s.budget_bytes <= 2 * top else 0, 1) / scale)
    for start, name in s.phases:
        ax.axvline(start, color="grey", lw=0.5, ls=":")
        ax.text(start, 0.99, name, rotation=90, va="top", ha="right", fontsize=7,
                transform=ax.get_xaxis_transform(), color="grey")
    if s.allocated:
        live = "\n".join(f"{c.replace('_', ' ')} {format_size(b)}" for c, b in s.peak_live[:3])
        right = s.peak_index > len(s.allocated) / 2
        ax.annotate(f"peak {format_size(s.allocated[s.peak_index])} allocated\n{live}",
                    (s.peak_index, s.allocated[s.peak_index] / scale),
                    xytext=(-150 if right else 30, -60), textcoords="offset points",
                    fontsize=8, bbox={"boxstyle": "round", "fc": "white", "alpha": 0.9},
                    arrowprops={"arrowstyle": "->", "lw": 0.8})
    ax.set_xlabel("allocator event (malloc or free, in order)")
    ax.set_ylabel(unit)
    ax.set_title(f"{e.model}: batch {e.batch_size}, {e.precision}"
                 f"{', checkpointing' if e.checkpointing else ''} on {e.gpu}"
                 + ("" if s.budget_bytes <= 2 * top else f" ({budget}, far above)"))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


def write_plot(s: StepSeries, e: Estimate, path: str) -> None:
    """PNG, SVG, or one HTML page with the SVG inline, by the file's extension."""
    plot_format(path)                 # before drawing: a bad name fails fast
    write_figure(figure(s, e), path, f"oomdoctor estimate: {e.model}")
