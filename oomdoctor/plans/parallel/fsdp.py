"""FSDP2 (``fully_shard`` on every block, then on the model) as one rank's event list.

What it allocates, and when, follows torch/distributed/fsdp/_fully_shard (torch 2.13), checked
against a rank of a real run on the CPU (tests/test_fsdp.py):

- Parameters live as shards (``_fsdp_param.py``: each rank keeps 1/N of every parameter in the
  dtype it was built in).
- Before a block runs, ``foreach_all_gather`` (``_fsdp_collectives.py``) allocates one flat
  output of N shards in ``param_dtype``; a cast to ``param_dtype`` first goes through a flat
  copy-in buffer of one shard (``_get_param_all_gather_inputs``). ``foreach_all_gather_copy_out``
  then allocates the unsharded parameters and copies them out.
- In the forward the flat output is kept (``FSDPParamGroup.wait_for_unshard``: the
  ``all_gather_state`` "defer free to allow for overlap of this copy-out with the next
  all-gather") until the next block's copy-out; in the backward it is freed right after the
  copy-out, and the next block's all-gather is issued at once (``backward_prefetch``).
- ``post_forward`` frees a block's unsharded parameters; the root keeps its own gathered to the
  end of the backward (``reshard_after_forward`` is False for the root).
- ``post_backward`` runs when the block's input gradients are done (``RegisterPostBackward
  Function`` on its forward inputs), after its frozen layers' input gradients too. It frees the
  unsharded parameters, then ``foreach_reduce`` copies the block's
  gradients into one reduce-scatter input in ``reduce_dtype`` and makes the sharded gradient.
  That input is held (``reduce_scatter_states``, one in flight by default) until the next
  block's ``post_backward`` (``post_backward_rs_wait``), or the end of the backward.
- Frozen parameters are gathered like any other, and have no gradient to reduce.
- Streams (the caching allocator keeps each stream's blocks apart): on N > 1 GPUs the cast
  buffer and the flat output are made on the all-gather copy-in stream in the forward and
  pre-backward (``get_all_gather_streams``); ``foreach_reduce`` makes one flat output per block
  on the reduce-scatter stream, and the sharded gradients are views of it, so it lives until
  the last of them goes (zero_grad). On one GPU there is no all-gather (``unshard`` returns
  early), but the reduce output is still made on that stream. Measured on an H200 (one-GPU
  mesh, benchmarks/results/newpaths/traces): nine segments of that stream, a block's 43 MiB
  of fp32 gradients each and the root's 250 MiB, which the default stream never reuses.

Under CPU offload (``CPUOffloadPolicy``, ``Strategy.cpu_offload``) the sharded parameters, their
gradients and the optimizer live on the host (``_fsdp_param.py``: the padded shard is moved
``.cpu()`` and pinned; the optimizer steps those host tensors). Each all-gather input is the
shard copied to the GPU (``all_gather_inputs``: ``.to(self.device)``, then cast to
``param_dtype``), one per parameter, held until the copy-in; each block's reduce output is freed
as soon as its sharded gradient is copied to the host (``foreach_reduce``: "we can free it here
by not keeping a ref"). The GPU keeps no model state between steps.

Under a mixed-precision policy (``Strategy.mixed_precision``) the trace computes in pure bf16:
trainable parameters that the trace holds in 16 bits are kept, reduced and stepped in fp32
(``MASTER_SCALE``); frozen ones are kept in the dtype they were loaded in, as a LoRA base is.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from typing import NamedTuple

from oomdoctor.plans.parallel.events import _Context, _Gpu
from oomdoctor.plans.parallel.layout import MAIN
from oomdoctor.plans.parallel.strategy import MASTER_SCALE, POLICY_NOTE, Strategy
from oomdoctor.sim.trace import Category, Phase

AUTOCAST_NOTE = ("bf16 as torch.autocast over all-gathered fp32 weights (--no-mp-policy): every "
                 "block is gathered in fp32 and autocast keeps a bf16 copy of each weight until "
                 "the forward ends; FSDP2's MixedPrecisionPolicy(param_dtype=torch.bfloat16) "
                 "gathers bf16 instead (--mp-policy, the default)")
OFFLOAD_NOTE = ("FSDP2 CPUOffloadPolicy: sharded parameters, gradients and the optimizer (its "
                "step too) on the host, in pinned memory; the GPU holds only the blocks being "
                "gathered, their gradients until reduced, and the activations")
_POLICY_DTYPE = 2           # param_dtype=torch.bfloat16
_REDUCE_DTYPE = 4           # reduce_dtype=torch.float32
ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM = 1, 2      # the allocator's stream ids


def _shard(n: int, world: int) -> int:
    return -(-n // world)


class _Params:
    """Per parameter (layout index): bytes per element as traced, stored (sharded), gathered
    and reduced, and which block owns it."""

    def __init__(self, ctx: _Context, strategy: Strategy) -> None:
        lay = ctx.layout
        self.world = strategy.shard_group
        self.numel = lay.param_numel
        units = stack_units(lay.blocks)
        self.owner = tuple(o if o in units else MAIN for o in lay.param_owner)
        self.trainable = lay.param_trainable
        self.handle = {i: h for h, i in ctx.param_index.items() if i < lay.num_param_storages}
        self.traced: dict[int, float] = {}
        self._units: dict[int, list[int]] = defaultdict(list)     # block -> its parameters
        for i, h in self.handle.items():
            self.traced[i] = ctx.trace.storages[h].nbytes / max(1, self.numel[i])
            self._units[self.owner[i]].append(i)
        self.policy = strategy.mixed_precision
        self.offload = strategy.cpu_offload

    def stored(self, i: int) -> float:
        """Bytes per element of the sharded parameter (and of its gradient and AdamW state)."""
        t = self.traced[i]
        return t * MASTER_SCALE if self.policy and self.trainable[i] and t == 2 else t

    def gathered(self, i: int) -> float:
        t = self.traced[i]
        return min(t, _POLICY_DTYPE) if self.policy and t >= 2 else t

    def scale(self, i: int) -> float:
        """Sharded bytes per traced byte."""
        return self.stored(i) / self.traced[i]

    def shard_numel(self, i: int) -> int:
        return _shard(self.numel[i], self.world)

    def unit(self, block: int) -> list[int]:
        return self._units.get(block, [])

    def units(self) -> list[int]:
        """The blocks that own parameters."""
        return [b for b, members in self._units.items() if members]

    def gather_bytes(self, block: int) -> tuple[int, int, int]:
        """(unsharded parameters, flat all-gather output, copy-in inputs) of a block: the
        inputs are the shards cast to ``param_dtype``, or, offloaded, every shard copied to
        the GPU (with the largest one's uncast copy while it is cast)."""
        ps = self.unit(block)
        full = sum(int(self.numel[i] * self.gathered(i)) for i in ps)
        out = sum(int(self.shard_numel(i) * self.gathered(i)) for i in ps) * self.world
        return full, out, self._copy_in(ps)

    def _copy_in(self, ps: list[int]) -> int:
        """Bytes of a block's all-gather inputs while they are made: each cast shard; offloaded,
        every shard copied to the GPU, and the uncast copy of the one being cast (one GPU
        offloaded unshards parameter by parameter: :func:`_unshard_offloaded`)."""
        def uncast(i: int) -> int:
            return int(self.shard_numel(i) * self.stored(i)) \
                if self.gathered(i) != self.stored(i) else 0

        def cast(i: int) -> int:
            return int(self.shard_numel(i) * self.gathered(i))
        if not self.offload:
            return sum(cast(i) for i in ps if self.gathered(i) != self.stored(i))
        return sum(cast(i) for i in ps) + max((uncast(i) for i in ps), default=0)

    def reduce_bytes(self, i: int) -> tuple[int, int]:
        """(reduce-scatter input, sharded gradient) of one trainable parameter."""
        red = _REDUCE_DTYPE if self.policy else self.traced[i]
        return (int(self.shard_numel(i) * red) * self.world,
                int(self.shard_numel(i) * self.stored(i)))


def stack_units(blocks: tuple[str, ...]) -> set[int]:
    """The blocks ``fully_shard`` wraps one by one: the repeated blocks (``model.layers.N``,
    ``transformer.h.N``: two or more siblings named by their index), as torchtitan, the
    transformer-layer auto-wrap policy of accelerate and the Trainer, and oomdoctor's own plan
    code wrap them; every other parameter (embeddings, final norm, head) belongs to the root's
    ``fully_shard(model)``. A model without such a stack: every block."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, name in enumerate(blocks):
        parent, _, last = name.rpartition(".")
        if last.isdigit():
            groups[parent].append(i)
    units = {i for members in groups.values() if len(members) >= 2 for i in members}
    return units or set(range(len(blocks)))


def fsdp(ctx: _Context, strategy: Strategy) -> tuple[list[_Gpu], list[str]]:
    """One rank of FSDP2 FULL_SHARD (every GPU alike)."""
    g = _Gpu("each GPU", ctx.first_handle)
    ctx.workspaces(g)
    ps = _Params(ctx, strategy)
    _states(ctx, g, ps)
    for ph in ctx.timing.marks_of(Phase.FORWARD):
        _forward_gathers(ctx, g, ps, ph)
    notes = ["FSDP/ZeRO-3: each block is all-gathered for its forward and again for its "
             "backward (the next one prefetched); wrap every block, e.g. fully_shard(block) for "
             "each, then fully_shard(model)"]
    if strategy.cpu_offload:
        notes.append(OFFLOAD_NOTE)
    if strategy.mixed_precision:
        notes.append(POLICY_NOTE)
    elif ctx.trace.config.precision == "bf16":
        notes.append(AUTOCAST_NOTE)
    return [g], notes


def _states(ctx: _Context, g: _Gpu, ps: _Params, at_inputs: bool = True) -> None:
    """The trace's storages: parameters and optimizer state sharded, each gradient full until its
    block's post_backward and then a shard, the rest as traced. Offloaded, the shards and the
    optimizer's step are the host's, and each block's sharded gradients leave the GPU at once.
    ``at_inputs``: post_backward runs when the block's input gradients are done (FSDP2), else
    at its last parameter gradient (FSDP1's hook on the flat parameter)."""
    tl = ctx.timing
    post = _PostBackward(ctx, at_inputs)
    world = ps.world
    kept = _uncast_inputs(ctx) if ps.policy else {}
    reduced: dict[int, dict[float, int]] = defaultdict(lambda: defaultdict(int))
    outputs: dict[tuple[int, float], list] = {}    # (phase, post_backward) -> [bytes, freed]
    for s in ctx.storages:
        h, size = s.handle, ctx.size[s.handle]
        key = ctx.key(h)
        if s.phase is Phase.SETUP and s.category is Category.PARAMETERS:
            i = ctx.param_index[h]
            if not ps.offload:
                g.add(key, int(_shard(size, world) * ps.scale(i)), s.t_alloc, s.t_free, h)
        elif s.phase is Phase.OPTIMIZER or s.category is Category.OPTIMIZER_STATE:
            if ps.offload:
                continue
            i = ctx.opt_param.get(h)
            scale = ps.scale(i) if i is not None else 1
            g.add(key, int(_shard(size, world) * scale), s.t_alloc, s.t_free, h)
        elif s.category is Category.GRADIENTS and tl.phase_of(s.t_alloc) is Phase.BACKWARD \
                and tl.grad_owner.get(h) is not None:
            i = tl.grad_owner[h]
            ph = tl.phase_index(s.t_alloc)
            done = post.at(ph, ps.owner[i])
            if s.t_free is not None and s.t_free <= done:
                g.add(key, size, s.t_alloc, s.t_free, h)
                continue
            rs_in, shard = ps.reduce_bytes(i)
            g.add(key, size, s.t_alloc, done - 0.2, h)
            out = outputs.setdefault((ph, done), [0, s.t_free])
            out[0] += shard
            out[1] = None if None in (out[1], s.t_free) else max(out[1], s.t_free)
            reduced[ph][done] += rs_in
        else:
            g.add(key, size, s.t_alloc, kept.get(h, s.t_free), h)
    for ph, by_done in reduced.items():
        _reduce_scatter_inputs(ctx, g, ph, by_done)
    if ps.offload:
        _offload_setup(ctx, g, ps)
    for (_, done), (nbytes, freed) in outputs.items():
        # one flat reduce output per block; its sharded gradients are views of it (offloaded:
        # copied to the host, and the output dropped)
        g.add("gradients", nbytes, done - 0.19, done - 0.185 if ps.offload else freed,
              stream=REDUCE_SCATTER_STREAM)


def _uncast_inputs(ctx: _Context) -> dict[int, float]:
    """Under a policy the script's batch stays as it made it (fp32 images) and FSDP's root
    casts a copy to bf16 in its forward (``MixedPrecisionPolicy.cast_forward_inputs``); the
    pure-bf16 trace casts the batch and drops the original. Each original freed inside its data
    phase lives as long as the cast copies: storage handle -> when it is freed."""
    tl = ctx.timing
    casts: dict[int, float] = {}
    for s in ctx.storages:
        if s.phase is Phase.DATA and s.op.startswith("_to_copy") and s.t_free is not None:
            ph = tl.phase_index(s.t_alloc)
            casts[ph] = max(casts.get(ph, 0), s.t_free)
    kept = {}
    for s in ctx.storages:
        ph = tl.phase_index(s.t_alloc)
        if s.phase is Phase.DATA and ph in casts and s.t_free is not None \
                and tl.phase_index(s.t_free) == ph and not s.op.startswith("_to_copy"):
            kept[s.handle] = casts[ph]
    return kept


class _PostBackward:
    """Where each block's post_backward runs in a backward phase. FSDP2 registers it on the
    block's forward inputs (``RegisterPostBackwardFunction``, _fsdp_state.py): it runs when their
    gradients are done, after the input gradients of the block's first ops - which, frozen,
    come after its last parameter gradient. A trace names no module in the backward; the block's
    input being released (its first ops' saved tensors dropped) marks it, where that falls
    before the next block's window ends. Else (and for FSDP1, whose hook is the flat
    parameter's gradient) the end of the block's window; the root's at the end of the backward
    (its hook is the backward's final callback)."""

    def __init__(self, ctx: _Context, at_inputs: bool) -> None:
        self.ctx, self.at_inputs = ctx, at_inputs
        self._cache: dict[tuple[int, int], float] = {}       # (phase, block) -> position
        self._inputs: dict[int, dict[int, tuple[int, float | None]]] = {}   # by forward

    def at(self, ph: int, block: int) -> float:
        key = (ph, block)
        if key not in self._cache:
            self._cache[key] = self._find(ph, block)
        return self._cache[key]

    def _find(self, ph: int, block: int) -> float:
        tl = self.ctx.timing
        wins = tl.bwd_windows.get(ph, [])
        k = next((j for j, w in enumerate(wins) if w[2] == block), None)
        if block == MAIN or k is None:
            return tl.phases[ph][1]
        end = wins[k][1]
        if self.at_inputs and k + 1 < len(wins):
            freed = self._input_freed(ph, block)
            if freed is not None and end < freed < wins[k + 1][1]:
                return freed + 0.45
        return end

    def _input_freed(self, ph: int, block: int) -> float | None:
        fwd = next((f for f in self.ctx.timing.marks_of(Phase.FORWARD)
                    if self.ctx.timing.backward_of(f) == ph), None)
        if fwd is None:
            return None
        if fwd not in self._inputs:
            spans = self.ctx.timing.fwd_spans.get(fwd, {})
            order = sorted(spans, key=lambda b: spans[b][0])
            self._inputs[fwd] = block_inputs(self.ctx, fwd, order)
        return self._inputs[fwd].get(block, (0, None))[1]


def forward_kept(ctx: _Context, ph: int) -> list[tuple[float, int, float | None]]:
    """(allocation, bytes, free) of each storage forward phase ``ph`` makes that outlives it -
    what the backward needs, and each block's output - in allocation order."""
    fstart, fstop, _ = ctx.timing.phases[ph]
    return sorted((s.t_alloc, ctx.size[s.handle], s.t_free) for s in ctx.storages
                  if fstart <= s.t_alloc < fstop and (s.t_free is None or s.t_free > fstop))


def block_inputs(ctx: _Context, ph: int, order: list[int]) -> dict[int, tuple[int, float | None]]:
    """(bytes, where the trace frees it) of each block's input in forward phase ``ph``: the
    latest storage allocated before the block starts that outlives the forward (the previous
    block's kept output, or the embedding's)."""
    spans = ctx.timing.fwd_spans.get(ph, {})
    kept = forward_kept(ctx, ph)
    out: dict[int, tuple[int, float | None]] = {}
    i = 0
    last: tuple[int, float | None] = (0, None)
    for b in order:
        if b not in spans:
            continue
        while i < len(kept) and kept[i][0] < spans[b][0]:
            last = kept[i][1:]
            i += 1
        out[b] = last
    return out


def _reduce_scatter_inputs(ctx: _Context, g: _Gpu, ph: int, by_done: dict[float, int]) -> None:
    """Each block's reduce-scatter input, from its post_backward to the next one's (or the end
    of the backward)."""
    ends = sorted(by_done)
    stop = ctx.timing.phases[ph][1]
    for k, done in enumerate(ends):
        free = ends[k + 1] - 0.25 if k + 1 < len(ends) else stop - 0.05
        g.add("communication", by_done[done], done - 0.22, max(free, done - 0.21))


class StepSpan(NamedTuple):
    """One forward phase and the backward that follows it, as FSDP's gathers see them."""

    spans: dict[int, list[int]]        # block -> its first and last forward allocation
    order: list[int]                   # the forward's units (blocks with parameters), in order
    backward: int | None               # the backward phase, if any
    start: float                       # the forward's start and end
    stop: float
    backward_stop: float               # the backward's end (the forward's without one)


def step_span(ctx: _Context, ps: "_Params", ph: int) -> StepSpan:
    """Forward phase ``ph``'s units in the order they ran, and where it and its backward end."""
    tl = ctx.timing
    spans = tl.fwd_spans.get(ph, {})
    order = [b for b in sorted(spans, key=lambda b: spans[b][0]) if ps.unit(b)]
    bw = tl.backward_of(ph)
    start, stop, _ = tl.phases[ph]
    return StepSpan(spans, order, bw, start, stop, tl.phases[bw][1] if bw is not None else stop)


def _forward_gathers(ctx: _Context, g: _Gpu, ps: _Params, ph: int) -> None:
    """The all-gathers of one forward and of the backward that follows it."""
    step = step_span(ctx, ps, ph)
    held: int | None = None                 # the previous block's flat output (all_gather_state)
    if ps.unit(MAIN):                       # the root first, kept gathered to the backward's end
        held = _gather(g, ps, MAIN, step.start - 0.45, step.backward_stop - 0.1)
    for b in step.order:
        lo, hi = step.spans[b]
        held = _gather(g, ps, b, lo - 0.4, hi + 0.5, held)
    if held is not None:
        g.free(held, step.stop - 0.45)
    if step.backward is not None:
        _backward_gathers(ctx, g, ps, ph, step.backward)


def _gather(g: _Gpu, ps: _Params, block: int, at: float, free: float,
            held: int | None = None, keep: bool = True) -> int | None:
    """One all-gather and copy-out at ``at``: the cast buffer, the flat output (returned, to be
    freed by the caller unless ``keep`` is False), the unsharded parameters until ``free``; the
    previous flat output ``held`` is freed after the copy-out."""
    if held is not None:
        g.free(held, at + 0.04)
    if ps.world == 1 and ps.offload:
        _unshard_offloaded(g, ps, block, at, free)
        return None
    full, out, cast = ps.gather_bytes(block)
    if ps.world == 1:
        # One-GPU mesh: unshard() returns early and wait_for_unshard casts each parameter and
        # copies it out, with no flat output (FSDPParamGroup, world_size == 1)
        if cast:
            g.add("communication", cast, at, at + 0.035)
        g.add("parameters", full, at + 0.03, free)
        return None
    if cast:
        g.add("communication", cast, at, at + 0.02, stream=ALL_GATHER_STREAM)
    flat = g.add("communication", out, at + 0.01, None if keep else at + 0.035,
                 stream=ALL_GATHER_STREAM)
    g.add("parameters", full, at + 0.03, free)
    return flat


def _unshard_offloaded(g: _Gpu, ps: _Params, block: int, at: float, free: float) -> None:
    """A one-GPU mesh's unshard of an offloaded block, one parameter after another
    (FSDPParamGroup.wait_for_unshard, world_size 1): its shard copied to the GPU, cast to
    ``param_dtype`` (the copy dropped), the cast copied into the parameter's own new tensor
    (``init_all_gather_outputs``), the previous parameter's cast dropped only then. Measured,
    the three 126 MiB segments this leaves on an H200 decide where the backward's cuBLAS
    workspace goes (newpaths/traces/fsdp2-offload-*: with one gathered block the replay had
    it split a loss segment, 16% over at batch 1 with checkpointing)."""
    unit = ps.unit(block)
    step = 0.03 / max(1, len(unit))
    previous = None
    for k, i in enumerate(unit):
        t = at + k * step
        n = ps.shard_numel(i)
        if ps.gathered(i) != ps.stored(i):
            g.add("communication", int(n * ps.stored(i)), t, t + 0.4 * step)
            cast = g.add("communication", int(n * ps.gathered(i)), t + 0.2 * step, None)
        else:                                   # uncast: the copy is the all-gather input
            cast = g.add("communication", int(n * ps.stored(i)), t, None)
        if previous is not None:
            g.free(previous, t + 0.6 * step)
        g.add("parameters", int(ps.numel[i] * ps.gathered(i)), t + 0.8 * step, free)
        previous = cast
    if previous is not None:
        g.free(previous, at + 0.031)


def _offload_setup(ctx: _Context, g: _Gpu, ps: _Params) -> None:
    """``fully_shard`` under CPUOffloadPolicy, call by call (the blocks, then the root):
    the module's parameters moved to the GPU whole (``_move_states_to_device``), then each
    parameter's padded shard made there and copied to pinned host memory (FSDPParam
    ``_init_sharded_param``), then the moved copies dropped. Measured: 458 MiB of segments,
    all free when the first step starts, that the step's blocks then fill
    (newpaths/traces/fsdp2-offload-*)."""
    units = sorted(b for b in ps.units() if b != MAIN) + ([MAIN] if ps.unit(MAIN) else [])
    if not units:
        return
    t0, width = ctx.setup_end - 0.9, 0.4 / len(units)
    for k, b in enumerate(units):
        unit, t = ps.unit(b), t0 + k * width
        step = width / (3 * len(unit) + 3)
        for j, i in enumerate(unit):
            g.add("parameters", int(ps.numel[i] * ps.stored(i)), t + j * step, t + 0.9 * width)
        for j, i in enumerate(unit):
            at = t + (len(unit) + 2 * j + 1) * step
            g.add("parameters", int(ps.shard_numel(i) * ps.stored(i)), at, at + step / 2)


def _backward_gathers(ctx: _Context, g: _Gpu, ps: _Params, ph: int, bw: int) -> None:
    """Backward: each block's all-gather issued as the previous block's copy-out ends (the
    first one by the root's pre_backward, or on demand when the root holds no parameters); its
    copy-out at the block's own pre_backward (``wait_for_unshard``: one GPU gathers nothing
    and copies out only there); unsharded parameters freed at each block's post_backward."""
    wins = [w for w in ctx.timing.bwd_windows.get(bw, []) if ps.unit(w[2])]
    pre = _pre_backwards(ctx, ph, bw, wins)
    pending: int | None = None              # the prefetched flat output of this window's block
    if wins and ps.unit(MAIN):
        pending = _prefetch(g, ps, wins[0][2], wins[0][0])
    for j, (lo, hi, b) in enumerate(wins):
        full, _, _ = ps.gather_bytes(b)
        at = pre.get(b, lo)
        if pending is None:
            _gather(g, ps, b, at + 0.1, hi - 0.3, keep=False)
        else:
            g.add("parameters", full, at + 0.1, hi - 0.3)
            g.free(pending, at + 0.12)
        pending = _prefetch(g, ps, wins[j + 1][2], at + 0.14) if j + 1 < len(wins) else None


def _pre_backwards(ctx: _Context, ph: int, bw: int, wins: list[tuple[float, float, int]]
                   ) -> dict[int, float]:
    """Where each block's pre_backward runs in backward phase ``bw`` (of forward phase ``ph``):
    when the gradient of its output arrives (a hook on its forward outputs), after its
    consumer's backward. Two marks in a trace, the earlier taken: the block's recomputation
    starting (a checkpointed block's first backward allocation made by its own modules), and,
    for the first block of the backward, whose window opens with the root's (the loss, the
    head, the final norm), its output released by that backward (the last storage it made in
    its forward that outlives the forward). Else the window's start: a block's backward follows
    the previous one's at once. Measured on an H200 (LoRA under FSDP2's policy, newpaths/
    traces/fsdp2-lora-*): no block is gathered while the loss's backward peaks; placed at the
    window's start, the last block was, 22 MiB over at every batch."""
    tl = ctx.timing
    spans = tl.fwd_spans.get(ph, {})
    kept = forward_kept(ctx, ph)
    allocs = [a for a, _, _ in kept]
    recomputed: dict[int, float] = {}
    for s in ctx.storages:
        b = tl.block.get(s.handle)
        if b is not None and b >= 0 and tl.phase_index(s.t_alloc) == bw:
            recomputed[b] = min(recomputed.get(b, s.t_alloc), s.t_alloc)
    out = {}
    for k, (lo, hi, b) in enumerate(wins):
        marks = [recomputed[b] - 0.5] if b in recomputed else []
        span = spans.get(b) if k == 0 else None
        i = bisect.bisect_right(allocs, span[1]) - 1 if span else -1
        if i >= 0 and kept[i][0] >= span[0] and kept[i][2] is not None:
            marks.append(kept[i][2])
        marks = [m for m in marks if lo <= m < hi - 0.5]
        if marks:
            out[b] = min(marks)
    return out


def _prefetch(g: _Gpu, ps: _Params, block: int, at: float) -> int | None:
    """A block's all-gather issued ahead (its cast buffer, its flat output, returned)."""
    if ps.world == 1:
        return None                         # nothing to gather: done at wait_for_unshard
    _, out, cast = ps.gather_bytes(block)
    if cast:
        g.add("communication", cast, at, at + 0.02, stream=ALL_GATHER_STREAM)
    return g.add("communication", out, at + 0.01, None, stream=ALL_GATHER_STREAM)
