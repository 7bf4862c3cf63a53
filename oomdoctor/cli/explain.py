"""`oomdoctor explain`: read a failing run's log, and with --model add the simulator's plan."""
from __future__ import annotations

import json

import click

from oomdoctor.cli.group import EXIT_MODEL, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, cli
from oomdoctor.cli.options import _die, _load_model, _make_budget
from oomdoctor.configs import PRECISIONS
from oomdoctor.sim.gpus import PROFILES, custom_profile


# --- explain (section owned by the explain module's author) ---
@cli.command("explain")
@click.argument("file", type=click.File("rb"))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (sizes in bytes).")
@click.option("--model", "model_file", type=click.Path(),
              help="The model file of the failing run: add the simulator's numbers (what the "
                   "step needs, the largest batch that fits per precision).")
@click.option("--gpu", "gpu_name", metavar="NAME",
              help="With --model: the card (default: the one whose capacity the log states).")
@click.option("-b", "--batch-size", type=click.IntRange(1),
              help="With --model: the failing run's micro-batch (default: from the log).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True,
              help="With --model: the failing run's precision.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def explain_command(file, as_json: bool, model_file, gpu_name, batch_size, precision,
                    debug) -> None:
    """Explain the out-of-memory and multi-GPU launch errors in FILE ('-' reads stdin).

    \b
    oomdoctor explain train.log
    python train.py 2>&1 | oomdoctor explain -
    oomdoctor explain train.log --model model.py --gpu rtx3090 --batch-size 32

    Exit codes: 0 errors found and explained, 1 no known error found, 2 usage error,
    3 the --model file could not be loaded or traced.
    """
    from oomdoctor import explain as ex  # imported here so `oomdoctor --help` stays fast
    from oomdoctor.explain import snapshot as snap

    peek = getattr(file, "peek", None)
    if peek is not None and snap.is_pickle(peek(2)[:2]):
        _explain_snapshot(file, as_json, debug)
    result = ex.explain_file(file)
    plan = None
    if model_file and result.findings:
        plan = _oom_plan(result, model_file, gpu_name, batch_size, precision, debug)
    if as_json:
        doc = ex.to_json(result)
        if plan is not None:
            doc["simulation"] = plan.to_json()
        click.echo(json.dumps(doc, indent=2))
    elif result.findings:
        if plan is None:
            click.echo(ex.render_text(result), nl=False)
        else:
            click.echo(ex.render_text(result, f"Simulated with {plan.model} on {plan.gpu}: "
                                      f"{plan.summary()}.", plan.fix_effects()), nl=False)
    if not result.findings:
        name = getattr(file, "name", "-")
        click.echo(f"oomdoctor explain: no known error found in {result.lines_read:,} lines of {name}. It looks "
                   "for PyTorch/TensorFlow/JAX out-of-memory errors, host-memory kills and multi-GPU launch errors; "
                   "paste the complete error message with the traceback above it.", err=True)
    click.get_current_context().exit(EXIT_OK if result.findings else EXIT_PROBLEM)


def _explain_snapshot(file, as_json, debug):
    """A pickled CUDA memory snapshot (torch.cuda.memory._dump_snapshot, or estimate
    --snapshot), read without running anything in it: exit 0 explained, 2 refused."""
    from oomdoctor.explain import snapshot as snap
    from oomdoctor.explain.snapshot_report import (explain_snapshot, render_snapshot_text,
                                                   snapshot_to_json)
    name = getattr(file, "name", "-")
    try:
        report = explain_snapshot(file, name if isinstance(name, str) else "-")
    except (snap.UnsafeSnapshot, snap.NotASnapshot) as e:
        _die(RuntimeError(f"{name}: {e}"), debug, EXIT_USAGE)
    if as_json:
        click.echo(json.dumps(snapshot_to_json(report), indent=2))
    else:
        click.echo(render_snapshot_text(report), nl=False)
    click.get_current_context().exit(EXIT_OK)


def _oom_plan(result, model_file, gpu_name, batch_size, precision, debug):
    """The simulator's side of `explain --model`: the card from --gpu or from the capacity the
    log states, the batch from --batch-size or from the log."""
    from oomdoctor.plans import oom
    from oomdoctor.plans import probe as probe_mod
    from oomdoctor.plans.estimate import Budget
    from oomdoctor.models.spec import ModelFileError
    if gpu_name:
        gpu = _make_budget(gpu_name, None, None, "0", "5%").gpu
    else:
        capacity = max((f.numbers.get("capacity", 0) for f in result.findings), default=0)
        gpu = _profile_for_capacity(capacity)
        if gpu is None:
            raise click.UsageError("the log states no GPU capacity; pass --gpu NAME with --model")
        click.echo(f"the log's GPU has {capacity / 2**30:.2f} GiB: simulating on {gpu.name}",
                   err=True)
    batch_size = batch_size or result.context.get("batch_size")
    try:
        spec = _load_model(model_file)
        return oom.oom_plan(spec, Budget(gpu), batch_size, precision,
                            progress=lambda m: click.echo(m, err=True),
                            jobs=probe_mod.default_jobs())
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)


def _profile_for_capacity(capacity: int):
    """The profile whose reported capacity matches the log's (within 1%), else a custom card."""
    if capacity <= 0:
        return None
    for p in PROFILES.values():
        if abs(p.total_bytes - capacity) <= 0.01 * capacity:
            return p
    return custom_profile(capacity)
