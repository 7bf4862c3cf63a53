"""Data-parallel strategies as per-GPU event lists: DDP, DataParallel, ZeRO-1/2/3 (FSDP)."""
from __future__ import annotations

from collections import defaultdict

# DDP's constants and bucket sizes live with the script's DDP stand-in (re-exported here, as
# oomdoctor.plans.parallel exposes them).
from oomdoctor.sim.ddp import (DDP_BROADCAST_BUCKET_BYTES, DDP_BUCKET_BYTES,  # noqa: F401
                               DDP_FIRST_BUCKET_BYTES, chunks as _chunks, ddp_buckets)
from oomdoctor.plans.parallel.events import _base, _Context, _Gpu
from oomdoctor.plans.parallel.fsdp import _shard, fsdp
from oomdoctor.plans.parallel.fsdp1 import fsdp1
from oomdoctor.plans.parallel.results import prose_size
from oomdoctor.plans.parallel.strategy import Strategy
from oomdoctor.sim.trace import Category, Phase


# DataParallel: torch/nn/parallel/comm.py: broadcast_coalesced / reduce_add_coalesced
# (buffer_size=10485760).
DP_COALESCE_BYTES = 10 * 1024 * 1024


def _add_ddp(ctx: _Context, g: _Gpu, bucket_view: bool) -> list[str]:
    """DDP's own allocations on one rank."""
    notes = []
    grads = ctx.gradients_in_order()
    if not grads:
        return notes
    t0 = ctx.setup_end - 0.5
    # Start-up: parameters and buffers broadcast from rank 0 in 250 MiB coalesced chunks.
    states = [ctx.size[s.handle] for s in ctx.storages if s.phase is Phase.SETUP]
    for n in _chunks(states, DDP_BROADCAST_BUCKET_BYTES):
        g.add("communication", n, t0, t0)
    # One bucket with every gradient until the buckets are rebuilt before the second forward.
    fwd = ctx.timing.marks_of(Phase.FORWARD)
    second = next((ctx.timing.phases[ph][0] for ph in fwd
                   if ctx.timing.phases[ph][2].iteration == 1), None)
    rebuild_at = second - 0.5 if second is not None else None
    g.add("communication", sum(grads), t0, rebuild_at)
    if rebuild_at is not None:
        for n in ddp_buckets(grads):
            g.add("communication", n, rebuild_at, None)
    # Buffers are broadcast before every forward (broadcast_buffers=True).
    buffers = [ctx.size[s.handle] for s in ctx.storages
               if s.phase is Phase.SETUP and s.category is Category.BUFFERS]
    if buffers:
        for ph in fwd:
            start = ctx.timing.phases[ph][0] - 0.4
            for n in _chunks(buffers, DDP_BROADCAST_BUCKET_BYTES):
                g.add("communication", n, start, start)
    if bucket_view:
        notes.append("gradient_as_bucket_view=True: gradients are views into the buckets")
    else:
        notes.append(f"DDP gradient buckets hold a second copy of the gradients "
                     f"({prose_size(sum(grads))}); pass gradient_as_bucket_view=True to DDP to drop it")
    return notes


def _ddp(ctx: _Context, strategy: Strategy) -> tuple[list[_Gpu], list[str]]:
    g = _Gpu("each GPU", ctx.first_handle)
    ctx.workspaces(g)
    _base(ctx, g, keep=lambda s: not (strategy.bucket_view
                                      and s.category is Category.GRADIENTS))
    notes = _add_ddp(ctx, g, strategy.bucket_view)
    notes.append(f"DDP does not lower per-GPU memory: each of the {strategy.num_gpus} GPUs holds "
                 "the whole model, its gradients and optimizer state; it multiplies throughput "
                 f"(effective batch = micro-batch x {strategy.num_gpus} x accumulation)")
    return [g], notes


def _dp(ctx: _Context, strategy: Strategy) -> tuple[list[_Gpu], list[str]]:
    n = strategy.num_gpus
    tl = ctx.timing
    g0 = _Gpu("GPU 0", ctx.first_handle)
    ctx.workspaces(g0)

    def outside(s) -> bool:       # runs on GPU 0 for the whole batch
        return s.phase is Phase.DATA or (s.phase is Phase.FORWARD and not s.module)

    _base(ctx, g0, size=lambda s: ctx.size_dp[s.handle] if outside(s) else ctx.size[s.handle])
    lay = ctx.layout
    out_b = max(0, lay.output_bytes_at_1 + lay.output_bytes_per_sample
                * (ctx.trace.config.batch_size - 1))
    params = ctx.param_bytes()
    grads = sum(ctx.gradients_in_order())
    for ph in tl.marks_of(Phase.FORWARD):
        start, stop, _ = tl.phases[ph]
        # Replicas each forward: broadcast_coalesced flattens 10 MiB chunks on GPU 0.
        g0.add("communication", min(DP_COALESCE_BYTES, params), start - 0.3, start - 0.3)
        # Gathered outputs of all replicas, used by the loss on GPU 0.
        g0.add("activations", out_b * n, stop - 0.6, stop - 0.2)
    for ph in tl.marks_of(Phase.BACKWARD):
        _, stop, _ = tl.phases[ph]
        # Gradients summed onto GPU 0 (ReduceAddCoalesced, 10 MiB chunks per device).
        g0.add("communication", min(DP_COALESCE_BYTES, grads) * n, stop - 0.5, stop - 0.5)
    gk = _Gpu("GPU 1..", ctx.first_handle)
    ctx.workspaces(gk)
    fwd_phases = tl.marks_of(Phase.FORWARD)
    replicas = [ctx.size[s.handle] for s in ctx.storages if s.phase is Phase.SETUP]
    for ph in fwd_phases:
        start = tl.phases[ph][0]
        bw = tl.backward_of(ph)
        end = tl.phases[bw][1] - 0.5 if bw is not None else tl.phases[ph][1]
        for nb in replicas:
            gk.add("parameters", nb, start - 0.2, end)
    for s in ctx.storages:
        if s.phase in (Phase.SETUP, Phase.OPTIMIZER, Phase.ZERO_GRAD):
            continue
        if s.phase is Phase.FORWARD and not s.module:
            continue                            # the loss runs on GPU 0
        free = s.t_free
        if s.category is Category.GRADIENTS:
            bw = tl.phase_index(s.t_alloc)
            free = tl.phases[bw][1] - 0.4       # summed onto GPU 0 at the end of backward
        gk.add(ctx.key(s.handle), ctx.size[s.handle], s.t_alloc, free, s.handle)
    notes = [f"DataParallel puts the optimizer, the whole batch, the {n} gathered outputs and the "
             "loss on GPU 0 and copies the parameters to every GPU each forward: GPU 0 "
             "carries the most; use DistributedDataParallel (one process per GPU, no GPU-0 "
             "hot spot, does not need P2P: DataParallel hangs or crawls on boards whose GPUs "
             "report P2P 'Not Supported')"]
    return [g0, gk], notes


def zero_partition(numels: list[int], world: int) -> list[int]:
    """Rank of each parameter under ZeroRedundancyOptimizer: largest first, each to the rank with
    the fewest elements so far (zero_redundancy_optimizer.py _partition_parameters)."""
    sizes = [0] * world
    rank = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        r = min(range(world), key=lambda r: sizes[r])
        rank[i] = r
        sizes[r] += numels[i]
    return rank


def _zero(ctx: _Context, strategy: Strategy, stage: int) -> tuple[list[_Gpu], list[str]]:
    n = strategy.num_gpus
    tl = ctx.timing
    lay = ctx.layout
    notes: list[str] = []
    if stage == 1:
        # Whole parameters per rank: the ranks differ, so each is its own event list.
        trainable = [i for i in range(lay.num_param_storages) if lay.param_trainable[i]]
        ranks = zero_partition([lay.param_numel[i] for i in trainable], n)
        owner_rank = dict(zip(trainable, ranks))
        gpus = []
        for r in range(n):
            g = _Gpu(f"GPU {r}", ctx.first_handle)
            ctx.workspaces(g)

            def keep(s, r=r):
                if s.phase is not Phase.OPTIMIZER:
                    return True
                p = ctx.opt_param.get(s.handle)
                return p is None or owner_rank.get(p, 0) == r
            _base(ctx, g, keep=keep)
            notes = _add_ddp(ctx, g, strategy.bucket_view)
            gpus.append(g)
        notes.append("ZeRO-1 as PyTorch runs it: DDP (with its buckets) + ZeroRedundancyOptimizer, "
                     "which gives each rank whole parameters (largest first), so ranks differ")
        return gpus, notes

    if stage == 3:
        return fsdp1(ctx, strategy) if strategy.fsdp_version == 1 else fsdp(ctx, strategy)
    g = _Gpu("each GPU", ctx.first_handle)
    ctx.workspaces(g)
    reduce_at: dict[float, int] = defaultdict(int)       # window end -> unsharded gradient bytes
    for s in ctx.storages:
        h, size = s.handle, ctx.size[s.handle]
        key = ctx.key(h)
        if s.phase is Phase.OPTIMIZER or s.category is Category.OPTIMIZER_STATE:
            g.add(key, _shard(size, n), s.t_alloc, s.t_free, h)
        elif s.category is Category.GRADIENTS and tl.phase_of(s.t_alloc) is Phase.BACKWARD:
            # Full size until its block's backward is done, then reduce-scattered to a shard.
            ph = tl.phase_index(s.t_alloc)
            owner = tl.grad_owner.get(h)
            win = tl.block_window(ph, lay.param_owner[owner]) if owner is not None else None
            win = win or tl.window(s.t_alloc)
            done = win[1] if win else tl.phases[ph][1]
            if s.t_free is not None and s.t_free <= done:
                g.add(key, size, s.t_alloc, s.t_free, h)
                continue
            g.add(key, size, s.t_alloc, done - 0.2, h)
            g.add(key, _shard(size, n), done - 0.2, s.t_free)
            reduce_at[done] += size
        else:
            g.add(key, size, s.t_alloc, s.t_free, h)
    # The block's unsharded gradients copied into one reduce-scatter input while still alive.
    for done, nbytes in reduce_at.items():
        g.add("communication", _shard(nbytes, n) * n, done - 0.3, done - 0.1)
    notes.append("ZeRO-2 as DeepSpeed runs it: parameters replicated, gradients reduce-"
                 "scattered block by block, optimizer state sharded")
    return [g], notes
