"""Measure the largest batch that fits on a real GPU, seeded by the simulator's prediction.

    python -c "from oomdoctor.models.loader import load_model_file; from oomdoctor.sim.trace import TraceConfig; \
from oomdoctor.runs.measure import measured_probe; \
print(measured_probe(load_model_file('sample_models/gpt2_small.py'), TraceConfig(1), predicted_max=12))"

Each trial runs the training loop the simulator traces (:func:`oomdoctor.sim.trace.trace_training`):
the model file's protocol (build_model, make_batch, loss_fn, make_optimizer), ``cfg.steps``
optimizer steps (2 by default: the second has optimizer state), the precision (AMP through
``torch.autocast`` plus ``torch.amp.GradScaler`` for fp16, ``model.to(bfloat16)`` for
bf16-pure, ``model.half()`` for fp16-pure) and checkpointing (:func:`oomdoctor.models.checkpointing.apply_checkpointing`). Every trial builds
a fresh model and optimizer inside a function whose frame is gone when it returns, then
``gc.collect()``, ``torch.cuda.empty_cache()`` and ``torch.cuda.reset_peak_memory_stats()``, so
``max_memory_allocated/reserved`` are the trial's own peaks and the process holds no more GPU
memory after the probe than before it.

The search starts at the simulator's predicted maximum ``p``: it tries ``p``, then ``p + 1`` if
``p`` fit or ``p - 1`` if not, galloping away from ``p`` only when the prediction was off - two or
three trials when the simulator is right, against about ``2 * log2(N)`` for the doubling and
bisection of Lightning's batch-size finder (``tuner/batch_size_scaling.py``), which is the
fallback without a prediction. Only ``torch.OutOfMemoryError`` counts as "does not fit"; anything
else is re-raised, as Lightning does.

Everything device-specific goes through a :class:`Runner` (default :class:`TorchRunner`), so the
search and the cleanup guarantees are tested on CPU-only machines with a fake-OOM runner.

Known limitations:
- A trial that OOMs part-way can leave the caching allocator fragmented; ``empty_cache()``
  returns every unused segment to the driver, so the next trial starts from nothing reserved -
  but not from a new process's device: the driver puts the next trial's segments in the range
  the earlier ones freed, and what fits changes (lora_gpt, measured on an H200: 540 trained
  after earlier runs and not in a new process). ``probe --device`` runs each trial in a new
  process (:mod:`oomdoctor.runs.fresh_process`); calibrate.py keeps one process and its results
  say so (``"process"``), which the calibration test replays.
- Memory other processes take on the card during the probe changes the answer.
- On ``device="cpu"`` (for tests) nothing is measured: the memory numbers are ``None``.
"""
from __future__ import annotations

import contextlib
import gc
import time
import traceback
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Protocol

import torch

from oomdoctor.configs import MAX_BATCH
from oomdoctor.sim.gpus import GiB, PROFILES, GpuProfile, custom_profile
from oomdoctor.models.spec import ModelSpec
from oomdoctor.plans.probe import bisect_largest
from oomdoctor.sim.trace import TraceConfig

Progress = Callable[[str], None]
# Predicted (allocated, reserved) bytes at a batch size, e.g. from oomdoctor.plans.estimate.
Predictor = Callable[[int], "tuple[int, int]"]


class MeasureError(Exception):
    """The measured probe cannot run here (no such device, bad arguments)."""


class NoDeviceError(MeasureError):
    """The CUDA device asked for is not here (no GPU, CPU-only torch, index out of range)."""


@dataclass(frozen=True)
class MeasuredTrial:
    """One real training run at one batch size."""

    batch_size: int
    fits: bool                               # cfg.steps optimizer steps ran without an OOM
    max_memory_allocated: int | None         # torch.cuda.max_memory_allocated(); None on CPU
    max_memory_reserved: int | None          # torch.cuda.max_memory_reserved(); None on CPU
    predicted_allocated_bytes: int | None    # the simulator's numbers, when a predictor is given
    predicted_reserved_bytes: int | None
    seconds: float
    error: str | None = None                 # first line of the OOM message


@dataclass(frozen=True)
class MeasuredProbe:
    """The measured maximum batch of one configuration, next to the prediction."""

    model: str
    device: str
    device_name: str
    precision: str
    checkpointing: bool
    max_batch_size: int | None               # None: even batch 1 does not fit
    predicted_max_batch_size: int | None
    capped: bool                             # the search stopped at max_batch
    trials: tuple[MeasuredTrial, ...]        # in the order they ran
    allocated_before: int | None             # torch.cuda.memory_allocated() before the probe
    allocated_after: int | None
    reserved_before: int | None              # torch.cuda.memory_reserved() before the probe
    reserved_after: int | None

    @property
    def num_trials(self) -> int:
        return len(self.trials)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["trials"] = [asdict(t) for t in self.trials]
        d["num_trials"] = self.num_trials
        return d


class Runner(Protocol):
    """The device-specific half of the probe."""

    device: str

    def device_name(self) -> str: ...

    def memory(self) -> tuple[int | None, int | None]:
        """Currently (allocated, reserved) bytes; (None, None) where nothing is measured."""

    def reset_peaks(self) -> None: ...

    def peaks(self) -> tuple[int | None, int | None]:
        """(max allocated, max reserved) since the last reset_peaks()."""

    def train(self, spec: ModelSpec, cfg: TraceConfig) -> None:
        """Run the training steps of ``cfg``; raise torch.OutOfMemoryError when it does not fit.
        Must keep no reference to what it allocated once it returns or raises."""

    def cleanup(self) -> None:
        """Give back everything a trial left: collect garbage, empty the allocator's cache."""


class TorchRunner:
    """Real training on ``cuda[:N]`` (or ``cpu`` for tests: no CUDA call is made then).

    ``build_on_device``: build the model under ``with device:`` (the calibration harness's
    way, replayed by oomdoctor.runs.onbuild), or on the host and then ``.to(device)``, as a
    training script usually does and as the simulator places it."""

    def __init__(self, device: str = "cuda:0", build_on_device: bool = True) -> None:
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise MeasureError(f"cannot read device {device!r}: {e}; use cuda, cuda:N or cpu") from e
        if dev.type not in ("cuda", "cpu"):
            raise MeasureError(f"device {device!r} is not supported; the measured probe runs "
                               "on cuda, cuda:N (or cpu for tests)")
        if dev.type == "cuda":
            # Checked here, not at import: library code never initialises CUDA on import.
            if not torch.cuda.is_available():
                raise NoDeviceError(f"--device {device} asked for a CUDA GPU, but torch "
                                   f"{torch.__version__} sees none (CPU-only build or no "
                                   "driver); run on a machine with a GPU, or use "
                                   "`oomdoctor probe` without --device for the simulation")
            index = 0 if dev.index is None else dev.index
            if index >= torch.cuda.device_count():
                raise NoDeviceError(f"--device {device}: only {torch.cuda.device_count()} CUDA "
                                   "device(s) visible; check CUDA_VISIBLE_DEVICES")
            dev = torch.device("cuda", index)
        self.dev = dev
        self.device = str(dev)
        self.cuda = dev.type == "cuda"
        self.build_on_device = build_on_device

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.dev) if self.cuda else "cpu"

    def memory(self) -> tuple[int | None, int | None]:
        if not self.cuda:
            return None, None
        torch.cuda.synchronize(self.dev)
        return torch.cuda.memory_allocated(self.dev), torch.cuda.memory_reserved(self.dev)

    def reset_peaks(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.dev)

    def peaks(self) -> tuple[int | None, int | None]:
        if not self.cuda:
            return None, None
        return torch.cuda.max_memory_allocated(self.dev), torch.cuda.max_memory_reserved(self.dev)

    def outside_allocator(self) -> int | None:
        """What the device holds outside the caching allocator now: the CUDA context, with the
        kernels loaded so far (lazily); None on the host."""
        if not self.cuda:
            return None
        free, total = torch.cuda.mem_get_info(self.dev)
        return total - free - torch.cuda.memory_reserved(self.dev)

    def train(self, spec: ModelSpec, cfg: TraceConfig) -> None:
        _train(spec, cfg, self.dev, self.build_on_device)
        if self.cuda:
            torch.cuda.synchronize(self.dev)   # an asynchronous kernel's failure belongs here

    def cleanup(self) -> None:
        gc.collect()   # cycles (autograd graphs held by closures, modules) before emptying
        if not self.cuda:
            return
        torch.cuda.synchronize(self.dev)
        # cuBLAS workspaces are allocated through the caching allocator on each thread's first
        # matmul and kept per handle (aten/src/ATen/cuda/CublasHandlePool.cpp); without clearing
        # them they would outlive the probe. torch.cuda.empty_cache() does not release them.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.dev)


def _train(spec: ModelSpec, cfg: TraceConfig, dev: torch.device,
           build_on_device: bool = True) -> None:
    """The simulator's training loop (oomdoctor/sim/trace.py trace_training) on real tensors.
    Everything lives in this frame, so it is all unreferenced when the function exits.
    ``build_on_device=False``: the model is built (and cast) on the host, then moved."""
    from oomdoctor.models.training import (build_for_training, compute_loss, make_configured_batch,
                                           make_configured_optimizer)

    torch.manual_seed(0)
    with dev if build_on_device else torch.device("cpu"):
        model, _ = build_for_training(spec, cfg.precision, cfg.checkpointing, cfg.checkpoint_class,
                                      checkpoint_every=cfg.checkpoint_every,
                                      checkpoint_policy=cfg.checkpoint_policy)
    if not build_on_device:
        model.to(dev)
    optimizer = make_configured_optimizer(spec, model, cfg.optimizer)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.precision)
    scaler = torch.amp.GradScaler(dev.type) if cfg.precision == "fp16" else None
    for _ in range(cfg.steps):
        for micro in range(cfg.grad_accum):
            with dev:   # the trace makes the batch on the device too (trace.py, Phase.DATA)
                batch = make_configured_batch(spec, cfg.batch_size, cfg.precision)
            with (torch.autocast(dev.type, dtype=amp) if amp is not None
                  else contextlib.nullcontext()):
                loss = compute_loss(spec, model, batch)
            if cfg.grad_accum > 1:
                loss = loss / cfg.grad_accum
            if cfg.zero_grad == "after-forward" and micro == 0:
                optimizer.zero_grad(set_to_none=True)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss, batch   # as the trace does: the graph goes before the next micro-batch
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if cfg.zero_grad == "after-step":
            optimizer.zero_grad(set_to_none=True)
        elif cfg.zero_grad == "in-place":
            optimizer.zero_grad(set_to_none=False)


def measured_probe(spec: ModelSpec, cfg: TraceConfig, device: str = "cuda:0",
                   predicted_max: int | None = None, progress: Progress = lambda _: None,
                   max_batch: int = MAX_BATCH, runner: Runner | None = None,
                   predict: Predictor | None = None) -> MeasuredProbe:
    """Largest batch size of ``cfg`` (its batch_size is ignored) that trains on ``device``.

    ``predicted_max``: the simulator's answer, which seeds the search (0: the simulator says
    nothing fits, the search starts at 1; None: no prediction, double then bisect). ``predict(b)``: the simulator's
    (allocated, reserved) bytes at batch ``b``, recorded next to each trial's measurement.
    ``runner`` replaces the real device (tests). A KeyboardInterrupt during a trial is re-raised
    after the trial's cleanup.
    """
    if max_batch < 1:
        raise MeasureError(f"max_batch must be >= 1, got {max_batch}")
    if predicted_max is not None and predicted_max < 0:
        raise MeasureError(f"predicted_max must be >= 0, got {predicted_max}")
    runner = runner if runner is not None else TorchRunner(device)
    label = f"{cfg.precision}{' + checkpointing' if cfg.checkpointing else ''}"
    trials: list[MeasuredTrial] = []
    known: dict[int, bool] = {}

    def fits(b: int) -> bool:
        if b not in known:
            trial = _run_trial(spec, replace(cfg, batch_size=b), runner, predict)
            trials.append(trial)
            known[b] = trial.fits
            mem = ("" if trial.max_memory_reserved is None else
                   f" (peak reserved {trial.max_memory_reserved / GiB:.2f} GiB"
                   + ("" if trial.predicted_reserved_bytes is None else
                      f", predicted {trial.predicted_reserved_bytes / GiB:.2f} GiB") + ")")
            progress(f"{label}: batch size {b} {'fits' if trial.fits else 'does not fit'}{mem}")
        return known[b]

    allocated_before, reserved_before = runner.memory()
    if predicted_max is None:
        best, capped = _double_thenbisect_largest(fits, max_batch)
    else:
        best, capped = _search_from(fits, max(1, min(predicted_max, max_batch)), max_batch)
    allocated_after, reserved_after = runner.memory()
    return MeasuredProbe(
        model=spec.name, device=runner.device, device_name=runner.device_name(),
        precision=cfg.precision, checkpointing=cfg.checkpointing, max_batch_size=best,
        predicted_max_batch_size=predicted_max, capped=capped, trials=tuple(trials),
        allocated_before=allocated_before, allocated_after=allocated_after,
        reserved_before=reserved_before, reserved_after=reserved_after)


def _run_trial(spec: ModelSpec, cfg: TraceConfig, runner: Runner,
               predict: Predictor | None) -> MeasuredTrial:
    """One trial; the runner's cleanup runs whatever happens."""
    predicted = predict(cfg.batch_size) if predict is not None else (None, None)
    runner.cleanup()        # start from nothing cached, peaks reset
    runner.reset_peaks()
    error: str | None = None
    t0 = time.perf_counter()
    try:
        runner.train(spec, cfg)
    except torch.OutOfMemoryError as e:   # the caching allocator's OOM (torch >= 2.1 name)
        error = oom_line(e)
        # The traceback's frames hold the trial's tensors until it dies; drop their locals.
        traceback.clear_frames(e.__traceback__)
    except BaseException as e:            # KeyboardInterrupt, model errors: clean up, re-raise
        traceback.clear_frames(e.__traceback__)
        runner.cleanup()
        raise
    seconds = time.perf_counter() - t0
    peak_allocated, peak_reserved = runner.peaks()
    runner.cleanup()
    return MeasuredTrial(cfg.batch_size, error is None, peak_allocated, peak_reserved,
                         predicted[0], predicted[1], seconds, error)


def oom_line(e: BaseException) -> str:
    """The first line of an out-of-memory error's message (what a trial records)."""
    return (str(e).strip().splitlines() or ["out of memory"])[0]


def _search_from(fits: Callable[[int], bool], guess: int, max_batch: int) -> tuple[int | None, bool]:
    """Largest b in [1, max_batch] with fits(b), starting at a good guess: try the guess, then
    guess + 1 (or guess - 1), guess + 2, guess + 4, ... until the verdict flips, then bisect.
    Two trials when the guess is exact, three when it is one off."""
    if fits(guess):
        lo, d = guess, 1
        while True:
            b = guess + d
            if b > max_batch:
                if lo == max_batch:
                    return lo, True
                if fits(max_batch):
                    return max_batch, True
                return bisect_largest(fits, lo, max_batch), False
            if not fits(b):
                return bisect_largest(fits, lo, b), False
            lo, d = b, d * 2
    hi, d = guess, 1
    while True:
        b = guess - d
        if b < 1:
            if hi == 1 or not fits(1):
                return None, False
            return bisect_largest(fits, 1, hi), False
        if fits(b):
            return bisect_largest(fits, b, hi), False
        hi, d = b, d * 2


def _double_thenbisect_largest(fits: Callable[[int], bool], max_batch: int) -> tuple[int | None, bool]:
    """No prediction: Lightning's search - 1, 2, 4, ... until one fails, then bisect."""
    if not fits(1):
        return None, False
    lo, hi = 1, 2
    while hi <= max_batch and fits(hi):
        lo, hi = hi, hi * 2
    if hi > max_batch:
        if lo == max_batch:
            return lo, True
        if fits(max_batch):
            return max_batch, True
        hi = max_batch
    return bisect_largest(fits, lo, hi), False


# Device names as torch.cuda.get_device_name() reports them -> oomdoctor.sim.gpus.PROFILES keys.
# Checked in order: "A100" before "A10", "L40" must not read as "L4".
# First match wins, so a name that contains another comes first (L40S before L40 and L4).
# "NVIDIA H200" is what torch 2.11 reported on an H200 (benchmarks/results/).
_NAME_RULES: tuple[tuple[str, Callable[[int], str]], ...] = (
    ("H100", lambda total: "h100-80"),
    ("H200", lambda total: "h200"),
    ("B200", lambda total: "b200"),
    ("MI300X", lambda total: "mi300x"),
    ("MI250", lambda total: "mi250"),
    ("A100", lambda total: "a100-80" if total > 50 * GiB else "a100-40"),
    ("A6000", lambda total: "a6000"),
    ("A10", lambda total: "a10"),
    ("L40S", lambda total: "l40s"),
    ("L40", lambda total: ""),
    ("L4", lambda total: "l4"),
    ("T4", lambda total: "t4"),
    ("V100", lambda total: "v100-32" if total > 20 * GiB else "v100-16"),
    ("5090", lambda total: "rtx5090"),
    ("4090", lambda total: "rtx4090"),
    ("4080", lambda total: "rtx4080"),
    ("3090", lambda total: "rtx3090"),
    ("3060", lambda total: "rtx3060-12"),
)


def profile_for_device(name: str, total_bytes: int, compute_capability: tuple[int, int]
                       ) -> GpuProfile:
    """The oomdoctor profile of a measured card: the named profile when one matches the device
    name, else a custom profile with the card's own capacity and compute capability. Either
    way the capacity is the card's: what the allocator may use is measured, not assumed."""
    upper = name.upper()
    key = ""
    for needle, pick in _NAME_RULES:
        if needle in upper:
            key = pick(total_bytes)
            break
    if key:
        return replace(PROFILES[key], total_bytes=total_bytes)
    return custom_profile(total_bytes, bf16=compute_capability >= (8, 0),
                          compute_capability=tuple(compute_capability))
