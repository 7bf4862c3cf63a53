"""What DeepSpeed stores for a model's parameters, and when its gradient hooks run: the two
things every part of :mod:`oomdoctor.plans.parallel.deepspeed`'s replay reads."""
from __future__ import annotations

import bisect

from oomdoctor.plans.parallel.events import _Context
from oomdoctor.plans.parallel.fsdp import _shard
from oomdoctor.plans.parallel.strategy import MASTER_SCALE, DeepSpeedConfig, Strategy
from oomdoctor.sim.trace import Category

_FP32 = 4


class _Model:
    """The trainable parameters' sizes as traced, and what DeepSpeed stores for them."""

    def __init__(self, ctx: _Context, strategy: Strategy) -> None:
        lay = ctx.layout
        self.stage = strategy.zero_stage
        self.world = strategy.num_gpus
        self.ds: DeepSpeedConfig = strategy.deepspeed
        self.mixed = strategy.mixed_precision
        handle = {i: h for h, i in ctx.param_index.items() if i < lay.num_param_storages}
        self.itemsize = {i: ctx.trace.storages[h].nbytes / max(1, lay.param_numel[i])
                         for i, h in handle.items()}
        trainable = sorted(i for i in handle if lay.param_trainable[i])   # the model's order
        self.numels = [lay.param_numel[i] for i in trainable]
        self.numel = sum(self.numels)
        self.grad_bytes = sum(ctx.trace.storages[handle[i]].nbytes for i in trainable)
        self.grad_itemsize = round(self.grad_bytes / self.numel) if self.numel else 2
        self.persistent = {handle[i] for i in handle
                           if lay.param_numel[i] < self.ds.param_persistence_threshold}
        self._trainable = {handle[i] for i in trainable}
        fused = self.mixed and self.ds.fused_optimizer
        # FP16_Optimizer (stage 0, fused) and DeepSpeedZeroOptimizer (stages 1-2) flatten the
        # 16-bit parameters into one buffer; stage 3 partitions them instead
        self.flattens = self.stage in (1, 2) or (self.stage == 0 and fused)
        # stage 3 moves its partitions into one buffer (_create_fp16_partitions_with_
        # defragmentation); the parameters it keeps whole stay where they are
        self.defragments = self.stage == 3
        # ... and their optimizer steps flat fp32 partitions (stage 3 too)
        self.flat_optimizer = self.stage >= 1 or (self.stage == 0 and fused)
        self.offload_opt = self.ds.offload_optimizer and self.stage >= 1
        self.offload_param = self.ds.offload_param and self.stage == 3

    def trainable(self, h: int) -> bool:
        return h in self._trainable

    @property
    def optimizer_world(self) -> int:
        """Ranks the master weights and optimizer state are split over."""
        return self.world if self.stage >= 1 else 1

    def state_scale(self, i: int | None) -> float:
        """fp32 state per traced byte of optimizer state (16 bits in the trace)."""
        if not self.mixed:
            return 1
        return MASTER_SCALE if i is None or self.itemsize.get(i) == 2 else 1

    def local_numel(self) -> int:
        """Trainable elements this rank's optimizer owns."""
        return _shard(self.numel, self.optimizer_world)

    def chunks(self) -> list[int]:
        """The rank's partition as the optimizer steps it: stage 3 in sub-groups of whole
        parameters, each closed once it reaches ``sub_group_size`` elements (stage3.py
        ``_create_fp16_sub_groups``), else whole."""
        if self.stage != 3:
            return [self.local_numel()]
        out, size = [], 0
        for n in self.numels:
            size += _shard(n, self.world)
            if size >= self.ds.sub_group_size:
                out.append(size)
                size = 0
        return out + [size] if size or not out else out

    def bucket_bytes(self) -> int:
        return self.ds.reduce_bucket_size * self.grad_itemsize


class _Hooks:
    """When DeepSpeed's gradient hook runs for a gradient the trace allocated at ``t``: after
    autograd's node that made it has returned and released its inputs (AccumulateGrad, then
    the post-accumulate hook), so just before the next allocation that is not itself a
    gradient. Measured on an H200 (benchmarks/results/deepspeed/traces/zero2-bf16-*): the
    output projection's weight gradient, then its bias gradient, the logits' gradient freed,
    and only then ``setup_buckets`` allocates the reduce bucket."""

    def __init__(self, ctx: _Context) -> None:
        self._allocs = sorted(s.t_alloc for s in ctx.storages
                              if s.category is not Category.GRADIENTS)
        self._every = sorted(s.t_alloc for s in ctx.storages)
        self._timing = ctx.timing

    def ready(self, t: float) -> float:
        i = bisect.bisect_right(self._allocs, t)
        nxt = self._allocs[i] if i < len(self._allocs) else self._timing.end
        hi = self._timing.phases[self._timing.phase_index(t)][1]
        return min(nxt - 0.5, hi - 0.45)   # before the epilogue's buffers (hi - 0.31 ..)

    def moved(self, t: float, src: int, dst: int) -> float:
        """Position ``t`` of phase ``src`` at the same allocation ordinal in phase ``dst``: an
        accumulating backward runs the same ops as the first (the trace accumulates into the
        gradients the first made, where DeepSpeed, having dropped them, gets new ones)."""
        (a, _, _), (b, hi, _) = self._timing.phases[src], self._timing.phases[dst]
        every = self._every           # counted with the gradients: accumulated, they are
        k = bisect.bisect_right(every, t) - bisect.bisect_left(every, a)   # temporaries there
        i = bisect.bisect_left(every, b) + k
        at = every[i] - 0.5 if i < len(every) else hi
        return min(at, hi - 0.45)
