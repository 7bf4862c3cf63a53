"""How a training script's run is read: its phases from what it calls, its steps, its stop.

A model file's loop marks its phases itself; a script's are read from what it calls
(:mod:`oomdoctor.sim.script` runs it): a forward of a module that is not inside another (global
module hooks; not a DataLoader's transform modules, not an evaluation under ``no_grad`` for the
step count), ``backward()``, ``optimizer.step()`` (global optimizer hooks), or - in a script
without an optimizer, which updates its weights by hand - the next forward after a backward.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)
from torch.utils._pytree import tree_leaves

from oomdoctor.models.blocks import execution_blocks
from oomdoctor.models.spec import ModelFileError
from oomdoctor.sim import cudaoptim, versions
from oomdoctor.sim.recorder import Category, Phase, PhaseMark, Recorder
from oomdoctor.sim.stepping import in_step, unique_storages
from oomdoctor.sim.trace import TraceConfig


class ScriptError(ModelFileError):
    """The script failed, or did something the fake GPU cannot follow."""


class DataExhausted(ScriptError):
    """The script's DataLoader yields no batch at this batch size: its dataset holds fewer
    samples than one batch, and ``drop_last`` drops the partial one."""

    def __init__(self, message: str, samples: int | None) -> None:
        super().__init__(message)
        self.samples = samples


class NoStep(ScriptError):
    """The script ended without an optimizer step (at a larger batch: its data gave no batch,
    as a corpus cut into fewer rows than a sequence does)."""


class Stop(BaseException):
    """The run has its steps (BaseException: a script's ``except Exception`` lets it through)."""


@dataclass
class ScriptLimits:
    """When a script that does not reach its steps is stopped."""

    seconds: float = 600.0
    forwards: int = 200          # forward passes without an optimizer step


@dataclass
class ScriptRun:
    """What the run saw besides the events: for the trace's figures and notes."""

    roots: dict[int, torch.nn.Module] = field(default_factory=dict)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    loader_batches: list[int] = field(default_factory=list)   # DataLoader batch sizes
    loaders: list["LoaderSeen"] = field(default_factory=list)  # the DataLoaders it made
    steps_done: int = 0
    micro_batches: list[int] = field(default_factory=list)   # backward passes per step
    ended: str = ""              # how the run ended: "steps", "script end"
    gradient_bytes: int = 0
    # the first forward's calls of each root's blocks: root id -> [(block, [(storage handle,
    # bytes, requires_grad) of each tensor argument])], for the split (plans.parallel.layout)
    calls: dict[int, list] = field(default_factory=dict)
    # the first dimension of the first forward's first tensor argument: the batch of a script
    # that batches by hand (no DataLoader)
    forward_batch: int = 0
    sharding: Any = None         # what the script's FSDP wrapped (sim.sharding.Sharding)
    spread: Any = None           # DataParallel or dispatch_model in it (sim.spreading.Spread)
    deepspeed: dict | None = None  # the config deepspeed.initialize was given
    output_bytes: int = 0        # the first forward's output (its tensors), at the run's batch


@dataclass(frozen=True)
class LoaderSeen:
    """A DataLoader the script made, with the settings it asked for (the trace's copy runs in
    this process: num_workers=0)."""

    loader: Any
    num_workers: int
    pin_memory: bool


class Phases:
    """Reads the script's phases from what it calls, and stops it after its steps."""

    def __init__(self, rec: Recorder, run: ScriptRun, cfg: TraceConfig,
                 limits: ScriptLimits, progress: Callable[[str], None] | None) -> None:
        self.rec, self.run, self.limits = rec, run, limits
        self.steps = cfg.steps
        self.torch = cfg.torch              # whose CUDA facts (sim.versions)
        self.emulate_cuda = cfg.emulate_cuda
        self.progress = progress
        self.marks: list[PhaseMark] = []
        self.micro = self.depth = self.forwards = 0
        self.backwarded = False
        self.optimizer_made = False      # a torch.optim.Optimizer exists (the script made one)
        self.loading = Loading()         # the DataLoaders at work (batches since the step)
        self.names: dict[int, str] = {}
        self.blocks: dict[int, tuple[int, int]] = {}     # module id -> (root id, block)
        self.started = time.monotonic()
        self.mark(Phase.SETUP)

    def mark(self, phase: Phase) -> None:
        rec = self.rec
        it = min(self.run.steps_done, self.steps - 1)
        if self.marks and self.marks[-1].start == len(rec.raw) \
                and self.marks[-1].phase is not Phase.OPTIMIZER:
            # an empty phase; an optimizer step that allocates nothing (its state made, a fused
            # kernel) is still the step the replays time frees and state by, as a model
            # file's trace keeps it
            self.marks.pop()
        if self.progress is not None and phase in (Phase.FORWARD, Phase.BACKWARD,
                                                   Phase.OPTIMIZER):
            self.progress(f"step {it + 1}/{self.steps}: {phase.value}")
        rec.phase, rec.iteration = phase, it
        self.marks.append(PhaseMark(len(rec.raw), phase, it, self.micro))

    def _stop_if_done(self) -> None:
        if self.run.steps_done >= self.steps:
            self.rec.closed = True             # what unwinding the script frees is not the step
            self.run.ended = "steps"
            raise Stop
        if time.monotonic() - self.started > self.limits.seconds:
            raise ScriptError(f"no optimizer step within {self.limits.seconds:.0f} s "
                              f"(the script was at {script_frame()}); pass --steps 1, or write a "
                              "model file")

    def forward_pre(self, module: torch.nn.Module, _args: Any) -> None:
        if self.loading:
            return
        # A forward inside backward is a checkpointed block recomputing: part of the backward.
        if self.depth == 0 and self.rec.phase is not Phase.BACKWARD:
            if self.backwarded and not self.optimizer_made:
                self._manual_step()
            self._stop_if_done()
            self._root(module)
            if not self.run.forward_batch:
                first = next((t for t in tree_leaves(_args) if isinstance(t, torch.Tensor)
                              and t.dim() >= 1), None)
                dim = 1 if first is not None and first.dim() >= 2 and _sequence_first(module) \
                    else 0
                self.run.forward_batch = int(first.shape[dim]) if first is not None else 0
            if self.rec.phase is not Phase.FORWARD:
                self.mark(Phase.FORWARD)
            if torch.is_grad_enabled():       # an evaluation under no_grad trains nothing
                self.forwards += 1
            if self.forwards > self.limits.forwards:
                raise ScriptError(f"{self.forwards - 1} forward passes without an optimizer "
                                  f"step (the script was at {script_frame()}); oomdoctor stops "
                                  "after its steps, so the script must reach optimizer.step()")
        self._record_call(module, _args)
        self.depth += 1
        self.rec.module_stack.append(self.names.get(id(module), type(module).__name__))

    def _record_call(self, module: torch.nn.Module, args: Any) -> None:
        """A block's tensor arguments in the first forward of its root."""
        where = self.blocks.get(id(module))
        if where is None or self.forwards != 1 or self.rec.phase is not Phase.FORWARD:
            return
        root, block = where
        seen = self.run.calls.setdefault(root, [])
        if any(b == block for b, _ in seen):        # a block called again (a shared one)
            return
        args = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        seen.append(
            (block, [(self.rec.handle_of(t), t.numel() * t.element_size(), t.requires_grad)
                     for t in args]))

    def forward_post(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if self.loading:
            return
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0 and self.forwards == 1 and not self.run.output_bytes:
            # the model's output: what DataParallel gathers on its first GPU
            self.run.output_bytes = sum(t.numel() * t.element_size() for t in tree_leaves(_out)
                                        if isinstance(t, torch.Tensor))
        if self.rec.module_stack:
            self.rec.module_stack.pop()

    def _root(self, module: torch.nn.Module) -> None:
        if id(module) in self.run.roots:
            return
        self.run.roots[id(module)] = module
        root = type(module).__name__
        for name, m in module.named_modules():
            self.names.setdefault(id(m), name or root)
        for i, name in enumerate(execution_blocks(module)):
            if name:
                self.blocks.setdefault(id(module.get_submodule(name)), (id(module), i))

    def backward(self, real: Callable) -> Callable:
        def backward(*args, **kwargs):
            self._stop_if_done()
            self.mark(Phase.BACKWARD)
            out = real(*args, **kwargs)
            self.run.gradient_bytes = _label_gradients(self.rec, self.run)
            self.micro += 1
            self.backwarded = True
            # inside optimizer.step(closure) (Lightning's loop) the update follows at once
            self.mark(Phase.OPTIMIZER if in_step() else Phase.DATA)
            return out
        return backward

    def _manual_step(self) -> None:
        """A script without an optimizer (``p.data.add_(p.grad, alpha=-lr)``, pytorch/examples'
        word_language_model) updates its weights by hand: a backward followed by the next
        forward is its step."""
        self._step_done()
        self.mark(Phase.ZERO_GRAD)

    def _step_done(self) -> None:
        """An optimizer step (or a hand-written one) ended: its backward passes per step, but no
        more than the batches it took (a GAN's discriminator backpropagates a real and a fake
        loss for one batch)."""
        self.run.steps_done += 1
        fetched = self.loading.batches
        self.run.micro_batches.append(min(self.micro, fetched) if fetched else self.micro)
        self.backwarded, self.micro, self.forwards, self.loading.batches = False, 0, 0, 0

    def optimizer_init(self, real: Callable) -> Callable:
        def __init__(optimizer, *args, **kwargs):
            self.optimizer_made = True
            return real(optimizer, *args, **kwargs)
        return __init__

    def step_pre(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if not any(o is optimizer for o in self.run.optimizers):
            self.run.optimizers.append(optimizer)
            if self.emulate_cuda and versions.has(self.torch, versions.FOREACH_DEFAULT):
                cudaoptim.cuda_optimizer_defaults(optimizer)   # foreach, as on CUDA
        self.mark(Phase.OPTIMIZER)

    def step_post(self, _optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if self.backwarded:
            self._step_done()
        self.mark(Phase.ZERO_GRAD)


def _sequence_first(module: torch.nn.Module) -> bool:
    """Whether the model takes (sequence, batch, ...) inputs: torch's RNNs and Transformer
    layers without batch_first=True (their default), as word_language_model runs them."""
    kinds = (torch.nn.RNNBase, torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
             torch.nn.TransformerDecoderLayer)
    found = [m for m in module.modules() if isinstance(m, kinds)]
    return bool(found) and not any(getattr(m, "batch_first", False) for m in found)


def _label_gradients(rec: Recorder, run: ScriptRun) -> int:
    """Label the gradients the backward left (as labels.label_gradients does for one model)
    and return their bytes."""
    grads = unique_storages(p.grad for p in parameters(run).values() if p.grad is not None)
    for g in grads.values():
        rec.relabel(g, Category.GRADIENTS)
    return sum(g.untyped_storage().nbytes() for g in grads.values())


def parameters(run: ScriptRun) -> dict[int, torch.nn.Parameter]:
    """Every parameter of the modules the script ran and of its optimizers, once."""
    params = {id(p): p for m in run.roots.values() for p in m.parameters()}
    for o in run.optimizers:
        params.update((id(p), p) for g in o.param_groups for p in g["params"])
    return params


def script_frame() -> str:
    """``file:line`` of the innermost frame of the running script's own code (outside torch,
    installed libraries and oomdoctor)."""
    skip = (os.sep + "site-packages" + os.sep, os.sep + "oomdoctor" + os.sep, "<frozen ",
            os.path.dirname(torch.__file__))
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(s in name for s in skip) and not name.startswith("<"):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "its top level"


class Loading:
    """The script's DataLoaders at work: true while one makes a batch (its dataset's transform
    modules run then, on the CPU: not the model's forwards), and the batches taken."""

    def __init__(self) -> None:
        self.depth = self.batches = 0

    def __bool__(self) -> bool:
        return self.depth > 0


@contextlib.contextmanager
def watching_loaders(loading: Loading) -> Iterator[None]:
    """Every DataLoader iterator's ``__next__`` counted into ``loading`` for the block (in
    this process; a worker process makes its batches elsewhere)."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter
    real = _BaseDataLoaderIter.__next__

    def __next__(it):
        loading.batches += 1
        loading.depth += 1
        try:
            return real(it)
        finally:
            loading.depth -= 1
    _BaseDataLoaderIter.__next__ = __next__
    try:
        yield
    finally:
        _BaseDataLoaderIter.__next__ = real


@contextlib.contextmanager
def hooks(phases: Phases) -> Iterator[None]:
    from torch.nn.modules import module as nn_module
    handles = [nn_module.register_module_forward_pre_hook(phases.forward_pre),
               nn_module.register_module_forward_hook(phases.forward_post, always_call=True),
               register_optimizer_step_pre_hook(phases.step_pre),
               register_optimizer_step_post_hook(phases.step_post)]
    real = torch.autograd.backward
    torch.autograd.backward = phases.backward(real)
    init = torch.optim.Optimizer.__init__
    torch.optim.Optimizer.__init__ = phases.optimizer_init(init)
    try:
        with watching_loaders(phases.loading):
            yield
    finally:
        torch.optim.Optimizer.__init__ = init
        torch.autograd.backward = real
        for h in handles:
            h.remove()
