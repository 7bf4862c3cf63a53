"""The records a recommendation is made of: candidates, lower bounds, the launch, the result."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from oomdoctor.plans.parallel import StrategyEstimate


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
    nodes: int = 1                    # machines; num_gpus counts the GPUs of all of them
    verified: bool = False            # its figures from a direct trace of the plan (_verified)
    # the split (pipeline2): module name -> GPU, and the GPU that takes the inputs and loss
    device_map: dict[str, int] | None = None
    main_device: int = 0


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
    node_commands: tuple[str, ...] = ()    # several nodes: the line to run on each, rank order
    sbatch: str = ""                       # several nodes: the same as a SLURM batch script


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
    nodes: int = 1                             # num_gpus GPUs on each
    inter_node: str = ""                       # ib | ethernet
    inter_node_gbps: float = 0.0
    tensor_parallel: tuple[TensorParallelPlan, ...] = ()
    offload: tuple[OffloadPlan, ...] = ()      # CPU offload plans, when nothing fits on the GPUs
    host_ram_bytes: int | None = None          # per node, what the offload plans are checked on
    host_ram_source: str = ""                  # --host-ram, or this machine's MemTotal
    allocator: str = ""                        # PYTORCH_CUDA_ALLOC_CONF the numbers assume

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["by_strategy"] = [e.to_json() for e in self.by_strategy]
        # The multi-node and offload keys appear only when used, so a one-node plan's JSON
        # keeps the shape scripts already read.
        for key, unused in _ADDED.items():
            if d[key] == unused:
                del d[key]
        for c in [*d["candidates"], d["best"]]:
            if c is not None and c["nodes"] == 1:
                del c["nodes"]
        if d["launch"] is not None and not self.launch.node_commands:
            del d["launch"]["node_commands"], d["launch"]["sbatch"]
        return d


_ADDED = {"nodes": 1, "inter_node": "", "inter_node_gbps": 0.0, "tensor_parallel": (),
          "offload": (), "host_ram_bytes": None, "host_ram_source": ""}


@dataclass(frozen=True)
class TensorParallelPlan:
    """Tensor parallelism of degree ``degree`` inside a node, data parallelism across: model
    states per GPU (Linear/Embedding weights split ``degree`` ways, the rest replicated)."""

    degree: int
    data_parallel: int
    model_state_bytes: int
    fits: bool                                 # model states alone under the budget


@dataclass(frozen=True)
class OffloadPlan:
    """A CPU offload configuration: what stays on each GPU, what each node's host RAM holds,
    what it costs per optimizer step (a rough estimate), and how to run it."""

    name: str                # zero2-offload | zero3-offload | zero3-offload-all | fsdp-offload
    description: str
    gpu_model_state_bytes: int                 # DeepSpeed's estimator: model states per GPU
    gpu_replayed_bytes: int | None             # the plan's step replayed: reserved + context
    fits_gpu: bool
    host_bytes_per_node: int                   # incl. DeepSpeed's 1.5x buffer factor
    host_fits: bool | None                     # None: host RAM unknown
    pcie_seconds: float                        # per optimizer step, host <-> GPU transfers
    cpu_optimizer_seconds: float               # per optimizer step, Adam on the CPU
    slowdown: float | None                     # step time over the GPU-only compute (traced)
    config: str                                # the DeepSpeed (or FSDP) settings to use
    launch: str = ""                           # the command that runs it
    env: dict[str, str] = field(default_factory=dict)   # ... with this environment
    sketch: str = ""                           # its training loop, complete but build_model,
                                               # dataset, loss_fn and epochs

    @property
    def gpu_bytes(self) -> int:
        """Per GPU: the replayed peak, else the estimator's model states alone."""
        return (self.gpu_replayed_bytes if self.gpu_replayed_bytes is not None
                else self.gpu_model_state_bytes)
