"""The `oomdoctor` command line: one function per command that parses, calls the library, renders."""
from __future__ import annotations

import json
import os
import sys

import click

from oomdoctor import __version__
from oomdoctor.allocator import AllocatorConfig
from oomdoctor.configs import MAX_BATCH, OPTIMIZERS, PRECISIONS, ZERO_GRAD_MODES
from oomdoctor.gpus import PROFILES, custom_profile, get_profile, parse_size

# estimate/probe/check import torch (seconds, hundreds of MiB): they are imported inside the
# commands that need them, so `oomdoctor explain` and `--help` stay fast.

# Exit codes, documented in the README ("Exit codes").
EXIT_OK = 0
EXIT_PROBLEM = 1     # explain: no known error found; check: regression; estimate: does not fit
EXIT_USAGE = 2       # click's own usage errors
EXIT_MODEL = 3       # the model file could not be loaded or traced


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="oomdoctor")
def cli() -> None:
    """Predict, explain and gate PyTorch GPU memory - with or without a GPU."""


def _die(e: BaseException, debug: bool, code: int) -> None:
    """One line on stderr (what, why, fix) and the exit code; the traceback only with --debug."""
    if debug:
        import traceback
        traceback.print_exception(e)
    click.echo(f"error: {e}" + ("" if debug else " (--debug for the traceback)"), err=True)
    sys.exit(code)


def _budget_options(f):
    """Options shared by estimate and probe: the card, the model's configuration, output."""
    opts = [
        click.option("--gpu", "gpu_name", metavar="NAME",
                     help="GPU profile: rtx3060-12, rtx3090, rtx4090, a10, l4, t4, v100-16, "
                          "v100-32, a100-40, a100-80, h100-80, a6000 (default: the local "
                          "CUDA GPU, else rtx3090)."),
        click.option("--memory", metavar="SIZE",
                     help="Any card by its capacity, e.g. 24GiB (IEC units)."),
        click.option("--overhead", metavar="SIZE",
                     help="CUDA context outside the allocator (default: the profile's, "
                          "about 400MiB)."),
        click.option("--other", "other_mem", metavar="SIZE", default="0",
                     help="Memory other processes hold on the card."),
        click.option("--margin", default="5%", show_default=True,
                     help="Safety margin, a share of the capacity."),
        click.option("--alloc-conf", envvar="PYTORCH_CUDA_ALLOC_CONF", default="",
                     help="PYTORCH_CUDA_ALLOC_CONF to simulate, e.g. expandable_segments:True "
                          "(default: the environment variable)."),
        click.option("--checkpoint-class", metavar="NAME",
                     help="Module class to checkpoint (default: the most repeated block)."),
        click.option("--grad-accum", default=1, show_default=True, type=click.IntRange(1),
                     help="Micro-batches per optimizer step."),
        click.option("--optimizer", type=click.Choice(list(OPTIMIZERS)),
                     help="Override the model file's optimizer (default: its make_optimizer, "
                          "else AdamW)."),
        click.option("--zero-grad", type=click.Choice(ZERO_GRAD_MODES), default="after-step",
                     show_default=True,
                     help="When the loop drops gradients: after-step (zero_grad(set_to_none="
                          "True) after step), after-forward (zero_grad between forward and "
                          "backward: gradients live through the forward), in-place "
                          "(set_to_none=False: gradients never freed)."),
        click.option("--no-cuda-emulation", is_flag=True,
                     help="Trace as the CPU runs (CPU kernels, for-loop optimizer): for checks "
                          "against a real CPU run."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON (bytes as ints)."),
        click.option("--debug", is_flag=True, help="Show tracebacks."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _make_budget(gpu_name, memory, overhead, other_mem, margin):
    from oomdoctor.estimate import Budget
    try:
        if gpu_name and memory:
            raise ValueError("give --gpu or --memory, not both")
        if memory:
            gpu = custom_profile(parse_size(memory))
        elif gpu_name:
            gpu = get_profile(gpu_name)
        else:
            gpu = _local_gpu()
        m = margin.strip().rstrip("%")
        frac = float(m) / 100 if margin.strip().endswith("%") or float(m) >= 1 else float(m)
        if not 0 <= frac < 1:
            raise ValueError(f"--margin {margin} must be between 0% and 100%")
        return Budget(gpu, frac, parse_size(overhead) if overhead else None,
                      parse_size(other_mem))
    except ValueError as e:
        raise click.UsageError(str(e)) from e


def _local_gpu():
    """The first CUDA GPU if torch sees one, else the users' typical card, said on stderr."""
    import torch
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        for p in PROFILES.values():
            if abs(p.total_bytes - props.total_memory) < 2**30 and \
                    p.compute_capability == (props.major, props.minor):
                return p
        return custom_profile(props.total_memory, props.major >= 8, (props.major, props.minor))
    click.echo("no CUDA GPU here: planning for an rtx3090 (24 GiB); pass --gpu NAME or "
               "--memory SIZE for another card", err=True)
    return get_profile("rtx3090")


def _alloc_config(value: str) -> AllocatorConfig:
    try:
        return AllocatorConfig.from_env(value) if value else AllocatorConfig()
    except ValueError as e:
        raise click.UsageError(f"--alloc-conf: {e}") from e


@cli.command()
@click.argument("model_file", type=click.Path())
@click.option("-b", "--batch-size", type=click.IntRange(1), required=True,
              help="Micro-batch size per GPU.")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True,
              help="fp16/bf16: autocast AMP (fp16 with GradScaler); bf16-pure: model.to(bf16).")
@click.option("--checkpointing", is_flag=True, help="Checkpoint the repeated blocks.")
@_budget_options
def estimate(model_file, batch_size, precision, checkpointing, gpu_name, memory, overhead,
             other_mem, margin, alloc_conf, checkpoint_class, grad_accum, optimizer, zero_grad,
             no_cuda_emulation, as_json, debug):
    """Peak GPU memory of one training configuration, and what it is made of.

    \b
    oomdoctor estimate sample_models/gpt2_small.py --batch-size 8 --precision bf16 --json

    Exit codes: 0 fits, 1 does not fit, 2 usage error, 3 model file error.
    """
    from oomdoctor import estimate as estimate_mod
    from oomdoctor.loader import ModelFileError, load_model_file
    from oomdoctor.trace import TraceConfig
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    alloc = _alloc_config(alloc_conf)
    try:
        spec = load_model_file(model_file)
        cfg = TraceConfig(batch_size, precision, checkpointing, checkpoint_class, grad_accum,
                          optimizer, not no_cuda_emulation, zero_grad=zero_grad)
        result = estimate_mod.estimate(spec, cfg, budget, alloc)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        click.echo(estimate_mod.render_text(result))
    sys.exit(EXIT_OK if result.fits else EXIT_PROBLEM)


@cli.command()
@click.argument("model_file", type=click.Path())
@click.option("--precision", "precisions", type=click.Choice(PRECISIONS), multiple=True,
              help="Probe only these precisions (repeatable; default: fp32, fp16, and bf16 "
                   "AMP and pure bf16 where the card supports bf16).")
@click.option("--checkpointing/--no-checkpointing", default=None,
              help="Probe only with / without checkpointing (default: both).")
@click.option("--max-batch-size", type=click.IntRange(1), default=MAX_BATCH, show_default=True,
              help="Stop searching here.")
@click.option("-j", "--jobs", type=click.IntRange(1), default=None,
              help="Worker processes (default: one per core).")
@_budget_options
def probe(model_file, precisions, checkpointing, max_batch_size, jobs, gpu_name, memory,
          overhead, other_mem, margin, alloc_conf, checkpoint_class, grad_accum, optimizer,
          zero_grad, no_cuda_emulation, as_json, debug):
    """The largest batch size that fits, for each precision x checkpointing configuration.

    \b
    oomdoctor probe sample_models/gpt2_small.py --gpu rtx3090
    oomdoctor probe sample_models/llama7b.py --gpu a100-80 --precision bf16-pure --json

    Progress goes to stderr, the result to stdout.
    Exit codes: 0 something fits, 1 nothing fits, 2 usage error, 3 model file error.
    """
    from oomdoctor import probe as probe_mod
    from oomdoctor.loader import ModelFileError, load_model_file
    from oomdoctor.trace import TraceConfig
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    alloc = _alloc_config(alloc_conf)
    configs = probe_mod.default_matrix(budget.gpu.bf16)
    if precisions:
        bad = [p for p in precisions if p.startswith("bf16") and not budget.gpu.bf16]
        if bad:
            raise click.UsageError(f"{budget.gpu.name} has no bf16 support; drop "
                                   f"--precision {bad[0]}")
        configs = [(p, ck) for p in precisions for ck in (False, True)]
    if checkpointing is not None:
        configs = [(p, ck) for p, ck in configs if ck == checkpointing]
    try:
        spec = load_model_file(model_file)
        base = TraceConfig(1, "fp32", False, checkpoint_class, grad_accum, optimizer,
                           not no_cuda_emulation, zero_grad=zero_grad)
        result = probe_mod.probe(spec, base, budget, configs, alloc,
                                 progress=lambda msg: click.echo(msg, err=True),
                                 max_batch=max_batch_size,
                                 jobs=jobs or probe_mod.default_jobs())
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        click.echo(probe_mod.render_table(result))
    fits = any(r.max_batch_size for r in result.results)
    sys.exit(EXIT_OK if fits else EXIT_PROBLEM)


@cli.command()
@click.option("--config", "config_path", type=click.Path(), default=None,
              help="File with [oomdoctor:NAME] case sections (default: ./setup.cfg).")
@click.option("--update", is_flag=True, help="Record the current peaks as the baseline.")
@click.option("--tolerance", default=None,
              help="Allowed growth, e.g. 2% (overrides the config's; per-case values win).")
@click.option("--format", "fmt", type=click.Choice(["text", "github"]), default="text",
              show_default=True, help="github: workflow annotations on the model files.")
@click.option("--junit-xml", type=click.Path(dir_okay=False), help="Also write JUnit XML here.")
@click.option("-j", "--jobs", type=click.IntRange(1), default=None,
              help="Worker processes (default: one per core).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def check(config_path, update, tolerance, fmt, junit_xml, jobs, as_json, debug):
    """CI gate: fail when a configured case's predicted peak memory grew.

    \b
    oomdoctor check --update     # record oomdoctor-baseline.json, then commit it
    oomdoctor check              # in CI (CPU-only is fine)

    Exit codes: 0 passed, 1 failed (growth beyond the tolerance, budget exceeded, a case that
    cannot be estimated, a case missing from the baseline), 2 usage or configuration error.
    """
    from dataclasses import replace as dc_replace

    from oomdoctor import check as check_mod
    from oomdoctor import probe as probe_mod
    try:
        cfg = check_mod.load_config(config_path)
        if tolerance is not None:
            tol = check_mod._fraction(tolerance, "--tolerance")
            cfg = dc_replace(cfg, tolerance=tol, cases=tuple(
                c if c.tolerance != cfg.tolerance else dc_replace(c, tolerance=tol)
                for c in cfg.cases))
        baseline_path = os.path.join(cfg.root, cfg.baseline)
        baseline = None if update else check_mod.read_baseline(baseline_path)
    except check_mod.ConfigError as e:
        raise click.UsageError(str(e)) from e
    measured = check_mod.measure_all(cfg, jobs or probe_mod.default_jobs(),
                                     progress=lambda m: click.echo(m, err=True))
    if update:
        try:
            doc = check_mod.baseline_document(cfg, measured)
        except ValueError as e:
            _die(e, debug, EXIT_PROBLEM)
        with open(baseline_path, "w", encoding="utf-8") as f:
            f.write(check_mod.dumps_baseline(doc))
        click.echo(f"wrote {baseline_path} ({len(doc['cases'])} cases); commit it", err=True)
        baseline = doc
    result = check_mod.compare(cfg, measured, baseline)
    if junit_xml:
        with open(junit_xml, "w", encoding="utf-8") as f:
            f.write(check_mod.junit_xml(result))
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    elif fmt == "github":
        click.echo(check_mod.render_github(result))
    else:
        click.echo(check_mod.render_table(result))
    sys.exit(EXIT_OK if result.passed else EXIT_PROBLEM)


# --- explain (section owned by the explain module's author) ---
@cli.command("explain")
@click.argument("file", type=click.File("rb"))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (sizes in bytes).")
def explain_command(file, as_json: bool) -> None:
    """Explain the out-of-memory and multi-GPU launch errors in FILE ('-' reads stdin).

    Exit codes: 0 errors found and explained, 1 no known error found, 2 usage error.
    """
    import json

    from oomdoctor import explain as ex  # imported here so `oomdoctor --help` stays fast

    result = ex.explain_file(file)
    if as_json:
        click.echo(json.dumps(ex.to_json(result), indent=2))
    elif result.findings:
        click.echo(ex.render_text(result), nl=False)
    if not result.findings:
        name = getattr(file, "name", "-")
        click.echo(f"oomdoctor explain: no known error found in {result.lines_read:,} lines of {name}. It looks "
                   "for PyTorch/TensorFlow/JAX out-of-memory errors, host-memory kills and multi-GPU launch errors; "
                   "paste the complete error message with the traceback above it.", err=True)
    click.get_current_context().exit(EXIT_OK if result.findings else EXIT_PROBLEM)



def main() -> None:
    cli(prog_name="oomdoctor")


if __name__ == "__main__":
    main()
