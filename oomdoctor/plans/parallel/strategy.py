"""Strategy names, aliases and descriptions, and :class:`Strategy`: one way to use N GPUs."""
from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass, replace

from oomdoctor.sim.trace import TraceConfig


STRATEGIES = ("single", "ddp", "dp", "zero1", "zero2", "zero3", "pipeline2")
# Strategies that only mean something across several nodes (recommend/smoke --nodes N): kept out
# of STRATEGIES so that the one-node commands (parallel, probe) list what they always did.
NODE_STRATEGIES = ("hsdp",)
# DeepSpeed's ZeRO stages as its engine runs them (oomdoctor.plans.parallel.deepspeed): named on
# request only, as the frameworks' own plans are torch's.
DEEPSPEED_STRATEGIES = ("ds0", "ds1", "ds2", "ds3")
ALIASES = {"fsdp": "zero3", "dataparallel": "dp", "pipeline": "pipeline2", "split": "pipeline2",
           "naive-pipeline": "pipeline2", "zero": "zero3", "hybrid": "hsdp",
           "hybridshard": "hsdp",
           **{f"{word}{k}": f"ds{k}" for k in range(4)
              for word in ("deepspeed", "deepspeedzero", "dszero", "deepspeedstage")}}
DESCRIPTIONS = {
    "single": "one GPU",
    "ddp": "DistributedDataParallel: full replica per GPU",
    "dp": "nn.DataParallel: one process, GPU 0 gathers",
    "zero1": "ZeRO-1: optimizer state sharded (DDP + ZeroRedundancyOptimizer)",
    "zero2": "ZeRO-2: + gradients sharded",
    "zero3": "ZeRO-3 / FSDP FULL_SHARD: + parameters sharded",
    "pipeline2": "naive 2-GPU split: stages on cuda:0 and cuda:1",
    "hsdp": "hybrid sharding: ZeRO-3 within each node, replicas across nodes (FSDP HYBRID_SHARD)",
    "ds0": "DeepSpeed, ZeRO disabled (stage 0): its fp16/bf16 optimizer, fp32 master replicated",
    "ds1": "DeepSpeed ZeRO-1: fp32 master weights and optimizer state sharded",
    "ds2": "DeepSpeed ZeRO-2: + gradients reduced into per-rank partitions",
    "ds3": "DeepSpeed ZeRO-3: + 16-bit parameters partitioned, gathered per module",
}
ALL_STRATEGIES = STRATEGIES + NODE_STRATEGIES + DEEPSPEED_STRATEGIES


def parse_strategy(name: str) -> str:
    key = name.lower().replace("_", "").replace(" ", "").replace("-", "")
    key = ALIASES.get(key, key)
    if key not in ALL_STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of "
                         f"{', '.join(ALL_STRATEGIES)} (aliases: "
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
    # fp32 and the reduce-scatter in fp32 (mixed_precision_plan). DeepSpeed (ds0..ds3): its
    # fp16/bf16 mode, 16-bit model and gradients with fp32 master weights and optimizer state.
    mixed_precision: bool = False
    # DeepSpeed's zero_optimization settings (ds0..ds3 only; DeepSpeed's defaults)
    deepspeed: "DeepSpeedConfig | None" = None
    # zero3's FSDP: 2 is fully_shard (oomdoctor.plans.parallel.fsdp), 1 FullyShardedDataParallel
    # as accelerate's FSDP plugin and the Trainer run it (oomdoctor.plans.parallel.fsdp1)
    fsdp_version: int = 2
    # FSDP2's CPUOffloadPolicy (zero3/hsdp): sharded parameters, their gradients and the
    # optimizer on the host; each block copied to the GPU to be gathered. DeepSpeed's offload is
    # its config's (DeepSpeedConfig.offload_optimizer / offload_param).
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if self.name not in ALL_STRATEGIES:
            raise ValueError(f"unknown strategy {self.name!r}")
        if self.is_deepspeed and self.deepspeed is None:
            object.__setattr__(self, "deepspeed", DeepSpeedConfig())
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
        if self.fsdp_version not in (1, 2):
            raise ValueError(f"--fsdp-version is 1 or 2, not {self.fsdp_version}")
        if self.fsdp_version == 1 and self.name != "zero3":
            raise ValueError("--fsdp-version 1 models FSDP1's FULL_SHARD: use it with zero3 (fsdp)")
        if self.cpu_offload and (self.name not in ("zero3", "hsdp") or self.fsdp_version != 2):
            raise ValueError("--cpu-offload is FSDP2's CPUOffloadPolicy: zero3 or hsdp with "
                             "fully_shard; DeepSpeed's offload is set in its config "
                             "(zero_optimization.offload_optimizer / offload_param)")
        if self.mixed_precision and self.name not in ("zero3", "hsdp") \
                and not self.is_deepspeed:
            raise ValueError("a mixed-precision policy shards fp32 master weights: zero3 (FSDP), "
                             "hsdp or DeepSpeed's stages (ds0..ds3) only")

    @property
    def is_deepspeed(self) -> bool:
        return self.name in DEEPSPEED_STRATEGIES

    @property
    def zero_stage(self) -> int:
        """DeepSpeed's ZeRO stage (ds0..ds3)."""
        return int(self.name[-1]) if self.is_deepspeed else 0

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
        return self.num_gpus if self.name in ("ddp", "zero1", "zero2", "zero3", "hsdp",
                                              *DEEPSPEED_STRATEGIES) else 1


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
    """``strategy`` as the frameworks run ``precision`` on it (:func:`policy_applies`); DeepSpeed
    runs fp16 and bf16 in its own mode, always (engine.py: ``fp16``/``bf16`` enabled casts the
    model, the optimizer wrapper keeps fp32 master weights)."""
    if strategy.is_deepspeed:
        return replace(strategy, mixed_precision=precision in ("fp16", "bf16"))
    if policy_applies(strategy.name, precision) and not strategy.mixed_precision:
        return replace(strategy, mixed_precision=True)
    return strategy


def trace_precision(strategy: Strategy, precision: str) -> str:
    """The precision to trace ``strategy`` at ``precision``: a mixed-precision policy computes
    in pure bf16 (no autocast: the gathered weights are bf16); DeepSpeed's fp16/bf16 mode in
    pure 16 bits (the engine casts the model's parameters). Both cast every parameter, LoRA
    adapters included (configs.WRAPPER_CASTS)."""
    if strategy.is_deepspeed:
        if precision in ("bf16-pure", "fp16-pure"):
            raise ValueError(f"DeepSpeed's {precision[:4]} mode keeps fp32 master weights in its "
                             f"optimizer: give --precision {precision[:4]} (its config's "
                             f'"{precision[:4]}": {{"enabled": true}}), or fp32')
        return f"{precision}-cast" if strategy.mixed_precision else precision
    if strategy.mixed_precision:
        if precision != "bf16":
            raise ValueError(f"the FSDP mixed-precision policy is modelled for bf16 (param_dtype "
                             f"bfloat16), not {precision}")
        return "bf16-cast"
    return precision


def trace_config(strategy: Strategy, cfg: TraceConfig, precision: str | None = None
                 ) -> TraceConfig:
    """``cfg`` as ``strategy`` runs its step at ``precision`` (default ``cfg``'s): the traced
    precision (:func:`trace_precision`), and DeepSpeed ZeRO-3's module hooks and F.linear
    (TraceConfig zero3_hooks, oomdoctor.sim.zero3), which stage 3 puts on every module."""
    return replace(cfg, precision=trace_precision(strategy, precision or cfg.precision),
                   zero3_hooks=strategy.is_deepspeed and strategy.zero_stage == 3)


POLICY_NOTE = ("FSDP2 MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch."
               "float32): trainable parameters, their gradients and AdamW state sharded in fp32, "
               "frozen ones in the dtype they were loaded in; each block all-gathered and "
               "computed in bf16 (no autocast), gradients reduce-scattered in fp32")


@dataclass(frozen=True)
class DeepSpeedConfig:
    """The ``zero_optimization`` settings that size DeepSpeed's buffers, with its defaults
    (deepspeed/runtime/zero/config.py: DeepSpeedZeroConfig). Sizes are elements."""

    reduce_bucket_size: int = 500_000_000
    allreduce_bucket_size: int = 500_000_000     # stage 0's gradient all-reduce (engine)
    overlap_comm: bool | None = None             # None: True at stage 3 only (overlap_comm_valid)
    sub_group_size: int = 1_000_000_000
    prefetch_bucket_size: int = 50_000_000       # stage3_prefetch_bucket_size
    param_persistence_threshold: int = 100_000   # stage3_param_persistence_threshold
    max_reuse_distance: int = 1_000_000_000      # stage3_max_reuse_distance
    max_live_parameters: int = 1_000_000_000     # stage3_max_live_parameters
    contiguous_gradients: bool = True
    # Stage 0's fp16/bf16 wrapper (engine.py _configure_fp16_optimizer): FP16_Optimizer, flat,
    # for DeepSpeed's FusedAdam (the config's Adam/AdamW, or a client FusedAdam as
    # DeepSpeed-Chat passes); FP16_UnfusedOptimizer, per parameter, for any other (torch_adam,
    # a torch optimizer).
    fused_optimizer: bool = True
    auto: tuple[str, ...] = ()                   # keys the config left "auto" (defaults used)
    release: str = ""                            # DeepSpeed's version; "" the installed one,
                                                 # else NEWEST_DEEPSPEED
    # zero_optimization.offload_optimizer / offload_param with "device": "cpu" (ZeRO-Offload;
    # stage 3's parameters too)
    offload_optimizer: bool = False
    offload_param: bool = False

    def overlap(self, stage: int) -> bool:
        return stage == 3 if self.overlap_comm is None else self.overlap_comm

    @property
    def version(self) -> tuple[int, ...]:
        return deepspeed_release(self.release) if self.release else installed_deepspeed()

    @property
    def buckets_at_first_gradient(self) -> bool:
        """Where ZeRO-1/2 allocate their reduce buckets: from 0.18.3 (DeepSpeed PR #7665,
        "PyTorch-compatible backward API") ``setup_buckets`` at the first gradient's hook;
        before it, ``DeepSpeedZeroOptimizer.backward`` before the loss's backward starts."""
        return self.version >= (0, 18, 3)


# The DeepSpeed release this model follows (deepspeed/runtime as of it, and the H200 runs of
# benchmarks/results/deepspeed/) when none is installed or named.
NEWEST_DEEPSPEED = (0, 19, 8)


def deepspeed_release(text: str) -> tuple[int, ...]:
    """``0.9.2`` (or ``0.18``) as a comparable tuple; a ValueError that says what it takes."""
    parts = text.strip().lstrip("v").split("+")[0].split(".")
    if not 1 < len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"DeepSpeed release {text!r}: give it as 0.9.2 or 0.18")
    return tuple(int(p) for p in parts) + (0,) * (3 - len(parts))


@functools.lru_cache(maxsize=1)
def installed_deepspeed() -> tuple[int, ...]:
    """The installed DeepSpeed's release, else :data:`NEWEST_DEEPSPEED`."""
    try:
        return deepspeed_release(importlib.metadata.version("deepspeed"))
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return NEWEST_DEEPSPEED


# zero_optimization keys -> DeepSpeedConfig fields
_DS_KEYS = {"reduce_bucket_size": "reduce_bucket_size",
            "allreduce_bucket_size": "allreduce_bucket_size",
            "overlap_comm": "overlap_comm", "sub_group_size": "sub_group_size",
            "stage3_prefetch_bucket_size": "prefetch_bucket_size",
            "stage3_param_persistence_threshold": "param_persistence_threshold",
            "stage3_max_reuse_distance": "max_reuse_distance",
            "stage3_max_live_parameters": "max_live_parameters",
            "contiguous_gradients": "contiguous_gradients"}


@dataclass(frozen=True)
class DeepSpeedRun:
    """What a DeepSpeed config file says about memory: the ZeRO stage, the precision mode and
    the buffer sizes."""

    stage: int
    precision: str | None          # fp16 | bf16 | None (neither enabled: fp32)
    config: DeepSpeedConfig

    @property
    def strategy(self) -> str:
        return f"ds{self.stage}"


def read_deepspeed_config(doc: dict, source: str = "the DeepSpeed config") -> DeepSpeedRun:
    """A DeepSpeed JSON config (as ``deepspeed.initialize(config=...)`` or the Trainer's
    ``--deepspeed`` takes it). CPU offload is followed; NVMe offload is refused. ``"auto"``
    (the Trainer fills it in) keeps DeepSpeed's default, and says so."""
    zero = doc.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage == "auto" or stage not in (0, 1, 2, 3):
        raise ValueError(f"{source}: zero_optimization.stage is {stage!r}; give 0, 1, 2 or 3")
    offload = _offload(zero, stage, source)
    # "bfloat16" is the old key of "bf16" (deepspeed/runtime/constants.py BFLOAT16_OLD)
    enabled = [p for p in ("fp16", "bf16") if any(
        (doc.get(k) or {}).get("enabled") in (True, "auto")
        for k in ((p, "bfloat16") if p == "bf16" else (p,)))]
    if len(enabled) > 1:
        raise ValueError(f"{source}: both fp16 and bf16 are enabled; DeepSpeed allows one")
    values, auto = {}, []
    for key, field in _DS_KEYS.items():
        if key in zero:
            if zero[key] == "auto":
                auto.append(key)
            elif field in ("overlap_comm", "contiguous_gradients"):
                values[field] = bool(zero[key])
            else:
                try:
                    values[field] = int(float(zero[key]))
                except (TypeError, ValueError):
                    raise ValueError(f"{source}: zero_optimization.{key} is {zero[key]!r}; "
                                     "give it as a number of elements (5e7), or \"auto\"") \
                        from None
    return DeepSpeedRun(stage, enabled[0] if enabled else None,
                        DeepSpeedConfig(**values, fused_optimizer=_fused_optimizer(doc),
                                        auto=tuple(auto), **offload))


def _offload(zero: dict, stage: int, source: str) -> dict[str, bool]:
    """The config's CPU offload, as DeepSpeed accepts it (zero/config.py, offload_config.py):
    the optimizer from stage 1, the parameters at stage 3 only."""
    out = {}
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device in ("none", None):
            continue
        if device != "cpu":
            raise ValueError(f"{source}: zero_optimization.{key} puts state on {device!r}; "
                             "oomdoctor follows CPU offload, not NVMe - estimate it with "
                             '"device": "cpu" (the GPU holds the same)')
        if stage < (3 if key == "offload_param" else 1):
            raise ValueError(f"{source}: zero_optimization.{key} needs ZeRO stage "
                             f"{3 if key == 'offload_param' else '1 or more'}, not {stage}")
        out[key] = True
    return out


def _fused_optimizer(doc: dict) -> bool:
    """Whether the config's optimizer is DeepSpeed's FusedAdam (engine.py
    _configure_basic_optimizer: Adam/AdamW unless ``torch_adam``; the 1-bit Adams count as
    fused too). Without an optimizer section the client's is used: FusedAdam assumed, as
    DeepSpeed's examples pass it."""
    opt = doc.get("optimizer")
    if not opt:
        return True
    kind = str(opt.get("type", "")).lower()
    if kind in ("onebitadam", "zerooneadam"):
        return True
    return kind in ("adam", "adamw") and not (opt.get("params") or {}).get("torch_adam", False)
