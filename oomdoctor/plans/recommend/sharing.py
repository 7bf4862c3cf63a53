"""Several trainings on the same GPUs: one per GPU, one after the other, or side by side.

"Can I train two models at once?" (the users' third question). Three ways, compared by the time
until every training is done, in units of one training alone on all the GPUs:

- one per GPU (``CUDA_VISIBLE_DEVICES=0`` / ``=1``): each training gets ``num_gpus // N`` GPUs to
  itself, memory and compute;
- one after the other: each gets every GPU, in turn, so N trainings take N times as long;
- side by side on every GPU: each process has its own CUDA context and caching allocator, so the
  card's memory is split N ways (minus one more context per process), and without MPS the GPU
  time-slices between the processes' contexts ("CUDA Multi-Process Service" overview: kernels
  of different processes do not run concurrently, the GPU switches between contexts), so each
  gets about 1/N of the compute. The memory split is what makes the second job OOM or shrink
  its micro-batch; the time-slicing is why both crawl.

Each way's plan comes from :func:`~oomdoctor.plans.recommend.search.recommend` itself, so its
micro-batch and step time are the ones its own report would print.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from oomdoctor.plans.estimate import Budget
from oomdoctor.plans.recommend.machine import Hardware
from oomdoctor.plans.recommend.records import Candidate, Recommendation

# recommend() restricted to the user's options, for other hardware or another budget.
Planner = Callable[[Hardware, Budget], Recommendation]


@dataclass(frozen=True)
class Way:
    """One way to run the trainings."""

    name: str                  # "one per GPU" | "one after the other" | "side by side"
    gpus_per_training: int
    plan: Candidate | None     # each training's plan that way; None: it does not fit
    makespan: float | None     # all done, in units of one training alone on every GPU

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "gpus_per_training": self.gpus_per_training,
                "plan": None if self.plan is None else vars(self.plan),
                "makespan": self.makespan}


@dataclass(frozen=True)
class Sharing:
    trainings: int
    num_gpus: int
    ways: tuple[Way, ...]      # fastest first; those that do not fit last

    @property
    def best(self) -> Way | None:
        return self.ways[0] if self.ways and self.ways[0].makespan is not None else None

    def to_json(self) -> dict[str, Any]:
        return {"trainings": self.trainings, "num_gpus": self.num_gpus,
                "ways": [w.to_json() for w in self.ways],
                "best": None if self.best is None else self.best.name}


def side_by_side_budget(budget: Budget, trainings: int) -> Budget:
    """One of N equal processes' budget on a card: every process holds its own CUDA context,
    and the rest is split evenly between their allocators."""
    alone = budget.limit_bytes
    each = max(0, (alone - (trainings - 1) * budget.cuda_context_bytes) // trainings)
    return replace(budget, other_bytes=budget.other_bytes + alone - each)


def sharing(alone: Recommendation, hw: Hardware, budget: Budget, trainings: int,
            plan: Planner) -> Sharing:
    """The three ways for ``trainings`` equal trainings on ``hw``; ``alone`` is the plan of
    one training with every GPU to itself."""
    if trainings < 2:
        raise ValueError(f"--trainings must be at least 2 to compare ways of sharing, got "
                         f"{trainings}")
    rate = alone.best.samples_per_second if alone.best else None
    ways = [Way("one after the other", hw.num_gpus, alone.best,
                None if rate is None else float(trainings))]
    if hw.num_gpus >= trainings:
        k = hw.num_gpus // trainings
        own = plan(replace(hw, num_gpus=k), budget).best
        ways.append(Way("one per GPU" if k == 1 else f"{k} GPUs each", k, own,
                        _relative(rate, own, 1)))
    side = plan(hw, side_by_side_budget(budget, trainings)).best
    ways.append(Way("side by side", hw.num_gpus, side, _relative(rate, side, trainings)))
    # Ties go to the way with the least contention: the step-time model counts no cost for a
    # smaller micro-batch and none for switching contexts, so side by side never wins a tie.
    order = ("one per GPU", "one after the other", "side by side")
    ways.sort(key=lambda w: (w.makespan is None, round(w.makespan or 0.0, 2),
                             order.index(w.name) if w.name in order else 0))
    return Sharing(trainings, hw.num_gpus, tuple(ways))


def _relative(alone_rate: float | None, plan: Candidate | None, slicing: int) -> float | None:
    """Time until all are done over one training's time alone: each runs at its plan's rate
    over ``slicing`` (the share of the GPU's time it gets), all at once."""
    if plan is None or alone_rate is None or plan.samples_per_second <= 0:
        return None
    return slicing * alone_rate / plan.samples_per_second


def render_sharing(s: Sharing) -> str:
    """One line per way, fastest first, then the verdict."""
    lines = [f"{s.trainings} trainings on these {s.num_gpus} GPUs (time until all are done, "
             "in units of one training alone on every GPU):"]
    for w in s.ways:
        lines.append(f"  {w.name + ':':<22}{_describe(w, s)}")
    best = s.best
    lines.append(f"  -> {best.name}" + (f" ({_visible(s)})" if best.name == "one per GPU" else "")
                 if best is not None else "  -> none of them fits; see the plan above")
    return "\n".join(lines)


def _describe(w: Way, s: Sharing) -> str:
    if w.plan is None:
        return "does not fit" + (f" in 1/{s.trainings} of each GPU's memory"
                                 if w.name == "side by side" else "")
    c = w.plan
    how = (f"{c.strategy} x{c.num_gpus}" if c.num_gpus > 1 else "one GPU") + \
        f", {c.precision}{' + ckpt' if c.checkpointing else ''}, micro-batch {c.micro_batch}"
    why = {"side by side": f"; 1/{s.trainings} of the memory and of the compute each",
           "one after the other": "; every GPU in turn"}.get(w.name, "")
    return f"{w.makespan:.2f}x ({how}{why})"


def _visible(s: Sharing) -> str:
    return " / ".join(f"CUDA_VISIBLE_DEVICES={i}" for i in range(s.trainings))


def other_process_note(budget: Budget) -> str:
    """--other is memory only: say what a process that computes too does to the step time."""
    if budget.other_bytes <= 0:
        return ""
    return (f"--other: {budget.other_bytes / 2**30:.2f} GiB held by another process is taken "
            "off each GPU's memory; if that process computes too, the GPU time-slices between "
            "the two and steps take about twice the times above (--trainings 2 plans two equal "
            "trainings on these GPUs)")
