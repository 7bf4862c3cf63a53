"""The `oomdoctor` click group and the exit codes its commands share."""
from __future__ import annotations

import click

from oomdoctor import __version__

# Exit codes, documented in the README ("Exit codes").
EXIT_OK = 0
EXIT_PROBLEM = 1     # explain: no known error found; check: regression; estimate: does not fit
EXIT_USAGE = 2       # click's own usage errors
EXIT_MODEL = 3       # the model file could not be loaded or traced
EXIT_NO_GPU = 4      # gpus: no NVIDIA driver or no GPU (oomdoctor.runs.nvml.EXIT_NO_DRIVER);
                     # probe --device cuda[:i]: no such CUDA device
EXIT_INTERNAL = 5    # oomdoctor could not follow this step (an unsupported construct, a bug)


class GuardedCommand(click.Command):
    """A command whose unexpected failure is never read as a verdict.

    Exit code 1 means "does not fit" (estimate, probe), "regression" (check) or "no known
    error" (explain): a crash that fell through to Python's default exit code 1 would say one
    of those. Any exception a command did not turn into its own exit code leaves with
    EXIT_INTERNAL and one line naming what failed and where; --debug shows the traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.Abort,
                SystemExit, KeyboardInterrupt):
            raise
        except Exception as e:                  # noqa: BLE001 - the point of this class
            import sys
            import traceback
            if ctx.params.get("debug"):
                traceback.print_exception(e)
            frames = traceback.extract_tb(e.__traceback__)
            where = ""
            if frames:                          # the innermost frame, without the site path
                f = frames[-1]
                where = f" (in {f.name}, {f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno})"
            text = str(e).strip().splitlines()
            click.echo(f"error: oomdoctor could not simulate this: {type(e).__name__}: "
                       f"{text[0] if text else '(no message)'}{where}. This is a limit of "
                       "oomdoctor, not a verdict on memory: simplify or remove that construct "
                       "from the model file, or report it"
                       + ("" if ctx.params.get("debug") else " (--debug for the traceback)"),
                       err=True)
            sys.exit(EXIT_INTERNAL)


class GuardedGroup(click.Group):
    command_class = GuardedCommand

    def invoke(self, ctx: click.Context):
        _quiet_library_imports()
        return super().invoke(ctx)


# Loggers of libraries oomdoctor imports, whose import-time warnings are about kernels and APIs
# the simulation never uses (torchao: CUDA-only .so files that do not load next to a CPU torch;
# bitsandbytes: an optional CPU 4-bit kernel package; torch's pytree: a deprecation addressed
# to torchao). They drowned the progress lines on stderr. Errors still show, and a level the
# user set on those loggers is kept.
_CHATTY = ("torchao", "bitsandbytes", "torch.utils._pytree")


def _quiet_library_imports() -> None:
    import logging
    for name in _CHATTY:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:            # not set by the user: ours to choose
            logger.setLevel(logging.ERROR)


@click.group(cls=GuardedGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="oomdoctor")
def cli() -> None:
    """Predict, explain and gate PyTorch GPU memory - with or without a GPU."""
