"""DeepSpeed's ZeRO stages 0-3 as its engine runs them, as one rank's event list.

    oomdoctor parallel model.py --gpus 4 --strategy ds3 --precision bf16 --ds-config ds.json

DeepSpeed's ``fp16``/``bf16`` modes are neither autocast nor pure 16-bit training: the engine
casts the model's parameters to 16 bits (engine.py ``_configure_distributed_model``), so the
forward, the backward and the gradients are 16-bit, and the optimizer wrapper keeps fp32 master
weights and runs the optimizer on them. The step is therefore traced in pure 16 bits
(:func:`~oomdoctor.plans.parallel.strategy.trace_precision`) and rewritten here, after
deepspeed/runtime (DeepSpeed master, 2026-08):

- **Master weights and optimizer state.** Stage 0: ``FP16_Optimizer`` (fp16/fused_optimizer.py)
  keeps one flat fp32 copy of every parameter and the optimizer's state on it, whole on every
  rank. Stages 1-2: ``DeepSpeedZeroOptimizer`` (zero/stage_1_and_2.py) keeps this rank's
  partition (``single_partition_of_fp32_groups``); stage 3 likewise
  (``fp32_partitioned_groups_flat``). The trace's 16-bit optimizer state becomes fp32, sharded
  from stage 1.
- **Gradients.** Stage 0: 16-bit, whole, all-reduced at the end of the backward through one flat
  bucket (``buffered_allreduce_fallback``). Stage 1: whole until the backward ends, then reduced
  into this rank's partition (``grads_in_partition``, 16-bit, 1/N). Stage 2: each gradient is
  copied into the reduce bucket (``ipg_buffer``, ``reduce_bucket_size`` elements, two with
  ``overlap_comm``) as autograd makes it and its own storage dropped
  (``reduce_independent_p_g_buckets_and_remove_grads``). Stage 3: the same into its one bucket
  (allocated at start-up), reduced into ``grad_partitions_flat_buffer`` (1/N, at start-up).
- **The step's fp32 gradients.** Stage 0: every gradient converted to fp32 (a list), flattened
  into one fp32 buffer, the 16-bit ones dropped (``FP16_Optimizer.step``). Stages 1-2: this
  rank's partition flattened and converted (``single_grad_partition``); stage 3 one sub-group
  (``sub_group_size`` elements) at a time (``_prepare_fp32_grad_for_sub_group``).
- **Parameters at stage 3**: 16-bit partitions (1/N); parameters under
  ``stage3_param_persistence_threshold`` elements stay whole. DeepSpeed gathers module by module
  with a prefetch bucket; modelled as the largest layer plus ``stage3_prefetch_bucket_size``
  gathered through each forward and backward (the "largest layer" term of DeepSpeed's own
  ``estimate_zero3_model_states_mem_needs``).

In fp32 (neither mode enabled) there is no master copy and no conversion; the buffers remain.
Not modelled: offload, ZeRO++ (quantized weights/gradients), the engine's start-up transients
(a model moved to the GPU whole before stage 3 partitions it, when it is not built under
``deepspeed.zero.Init``).
"""
from __future__ import annotations

from oomdoctor.plans.parallel.events import _Context, _Gpu
from oomdoctor.plans.parallel.fsdp import _shard
from oomdoctor.plans.parallel.layout import MAIN
from oomdoctor.plans.parallel.strategy import MASTER_SCALE, DeepSpeedConfig, Strategy
from oomdoctor.sim.trace import Category, Phase

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
        trainable = [i for i in handle if lay.param_trainable[i]]
        self.numel = sum(lay.param_numel[i] for i in trainable)
        self.grad_bytes = sum(ctx.trace.storages[handle[i]].nbytes for i in trainable)
        self.grad_itemsize = round(self.grad_bytes / self.numel) if self.numel else 2
        self.persistent = {handle[i] for i in handle
                           if lay.param_numel[i] < self.ds.param_persistence_threshold}

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

    def bucket_bytes(self) -> int:
        return self.ds.reduce_bucket_size * self.grad_itemsize


def deepspeed(ctx: _Context, strategy: Strategy) -> tuple[list[_Gpu], list[str]]:
    """One rank of DeepSpeed at ``strategy.zero_stage`` (every rank alike)."""
    g = _Gpu("each GPU", ctx.first_handle)
    ctx.workspaces(g)
    m = _Model(ctx, strategy)
    _states(ctx, g, m)
    _optimizer_buffers(ctx, g, m)
    _gradient_buffers(ctx, g, m)
    if m.stage == 3:
        _gathers(ctx, g, m)
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
            "set it in the config's zero_optimization, or pass --ds-config)"]
    if ds.auto:
        notes.append(f"'auto' in the DeepSpeed config for {', '.join(ds.auto)}: the HF Trainer "
                     "fills these in from the model; DeepSpeed's defaults were assumed")
    return notes


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


def _states(ctx: _Context, g: _Gpu, m: _Model) -> None:
    """The trace's storages: parameters partitioned at stage 3, optimizer state fp32 and
    sharded, each parameter gradient dropped where DeepSpeed copies it into its buffers."""
    tl = ctx.timing
    steps = _steps(ctx)
    for s in ctx.storages:
        h, size = s.handle, ctx.size[s.handle]
        key = ctx.key(h)
        if s.phase is Phase.SETUP and s.category is Category.PARAMETERS:
            whole = m.stage < 3 or h in m.persistent
            g.add(key, size if whole else _shard(size, m.world), s.t_alloc, s.t_free, h)
        elif s.phase is Phase.OPTIMIZER or s.category is Category.OPTIMIZER_STATE:
            scale = m.state_scale(ctx.opt_param.get(h))
            g.add(key, int(_shard(size, m.optimizer_world) * scale), s.t_alloc, s.t_free, h)
        elif s.category is Category.GRADIENTS and tl.phase_of(s.t_alloc) is Phase.BACKWARD \
                and tl.grad_owner.get(h) is not None:
            g.add(key, size, s.t_alloc, _gradient_free(ctx, m, s, steps), h)
        else:
            g.add(key, size, s.t_alloc, s.t_free, h)


def _gradient_free(ctx: _Context, m: _Model, s, steps: list[tuple[float, float]]) -> float:
    """When a parameter's own 16-bit gradient storage goes."""
    if m.stage >= 2:
        return s.t_alloc + 0.001               # copied into the reduce bucket at once
    if m.stage == 1:
        ph = ctx.timing.phase_index(s.t_alloc)
        return ctx.timing.phases[ph][1] - 0.3  # reduced into the partition as the backward ends
    start = next((a for a, _ in steps if a > s.t_alloc), None)
    if m.mixed and start is not None:          # FP16_Optimizer.step drops it (p.grad = None)
        return min(s.t_free if s.t_free is not None else start, start - 0.13)
    return s.t_free


def _optimizer_buffers(ctx: _Context, g: _Gpu, m: _Model) -> None:
    """fp32 master weights from start-up, and the fp32 gradients of each step."""
    if not m.numel:
        return
    local = m.local_numel()
    if m.mixed:
        g.add("optimizer_state", local * _FP32, ctx.setup_end - 0.4, None)
    for start, end in _steps(ctx):
        if m.stage == 0:
            if m.mixed:                        # the fp32 copies, then their flat buffer
                g.add("gradients", local * _FP32, start - 0.2, start - 0.12)
                g.add("gradients", local * _FP32, start - 0.15, end)
            continue
        k = min(local, m.ds.sub_group_size) if m.stage == 3 else local
        # this rank's partition flattened (a copy), then converted to fp32 (in fp32 the copy
        # is the optimizer's gradient: .to() returns it)
        g.add("gradients", k * m.grad_itemsize, start - 0.2, start - 0.12 if m.mixed else end)
        if m.mixed:
            g.add("gradients", k * _FP32, start - 0.15, end)


def _gradient_buffers(ctx: _Context, g: _Gpu, m: _Model) -> None:
    """The reduce buckets and the per-rank gradient partition (both hold gradients)."""
    tl = ctx.timing
    backwards = tl.marks_of(Phase.BACKWARD)
    if not backwards or not m.numel:
        return
    partition = _shard(m.numel, m.world) * m.grad_itemsize
    if m.stage == 0:
        if m.world > 1:                        # each backward's flat all-reduce bucket
            flat = min(m.numel, m.ds.allreduce_bucket_size) * m.grad_itemsize
            for ph in backwards:
                end = tl.phases[ph][1]
                g.add("communication", flat, end - 0.35, end - 0.32)
        return
    if m.stage == 3:                           # both at start-up, for good (stage3.py __init__)
        g.add("gradients", m.bucket_bytes(), ctx.setup_end - 0.35, None)
        g.add("gradients", partition, ctx.setup_end - 0.34, None)
        return
    steps = [start for start, _ in _steps(ctx)]
    held = None
    for ph in backwards:
        lo, hi, _ = tl.phases[ph]
        if m.ds.contiguous_gradients:          # setup_buckets .. _release_ipg_buffers
            for _ in range(2 if m.ds.overlap(m.stage) else 1):
                g.add("gradients", m.bucket_bytes(), lo + 0.01, hi - 0.29)
        # grads_in_partition: made by the first reduce of a step; the parameters' gradients
        # are views into it until the step has converted them to fp32 and drops them
        step = next((s for s in steps if s > lo), None)
        if held != step:
            at = hi - 0.31 if m.stage == 1 else lo + 0.02
            g.add("gradients", partition, at, step - 0.12 if step is not None else None)
            held = step


def _gathers(ctx: _Context, g: _Gpu, m: _Model) -> None:
    """Stage 3's gathered parameters, block by block (DeepSpeed fetches module by module; a
    block is the unit here). A gathered block is released after its forward unless the
    coordinator keeps it: from the second step on (the first records the module order),
    ``__params_to_release`` (partitioned_param_coordinator.py) keeps a parameter that is used
    again within ``stage3_max_reuse_distance`` parameters of upcoming modules - its own
    backward, for the last blocks, or every block of a model smaller than that. One rank alone
    gathers nothing (``_no_gather_coalesced``: the partition is the parameter)."""
    if m.world == 1:
        return
    tl = ctx.timing
    full = _block_bytes(ctx, m)
    prefetch = min(m.ds.prefetch_bucket_size, m.numel) * m.grad_itemsize
    for ph in tl.marks_of(Phase.FORWARD):
        start, stop, mark = tl.phases[ph]
        spans = tl.fwd_spans.get(ph, {})
        order = [b for b in sorted(spans, key=lambda b: spans[b][0]) if full.get(b)]
        bw = tl.backward_of(ph)
        bstop = tl.phases[bw][1] if bw is not None else stop
        wins = {b: (lo, hi) for lo, hi, b in tl.bwd_windows.get(bw, [])} if bw is not None \
            else {}
        kept = _kept(order, full, m) if mark.iteration else set()
        g.add("communication", prefetch, start + 0.05, bstop - 0.25)
        if full.get(MAIN):                    # the root's own parameters, the whole step
            g.add("parameters", full[MAIN], start + 0.06, bstop - 0.25)
        for b in order:
            lo, hi = spans[b]
            free = wins[b][1] - 0.3 if b in kept and b in wins else hi + 0.5
            g.add("parameters", full[b], lo - 0.4, free)
        for b, (lo, hi) in wins.items():
            if b not in kept and full.get(b):
                g.add("parameters", full[b], lo + 0.1, hi - 0.3)


def _block_bytes(ctx: _Context, m: _Model) -> dict[int, int]:
    """Gathered 16-bit bytes per block (parameters that stay whole are held already)."""
    out: dict[int, int] = {}
    for h, i in ctx.param_index.items():
        if i < ctx.layout.num_param_storages and h not in m.persistent:
            owner = ctx.layout.param_owner[i]
            out[owner] = out.get(owner, 0) + ctx.size[h]
    return out


def _kept(order: list[int], full: dict[int, int], m: _Model) -> set[int]:
    """Blocks whose backward comes within ``max_reuse_distance`` parameters of their forward:
    the modules between (the rest of the forward, the backward down to it) are counted as
    the coordinator walks them."""
    numel = {b: full[b] // m.grad_itemsize for b in order}
    n = len(order)
    walk = order + order[::-1]
    kept = set()
    for i, b in enumerate(order):
        between = sum(numel[x] for x in walk[i + 1:2 * n - 1 - i])
        if between < m.ds.max_reuse_distance:
            kept.add(b)
    return kept


def model_state_floor(param_bytes: int, grad_bytes: int, optim_bytes: int, strategy: Strategy
                      ) -> int:
    """Parameters, gradients and optimizer state (with fp32 master weights in DeepSpeed's
    fp16/bf16 mode) one GPU holds at least, from the traced 16-bit figures."""
    n, stage = strategy.num_gpus, strategy.zero_stage
    if strategy.mixed_precision:          # fp32 master weights + the optimizer state in fp32
        optim_bytes = optim_bytes * MASTER_SCALE + param_bytes * MASTER_SCALE
    params = param_bytes // n if stage == 3 else param_bytes
    grads = grad_bytes // n if stage >= 2 else grad_bytes
    optim = optim_bytes // n if stage >= 1 else optim_bytes
    return params + grads + optim
