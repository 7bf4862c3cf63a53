"""The multi-GPU commands: `oomdoctor parallel`, `split`, `recommend` and `smoke`."""
from __future__ import annotations

import dataclasses
import json
import sys

import click

from oomdoctor.cli.group import (EXIT_MODEL, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE,
                                 cli)
from oomdoctor.cli.script import model_or_script
from oomdoctor.cli.deepspeed_options import (_deepspeed_defaults, _deepspeed_run,
                                             _ds_config_option)
from oomdoctor.cli.options import (_bucket_view_option, _cpu_offload, _cpu_offload_option,
                                   _fsdp_version, _fsdp_version_option, _alloc_config, _card_options, _check_plot_file, _detect_gpus,
                                   _die, _load_model, _make_budget, _mp_policy,
                                   _mp_policy_option, _num_gpus, _progress, _torch_config,
                                   _checkpoint_config,
                                   _link_option, LINKS,
                                   _write_bar_plot)
from oomdoctor.cli.runs import _smoke_best, _smoke_prediction, _smoke_script, smoke_verdict
from oomdoctor.configs import (DEEPSPEED_CHOICES, MODEL_PROTOCOL, NODE_STRATEGY_CHOICES,
                               PRECISIONS, STRATEGY_CHOICES)

# --- parallel, split, recommend, smoke (section owned by the multi-GPU modules' author) ---
# Choices spelled out here so that --help never imports torch; tests/test_parallel.py checks
# them against oomdoctor.plans.parallel.STRATEGIES and oomdoctor.plans.recommend.LINKS.
LINK_CHOICES = LINKS
INTER_NODE_CHOICES = ("ib", "ethernet")          # oomdoctor.plans.recommend.INTER_NODE_GBPS
_NODES = click.option("--nodes", type=click.IntRange(1), default=1, show_default=True,
                      help="Machines, each with --num-gpus GPUs (plans and launch lines for "
                           "several nodes).")


@cli.command("parallel", epilog=MODEL_PROTOCOL)
@click.argument("model_file", nargs=-1, required=True, metavar="MODEL",
                callback=model_or_script)
@click.option("-b", "--batch-size", type=click.IntRange(1), default=1, show_default=True,
              help="Micro-batch per GPU (per data-parallel rank).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option("--checkpointing", is_flag=True, help="Checkpoint the repeated blocks.")
@click.option("--grad-accum", default=1, show_default=True, type=click.IntRange(1),
              help="Micro-batches per optimizer step.")
@click.option("--strategy", "strategies", multiple=True,
              type=click.Choice(STRATEGY_CHOICES + DEEPSPEED_CHOICES),
              help="Only these strategies (repeatable; default: all of PyTorch's). ds0..ds3: "
                   "DeepSpeed's ZeRO stages as DeepSpeed runs them (fp16/bf16 in its own mode: "
                   "16-bit model, fp32 master weights in the optimizer).")
@_ds_config_option
@_bucket_view_option
@_mp_policy_option
@_fsdp_version_option
@_cpu_offload_option
@_link_option
@_card_options
@click.pass_context
def parallel_command(ctx, model_file, batch_size, precision, checkpointing, grad_accum,
                     strategies, ds_config, ds_release, bucket_view, mp_policy, fsdp_version,
                     cpu_offload, link, gpu_name,
                     memory, num_gpus, overhead, other_mem, margin, alloc_conf, checkpoint_class,
                     optimizer, as_json, debug):
    """Per-GPU memory of single, DDP, DataParallel, ZeRO-1/2/3 (FSDP) and a 2-GPU split; and
    of DeepSpeed's ZeRO stages on request.

    \b
    oomdoctor parallel sample_models/gpt2_small.py --gpus 2 --gpu rtx3090 -b 8 --precision bf16
    oomdoctor parallel sample_models/llama7b.py --gpus 2 --precision bf16-pure --checkpointing
    oomdoctor parallel sample_models/gpt2_small.py --gpus 4 --strategy ds2 --precision fp16
    oomdoctor parallel --gpus 2 --gpu rtx3090 -- python train.py --lr 3e-4

    After `--`, MODEL is a single-GPU training script's command line: it runs once on a fake
    GPU (at -b per GPU when given) and its step is planned across the strategies.

    Exit codes: 0 some strategy fits, 1 none fits, 2 usage error, 3 model file error.
    """
    from oomdoctor.plans import parallel as par
    from oomdoctor.models.spec import ModelFileError
    from oomdoctor.sim.trace import TraceConfig
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    alloc = _alloc_config(alloc_conf)
    n = _num_gpus(num_gpus)
    script = _planned_script(ctx, model_file, debug, ds_config, mp_policy)
    if script is not None:
        report = _parallel_script(ctx, script, budget, n, strategies, alloc, bucket_view, debug,
                                  _fsdp_version(fsdp_version, strategies))
        _print_parallel(report, link, budget, gpu_name, memory, n, as_json)
    model_file = model_file[0]
    ds = _deepspeed_defaults(ctx)
    if ds_config:
        precision, strategies, ds = _deepspeed_run(ctx, ds_config, precision, strategies)
    try:
        spec = _load_model(model_file)
        cfg = TraceConfig(batch_size, precision, checkpointing, checkpoint_class, grad_accum,
                          optimizer, **_torch_config(), **_checkpoint_config(checkpointing))
        report = par.estimate_strategies(spec, cfg, budget, n, strategies or par.STRATEGIES,
                                         alloc, bucket_view, progress=_progress,
                                         mixed_precision=_mp_policy(mp_policy, precision,
                                                                    strategies),
                                         deepspeed=ds,
                                         fsdp_version=_fsdp_version(fsdp_version, strategies),
                                         cpu_offload=_cpu_offload(cpu_offload, strategies))
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    _print_parallel(report, link, budget, gpu_name, memory, n, as_json)


def _print_parallel(report, link, budget, gpu_name, memory, num_gpus, as_json):
    """Print parallel's report, with the link it assumed, and exit with its verdict."""
    from oomdoctor.plans import parallel as par
    report = dataclasses.replace(report, link=_assumed_link(link, budget, gpu_name, memory,
                                                            num_gpus))
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else par.render_report(report))
    sys.exit(EXIT_OK if any(e.fits for e in report.estimates) else EXIT_PROBLEM)


def _planned_script(ctx, words, debug, ds_config, mp_policy):
    """The ScriptSpec when MODEL is a command line (the options that describe a model file's
    loop refused), else None."""
    from oomdoctor.cli import script as script_cli
    from oomdoctor.models.spec import ModelFileError
    try:
        script = script_cli.script_of(words)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    if script is None:
        return None
    script_cli.refuse_loop_options(ctx, allowed=("strategy", "strategies"))
    if ds_config or mp_policy is not None:
        raise click.UsageError(f"--{'ds-config' if ds_config else 'mp-policy'} describes how a "
                               "framework runs a model's precision; a script decides its own")
    return script


def _parallel_script(ctx, script, budget, num_gpus, strategies, alloc, bucket_view, debug,
                     fsdp_version=2):
    """`parallel -- python train.py`: the script's run, planned across strategies."""
    from oomdoctor.plans import parallel as par
    from oomdoctor.models.spec import ModelFileError
    try:
        return _script_run(ctx, lambda batch, seq: par.estimate_script_strategies(
            script, budget, num_gpus, strategies or par.STRATEGIES, alloc, bucket_view,
            progress=_progress, batch_size=batch, seq_len=seq, fsdp_version=fsdp_version))
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)


def _script_run(ctx, plan):
    """``plan(batch_size, seq_len)`` with the script's prints on stderr: -b when given on the
    command line (every DataLoader's batch size, or {batch}), --seq-len for {seq}."""
    from oomdoctor.cli.script import run_script, seq_len_option
    given = ctx.get_parameter_source("batch_size") is click.core.ParameterSource.COMMANDLINE
    seq = seq_len_option(ctx)
    return run_script(lambda: plan(ctx.params["batch_size"] if given else None, seq))


def _assumed_link(link, budget, gpu_name, memory, num_gpus) -> str:
    """--link, else the detected GPUs' link, else the card's default (GeForce: no P2P)."""
    from oomdoctor.plans.recommend.machine import default_link
    if link:
        return link
    detected = _detect_gpus(gpu_name, memory, num_gpus)
    return (detected[2] if detected and detected[2] else None) or default_link(budget.gpu)


@cli.command("split", epilog=MODEL_PROTOCOL)
@click.argument("model_file", nargs=-1, required=True, metavar="MODEL",
                callback=model_or_script)
@click.option("-b", "--batch-size", type=click.IntRange(1), default=1, show_default=True,
              help="Micro-batch (the whole batch: both GPUs see it in turn).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option("--checkpointing", is_flag=True, help="Checkpoint the repeated blocks.")
@click.option("--grad-accum", default=1, show_default=True, type=click.IntRange(1))
@click.option("--device-map", "device_map_path", type=click.Path(dir_okay=False),
              help="Write the partition as JSON for accelerate's dispatch_model (and smoke).")
@_card_options
@click.pass_context
def split_command(ctx, model_file, batch_size, precision, checkpointing, grad_accum,
                  device_map_path, gpu_name, memory, num_gpus, overhead, other_mem, margin,
                  alloc_conf, checkpoint_class, optimizer, as_json, debug):
    """A naive two-GPU split: which modules go on cuda:0 and cuda:1, each GPU's memory.

    \b
    oomdoctor split sample_models/llama7b.py --gpus 2 --gpu rtx3090 --precision bf16-pure
    oomdoctor split model.py --gpus 2 --device-map map.json && oomdoctor smoke model.py \\
        --strategy pipeline2 --device-map map.json
    oomdoctor split --gpus 2 --gpu rtx3090 -- python train.py --lr 3e-4

    Exit codes: 0 both stages fit, 1 a stage does not fit, 2 usage error, 3 model file error.
    """
    from oomdoctor.plans import parallel as par
    from oomdoctor.models.spec import ModelFileError
    from oomdoctor.sim.trace import TraceConfig
    if num_gpus not in (None, 2):
        raise click.UsageError(f"the naive split uses exactly 2 GPUs (got --gpus {num_gpus}); "
                               "for more GPUs use `oomdoctor parallel --strategy zero3`")
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    alloc = _alloc_config(alloc_conf)
    script = _planned_script(ctx, model_file, debug, None, None)
    try:
        if script is not None:
            plan = _script_run(ctx, lambda batch, seq: par.plan_script_split(
                script, budget, alloc, progress=_progress, batch_size=batch, seq_len=seq))
        else:
            spec = _load_model(model_file[0])
            cfg = TraceConfig(batch_size, precision, checkpointing, checkpoint_class,
                              grad_accum, optimizer, **_torch_config(),
                              **_checkpoint_config(checkpointing))
            plan = par.plan_split(spec, cfg, budget, alloc, progress=_progress)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    doc = plan.to_json()
    if device_map_path:
        from oomdoctor.models.adapters import base_model_names
        # the base model's names: from_pretrained(..., device_map=...) places them before
        # get_peft_model wraps it (smoke maps them back onto the wrapped model)
        with open(device_map_path, "w", encoding="utf-8") as f:
            json.dump({"model": doc["model"], "main_device": doc["main_device"],
                       "device_map": base_model_names(doc["device_map"])}, f, indent=2)
        click.echo(f"wrote the device map to {device_map_path}", err=True)
    click.echo(json.dumps(doc, indent=2) if as_json else par.render_split(plan))
    sys.exit(EXIT_OK if plan.estimate.fits else EXIT_PROBLEM)


@cli.command("recommend", epilog=MODEL_PROTOCOL)
@click.argument("model_file", nargs=-1, required=True, metavar="MODEL | -- COMMAND...",
                callback=model_or_script)
@click.option("--target-batch", type=click.IntRange(1), default=256, show_default=True,
              help="The effective batch you want (micro-batch x accumulation x GPUs).")
@click.option("--precision", "precisions", type=click.Choice(PRECISIONS), multiple=True,
              help="Allowed precisions (repeatable; default: all the card supports but "
                   "fp16-pure, which is searched only if named).")
@click.option("--strategy", "strategies", multiple=True,
              type=click.Choice(NODE_STRATEGY_CHOICES),
              help="Allowed strategies (repeatable; default: all; hsdp with --nodes).")
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
@_NODES
@click.option("--inter-node-link", "inter_node", type=click.Choice(INTER_NODE_CHOICES),
              default="ethernet", show_default=True,
              help="Link between nodes: ib (HDR, 25 GB/s) or ethernet (10 GbE, 1.25 GB/s).")
@click.option("--inter-node-bandwidth", "inter_node_gbps", type=click.FloatRange(min=0.001),
              metavar="GB/S", help="Per-direction GB/s between nodes, e.g. 3.125 for 25 GbE.")
@click.option("--host-ram", metavar="SIZE",
              help="RAM of each node for the CPU offload plans, e.g. 128GiB (default: this "
                   "machine's when planning for its own GPUs).")
@click.option("--trainings", type=click.IntRange(2), default=None, metavar="N",
              help="N equal trainings on these GPUs (this one included): compare one per GPU, "
                   "one after the other, and side by side (memory split N ways, compute "
                   "time-sliced).")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Draw each strategy's per-GPU peak reserved, stacked by category, against "
                   "the budget: FILE.png, .svg or .html (needs matplotlib: the plot extra).")
@_card_options
@click.pass_context
def recommend_command(ctx, model_file, target_batch, precisions, strategies, link, top, jobs,
                      quick,
                      run_smoke, nodes, inter_node, inter_node_gbps, host_ram, trainings,
                      plot_file, gpu_name, memory,
                      num_gpus, overhead, other_mem, margin, alloc_conf, checkpoint_class,
                      optimizer, as_json, debug):
    """Recommend precision, checkpointing, strategy, micro-batch and accumulation.

    \b
    oomdoctor recommend sample_models/gpt2_small.py --gpu rtx3090 --num-gpus 2 --target-batch 256
    oomdoctor recommend sample_models/llama7b.py --gpu rtx3090 --num-gpus 2 --target-batch 64
    oomdoctor recommend sample_models/gpt2_small.py --nodes 2 --num-gpus 2 --inter-node-link ib
    oomdoctor recommend --gpu rtx3090 --num-gpus 2 -- python train.py --lr 3e-4

    After `--`, MODEL is a single-GPU training script's command line: it runs on a fake GPU at
    each micro-batch tried (every DataLoader's batch_size, or its {batch}), and the strategy,
    micro-batch and accumulation are planned; its precision and checkpointing stay its own.

    Exit codes: 0 a configuration fits, 1 nothing fits (the output says what would), 2 usage
    error, 3 model file error.
    """
    from oomdoctor.plans import probe as probe_mod
    from oomdoctor.plans import recommend as rec
    from oomdoctor.models.spec import ModelFileError
    from oomdoctor.plans.parallel import parse_strategy
    from oomdoctor.sim.trace import TraceConfig
    if plot_file:
        _check_plot_file(plot_file)
    detected = _detect_gpus(gpu_name, memory, num_gpus)
    if detected is not None:
        gpu_name = gpu_name or detected[0].name
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    # No --alloc-conf: the plan is computed with the setting its launch line sets.
    alloc = _alloc_config(alloc_conf) if alloc_conf else rec.LAUNCH_ALLOCATOR
    n = num_gpus or (detected[1] if detected else _num_gpus(None))
    ram, ram_source = _host_ram(host_ram, detected is not None)
    script = _recommend_script_of(ctx, model_file, debug)
    if script is not None:
        _recommend_script(ctx, script, budget, alloc, n, link or (detected[2] if detected
                                                                  else None), debug)
    model_file = model_file[0]
    try:
        hw = rec.hardware(budget.gpu, n, link or (detected[2] if detected else None),
                          detected is not None, nodes, inter_node, inter_node_gbps)
        spec = _load_model(model_file)
        base = TraceConfig(1, "fp32", False, checkpoint_class, 1, optimizer,
                           **_torch_config(), **_checkpoint_config())
        def plan(hw, budget, detail=not quick):
            return rec.recommend(spec, hw, target_batch, budget, list(precisions) or None,
                                 list(dict.fromkeys(parse_strategy(s) for s in strategies))
                                 or None, alloc, base, jobs=jobs or probe_mod.default_jobs(),
                                 top=top, detail=detail, progress=_progress,
                                 host_ram=ram, host_ram_source=ram_source)
        result = plan(hw, budget)
        shared = None
        if trainings:
            from oomdoctor.plans.recommend.sharing import sharing
            _progress(f"planning {trainings} trainings on these GPUs")
            shared = sharing(result, hw, budget, trainings,
                             lambda hw, budget: plan(hw, budget, detail=False))
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    smoked = None
    if run_smoke and result.best is not None:
        smoked = _smoke_best(spec, result.best, budget, alloc, checkpoint_class, optimizer,
                             debug)
    plot = _recommend_plot(result, plot_file, debug) if plot_file else None
    _print_recommend(result, plot, smoked, shared, as_json)


def _print_recommend(result, plot, smoked, shared, as_json):
    """Print recommend's answer (with its plot, smoke run and sharing plan) and exit with its
    verdict."""
    from oomdoctor.plans import recommend as rec
    if as_json:
        doc = result.to_json()
        if plot is not None:
            doc["plot"] = plot
        if smoked is not None:
            doc["smoke"] = smoked.to_json()
        if shared is not None:
            doc["sharing"] = shared.to_json()
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(rec.render_text(result))
        if shared is not None:
            from oomdoctor.plans.recommend.sharing import render_sharing
            click.echo("\n" + render_sharing(shared))
        if smoked is not None:
            from oomdoctor.runs import smoke as smoke_mod
            from oomdoctor.runs import smoke_nodes
            click.echo("\n" + (smoke_nodes.render_text(smoked) if result.best.nodes > 1
                               else smoke_mod.render_text(smoked)))
    if smoked is not None and not smoked.ok:
        sys.exit(EXIT_PROBLEM)
    sys.exit(EXIT_OK if result.best is not None else EXIT_PROBLEM)


def _recommend_script_of(ctx, words, debug):
    """The ScriptSpec when recommend's MODEL is a command line (what a script decides itself,
    and what is not planned for one yet, refused), else None."""
    script = _planned_script(ctx, words, debug, None, None)
    if script is not None:
        for name, flag in (("run_smoke", "--smoke"), ("trainings", "--trainings"),
                           ("plot_file", "--plot")):
            if ctx.params.get(name):
                raise click.UsageError(f"{flag} is not planned for a script yet: drop it, or "
                                       "give the script's model as a model file")
    return script


def _recommend_script(ctx, script, budget, alloc, num_gpus, link, debug):
    """`recommend -- python train.py`: plan the script, print it, exit with its verdict."""
    from oomdoctor.cli.script import run_script
    from oomdoctor.models.spec import ModelFileError
    from oomdoctor.plans import recommend as rec
    from oomdoctor.plans.parallel import parse_strategy
    from oomdoctor.plans.recommend import script as rec_script
    p = ctx.params
    try:
        hw = rec.hardware(budget.gpu, num_gpus, link, False, p["nodes"], p["inter_node"],
                          p["inter_node_gbps"])
        strategies = list(dict.fromkeys(parse_strategy(s) for s in p["strategies"])) or None
        result = run_script(lambda: rec_script.recommend_script(
            script, hw, p["target_batch"], budget, strategies, alloc, _progress))
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    result = dataclasses.replace(result, candidates=result.candidates[:p["top"]])
    click.echo(json.dumps(result.to_json(), indent=2) if p["as_json"]
               else rec_script.render_text(result))
    sys.exit(EXIT_OK if result.best is not None else EXIT_PROBLEM)


def _recommend_plot(result, path, debug):
    """`recommend --plot`: the per-strategy bars; None (said on stderr) when none was traced."""
    from oomdoctor.plans.barplot import strategy_bars
    try:
        bars = strategy_bars(result)
    except ValueError as e:
        click.echo(f"no plot written: {e}", err=True)
        return None
    return _write_bar_plot(bars, path, f"oomdoctor recommend: {result.model}", debug)


def _host_ram(text, local):
    """Each node's RAM for the offload plans: --host-ram, else this machine's when the plan is
    for its own GPUs, else unknown."""
    from oomdoctor.sim.gpus import parse_size
    if text:
        try:
            return parse_size(text), "--host-ram"
        except ValueError as e:
            raise click.UsageError(f"--host-ram {text}: {e}") from None
    if local:
        from oomdoctor.plans.recommend.offload import local_host_ram
        ram = local_host_ram()
        return ram, "this machine's MemTotal" if ram else ""
    return None, ""


@cli.command("smoke", epilog=MODEL_PROTOCOL)
@click.argument("model_file", nargs=-1, required=True, metavar="MODEL | -- COMMAND...",
                callback=model_or_script)
@click.option("--strategy", type=click.Choice(NODE_STRATEGY_CHOICES), default="single",
              show_default=True, help="hsdp (hybrid sharding) with --nodes.")
@click.option("-b", "--batch-size", type=click.IntRange(1), default=1, show_default=True,
              help="Micro-batch per GPU.")
@click.option("--grad-accum", default=1, show_default=True, type=click.IntRange(1))
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option("--checkpointing", is_flag=True, help="Checkpoint the repeated blocks.")
@click.option("--steps", type=click.IntRange(1), default=3, show_default=True,
              help="Optimizer steps (a script: stopped after its N-th).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto",
              show_default=True, help="auto: the GPUs when enough are visible, else the CPU.")
@click.option("--cpu-batch", type=click.IntRange(1), default=2, show_default=True,
              help="Largest micro-batch run on the CPU.")
@click.option("--device-map", "device_map_path", type=click.Path(exists=True, dir_okay=False),
              help="pipeline2: the map `oomdoctor split --device-map` wrote (default: "
                   "computed now).")
@_NODES
@_card_options
@click.pass_context
def smoke_command(ctx, model_file, strategy, batch_size, grad_accum, precision, checkpointing,
                  steps, device, cpu_batch, device_map_path, nodes, gpu_name, memory, num_gpus,
                  overhead, other_mem, margin, alloc_conf, checkpoint_class, optimizer, as_json,
                  debug):
    """Run a few real training steps; loss per step, step time, measured vs predicted peaks.

    \b
    oomdoctor smoke sample_models/tiny_mlp.py --strategy ddp --gpus 2 -b 16 --grad-accum 2
    oomdoctor smoke model.py --strategy pipeline2 --device-map map.json --precision bf16
    oomdoctor smoke sample_models/tiny_mlp.py --strategy hsdp --nodes 2 --num-gpus 2
    oomdoctor smoke --steps 3 -- python tests/scripts/mlp_loop.py --samples 256

    Without CUDA a model file runs on the CPU (gloo processes, bf16 autocast, the split via
    accelerate) and the output says that GPU memory was not measured.

    After `--`, MODEL is your training script's command line: it runs for real, unmodified,
    in a fresh process, stopped after its --steps-th optimizer step; each step's loss (the
    scalar its backward() starts from) and time are reported. With CUDA its peaks are compared
    with `oomdoctor estimate --steps N` of the same command, which stops at the same point.
    Without CUDA its CUDA calls (.cuda(), device="cuda", autocast, GradScaler) run on the CPU
    and GPU memory is not measured. One process, as given: torchrun and other launchers,
    and the options of a model file's loop (-b, --precision, --strategy, ...), are refused.

    Exit codes: 0 passed, 1 failed (OOM, peak >10% off the prediction, loss not finite or
    not moving, no optimizer step, or the run could not start), 2 usage error, 3 model file or
    script error (the script raised).
    """
    from oomdoctor.cli.script import script_of
    from oomdoctor.models.spec import ModelFileError
    try:
        script = script_of(model_file)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    if script is not None:
        def budget():
            return _make_budget(gpu_name, memory, overhead, other_mem, margin)
        if gpu_name or memory:
            budget()            # a misspelt card is a usage error before the run
        _smoke_script(ctx, script, steps, device, budget, alloc_conf, as_json, debug)
    model_file = model_file[0]
    from oomdoctor.runs import smoke as smoke_mod
    from oomdoctor.plans.parallel import parse_strategy
    strategy = parse_strategy(strategy)
    if strategy == "hsdp" and nodes < 2:
        raise click.UsageError("hsdp (hybrid sharding) spans several nodes: add --nodes N, or "
                               "use --strategy zero3 on one node")
    if nodes > 1:
        _smoke_nodes(model_file, strategy, nodes, num_gpus or 1, batch_size, grad_accum,
                     precision, checkpointing, checkpoint_class, steps, optimizer, cpu_batch,
                     as_json, debug)
    n = 1 if strategy == "single" else _num_gpus(num_gpus)
    budget = _make_budget(gpu_name, memory, overhead, other_mem, margin)
    alloc = _alloc_config(alloc_conf)
    dmap, main = None, 0
    if device_map_path:
        with open(device_map_path, encoding="utf-8") as f:
            doc = json.load(f)
        dmap, main = doc.get("device_map"), int(doc.get("main_device", 0))
    def run():
        spec = _load_model(model_file)
        cfg = smoke_mod.SmokeConfig(strategy, n, precision, checkpointing, checkpoint_class,
                                    batch_size, grad_accum, steps, optimizer, device, cpu_batch,
                                    dmap, main, **_checkpoint_config(checkpointing))
        cfg, prediction = _smoke_prediction(spec, cfg, budget, alloc)
        return smoke_mod.run_smoke(spec, cfg, prediction, progress=_progress)
    smoke_verdict(run, smoke_mod.render_text, as_json, debug)


def _smoke_nodes(model_file, strategy, nodes, per_node, batch_size, grad_accum, precision,
                 checkpointing, checkpoint_class, steps, optimizer, cpu_batch, as_json, debug):
    """smoke --nodes N: the plan's ranks as gloo processes on this machine (exits)."""
    from oomdoctor.runs import smoke as smoke_mod
    from oomdoctor.runs import smoke_nodes
    from oomdoctor.models.spec import ModelFileError
    try:
        spec = _load_model(model_file)
        cfg = smoke_mod.SmokeConfig(strategy, nodes * per_node, precision, checkpointing,
                                    checkpoint_class, batch_size, grad_accum, steps, optimizer,
                                    "cpu", cpu_batch, nodes=nodes,
                                    **_checkpoint_config(checkpointing))
        result = smoke_nodes.run_nodes_smoke(spec, cfg, nodes, per_node, progress=_progress)
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except smoke_mod.SmokeError as e:
        _die(e, debug, EXIT_PROBLEM)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    click.echo(json.dumps(result.to_json(), indent=2) if as_json
               else smoke_nodes.render_text(result))
    sys.exit(EXIT_OK if result.ok else EXIT_PROBLEM)
