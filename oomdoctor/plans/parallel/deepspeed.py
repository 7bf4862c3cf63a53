"""DeepSpeed's ZeRO stages 0-3 as its engine runs them, as one rank's event list.

    oomdoctor parallel model.py --gpus 4 --strategy ds3 --precision bf16 --ds-config ds.json

DeepSpeed's ``fp16``/``bf16`` modes are neither autocast nor pure 16-bit training: the engine
casts the model's parameters to 16 bits (engine.py ``_configure_distributed_model``), so the
forward, the backward and the gradients are 16-bit, and the optimizer wrapper keeps fp32 master
weights and runs the optimizer on them. The step is therefore traced in pure 16 bits
(:func:`~oomdoctor.plans.parallel.strategy.trace_precision`) and rewritten here, after
deepspeed/runtime 0.19.8, checked event by event against its allocator on an H200
(benchmarks/results/deepspeed/, tests/test_deepspeed_gpu.py):

- **Master weights and optimizer state.** Stage 0: ``FP16_Optimizer`` (fp16/fused_optimizer.py,
  for DeepSpeed's FusedAdam) keeps one flat fp32 copy of every parameter and the optimizer's
  state on it, whole on every rank; ``FP16_UnfusedOptimizer`` (any other optimizer) one fp32
  copy per parameter. Stages 1-2: ``DeepSpeedZeroOptimizer`` (zero/stage_1_and_2.py) keeps
  this rank's partition (``single_partition_of_fp32_groups``); stage 3 one per sub-group of
  whole parameters reaching ``sub_group_size`` elements (``fp32_partitioned_groups_flat``).
  The optimizer steps these flat tensors, so each state slot is one flat fp32 tensor (per
  sub-group), sharded from stage 1.
- **Start-up.** Stages 0 (fused) to 2 flatten the 16-bit parameters into one buffer; stage 3
  moves its partitions to the host, empties the cache and makes one buffer of them. Each
  master partition is made through a transient copy, and ``initialize_optimizer_states``
  gives the masters a zero fp32 gradient; these leave the cached segments the first forward
  reuses.
- **Gradients.** A gradient's hook runs when autograd has finished the node that made it.
  Stage 0: 16-bit, whole, all-reduced at the end of the backward through one flat bucket
  (``buffered_allreduce_fallback``, on one GPU too). Stage 1: whole until the backward ends,
  then reduced into this rank's partition (``grads_in_partition``, 16-bit, 1/N). Stage 2:
  each gradient is copied into the reduce bucket (``reduce_bucket_size`` elements, two with
  ``overlap_comm``) by its hook and its own storage dropped
  (``reduce_independent_p_g_buckets_and_remove_grads``); the bucket is made by the first hook
  from 0.18.3, as the backward starts before (``--deepspeed``); the partition by the first
  reduce (the bucket full, or the backward's end). Stage 3: the same into its one bucket
  (allocated at start-up), reduced into ``grad_partitions_flat_buffer`` (1/N, at start-up).
- **The step.** The gradient norm copies one gradient at a time to float64 (stage 0: float32).
  Stage 0: every gradient converted to fp32 (``FP16_Optimizer``: a list, flattened into one
  buffer, the 16-bit ones dropped; unfused: one per parameter, the 16-bit ones kept). Stages
  1-2: this rank's partition flattened and converted (``single_grad_partition``); stage 3 one
  sub-group at a time (``_prepare_fp32_grad_for_sub_group``), its state made by the first step.
- **Parameters at stage 3**: 16-bit partitions (1/N); parameters under
  ``stage3_param_persistence_threshold`` elements stay whole. DeepSpeed gathers module by module
  as its coordinator prefetches and keeps them (:mod:`oomdoctor.plans.parallel.zero3_gathers`,
  :mod:`~oomdoctor.plans.parallel.zero3_coordinator`); at start-up it gathers each parameter
  once to hook its gradient (:func:`_hook_gathers`).

In fp32 (neither mode enabled) there is no master copy and no conversion; the buffers remain.
Stage 3 reduce-scatters each full bucket through a flat buffer on its reduce stream.

**CPU offload** (``offload_optimizer``/``offload_param`` with ``"device": "cpu"``; the GPU's
side, from the same sources): the master weights, the optimizer state and its step
(DeepSpeedCPUAdam), and the fp32 gradient partition are the host's. Stages 1-2 keep no
``grads_in_partition``: at each reduce, every gradient of this rank's partition is copied to
the host (``copy_grads_in_partition`` -> ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``,
after ``set_norm_for_param_grad_in_gpu`` takes its norm through a float64 copy), and a
``temp_grad_buffer_for_gpu_offload`` of the largest parameter stays on the GPU from start-up.
Stage 3 makes its ``grad_partitions_flat_buffer`` on the host. With ``offload_param`` (stage 3)
the 16-bit partitions are the host's too (``_create_param_groups_fp16_flat_cpu_memory``; those
under the persistence threshold stay whole on the GPU), and every rank gathers module by
module, one GPU included (``NoGatherCoalescedHandle``: ``ds_tensor.to(device)``), each gather
copying its partitions to the GPU first (``_allgather_params_coalesced``).
Not modelled: NVMe offload, ZeRO++ (quantized weights/gradients), the whole model on the GPU before
stage 3 partitions it (when it is not built under ``deepspeed.zero.Init``: emptied from the
cache before training), FP16_UnfusedOptimizer's per-parameter start-up copies.
"""
from __future__ import annotations

import importlib.util

from oomdoctor.plans.parallel.deepspeed_model import _FP32, _Hooks, _Model
from oomdoctor.plans.parallel.events import _Context, _Gpu
from oomdoctor.plans.parallel.fsdp import REDUCE_SCATTER_STREAM, _shard
from oomdoctor.plans.parallel.strategy import DeepSpeedConfig, Strategy
from oomdoctor.plans.parallel.zero3_gathers import gathers
from oomdoctor.sim.trace import Category, Phase


def deepspeed(ctx: _Context, strategy: Strategy) -> tuple[list[_Gpu], list[str]]:
    """One rank of DeepSpeed at ``strategy.zero_stage`` (every rank alike)."""
    g = _Gpu("each GPU", ctx.first_handle)
    ctx.workspaces(g)
    m = _Model(ctx, strategy)
    hooks = _Hooks(ctx)
    _states(ctx, g, m, hooks)
    _optimizer_buffers(ctx, g, m)
    _gradient_buffers(ctx, g, m, hooks)
    if m.stage == 3:
        gathers(ctx, g, m)
    return [g], _notes(m)


def _notes(m: _Model) -> list[str]:
    mode = ("fp16/bf16 mode: 16-bit model, activations and gradients; fp32 master weights and "
            "optimizer state in its optimizer" if m.mixed else "fp32 (no fp16/bf16 mode)")
    shard = {0: "replicated on every GPU (ZeRO disabled)", 1: "sharded over the GPUs",
             2: "sharded, gradients reduced into per-GPU partitions",
             3: "sharded, 16-bit parameters partitioned and gathered module by module"}
    ds = m.ds
    notes = [f"DeepSpeed ZeRO stage {m.stage}, {mode}; optimizer state {shard[m.stage]}",
            f"DeepSpeed buffers as configured: reduce_bucket_size {ds.reduce_bucket_size:,} "
            f"elements ({'two buckets, ' if ds.overlap(m.stage) and m.stage in (1, 2) else ''}"
            f"{m.bucket_bytes() / 2**20:,.0f} MiB each, allocated whatever the model's size; "
            "set it in the config's zero_optimization, or pass --ds-config)",
            _release_note(ds)]
    if m.offload_opt:
        notes.append("ZeRO-Offload (offload_optimizer cpu): fp32 master weights, optimizer state "
                     "and step (DeepSpeedCPUAdam) and the gradient partition on the host"
                     + ("; the 16-bit parameter partitions too (offload_param cpu), each "
                        "module copied in and gathered as it runs" if m.offload_param else ""))
    if ds.auto:
        notes.append(f"'auto' in the DeepSpeed config for {', '.join(ds.auto)}: the HF Trainer "
                     "fills these in from the model; DeepSpeed's defaults were assumed")
    return notes


def _release_note(ds: DeepSpeedConfig) -> str:
    """Which DeepSpeed release the estimate follows, why, and what that changes."""
    if ds.release:
        source = "as given"
    elif importlib.util.find_spec("deepspeed") is not None:
        source = "the installed one"
    else:
        source = "the newest modelled"
    when = ("at the first gradient" if ds.buckets_at_first_gradient
            else "as the backward starts (before 0.18.3)")
    return (f"DeepSpeed {'.'.join(map(str, ds.version))} assumed ({source}; --deepspeed "
            f"VERSION sets it): ZeRO-1/2 make their reduce buckets {when}")


def _steps(ctx: _Context) -> list[tuple[float, float]]:
    """Each optimizer step as (start, end) positions for what DeepSpeed adds around it: just
    before its first event, to just before the next phase (a step that allocates nothing, as a
    fused optimizer's second, has no events of its own)."""
    tl = ctx.timing
    out = []
    for ph in tl.marks_of(Phase.OPTIMIZER):
        start, stop, _ = tl.phases[ph]
        out.append((start, stop - 0.05 if stop > start else start - 0.06))
    return out


def _states(ctx: _Context, g: _Gpu, m: _Model, hooks: _Hooks) -> None:
    """The trace's storages: parameters partitioned at stage 3 (or flattened into one buffer
    at start-up), optimizer state fp32, sharded and flat, each parameter gradient dropped
    where DeepSpeed copies it into its buffers."""
    tl = ctx.timing
    steps = _steps(ctx)
    flat = _flat_states(ctx, m)
    folded = set(flat)
    flatten_at = ctx.setup_end - 0.45 if m.flattens or m.defragments else None
    on_host = _flattens_on_host(ctx, m)
    flat_bytes = 0
    for s in ctx.storages:
        h, size = s.handle, ctx.size[s.handle]
        key = ctx.key(h)
        if h in folded:
            continue
        if s.phase is Phase.SETUP and s.category is Category.PARAMETERS:
            whole = m.stage < 3 or h in m.persistent
            stored = size if whole else _shard(size, m.world)
            if m.offload_param and not whole:       # the partition goes to the host
                g.add(key, stored, s.t_alloc, flatten_at - 0.002, h)
                continue
            moved = flatten_at is not None and m.trainable(h) and (m.flattens or not whole)
            flat_bytes += stored if moved else 0
            g.add(key, stored, s.t_alloc, flatten_at - 0.002 * m.defragments
                  - 0.003 * on_host if moved else s.t_free, h)
        elif s.phase is Phase.OPTIMIZER or s.category is Category.OPTIMIZER_STATE:
            if m.offload_opt:                       # DeepSpeedCPUAdam steps on the host
                continue
            scale = m.state_scale(ctx.opt_param.get(h))
            g.add(key, int(_shard(size, m.optimizer_world) * scale), s.t_alloc, s.t_free, h)
        elif s.category is Category.GRADIENTS and tl.phase_of(s.t_alloc) is Phase.BACKWARD \
                and tl.grad_owner.get(h) is not None:
            g.add(key, size, s.t_alloc, _gradient_free(ctx, m, s, steps, hooks), h)
        else:
            g.add(key, size, s.t_alloc, s.t_free, h)
    if flat_bytes:
        _flatten(g, m, flat_bytes, flatten_at, on_host)
    _add_flat_states(ctx, g, m, flat)


def _flattens_on_host(ctx: _Context, m: _Model) -> bool:
    """Whether stages 1-2 flatten the 16-bit parameters on the host: before 0.19.0 always
    (stage_1_and_2.py: "move all the parameters to cpu to free up GPU space for creating flat
    buffer"), from 0.19.0 (DeepSpeed PR #7948) only when the GPU's free memory after
    ``empty_cache`` is short of the flat buffer (``flatten_on_accelerator``): the parameters
    and the CUDA context hold the rest of the card."""
    if m.stage not in (1, 2):
        return False
    if m.ds.version < (0, 19, 0):
        return True
    params = m.numel * m.grad_itemsize
    return ctx.gpu.total_bytes - ctx.gpu.context_bytes - params < params


def _flatten(g: _Gpu, m: _Model, nbytes: int, at: float, on_host: bool = False) -> None:
    """The 16-bit parameters moved into one buffer, whose originals go at ``at``. Stages 0-2
    flatten on the GPU (``bit16_groups_flat``: made while the originals live). Stage 3's
    defragmentation (runtime/utils.py ``defragment``) moves its partitions to the host first
    and empties the cache (measured: the reserve fell to 2 MiB, traces/zero3-*), then makes
    the buffer; so do stages 1-2 where the GPU lacks the room (:func:`_flattens_on_host`).
    Stage 0's FP16_Optimizer flattens clones of the parameters (fused_optimizer.py:
    ``[p.clone().detach() ...]``), dropped once the buffer is made (measured: their segments,
    traces/zero0-*-fusedadam-*)."""
    if m.defragments:
        g.empty_cache(at - 0.001)
        g.add("parameters", nbytes, at, None)
        return
    if m.stage == 0:
        for n in m.numels:
            g.add("parameters", n * m.grad_itemsize, at - 0.004, at - 0.001)
    if on_host:                      # the originals went to the host first, the cache emptied
        g.empty_cache(at - 0.0025)
    g.add("parameters", nbytes, at - 0.002, None)


def _flat_states(ctx: _Context, m: _Model) -> list[int]:
    """The optimizer state storages DeepSpeed's flat partitions replace: the optimizer steps one
    flat fp32 tensor per parameter group, so each state slot (exp_avg, exp_avg_sq) is one
    tensor of the partition's size, not one per parameter. Measured: two 1.02 GB Adam moments
    as two new segments (benchmarks/results/deepspeed/traces/zero2-*)."""
    if not m.flat_optimizer or not m.grad_bytes or m.offload_opt:
        return []
    return [s.handle for s in ctx.storages
            if s.category is Category.OPTIMIZER_STATE and s.phase is Phase.OPTIMIZER]


def _add_flat_states(ctx: _Context, g: _Gpu, m: _Model, handles: list[int]) -> None:
    """The state slots as flat tensors of this rank's partition (the traced state bytes over
    the trainable parameters' bytes: 2 for Adam, whose per-parameter step counters fold into
    one): one per stage-3 sub-group (``sub_group_size`` elements), else one per slot."""
    if not handles:
        return
    by_handle = {s.handle: s for s in ctx.storages if s.handle in set(handles)}
    slots = round(sum(ctx.trace.storages[h].nbytes for h in handles) / m.grad_bytes)
    t_alloc = min(s.t_alloc for s in by_handle.values())
    frees = [s.t_free for s in by_handle.values()]
    t_free = None if None in frees else max(frees)
    itemsize = _FP32 if m.mixed else m.grad_itemsize
    chunks = m.chunks()
    first = max(((a, e) for a, e in _steps(ctx) if a <= t_alloc), default=None)
    # made lazily by the first step, sub-group by sub-group after its fp32 gradients
    at = [a + 0.3 * d for a, d, _ in _subgroups(*first, len(chunks))] \
        if first is not None and len(chunks) > 1 else [t_alloc] * len(chunks)
    if m.stage == 0:                 # FP16_Optimizer: made at start-up, by one step
        at = [ctx.setup_end - 0.44 + 0.027] * len(chunks)
    for n, t in zip(chunks, at):
        for _ in range(slots):
            g.add("optimizer_state", n * itemsize, t, t_free)


def _gradient_free(ctx: _Context, m: _Model, s, steps: list[tuple[float, float]],
                   hooks: _Hooks) -> float:
    """When a parameter's own 16-bit gradient storage goes."""
    if m.stage >= 2:
        return hooks.ready(s.t_alloc)          # its hook copies it into the reduce bucket
    if m.stage == 1:
        ph = ctx.timing.phase_index(s.t_alloc)
        return ctx.timing.phases[ph][1] - 0.32  # copied into the bucket as the backward ends,
                                                # before the partition is made
    start, end = next(((a, e) for a, e in steps if a > s.t_alloc), (None, None))
    if m.mixed and start is not None:
        free = s.t_free if s.t_free is not None else end
        if m.ds.fused_optimizer:               # FP16_Optimizer.step drops it (p.grad = None)
            return min(free, start - 0.13)
        return min(free, end - 0.01)           # FP16_UnfusedOptimizer: zero_grad after the step
    return s.t_free


def _optimizer_buffers(ctx: _Context, g: _Gpu, m: _Model) -> None:
    """fp32 master weights from start-up, and the fp32 gradients of each step (offloaded:
    the host's; stages 1-2 keep a 16-bit buffer of the largest parameter on the GPU)."""
    if not m.numel:
        return
    if m.offload_opt:
        if m.stage < 3:
            # the master partition is cloned on the GPU, then moved to the host in fp32
            # (stage_1_and_2.py: ``...[partition_id].detach().clone().to(device=self.device,
            # dtype=...)``, the device the host's): a transient 16-bit copy whose segment stays
            # cached (measured: 486 MB at start-up, deepspeed/traces/zero2-bf16-offload-*)
            t0 = ctx.setup_end - 0.44
            for n in m.chunks():
                g.add("optimizer_state", n * m.grad_itemsize, t0, t0 + 0.01)
            g.add("gradients", max(m.numels) * m.grad_itemsize, ctx.setup_end - 0.36, None)
        return
    local = m.local_numel()
    if m.mixed or m.stage:
        _masters(ctx, g, m)
    for start, end in _steps(ctx):
        _norm_copy(g, m, start)
        if m.stage == 0:
            if m.mixed and m.ds.fused_optimizer:   # each gradient's fp32 copy (a list), then
                for n in m.numels:                 # their flat buffer (FP16_Optimizer.step)
                    g.add("gradients", n * _FP32, start - 0.2, start - 0.12)
                g.add("gradients", local * _FP32, start - 0.15, end)
            elif m.mixed:                      # FP16_UnfusedOptimizer.step: p32.grad = p16.grad.to
                for n in m.numels:             # (fp32), each kept until the update is copied back
                    g.add("gradients", n * _FP32, start - 0.15, end - 0.02)
            continue
        # each sub-group's gradients flattened (a copy), then converted to fp32 (in fp32 the
        # copy is the optimizer's gradient: .to() returns it), stepped, dropped
        chunks = m.chunks()
        for n, (a, d, b) in zip(chunks, _subgroups(start, end, len(chunks))):
            g.add("gradients", n * m.grad_itemsize, a, a + 0.4 * d if m.mixed else b)
            if m.mixed:
                g.add("gradients", n * _FP32, a + 0.25 * d, b)


def _subgroups(start: float, end: float, count: int) -> list[tuple[float, float, float]]:
    """(begin, a short span, end) of each of ``count`` sub-groups in the step (start, end):
    stage 3's ``step`` prepares, steps and releases one sub-group after another (stage3.py
    ``_prepare_sub_group`` .. ``_release_sub_group``); the first begins just before the
    step's own events."""
    lo = start - 0.2
    width = (end - lo) / count
    short = min(width, 0.2)
    return [(lo + j * width, short, lo + (j + 1) * width) for j in range(count)]


def _norm_copy(g: _Gpu, m: _Model, start: float) -> None:
    """The gradient norm's copy of one gradient at a time, at the step's start: ZeRO's
    ``get_grad_norm_direct`` takes each of this rank's gradients ``.to(get_norm_dtype())``
    (float64 where the device has it; zero/utils.py), stage 0's ``get_weight_norm`` ``.float()``.
    Measured: 409.6 MB for the 51.2M-element output projection (traces/zero2-*)."""
    largest = max(m.numels, default=0)
    if m.stage == 3:
        largest = _shard(largest, m.world)
    elif m.stage >= 1:
        largest = min(largest, m.local_numel())
    g.add("temporaries", largest * (8 if m.stage else _FP32), start - 0.25, start - 0.24)


def _masters(ctx: _Context, g: _Gpu, m: _Model) -> None:
    """The fp32 master partition, one tensor per stage-3 sub-group, and the start-up
    transients around it, which leave cached segments the first forward reuses (seen in
    benchmarks/results/deepspeed/traces/). Stages 1-2 clone the partition and convert the
    clone (stage_1_and_2.py ``weights_partition``: in fp32 the clone is the master, a second
    copy of the weights); stage 3 converts each sub-group's and clones the result (stage3.py
    ``_create_fp32_partitions``: the converted copy lives until the next sub-group's replaces
    it in the loop; in fp32 the partition itself is the master). Then
    ``initialize_optimizer_states`` makes a zero fp32 gradient (stage 3: one, of the largest
    sub-group). Stage 0's FP16_Optimizer (fused_optimizer.py) clones and converts like stages
    1-2, and makes its state there too (its ``initialize_optimizer_states`` steps once);
    FP16_UnfusedOptimizer's per-parameter copies are not modelled as transients."""
    t0 = ctx.setup_end - 0.44
    chunks = m.chunks()
    step = 0.02 / (len(chunks) + 1)
    previous = None
    for j, n in enumerate(chunks):
        at = t0 + j * step
        if m.stage == 3 and m.mixed:
            copy = g.add("optimizer_state", n * _FP32, at, None)
            if previous is not None:
                g.free(previous, at + step * 0.1)
            previous = copy
        elif m.mixed and m.flattens:
            g.add("optimizer_state", n * m.grad_itemsize, at, at + step * 0.5)
        if m.mixed or m.stage < 3:
            g.add("optimizer_state", n * _FP32, at + step * 0.25, None)
    if previous is not None:
        g.free(previous, t0 + len(chunks) * step)
    if m.stage or m.flattens:
        g.add("gradients", max(chunks) * _FP32, t0 + 0.025, t0 + 0.03)


def _gradient_buffers(ctx: _Context, g: _Gpu, m: _Model, hooks: _Hooks) -> None:
    """The reduce buckets and the per-rank gradient partition (both hold gradients)."""
    tl = ctx.timing
    backwards = tl.marks_of(Phase.BACKWARD)
    if not backwards or not m.numel:
        return
    partition = _shard(m.numel, m.world) * m.grad_itemsize
    if m.stage == 0:                           # each backward's flat all-reduce bucket (made
        flat = min(m.numel, m.ds.allreduce_bucket_size) * m.grad_itemsize   # on one GPU too)
        for ph in backwards:
            end = tl.phases[ph][1]
            g.add("communication", flat, end - 0.35, end - 0.32)
        return
    if m.stage == 3:                           # both at start-up, for good (stage3.py __init__)
        g.add("gradients", m.bucket_bytes(), ctx.setup_end - 0.35, None)
        if not m.offload_opt:                  # offloaded: the partition is the host's
            g.add("gradients", partition, ctx.setup_end - 0.34, None)
        _hook_gathers(ctx, g, m)
        for ph in backwards:
            _reduce_scatters(ctx, g, m, hooks, ph)
        return
    steps = [start for start, _ in _steps(ctx)]
    held, handle, template = None, None, None
    for ph in backwards:
        lo, hi, _ = tl.phases[ph]
        first, reduce_at = _bucket_times(ctx, m, hooks, ph)
        if first is None and template is not None:     # an accumulating backward
            first, reduce_at = (t if t is None else hooks.moved(t, template, ph)
                                for t in _bucket_times(ctx, m, hooks, template))
        elif first is not None:
            template = ph
        if first is None or not m.ds.buckets_at_first_gradient:
            first = lo + 0.01
        if m.ds.contiguous_gradients or m.offload_opt:   # setup_buckets .. the epilogue
            for _ in range(2 if m.ds.overlap(m.stage) else 1):
                g.add("gradients", m.bucket_bytes(), first, hi - 0.29)
        if m.offload_opt:
            _offloaded_reduces(ctx, g, m, hooks, ph)
            continue
        # grads_in_partition: made by the first reduce of a step (copy_grads_in_partition),
        # when the bucket first fills or at the backward's epilogue; the parameters'
        # gradients are views into it until the step has converted them to fp32 and drops them.
        # An accumulating backward's epilogue makes a new one and drops the old after the
        # bucket (measured: traces/zero2-bf16-accum2-*).
        step = next((s for s in steps if s > lo), None)
        if held != step:
            at = reduce_at if m.stage == 2 and reduce_at is not None else hi - 0.31
            handle = g.add("gradients", partition, at, None)
            held = step
        elif m.stage == 2:
            g.free(handle, hi - 0.28)
            handle = g.add("gradients", partition, hi - 0.31, None)
        following = next((tl.phases[b][0] for b in backwards if b > ph), None)
        if step is not None and (following is None or following > step):
            g.free(handle, step - 0.12)        # the step has converted and dropped it


def _hook_gathers(ctx: _Context, g: _Gpu, m: _Model) -> None:
    """Stage 3's start-up gathers each trainable parameter in turn on the default stream to
    hook its gradient, and partitions it again (stage3.py ``create_reduce_and_remove_grad_hooks``:
    ``param.all_gather()`` then ``param.partition()``): the gathered buffer, and first a copy
    of the partition where it is the host's (``_allgather_params_sequential``; measured, one
    buffer per parameter, and with offload_param a copy inside it, traces/zero3-*). What it
    caches on the default stream - a segment of the largest parameter - the forward reuses."""
    t0, n = ctx.setup_end - 0.33, max(1, len(m.numels))
    dt = 0.009 / n
    for k, numel in enumerate(m.numels):
        t = t0 + k * dt
        g.add("parameters", numel * m.grad_itemsize, t, t + 0.75 * dt)
        if m.offload_param:
            g.add("parameters", _shard(numel, m.world) * m.grad_itemsize, t + 0.25 * dt,
                  t + 0.5 * dt)


def _offloaded_reduces(ctx: _Context, g: _Gpu, m: _Model, hooks: _Hooks, ph: int) -> None:
    """Stages 1-2 offloaded, at each reduce of the bucket: each of its gradients' slice in this
    rank's partition taken to float64 for its norm, then to fp32 for the host, one at a time:
    the largest's float64 copy is the peak. Stage 1 reduces everything at the backward's end."""
    hi = ctx.timing.phases[ph][1]
    fills = _bucket_fills(_phase_gradients(ctx, ph), m)
    if m.stage == 1 and fills:
        fills = [(None, 0, max(largest for _, _, largest in fills))]
    for t, _, largest in fills:
        at = hooks.ready(t) - 0.004 if t is not None else hi - 0.31
        g.add("temporaries", min(largest, m.local_numel()) * 8, at, at + 0.001)


def _reduce_scatters(ctx: _Context, g: _Gpu, m: _Model, hooks: _Hooks, ph: int) -> None:
    """Stage 3's reduce-scatter of each full bucket: ``reduce_scatter_coalesced``
    (zero/coalesced_collectives.py) flattens the bucket's gradients into one buffer on the
    reduce stream and drops it once reduced; a bucket of one gradient whose elements split
    evenly across the ranks is reduced in place (measured: no buffer for the output
    projection's bucket, traces/zero3-bf16-offload-*). The stream's blocks are its own:
    measured, two cached segments of 92-101 MB beside the default stream's (traces/zero3-*)."""
    hi = ctx.timing.phases[ph][1]
    for t, elements, largest in _bucket_fills(_phase_gradients(ctx, ph), m):
        at = hooks.ready(t) - 0.004 if t is not None else hi - 0.34
        if elements != largest or elements % m.world:   # one gradient that splits evenly is
            g.add("communication", elements * m.grad_itemsize, at, at + 0.002,   # its own
                  stream=REDUCE_SCATTER_STREAM)                                  # buffer
        if m.offload_opt:
            _offloaded_partition(g, m, _shard(largest, m.world), at)


def _offloaded_partition(g: _Gpu, m: _Model, n: int, at: float) -> None:
    """Stage 3 offloaded, each gradient partition of a reduced bucket in turn, on the reduce
    stream while the bucket's flat buffer lives (stage3.py ``partition_grads``): the host
    buffer's copy back on the GPU (``grad_buffer.to(grad_partition.device)``), its float64
    copy for the norm (``_constant_buffered_norm2``), then its fp32 copy for the host
    (``_offload_grad_partition_at_boundary``). The largest partition's set stands for the
    bucket's (measured: 97.7 + 390.6 MiB, then 195.3 MiB, for the 51.2M-element output
    projection, each segment cached on that stream; deepspeed/traces/zero3-bf16-offload-*)."""
    g.add("temporaries", n * m.grad_itemsize, at + 0.0004, at + 0.0016,
          stream=REDUCE_SCATTER_STREAM)
    g.add("temporaries", n * 8, at + 0.0006, at + 0.0008, stream=REDUCE_SCATTER_STREAM)
    g.add("temporaries", n * _FP32, at + 0.001, at + 0.0012, stream=REDUCE_SCATTER_STREAM)


def _bucket_times(ctx: _Context, m: _Model, hooks: _Hooks, ph: int
                  ) -> tuple[float | None, float | None]:
    """(when one backward's first gradient hook allocates the bucket, when a gradient first
    finds it full and reduces it: None if the backward's gradients fit it, reduced at the
    epilogue). ``reduce_independent_p_g_buckets_and_remove_grads`` (stage_1_and_2.py). Both
    None for a backward that makes no gradient of its own in the trace."""
    grads = _phase_gradients(ctx, ph)
    if not grads:                              # accumulating into existing gradients
        return None, None
    first = hooks.ready(grads[0][0]) - 0.01
    reduce_at = next((hooks.ready(t) - 0.005 for t, _, _ in _bucket_fills(grads, m)
                      if t is not None), None)
    return first, reduce_at


def _phase_gradients(ctx: _Context, ph: int) -> list[tuple[float, int]]:
    """(allocation, bytes) of the parameter gradients backward phase ``ph`` makes, in order."""
    tl = ctx.timing
    return sorted((s.t_alloc, ctx.size[s.handle]) for s in ctx.storages
                  if s.category is Category.GRADIENTS and tl.grad_owner.get(s.handle) is not None
                  and tl.phase_index(s.t_alloc) == ph)


def _bucket_fills(grads: list[tuple[float, int]], m: _Model
                  ) -> list[tuple[float | None, int, int]]:
    """Each reduce of a backward's bucket: (the allocation of the gradient whose hook finds it
    full, None for the reduce at the backward's end; the elements reduced; the largest
    gradient's)."""
    out, elements, largest = [], 0, 0
    for t, nbytes in grads:
        n = nbytes // max(1, m.grad_itemsize)
        if elements and elements + n > m.ds.reduce_bucket_size:
            out.append((t, elements, largest))
            elements = largest = 0
        elements += n
        largest = max(largest, n)
    return out + [(None, elements, largest)] if elements else out
