"""`oomdoctor probe` (with its multi-GPU plan and the measured probe)."""
from __future__ import annotations

import json
import sys

import click

from oomdoctor.cli.estimate import _write_snapshots
from oomdoctor.cli.group import (EXIT_INTERNAL, EXIT_MODEL, EXIT_NO_GPU, EXIT_OK, EXIT_PROBLEM,
                                 EXIT_USAGE, cli)
from oomdoctor.cli.options import (_alloc_config, _budget_options, _check_plot_file,
                                   _checkpoint_config, _cpu_offload, _cpu_offload_option,
                                   _detect_gpus, _die, _link_option,
                                   _load_model, _make_budget, _modelled_torch, _mp_policy,
                                   _mp_policy_option, _progress, _wants_longest_context,
                                   _write_bar_plot)
from oomdoctor.cli.runs import _smoke_run
from oomdoctor.cli.script import input_options as script_input_options
from oomdoctor.configs import (MAX_BATCH, MODEL_PROTOCOL, PRECISIONS, STRATEGY_CHOICES,
                               needs_bf16, no_bf16_fix)


@cli.command(epilog=MODEL_PROTOCOL)
@click.argument("model_words", nargs=-1, required=True, metavar="MODEL | -- COMMAND...")
@click.option("--precision", "precisions", type=click.Choice(PRECISIONS), multiple=True,
              help="Probe only these precisions (repeatable; default: fp32, fp16, and bf16 "
                   "AMP and pure bf16 where the card supports bf16; fp16-pure only if named).")
@click.option("--checkpointing/--no-checkpointing", default=None,
              help="Probe only with / without checkpointing (default: both).")
@click.option("--max-batch-size", type=click.IntRange(1), default=MAX_BATCH, show_default=True,
              help="Stop searching here.")
@click.option("-b", "--batch-size", "context_batch", type=click.IntRange(1), default=None,
              help="With --seq-len max: the batch size to find the longest sequence at "
                   "(default 1).")
@click.option("-j", "--jobs", type=click.IntRange(1), default=None,
              help="Worker processes (default: one per core).")
@click.option("--strategy", type=click.Choice(STRATEGY_CHOICES), default="single",
              show_default=True,
              help="Probe the micro-batch per GPU of a multi-GPU strategy on --num-gpus cards.")
@click.option("--num-gpus", type=click.IntRange(1), default=None,
              help="GPUs for --strategy (default 2). With the single-GPU probe and N > 1, "
                   "the end also plans the recommended precision on N GPUs (strategy, "
                   "micro-batch, accumulation, launch line); that plan is also made when "
                   "more than one GPU is detected.")
@click.option("--target-batch", type=click.IntRange(1), default=256, show_default=True,
              help="Effective batch for the multi-GPU plan (micro-batch x accumulation x "
                   "GPUs).")
@click.option("--smoke", "run_smoke", is_flag=True,
              help="Then run a few real training steps of the recommended configuration "
                   "(on the GPU if there is one, else on the CPU at a small batch).")
@click.option("--device", metavar="cuda[:i]",
              help="Measure for real on this device: real training steps in a search seeded "
                   "by the simulator's prediction (usually about three trials per "
                   "configuration), measured peaks next to the predicted ones.")
@click.option("--snapshot", "snapshot_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write each configuration's step at its largest batch as a CUDA memory "
                   "snapshot for https://pytorch.org/memory_viz: FILE with the configuration "
                   "before the extension (step.bf16-ckpt.pickle).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Draw each configuration's peak reserved at its largest batch as bars "
                   "against the budget, labelled with that batch: FILE.png, .svg or .html "
                   "(needs matplotlib: the plot extra).")
@_mp_policy_option
@_cpu_offload_option
@_link_option
@script_input_options
@_budget_options
def probe(model_words, precisions, checkpointing, max_batch_size, context_batch, jobs, strategy,
          num_gpus,
          target_batch, run_smoke, device, snapshot_file, plot_file, mp_policy, cpu_offload, link,
          cpus, skip_input, gpu_name,
          memory, overhead, other_mem, margin, alloc_conf, checkpoint_class, grad_accum,
          optimizer, zero_grad, no_cuda_emulation, as_json, debug):
    """The largest batch size that fits, for each precision x checkpointing configuration.

    \b
    oomdoctor probe sample_models/gpt2_small.py --gpu rtx3090
    oomdoctor probe sample_models/gpt2_small.py --gpu rtx3090 --num-gpus 2 --target-batch 256
    oomdoctor probe sample_models/llama7b.py --gpu a100-80 --precision bf16-pure --json
    oomdoctor probe Qwen/Qwen2.5-0.5B --seq-len max -b 1 --gpu rtx3090

    oomdoctor probe --gpu rtx3090 -- python train.py --bs {batch}

    After `--`, MODEL is your training script's command line: each trial runs it at one batch
    size (every DataLoader's batch_size, or its {batch} placeholder) on a fake GPU.

    Progress goes to stderr, the result to stdout.
    Exit codes: 0 something fits, 1 nothing fits, 2 usage error, 3 model file or script error,
    4 --device cuda[:i] and no such GPU here.
    """
    from oomdoctor.plans import probe as probe_mod
    from oomdoctor.cli import script as script_cli
    from oomdoctor.models.spec import ModelFileError
    try:
        script = script_cli.script_of(model_words)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    if script is not None:
        _probe_script(script, max_batch_size, cpus, skip_input, gpu_name, memory, overhead,
                      other_mem, margin,
                      alloc_conf, as_json, debug)
    model_file = script_cli.one_source(model_words)
    script_cli.refuse_input_options(cpus, skip_input)
    if device:     # before minutes of simulation: is the device there at all?
        _check_device(device, debug)
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    alloc = _alloc_config(alloc_conf)
    if _wants_longest_context():
        _longest_context(model_file, precisions, checkpointing, context_batch or 1, budget,
                         alloc, checkpoint_class, grad_accum, optimizer, zero_grad,
                         no_cuda_emulation, as_json, debug)
    if context_batch is not None:
        raise click.UsageError("-b/--batch-size goes with --seq-len max (probe searches the "
                               "batch size otherwise)")
    if snapshot_file and strategy != "single":
        raise click.UsageError("--snapshot writes one GPU's step: use it without --strategy")
    if plot_file:
        _check_plot_file(plot_file)
    spec, base, result = _probe_matrix(model_file, precisions, checkpointing, max_batch_size,
                                       jobs, strategy, num_gpus, budget, alloc,
                                       checkpoint_class, grad_accum, optimizer, zero_grad,
                                       no_cuda_emulation, debug,
                                       _mp_policy(mp_policy, "bf16", [strategy]),
                                       _cpu_offload(cpu_offload, [strategy]))
    if device:     # measures, prints and exits: the plan below would be thrown away
        _measure_probe(spec, base, result, device, max_batch_size, as_json, debug)
    best = probe_mod.recommended(result) if strategy == "single" else None
    plan, failed = None, None
    if strategy == "single":
        plan, failed = _plan_if_several_gpus(spec, best, budget, alloc, base, gpu_name, memory,
                                             link, num_gpus, target_batch, jobs)
    smoke = None
    if run_smoke and best is not None:
        smoke = _smoke_best(spec, best, checkpoint_class, grad_accum, optimizer, budget, alloc,
                            debug)
    snapshots = _probe_snapshots(spec, base, budget, alloc, result, snapshot_file, debug) \
        if snapshot_file else None
    plot = None
    if plot_file:
        from oomdoctor.plans.barplot import probe_bars
        plot = _write_bar_plot(probe_bars(result), plot_file,
                               f"oomdoctor probe: {result.model}", debug)
    _render_probe(result, strategy, best, plan, smoke, as_json, snapshots, plot)
    if failed is not None:       # the single-GPU answer above stands; then the plan's error
        _die(failed[0], debug, failed[1])
    fits = any(r.max_batch_size for r in result.results)
    sys.exit(EXIT_OK if fits and (smoke is None or smoke.ok) else EXIT_PROBLEM)


def _probe_script(script, max_batch_size, cpus, skip_input, gpu_name, memory, overhead,
                  other_mem, margin, alloc_conf, as_json, debug):
    """`probe -- python train.py`: the largest batch the script fits, by running it."""
    from oomdoctor.cli import script as script_cli
    from oomdoctor.models.spec import ModelFileError
    from oomdoctor.plans import script_probe
    from oomdoctor.sim.trace import TraceConfig
    ctx = click.get_current_context()
    script_cli.refuse_loop_options(ctx)
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    try:
        result = script_cli.run_script(lambda: script_probe.probe_script(
            script, TraceConfig(1, torch=_modelled_torch()), budget, _alloc_config(alloc_conf),
            max_batch=max_batch_size, seq_len=script_cli.seq_len_option(ctx),
            progress=_progress))
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    checked = None
    if result.at_max_trace is not None:         # the input pipeline at the answer's batch
        checked = script_cli.check_input(result.at_max_trace, budget, script, cpus,
                                         skip_input, _progress)
    if as_json:
        doc = result.to_json()
        doc["input_pipeline"] = checked.to_json() if checked is not None else None
        click.echo(json.dumps(doc, indent=2))
    else:
        from oomdoctor.runs.input_pipeline import render_text as input_text
        click.echo(script_probe.render_text(result)
                   + ("\n" + input_text(checked) if checked is not None else ""))
    sys.exit(EXIT_OK if result.max_batch_size else EXIT_PROBLEM)


def _check_device(device, debug):
    """`probe --device`: exit 4 when there is no such GPU here, 2 when it cannot measure."""
    from oomdoctor.runs import measure
    try:
        measure.TorchRunner(device)
    except measure.NoDeviceError as e:
        _die(e, debug, EXIT_NO_GPU)
    except measure.MeasureError as e:
        _die(e, debug, EXIT_USAGE)


def _probe_matrix(model_file, precisions, checkpointing, max_batch_size, jobs, strategy,
                  num_gpus, budget, alloc, checkpoint_class, grad_accum, optimizer, zero_grad,
                  no_cuda_emulation, debug, mixed_precision=False, cpu_offload=False):
    """The probe itself (probe.probe over the configuration matrix): the spec, the base
    configuration and the result."""
    from oomdoctor.plans import probe as probe_mod
    from oomdoctor.models.spec import ModelFileError
    from oomdoctor.sim.trace import TraceConfig
    try:
        configs = probe_mod.matrix(budget.gpu, precisions, checkpointing)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    try:
        spec = _load_model(model_file)
        base = TraceConfig(1, "fp32", False, checkpoint_class, grad_accum, optimizer,
                           not no_cuda_emulation, zero_grad=zero_grad,
                           torch=_modelled_torch(), **_checkpoint_config(checkpointing))
        result = probe_mod.probe(spec, base, budget, configs, alloc,
                                 progress=lambda msg: click.echo(msg, err=True),
                                 max_batch=max_batch_size,
                                 jobs=jobs or probe_mod.default_jobs(),
                                 strategy=strategy, num_gpus=num_gpus or 2,
                                 mixed_precision=mixed_precision, cpu_offload=cpu_offload)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    return spec, base, result


def _plan_if_several_gpus(spec, best, budget, alloc, base, gpu_name, memory, link, num_gpus,
                          target_batch, jobs):
    """The multi-GPU plan of a single-GPU probe, when --num-gpus or the detected GPUs make
    more than one, or why it failed as (error, exit code): a failure there never hides the
    finished single-GPU table (issue #24). (None, None) on one GPU."""
    detected = _detect_gpus(gpu_name, memory, num_gpus)
    n = num_gpus or (detected[1] if detected else 1)
    if n <= 1:
        return None, None
    from oomdoctor.models.spec import ModelFileError
    try:
        return _multi_gpu_plan(spec, best, budget, alloc, base, n, detected, link,
                               target_batch, jobs), None
    except ModelFileError as e:
        return None, (e, EXIT_MODEL)
    except ValueError as e:
        return None, (e, EXIT_USAGE)
    except Exception as e:     # a construct the planner cannot follow: not a verdict
        return None, (RuntimeError(
            f"the {n}-GPU plan could not be simulated ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else 'no message'}); the "
            "single-GPU result above stands - report it, or plan with `oomdoctor recommend`"),
            EXIT_INTERNAL)


def _smoke_best(spec, best, checkpoint_class, grad_accum, optimizer, budget, alloc, debug):
    """`probe --smoke`: a few real training steps of the recommended configuration."""
    from oomdoctor.runs import smoke as smoke_mod
    return _smoke_run(spec, smoke_mod.SmokeConfig(
        "single", 1, best.precision, best.checkpointing, checkpoint_class,
        best.max_batch_size, grad_accum, optimizer=optimizer, **_checkpoint_config()),
        budget, alloc, debug)


def _probe_snapshots(spec, base, budget, alloc, result, path, debug):
    """`probe --snapshot`: each configuration at its largest batch, one file each."""
    from oomdoctor.models.spec import ModelFileError
    from oomdoctor.plans import snapshot as snapshot_mod
    click.echo("tracing each configuration at its largest batch for --snapshot", err=True)
    try:
        snaps = snapshot_mod.probe_snapshots(spec, base, budget, result, alloc)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    written = _write_snapshots([(snapshot_mod.snapshot_path(path, label), snap)
                                for label, _, snap in snaps], debug)
    return [dict(w, configuration=label, batch_size=e.batch_size,
                 peak_allocated_bytes=e.peak_allocated_bytes)
            for w, (label, e, _) in zip(written, snaps)]


def _render_probe(result, strategy, best, plan, smoke, as_json, snapshots=None, plot=None):
    """The probe's table and recommendation, then the multi-GPU plan and the smoke run (or all
    of them as one JSON document)."""
    from oomdoctor.plans import estimate as estimate_mod
    from oomdoctor.plans import probe as probe_mod
    from oomdoctor.plans import probe_render
    if as_json:
        doc = result.to_json()
        if snapshots is not None:
            doc["snapshots"] = snapshots
        if plot is not None:
            doc["plot"] = plot
        if plan is not None:
            doc["multi_gpu_plan"] = plan.to_json()
        if smoke is not None:
            doc["smoke"] = smoke.to_json()
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(probe_render.render_table(result))
    if strategy == "single":
        click.echo(probe_render.render_recommendation(result))
    if plan is not None:
        from oomdoctor.plans import recommend as rec
        scope = ("at the recommended precision (all precisions and strategies: "
                 "`oomdoctor recommend`)" if best is not None
                 else "every precision, since none fits one card")
        click.echo(f"\non {plan.num_gpus} GPUs, {scope}:\n")
        click.echo(rec.render_text(plan))
    if smoke is not None:
        from oomdoctor.runs import smoke as smoke_mod
        click.echo("\n" + smoke_mod.render_text(smoke))
    if result.traced_with:
        click.echo(estimate_mod.traced_with_text(result.traced_with))


def _multi_gpu_plan(spec, best, budget, alloc, base, num_gpus, detected, link, target_batch,
                    jobs):
    """The end of a single-GPU probe on N > 1 GPUs: the recommended precision and
    checkpointing (``best``), planned across every strategy (recommend.recommend, restricted)."""
    from dataclasses import replace as dc_replace

    from oomdoctor.plans import probe as probe_mod
    from oomdoctor.plans import recommend as rec
    # Nothing fits one card: plan every precision (sharding or the split may still fit).
    precisions = [best.precision] if best is not None else None
    checkpointing = [best.checkpointing] if best is not None else None
    click.echo(f"planning {num_gpus} GPUs for an effective batch of {target_batch}", err=True)
    hw = rec.hardware(budget.gpu, num_gpus, link or (detected[2] if detected else None),
                      detected is not None)
    return rec.recommend(spec, hw, target_batch, budget, precisions, None, alloc,
                         dc_replace(base, grad_accum=1), checkpointing,
                         jobs=jobs or probe_mod.default_jobs(), top=5, detail=False,
                         progress=_progress)


def _measure_probe(spec, base, predicted, device, max_batch, as_json, debug):
    """`probe --device cuda`: measure each probed configuration for real, seeded by the
    simulator's answer, print measured vs predicted, and exit."""
    from dataclasses import replace as dc_replace

    from tabulate import tabulate

    from oomdoctor.runs import measure
    from oomdoctor.runs.fresh_process import FreshProcessRunner
    runs = []
    try:
        # Each trial in a new process, as the simulator models and the user's run starts;
        # a spec built in memory (no file or Hub id to rebuild it from) trains in this one.
        runner = FreshProcessRunner(device) if spec.origin is not None else None
        for r in predicted.results:
            if r.error:
                continue
            cfg = dc_replace(base, precision=r.precision, checkpointing=r.checkpointing)
            runs.append((r, measure.measured_probe(
                spec, cfg, device, r.max_batch_size or 0, progress=_progress,
                max_batch=max_batch, runner=runner)))
    except measure.MeasureError as e:
        _die(e, debug, EXIT_USAGE)
    if as_json:
        click.echo(json.dumps({"predicted": predicted.to_json(),
                               "measured": [m.to_json() for _, m in runs]}, indent=2))
    else:
        rows = [(r.precision + (" + ckpt" if r.checkpointing else ""), r.max_batch_size,
                 m.max_batch_size, m.num_trials) for r, m in runs]
        click.echo(tabulate(rows, headers=("config", "predicted max", "measured max",
                                           "trials")))
    agree = all(m.max_batch_size is not None and r.max_batch_size is not None
                and 0 <= m.max_batch_size - r.max_batch_size <= 1 for r, m in runs)
    sys.exit(EXIT_OK if agree else EXIT_PROBLEM)


def _longest_context(model_file, precisions, checkpointing, batch_size, budget, alloc,
                     checkpoint_class, grad_accum, optimizer, zero_grad, no_cuda_emulation,
                     as_json, debug):
    """`probe --seq-len max`: the longest sequence per configuration at one batch size (by
    default the card's AMP type, with and without checkpointing)."""
    from oomdoctor.plans import context
    from oomdoctor.models.spec import ModelFileError
    from oomdoctor.sim.trace import TraceConfig
    amp = "bf16" if budget.gpu.bf16 else "fp16"
    try:
        configs = [(p, ck) for p in (precisions or (amp,))
                   for ck in ((checkpointing,) if checkpointing is not None else (False, True))]
        bad = [p for p, _ in configs if needs_bf16(p) and not budget.gpu.bf16]
        if bad:
            raise ValueError(f"{budget.gpu.name} has no bf16 support; {no_bf16_fix(bad[0])}")
        spec = _load_model(model_file, longest=True)
        base = TraceConfig(batch_size, "fp32", False, checkpoint_class, grad_accum, optimizer,
                           not no_cuda_emulation, zero_grad=zero_grad,
                           torch=_modelled_torch(), **_checkpoint_config(checkpointing))
        result = context.longest_context(spec, base, budget, configs, alloc,
                                         progress=lambda m: click.echo(m, err=True))
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else context.render_text(result))
    sys.exit(EXIT_OK if any(r.max_seq_len for r in result.results) else EXIT_PROBLEM)
