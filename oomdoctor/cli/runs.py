"""Smoke runs of a chosen configuration against its prediction (probe/recommend --smoke, smoke)."""
from __future__ import annotations

from oomdoctor.cli.group import EXIT_PROBLEM
from oomdoctor.cli.options import _checkpoint_config, _die, _progress, _torch_config


def _smoke_best(spec, best, budget, alloc, checkpoint_class, optimizer, debug):
    """recommend --smoke: a few real steps of the recommended configuration."""
    from oomdoctor.runs import smoke as smoke_mod
    cfg = smoke_mod.SmokeConfig(best.strategy, best.num_gpus, best.precision,
                                best.checkpointing, checkpoint_class, best.micro_batch,
                                best.grad_accum, optimizer=optimizer, nodes=best.nodes,
                                **_checkpoint_config())
    if best.nodes > 1:          # the nodes' ranks as gloo processes on this machine
        from oomdoctor.runs import smoke_nodes
        try:
            return smoke_nodes.run_nodes_smoke(spec, cfg, best.nodes,
                                               best.num_gpus // best.nodes, _progress)
        except (smoke_mod.SmokeError, ValueError) as e:
            _die(e, debug, EXIT_PROBLEM)
    return _smoke_run(spec, cfg, budget, alloc, debug)


def _smoke_run(spec, cfg, budget, alloc, debug):
    """Run a smoke configuration against its prediction (probe --smoke, recommend --smoke)."""
    from oomdoctor.runs import smoke as smoke_mod
    try:
        cfg, prediction = _smoke_prediction(spec, cfg, budget, alloc)
        return smoke_mod.run_smoke(spec, cfg, prediction, progress=_progress)
    except (smoke_mod.SmokeError, ValueError) as e:
        _die(e, debug, EXIT_PROBLEM)


def _smoke_prediction(spec, cfg, budget, alloc):
    """The device map a split needs, and the prediction to compare with when CUDA is here."""
    import dataclasses

    import torch

    from oomdoctor.plans import parallel as par
    from oomdoctor.sim.trace import TraceConfig
    have_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= cfg.num_gpus
    tcfg = TraceConfig(cfg.micro_batch, cfg.precision, cfg.checkpointing, cfg.checkpoint_class,
                       cfg.grad_accum, cfg.optimizer, **_torch_config(),
                       checkpoint_every=cfg.checkpoint_every,
                       checkpoint_policy=cfg.checkpoint_policy)
    if cfg.strategy == "pipeline2" and cfg.device_map is None:
        plan = par.plan_split(spec, tcfg, budget, alloc, progress=_progress)
        cfg = dataclasses.replace(cfg, device_map=plan.partition.device_map,
                                  main_device=plan.partition.main_stage)
        return cfg, plan.estimate if have_cuda else None
    if not have_cuda:
        return cfg, None
    _progress("predicting the per-GPU peaks to compare with")
    from oomdoctor.plans.estimate import trace_for
    trace = trace_for(spec, tcfg, budget.gpu)
    sizes = None
    if cfg.strategy == "dp":      # GPU 0 holds the whole batch: its sizes from a second trace
        big = trace_for(spec, dataclasses.replace(tcfg, batch_size=cfg.micro_batch
                                                  * cfg.num_gpus), budget.gpu)
        sizes = par.Sizes.affine(trace, big)
    layout = par.model_layout(spec, cfg.precision)
    return cfg, par.estimate_strategy(trace, layout, par.Strategy(cfg.strategy, cfg.num_gpus),
                                      budget, alloc, sizes, grad_accum=cfg.grad_accum)


# smoke's options that describe the loop it builds around a model file, and what says them in a
# script (refused for `smoke -- python train.py`, with the loop options every command refuses)
_SCRIPT_SMOKE_REFUSED = {
    "batch_size": "(its DataLoader's batch_size: smoke runs the command as given)",
    "cpu_batch": "(its DataLoader's batch_size: smoke runs the command as given)",
    "device_map_path": "(its own .to(device) calls)",
    "nodes": "(smoke runs a script as one process)",
    "num_gpus": "(smoke runs a script as one process)",
}


def _smoke_script(ctx, script, steps, device, budget, alloc_conf, as_json, debug):
    """`smoke -- python train.py`: the script's real steps judged (with CUDA, against its
    estimate for as many steps); prints the result and exits with the verdict."""
    from oomdoctor.cli.options import _alloc_config, _modelled_torch
    from oomdoctor.cli.script import refuse_loop_options, run_script
    from oomdoctor.runs import smoke_script
    refuse_loop_options(ctx, extra=_SCRIPT_SMOKE_REFUSED)
    alloc = _alloc_config(alloc_conf)

    def predict():
        from oomdoctor.plans.estimate import script_trace
        from oomdoctor.plans.parallel.scripts import script_gpu_estimate
        from oomdoctor.sim.trace import TraceConfig
        # the same stop as the real run's: after optimizer step `steps` (runs.script_steps)
        cfg = TraceConfig(1, steps=steps, torch=_modelled_torch())

        def estimate():
            trace = script_trace(script, cfg, budget(), progress=_progress)
            return script_gpu_estimate(script, trace, budget(), alloc)
        return run_script(estimate)
    cfg = smoke_script.ScriptSmokeConfig(steps, device, alloc_conf=alloc_conf)
    smoke_verdict(lambda: smoke_script.run_script_smoke(script, cfg, predict, progress=_progress,
                                                        output=_progress),
                  smoke_script.render_text, as_json, debug)


def smoke_verdict(run, render, as_json: bool, debug: bool):
    """Run a smoke (``run()``: a result with ``ok`` and ``to_json``) and end the command with
    its report and verdict: exit 0 passed, 1 failed; a model or script error 3, no GPU 4, a
    usage error 2 - for a model file's smoke and a script's alike."""
    import json
    import sys

    import click

    from oomdoctor.cli.group import EXIT_MODEL, EXIT_NO_GPU, EXIT_OK, EXIT_USAGE
    from oomdoctor.models.spec import ModelFileError
    from oomdoctor.runs import smoke as smoke_mod
    try:
        result = run()
    except ModelFileError as e:
        _die(e, debug, EXIT_MODEL)
    except smoke_mod.NoDeviceError as e:
        _die(e, debug, EXIT_NO_GPU)
    except smoke_mod.SmokeError as e:
        _die(e, debug, EXIT_PROBLEM)
    except ValueError as e:
        _die(e, debug, EXIT_USAGE)
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else render(result))
    sys.exit(EXIT_OK if result.ok else EXIT_PROBLEM)
