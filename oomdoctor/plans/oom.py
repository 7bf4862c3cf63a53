"""The simulator's numbers for an OOM in a log (`oomdoctor explain --model`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.plans.estimate import Budget
from oomdoctor.plans.probe import Progress, probe
from oomdoctor.models.spec import ModelSpec
from oomdoctor.sim.trace import TraceConfig


@dataclass(frozen=True)
class OomPlan:
    """The simulator's numbers for an OOM in a log (``oomdoctor explain --model``)."""

    model: str
    gpu: str
    device_total_bytes: int
    batch_size: int | None              # the failing run's micro-batch, when known
    precision: str                      # the failing run's precision (assumed fp32 if unknown)
    needed_bytes: int | None            # reserved + CUDA context at that batch size
    fits: bool | None
    max_batch: tuple[tuple[str, int | None], ...]   # (configuration, largest batch that fits)
    capped: tuple[str, ...] = ()        # configurations whose search stopped at the cap

    def _batch(self, label: str, b: int | None) -> str:
        if not b:
            return f"none {label}"
        return f"at least {b} {label} (the search cap)" if label in self.capped else f"{b} {label}"

    def summary(self) -> str:
        from oomdoctor.sim.allocator import format_size
        parts = []
        if self.batch_size is not None and self.needed_bytes is not None:
            parts.append(f"at batch {self.batch_size} ({self.precision}) this step needs "
                         f"{format_size(self.needed_bytes)} on a "
                         f"{format_size(self.device_total_bytes)} {self.gpu}")
        fits = [self._batch(label, b) for label, b in self.max_batch]
        parts.append("the largest batch that fits is " + ", ".join(fits))
        return "; ".join(parts)

    def fix_effects(self) -> dict[str, str]:
        """What the simulator says each of explain's fixes buys, by fix id."""
        found = dict(self.max_batch)
        amp = next((label for label, _ in self.max_batch
                    if "AMP" in label and "checkpointing" not in label), None)
        wanted = {"halve_micro_batch": "in fp32" if self.precision == "fp32" else None,
                  "mixed_precision": amp,
                  "activation_checkpointing": amp and f"{amp} + checkpointing"}
        def effect(label: str) -> str:
            b = found[label]
            if not b:
                return f"simulated: not even batch 1 fits {label}"
            if label in self.capped:
                return f"simulated: batch {b} and more fits {label} (the search cap)"
            return f"simulated: batch {b} fits {label}"
        return {fix: effect(label) for fix, label in wanted.items() if label in found}

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.gpu,
                "device_total_bytes": self.device_total_bytes, "batch_size": self.batch_size,
                "precision": self.precision, "needed_bytes": self.needed_bytes,
                "fits": self.fits, "summary": self.summary(),
                "fix_effects": self.fix_effects(),
                "max_batch": [{"config": c, "max_batch_size": b, "capped": c in self.capped}
                              for c, b in self.max_batch]}


_LABELS = {("fp32", False): "in fp32", ("fp16", False): "with fp16 AMP",
           ("bf16", False): "with bf16 AMP", ("fp16", True): "with fp16 AMP + checkpointing",
           ("bf16", True): "with bf16 AMP + checkpointing"}


def oom_plan(spec: ModelSpec, budget: Budget, batch_size: int | None = None,
             precision: str = "fp32", alloc: AllocatorConfig = AllocatorConfig(),
             progress: Progress = lambda _: None, jobs: int = 1) -> OomPlan:
    """How much the failing configuration needs and the largest batches that fit instead."""
    from oomdoctor.plans.estimate import estimate
    amp = "bf16" if budget.gpu.bf16 else "fp16"
    configs = [("fp32", False), (amp, False), (amp, True)]
    result = probe(spec, TraceConfig(1), budget, configs, alloc, progress, jobs=jobs)
    needed = fits = None
    if batch_size is not None:
        progress(f"estimating the failing configuration: batch {batch_size}, {precision}")
        e = estimate(spec, TraceConfig(batch_size, precision), budget, alloc)
        needed, fits = e.device_peak_bytes, e.fits
    return OomPlan(spec.name, budget.gpu.name, budget.gpu.total_bytes, batch_size, precision,
                   needed, fits,
                   tuple((_LABELS[(r.precision, r.checkpointing)], r.max_batch_size)
                         for r in result.results if r.error is None),
                   tuple(_LABELS[(r.precision, r.checkpointing)] for r in result.results
                         if r.error is None and r.capped))
