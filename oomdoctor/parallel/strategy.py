"""Strategy names, aliases and descriptions, and :class:`Strategy`: one way to use N GPUs."""
from __future__ import annotations

from dataclasses import dataclass


STRATEGIES = ("single", "ddp", "dp", "zero1", "zero2", "zero3", "pipeline2")
ALIASES = {"fsdp": "zero3", "dataparallel": "dp", "pipeline": "pipeline2", "split": "pipeline2",
           "naive-pipeline": "pipeline2", "zero": "zero3"}
DESCRIPTIONS = {
    "single": "one GPU",
    "ddp": "DistributedDataParallel: full replica per GPU",
    "dp": "nn.DataParallel: one process, GPU 0 gathers",
    "zero1": "ZeRO-1: optimizer state sharded (DDP + ZeroRedundancyOptimizer)",
    "zero2": "ZeRO-2: + gradients sharded",
    "zero3": "ZeRO-3 / FSDP FULL_SHARD: + parameters sharded",
    "pipeline2": "naive 2-GPU split: stages on cuda:0 and cuda:1",
}


def parse_strategy(name: str) -> str:
    key = name.lower().replace("_", "").replace(" ", "")
    key = ALIASES.get(key, key)
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)} "
                         f"(aliases: {', '.join(ALIASES)})")
    return key


@dataclass(frozen=True)
class Strategy:
    """One way to use ``num_gpus`` GPUs."""

    name: str
    num_gpus: int = 1
    bucket_view: bool = False       # DDP/ZeRO-1 gradient_as_bucket_view=True

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.name!r}")
        if self.name == "single" and self.num_gpus != 1:
            object.__setattr__(self, "num_gpus", 1)
        if self.name == "pipeline2" and self.num_gpus != 2:
            raise ValueError("pipeline2 splits the model over exactly 2 GPUs; for more GPUs use "
                             "zero3 (FSDP)")
        if self.num_gpus < 1:
            raise ValueError(f"--num-gpus must be >= 1, got {self.num_gpus}")

    @property
    def data_parallel(self) -> int:
        """Ranks that each see a different micro-batch."""
        return 1 if self.name in ("single", "pipeline2") else self.num_gpus

    @property
    def processes(self) -> int:
        """Processes the launcher starts (DataParallel and the split run in one process)."""
        return self.num_gpus if self.name in ("ddp", "zero1", "zero2", "zero3") else 1
