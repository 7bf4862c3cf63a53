"""A user's training script as a model source: the command line that runs it.

    oomdoctor estimate -- python train.py --lr 3e-4
    oomdoctor probe -- python train.py --bs {batch}

The script is run as it is, in oomdoctor's process, on a fake GPU (:mod:`oomdoctor.sim.script`).
Here is only what the command line says: which file, its arguments, and the ``{batch}`` /
``{seq}`` placeholders a probe fills in. ``python -m module`` and ``torchrun``/``accelerate
launch`` in front of the script are understood; their own options are read for the process
count and otherwise left out.
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass

from oomdoctor.models.spec import ModelFileError

# Launchers whose options come before the script; the ones that take a value.
_LAUNCHERS = {"torchrun": {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank",
                           "--node-rank", "--master_addr", "--master-addr", "--master_port",
                           "--master-port", "--rdzv_backend", "--rdzv-backend",
                           "--rdzv_endpoint", "--rdzv-endpoint", "--rdzv_id", "--rdzv-id",
                           "--max_restarts", "--max-restarts", "--log_dir", "--log-dir",
                           "--redirects", "--tee", "--role", "--monitor_interval"},
              "accelerate": {"--num_processes", "--num-processes", "--config_file",
                             "--config-file", "--mixed_precision", "--mixed-precision",
                             "--num_machines", "--num-machines", "--main_process_port",
                             "--main-process-port", "--gpu_ids", "--gpu-ids"}}
_PLACEHOLDER = re.compile(r"\{(batch|seq)\}")


@dataclass(frozen=True)
class ScriptSpec:
    """A training script and the arguments it runs with."""

    path: str
    args: tuple[str, ...]
    processes: int = 1              # torchrun --nproc_per_node / accelerate --num_processes
    launcher: str = "python"

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def placeholders(self) -> frozenset[str]:
        """The axes the arguments leave to oomdoctor: "batch", "seq"."""
        return frozenset(m for a in self.args for m in _PLACEHOLDER.findall(a))

    def argv(self, batch: int | None = None, seq: int | None = None) -> list[str]:
        """``sys.argv`` for the run, the placeholders filled in."""
        fill = {"batch": batch, "seq": seq}
        missing = [k for k in sorted(self.placeholders) if fill[k] is None]
        if missing:
            flag = {"batch": "--batch-size", "seq": "--seq-len"}
            raise ModelFileError(f"{self.name}: the arguments hold {{{missing[0]}}} but no value "
                                 f"was given for it; pass {flag[missing[0]]}")
        return [self.path] + [_PLACEHOLDER.sub(lambda m: str(fill[m.group(1)]), a)
                              for a in self.args]

    def command(self) -> str:
        return shlex.join(["python", self.path, *self.args])


def is_command(words: tuple[str, ...] | list[str]) -> bool:
    """Whether MODEL's words are a command line (``python train.py ...``) rather than one model
    source (a model file, a Hub id, ``timm:NAME``)."""
    if not words:
        return False
    first = os.path.basename(words[0])
    return len(words) > 1 or re.fullmatch(r"python[0-9.]*|torchrun|accelerate", first) is not None


def parse_command(words: tuple[str, ...] | list[str]) -> ScriptSpec:
    """The script and its arguments from ``python train.py ARGS`` (or ``torchrun ... train.py
    ARGS``, ``accelerate launch ... train.py ARGS``, ``train.py ARGS``)."""
    words = list(words)
    launcher = os.path.basename(words[0]) if words else ""
    processes = 1
    if re.fullmatch(r"python[0-9.]*", launcher):
        words = words[1:]
        while words and words[0].startswith("-") and words[0] != "-m":
            words = words[1:]                   # python -u / -O: interpreter flags
        if words[:1] == ["-m"]:
            raise ModelFileError("python -m MODULE: pass the script's path instead "
                                 "(`-- python path/to/train.py ARGS`)")
    elif launcher in _LAUNCHERS:
        words, processes = _launcher_args(launcher, words[1:])
    else:
        launcher = "python"
    if not words:
        raise ModelFileError("no script in the command; pass `-- python train.py ARGS`")
    path = words[0]
    if not path.endswith(".py") or not os.path.isfile(path):
        raise ModelFileError(f"{path}: no such Python script; the command after `--` must run "
                             "a .py file (`-- python train.py ARGS`)")
    return ScriptSpec(path, tuple(words[1:]), processes, launcher)


def _launcher_args(launcher: str, words: list[str]) -> tuple[list[str], int]:
    """The script's words after the launcher's options, and the process count they ask for."""
    if launcher == "accelerate":
        if words[:1] != ["launch"]:
            raise ModelFileError("accelerate: only `accelerate launch ... train.py` runs a "
                                 "script")
        words = words[1:]
    takes_value, processes = _LAUNCHERS[launcher], 1
    while words and words[0].startswith("-"):
        flag, _, value = words[0].partition("=")
        if flag in takes_value and not value:
            value, words = (words[1] if len(words) > 1 else ""), words[1:]
        words = words[1:]
        if flag in ("--nproc_per_node", "--nproc-per-node", "--num_processes",
                    "--num-processes"):
            processes = int(value) if value.isdigit() else 1
    return words, processes
