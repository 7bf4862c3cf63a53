"""Launching on several nodes: one torchrun line per node, and the same as a SLURM batch script.

torchrun's multi-node form (https://pytorch.org/docs/stable/elastic/run.html): every node runs
the same line with its own ``--node-rank``; the c10d rendezvous is hosted by the agent on the
node that ``--rdzv-endpoint`` names, so that must be reachable from every node (HOST below is
node 0's address, 29500 the usual port). With ``--rdzv-backend c10d`` the agents may be given
their group ranks in the order they join; ``--node-rank`` is what the static backend (or a
scheduler) relies on, and keeping it right costs nothing.

Under SLURM (https://slurm.schedmd.com/sbatch.html) one task per node runs torchrun; the first
host of the allocation (``scontrol show hostnames``) hosts the rendezvous, and ``$SLURM_NODEID``
must be expanded by each task, not by the batch script - hence the single quotes.
"""
from __future__ import annotations

RDZV_PORT = 29500


def torchrun_lines(nodes: int, per_node: int, args: str, host: str = "HOST",
                   port: int = RDZV_PORT) -> tuple[str, ...]:
    """The command each node runs, node 0 first."""
    return tuple(f"torchrun --nnodes={nodes} --nproc-per-node={per_node} --node-rank={rank} "
                 f"--rdzv-backend=c10d --rdzv-endpoint={host}:{port} --rdzv-id=oomdoctor "
                 f"{args}" for rank in range(nodes))


def sbatch_script(nodes: int, per_node: int, args: str, env: dict[str, str],
                  cpus_per_node: int | None = None, port: int = RDZV_PORT) -> str:
    """A batch script for ``sbatch``: one task per node, each starting ``per_node`` ranks."""
    lines = ["#!/bin/bash",
             "#SBATCH --job-name=train",
             f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1          # one torchrun per node",
             f"#SBATCH --gpus-per-node={per_node}"]
    if cpus_per_node:
        lines.append(f"#SBATCH --cpus-per-task={cpus_per_node}")
    lines += ["",
              "# the first node of the allocation hosts the rendezvous",
              'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              f"export MASTER_PORT={port}"]
    lines += [f"export {k}={v}" for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"]
    lines += ["",
              "# single quotes: each node's task expands its own $SLURM_NODEID",
              f"srun bash -c 'torchrun --nnodes=$SLURM_NNODES --nproc-per-node={per_node} "
              "--node-rank=$SLURM_NODEID --rdzv-backend=c10d "
              "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv-id=$SLURM_JOB_ID "
              f"{args}'"]
    return "\n".join(lines)
