"""`oomdoctor watch`: run a training command, sample NVML meanwhile, summarise GPU use after.

    oomdoctor watch -- torchrun --nproc-per-node 2 train.py
    oomdoctor watch --interval 1 --json report.json --plot gpus.png -- python train.py

The child keeps the terminal: its stdout/stderr are inherited, its exit code is ours. The
summary is a pure function of the samples (`summarize`), tested without a GPU.
"""
from __future__ import annotations

import dataclasses
import math
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from oomdoctor.sim.gpus import GiB, MiB

BUSY_UTIL = 10          # util% at which a GPU counts as busy (the "both GPUs at once" tracker)
IDLE_MEAN_UTIL = 40     # mean util% below which the run looks input-bound
NEAR_LIMIT = 0.90       # peak memory share that leaves no room for a longer batch
# NVML's utilisation is the share of each sample period in which a kernel ran; a GPU-bound
# training loop keeps it near 100%. Idle above this share of the training window (first to last
# busy sample) means the GPU waited - for data, or for the CPU launching its kernels.
WAITED = 0.10


@dataclass(frozen=True)
class Reading:
    gpu: int
    used_bytes: int
    total_bytes: int
    util_percent: int | None


@dataclass(frozen=True)
class Tick:
    t: float                        # seconds since the command started
    readings: tuple[Reading, ...]


@dataclass(frozen=True)
class GpuSummary:
    gpu: int
    peak_used_bytes: int
    total_bytes: int
    util_mean: float | None
    util_p50: float | None
    util_p95: float | None
    busy_s: float

    def memory_line(self) -> str:
        return (f"GPU {self.gpu}: {self.peak_used_bytes // MiB}/{self.total_bytes // MiB} MiB "
                f"({100 * self.peak_used_bytes / self.total_bytes:.1f}%) peak")


@dataclass(frozen=True)
class WatchSummary:
    command: tuple[str, ...]
    exit_code: int
    duration_s: float
    sampling: bool                  # False: NVML was unavailable, only the time is known
    sampling_error: str | None
    samples: int
    interval_s: float
    gpus: tuple[GpuSummary, ...]
    overlap_s: float                # time two or more GPUs were busy at once
    overlap_share: float            # overlap_s / duration_s
    warnings: tuple[str, ...] = field(default=())
    # The working GPUs' idle share between their first and last busy sample (100 - util):
    # the measured counterpart of the input-pipeline check's wait per step. None: unknown.
    idle_share: float | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile: an actual sample, so p50 of [0, 100] is 0, not 50."""
    s = sorted(values)
    return float(s[max(0, math.ceil(p / 100 * len(s)) - 1)])


def summarize(ticks: Sequence[Tick], duration_s: float, command: Sequence[str] = (),
              exit_code: int = 0, interval_s: float = 0.5, sampling_error: str | None = None,
              cores: int = 1) -> WatchSummary:
    """Per-GPU peaks and utilisation, and how long >= 2 GPUs were busy together.

    Each tick stands for the time until the next one (the last until the end of the run), so
    overlap is a share of wall time, not of sample count."""
    sampling = sampling_error is None
    ticks = sorted(ticks, key=lambda k: k.t)
    weights = [max(0.0, (ticks[i + 1].t if i + 1 < len(ticks) else duration_s) - k.t)
               for i, k in enumerate(ticks)]
    per: dict[int, list[tuple[Reading, float]]] = {}
    overlap = 0.0
    for k, w in zip(ticks, weights):
        busy = sum(1 for r in k.readings if (r.util_percent or 0) >= BUSY_UTIL)
        if busy >= 2:
            overlap += w
        for r in k.readings:
            per.setdefault(r.gpu, []).append((r, w))
    gpus = []
    for g in sorted(per):
        rs = per[g]
        utils = [r.util_percent for r, _ in rs if r.util_percent is not None]
        gpus.append(GpuSummary(
            g, max(r.used_bytes for r, _ in rs), max(r.total_bytes for r, _ in rs),
            sum(utils) / len(utils) if utils else None,
            percentile(utils, 50) if utils else None, percentile(utils, 95) if utils else None,
            sum(w for r, w in rs if (r.util_percent or 0) >= BUSY_UTIL)))
    share = overlap / duration_s if duration_s > 0 else 0.0
    s = WatchSummary(tuple(command), exit_code, duration_s, sampling, sampling_error,
                     len(ticks), interval_s, tuple(gpus), overlap, share,
                     idle_share=_idle_share(ticks, weights))
    return dataclasses.replace(s, warnings=tuple(_warnings(s, cores)))


def _idle_share(ticks: Sequence[Tick], weights: Sequence[float]) -> float | None:
    """The time-weighted idle share (100 - util) of the GPUs that worked, between the first
    and the last sample in which any of them was busy: start-up and shutdown left out."""
    busy = [i for i, k in enumerate(ticks)
            if any((r.util_percent or 0) >= BUSY_UTIL for r in k.readings)]
    if len(busy) < 2:
        return None
    working = {r.gpu for i in busy for r in ticks[i].readings
               if (r.util_percent or 0) >= BUSY_UTIL}
    idle = total = 0.0
    for k, w in zip(ticks[busy[0]:busy[-1] + 1], weights[busy[0]:busy[-1] + 1]):
        for r in k.readings:
            if r.gpu in working and r.util_percent is not None:
                idle += w * (100 - r.util_percent) / 100
                total += w
    return idle / total if total else None


def _warnings(s: WatchSummary, cores: int) -> list[str]:
    w: list[str] = []
    if not s.gpus or s.samples < 4:     # a few samples say nothing about a run
        return w
    for g in s.gpus:
        if g.total_bytes and g.peak_used_bytes > NEAR_LIMIT * g.total_bytes:
            w.append(f"GPU {g.gpu} peaked at {g.peak_used_bytes / GiB:.2f} of "
                     f"{g.total_bytes / GiB:.2f} GiB "
                     f"({100 * g.peak_used_bytes / g.total_bytes:.0f}%): "
                     f"one longer batch away from OOM; lower the batch and use gradient "
                     f"accumulation, AMP or checkpointing (`oomdoctor probe model.py` finds the "
                     f"largest batch that fits)")
    utils = [g for g in s.gpus if g.util_mean is not None]
    active = [g for g in utils if g.busy_s > 0.2 * s.duration_s]
    idle = [g for g in utils if g.busy_s <= 0.05 * s.duration_s]
    if len(utils) >= 2 and active and idle:
        ids = ", ".join(str(g.gpu) for g in idle)
        w.append(f"GPU {ids} stayed idle while GPU {active[0].gpu} worked: the run used "
                 f"{len(active)} of {len(utils)} GPUs; launch one process per GPU (torchrun "
                 f"--nproc-per-node {len(utils)}, torch.cuda.set_device(local_rank)), or set "
                 f"CUDA_VISIBLE_DEVICES so the idle GPU is free for another job")
    used = active or utils
    mean = sum(g.util_mean for g in used) / len(used) if used else 100
    if mean < IDLE_MEAN_UTIL:
        procs = max(1, len(active))
        w.append(f"the GPUs were mostly idle (mean utilisation {mean:.0f}%): the training waits "
                 f"for the data pipeline; raise DataLoader num_workers, set pin_memory=True and "
                 f".to(device, non_blocking=True), and export OMP_NUM_THREADS="
                 f"{max(1, cores // procs)} ({cores} cores / {procs} process(es))")
    return w


Sampler = Callable[[], Sequence[Reading]]


def nvml_sampler(nv, gpus: Sequence[int] | None = None) -> Sampler | None:
    """One reading per GPU from NVML, or None when NVML is unavailable (nv.error says why)."""
    if not nv.available():
        return None
    idx = list(range(nv.device_count())) if gpus is None else list(gpus)
    handles = [(i, nv.handle(i)) for i in idx]

    def sample() -> list[Reading]:
        out = []
        for i, h in handles:
            m = nv.memory(h)
            if m is not None:
                out.append(Reading(i, m[0], m[1], nv.utilization(h)))
        return out
    return sample


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    duration_s: float
    ticks: tuple[Tick, ...]
    sampling_error: str | None


class CommandError(Exception):
    """The command could not be started; `exit_code` follows the shell (127, 126)."""

    def __init__(self, msg: str, exit_code: int):
        super().__init__(msg)
        self.exit_code = exit_code


def run_watched(argv: Sequence[str], sampler: Sampler | None, interval_s: float = 0.5,
                clock: Callable[[], float] = time.monotonic,
                unavailable: str = "GPU sampling unavailable") -> RunResult:
    """Run argv (no shell, stdio inherited) while a thread samples every interval_s."""
    ticks: list[Tick] = []
    err: list[str] = []
    stop = threading.Event()
    t0 = clock()

    def loop() -> None:
        while True:
            try:
                ticks.append(Tick(clock() - t0, tuple(sampler())))
            except Exception as e:  # a sampler failure must never kill the training run
                err.append(f"GPU sampling stopped: {e}")
                return
            if stop.wait(interval_s):
                return

    try:
        proc = subprocess.Popen(list(argv))
    except FileNotFoundError as e:
        raise CommandError(f"{argv[0]}: command not found ({e.strerror}); check the spelling "
                           f"or the PATH", 127) from e
    except PermissionError as e:
        raise CommandError(f"{argv[0]}: not executable ({e.strerror}); chmod +x it or run it "
                           f"through its interpreter (python {argv[0]})", 126) from e
    th = threading.Thread(target=loop, daemon=True) if sampler is not None else None
    if th is not None:
        th.start()
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:   # Ctrl-C reached the child too: wait for it to finish
            continue
    duration = clock() - t0
    stop.set()
    if th is not None:
        th.join(timeout=max(5.0, 2 * interval_s))
    # The sampler may have taken one more reading between the child's exit and stop.set();
    # it describes the GPU after the run, so it is not part of the run.
    ticks[:] = [k for k in ticks if k.t <= duration]
    # A child killed by signal N: the shell's convention, 128 + N.
    code = 128 - code if code < 0 else code
    return RunResult(code, duration, tuple(ticks),
                     None if sampler is not None and not err else (err[0] if err else unavailable))


def render_text(s: WatchSummary) -> str:
    lines = [f"oomdoctor watch: `{' '.join(s.command)}` exited {s.exit_code} after "
             f"{s.duration_s:.1f} s"]
    if not s.sampling:
        lines.append(f"{s.sampling_error}; only the time is reported")
        return "\n".join(lines)
    if not s.gpus:
        lines.append("no GPU samples were taken (the run was shorter than one interval?)")
        return "\n".join(lines)
    for g in s.gpus:
        util = ("util ?" if g.util_mean is None else
                f"util mean {g.util_mean:.0f}% p50 {g.util_p50:.0f}% p95 {g.util_p95:.0f}%")
        lines.append(f"{g.memory_line()}, {util}, busy {g.busy_s:.1f} s")
    if len(s.gpus) >= 2:
        lines.append(f"two or more GPUs busy at once (util >= {BUSY_UTIL}%): "
                     f"{s.overlap_s:.1f} s of {s.duration_s:.1f} s ({100 * s.overlap_share:.0f}%)")
    lines.append(f"{s.samples} samples every {s.interval_s:g} s")
    if s.idle_share is not None:
        lines.append(_idle_text(s.idle_share))
    lines += [f"warning: {w}" for w in s.warnings]
    return "\n".join(lines)


def _idle_text(share: float) -> str:
    """The measured verdict, worded as the input-pipeline check's prediction is."""
    head = f"between its first and last kernel the GPU sat idle {share:.0%} of the time"
    if share <= WAITED:
        return f"{head}: GPU-BOUND, it did not wait for data"
    return (f"{head}: it WAITED - for the data pipeline or for the CPU launching kernels; "
            "`oomdoctor estimate -- python train.py` times the script's DataLoader per "
            "num_workers against the step")


def plot(ticks: Sequence[Tick], path: str) -> None:
    """PNG of memory (GiB) and utilisation (%) per GPU over time; needs matplotlib."""
    import matplotlib.pyplot as plt
    fig = figure(ticks)
    fig.savefig(path)
    plt.close(fig)


def figure(ticks: Sequence[Tick]) -> Any:
    """The plot as a matplotlib Figure: memory above, utilisation below, one line per GPU."""
    import matplotlib
    matplotlib.use("Agg")            # no display needed; files only
    import matplotlib.pyplot as plt
    fig, (ax_m, ax_u) = plt.subplots(2, 1, sharex=True, figsize=(9, 5))
    gpus = sorted({r.gpu for k in ticks for r in k.readings})
    for g in gpus:
        pts = [(k.t, r) for k in ticks for r in k.readings if r.gpu == g]
        line, = ax_m.plot([t for t, _ in pts], [r.used_bytes / GiB for _, r in pts],
                          label=f"GPU {g}")
        # The card's capacity, dashed in the same colour: how close the run came to an OOM.
        ax_m.axhline(pts[-1][1].total_bytes / GiB, color=line.get_color(), linestyle="--",
                     linewidth=0.8)
        # No utilisation reading (NVML_ERROR_NOT_SUPPORTED on some cards) is a gap, not 0%.
        ax_u.plot([t for t, _ in pts],
                  [float("nan") if r.util_percent is None else r.util_percent for _, r in pts],
                  label=f"GPU {g}")
    ax_u.set_ylim(0, 105)
    ax_m.set_ylabel("memory used (GiB)")
    ax_u.set_ylabel("utilisation (%)")
    ax_u.set_xlabel("time (s)")
    ax_m.legend()
    fig.tight_layout()
    return fig
