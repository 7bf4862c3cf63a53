"""Will the GPU wait for data? A training script's input pipeline against its GPU step.

    oomdoctor estimate --gpu rtx3090 -- python train.py

A script run through oomdoctor builds its DataLoaders for real on this machine's CPU. Each step
then has two sides:
- the GPU's: the step's FLOPs (counted as the script ran, recompute included) at the
  step-time model's sustained rate, the one ``recommend`` ranks plans by
  (oomdoctor.plans.recommend.cost.compute_seconds), plus the batch's copy to the GPU;
- the data's: the training DataLoader run again alone with the script's own ``num_workers``,
  then with more, measured on this CPU (oomdoctor.runs.loader_speed).

Workers prefetch while the GPU computes, so a step takes the longer of the two. With
``num_workers=0`` the main process loads the next batch while the GPU runs the queued kernels -
unless the loop reads a GPU value every step (``loss.item()``), which makes it wait for the GPU
first: then loading and computing add up. The GPU waits for the difference.

The verdict holds for this machine's CPU: a laptop planning a server's run measures the laptop's
cores (``--cpus N`` describes the training host's core count; each core's speed is still this
machine's). Under torchrun every rank runs its own loader on the same host, so each gets the
host's cores divided by the processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from oomdoctor.plans.recommend.cost import COMPUTE_EFFICIENCY, compute_seconds
from oomdoctor.runs.loader_speed import (LoaderTiming, sweep, time_loader, usable_cores,
                                         worker_counts)
from oomdoctor.sim.gpus import GpuProfile
from oomdoctor.sim.recorder import Category
from oomdoctor.sim.trace import Trace

# Host-to-device copy rates over PCIe 4.0 x16: about 25 GB/s from pinned (page-locked) memory;
# pageable memory goes through a pinned staging buffer of the driver at about half that
# (NVIDIA, "How to Optimize Data Transfers in CUDA C/C++"; CUDA samples' bandwidthTest).
H2D_PINNED = 25e9
H2D_PAGEABLE = 12e9
WAITS = 0.05            # the share of a step above which the GPU is said to wait for data
LAUNCH_BOUND = 0.01     # steps shorter than this (s) are likely set by kernel launches


@dataclass(frozen=True)
class Host:
    """The CPU the training runs on, as oomdoctor knows it."""

    cores: int                  # the training host's usable cores (--cpus, else this one's)
    measured_cores: int         # this machine's, where the loader was timed
    given: bool                 # --cpus described the training host
    processes: int = 1          # training processes per node (torchrun --nproc_per_node)

    @property
    def cores_per_rank(self) -> int:
        return max(1, self.cores // self.processes)


@dataclass(frozen=True)
class InputCheck:
    """One script's data side against its GPU side, with the measurements behind it."""

    gpu: str
    precision: str
    batch_size: int
    flops: float                # per micro-batch
    gpu_seconds: float          # modelled GPU compute per micro-batch
    input_bytes: int            # the batch copied to the GPU, per micro-batch
    syncs: bool                 # the loop reads a GPU value each step
    script_workers: int
    script_pin_memory: bool
    timings: tuple[LoaderTiming, ...]
    host: Host
    # The best setting again with pin_memory=True, where pinning applies: a CUDA device on this
    # machine (page-locked memory is a CUDA allocation); None elsewhere
    pinned: LoaderTiming | None = None

    def copy_seconds(self, pinned: bool) -> float:
        return self.input_bytes / (H2D_PINNED if pinned else H2D_PAGEABLE)

    def busy_seconds(self, t: LoaderTiming) -> float:
        """The GPU's side of a micro-batch with this loader setting: compute and the copy."""
        return self.gpu_seconds + self.copy_seconds(t.pin_memory or self.script_pin_memory)

    def step_seconds(self, t: LoaderTiming) -> float:
        """A micro-batch's time with this loader setting: loading overlaps the GPU's work
        unless the main process loads and the loop waits for the GPU every step."""
        gpu = self.busy_seconds(t)
        if t.num_workers == 0 and self.syncs:
            return t.seconds_per_batch + gpu
        return max(t.seconds_per_batch, gpu)

    def waiting(self, t: LoaderTiming) -> float:
        """The share of each step the GPU spends waiting for data."""
        step = self.step_seconds(t)
        return max(0.0, step - self.busy_seconds(t)) / step if step > 0 else 0.0

    @property
    def as_run(self) -> LoaderTiming | None:
        """The measurement at the script's own settings."""
        return next((t for t in self.timings if t.num_workers == self.script_workers), None)

    @property
    def data_bound(self) -> bool:
        return self.as_run is not None and self.waiting(self.as_run) > WAITS

    @property
    def fix(self) -> LoaderTiming | None:
        """The fewest workers measured that remove the wait, when the script's setting waits."""
        if not self.data_bound:
            return None
        return next((t for t in self.timings if t.num_workers > self.script_workers
                     and self.waiting(t) <= WAITS), None)

    def omp_threads(self, workers: int) -> int:
        """OMP_NUM_THREADS that leaves each rank's workers their cores."""
        return max(1, self.host.cores_per_rank - workers)

    def to_json(self) -> dict[str, Any]:
        fix = self.fix
        return {"gpu": self.gpu, "precision": self.precision, "batch_size": self.batch_size,
                "flops_per_micro_batch": self.flops, "gpu_seconds": self.gpu_seconds,
                "copy_seconds": self.copy_seconds(self.script_pin_memory),
                "syncs_every_step": self.syncs,
                "script_num_workers": self.script_workers,
                "script_pin_memory": self.script_pin_memory,
                "measured": [dict(vars(t), waiting_share=self.waiting(t),
                                  step_seconds=self.step_seconds(t)) for t in self.timings],
                "pinned": vars(self.pinned) if self.pinned else None,
                "data_bound": self.data_bound,
                "fix_num_workers": fix.num_workers if fix else None,
                "cores": self.host.cores, "measured_cores": self.host.measured_cores,
                "cores_given": self.host.given, "processes": self.host.processes,
                "cores_per_rank": self.host.cores_per_rank}


def check_input(trace: Trace, gpu: GpuProfile, *, processes: int = 1, cpus: int | None = None,
                progress: Callable[[str], None] = lambda _: None) -> InputCheck | None:
    """The script's training DataLoader timed against its modelled GPU step (``processes``:
    training processes per node); None when the script made no DataLoader (it batches by
    hand) or its loader gives too few batches to time."""
    if not trace.loaders:
        return None
    seen = trace.loaders[0]                  # the training loader, as the report's batch size
    cfg = trace.config
    flops = trace.flops / max(cfg.grad_accum, 1)
    measured = usable_cores()
    host = Host(cpus or measured, measured, cpus is not None, processes)
    check = InputCheck(gpu.name, cfg.precision, cfg.batch_size, flops,
                       compute_seconds(flops, gpu, cfg.precision), _input_bytes(trace),
                       trace.syncs_per_step >= 1, seen.num_workers, seen.pin_memory, (), host)
    counts = [seen.num_workers] + [w for w in worker_counts(host.cores_per_rank)
                                   if w > seen.num_workers]
    timings = sweep(seen.loader, counts, lambda t: check.waiting(t) <= WAITS,
                    seen.pin_memory, progress)
    if not timings:
        return None
    done = InputCheck(**{**vars(check), "timings": tuple(timings)})
    return InputCheck(**{**vars(done), "pinned": _pinned(done, seen.loader, progress)})


def _pinned(check: InputCheck, loader: Any, progress: Callable[[str], None]
            ) -> LoaderTiming | None:
    """The setting to recommend, timed with pin_memory=True where this machine can pin."""
    import torch
    if check.script_pin_memory or not torch.cuda.is_available():
        return None
    best = check.fix or check.as_run
    progress(f"timing the DataLoader with num_workers={best.num_workers}, pin_memory=True")
    return time_loader(loader, best.num_workers, pin_memory=True)


def _input_bytes(trace: Trace) -> int:
    """Bytes the script copied to the GPU as its batches in its first step, per micro-batch."""
    first = [s.nbytes for s in trace.storages.values()
             if s.category is Category.INPUTS and s.iteration == 0]
    return sum(first) // max(trace.config.grad_accum, 1)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def render_text(c: InputCheck) -> str:
    """The verdict and its numbers, for the terminal."""
    host = c.host
    where = (f"this machine's CPU, {host.measured_cores} cores" if not host.given else
             f"this machine's CPU ({host.measured_cores} cores) for a training host of "
             f"{host.cores}: each core's speed is this machine's")
    lines = [f"input pipeline (DataLoader measured on {where}; GPU step modelled on {c.gpu}):",
             f"  GPU step {_ms(c.gpu_seconds)} per micro-batch of {c.batch_size} "
             f"({c.flops / 1e9:,.1f} GFLOP at {COMPUTE_EFFICIENCY:.0%} of the {c.precision} "
             f"peak, recommend's step-time model), batch copy to the GPU "
             f"{_ms(c.copy_seconds(c.script_pin_memory))}"
             + (" (pinned)" if c.script_pin_memory else " (pageable)")]
    for t in c.timings:
        own = " (the script's)" if t.num_workers == c.script_workers else ""
        share = c.waiting(t)
        lines.append(f"  num_workers={t.num_workers}{own}: {_ms(t.seconds_per_batch)} per batch"
                     f" -> " + (f"the GPU waits {share:.0%} of each step" if share > WAITS
                                else "the GPU does not wait"))
    if c.pinned is not None:
        lines.append(f"  num_workers={c.pinned.num_workers}, pin_memory=True: "
                     f"{_ms(c.pinned.seconds_per_batch)} per batch (measured), batch copy "
                     f"{_ms(c.copy_seconds(True))}")
    lines.append("  " + _verdict(c))
    if c.gpu_seconds < LAUNCH_BOUND and not c.data_bound:
        lines.append(f"  (a step under {_ms(LAUNCH_BOUND)} is likely paced by kernel launches "
                     "on the CPU rather than FLOPs: `oomdoctor watch` measures the real run)")
    if host.processes > 1:
        w = c.fix.num_workers if c.fix else c.script_workers
        lines.append(f"  {host.processes} processes on one host: {host.cores_per_rank} core(s) "
                     f"per rank ({host.cores} / {host.processes}); per rank num_workers <= "
                     f"{host.cores_per_rank} and OMP_NUM_THREADS={c.omp_threads(w)} (torchrun "
                     "sets 1 when unset)")
    return "\n".join(lines)


def _verdict(c: InputCheck) -> str:
    if not c.data_bound:
        return (f"GPU-BOUND: the data keeps up at num_workers={c.script_workers}; more "
                "workers would not speed the step")
    own = c.as_run
    head = (f"DATA-BOUND: at num_workers={c.script_workers} the GPU waits "
            f"{c.waiting(own):.0%} of each step")
    pin = ("" if c.script_pin_memory else
           ", pin_memory=True) and .to(device, non_blocking=True) for the batch")
    if c.fix is not None:
        return (f"{head}; num_workers={c.fix.num_workers} removes the wait (measured: "
                f"{_ms(c.fix.seconds_per_batch)} per batch): DataLoader(..., "
                f"num_workers={c.fix.num_workers}{pin or ')'}")
    best = min(c.timings, key=lambda t: t.seconds_per_batch)
    return (f"{head}; the best setting measured within the cores a rank gets "
            f"(num_workers={best.num_workers}, {_ms(best.seconds_per_batch)} per batch) still "
            "leaves it waiting "
            f"{c.waiting(best):.0%}: make __getitem__/collate cheaper (decode or tokenize "
            "once, ahead of training), or train on a host with more cores")
