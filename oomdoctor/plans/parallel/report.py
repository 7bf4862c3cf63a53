"""The `parallel` and `split` commands' library entry points for a model source: every
strategy, or the best split (a training script's: :mod:`oomdoctor.plans.parallel.scripts`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterable

from oomdoctor.configs import needs_bf16, no_bf16_fix
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.plans.estimate import Budget, allocator_conf_string, trace_for
from oomdoctor.models.spec import ModelSpec
from oomdoctor.plans.parallel.estimator import estimate_strategy
from oomdoctor.plans.parallel.layout import model_layout
from oomdoctor.plans.parallel.results import Partition, StrategyEstimate
from oomdoctor.plans.parallel.strategy import (DEEPSPEED_STRATEGIES, STRATEGIES,
                                              DeepSpeedConfig, Strategy, default_policy,
                                              parse_strategy, trace_config)
from oomdoctor.plans.parallel.timeline import Sizes
from oomdoctor.sim.trace import TraceConfig


Progress = Callable[[str], None]
# Among strategies that fit at the same samples per step, the one to prefer: least
# communication first (DDP), then more sharding, then DataParallel (one process, GPU 0 gathers)
# and the naive split (one GPU busy at a time). `oomdoctor recommend` ranks by step time.
PREFERENCE = ("ddp", "zero1", "zero2", "zero3", "dp", "pipeline2", "single")


@dataclass(frozen=True)
class ParallelReport:
    """Every requested strategy at one configuration."""

    model: str
    gpu: str
    num_gpus: int
    device_total_bytes: int
    budget_bytes: int
    micro_batch: int
    precision: str
    checkpointing: bool
    num_parameters: int
    estimates: tuple[StrategyEstimate, ...]
    errors: tuple[tuple[str, str], ...] = ()
    allocator: str = ""            # the PYTORCH_CUDA_ALLOC_CONF assumed ("": PyTorch's defaults)
    # strategies that do not fit as assumed but would with expandable segments: (strategy,
    # the fullest GPU's peak there)
    expandable_fits: tuple[tuple[str, int], ...] = ()
    link: str = ""                 # the GPU-to-GPU link assumed (pcie-no-p2p | pcie | nvlink)

    @property
    def fitting(self) -> tuple[str, ...]:
        return tuple(e.strategy for e in self.estimates if e.fits)

    @property
    def not_fitting(self) -> tuple[str, ...]:
        return tuple(e.strategy for e in self.estimates if not e.fits)

    @property
    def best(self) -> str | None:
        """The fitting strategy that trains the most samples per step with the least
        communication and idle time (PREFERENCE); None when nothing fits."""
        fit = [e for e in self.estimates if e.fits]
        if not fit:
            return None
        return min(fit, key=lambda e: (-e.effective_batch,
                                       PREFERENCE.index(e.strategy)
                                       if e.strategy in PREFERENCE else len(PREFERENCE))).strategy

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.gpu, "num_gpus": self.num_gpus,
                "device_total_bytes": self.device_total_bytes, "budget_bytes": self.budget_bytes,
                "micro_batch": self.micro_batch, "precision": self.precision,
                "checkpointing": self.checkpointing, "num_parameters": self.num_parameters,
                "strategies": [e.to_json() for e in self.estimates],
                "errors": [{"strategy": s, "error": m} for s, m in self.errors],
                "allocator": self.allocator, "link": self.link,
                "fits_with_expandable_segments": [{"strategy": s, "peak_device_bytes": b}
                                                  for s, b in self.expandable_fits],
                "fits": list(self.fitting), "does_not_fit": list(self.not_fitting),
                "best": self.best}


def estimate_strategies(spec: ModelSpec, cfg: TraceConfig, budget: Budget, num_gpus: int,
                        strategies: Iterable[str] = STRATEGIES,
                        alloc: AllocatorConfig = AllocatorConfig(), bucket_view: bool = False,
                        progress: Progress = lambda _: None,
                        mixed_precision: bool = False,
                        deepspeed: DeepSpeedConfig | None = None,
                        fsdp_version: int = 2, cpu_offload: bool = False) -> ParallelReport:
    """Trace ``cfg`` (its batch_size is the micro-batch per GPU) and estimate every strategy;
    ``mixed_precision``: zero3 under FSDP2's bf16 MixedPrecisionPolicy (strategy.py), traced
    apart in pure bf16; DeepSpeed's stages (ds0..ds3) run fp16/bf16 in DeepSpeed's own mode,
    traced in pure 16 bits, with ``deepspeed``'s buffer sizes; ``fsdp_version``: zero3 as FSDP2
    (fully_shard) or FSDP1 (FullyShardedDataParallel, oomdoctor.plans.parallel.fsdp1);
    ``cpu_offload``: zero3 under FSDP2's CPUOffloadPolicy."""
    if needs_bf16(cfg.precision) and not budget.gpu.bf16:
        raise ValueError(f"{budget.gpu.name} has no bf16 support; {no_bf16_fix(cfg.precision)}")
    names = [parse_strategy(s) for s in strategies]
    plans = {name: _strategy(name, num_gpus, cfg.precision, bucket_view, mixed_precision,
                             deepspeed, fsdp_version, cpu_offload) for name in names}
    inputs = _Inputs(spec, cfg, budget, progress)
    if "dp" in names and num_gpus > 1:
        inputs.with_dataparallel(num_gpus)
    out, errors = [], []
    for name, st in plans.items():
        if name == "pipeline2" and num_gpus != 2:
            errors.append((name, "the naive split uses exactly 2 GPUs"))
            continue
        try:
            trace, layout, sizes = inputs.of(trace_config(st, cfg))
            progress(f"{name}: replaying {st.num_gpus} GPU(s)")
            out.append(estimate_strategy(trace, layout, st, budget, alloc, sizes,
                                         grad_accum=cfg.grad_accum))
        except ValueError as e:
            errors.append((name, str(e)))
    expandable = _expandable_fits(out, plans, cfg, budget, alloc, inputs)
    # any traced precision's layout counts the same parameters
    layouts = [layout for _, layout, _ in inputs.done.values()]
    num_parameters = (layouts[0] if layouts else model_layout(spec, cfg.precision)).num_parameters
    return ParallelReport(spec.name, budget.gpu.name, num_gpus, budget.gpu.total_bytes,
                          budget.limit_bytes, cfg.batch_size, cfg.precision, cfg.checkpointing,
                          num_parameters, tuple(out), tuple(errors),
                          allocator_conf_string(alloc), expandable)


def _strategy(name: str, num_gpus: int, precision: str, bucket_view: bool,
              mixed_precision: bool, deepspeed: DeepSpeedConfig | None,
              fsdp_version: int = 2, cpu_offload: bool = False) -> Strategy:
    """One named strategy as it runs ``precision``: FSDP2's policy and CPU offload where asked
    (zero3), DeepSpeed's fp16/bf16 mode on its stages."""
    st = Strategy(name, 1 if name == "single" else num_gpus, bucket_view,
                  mixed_precision=mixed_precision and name == "zero3",
                  deepspeed=deepspeed if name in DEEPSPEED_STRATEGIES else None,
                  fsdp_version=fsdp_version if name == "zero3" else 2,
                  cpu_offload=cpu_offload and name == "zero3")
    return default_policy(st, precision) if st.is_deepspeed else st


class _Inputs:
    """The traces, layouts and storage sizes the strategies replay, one set per traced
    precision (the policy's and DeepSpeed's fp16/bf16 modes compute in pure 16 bits)."""

    def __init__(self, spec: ModelSpec, cfg: TraceConfig, budget: Budget,
                 progress: Progress) -> None:
        self.spec, self.cfg, self.budget, self.progress = spec, cfg, budget, progress
        self.done: dict[str, tuple] = {}
        self.dataparallel = 0

    def with_dataparallel(self, num_gpus: int) -> None:
        """DataParallel's GPU 0 carries the whole batch: sizes from a second trace."""
        self.dataparallel = num_gpus

    def of(self, cfg: TraceConfig) -> tuple:
        """(trace, layout, sizes) of the step as a strategy runs it (``trace_config``): one
        per traced precision and ZeRO-3's hooks."""
        key = (cfg.precision, cfg.zero3_hooks)
        if key not in self.done:
            precision = cfg.precision
            self.progress(f"tracing {self.spec.name} at micro-batch {cfg.batch_size} "
                          f"({precision}{', checkpointing' if cfg.checkpointing else ''})")
            trace = trace_for(self.spec, cfg, self.budget.gpu)
            sizes = Sizes.of(trace)
            if self.dataparallel and precision == self.cfg.precision:
                self.progress(f"tracing micro-batch {cfg.batch_size * self.dataparallel} for "
                              "DataParallel's GPU 0")
                big = trace_for(self.spec, replace(cfg, batch_size=cfg.batch_size
                                                   * self.dataparallel), self.budget.gpu)
                sizes = Sizes.affine(trace, big) or sizes
            self.progress("laying out blocks, block inputs and FLOPs")
            self.done[key] = (trace, model_layout(self.spec, precision), sizes)
        return self.done[key]


def _expandable_fits(out: list[StrategyEstimate], plans: dict[str, Strategy], cfg: TraceConfig,
                     budget: Budget, alloc: AllocatorConfig, inputs: _Inputs
                     ) -> tuple[tuple[str, int], ...]:
    """The strategies that do not fit under ``alloc`` but would with expandable segments (the
    setting `recommend` launches with), each replayed again from the same traces."""
    if alloc.expandable_segments:
        return ()
    roomy = replace(alloc, expandable_segments=True)
    found = []
    for e in out:
        if e.fits or e.strategy == "pipeline2":
            continue
        st = plans[e.strategy]
        trace, layout, sizes = inputs.of(trace_config(st, cfg))
        again = estimate_strategy(trace, layout, st, budget, roomy, sizes,
                                  grad_accum=cfg.grad_accum)
        if again.fits:
            found.append((e.strategy, again.peak_device_bytes))
    return tuple(found)


@dataclass(frozen=True)
class SplitPlan:
    """The `split` command's result: the partition and both stages' memory."""

    estimate: StrategyEstimate
    partition: Partition
    layout_blocks: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        p = self.partition
        return {"model": self.estimate.model, "gpu": self.estimate.gpu,
                "micro_batch": self.estimate.micro_batch,
                "precision": self.estimate.precision,
                "checkpointing": self.estimate.checkpointing,
                "fits": self.estimate.fits,
                "stages": [{"gpu": k, "modules": list(p.stages[k]),
                            "utilisation": p.utilisation[k],
                            **asdict(self.estimate.gpus[k])} for k in range(2)],
                "main_device": p.main_stage, "device_map": p.device_map,
                "boundary_bytes": p.boundary_bytes, "notes": list(self.estimate.notes)}


def plan_split(spec: ModelSpec, cfg: TraceConfig, budget: Budget,
               alloc: AllocatorConfig = AllocatorConfig(),
               progress: Progress = lambda _: None) -> SplitPlan:
    """Trace ``cfg`` and find the two-GPU split whose larger stage peak is smallest."""
    if needs_bf16(cfg.precision) and not budget.gpu.bf16:
        raise ValueError(f"{budget.gpu.name} has no bf16 support; {no_bf16_fix(cfg.precision)}")
    progress(f"tracing {spec.name} at batch {cfg.batch_size}")
    trace = trace_for(spec, cfg, budget.gpu)
    progress("laying out blocks and what crosses between them")
    layout = model_layout(spec, cfg.precision)
    progress(f"trying {max(len(layout.blocks) - 1, 0)} cuts")
    e = estimate_strategy(trace, layout, Strategy("pipeline2", 2), budget, alloc,
                          grad_accum=cfg.grad_accum)
    assert e.partition is not None
    return SplitPlan(e, e.partition, layout.blocks)
