"""The `oomdoctor` command line: one function per command that parses, calls the library, renders."""
from __future__ import annotations

import json
import os
import sys

import click

from oomdoctor import __version__
from oomdoctor.allocator import AllocatorConfig
from oomdoctor.configs import (MAX_BATCH, OPTIMIZERS, PRECISIONS, STRATEGY_CHOICES,
                               ZERO_GRAD_MODES)
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
@click.option("--strategy", type=click.Choice(STRATEGY_CHOICES), default="single",
              show_default=True,
              help="Multi-GPU strategy: per-GPU memory of DDP, DataParallel, ZeRO-1/2/3 (fsdp) "
                   "or the naive two-GPU split (pipeline2) on --num-gpus cards.")
@click.option("--num-gpus", type=click.IntRange(1), default=2, show_default=True,
              help="GPUs for --strategy (ignored for single).")
@_budget_options
def estimate(model_file, batch_size, precision, checkpointing, strategy, num_gpus, gpu_name,
             memory, overhead, other_mem, margin, alloc_conf, checkpoint_class, grad_accum,
             optimizer, zero_grad, no_cuda_emulation, as_json, debug):
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
        if strategy != "single":
            from oomdoctor import parallel as par
            report = par.estimate_strategies(spec, cfg, budget, num_gpus, [strategy], alloc,
                                             progress=lambda m: click.echo(m, err=True))
            if report.errors:
                raise ValueError(report.errors[0][1])
        else:
            result = estimate_mod.estimate(spec, cfg, budget, alloc)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    if strategy != "single":
        # The per-GPU view: every GPU's peak, the model-state floor, DeepSpeed's formula.
        click.echo(json.dumps(report.to_json(), indent=2) if as_json
                   else par.render_report(report))
        sys.exit(EXIT_OK if all(e.fits for e in report.estimates) else EXIT_PROBLEM)
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
@_budget_options
def probe(model_file, precisions, checkpointing, max_batch_size, jobs, strategy, num_gpus,
          target_batch, run_smoke, device, gpu_name,
          memory, overhead, other_mem, margin, alloc_conf, checkpoint_class, grad_accum,
          optimizer, zero_grad, no_cuda_emulation, as_json, debug):
    """The largest batch size that fits, for each precision x checkpointing configuration.

    \b
    oomdoctor probe sample_models/gpt2_small.py --gpu rtx3090
    oomdoctor probe sample_models/gpt2_small.py --gpu rtx3090 --num-gpus 2 --target-batch 256
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
                                 jobs=jobs or probe_mod.default_jobs(),
                                 strategy=strategy, num_gpus=num_gpus or 2)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    if device:     # measures, prints and exits: the plan below would be thrown away
        _measure_probe(spec, base, result, device, max_batch_size, as_json, debug)
    best = probe_mod.recommended(result) if strategy == "single" else None
    plan = None
    if strategy == "single":
        detected = _detect_gpus(gpu_name, memory, num_gpus)
        n = num_gpus or (detected[1] if detected else 1)
        if n > 1:
            plan = _multi_gpu_plan(spec, best, budget, alloc, base, n, detected, target_batch,
                                   jobs, debug)
    smoke = None
    if run_smoke and best is not None:
        from oomdoctor import smoke as smoke_mod
        smoke = _smoke_run(spec, smoke_mod.SmokeConfig(
            "single", 1, best.precision, best.checkpointing, checkpoint_class,
            best.max_batch_size, grad_accum, optimizer=optimizer), budget, alloc, debug)
    if as_json:
        doc = result.to_json()
        if plan is not None:
            doc["multi_gpu_plan"] = plan.to_json()
        if smoke is not None:
            doc["smoke"] = smoke.to_json()
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(probe_mod.render_table(result))
        if strategy == "single":
            click.echo(probe_mod.render_recommendation(result))
        if plan is not None:
            from oomdoctor import recommend as rec
            scope = ("at the recommended precision (all precisions and strategies: "
                     "`oomdoctor recommend`)" if best is not None
                     else "every precision, since none fits one card")
            click.echo(f"\non {plan.num_gpus} GPUs, {scope}:\n")
            click.echo(rec.render_text(plan))
        if smoke is not None:
            click.echo("\n" + smoke_mod.render_text(smoke))
    fits = any(r.max_batch_size for r in result.results)
    sys.exit(EXIT_OK if fits and (smoke is None or smoke.ok) else EXIT_PROBLEM)


def _detect_gpus(gpu_name, memory, num_gpus):
    """This machine's CUDA GPUs as (profile, count, link), or None: only when the hardware was
    not given (a named card or count means planning for other hardware)."""
    if gpu_name or memory or num_gpus:
        return None
    from oomdoctor import recommend as rec
    return rec.detect_hardware()


def _multi_gpu_plan(spec, best, budget, alloc, base, num_gpus, detected, target_batch, jobs,
                    debug):
    """The end of a single-GPU probe on N > 1 GPUs: the recommended precision and
    checkpointing (``best``), planned across every strategy (recommend.recommend, restricted)."""
    from dataclasses import replace as dc_replace

    from oomdoctor import probe as probe_mod
    from oomdoctor import recommend as rec
    from oomdoctor.loader import ModelFileError
    # Nothing fits one card: plan every precision (sharding or the split may still fit).
    precisions = [best.precision] if best is not None else None
    checkpointing = [best.checkpointing] if best is not None else None
    click.echo(f"planning {num_gpus} GPUs for an effective batch of {target_batch}", err=True)
    try:
        hw = rec.hardware(budget.gpu, num_gpus, detected[2] if detected else None,
                          detected is not None)
        return rec.recommend(spec, hw, target_batch, budget, precisions, None, alloc,
                             dc_replace(base, grad_accum=1), checkpointing,
                             jobs=jobs or probe_mod.default_jobs(), top=5, detail=False,
                             progress=_progress)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)


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


# --- parallel, split, recommend, smoke (section owned by the multi-GPU modules' author) ---
# Choices spelled out here so that --help never imports torch; tests/test_parallel.py checks
# them against oomdoctor.parallel.STRATEGIES and oomdoctor.recommend.LINKS.
LINK_CHOICES = ("pcie-no-p2p", "pcie", "nvlink")


def _card_options(f):
    """The card and the allocator, for the multi-GPU commands."""
    opts = [
        click.option("--gpu", "gpu_name", metavar="NAME",
                     help="GPU profile, e.g. rtx3090 (default: the local CUDA GPU, else "
                          "rtx3090)."),
        click.option("--memory", metavar="SIZE", help="Any card by its capacity, e.g. 24GiB."),
        click.option("--num-gpus", "--gpus", "num_gpus", type=click.IntRange(1), default=None,
                     help="GPUs (default: the local count, else 2)."),
        click.option("--overhead", metavar="SIZE",
                     help="CUDA context outside the allocator (default: the profile's)."),
        click.option("--other", "other_mem", metavar="SIZE", default="0",
                     help="Memory other processes hold on each card."),
        click.option("--margin", default="5%", show_default=True,
                     help="Safety margin, a share of the capacity."),
        click.option("--alloc-conf", envvar="PYTORCH_CUDA_ALLOC_CONF", default="",
                     help="PYTORCH_CUDA_ALLOC_CONF to simulate (default: the environment)."),
        click.option("--checkpoint-class", metavar="NAME",
                     help="Module class to checkpoint (default: the most repeated block)."),
        click.option("--optimizer", type=click.Choice(list(OPTIMIZERS)),
                     help="Override the model file's optimizer."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON (bytes as ints)."),
        click.option("--debug", is_flag=True, help="Show tracebacks."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _num_gpus(num_gpus):
    """--num-gpus, else the local CUDA count, else the users' two cards (said on stderr)."""
    if num_gpus:
        return num_gpus
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        return torch.cuda.device_count()
    click.echo("planning for 2 GPUs; pass --num-gpus N for another count", err=True)
    return 2


def _progress(msg: str) -> None:
    click.echo(msg, err=True)


@cli.command("parallel")
@click.argument("model_file", type=click.Path())
@click.option("-b", "--batch-size", type=click.IntRange(1), default=1, show_default=True,
              help="Micro-batch per GPU (per data-parallel rank).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option("--checkpointing", is_flag=True, help="Checkpoint the repeated blocks.")
@click.option("--grad-accum", default=1, show_default=True, type=click.IntRange(1),
              help="Micro-batches per optimizer step.")
@click.option("--strategy", "strategies", multiple=True, type=click.Choice(STRATEGY_CHOICES),
              help="Only these strategies (repeatable; default: all).")
@click.option("--bucket-view", is_flag=True,
              help="DDP with gradient_as_bucket_view=True (no second copy of the gradients).")
@_card_options
def parallel_command(model_file, batch_size, precision, checkpointing, grad_accum, strategies,
                     bucket_view, gpu_name, memory, num_gpus, overhead, other_mem, margin,
                     alloc_conf, checkpoint_class, optimizer, as_json, debug):
    """Per-GPU memory of single, DDP, DataParallel, ZeRO-1/2/3 (FSDP) and a 2-GPU split.

    \b
    oomdoctor parallel sample_models/gpt2_small.py --gpus 2 --gpu rtx3090 -b 8 --precision bf16
    oomdoctor parallel sample_models/llama7b.py --gpus 2 --precision bf16-pure --checkpointing

    Exit codes: 0 some strategy fits, 1 none fits, 2 usage error, 3 model file error.
    """
    from oomdoctor import parallel as par
    from oomdoctor.loader import ModelFileError, load_model_file
    from oomdoctor.trace import TraceConfig
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    alloc = _alloc_config(alloc_conf)
    n = _num_gpus(num_gpus)
    try:
        spec = load_model_file(model_file)
        cfg = TraceConfig(batch_size, precision, checkpointing, checkpoint_class, grad_accum,
                          optimizer)
        report = par.estimate_strategies(spec, cfg, budget, n, strategies or par.STRATEGIES,
                                         alloc, bucket_view, progress=_progress)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else par.render_report(report))
    sys.exit(EXIT_OK if any(e.fits for e in report.estimates) else EXIT_PROBLEM)


@cli.command("split")
@click.argument("model_file", type=click.Path())
@click.option("-b", "--batch-size", type=click.IntRange(1), default=1, show_default=True,
              help="Micro-batch (the whole batch: both GPUs see it in turn).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option("--checkpointing", is_flag=True, help="Checkpoint the repeated blocks.")
@click.option("--grad-accum", default=1, show_default=True, type=click.IntRange(1))
@click.option("--device-map", "device_map_path", type=click.Path(dir_okay=False),
              help="Write the partition as JSON for accelerate's dispatch_model (and smoke).")
@_card_options
def split_command(model_file, batch_size, precision, checkpointing, grad_accum, device_map_path,
                  gpu_name, memory, num_gpus, overhead, other_mem, margin, alloc_conf,
                  checkpoint_class, optimizer, as_json, debug):
    """A naive two-GPU split: which modules go on cuda:0 and cuda:1, each GPU's memory.

    \b
    oomdoctor split sample_models/llama7b.py --gpus 2 --gpu rtx3090 --precision bf16-pure
    oomdoctor split model.py --gpus 2 --device-map map.json && oomdoctor smoke model.py \\
        --strategy pipeline2 --device-map map.json

    Exit codes: 0 both stages fit, 1 a stage does not fit, 2 usage error, 3 model file error.
    """
    from oomdoctor import parallel as par
    from oomdoctor.loader import ModelFileError, load_model_file
    from oomdoctor.trace import TraceConfig
    if num_gpus not in (None, 2):
        raise click.UsageError(f"the naive split uses exactly 2 GPUs (got --gpus {num_gpus}); "
                               "for more GPUs use `oomdoctor parallel --strategy zero3`")
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    alloc = _alloc_config(alloc_conf)
    try:
        spec = load_model_file(model_file)
        cfg = TraceConfig(batch_size, precision, checkpointing, checkpoint_class, grad_accum,
                          optimizer)
        plan = par.plan_split(spec, cfg, budget, alloc, progress=_progress)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    doc = plan.to_json()
    if device_map_path:
        with open(device_map_path, "w", encoding="utf-8") as f:
            json.dump({"model": doc["model"], "main_device": doc["main_device"],
                       "device_map": doc["device_map"]}, f, indent=2)
        click.echo(f"wrote the device map to {device_map_path}", err=True)
    click.echo(json.dumps(doc, indent=2) if as_json else par.render_split(plan))
    sys.exit(EXIT_OK if plan.estimate.fits else EXIT_PROBLEM)


@cli.command("recommend")
@click.argument("model_file", type=click.Path())
@click.option("--target-batch", type=click.IntRange(1), default=256, show_default=True,
              help="The effective batch you want (micro-batch x accumulation x GPUs).")
@click.option("--precision", "precisions", type=click.Choice(PRECISIONS), multiple=True,
              help="Allowed precisions (repeatable; default: all the card supports).")
@click.option("--strategy", "strategies", multiple=True, type=click.Choice(STRATEGY_CHOICES),
              help="Allowed strategies (repeatable; default: all).")
@click.option("--link", type=click.Choice(LINK_CHOICES),
              help="GPU-to-GPU link (default: detected, else pcie-no-p2p for GeForce cards).")
@click.option("--top", type=click.IntRange(1), default=8, show_default=True,
              help="Configurations to list.")
@click.option("-j", "--jobs", type=click.IntRange(1), default=None,
              help="Worker processes (default: one per core).")
@click.option("--quick", is_flag=True,
              help="Skip the per-strategy table when nothing can fit (no trace).")
@click.option("--smoke", "run_smoke", is_flag=True,
              help="Then run a few real training steps of the recommended configuration.")
@_card_options
def recommend_command(model_file, target_batch, precisions, strategies, link, top, jobs, quick,
                      run_smoke, gpu_name, memory, num_gpus, overhead, other_mem, margin,
                      alloc_conf, checkpoint_class, optimizer, as_json, debug):
    """Recommend precision, checkpointing, strategy, micro-batch and accumulation.

    \b
    oomdoctor recommend sample_models/gpt2_small.py --gpu rtx3090 --num-gpus 2 --target-batch 256
    oomdoctor recommend sample_models/llama7b.py --gpu rtx3090 --num-gpus 2 --target-batch 64

    Exit codes: 0 a configuration fits, 1 nothing fits (the output says what would), 2 usage
    error, 3 model file error.
    """
    from oomdoctor import probe as probe_mod
    from oomdoctor import recommend as rec
    from oomdoctor.loader import ModelFileError, load_model_file
    from oomdoctor.parallel import parse_strategy
    from oomdoctor.trace import TraceConfig
    detected = _detect_gpus(gpu_name, memory, num_gpus)
    if detected is not None:
        gpu_name = gpu_name or detected[0].name
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    alloc = _alloc_config(alloc_conf)
    n = num_gpus or (detected[1] if detected else _num_gpus(None))
    try:
        hw = rec.hardware(budget.gpu, n, link or (detected[2] if detected else None),
                          detected is not None)
        spec = load_model_file(model_file)
        base = TraceConfig(1, "fp32", False, checkpoint_class, 1, optimizer)
        result = rec.recommend(spec, hw, target_batch, budget, list(precisions) or None,
                               list(dict.fromkeys(parse_strategy(s) for s in strategies))
                               or None, alloc, base, jobs=jobs or probe_mod.default_jobs(),
                               top=top, detail=not quick, progress=_progress)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    smoked = None
    if run_smoke and result.best is not None:
        smoked = _smoke_best(spec, result.best, budget, alloc, checkpoint_class, optimizer,
                             debug)
    if as_json:
        doc = result.to_json()
        if smoked is not None:
            doc["smoke"] = smoked.to_json()
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(rec.render_text(result))
        if smoked is not None:
            from oomdoctor import smoke as smoke_mod
            click.echo("\n" + smoke_mod.render_text(smoked))
    if smoked is not None and not smoked.ok:
        sys.exit(EXIT_PROBLEM)
    sys.exit(EXIT_OK if result.best is not None else EXIT_PROBLEM)


def _smoke_best(spec, best, budget, alloc, checkpoint_class, optimizer, debug):
    """recommend --smoke: a few real steps of the recommended configuration."""
    from oomdoctor import smoke as smoke_mod
    cfg = smoke_mod.SmokeConfig(best.strategy, best.num_gpus, best.precision,
                                best.checkpointing, checkpoint_class, best.micro_batch,
                                best.grad_accum, optimizer=optimizer)
    return _smoke_run(spec, cfg, budget, alloc, debug)


def _smoke_run(spec, cfg, budget, alloc, debug):
    """Run a smoke configuration against its prediction (probe --smoke, recommend --smoke)."""
    from oomdoctor import smoke as smoke_mod
    try:
        cfg, prediction = _smoke_prediction(spec, cfg, budget, alloc)
        return smoke_mod.run_smoke(spec, cfg, prediction, progress=_progress)
    except (smoke_mod.SmokeError, ValueError) as e:
        _die(e, debug, EXIT_PROBLEM)


def _smoke_prediction(spec, cfg, budget, alloc):
    """The device map a split needs, and the prediction to compare with when CUDA is here."""
    import dataclasses

    import torch

    from oomdoctor import parallel as par
    from oomdoctor.trace import TraceConfig
    have_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= cfg.num_gpus
    tcfg = TraceConfig(cfg.micro_batch, cfg.precision, cfg.checkpointing, cfg.checkpoint_class,
                       cfg.grad_accum, cfg.optimizer)
    if cfg.strategy == "pipeline2" and cfg.device_map is None:
        plan = par.plan_split(spec, tcfg, budget, alloc, progress=_progress)
        cfg = dataclasses.replace(cfg, device_map=plan.partition.device_map,
                                  main_device=plan.partition.main_stage)
        return cfg, plan.estimate if have_cuda else None
    if not have_cuda:
        return cfg, None
    _progress("predicting the per-GPU peaks to compare with")
    from oomdoctor.estimate import trace_for
    trace = trace_for(spec, tcfg, budget.gpu)
    sizes = None
    if cfg.strategy == "dp":      # GPU 0 holds the whole batch: its sizes from a second trace
        big = trace_for(spec, dataclasses.replace(tcfg, batch_size=cfg.micro_batch
                                                  * cfg.num_gpus), budget.gpu)
        sizes = par.Sizes.affine(trace, big)
    layout = par.model_layout(spec, cfg.precision)
    return cfg, par.estimate_strategy(trace, layout, par.Strategy(cfg.strategy, cfg.num_gpus),
                                      budget, alloc, sizes, grad_accum=cfg.grad_accum)


@cli.command("smoke")
@click.argument("model_file", type=click.Path())
@click.option("--strategy", type=click.Choice(STRATEGY_CHOICES), default="single",
              show_default=True)
@click.option("-b", "--batch-size", type=click.IntRange(1), default=1, show_default=True,
              help="Micro-batch per GPU.")
@click.option("--grad-accum", default=1, show_default=True, type=click.IntRange(1))
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option("--checkpointing", is_flag=True, help="Checkpoint the repeated blocks.")
@click.option("--steps", type=click.IntRange(1), default=3, show_default=True)
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto",
              show_default=True, help="auto: the GPUs when enough are visible, else the CPU.")
@click.option("--cpu-batch", type=click.IntRange(1), default=2, show_default=True,
              help="Largest micro-batch run on the CPU.")
@click.option("--device-map", "device_map_path", type=click.Path(exists=True, dir_okay=False),
              help="pipeline2: the map `oomdoctor split --device-map` wrote (default: "
                   "computed now).")
@_card_options
def smoke_command(model_file, strategy, batch_size, grad_accum, precision, checkpointing, steps,
                  device, cpu_batch, device_map_path, gpu_name, memory, num_gpus, overhead,
                  other_mem, margin, alloc_conf, checkpoint_class, optimizer, as_json, debug):
    """Run a few real training steps; loss per step, step time, measured vs predicted peaks.

    \b
    oomdoctor smoke sample_models/tiny_mlp.py --strategy ddp --gpus 2 -b 16 --grad-accum 2
    oomdoctor smoke model.py --strategy pipeline2 --device-map map.json --precision bf16

    Without CUDA it runs on the CPU (gloo processes, bf16 autocast, the split via accelerate)
    and says that GPU memory was not measured.
    Exit codes: 0 passed, 1 failed (OOM, peak >10% off the prediction, loss not finite or
    not moving, or the run could not start), 2 usage error, 3 model file error.
    """
    from oomdoctor import smoke as smoke_mod
    from oomdoctor.loader import ModelFileError, load_model_file
    from oomdoctor.parallel import parse_strategy
    strategy = parse_strategy(strategy)
    n = 1 if strategy == "single" else _num_gpus(num_gpus)
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    alloc = _alloc_config(alloc_conf)
    dmap, main = None, 0
    if device_map_path:
        with open(device_map_path, encoding="utf-8") as f:
            doc = json.load(f)
        dmap, main = doc.get("device_map"), int(doc.get("main_device", 0))
    try:
        spec = load_model_file(model_file)
        cfg = smoke_mod.SmokeConfig(strategy, n, precision, checkpointing, checkpoint_class,
                                    batch_size, grad_accum, steps, optimizer, device, cpu_batch,
                                    dmap, main)
        cfg, prediction = _smoke_prediction(spec, cfg, budget, alloc)
        result = smoke_mod.run_smoke(spec, cfg, prediction, progress=_progress)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except smoke_mod.SmokeError as e:
        _die(e, debug, EXIT_PROBLEM)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    click.echo(json.dumps(result.to_json(), indent=2) if as_json
               else smoke_mod.render_text(result))
    sys.exit(EXIT_OK if result.ok else EXIT_PROBLEM)


# --- gpus, watch (section owned by the NVML modules' author) ---
EXIT_NO_GPU = 4      # gpus: no NVIDIA driver or no GPU (oomdoctor.nvml.EXIT_NO_DRIVER)


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
    from oomdoctor import nvml
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
    from oomdoctor import nvml, watch
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError("--plot needs matplotlib, which is not installed: "
                                   "pip install 'oomdoctor[plot]' (or matplotlib), or drop --plot")
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
        click.echo(ex.render_text(result), nl=False)
        if plan is not None:
            click.echo(f"\nSimulated with {plan.model} on {plan.gpu}: {plan.summary()}.")
    if not result.findings:
        name = getattr(file, "name", "-")
        click.echo(f"oomdoctor explain: no known error found in {result.lines_read:,} lines of {name}. It looks "
                   "for PyTorch/TensorFlow/JAX out-of-memory errors, host-memory kills and multi-GPU launch errors; "
                   "paste the complete error message with the traceback above it.", err=True)
    click.get_current_context().exit(EXIT_OK if result.findings else EXIT_PROBLEM)


def _oom_plan(result, model_file, gpu_name, batch_size, precision, debug):
    """The simulator's side of `explain --model`: the card from --gpu or from the capacity the
    log states, the batch from --batch-size or from the log."""
    from oomdoctor import probe as probe_mod
    from oomdoctor.estimate import Budget
    from oomdoctor.loader import ModelFileError, load_model_file
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
        spec = load_model_file(model_file)
        return probe_mod.oom_plan(spec, Budget(gpu), batch_size, precision,
                                  progress=lambda m: click.echo(m, err=True),
                                  jobs=probe_mod.default_jobs())
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)


def _measure_probe(spec, base, predicted, device, max_batch, as_json, debug):
    """`probe --device cuda`: measure each probed configuration for real, seeded by the
    simulator's answer, print measured vs predicted, and exit."""
    from dataclasses import replace as dc_replace

    from tabulate import tabulate

    from oomdoctor import measure
    runs = []
    try:
        for r in predicted.results:
            if r.error:
                continue
            cfg = dc_replace(base, precision=r.precision, checkpointing=r.checkpointing)
            runs.append((r, measure.measured_probe(
                spec, cfg, device, r.max_batch_size or 0, progress=_progress,
                max_batch=max_batch)))
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


def _profile_for_capacity(capacity: int):
    """The profile whose reported capacity matches the log's (within 1%), else a custom card."""
    if capacity <= 0:
        return None
    for p in PROFILES.values():
        if abs(p.total_bytes - capacity) <= 0.01 * capacity:
            return p
    return custom_profile(capacity)


def main() -> None:
    try:
        cli(prog_name="oomdoctor")
    except SystemExit as e:
        code = e.code
    else:
        code = 0
    _exit_fast(code)


def _exit_fast(code: int | str | None) -> None:
    """Exit without the interpreter's teardown once torch is loaded.

    Finalising the interpreter after `import torch` (and torch._dynamo, which every optimizer
    constructor imports) takes about 1.5 s on a 2-core machine - a quarter of an `estimate` -
    spent freeing objects the OS reclaims anyway. Everything this process owns is closed by
    then: output files are written in `with` blocks, worker pools and child processes are joined,
    temporary directories removed. Only the console entry point does this; click's
    CliRunner (the tests) and library callers never reach it."""
    if isinstance(code, str):           # sys.exit("message"): print it like Python would
        sys.stderr.write(code + "\n")
        code = 1
    code = 0 if code is None else code
    if "torch" not in sys.modules:
        sys.exit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):   # the reader went away, or the stream was closed
        pass
    os._exit(code)


if __name__ == "__main__":
    main()
