"""A running training script's optimizer steps: counted, each one's loss and time recorded, and
the script stopped after the N-th.

    oomdoctor smoke --steps 3 -- python train.py --lr 3e-4

Read from what the script calls, as oomdoctor's own run of a script reads its phases
(:mod:`oomdoctor.sim.script`): a forward of a module that is not inside another (global module
hooks), ``torch.autograd.backward`` (which ``loss.backward()`` calls), ``optimizer.step()`` (a
global optimizer step post-hook). The stop is that run's stop, so that the two are comparable:
after the N-th optimizer step, the script's next top-level forward or backward raises
:class:`StopRun` (a BaseException: a script's ``except Exception`` lets it through), so the
step's ``zero_grad`` has run. A step counts when a backward came before it, so two optimizers
stepped after one backward are one step, as there; a step a ``GradScaler`` skips (inf/NaN
gradients at its first loss scales) counts too, as there, where the fake GPU's scaler always
steps.

A step's loss is the sum of the scalar tensors ``backward()`` was called on since the previous
step - the micro-batches' ``loss / accum`` add up to the step's mean - taken before a
``GradScaler``'s scaling. Its time runs from the end of the previous step (the first: from the
script's first forward or backward), with CUDA synchronised before the clock is read.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.nn.modules import module as nn_module
from torch.optim.optimizer import register_optimizer_step_post_hook

from oomdoctor.sim.script_phases import Loading, watching_loaders


class StopRun(BaseException):
    """The script has taken its steps."""


class NoStep(BaseException):
    """The script ran forward passes and never stepped an optimizer (the message says how
    many)."""


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step as the script took it."""

    step: int                  # from 1
    loss: float | None         # None: no backward of a scalar in the step
    seconds: float
    skipped: bool = False      # the GradScaler skipped the optimizer's update


class StepWatch:
    """Counts the script's steps and stops it after ``steps`` (see the module docstring).
    ``on_step`` is told of each step as it ends; ``sync`` (CUDA's synchronize) runs before a
    step's clock is read; more than ``forwards`` top-level forwards without a step raise
    :class:`NoStep`."""

    def __init__(self, steps: int, on_step: Callable[[StepRecord], None],
                 sync: Callable[[], None] | None = None, forwards: int = 200,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.steps, self.on_step, self.sync = steps, on_step, sync
        self.forward_limit, self.clock = forwards, clock
        self.done = self.skipped = 0
        self.depth = self.in_backward = self.forwards = 0
        self.loading = Loading()  # the DataLoaders at work (their transform modules)
        self.backwarded = False
        self.pending: list[float | None] = []       # this step's backward losses
        self.last: float | None = None              # when the previous step ended
        # id(scaled loss) -> (a weak reference to it, the loss before scaling)
        self.scaled: dict[int, tuple[Any, torch.Tensor]] = {}

    def _stop_if_done(self) -> None:
        if self.done >= self.steps:
            raise StopRun

    def _start(self) -> None:
        if self.last is None:
            self.last = self.clock()

    def _data(self) -> bool:
        """A DataLoader making a batch (in this process, or in one of its workers, which
        inherit the hooks): its dataset's transform modules are not the model's forwards."""
        return bool(self.loading) or torch.utils.data.get_worker_info() is not None

    def forward_pre(self, _module: torch.nn.Module, _args: Any) -> None:
        if self._data():
            return
        # a forward inside backward is a checkpointed block recomputing: part of the backward
        if self.depth == 0 and not self.in_backward:
            self._stop_if_done()
            self._start()
            if torch.is_grad_enabled():       # an evaluation under no_grad trains nothing
                self.forwards += 1
            if self.forwards > self.forward_limit:
                raise NoStep(f"{self.forwards - 1} forward passes without an optimizer step")
        self.depth += 1

    def forward_post(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if self._data():
            return
        self.depth = max(self.depth - 1, 0)


    def backward(self, real: Callable) -> Callable:
        """``torch.autograd.backward`` that stops the script after its steps and records the
        loss it is called on."""
        def backward(tensors, *args, **kwargs):
            self._stop_if_done()
            self._start()
            self.pending.append(self._loss(tensors))
            self.in_backward += 1
            try:
                return real(tensors, *args, **kwargs)
            finally:
                self.in_backward -= 1
                self.backwarded = True
        return backward

    def _loss(self, tensors: Any) -> float | None:
        """The value of the scalar a backward starts from, before any GradScaler scaling."""
        if isinstance(tensors, (tuple, list)) and len(tensors) == 1:
            tensors = tensors[0]
        if not isinstance(tensors, torch.Tensor) or tensors.numel() != 1:
            return None
        ref, unscaled = self.scaled.pop(id(tensors), (None, None))
        self.scaled.clear()
        t = unscaled if ref is not None and ref() is tensors else tensors
        try:
            return float(t.detach().item())    # no device allocation: a host copy
        except (RuntimeError, NotImplementedError):   # a tensor with no data (meta)
            return None

    def scale(self, real: Callable) -> Callable:
        """``GradScaler.scale`` that remembers the loss it scaled."""
        def scale(scaler, outputs):
            out = real(scaler, outputs)
            if isinstance(outputs, torch.Tensor) and out is not outputs \
                    and outputs.numel() == 1:
                self.scaled[id(out)] = (weakref.ref(out), outputs.detach())
            return out
        return scale

    def scaler_step(self, real: Callable) -> Callable:
        """``GradScaler.step``: a step it skips (inf/NaN gradients) still counts."""
        def step(scaler, optimizer, *args, **kwargs):
            before = self.done
            out = real(scaler, optimizer, *args, **kwargs)
            if self.done == before and self.backwarded:
                self._step_done(skipped=True)
            return out
        return step

    def step_post(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self.backwarded:
            self._step_done(skipped=False)

    def _step_done(self, skipped: bool) -> None:
        if self.sync is not None:
            self.sync()
        now = self.clock()
        seconds = now - (self.last if self.last is not None else now)
        losses = [x for x in self.pending if x is not None]
        self.done += 1
        self.skipped += skipped
        self.last, self.backwarded, self.forwards, self.pending = now, False, 0, []
        self.on_step(StepRecord(self.done, sum(losses) if losses else None, seconds, skipped))


@contextlib.contextmanager
def watching(watch: StepWatch) -> Iterator[StepWatch]:
    """``watch`` hooked into torch for the block: module forwards, backward, optimizer steps
    and GradScaler's scale and step; all put back after."""
    scaler = torch.amp.grad_scaler.GradScaler
    real_backward, real_scale, real_step = torch.autograd.backward, scaler.scale, scaler.step
    hooks = [nn_module.register_module_forward_pre_hook(watch.forward_pre),
             nn_module.register_module_forward_hook(watch.forward_post, always_call=True),
             register_optimizer_step_post_hook(watch.step_post)]
    torch.autograd.backward = watch.backward(real_backward)
    scaler.scale, scaler.step = watch.scale(real_scale), watch.scaler_step(real_step)
    try:
        with watching_loaders(watch.loading):
            yield watch
    finally:
        torch.autograd.backward = real_backward
        scaler.scale, scaler.step = real_scale, real_step
        for h in hooks:
            h.remove()
