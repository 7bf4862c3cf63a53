"""FSDP1 (``FullyShardedDataParallel``, FULL_SHARD, one unit per block, use_orig_params=True,
BACKWARD_PRE, limit_all_gathers) as one rank's event list: a variant of FSDP2's model
(oomdoctor.plans.parallel.fsdp), whose sharded states, gradients and reduce-scatter it keeps.
What differs follows torch/distributed/fsdp (torch 2.13) and is checked against a rank of a real
run on the CPU (tests/test_fsdp1.py):

- All-gather: ``FlatParamHandle.unshard`` (``_flat_param.py``) allocates the padded unsharded
  flat parameter and all-gathers into it; the parameters are views into it, so a unit holds one
  full copy (FSDP2 also keeps its flat all-gather output next to the copied-out parameters). A
  cast to a low-precision ``param_dtype`` first makes a one-shard copy (``_mp_shard``), freed
  after the all-gather (``_free_low_precision_sharded_param``).
- Forward: ``_pre_forward`` unshards, ``_post_forward_reshard`` frees at once (no forward
  prefetch by default); the root keeps its own to the end of the backward (``_runtime_utils.py``:
  "Do not free the root's parameters in the post-forward for FULL_SHARD").
- Backward: ``_pre_backward_hook`` unshards the block and prefetches the next one
  (BACKWARD_PRE) only if that one's ``_needs_pre_backward_unshard`` is set, which
  ``_register_pre_backward_hooks`` does in a forward run with grad enabled. Under reentrant
  checkpointing (transformers' default, ``use_reentrant=True``) the blocks' forward runs under
  ``no_grad`` and the recompute of block k comes after block k+1's pre-backward, so nothing is
  prefetched: one block gathered at a time.
- A unit whose flat parameter is frozen (a LoRA'd block: peft's ``fsdp_auto_wrap_policy`` wraps
  each adapter in a unit of its own) is resharded by ``_register_post_backward_reshard_only_hook``:
  a ``register_multi_grad_hook`` on the block's inputs, kept in
  ``flat_param._post_backward_hook_state`` until ``_finalize_params`` at the end of the backward.
  Under reentrant checkpointing those inputs are the recompute's detached leaves, and the hook
  holds their AccumulateGrad nodes, so each leaf's ``.grad`` (the gradient of the block's input,
  one block-input-sized tensor) stays until the backward ends instead of being freed in the
  block before it.

Without checkpointing (or with the non-reentrant kind) the forward registers the pre-backward
hooks, the next block is prefetched as in FSDP2, and the inputs are not leaves (nothing kept).
"""
from __future__ import annotations

from oomdoctor.plans.parallel.events import _Context, _Gpu
from oomdoctor.plans.parallel.fsdp import AUTOCAST_NOTE, _Params, _states, block_inputs, step_span
from oomdoctor.plans.parallel.layout import MAIN
from oomdoctor.plans.parallel.strategy import POLICY_NOTE, Strategy
from oomdoctor.sim.trace import Phase

FSDP1_NOTE = ("FSDP1 (FullyShardedDataParallel, FULL_SHARD, a unit per block, BACKWARD_PRE, "
              "--fsdp-version 1): each block's flat parameter all-gathered in place")
REENTRANT_NOTE = ("checkpointing assumed reentrant (transformers' default use_reentrant=True, as "
                  "accelerate's FSDP plugin and the Trainer run it): no backward prefetch, one "
                  "block gathered at a time; each all-frozen block (LoRA/QLoRA: peft wraps the "
                  "adapters in units of their own) keeps its input (the recompute's leaf) and that "
                  "input's gradient to the end of the backward (FSDP1's reshard-only hook holds "
                  "the leaf's AccumulateGrad)")


def fsdp1(ctx: _Context, strategy: Strategy) -> tuple[list[_Gpu], list[str]]:
    """One rank of FSDP1 FULL_SHARD (every GPU alike)."""
    g = _Gpu("each GPU", ctx.first_handle)
    ctx.workspaces(g)
    ps = _Params(ctx, strategy)
    _states(ctx, g, ps, at_inputs=False)
    reentrant = bool(ctx.trace.config.checkpointing)
    for ph in ctx.timing.marks_of(Phase.FORWARD):
        _forward(ctx, g, ps, ph, reentrant)
    notes = [FSDP1_NOTE + ("; " + REENTRANT_NOTE if reentrant else
                           "; the next block prefetched in the backward")]
    if strategy.mixed_precision:
        notes.append(POLICY_NOTE.replace("FSDP2 MixedPrecisionPolicy", "MixedPrecision"))
    elif ctx.trace.config.precision == "bf16":
        notes.append(AUTOCAST_NOTE)
    return [g], notes


def _frozen_unit(ps: _Params, block: int) -> bool:
    """Whether the block's own unit holds only frozen parameters: it has some, and its trainable
    ones (adapters) are wrapped apart (peft's fsdp_auto_wrap_policy)."""
    return any(not ps.trainable[i] for i in ps.unit(block))


def _gather(g: _Gpu, ps: _Params, block: int, at: float, free: float) -> None:
    """``FlatParamHandle.unshard``: the low-precision shard copy, then the unsharded flat
    parameter (all-gathered in place) until ``free``."""
    full, _, cast = ps.gather_bytes(block)
    if cast:
        g.add("communication", cast, at, at + 0.02)
    g.add("parameters", full, at + 0.01, free)


def _forward(ctx: _Context, g: _Gpu, ps: _Params, ph: int, reentrant: bool) -> None:
    """The gathers of one forward and of the backward that follows it."""
    step = step_span(ctx, ps, ph)
    if ps.unit(MAIN):
        _gather(g, ps, MAIN, step.start - 0.45, step.backward_stop - 0.1)
    for b in step.order:
        _gather(g, ps, b, step.spans[b][0] - 0.4, step.spans[b][1] + 0.5)
    bw = step.backward
    if bw is None:
        return
    wins = [w for w in ctx.timing.bwd_windows.get(bw, []) if ps.unit(w[2])]
    for j, (lo, hi, b) in enumerate(wins):
        if reentrant or j == 0:
            _gather(g, ps, b, lo + 0.1, hi - 0.3)
        else:                                  # prefetched at the previous block's pre-backward
            _gather(g, ps, b, wins[j - 1][0] + 0.14, hi - 0.3)
    if reentrant:
        _kept_input_grads(ctx, g, ps, ph, bw, step.order)


def _kept_input_grads(ctx: _Context, g: _Gpu, ps: _Params, ph: int, bw: int,
                      order: list[int]) -> None:
    """Each all-frozen unit's input leaf and its gradient, held by the reshard-only hook to the
    end of the backward. The leaf shares the block's saved input (freed where the trace frees
    it); the gradient is counted from the end of the previous block's backward window, where the
    trace frees the gradient that flowed through it."""
    tl = ctx.timing
    inputs = block_inputs(ctx, ph, order)
    bstart, bstop, _ = tl.phases[bw]
    for k, b in enumerate(order):
        size, freed = inputs.get(b, (0, None))
        if not size or not _frozen_unit(ps, b):
            continue
        if freed is not None and bstart <= freed < bstop:
            g.add("activations", size, freed, bstop - 0.08)
        win = tl.block_window(bw, order[k - 1]) if k else None
        if win:
            g.add("activations", size, win[1] - 0.05, bstop - 0.08)
