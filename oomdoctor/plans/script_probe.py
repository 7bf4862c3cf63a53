"""The largest batch a training script fits: ``oomdoctor probe -- python train.py --bs {batch}``.

A model file's probe traces few batch sizes and extrapolates, since its events are affine in
the batch size (oomdoctor.plans.probe). A script's batch comes from its own data pipeline: a
padding collator makes the sequence length depend on which samples a batch holds, so nothing
is affine. Each trial therefore runs the script at that batch size (every DataLoader's
``batch_size``, or its ``{batch}`` placeholder) and the search doubles until a trial does not
fit, then bisects - about 2 log2(N) runs, assuming a larger batch never needs less memory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from oomdoctor.models.script import ScriptSpec
from oomdoctor.models.spec import ModelFileError
from oomdoctor.plans.estimate import Budget, Estimate, script_trace
from oomdoctor.plans.parallel.scripts import script_gpu_estimate
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.sim.recorder import Category
from oomdoctor.sim.script import DataExhausted, NoStep
from oomdoctor.sim.trace import TraceConfig


class ScriptError(ModelFileError):
    """The probe cannot vary this script's batch size."""


@dataclass
class ScriptProbe:
    """Every trial of the search and its answer."""

    script: str
    budget_bytes: int
    trials: dict[int, Estimate] = field(default_factory=dict)
    max_batch_size: int = 0          # 0: not even batch 1 fits
    capped: bool = False             # the search stopped at --max-batch-size, still fitting
    # A batch this large already held all the data a batch gets (a larger one ran the same
    # step): the script's dataset, not the GPU, bounds the batch. 0: not seen.
    data_bound: int = 0
    # The dataset's size when a larger batch got no batch at all from the script's DataLoader
    # (drop_last): the data, not the GPU, ends the search there. 0: not seen.
    data_samples: int = 0
    # The smallest batch at which the script ended without an optimizer step, after smaller
    # ones trained (its own data, cut in fewer pieces than a step needs). 0: not seen.
    data_ends: int = 0
    # The run at the answer, kept for what is checked there (the input pipeline); not JSON.
    at_max_trace: Any = field(default=None, repr=False, compare=False)

    @property
    def at_max(self) -> Estimate | None:
        return self.trials.get(self.max_batch_size)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.script, "max_batch_size": self.max_batch_size,
                "capped": self.capped, "data_bound": self.data_bound or None,
                "data_samples": self.data_samples or None,
                "data_ends": self.data_ends or None,
                "budget_bytes": self.budget_bytes,
                "trials": [{"batch_size": b, "fits": e.fits,
                            "peak_allocated_bytes": e.peak_allocated_bytes,
                            "peak_reserved_bytes": e.peak_reserved_bytes}
                           for b, e in sorted(self.trials.items())],
                "at_max": self.at_max.to_json() if self.at_max else None}


def probe_script(script: ScriptSpec, cfg: TraceConfig, budget: Budget,
                 alloc: AllocatorConfig = AllocatorConfig(), *, max_batch: int = 1 << 16,
                 seq_len: int | None = None,
                 progress: Callable[[str], None] | None = None) -> ScriptProbe:
    """Double the batch from 1 until a run does not fit (or ``max_batch``), then bisect."""
    result = ScriptProbe(script.name, budget.limit_bytes)

    def fits(batch: int) -> bool:
        if progress is not None:
            progress(f"{script.name}: running at batch {batch}")
        trace = script_trace(script, cfg, budget, batch_size=batch, seq_len=seq_len)
        if trace.batch_from == "script":
            raise ScriptError(f"{script.name} makes its batches without a DataLoader, so "
                              "oomdoctor cannot set their size; put {batch} where the "
                              f"script's batch size goes: `-- {script.command()} --batch-size "
                              "{batch}` (its own flag)")
        e = script_gpu_estimate(script, trace, budget, alloc, seq_len)
        result.trials[batch] = e
        fitted[batch] = trace if e.fits else None
        inputs[batch] = sum(s.nbytes for s in trace.storages.values()
                            if s.category is Category.INPUTS)
        return e.fits

    def trains(batch: int) -> bool:
        """Whether ``batch`` fits; False too where the data runs out before a step."""
        try:
            return fits(batch)
        except DataExhausted as e:
            if batch == 1:
                raise
            result.data_samples = e.samples or result.data_samples or 1
            return False
        except NoStep:
            if batch == 1:
                raise
            result.data_ends = min(batch, result.data_ends or batch)
            return False

    inputs: dict[int, int] = {}      # bytes the script copied to the GPU as its batches
    fitted: dict[int, Any] = {}      # the runs that fit (the answer's is kept)
    lo, hi, batch = 0, None, 1
    while batch <= max_batch:
        if not trains(batch):
            hi = batch
            break
        if lo and inputs[lo] == inputs[batch] and (result.trials[lo].peak_allocated_bytes
                                                   == result.trials[batch].peak_allocated_bytes):
            # the data gives no more samples per batch: the same upload made the same step
            # (the uploads alone are no proof: a script that moves its whole dataset to the
            # GPU once, word_language_model's batchify, uploads the same bytes at every batch)
            result.data_bound = lo
            break
        lo, batch = batch, batch * 2
    if result.data_bound:
        result.max_batch_size = lo
        result.at_max_trace = fitted.get(lo)
        return result
    if hi is None and lo < max_batch:        # doubling passed the cap: try the cap itself
        if trains(max_batch):
            lo = max_batch
        else:
            hi = max_batch
    size = result.data_samples
    if hi is not None and size and lo < hi:
        # no batch above the dataset's size: try the whole dataset as one batch first
        if size <= lo:
            hi = lo + 1
        elif size < hi:
            lo, hi = (size, size + 1) if trains(size) else (lo, size)
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if trains(mid) else (lo, mid)
    result.max_batch_size = lo
    result.capped = lo == max_batch
    if result.data_samples and result.trials.get(lo + 1) is not None:
        result.data_samples = 0          # memory, not the data, stopped it
    result.at_max_trace = fitted.get(lo)
    return result


def render_text(p: ScriptProbe) -> str:
    """The trials and the answer, for the terminal."""
    from tabulate import tabulate

    from oomdoctor.sim.allocator import format_size
    rows = [(b, format_size(e.peak_allocated_bytes), format_size(e.peak_reserved_bytes),
             "yes" if e.fits else "no") for b, e in sorted(p.trials.items())]
    table = tabulate(rows, headers=("batch", "peak allocated", "peak reserved", "fits"),
                     colalign=("right", "right", "right", "left"))
    if not p.max_batch_size:
        verdict = (f"{p.script}: not even batch 1 fits the {format_size(p.budget_bytes)} "
                   "budget")
    else:
        e = p.at_max
        verdict = (f"{p.script}: largest batch that fits: {p.max_batch_size}"
                   + (" (the --max-batch-size cap; more may fit)" if p.capped else "")
                   + (" (and any larger: from here on the script's data holds no more "
                      "samples per batch, so the step does not grow)" if p.data_bound
                      else "")
                   + (f" (the script's dataset, {p.data_samples:,} samples, not the GPU, "
                      "limits the batch: a larger one gets no batch from its DataLoader)"
                      if p.data_samples else "")
                   + (f" (the script's data, not the GPU, limits the batch: at batch "
                      f"{p.data_ends} it ended before an optimizer step)"
                      if p.data_ends and p.data_ends == p.max_batch_size + 1 else "")
                   + f", peak {format_size(e.peak_reserved_bytes)} reserved of the "
                   f"{format_size(p.budget_bytes)} budget, {e.precision}")
    notes = p.at_max.notes if p.at_max else next(iter(p.trials.values())).notes
    return "\n".join([verdict, "", table, ""] + [f"note: {n}" for n in notes])
