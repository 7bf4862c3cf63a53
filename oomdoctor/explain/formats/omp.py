"""torchrun's OMP_NUM_THREADS warning: what the launcher did, when it matters, and the value to set."""
from __future__ import annotations

import re

from ..diagnosis import _QUALITY_NONE, _Ctx, _Out
from ..draft import _Draft
from ..results import Kind, Phase
from .patterns import _I, _AnchorSpec

# torch/distributed/run.py (config_from_args; launch.py before it), when OMP_NUM_THREADS is unset and
# nproc_per_node > 1: os.environ["OMP_NUM_THREADS"] = "1" and this warning, once per launcher. DataLoader
# workers call torch.set_num_threads(1) themselves (torch/utils/data/_utils/worker.py, _worker_loop).
_ANCHORS: tuple[_AnchorSpec, ...] = (
    _AnchorSpec(Kind.OMP_THREADS, ("omp_num_threads",), re.compile(
        r"SettingOMP_NUM_THREADSenvironmentvariableforeachprocesstobe1indefault", _I), absorb=400),
)


def _x_omp(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.OMP_THREADS)
    d.sig = ()
    return d


def _diag_omp(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    # (only as the log states it: the ranks a log shows are global, not per node)
    procs = ctx.facts.get("nproc_per_node")
    if procs:
        d.numbers["nproc_per_node"] = procs
    per = f"{procs} processes per node" if procs else "the processes per node (--nproc_per_node)"
    out.diag("omp_threads_set_to_1", "torchrun found OMP_NUM_THREADS unset and set it to 1 in every process it "
             "started" + (f" ({procs} on this node)" if procs else "") + ", so each process's CPU thread pool "
             "(OpenMP/MKL: torch ops on CPU tensors) uses one core. That avoids oversubscription - "
             f"{per} each taking every core - but it is a warning, not an error. It matters when the step does "
             "real work on the CPU: a data pipeline that transforms in the training process, CPU ops in the model "
             "or the loss, a CPU-offloaded optimizer (DeepSpeed/FSDP offload); a GPU-bound step whose data comes "
             "from DataLoader workers does not notice (each worker runs with one thread anyway).")
    value = f"$(( $(nproc) / {procs} ))" if procs else "<usable cores / processes per node>"
    out.fix("set_omp_num_threads", f"If the CPU side is slow, set it yourself before torchrun: OMP_NUM_THREADS={value} "
            "- the cores this job may use divided by the processes per node", None, None,
            "faster CPU ops and CPU data transforms when they are the bottleneck", _QUALITY_NONE,
            "Usable cores: nproc (it honours taskset and cgroup limits), or $SLURM_CPUS_PER_TASK under Slurm. "
            "If DataLoader workers do heavy CPU transforms, leave their cores out: (cores - processes x num_workers) "
            "/ processes.", cost=0, primary=True)
