"""Strategy names, aliases and descriptions, and :class:`Strategy`: one way to use N GPUs."""
from __future__ import annotations

from dataclasses import dataclass, replace


STRATEGIES = ("single", "ddp", "dp", "zero1", "zero2", "zero3", "pipeline2")
# Strategies that only mean something across several nodes (recommend/smoke --nodes N): kept out
# of STRATEGIES so that the one-node commands (parallel, probe) list what they always did.
NODE_STRATEGIES = ("hsdp",)
ALIASES = {"fsdp": "zero3", "dataparallel": "dp", "pipeline": "pipeline2", "split": "pipeline2",
           "naive-pipeline": "pipeline2", "zero": "zero3", "hybrid": "hsdp",
           "hybridshard": "hsdp"}
DESCRIPTIONS = {
    "single": "one GPU",
    "ddp": "DistributedDataParallel: full replica per GPU",
    "dp": "nn.DataParallel: one process, GPU 0 gathers",
    "zero1": "ZeRO-1: optimizer state sharded (DDP + ZeroRedundancyOptimizer)",
    "zero2": "ZeRO-2: + gradients sharded",
    "zero3": "ZeRO-3 / FSDP FULL_SHARD: + parameters sharded",
    "pipeline2": "naive 2-GPU split: stages on cuda:0 and cuda:1",
    "hsdp": "hybrid sharding: ZeRO-3 within each node, replicas across nodes (FSDP HYBRID_SHARD)",
}


def parse_strategy(name: str) -> str:
    key = name.lower().replace("_", "").replace(" ", "")
    key = ALIASES.get(key, key)
    if key not in STRATEGIES + NODE_STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of "
                         f"{', '.join(STRATEGIES + NODE_STRATEGIES)} (aliases: "
                         f"{', '.join(ALIASES)})")
    return key


@dataclass(frozen=True)
class Strategy:
    """One way to use ``num_gpus`` GPUs (all of them, over ``nodes`` machines)."""

    name: str
    num_gpus: int = 1
    bucket_view: bool = False       # DDP/ZeRO-1 gradient_as_bucket_view=True
    nodes: int = 1                  # machines; num_gpus is the total (the world size)
    # FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on a model built
    # in fp32 (zero3, hsdp): estimated from the pure-bf16 trace - what is gathered, computed and
    # kept for backward is bf16 - with the sharded parameters, gradients and optimizer state
    # fp32 and the reduce-scatter in fp32 (mixed_precision_plan)
    mixed_precision: bool = False

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES + NODE_STRATEGIES:
            raise ValueError(f"unknown strategy {self.name!r}")
        if self.nodes < 1 or self.num_gpus % self.nodes:
            raise ValueError(f"{self.num_gpus} GPUs do not split evenly over {self.nodes} "
                             "nodes; give --num-gpus per node")
        if self.name == "hsdp" and self.nodes < 2:
            raise ValueError("hsdp (hybrid sharding: shard within a node, replicate across "
                             "nodes) needs several nodes; on one node it is zero3 - use "
                             "`oomdoctor recommend --nodes N` or --strategy zero3")
        if self.name == "single" and self.num_gpus != 1:
            object.__setattr__(self, "num_gpus", 1)
        if self.name == "pipeline2" and self.num_gpus != 2:
            raise ValueError("pipeline2 splits the model over exactly 2 GPUs; for more GPUs use "
                             "zero3 (FSDP)")
        if self.num_gpus < 1:
            raise ValueError(f"--num-gpus must be >= 1, got {self.num_gpus}")
        if self.mixed_precision and self.name not in ("zero3", "hsdp"):
            raise ValueError("a mixed-precision policy shards fp32 master weights: zero3 (FSDP) "
                             "or hsdp only")

    @property
    def state_scale(self) -> int:
        """Bytes of the sharded state per byte the trace holds: MASTER_SCALE under a
        mixed-precision policy (fp32 state, bf16 trace), else 1."""
        return MASTER_SCALE if self.mixed_precision else 1

    @property
    def data_parallel(self) -> int:
        """Ranks that each see a different micro-batch."""
        return 1 if self.name in ("single", "pipeline2") else self.num_gpus

    @property
    def per_node(self) -> int:
        """GPUs on each node."""
        return self.num_gpus // self.nodes

    @property
    def shard_group(self) -> int:
        """Ranks the sharded model states are split over: every GPU for ZeRO, the GPUs of one
        node for hybrid sharding (each node holds a whole replica)."""
        return self.per_node if self.name == "hsdp" else self.num_gpus

    @property
    def processes(self) -> int:
        """Processes the launcher starts (DataParallel and the split run in one process)."""
        return self.num_gpus if self.name in ("ddp", "zero1", "zero2", "zero3", "hsdp") else 1


# What FSDP2's MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# changes against the pure-bf16 step it computes: the sharded fp32 state is twice the bytes of
# the bf16 state the trace holds, and so is the fp32 reduce-scatter input
# (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: the sharded parameter keeps its
# original dtype, all-gather inputs are cast to param_dtype; _fsdp_collectives.py
# foreach_reduce: gradients are cast to reduce_dtype into the reduce-scatter input).
MASTER_SCALE = 2            # fp32 / bf16


def policy_applies(strategy: str, precision: str) -> bool:
    """Whether the frameworks run ``precision`` under ``strategy`` as FSDP2's
    MixedPrecisionPolicy: bf16 under zero3/hsdp (torchtitan, accelerate's FSDP plugin, the
    Trainer's fsdp + bf16). The plan's code, its smoke run and its estimate all ask this."""
    return precision == "bf16" and strategy in ("zero3", "hsdp")


def default_policy(strategy: Strategy, precision: str) -> Strategy:
    """``strategy`` as the frameworks run ``precision`` on it (:func:`policy_applies`)."""
    if policy_applies(strategy.name, precision) and not strategy.mixed_precision:
        return replace(strategy, mixed_precision=True)
    return strategy


def trace_precision(strategy: Strategy, precision: str) -> str:
    """The precision to trace ``strategy`` at ``precision``: a mixed-precision policy computes
    in pure bf16 (no autocast: the gathered weights are bf16)."""
    if strategy.mixed_precision:
        if precision != "bf16":
            raise ValueError(f"the FSDP mixed-precision policy is modelled for bf16 (param_dtype "
                             f"bfloat16), not {precision}")
        return "bf16-pure"
    return precision


POLICY_NOTE = ("FSDP2 MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch."
               "float32): trainable parameters, their gradients and AdamW state sharded in fp32, "
               "frozen ones in the dtype they were loaded in; each block all-gathered and "
               "computed in bf16 (no autocast), gradients reduce-scattered in fp32")
