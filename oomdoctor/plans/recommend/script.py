"""`oomdoctor recommend -- python train.py ...`: a training script planned on these GPUs.

A model file's recommendation searches precisions, checkpointing and micro-batches over traces
it makes itself. A script decides its precision and checkpointing in its own code, so only the
strategy, the micro-batch (every DataLoader's ``batch_size``, or its ``{batch}`` placeholder)
and the accumulation that reaches the target batch are searched. Each micro-batch tried is one
run of the script on the fake GPU (oomdoctor.plans.parallel.scripts), shared by every strategy;
a strategy's largest fitting micro-batch among the divisors of its per-rank batch is found by
bisection, assuming a larger batch never needs less memory (as probe's search of a script does).
A micro-batch the script's data cannot fill (its run copied no more input than a smaller one's,
or its DataLoader ran dry) is not a plan; a script that makes its batches without a DataLoader
needs ``{batch}`` in its command line.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from oomdoctor.models.script import ScriptSpec
from oomdoctor.plans.script_probe import ScriptError
from oomdoctor.plans.estimate import Budget, allocator_conf_string
from oomdoctor.plans.parallel import StrategyEstimate, estimate_strategy, parse_strategy
from oomdoctor.plans.parallel.scripts import _script_cannot, _script_inputs, sets_aside
from oomdoctor.plans.parallel.report import _strategy
from oomdoctor.plans.parallel.timeline import Sizes
from oomdoctor.plans.recommend.cost import step_time
from oomdoctor.plans.recommend.machine import Hardware
from oomdoctor.plans.recommend import script_advice
from oomdoctor.plans.recommend.records import Candidate
from oomdoctor.plans.recommend.render import _duration, _rate
from oomdoctor.plans.recommend.config_search import _divisors, _largest_fitting, candidate
from oomdoctor.plans.recommend.search import (LAUNCH_ALLOCATOR, Progress, _strategies,
                                              _strategy_names, rank)
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.sim.recorder import Category
from oomdoctor.sim.script import DataExhausted


@dataclass(frozen=True)
class ScriptRecommendation:
    script: str
    gpu: str
    num_gpus: int
    link: str
    target_batch: int
    budget_bytes: int
    precision: str                    # what the script trains in (its own choice)
    checkpointing: bool               # whether the script checkpoints (its own choice)
    num_parameters: int
    candidates: tuple[Candidate, ...]
    best: Candidate | None
    how: tuple[str, ...]              # what the best plan changes in the script
    skipped: tuple[tuple[str, str], ...]     # (strategy, why it was not planned)
    allocator: str
    runs: tuple[int, ...]             # the micro-batches the script ran at

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["skipped"] = [{"strategy": s, "why": w} for s, w in self.skipped]
        return doc


class _Runs:
    """The script's runs, one per micro-batch tried, shared by every strategy."""

    def __init__(self, script: ScriptSpec, budget: Budget, progress: Progress,
                 seq_len: int | None) -> None:
        self.script, self.budget, self.progress, self.seq_len = script, budget, progress, seq_len
        self.done: dict[int, tuple | None] = {}
        self.inputs: dict[int, int] = {}     # bytes each run copied to the GPU as its batches

    def at(self, b: int) -> tuple | None:
        """(trace, layout, sizes) of a run at micro-batch ``b``; None where the script's data
        gives no batch of ``b`` samples (the dataset is smaller)."""
        if b not in self.done:
            try:
                trace, layout = _script_inputs(self.script, self.budget, self.progress, b,
                                               self.seq_len)
            except DataExhausted:
                self.done[b] = None
                return None
            if trace.batch_from == "script":
                raise ScriptError(f"{self.script.name} makes its batches without a DataLoader, "
                                  "so oomdoctor cannot set their size; put {batch} where the "
                                  f"script's batch size goes: `-- {self.script.command()} "
                                  "--batch-size {batch}` (its own flag)")
            # as probe's search of a script: a batch that copies no more input than a smaller
            # one got all the data there is (the dataset is smaller than the batch)
            inputs = sum(s.nbytes for s in trace.storages.values()
                         if s.category is Category.INPUTS)
            bound = any(n == inputs for b0, n in self.inputs.items() if b0 < b)
            self.inputs[b] = inputs
            self.done[b] = None if bound else (trace, layout, Sizes.of(trace))
        return self.done[b]


def recommend_script(script: ScriptSpec, hw: Hardware, target_batch: int, budget: Budget,
                     strategies: list[str] | None = None, alloc: AllocatorConfig | None = None,
                     progress: Progress = lambda _: None, seq_len: int | None = None
                     ) -> ScriptRecommendation:
    """Every strategy's largest fitting micro-batch for the script, its step time, ranked."""
    if target_batch < 1:
        raise ValueError(f"--target-batch must be >= 1, got {target_batch}")
    if hw.nodes > 1:
        raise ValueError("a script is planned on one node; give --nodes 1, or plan its model "
                         "with `oomdoctor recommend MODEL --nodes N`")
    alloc = LAUNCH_ALLOCATOR if alloc is None else alloc
    runs = _Runs(script, budget, progress, seq_len)
    divisors = _divisors(target_batch)
    # the run one GPU's bisection starts with (else the smallest): what the script trains in
    first = runs.at(divisors[(len(divisors) - 1) // 2]) or runs.at(1)
    if first is None:
        raise ScriptError(f"{script.name}'s data gives no batch to run at")
    trace, layout, _ = first
    precision, checkpointing = trace.config.precision, bool(trace.checkpointed)
    names = [parse_strategy(s) for s in _strategy_names(hw, strategies)]
    candidates, skipped, found = [], [], {}
    for st in _strategies(names, hw):
        st = _strategy(st.name, st.num_gpus, precision, False, False, None)
        why = _script_cannot(st.name, st, precision, hw.num_gpus)
        if why:
            skipped.append((st.name, why))
            continue
        hit = _best_batch(runs, st, target_batch, budget, alloc, progress)
        if hit is None:
            skipped.append((st.name, _no_fit(st, target_batch)))
            continue
        b, e = hit
        found[st.name] = e
        candidates.append(_candidate(runs.at(b), st, hw, precision, checkpointing, b,
                                     target_batch, e))
    ranked = rank(candidates, hw.link == "pcie-no-p2p")
    best = ranked[0] if ranked else None
    return ScriptRecommendation(
        script.name, hw.gpu.name, hw.num_gpus, hw.link, target_batch, budget.limit_bytes,
        precision, checkpointing, layout.num_parameters, tuple(ranked), best,
        _how(best, found.get(best.strategy) if best else None, script, sets_aside(trace)),
        tuple(skipped),
        allocator_conf_string(alloc), tuple(sorted(runs.done)))


def _best_batch(runs: _Runs, st, target: int, budget: Budget, alloc: AllocatorConfig,
                progress: Progress) -> tuple[int, StrategyEstimate] | None:
    """The largest micro-batch among the divisors of the per-rank batch that fits ``st``."""
    d = st.data_parallel
    if target % d:
        return None

    def try_batch(b: int) -> StrategyEstimate | _NoBatch:
        run = runs.at(b)
        if run is None:
            return _NoBatch()
        trace, layout, sizes = run
        progress(f"{st.name} x{st.num_gpus}: micro-batch {b}")
        return estimate_strategy(trace, layout, st, budget, alloc, sizes,
                                 grad_accum=trace.config.grad_accum)
    return _largest_fitting(try_batch, _divisors(target // d))


@dataclass(frozen=True)
class _NoBatch:
    """A micro-batch the script's data cannot fill: not a plan."""

    fits: bool = False


def _no_fit(st, target: int) -> str:
    if target % st.data_parallel:
        return (f"the target batch {target} does not split over {st.data_parallel} "
                "data-parallel GPUs")
    return "even micro-batch 1 does not fit"


def _candidate(run: tuple, st, hw: Hardware, precision: str, checkpointing: bool, b: int,
               target: int, e: StrategyEstimate) -> Candidate:
    trace, layout, _ = run
    k = target // (st.data_parallel * b)
    t = step_time(layout, trace, st, hw, precision, checkpointing, b, k,
                  e.partition.boundary_bytes if e.partition else 0)
    return candidate(st, precision, checkpointing, b, k, target, e, t, extrapolated=False)


def _how(best: Candidate | None, e: StrategyEstimate | None, script: ScriptSpec,
         set_aside: str = "") -> tuple[str, ...]:
    """What to change in the script for the best plan: batch, accumulation, strategy (in the
    terms of the framework the script is written in)."""
    if best is None:
        return ()
    kind = script_advice.framework(script.source())
    k = best.grad_accum
    out = [f"micro-batch {best.micro_batch}: every DataLoader's batch_size (or {{batch}})",
           f"step the optimizer every {k} micro-batches, the loss scaled by 1/{k}" if k > 1
           else "step the optimizer every micro-batch (no accumulation)",
           f"{best.strategy}: " + script_advice.change(best.strategy, kind, best.num_gpus,
                                                        script.name)]
    if set_aside:
        out.insert(0, set_aside)
    return tuple(out) + (e.notes if e is not None else ())


def render_text(r: ScriptRecommendation) -> str:
    """The table of plans, the best, and what to change in the script for it."""
    lines = [f"{r.script} ({r.num_parameters:,} parameters, {r.precision}"
             f"{', checkpointing' if r.checkpointing else ''}: the script's own choice) on "
             f"{r.num_gpus} x {r.gpu} ({r.budget_bytes / 2**30:.2f} GiB for the allocator, "
             f"linked by {r.link}), target batch {r.target_batch}",
             f"allocator: PYTORCH_CUDA_ALLOC_CONF={r.allocator or 'unset'} (the plan's setting); "
             f"the script ran at micro-batch {', '.join(map(str, r.runs))}", ""]
    if not r.candidates:
        lines.append("NOTHING FITS at any micro-batch: see `oomdoctor parallel -- <this command>"
                     "` for each strategy's per-GPU memory")
    else:
        lines.append(f"{'strategy':<12} {'GPUs':>4} {'micro-batch':>11} {'accum':>5} "
                     f"{'peak GiB':>8} {'step':>10} {'samples/s':>9}")
        for c in r.candidates:
            lines.append(f"{c.strategy:<12} {c.num_gpus:>4} {c.micro_batch:>11} "
                         f"{c.grad_accum:>5} {c.peak_device_bytes / 2**30:>8.2f} "
                         f"{_duration(c.step_seconds):>10} {_rate(c.samples_per_second):>9}")
        lines += ["", f"RECOMMENDED: {r.best.strategy} x{r.best.num_gpus}, change in the "
                      "script:"] + [f"- {h}" for h in r.how]
    lines += [f"not planned: {s}: {w}" for s, w in r.skipped]
    return "\n".join(lines)
