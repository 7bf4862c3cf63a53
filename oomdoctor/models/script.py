"""A user's training script as a model source: the command line that runs it.

    oomdoctor estimate -- python train.py --lr 3e-4
    oomdoctor probe -- python train.py --bs {batch}

The script is run as it is, in oomdoctor's process, on a fake GPU (:mod:`oomdoctor.sim.script`).
Here is only what the command line says: which file, its arguments, and the ``{batch}`` /
``{seq}`` placeholders a probe fills in. ``python -m module`` and ``torchrun``/``accelerate
launch`` in front of the script are understood; their own options are read for the process
count and otherwise left out, except what the launcher hands the script: torchrun's, accelerate's
and DeepSpeed's environment variables for rank 0 (:meth:`ScriptSpec.environment`), and
DeepSpeed's ``--local_rank`` argument. A script run with plain ``python`` gets none of them, as
it would outside oomdoctor.
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
                             "--main-process-port", "--gpu_ids", "--gpu-ids"},
              # deepspeed/launcher/runner.py's options
              "deepspeed": {"--num_gpus", "--num-gpus", "--num_nodes", "--num-nodes",
                            "--include", "-i", "--exclude", "-e", "--hostfile", "-H",
                            "--master_port", "--master_addr", "--launcher", "--launcher_args",
                            "--node_rank", "--min_elastic_nodes", "--max_elastic_nodes",
                            "--ssh_port", "--venv_script"}}
# The options that say how many processes run per node, and how many nodes.
_PER_NODE = ("--nproc_per_node", "--nproc-per-node", "--num_processes", "--num-processes",
             "--num_gpus", "--num-gpus")
_NODES = ("--nnodes", "--num_machines", "--num-machines", "--num_nodes", "--num-nodes")
_PLACEHOLDER = re.compile(r"\{(batch|seq)\}")


@dataclass(frozen=True)
class ScriptSpec:
    """A training script and the arguments it runs with."""

    path: str
    args: tuple[str, ...]
    processes: int = 1              # per node: torchrun --nproc_per_node, accelerate
    launcher: str = "python"        # --num_processes, deepspeed --num_gpus
    # the launcher's own options as given ((flag without dashes, value); "" for a switch)
    options: tuple[tuple[str, str], ...] = ()
    nodes: int = 1

    def option(self, name: str) -> str | None:
        """A launcher option's value (``mixed_precision`` matches --mixed_precision and
        --mixed-precision), None when not given."""
        want = name.replace("-", "_")
        return next((v for k, v in self.options if k.replace("-", "_") == want), None)

    def environment(self) -> dict[str, str]:
        """The variables the launcher gives the script's rank 0, as it would set them on a
        one-node run: torchrun's elastic agent (and accelerate's multi-process launch, which
        runs through it), DeepSpeed's launcher, accelerate's own. Plain ``python`` sets none:
        a script that chooses DDP when LOCAL_RANK is set must take its single-GPU way."""
        env: dict[str, str] = {}
        multi = self.processes > 1 or self.nodes > 1 or self.option("multi_gpu") is not None
        if self.launcher == "torchrun" or (self.launcher == "accelerate" and multi):
            env.update(_torchrun_env(self.processes, self.nodes,
                                     self.option("master_port") or self.option(
                                         "main_process_port") or "29500"))
        elif self.launcher == "deepspeed":
            # deepspeed/launcher/launch.py, per local process
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(self.processes * self.nodes),
                       LOCAL_SIZE=str(self.processes), CROSS_RANK="0",
                       CROSS_SIZE=str(self.nodes), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=self.option("master_port") or "29500")
        if self.launcher == "accelerate" and self.option("mixed_precision"):
            env["ACCELERATE_MIXED_PRECISION"] = self.option("mixed_precision").lower()
        return env

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def source(self) -> str:
        """The script's text ("" when it cannot be read: running it will say why)."""
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    @property
    def world(self) -> int:
        """Processes in all: one per GPU of every node."""
        return self.processes * self.nodes

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
        # DeepSpeed's launcher passes the local rank as an argument too
        rank = (["--local_rank=0"] if self.launcher == "deepspeed"
                and self.option("no_local_rank") is None else [])
        return [self.path] + rank + [_PLACEHOLDER.sub(lambda m: str(fill[m.group(1)]), a)
                                     for a in self.args]

    def command(self) -> str:
        return shlex.join(["python", self.path, *self.args])


def is_command(words: tuple[str, ...] | list[str]) -> bool:
    """Whether MODEL's words are a command line (``python train.py ...``) rather than one model
    source (a model file, a Hub id, ``timm:NAME``)."""
    if not words:
        return False
    first = os.path.basename(words[0])
    return len(words) > 1 or re.fullmatch(r"python[0-9.]*|torchrun|accelerate|deepspeed",
                                          first) is not None


def parse_command(words: tuple[str, ...] | list[str]) -> ScriptSpec:
    """The script and its arguments from ``python train.py ARGS`` (or ``torchrun ... train.py
    ARGS``, ``accelerate launch ... train.py ARGS``, ``deepspeed ... train.py ARGS``,
    ``train.py ARGS``)."""
    launcher, options, words = _split(list(words))
    if not words:
        raise ModelFileError("no script in the command; pass `-- python train.py ARGS`")
    path = words[0]
    if not path.endswith(".py") or not os.path.isfile(path):
        raise ModelFileError(f"{path}: no such Python script; the command after `--` must run "
                             "a .py file (`-- python train.py ARGS`)")
    counts = dict(options)
    per_node = next((counts[f] for f in _PER_NODE if f in counts), "1")
    nodes = next((counts[f] for f in _NODES if f in counts), "1")
    per_node, nodes = _count(per_node), _count(nodes)
    if launcher == "accelerate":            # its --num_processes counts every machine's
        per_node = max(1, per_node // nodes)
    return ScriptSpec(path, tuple(words[1:]), per_node, launcher,
                      tuple((f.lstrip("-"), v) for f, v in options), nodes)


def script_word(words: list[str]) -> str | None:
    """The script's path as a command line names it (None: none, or not a command)."""
    try:
        rest = _split(list(words))[2]
    except ModelFileError:
        return None
    return rest[0] if rest and rest[0].endswith(".py") else None


def _split(words: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(launcher, its options, the script's path and arguments) of a command line."""
    launcher = os.path.basename(words[0]) if words else ""
    options: list[tuple[str, str]] = []
    if re.fullmatch(r"python[0-9.]*", launcher):
        words = words[1:]
        while words and words[0].startswith("-") and words[0] != "-m":
            words = words[1:]                   # python -u / -O: interpreter flags
        if words[:1] == ["-m"]:
            raise ModelFileError("python -m MODULE: pass the script's path instead "
                                 "(`-- python path/to/train.py ARGS`)")
    elif launcher in _LAUNCHERS:
        words, options = _launcher_args(launcher, words[1:])
    else:
        launcher = "python"
    return launcher, options, words


def _count(value: str) -> int:
    """A process or node count as given (torchrun's "gpu"/"auto" and ranges: 1)."""
    return int(value) if value.isdigit() and int(value) > 0 else 1


def _launcher_args(launcher: str, words: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """The script's words after the launcher's options, and those options as (flag, value)."""
    if launcher == "accelerate":
        if words[:1] != ["launch"]:
            raise ModelFileError("accelerate: only `accelerate launch ... train.py` runs a "
                                 "script")
        words = words[1:]
    takes_value, options = _LAUNCHERS[launcher], []
    while words and words[0].startswith("-"):
        flag, _, value = words[0].partition("=")
        if flag in takes_value and not value:
            value, words = (words[1] if len(words) > 1 else ""), words[1:]
        words = words[1:]
        options.append((flag, value))
    return words, options


def _torchrun_env(per_node: int, nodes: int, port: str) -> dict[str, str]:
    """Rank 0's variables from torchrun's elastic agent
    (torch/distributed/elastic/agent/server/local_elastic_agent.py, ``_start_workers``), and
    the OMP_NUM_THREADS=1 torchrun sets for several processes per node when it is unset
    (torch/distributed/run.py)."""
    world = per_node * nodes
    env = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0",
           "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(per_node),
           "WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": str(nodes),
           "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
           "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
           "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
               "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    if per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    return env
