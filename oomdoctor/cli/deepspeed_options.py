"""The DeepSpeed options: --ds-config FILE (a run as its config describes it) and --deepspeed
VERSION (the release it runs), read into a DeepSpeedConfig."""
from __future__ import annotations

import dataclasses
import json

import click


def _ds_config_option(f):
    """--ds-config FILE: a DeepSpeed run as its config describes it; --deepspeed VERSION: the
    release it runs."""
    f = click.option(
        "--deepspeed", "ds_release", metavar="VERSION",
        help="The DeepSpeed release the run uses, e.g. 0.9.2 (default: the installed one, else "
             "the newest modelled): ZeRO-1/2 make their reduce buckets as the backward starts "
             "before 0.18.3, at the first gradient since.")(f)
    return click.option(
        "--ds-config", "ds_config", type=click.Path(exists=True, dir_okay=False),
        help="A DeepSpeed JSON config: its ZeRO stage (--strategy dsN), fp16/bf16 mode "
             "(--precision) and bucket sizes.")(f)


def _deepspeed_release(ctx) -> str:
    """--deepspeed, checked ('' when not given)."""
    from oomdoctor.plans.parallel.strategy import deepspeed_release
    text = ctx.params.get("ds_release") or ""
    if text:
        try:
            deepspeed_release(text)
        except ValueError as e:
            raise click.UsageError(f"--deepspeed: {e}") from None
    return text


def _deepspeed_defaults(ctx):
    """The DeepSpeedConfig of --strategy dsN without --ds-config: DeepSpeed's defaults at the
    --deepspeed release (None: no release named, the strategy's own defaults)."""
    from oomdoctor.plans.parallel import DeepSpeedConfig
    release = _deepspeed_release(ctx)
    return DeepSpeedConfig(release=release) if release else None


def _deepspeed_run(ctx, path, precision, strategies):
    """--ds-config: (precision, strategies, DeepSpeedConfig) as the config sets them; an
    explicit --precision or --strategy that contradicts it is a usage error."""
    from oomdoctor.plans.parallel import read_deepspeed_config
    release = _deepspeed_release(ctx)
    try:
        with open(path, encoding="utf-8") as f:
            run = read_deepspeed_config(json.load(f), path)
    except (OSError, json.JSONDecodeError, ValueError) as e:
        raise click.UsageError(f"--ds-config: {e}") from None
    if release:
        run = dataclasses.replace(run, config=dataclasses.replace(run.config, release=release))
    wanted = run.precision or "fp32"
    given = ctx.get_parameter_source("precision") is not click.core.ParameterSource.DEFAULT
    if given and precision != wanted:
        raise click.UsageError(f"--precision {precision} contradicts {path}, which runs "
                               f"{wanted}; drop one")
    others = [s for s in strategies if s != run.strategy]
    if others:
        raise click.UsageError(f"{path} is DeepSpeed ZeRO stage {run.stage} ({run.strategy}); "
                               f"--strategy {', '.join(others)} contradicts it")
    return wanted, (run.strategy,), run.config
