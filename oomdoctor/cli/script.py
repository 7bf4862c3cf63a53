"""A training script as MODEL: ``oomdoctor estimate|probe|smoke -- python train.py ARGS``.

What the commands share when MODEL is a command line: telling it from a model source, refusing
the options that describe a model file's loop (a script's loop says them itself), and running
the script with its own output kept off oomdoctor's stdout (where --json goes).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import click
from click.core import ParameterSource

# Options that describe the loop oomdoctor builds around a model file; a script has its own.
_LOOP_OPTIONS = {
    "precision": "(its autocast, its .to(dtype))", "precisions": "(its autocast, its .to(dtype))", "checkpointing": "(its checkpoint calls)",
    "checkpoint_class": "(its checkpoint calls)", "checkpoint_every": "(its checkpoint calls)",
    "checkpoint_policy": "(its checkpoint calls)", "grad_accum": "(its accumulation loop)",
    "optimizer": "(its optimizer)", "zero_grad": "(its zero_grad calls)",
    "no_cuda_emulation": "(a script always runs on the fake CUDA device)",
    "strategy": "(multi-GPU scripts are not simulated yet: oomdoctor runs one process)",
    "cpu_offload": "(its fully_shard offload_policy, or its DeepSpeed config's offload)",
}
# Model-source options of _model_source_options (remembered in ctx.meta, not parameters).
_SOURCE_OPTIONS = ("task", "image_size", "num_classes", "lora_rank", "quantize",
                   "keep_outputs", "lora_targets", "double_quant", "attn")


def script_of(words: tuple[str, ...]):
    """The :class:`ScriptSpec` when MODEL's words are a command line, else None."""
    from oomdoctor.models.script import is_command, parse_command
    return parse_command(words) if is_command(words) else None


def one_source(words: tuple[str, ...]) -> str:
    """MODEL as one model source, or a usage error that says how to pass a script."""
    if len(words) != 1:
        raise click.UsageError("MODEL is one model file, Hugging Face id or timm:/torchvision: "
                               "name; to run a training script, put it after `--`: "
                               "`oomdoctor estimate -- python train.py ARGS`")
    return words[0]


def model_or_script(_ctx: click.Context, _param: click.Parameter, words: tuple[str, ...]
                    ) -> tuple[str, ...]:
    """The MODEL argument of a planner that also takes a script: the words as given (a command
    line after ``--``, or one model source)."""
    from oomdoctor.models.script import is_command
    if not is_command(words):
        one_source(words)
    return words


def refuse_loop_options(ctx: click.Context, allowed: tuple[str, ...] = (),
                        extra: dict[str, str] | None = None) -> None:
    """A usage error for an option given on the command line that a script decides itself
    (``allowed``: options the command means otherwise for a script, as parallel's
    --strategy picks the strategies to plan; ``extra``: the command's own such options, by
    parameter name, with what decides them in a script)."""
    for name, own in {**_LOOP_OPTIONS, **(extra or {})}.items():
        if name in allowed:
            continue
        # (--checkpoint-every/-policy are remembered in ctx.meta, not parameters)
        given = name in ctx.params or name in ctx.meta.get("oomdoctor.checkpoint", {})
        if given and ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE:
            flag = "--" + name.replace("_", "-").removesuffix("s" if name == "precisions" else "")
            flag = next((max(p.opts, key=len) for p in ctx.command.params
                         if p.name == name and extra and name in extra), flag)
            raise click.UsageError(f"{flag} describes a model file's training loop; a script "
                                   f"decides it in its own code {own}. Change the script's "
                                   "arguments instead")
    remembered = ctx.meta.get("oomdoctor.source", {})
    for name in _SOURCE_OPTIONS:
        if remembered.get(name):
            raise click.UsageError(f"--{name.replace('_', '-').replace('-rank', '')} describes "
                                   "a model source; a script builds its own model (its peft "
                                   "config, its quantization)")


def seq_len_option(ctx: click.Context) -> int | None:
    """--seq-len for a script: the value of its ``{seq}`` placeholder."""
    seq = ctx.meta.get("oomdoctor.source", {}).get("seq_len")
    if seq == "max":
        raise click.UsageError("--seq-len max is not available for a script yet; give a token "
                               "count for its {seq} placeholder")
    return seq


@contextlib.contextmanager
def script_output() -> Iterator[None]:
    """The script's prints go to stderr while it runs: oomdoctor's stdout is its report."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def run_script(fn: Callable[[], Any]) -> Any:
    """``fn()`` with the script's output on stderr."""
    with script_output():
        return fn()


def input_options(f: Callable) -> Callable:
    """--cpus and --no-input-check: a script's DataLoader timed against its GPU step."""
    f = click.option("--no-input-check", "skip_input", is_flag=True,
                     help="A script: do not time its DataLoader against the GPU step.")(f)
    return click.option("--cpus", type=click.IntRange(1), metavar="N",
                        help="A script: cores of the host the training runs on (default: this "
                             "machine's); the DataLoader is still timed on this CPU.")(f)


def check_input(trace, budget, script, cpus: int | None, skip: bool, progress):
    """The script's input-pipeline check (None when skipped or it has no DataLoader), run with
    the script's prints on stderr."""
    if skip:
        return None
    from oomdoctor.runs.input_pipeline import check_input as check
    return run_script(lambda: check(trace, budget.gpu, processes=script.processes, cpus=cpus,
                                    progress=progress))


def refuse_input_options(cpus: int | None, skip: bool) -> None:
    """A usage error for the script-only input options given with a model source."""
    if cpus is not None or skip:
        raise click.UsageError("--cpus and --no-input-check describe a training script's "
                               "DataLoader: pass the script after `--`")


def sharded_report(script, trace, budget, alloc, views, deepspeed_release: str = ""):
    """The per-GPU report of a script that spreads its model over GPUs itself (FSDP, DeepSpeed
    at ``deepspeed_release``, DataParallel, a split; None: it does not)."""
    from oomdoctor.plans.estimate import how_it_spreads, spreads_itself
    if not spreads_itself(trace):
        return None
    if views:
        raise click.UsageError(f"--snapshot and --plot show one GPU's step; the script "
                               f"{how_it_spreads(trace)}, which is estimated per GPU: run "
                               "without them")
    from oomdoctor.plans import parallel as par
    return par.estimate_spread_script(script, trace, budget, alloc,
                                      progress=lambda m: click.echo(m, err=True),
                                      seq_len=seq_len_option(click.get_current_context()),
                                      deepspeed_release=deepspeed_release or "")
