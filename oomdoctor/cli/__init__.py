"""The `oomdoctor` command line: the click group, its entry point, a module per command group."""
from __future__ import annotations

import os
import sys

# Importing a command module registers its commands on `cli`, in this order (the old single-file
# cli.py's). estimate/probe/check import torch (seconds, hundreds of MiB): it is imported inside
# the commands that need it, so `oomdoctor explain` and `--help` stay fast.
from oomdoctor.cli.group import (EXIT_INTERNAL, EXIT_MODEL, EXIT_NO_GPU, EXIT_OK, EXIT_PROBLEM,
                                 EXIT_USAGE, cli)
from oomdoctor.cli import estimate as _estimate, probe, check, parallel, gpus, explain  # noqa: F401,I001
# The command objects stay importable by name, except `probe` and `check`: those names are
# now the modules (the commands are cli.commands["probe"] and cli.commands["check"]).
from oomdoctor.cli.estimate import estimate
from oomdoctor.cli.parallel import (LINK_CHOICES, parallel_command, recommend_command,
                                    smoke_command, split_command)
from oomdoctor.cli.gpus import gpus_command, watch_command
from oomdoctor.cli.explain import explain_command
from oomdoctor.configs import STRATEGY_CHOICES

__all__ = ["cli", "main", "EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "EXIT_MODEL", "EXIT_NO_GPU",
           "EXIT_INTERNAL",
           "LINK_CHOICES", "STRATEGY_CHOICES", "estimate", "parallel_command", "split_command",
           "recommend_command", "smoke_command", "gpus_command", "watch_command",
           "explain_command"]


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
