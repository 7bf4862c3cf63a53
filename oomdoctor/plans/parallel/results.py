"""What a strategy estimate reports: breakdown keys, per-GPU memory, the split's partition."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from oomdoctor.sim.trace import Category


BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries",
                  "communication", "allocator_overhead", "cuda_context")
_CATEGORY_KEY = {
    Category.PARAMETERS: "parameters", Category.BUFFERS: "parameters",
    Category.GRADIENTS: "gradients", Category.OPTIMIZER_STATE: "optimizer_state",
    Category.ACTIVATIONS: "activations", Category.INPUTS: "activations",
    Category.TEMPORARIES: "temporaries",
}


def prose_size(n: float) -> str:
    """IEC size for prose (notes and report text): GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class GpuMemory:
    """One GPU's predicted peak under a strategy. Bytes are ints."""

    label: str
    peak_allocated_bytes: int           # torch.cuda.max_memory_allocated()
    peak_reserved_bytes: int            # torch.cuda.max_memory_reserved()
    device_peak_bytes: int              # reserved + CUDA context (nvidia-smi at the peak)
    fits: bool
    breakdown: dict[str, int]
    peak_phase: str
    model_state_bytes: int              # parameters + gradients + optimizer state at the peak
    resting_state_bytes: int = 0        # the same at the end of the last optimizer step


@dataclass(frozen=True)
class Partition:
    """A two-stage split: which blocks run on which GPU."""

    stages: tuple[tuple[str, ...], ...]
    main_stage: int                     # where the inputs, the root and the loss live
    device_map: dict[str, int]          # accelerate device map (module/param name -> GPU)
    flops_share: tuple[float, ...]      # share of the step's compute per stage
    boundary_bytes: int                 # bytes copied across per micro-batch, forward

    @property
    def utilisation(self) -> tuple[float, ...]:
        """Busy fraction of each GPU with no micro-batch pipelining."""
        return self.flops_share


@dataclass(frozen=True)
class StrategyEstimate:
    """Per-GPU memory of one strategy at one configuration."""

    model: str
    strategy: str
    num_gpus: int
    precision: str
    checkpointing: bool
    micro_batch: int                    # per GPU (per data-parallel rank)
    grad_accum: int
    effective_batch: int
    gpu: str
    device_total_bytes: int
    budget_bytes: int
    gpus: tuple[GpuMemory, ...]
    fits: bool
    model_state_floor_bytes: int        # params + grads + optimizer state per GPU, no activations
    deepspeed_bytes: int | None = None  # DeepSpeed's estimator for this stage (its dtypes)
    partition: Partition | None = None
    notes: tuple[str, ...] = ()

    @property
    def peak_device_bytes(self) -> int:
        return max(g.device_peak_bytes for g in self.gpus)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["peak_device_bytes"] = self.peak_device_bytes
        d["notes"] = list(self.notes)
        if self.partition is not None:
            d["partition"]["utilisation"] = list(self.partition.utilisation)
        return d
