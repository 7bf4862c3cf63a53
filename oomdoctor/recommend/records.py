"""The records a recommendation is made of: candidates, lower bounds, the launch, the result."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from oomdoctor.parallel import StrategyEstimate


@dataclass(frozen=True)
class Candidate:
    """One configuration that fits, with its predicted cost."""

    strategy: str
    num_gpus: int
    precision: str
    checkpointing: bool
    micro_batch: int
    grad_accum: int
    effective_batch: int
    peak_device_bytes: int            # the fullest GPU: reserved + CUDA context
    per_gpu_bytes: tuple[int, ...]
    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    samples_per_second: float
    numerics: str
    score: float                      # step time with the numerics penalty; lower is better
    extrapolated: bool = True         # sizes from the batch-1/2 traces (False: traced directly)
    traffic_bytes: int = 0            # sent per GPU per step (StepTime.traffic_bytes)


@dataclass(frozen=True)
class Floor:
    """Model states alone per GPU: if this exceeds the budget, no batch size can fit."""

    strategy: str
    precision: str
    bytes: int
    fits: bool


@dataclass(frozen=True)
class Launch:
    command: str
    env: dict[str, str]
    snippet: str
    quality_notes: tuple[str, ...]
    env_note: str = ""           # what to adjust in env on the training machine


@dataclass(frozen=True)
class Recommendation:
    model: str
    gpu: str
    num_gpus: int
    link: str
    link_gbps: float
    target_batch: int
    device_total_bytes: int
    budget_bytes: int
    num_parameters: int
    candidates: tuple[Candidate, ...]          # best first
    best: Candidate | None
    launch: Launch | None
    by_strategy: tuple[StrategyEstimate, ...]  # per-GPU memory of every strategy, one config
    by_strategy_config: str
    floors: tuple[Floor, ...]
    alternatives: tuple[str, ...]              # what would fit, when nothing does
    notes: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    # The best plan's samples/s over one GPU's at the same precision and checkpointing (the
    # same effective batch through accumulation); None when one GPU cannot run it.
    speedup: float | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["by_strategy"] = [e.to_json() for e in self.by_strategy]
        return d
