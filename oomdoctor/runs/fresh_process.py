"""Each measured trial in a new process: what fits there is what a new training run fits.

    from oomdoctor.runs.fresh_process import FreshProcessRunner
    measured_probe(spec, cfg, runner=FreshProcessRunner("cuda:0"), predicted_max=12)

A process that trained before and emptied its cache does not start from the device a new
process sees: the driver puts its new segments in the address range the earlier runs freed,
lowest first, where a new process gets them top-down (oomdoctor.sim.allocator.addresses), and
the caching allocator's best fit, which breaks ties by address, then reuses other blocks.
Measured on an H200 (benchmarks/results/nvidia-h200-2.11.0.json and -fresh.json): lora_gpt,
bf16 AMP with checkpointing, trained at batch 540 after earlier runs in one process and ran
out of memory at 540 in a new one. A search whose trials share a process can so answer a batch
that the user's training run, a new process, cannot train; and the simulator, which models a
new process, looks wrong where it is right. So :class:`FreshProcessRunner` spawns one process
per trial (spawn, never fork: CUDA does not survive a fork). The parent touches no CUDA: a
context it held would take the child's memory.

Cost: a few seconds per trial to start Python, import torch and create the CUDA context.
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch

from oomdoctor.models.loader import for_process, in_process
from oomdoctor.models.spec import ModelSpec
from oomdoctor.runs.measure import TorchRunner, oom_line
from oomdoctor.sim.trace import TraceConfig


class FreshProcessRunner:
    """A :class:`oomdoctor.runs.measure.Runner` whose every ``train`` runs in a new process.
    ``build_on_device`` as :class:`oomdoctor.runs.measure.TorchRunner`'s (default: built on the
    host and moved, as a training script does and as the simulator places the model)."""

    def __init__(self, device: str = "cuda:0", build_on_device: bool = False) -> None:
        checked = TorchRunner(device, build_on_device)   # no such device: MeasureError now
        self.device = checked.device
        self.build_on_device = build_on_device
        self._name: str | None = None
        self._peaks: tuple[int | None, int | None] = (None, None)
        # the most any trial's process held outside the allocator at its end: the CUDA context
        # with the kernels the step loaded (lazily); None without CUDA
        self.context_after: int | None = None

    def device_name(self) -> str:
        return self._name or self.device

    def memory(self) -> tuple[int | None, int | None]:
        return None, None      # the parent holds nothing on the device: each trial is a child's

    def reset_peaks(self) -> None:
        self._peaks = (None, None)

    def peaks(self) -> tuple[int | None, int | None]:
        return self._peaks

    def cleanup(self) -> None:
        pass                   # the child's exit gave everything back

    def train(self, spec: ModelSpec, cfg: TraceConfig) -> None:
        """One trial in a new process; raises torch.OutOfMemoryError when the child ran out."""
        try:
            out = _in_new_process(_trial, for_process(spec, "spawn"), cfg, self.device,
                                  self.build_on_device)
        except BrokenProcessPool as e:    # not a verdict, nor the user's usage: exit 5
            raise RuntimeError(f"the trial's process at batch {cfg.batch_size} died without a "
                               f"result ({e}); run it alone to see why (out of host memory, a "
                               "crash in a CUDA extension)") from e
        self._name = out["device_name"]
        self._peaks = (out["max_memory_allocated"], out["max_memory_reserved"])
        if out["outside_allocator"] is not None:
            self.context_after = max(self.context_after or 0, out["outside_allocator"])
        if out["oom"] is not None:
            raise torch.OutOfMemoryError(out["oom"])


def _trial(source: Any, cfg: TraceConfig, device: str, build_on_device: bool) -> dict[str, Any]:
    """In the child: train ``cfg`` once on ``device``; the peaks, the device's name and the
    first line of the OOM message (None when it trained)."""
    runner = TorchRunner(device, build_on_device)
    spec = in_process(source)
    oom = None
    try:
        runner.train(spec, cfg)
    except torch.OutOfMemoryError as e:
        oom = oom_line(e)
    allocated, reserved = runner.peaks()
    return {"oom": oom, "max_memory_allocated": allocated, "max_memory_reserved": reserved,
            "device_name": runner.device_name(), "outside_allocator": runner.outside_allocator()}


def _in_new_process(fn, *args: Any) -> Any:
    """``fn(*args)`` in a spawned process (CUDA does not survive a fork), its result."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def first_context(device: str = "cuda:0") -> int | None:
    """The CUDA context right after a new process's first allocation, measured in one (this
    process stays without one); None without CUDA."""
    return _in_new_process(_first_context, device)


def _first_context(device: str) -> int | None:
    runner = TorchRunner(device)
    if runner.cuda:
        torch.zeros(1, device=runner.dev)
    return runner.outside_allocator()
