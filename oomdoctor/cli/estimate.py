"""`oomdoctor estimate`: one configuration's peak, per GPU with --strategy, as a snapshot or
a plot."""
from __future__ import annotations

import json
import sys

import click

from oomdoctor.cli.group import EXIT_MODEL, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, cli
from oomdoctor.cli.deepspeed_options import (_deepspeed_defaults, _deepspeed_run,
                                             _ds_config_option)
from oomdoctor.cli.options import (_alloc_config, _bucket_view_option, _budget_options,
                                   _check_plot_file, _checkpoint_config, _cpu_offload,
                                   _cpu_offload_option, _die, _fsdp_version,
                                   _fsdp_version_option, _load_model, _make_budget,
                                   _modelled_torch, _mp_policy, _mp_policy_option, _progress,
                                   _slow_trace_progress)
from oomdoctor.cli.script import input_options as script_input_options
from oomdoctor.configs import DEEPSPEED_CHOICES, MODEL_PROTOCOL, PRECISIONS, STRATEGY_CHOICES


@cli.command(epilog=MODEL_PROTOCOL)
@click.argument("model_words", nargs=-1, required=True, metavar="MODEL | -- COMMAND...")
@click.option("-b", "--batch-size", type=click.IntRange(1),
              help="Micro-batch size per GPU (a script: every DataLoader's batch_size and its "
                   "{batch} placeholder; default its own).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True,
              help="fp16/bf16: autocast AMP (fp16 with GradScaler); bf16-pure / fp16-pure: "
                   "model.to(bf16) / model.half(), no autocast, no GradScaler.")
@click.option("--checkpointing", is_flag=True, help="Checkpoint the repeated blocks.")
@click.option("--strategy", type=click.Choice(STRATEGY_CHOICES + DEEPSPEED_CHOICES),
              default="single", show_default=True,
              help="Multi-GPU strategy: per-GPU memory of DDP, DataParallel, ZeRO-1/2/3 (fsdp) "
                   "or the naive two-GPU split (pipeline2) on --num-gpus cards; ds0..ds3: "
                   "DeepSpeed's ZeRO stages as DeepSpeed runs them.")
@_ds_config_option
@_bucket_view_option
@click.option("--num-gpus", type=click.IntRange(1), default=2, show_default=True,
              help="GPUs for --strategy (ignored for single).")
@click.option("--snapshot", "snapshot_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write the simulated step as a CUDA memory snapshot (the pickle "
                   "torch.cuda.memory._dump_snapshot writes): open it at "
                   "https://pytorch.org/memory_viz.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Draw memory over the step stacked by category, with reserved, the phases "
                   "and the budget: FILE.png, .svg or .html (needs matplotlib: the plot extra).")
@click.option("--steps", type=click.IntRange(1), default=2, show_default=True,
              help="Optimizer steps to trace (the second holds the optimizer's state).")
@_mp_policy_option
@_fsdp_version_option
@_cpu_offload_option
@script_input_options
@_budget_options
@click.pass_context
def estimate(ctx, model_words, batch_size, precision, checkpointing, strategy, ds_config, ds_release,
             bucket_view,
             num_gpus, snapshot_file, plot_file, steps, mp_policy, fsdp_version, cpu_offload, cpus,
             skip_input, gpu_name,
             memory,
             overhead,
             other_mem, margin, alloc_conf, checkpoint_class, grad_accum, optimizer, zero_grad,
             no_cuda_emulation, as_json, debug):
    """Peak GPU memory of one training configuration, and what it is made of.

    \b
    oomdoctor estimate sample_models/gpt2_small.py --batch-size 8 --precision bf16 --json
    oomdoctor estimate --gpu rtx3090 -- python train.py --lr 3e-4

    After `--`, MODEL is your training script's command line: it runs as it is on a fake GPU
    until its second optimizer step (see "Your training script as it is" in the README).

    Exit codes: 0 fits, 1 does not fit, 2 usage error, 3 model file or script error.
    """
    from oomdoctor.plans import estimate as estimate_mod
    from oomdoctor.models.spec import ModelFileError
    from oomdoctor.sim.trace import TraceConfig
    from oomdoctor.cli import script as script_cli
    script, model_file = _script_or_model(model_words, batch_size, debug)
    if script is None:
        script_cli.refuse_input_options(cpus, skip_input)
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    alloc = _alloc_config(alloc_conf)
    precision, strategy, ds = _estimate_deepspeed(ctx, ds_config, script, precision, strategy)
    if bucket_view and strategy != "ddp":
        raise click.UsageError("--bucket-view is DDP's gradient_as_bucket_view: give it with "
                               "--strategy ddp")
    cpu_offload = _cpu_offload(cpu_offload, [strategy])

    def _cfg():
        return TraceConfig(batch_size, precision, checkpointing, checkpoint_class, grad_accum,
                           optimizer, not no_cuda_emulation, zero_grad=zero_grad, steps=steps,
                           torch=_modelled_torch(), **_checkpoint_config(checkpointing))
    if (snapshot_file or plot_file) and strategy != "single":
        raise click.UsageError("--snapshot and --plot show one GPU's step: use them without "
                               "--strategy")
    if plot_file:
        _check_plot_file(plot_file)
    snapshot = series = checked = None
    try:
        if script is not None:
            trace, (result, snapshot, series) = script_cli.run_script(lambda: _estimate_script(
                script, TraceConfig(batch_size or 1, steps=steps, torch=_modelled_torch()),
                budget, alloc, batch_size, bool(snapshot_file), bool(plot_file)))
            checked = script_cli.check_input(trace, budget, script, cpus, skip_input, _progress)
            report = script_cli.sharded_report(script, trace, budget, alloc,
                                               snapshot_file or plot_file, ds_release)
            strategy = report.estimates[0].strategy if report else strategy
        elif snapshot_file or plot_file:
            from oomdoctor.plans import snapshot as snapshot_mod
            result, snapshot, series = snapshot_mod.estimate_views(
                _load_model(model_file), _cfg(), budget, alloc, bool(snapshot_file),
                bool(plot_file), progress=_slow_trace_progress())
        elif strategy != "single":
            report = _estimate_strategy(model_file, _cfg(), budget, num_gpus, strategy, alloc,
                                        bucket_view, _mp_policy(mp_policy, precision, [strategy]),
                                        ds, _fsdp_version(fsdp_version, [strategy]),
                                        cpu_offload)
        else:
            result = estimate_mod.estimate(_load_model(model_file), _cfg(), budget, alloc,
                                           progress=_slow_trace_progress())
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    if strategy != "single":
        # The per-GPU view: every GPU's peak, the model-state floor, DeepSpeed's formula.
        from oomdoctor.plans import parallel as par
        click.echo(json.dumps(report.to_json(), indent=2) if as_json
                   else par.render_report(report))
        sys.exit(EXIT_OK if all(e.fits for e in report.estimates) else EXIT_PROBLEM)
    _print_estimate(result, checked if script is not None else False, snapshot, series,
                    snapshot_file, plot_file, as_json, debug)
    sys.exit(EXIT_OK if result.fits else EXIT_PROBLEM)


def _estimate_strategy(model_file, cfg, budget, num_gpus, strategy, alloc, bucket_view,
                       mixed_precision, ds, fsdp_version, cpu_offload=False):
    """`estimate --strategy`: the one strategy's per-GPU report (its error raised)."""
    from oomdoctor.plans import parallel as par
    report = par.estimate_strategies(_load_model(model_file), cfg, budget, num_gpus, [strategy],
                                     alloc, bucket_view,
                                     progress=lambda m: click.echo(m, err=True),
                                     mixed_precision=mixed_precision, deepspeed=ds,
                                     fsdp_version=fsdp_version, cpu_offload=cpu_offload)
    if report.errors:
        raise ValueError(report.errors[0][1])
    return report


def _estimate_deepspeed(ctx, ds_config, script, precision, strategy):
    """(precision, strategy, DeepSpeedConfig or None) as --ds-config sets them."""
    if not ds_config:
        return precision, strategy, _deepspeed_defaults(ctx)
    if script is not None:
        raise click.UsageError("--ds-config plans a model source; a script's own "
                               "deepspeed.initialize is read from its run (its config)")
    precision, (strategy,), ds = _deepspeed_run(
        ctx, ds_config, precision, () if strategy == "single" else (strategy,))
    return precision, strategy, ds


def _print_estimate(result, checked, snapshot, series, snapshot_file, plot_file, as_json,
                    debug):
    """The estimate, its files, and a script's input-pipeline check (``checked``: False for a
    model source, None when skipped), as text or JSON."""
    from oomdoctor.plans import estimate as estimate_mod
    doc = result.to_json()
    if checked is not False:
        doc["input_pipeline"] = checked.to_json() if checked is not None else None
    if snapshot is not None:
        doc["snapshot"] = _write_snapshots([(snapshot_file, snapshot)], debug)[0]
    if series is not None:
        doc["plot"] = _write_plot(series, result, plot_file, debug)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(estimate_mod.render_text(result))
    if checked:
        from oomdoctor.runs.input_pipeline import render_text as input_text
        click.echo(input_text(checked))


def _script_or_model(words, batch_size, debug):
    """(the ScriptSpec, None) when MODEL is a command line, else (None, the model source)."""
    from oomdoctor.cli import script as script_cli
    from oomdoctor.models.spec import ModelFileError
    try:
        script = script_cli.script_of(words)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    if script is not None:
        script_cli.refuse_loop_options(click.get_current_context())
        return script, None
    if batch_size is None:
        raise click.UsageError("Missing option '-b' / '--batch-size'.")
    return None, script_cli.one_source(words)


def _estimate_script(script, cfg, budget, alloc, batch_size, snapshot, series):
    """The run's trace, and (estimate, snapshot or None, plot series or None) of it."""
    from oomdoctor.cli.script import seq_len_option
    from oomdoctor.plans.estimate import script_trace
    from oomdoctor.plans.snapshot import trace_views
    trace = script_trace(script, cfg, budget, batch_size=batch_size,
                         seq_len=seq_len_option(click.get_current_context()),
                         progress=_slow_trace_progress())
    return trace, trace_views(trace, script.name, budget, alloc, snapshot, series)


def _write_plot(series, result, path, debug):
    """Draw the step; what --json reports: the path and the series at the peak."""
    from oomdoctor.plans import stepplot
    try:
        stepplot.write_plot(series, result, path)
    except OSError as e:
        _die(RuntimeError(f"cannot write the plot {path}: {e.strerror or e}; pass a writable "
                          "--plot FILE"), debug, EXIT_USAGE)
    click.echo(f"wrote {path}", err=True)
    return {"path": path, "events": len(series.allocated), "peak_index": series.peak_index,
            "at_peak": dict(series.peak_live)}


def _write_snapshots(files, debug):
    """Write each (path, snapshot); what --json reports of each: path, events, segments."""
    from oomdoctor.plans import snapshot as snapshot_mod
    out = []
    for path, snap in files:
        try:
            snapshot_mod.write_snapshot(snap, path)
        except OSError as e:
            _die(RuntimeError(f"cannot write the snapshot {path}: {e.strerror or e}; pass a "
                              "writable --snapshot FILE"), debug, EXIT_USAGE)
        events = len(snap["device_traces"][0])
        click.echo(f"wrote {path} ({events:,} allocator events, {len(snap['segments'])} "
                   "segments): open it at https://pytorch.org/memory_viz or explain it with "
                   f"`oomdoctor explain {path}`", err=True)
        out.append({"path": path, "events": events, "segments": len(snap["segments"])})
    return out
