"""The planners for a training script (``-- python train.py``): a single-GPU script planned
across the strategies or split, and a script that shards itself with FSDP estimated per GPU.

One run of the script on the fake GPU (:mod:`oomdoctor.sim.script`) is laid out from what it
ran (:func:`~oomdoctor.plans.parallel.layout.script_layout`) and replayed per strategy as a model
file's trace is. A script that calls ``fully_shard`` or FSDP1 itself ran as FSDP computes
(:mod:`oomdoctor.sim.sharding`: whole model, ``param_dtype``); its run is replayed as the FSDP it
recorded, on the launcher's GPUs.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import torch

from oomdoctor.models.script import ScriptSpec
from oomdoctor.models.spec import ModelFileError
from oomdoctor.plans.estimate import Budget, allocator_conf_string
from oomdoctor.plans.parallel.estimator import estimate_strategy
from oomdoctor.plans.parallel.fsdp import AUTOCAST_NOTE, stack_units
from oomdoctor.plans.parallel.layout import Layout, script_layout
from oomdoctor.plans.parallel.report import ParallelReport, Progress, SplitPlan, _strategy
from oomdoctor.plans.parallel.strategy import (STRATEGIES, DeepSpeedConfig, Strategy,
                                              default_policy, parse_strategy,
                                              read_deepspeed_config)
from oomdoctor.plans.parallel.timeline import Sizes
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.sim.trace import Trace, TraceConfig


def plan_script_split(script: ScriptSpec, budget: Budget,
                      alloc: AllocatorConfig = AllocatorConfig(),
                      progress: Progress = lambda _: None, batch_size: int | None = None,
                      seq_len: int | None = None) -> SplitPlan:
    """The best two-GPU split of a single-process training script, from its one run."""
    trace, layout = _script_inputs(script, budget, progress, batch_size, seq_len)
    progress(f"trying {max(len(layout.blocks) - 1, 0)} cuts")
    e = estimate_strategy(trace, layout, Strategy("pipeline2", 2), budget, alloc,
                          grad_accum=trace.config.grad_accum)
    assert e.partition is not None
    return SplitPlan(e, e.partition, layout.blocks)


def _script_inputs(script: ScriptSpec, budget: Budget, progress: Progress,
                   batch_size: int | None, seq_len: int | None) -> tuple:
    """The script's run (refused if it spreads itself already) and its layout."""
    from oomdoctor.plans.estimate import script_trace
    progress(f"running {script.name} on a fake {budget.gpu.name}")
    trace = script_trace(script, TraceConfig(batch_size or 1), budget, batch_size=batch_size,
                         seq_len=seq_len)
    _refuse_distributed(script, trace)
    return trace, script_layout(trace, script.name)


def estimate_script_strategies(script: ScriptSpec, budget: Budget, num_gpus: int,
                               strategies: Iterable[str] = STRATEGIES,
                               alloc: AllocatorConfig = AllocatorConfig(),
                               bucket_view: bool = False, progress: Progress = lambda _: None,
                               deepspeed: DeepSpeedConfig | None = None,
                               batch_size: int | None = None,
                               seq_len: int | None = None,
                               fsdp_version: int = 2) -> ParallelReport:
    """Every strategy for a single-process training script: its run (at ``batch_size`` per
    GPU, or its own) rewritten per strategy as a model file's trace is. The script decides its
    precision: zero3 runs the script's own autocast (a note says how FSDP2's bf16 policy
    differs), and DeepSpeed's 16-bit modes over an autocast script, which compute in another
    precision, are named as not estimated."""
    names = [parse_strategy(s) for s in strategies]
    trace, layout = _script_inputs(script, budget, progress, batch_size, seq_len)
    precision = trace.config.precision
    sizes = Sizes.of(trace)
    out, errors = [], []
    for name in names:
        st = _strategy(name, num_gpus, precision, bucket_view, False, deepspeed, fsdp_version)
        why = _script_cannot(name, st, precision, num_gpus)
        if why:
            errors.append((name, why))
            continue
        progress(f"{name}: replaying {st.num_gpus} GPU(s)")
        try:
            e = estimate_strategy(trace, layout, st, budget, alloc, sizes,
                                  grad_accum=trace.config.grad_accum)
        except ValueError as err:
            errors.append((name, str(err)))
            continue
        if name == "zero3" and precision == "bf16":      # not the options' note: the script's
            e = replace(e, notes=tuple(n for n in e.notes if n != AUTOCAST_NOTE)
                        + (SCRIPT_AUTOCAST_NOTE,))
        if sets_aside(trace):
            e = replace(e, notes=(sets_aside(trace), *e.notes))
        out.append(e)
    return ParallelReport(script.name, budget.gpu.name, num_gpus, budget.gpu.total_bytes,
                          budget.limit_bytes, trace.config.batch_size, precision,
                          bool(trace.checkpointed), layout.num_parameters, tuple(out),
                          tuple(errors), allocator_conf_string(alloc))


SCRIPT_AUTOCAST_NOTE = ("the script's own bf16 autocast under FSDP (all-gathered fp32 weights); "
                        "FSDP2's MixedPrecisionPolicy computes in pure bf16 instead: set it in "
                        "the script (fully_shard(..., mp_policy=MixedPrecisionPolicy("
                        "param_dtype=torch.bfloat16))) once it shards, or plan the model with "
                        "`oomdoctor parallel MODEL --precision bf16`")


def _script_cannot(name: str, st: Strategy, precision: str, num_gpus: int) -> str:
    """Why ``st`` cannot be estimated from one run of a script ("" when it can)."""
    if name == "pipeline2" and num_gpus != 2:
        return "the naive split uses exactly 2 GPUs"
    if name == "dp":
        return ("DataParallel's GPU 0 holds the whole batch's outputs, which needs a second run "
                "of the script; use DDP (torchrun), which needs no GPU-0 hot spot")
    if st.is_deepspeed and precision != "fp32":
        return (f"DeepSpeed's fp16/bf16 mode computes in pure 16 bits with fp32 master weights "
                f"in its optimizer; the script trains {precision} itself, so its run cannot show "
                "it: plan its model with `oomdoctor parallel MODEL --ds-config ds.json`")
    return ""


def _refuse_distributed(script: ScriptSpec, trace) -> None:
    """A script that already spreads itself (DDP/FSDP inside, under torchrun) is estimated per
    GPU as it is, by `estimate -- torchrun ...`: planning other strategies from it would count
    its own collectives' buffers twice."""
    from oomdoctor.plans.estimate import how_it_spreads, spreads_itself
    from oomdoctor.sim.ddp import ScriptDDP
    trained = trace.model.module if trace.model is not None else None
    if sets_aside(trace):
        return
    spreads = spreads_itself(trace)
    if isinstance(trained, ScriptDDP) or script.world > 1 or spreads:
        how = (how_it_spreads(trace) if spreads else
               f"already runs data-parallel ({script.world} processes under {script.launcher}, "
               "or DDP inside)")
        raise ValueError(f"{script.name} {how}: its per-GPU memory is what `oomdoctor "
                         "estimate -- <the same command>` gives; `oomdoctor parallel` plans a "
                         "single-GPU script across strategies - give it the script without its "
                         "own DDP/FSDP/DeepSpeed, as plain `python train.py ...`")


def script_gpu_estimate(script: ScriptSpec, trace: Trace, budget: Budget,
                        alloc: AllocatorConfig, seq_len: int | None = None):
    """A script's run as one GPU's estimate (plans.estimate.Estimate): its own, or - a script
    that spreads its model itself (FSDP, DeepSpeed, DataParallel, a split) - the fullest GPU of
    its per-GPU replay (the one `estimate -- <command>` gives), which fits when every GPU
    does. What probe searches, check gates and smoke compares with."""
    from oomdoctor.plans.estimate import estimate_trace, spreads_itself
    e = estimate_trace(trace, budget, alloc, script.name)
    if not spreads_itself(trace):
        return e
    report = estimate_spread_script(script, trace, budget, alloc, seq_len=seq_len)
    [s] = report.estimates
    g = max(s.gpus, key=lambda g: g.device_peak_bytes)
    return replace(e, precision=report.precision, peak_allocated_bytes=g.peak_allocated_bytes,
                   peak_reserved_bytes=g.peak_reserved_bytes, fits=s.fits,
                   breakdown=dict(g.breakdown), peak_phase=g.peak_phase,
                   notes=(f"per GPU: {s.strategy} x{s.num_gpus} as the script runs it, the "
                          f"fullest GPU ({g.label})", *s.notes))


def sets_aside(trace: Trace) -> str:
    """One process spreading its model with DataParallel or dispatch_model ran it whole on the
    fake GPU, the way a single-GPU script runs it: the planners plan that model across the
    strategies, setting the script's own spreading aside (what it says; "" when it does not
    apply). FSDP and DeepSpeed change the model's dtypes in the run, so they are not."""
    spread = getattr(trace.model, "spread", None)
    if spread is None or getattr(trace.model, "sharding", None) is not None \
            or getattr(trace.model, "deepspeed", None) is not None:
        return ""
    what = ("DataParallel" if spread.kind == "dp" else "dispatch_model split")
    return (f"the script's own {what} set aside: each strategy is planned for its model "
            f"(replace the {what} with the plan's strategy)")


def estimate_spread_script(script: ScriptSpec, trace: Trace, budget: Budget,
                           alloc: AllocatorConfig = AllocatorConfig(),
                           progress: Progress = lambda _: None,
                           seq_len: int | None = None, deepspeed_release: str = ""
                           ) -> ParallelReport:
    """Each GPU of a script that spreads its model itself: FSDP under torchrun
    (:func:`estimate_sharded_script`), DeepSpeed's engine (:func:`_estimate_deepspeed_script`,
    as ``deepspeed_release`` runs it), or one process over several GPUs - DataParallel, or
    accelerate's ``dispatch_model`` split (:mod:`oomdoctor.sim.spreading`)."""
    if getattr(trace.model, "deepspeed", None) is not None:
        return _estimate_deepspeed_script(script, trace, budget, alloc, progress,
                                          deepspeed_release)
    spread = getattr(trace.model, "spread", None)
    if spread is None:
        return estimate_sharded_script(script, trace, budget, alloc, progress)
    if spread.kind == "dp":
        trace, layout, st, sizes = _data_parallel_run(script, trace, budget, progress, seq_len)
        cut = None
    else:
        layout, st, sizes = script_layout(trace, script.name), Strategy("pipeline2", 2), None
        cut = map_cut(layout, spread.device_map)
    progress(f"{st.name}: replaying {st.num_gpus} GPUs as the script spreads")
    e = estimate_strategy(trace, layout, st, budget, alloc, sizes or Sizes.of(trace),
                          grad_accum=trace.config.grad_accum, cut=cut)
    notes = [_spread_note(spread, st)]
    if e.partition is not None and e.partition.main_stage != spread.main_stage:
        notes.append(f"the inputs, root-level tensors and loss estimated on stage "
                     f"{e.partition.main_stage} (the last block's GPU), where the script's "
                     f"main_device puts them on stage {spread.main_stage}")
    e = replace(e, notes=(*notes, *e.notes))
    return ParallelReport(script.name, budget.gpu.name, st.num_gpus, budget.gpu.total_bytes,
                          budget.limit_bytes, e.micro_batch, trace.config.precision,
                          bool(trace.checkpointed), layout.num_parameters, (e,), (),
                          allocator_conf_string(alloc))


def _estimate_deepspeed_script(script: ScriptSpec, trace: Trace, budget: Budget,
                               alloc: AllocatorConfig, progress: Progress,
                               release: str) -> ParallelReport:
    """Each GPU of a script that trains through ``deepspeed.initialize``: its run (the module in
    DeepSpeed's 16-bit mode, sim.deepspeed_engine) replayed as the ZeRO stage its config says,
    on the launcher's processes."""
    try:
        run = read_deepspeed_config(trace.model.deepspeed, f"{script.name}'s DeepSpeed config")
    except ValueError as e:
        raise ModelFileError(str(e)) from None
    st = default_policy(Strategy(run.strategy, script.world,
                                 deepspeed=replace(run.config, release=release)),
                        run.precision or "fp32")
    progress(f"{st.name}: replaying {st.num_gpus} GPU(s) as the script's DeepSpeed runs")
    layout = script_layout(trace, script.name)
    e = estimate_strategy(trace, layout, st, budget, alloc, Sizes.of(trace),
                          grad_accum=trace.config.grad_accum)
    note = (f"the script's deepspeed.initialize: ZeRO stage {run.stage}, "
            f"{run.precision or 'fp32'} on {st.num_gpus} GPU(s), replayed from its run")
    e = replace(e, notes=(note, *e.notes), precision=run.precision or "fp32")
    return ParallelReport(script.name, budget.gpu.name, st.num_gpus, budget.gpu.total_bytes,
                          budget.limit_bytes, trace.config.batch_size, run.precision or "fp32",
                          bool(trace.checkpointed), layout.num_parameters, (e,), (),
                          allocator_conf_string(alloc))


def _spread_note(spread, st: Strategy) -> str:
    if spread.kind == "dp":
        return (f"the script's DataParallel over GPUs {', '.join(map(str, spread.devices))}, "
                "replayed from two runs (its batch, and one GPU's share of it)")
    return (f"the script's dispatch_model over GPUs {' and '.join(map(str, spread.devices))}, "
            "replayed at the split its device map makes")


def _data_parallel_run(script: ScriptSpec, whole: Trace, budget: Budget, progress: Progress,
                       seq_len: int | None) -> tuple:
    """DataParallel scatters each batch over its GPUs: the run at the script's batch is GPU 0's
    gathered outputs and loss; a second run at one GPU's share (the first chunk, the largest:
    torch.chunk) is each replica's step. The replay's sizes come from the two."""
    from oomdoctor.plans.estimate import script_trace
    n = len(whole.model.spread.devices)
    batch = whole.config.batch_size
    if batch < n:
        raise ModelFileError(f"{script.name}'s batch of {batch} is smaller than the {n} GPUs "
                             "its DataParallel scatters over (it would use only as many GPUs "
                             f"as samples): give a batch of at least {n}, or fewer device_ids")
    if not (whole.loaders or "batch" in script.placeholders):
        raise ModelFileError(f"{script.name} runs DataParallel over {n} GPUs on batches it makes "
                         "without a DataLoader: oomdoctor needs one GPU's share of the batch in "
                         "a second run. Put {batch} in the script's arguments where it takes its "
                         "batch size, or use a DataLoader")
    share = -(-batch // n)
    progress(f"dp: running {script.name} again at one GPU's share of the batch ({share})")
    cfg = TraceConfig(share, steps=whole.config.steps, torch=whole.config.torch,
                      emulate_cuda=whole.config.emulate_cuda)
    part = script_trace(script, cfg, budget, batch_size=share, seq_len=seq_len)
    layout = script_layout(part, script.name)
    return part, layout, Strategy("dp", n), Sizes.affine(part, whole)


def map_cut(layout: Layout, device_map: dict[str, int]) -> int:
    """The split a device map makes (module name -> stage): the execution index of the first
    block on the other stage. A map of more than two contiguous runs of blocks is refused."""
    stages = [_stage_of(block, device_map) for block in layout.blocks]
    # a block the map does not name holds no parameter (accelerate needs every parameter
    # placed, nothing more): it runs where its inputs are, on the block before it
    known = [st for st in stages if st is not None] or [0]
    last = known[0]
    for i, st in enumerate(stages):
        stages[i] = last = last if st is None else st
    cuts = [i for i in range(1, len(stages)) if stages[i] != stages[i - 1]]
    if len(cuts) != 1:
        raise ModelFileError(f"the script's device map puts the blocks on the GPUs as {stages}: "
                         "oomdoctor replays one cut between two runs of consecutive blocks "
                         "(as `oomdoctor split --device-map` writes it)")
    return cuts[0]


def _stage_of(block: str, device_map: dict[str, int]) -> int | None:
    """A block's stage: the map's entry for it or for the module that holds it, else the one
    stage of all the entries inside it (None: the map names nothing of it)."""
    holders = [k for k in device_map if k == "" or block == k or block.startswith(k + ".")]
    if holders:
        return device_map[max(holders, key=len)]
    inside = {v for k, v in device_map.items() if k.startswith(block + ".")}
    if len(inside) > 1:
        raise ModelFileError(f"the script's device map splits the block {block!r}: oomdoctor "
                             "replays whole blocks per GPU")
    return inside.pop() if inside else None


def estimate_sharded_script(script: ScriptSpec, trace: Trace, budget: Budget,
                            alloc: AllocatorConfig = AllocatorConfig(),
                            progress: Progress = lambda _: None) -> ParallelReport:
    """Each GPU of a script that shards itself (``fully_shard`` or FSDP1 inside, under
    torchrun): its run (``trace``, as FSDP computes) replayed as the FSDP it recorded."""
    sharding = trace.model.sharding
    st = sharded_strategy(sharding, script.world)
    layout = script_layout(trace, script.name)
    progress(f"{st.name}: replaying {st.num_gpus} GPU(s) as the script shards")
    e = estimate_strategy(trace, layout, st, budget, alloc, Sizes.of(trace),
                          grad_accum=trace.config.grad_accum)
    e = replace(e, notes=tuple(dict.fromkeys((*_sharding_notes(trace, layout, st), *e.notes))))
    precision = "bf16" if st.mixed_precision else trace.config.precision
    return ParallelReport(script.name, budget.gpu.name, st.num_gpus, budget.gpu.total_bytes,
                          budget.limit_bytes, trace.config.batch_size, precision,
                          bool(trace.checkpointed), layout.num_parameters, (e,), (),
                          allocator_conf_string(alloc))


def sharded_strategy(sharding, world: int) -> Strategy:
    """The strategy a script's FSDP is (``sharding``: :class:`oomdoctor.sim.sharding.Sharding`):
    zero3 (FSDP2 or FSDP1 FULL_SHARD), zero2 (``reshard_after_forward=False``), hsdp (a 2-D
    mesh: replicas x shards); a 16-bit ``param_dtype`` is the mixed-precision policy."""
    mesh = sharding.mesh_shape or (world,)
    policy = sharding.param_dtype in (torch.bfloat16, torch.float16)
    offload = getattr(sharding, "cpu_offload", False)
    if len(mesh) == 2:
        return Strategy("hsdp", mesh[0] * mesh[1], nodes=mesh[0], mixed_precision=policy,
                        cpu_offload=offload)
    name = "zero3" if sharding.reshard_after_forward else "zero2"
    for what, used in (("a MixedPrecisionPolicy", policy), ("CPUOffloadPolicy", offload)):
        if used and name == "zero2":
            raise ValueError(f"fully_shard(reshard_after_forward=False) with {what} is not "
                             "modelled (with reshard_after_forward=True it is); estimate the "
                             "script with resharding")
    return Strategy(name, mesh[0], mixed_precision=policy, cpu_offload=offload, fsdp_version=sharding.version)


def _sharding_notes(trace: Trace, layout: Layout, st: Strategy) -> list[str]:
    """What the script's FSDP is, as estimated; and where its wrapping differs from the
    estimate's (every block of the stack, then the model)."""
    sharding = trace.model.sharding
    wrapper = ("fully_shard" if sharding.version == 2 else "FullyShardedDataParallel")
    notes = [f"the script's {wrapper} on {st.num_gpus} GPUs ({st.name}"
             + (f", param_dtype {str(sharding.param_dtype).removeprefix('torch.')}"
                if sharding.param_dtype else "") + "), replayed from its run"]
    reduce = sharding.reduce_dtype
    if st.mixed_precision and reduce != torch.float32:
        what = "None (= param_dtype)" if reduce is None else reduce
        notes.append(f"reduce_dtype {what} estimated as float32: the reduce-scatter input "
                     "counted at 4 bytes per element (an upper bound)")
    names = {id(m): n for n, m in trace.model.module.named_modules()}
    wrapped = {names.get(id(m)) for m in sharding.units} - {"", None}
    stack = {layout.blocks[i] for i in stack_units(layout.blocks)}
    if sharding.version == 2 and wrapped != stack:
        notes.append(f"estimated as fully_shard on each of the {len(stack)} blocks of the stack "
                     f"then the model; the script wraps {len(wrapped)} module(s) besides the "
                     "root, which can gather more or less at once")
    return notes
