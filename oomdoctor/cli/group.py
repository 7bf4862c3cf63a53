"""The `oomdoctor` click group and the exit codes its commands share."""
from __future__ import annotations

import click

from oomdoctor import __version__

# Exit codes, documented in the README ("Exit codes").
EXIT_OK = 0
EXIT_PROBLEM = 1     # explain: no known error found; check: regression; estimate: does not fit
EXIT_USAGE = 2       # click's own usage errors
EXIT_MODEL = 3       # the model file could not be loaded or traced
EXIT_NO_GPU = 4      # gpus: no NVIDIA driver or no GPU (oomdoctor.nvml.EXIT_NO_DRIVER)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="oomdoctor")
def cli() -> None:
    """Predict, explain and gate PyTorch GPU memory - with or without a GPU."""
