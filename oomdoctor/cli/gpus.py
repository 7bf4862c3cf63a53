"""`oomdoctor gpus` and `oomdoctor watch`: the GPUs as NVML sees them, before and during a run."""
from __future__ import annotations

import json
import os
import sys

import click

from oomdoctor.cli.group import EXIT_NO_GPU, EXIT_OK, EXIT_PROBLEM, cli
from oomdoctor.configs import install_hint
from oomdoctor.cli.options import _die


# --- gpus, watch (section owned by the NVML modules' author) ---
@cli.command("gpus")
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout (bytes as ints).")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def gpus_command(as_json, debug):
    """The GPUs as NVML sees them, and what that means for a training run.

    \b
    oomdoctor gpus
    oomdoctor gpus --json

    Per GPU: memory used/total, utilisation, temperature, compute capability, bf16, MIG and
    the processes using it (flagged when another job shares it); the P2P/NVLink matrix;
    CUDA_VISIBLE_DEVICES and what torch will see; torchrun's variables and whether
    MASTER_PORT is free; the OMP_NUM_THREADS to use.
    Exit codes: 0 report printed, 2 usage error, 4 no NVIDIA driver or no GPU (the report,
    with the launch environment, is still printed; --json stays valid).
    """
    from oomdoctor.runs import nvml
    nv = nvml.Nvml()
    try:
        report = nvml.gpus_report(nv)
    except Exception as e:  # NVML itself degrades to None; this is a bug in oomdoctor
        _die(e, debug, EXIT_PROBLEM)
    finally:
        nv.shutdown()
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        click.echo(nvml.render_text(report))
    if not report.available:
        click.echo(f"error: {report.error}", err=True)
    sys.exit(EXIT_OK if report.available else EXIT_NO_GPU)


@cli.command("watch", context_settings={"ignore_unknown_options": True,
                                        "allow_interspersed_args": False})
@click.option("--interval", type=click.FloatRange(0.01), default=0.5, show_default=True,
              help="Seconds between NVML samples.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), metavar="PATH",
              help="Write the report as JSON to PATH (stdout belongs to the command).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), metavar="PATH",
              help="Write a PNG of memory and utilisation over time (needs matplotlib).")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def watch_command(interval, json_path, plot_path, debug, command):
    """Run COMMAND, sample the GPUs meanwhile, and report how they were used.

    \b
    oomdoctor watch -- python train.py --epochs 1
    oomdoctor watch --json run.json --plot run.png -- torchrun --nproc-per-node 2 train.py

    The command's stdout/stderr pass through; the report goes to stderr (or to --json PATH):
    total time, per-GPU peak memory and mean/p50/p95 utilisation, the time two or more GPUs
    were busy at once, and warnings (input-bound run, an idle GPU, memory near the limit).
    Only the GPUs in CUDA_VISIBLE_DEVICES are watched. Without NVML the command still runs
    and only its time is reported.
    Exit codes: the command's own (128+N if killed by signal N), 2 usage error (e.g. --plot
    without matplotlib), 126 not executable, 127 command not found.
    """
    from oomdoctor.runs import nvml, watch
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib, which is not installed: "
                                   f"{install_hint('plot')}, or drop --plot")
    nv = nvml.Nvml()
    sampler = None
    if nv.available():
        n = nv.device_count()
        gpus = tuple(nvml.read_gpu(nv, i) for i in range(n))
        sampler = watch.nvml_sampler(
            nv, nvml.visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus))
    try:
        run = watch.run_watched(command, sampler, interval,
                                unavailable=f"GPU sampling unavailable: {nv.error}")
    except watch.CommandError as e:
        _die(e, debug, e.exit_code)
    finally:
        nv.shutdown()
    summary = watch.summarize(run.ticks, run.duration_s, command, run.exit_code, interval,
                              run.sampling_error, nvml.cpu_cores())
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(summary.to_json(), f, indent=2)
        click.echo(f"oomdoctor watch: exit {run.exit_code} after {run.duration_s:.1f} s; "
                   f"report written to {json_path}", err=True)
    else:
        click.echo(watch.render_text(summary), err=True)
    if plot_path:
        if run.ticks:
            watch.plot(run.ticks, plot_path)
        else:
            click.echo("no GPU samples: no plot written", err=True)
    sys.exit(run.exit_code)
