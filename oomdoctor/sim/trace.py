"""Trace training steps on fake CPU tensors and record every storage allocation and free.

    python -c "from oomdoctor.models.loader import load_model_file; from oomdoctor.sim.trace import *; \
print(trace_training(load_model_file('sample_models/tiny_mlp.py'), TraceConfig(8)).peak_live_bytes)"

The trace runs the model file's real training step - forward, loss, backward,
``optimizer.step()``, ``zero_grad(set_to_none=True)`` - for two optimizer steps under
``FakeTensorMode``: every tensor has the right shape and dtype but no data, so a 7B model traces
on a laptop. A ``TorchDispatchMode`` (:mod:`oomdoctor.sim.recorder`) sits above the fake mode
and sees every ATen op, in eager order, after autograd and composite ops have been decomposed -
the same ops a CUDA or CPU eager run executes. Each op's freshly allocated outputs (outputs
without alias information in the op schema) are new storages; a weakref finalizer on each storage
records its free, which CPython runs the moment the last reference dies, exactly when the caching
allocator would get the block back. The result is an ordered list of (alloc | free, handle,
bytes) events that :mod:`oomdoctor.sim.allocator` replays, plus what each storage was (parameter,
gradient, ...), when (phase, iteration) and where (module).

Known limitations:
- Memory a kernel allocates internally is no ATen output: :mod:`oomdoctor.plans.estimate` adds
  the BLAS and cuDNN convolution workspaces and reductions' scratch; CPU oneDNN scratch and
  tensors of C++/CUDA extensions that bypass the dispatcher are not seen. One stream.
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from oomdoctor.models import adapters
from oomdoctor.sim import cudaoptim, emulate, repeat, rnn, values, versions, zero3
# Category, Phase and PhaseMark are the plans' too: they import them from here.
from oomdoctor.sim.recorder import (Category, Phase, PhaseMark, Recorder, Storage, in_phase,
                                    module_hooks)
from oomdoctor.sim.stepping import (compile_notes, every_step, foreach_adam_before_2_1,
                                    foreach_measured, host_state, state_bytes, step_notes,
                                    unique_storages)
from oomdoctor.sim.eager import fake_trace
from oomdoctor.sim.labels import (allocator_events, label_activations, label_gradients,
                                  label_state)
from oomdoctor.sim.libraries import attention_note, traced_versions, weight_dtypes, weights_note
from oomdoctor.sim.unroll import UnrollError
from oomdoctor.sim.versions import TorchVersion
from oomdoctor.models.spec import DataDependentError, ModelFileError, ModelSpec
from oomdoctor.models.training import (build_for_training, compute_loss, make_configured_batch,
                                       make_configured_optimizer)
from oomdoctor.configs import (CHECKPOINT_POLICIES, PRECISIONS,  # noqa: F401  (re-exported)
                               TRACE_PRECISIONS, ZERO_GRAD_MODES)


@dataclass(frozen=True)
class TraceConfig:
    """One training configuration to trace."""

    batch_size: int
    precision: str = "fp32"  # fp32 | fp16 (AMP + GradScaler) | bf16 (AMP) | bf16-pure | fp16-pure
    checkpointing: bool = False        # wrap repeated blocks in torch.utils.checkpoint
    checkpoint_class: str | None = None  # which block class; default: the most repeated one
    grad_accum: int = 1                # micro-batches per optimizer step
    optimizer: str | None = None       # override the file's optimizer: adamw, adam, sgd, ...
    emulate_cuda: bool = True          # apply what CUDA does differently (see emulate.py)
    compute_capability: tuple[int, int] = (8, 6)  # picks the SDPA kernel CUDA would use
    gpu_arch: str = ""                 # an AMD target (gfx90a): ROCm's kernels instead of CUDA's
    steps: int = 2                     # optimizer steps traced (>= 2: the second has state)
    zero_grad: str = "after-step"      # when gradients go: see ZERO_GRAD_MODES
    torch: TorchVersion | None = None  # whose CUDA facts (sim.versions); None: the installed
    # with checkpointing: wrap every N-th block (torchtitan's selective_ac_option "N"), and
    # recompute the whole block ("full") or per op ("op", torchtitan's policy); see
    # oomdoctor.models.checkpointing
    checkpoint_every: int = 1
    checkpoint_policy: str = "full"
    zero3_hooks: bool = False          # DeepSpeed ZeRO-3's module hooks, F.linear (sim.zero3)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if self.precision not in TRACE_PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of "
                             f"{', '.join(PRECISIONS)}")
        if self.grad_accum < 1:
            raise ValueError(f"--grad-accum must be >= 1, got {self.grad_accum}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.zero_grad not in ZERO_GRAD_MODES:
            raise ValueError(f"unknown zero_grad mode {self.zero_grad!r}; choose one of "
                             f"{', '.join(ZERO_GRAD_MODES)}")
        if self.checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            raise ValueError(f"unknown checkpoint policy {self.checkpoint_policy!r}; choose "
                             f"one of {', '.join(CHECKPOINT_POLICIES)}")


@dataclass(frozen=True)
class Trace:
    """Everything the estimator needs from one traced configuration."""

    config: TraceConfig
    events: tuple[tuple[bool, int, int], ...]  # (is_alloc, handle, nbytes) in order
    storages: dict[int, Storage]
    marks: tuple[PhaseMark, ...]
    parameter_bytes: int
    trainable_parameter_bytes: int
    num_parameters: int
    num_trainable_parameters: int
    buffer_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    checkpointed: tuple[str, ...]
    notes: tuple[str, ...]
    flops: int = 0                     # a script's: forward + backward FLOPs per optimizer step
    module_flops: tuple[tuple[str, int], ...] = ()   # a script's forward FLOPs by module label
    raw_events: tuple[tuple[bool, int, int], ...] = ()  # events incl. host-side storages
    libraries: tuple[tuple[str, str], ...] = ()   # (name, version) traced (sim.libraries)
    batch_from: str = ""   # a script's batch: "dataloader" (set), "placeholder", "script" (its own)
    foreach_notes: tuple[str, ...] = ()  # the notes foreach_measured measures (sim.repeat)
    # What the step ran, as the report states it: processes it is one of (a launched script's
    # rank 0), autocast's dtype ("" without autocast), the weights' dtypes (trainable, frozen)
    processes: int = 1
    autocast: str = ""
    weight_dtypes: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    # A script's DataLoaders as it made them (sim.script.LoaderSeen), for the input-pipeline
    # check to run again, and its model (the planners lay it out); not part of what it is
    loaders: tuple = field(default=(), compare=False, repr=False)
    model: object = field(default=None, compare=False, repr=False)
    # A script's reads of GPU values per step (loss.item(), .cpu()): each makes the host wait
    # for the GPU, so loading the next batch cannot overlap the step
    syncs_per_step: float = 0.0

    def phase_at(self, index: int) -> PhaseMark:
        """The phase an event index falls in."""
        found = self.marks[0]
        for mark in self.marks:
            if mark.start > index:
                break
            found = mark
        return found

    def live_at(self, index: int) -> list[Storage]:
        """Storages alive just after event ``index``."""
        return [s for s in self.storages.values()
                if s.t_alloc <= index and (s.t_free is None or s.t_free > index) and not s.host]

    @property
    def peak_live(self) -> tuple[int, int]:
        """(bytes, event index) of the peak of live bytes, before any allocator rounding."""
        live = peak = 0
        at = 0
        for i, (is_alloc, _, nbytes) in enumerate(self.events):
            live += nbytes if is_alloc else -nbytes
            if live > peak:
                peak, at = live, i
        return peak, at

    @property
    def peak_live_bytes(self) -> int:
        return self.peak_live[0]


def _optimizer_step(optimizer: torch.optim.Optimizer,
                    scaler: cudaoptim.GradScalerEmulation | None, cfg: TraceConfig) -> bool:
    """The loop's step() (stepping.every_step gives it host counters and labels its state);
    whether it found any gradient to apply."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    found = any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
    old_adam = cfg.emulate_cuda and not versions.has(cfg.torch,
                                                     versions.FOREACH_ADAM_ONE_INTERMEDIATE)
    with cudaoptim.paged_optimizers_on_meta(optimizer), foreach_adam_before_2_1(optimizer,
                                                                                old_adam):
        optimizer.step()
    return found


class SpliceMismatch(Exception):
    """The optimizer phase of another trace does not line up with this one."""


def _splice_optimizer(rec: Recorder, ref: Trace, marks: list[PhaseMark], virtual: set[int]
                      ) -> None:
    """Copy the reference trace's events for the optimizer phase now starting.

    ``optimizer.step()`` touches parameters, gradients and its state - never activations - so
    its allocations are the same at every batch size; the probe traces it once and splices it
    into the traces at other batch sizes (a third of a trace's time). It only lines up when
    everything before it did: same number of events, same next handle."""
    mark = marks[-1]
    i = ref.marks.index(mark) if mark in ref.marks else -1
    if i < 0 or len(rec.raw) != mark.start:
        raise SpliceMismatch("phase start differs")
    stop = ref.marks[i + 1].start if i + 1 < len(ref.marks) else len(ref.raw_events)
    for is_alloc, handle, nbytes in ref.raw_events[mark.start:stop]:
        if is_alloc:
            if handle != rec._next:
                raise SpliceMismatch("handle numbering differs")
            src = ref.storages[handle]
            rec.storages[handle] = Storage(handle, nbytes, src.category, src.phase,
                                           src.iteration, src.module, src.op, len(rec.raw),
                                           host=src.host, name=src.name)
            rec._next += 1
            virtual.add(handle)
        else:
            if handle not in virtual:
                raise SpliceMismatch("the optimizer freed a storage made outside it")
            virtual.discard(handle)
            rec.storages[handle].t_free = len(rec.raw)
        rec.raw.append((is_alloc, handle, nbytes))


def trace_training(spec: ModelSpec, cfg: TraceConfig, *, fake: bool = True,
                   optimizer_from: Trace | None = None, backend: str = "auto",
                   progress: Callable[[str], None] | None = None,
                   min_blocks: int | None = repeat.MIN_BLOCKS) -> Trace:
    """Run ``cfg.steps`` optimizer steps of the model file's training loop and record memory
    (see :func:`_trace_training`).

    When the step asks a question about tensor values (transformers: does the attention mask
    have padding?), the trace is run once more with the batch's real values mirrored next to
    it (:mod:`oomdoctor.sim.values`), so the question gets the answer the real batch gives on the
    GPU. Models that ask nothing pay nothing.

    ``progress(message)``, if given, hears "step 1/2: backward" at each phase of the loop (a
    long trace - a big model, an RNN's per-timestep loop - can then say where it is).

    A model with a deep stack of identical blocks (``min_blocks`` or more; None: never) is
    traced with the stack cut to 2, 3 and 4 blocks and unrolled (:mod:`oomdoctor.sim.repeat`),
    on the meta backend; where the cut traces do not extend exactly, it is traced in full.
    """
    if min_blocks is not None and fake and backend == "auto" and cfg.emulate_cuda:
        stack = repeat.Stack(min_blocks)
        try:
            traces = _cut_traces(spec, cfg, fake, optimizer_from, backend, progress, stack)
            return traces if isinstance(traces, Trace) else replace(traces[-1],
                                                                    **stack.full(traces))
        except UnrollError:
            pass
        except Exception:
            if stack.path is None:
                raise             # the full trace itself failed
            # The model does not run with its stack cut (it indexes its blocks up to a count
            # from its config, or checks their number): trace it whole.
    return _trace_values(spec, cfg, fake, optimizer_from, backend, progress, None)


def _cut_traces(spec: ModelSpec, cfg: TraceConfig, fake: bool, optimizer_from: Trace | None,
                backend: str, progress: Callable[[str], None] | None, stack: repeat.Stack
                ) -> "Trace | list[Trace]":
    """The traces with the stack cut to 2, 3 and 4 blocks; the full trace (the first one) when
    the model has no deep stack."""
    traces: list[Trace] = []
    for k in repeat.CUTS:
        try:    # the first may be the full trace (no deep stack): the probe's splice too
            traces.append(_trace_values(spec, cfg, fake, None if traces else optimizer_from,
                                        backend, progress, stack.cut(k)))
        except SpliceMismatch:
            if stack.path is None:
                raise
            # a cut stack's optimizer phase is not the full model's: run its own
            traces.append(_trace_values(spec, cfg, fake, None, backend, progress,
                                        stack.cut(k)))
        if stack.path is None:
            return traces[0]          # no deep stack: that was the full trace
    return traces


def _trace_values(spec: ModelSpec, cfg: TraceConfig, fake: bool, optimizer_from: Trace | None,
                  backend: str, progress: Callable[[str], None] | None, builder) -> Trace:
    """One trace; again with the batch's real values mirrored if the step asks about them."""
    if spec.make_batch not in _ASKS_ABOUT_VALUES:
        try:
            return _trace_training(spec, cfg, fake=fake, optimizer_from=optimizer_from,
                                   backend=backend, shadows=False, progress=progress,
                                   builder=builder)
        except DataDependentError:
            if not fake:
                raise
        _ASKS_ABOUT_VALUES.add(spec.make_batch)     # the probe's next traces start with values
        if progress is not None:
            progress("the step asked about tensor values: tracing again with the batch's "
                     "real values")
    return _trace_training(spec, cfg, fake=fake, optimizer_from=optimizer_from,
                           backend=backend, shadows=True, progress=progress, builder=builder)


# Model files whose step asked a data-dependent question (keyed by their make_batch): later
# traces of the same model mirror the batch's values from the start.
_ASKS_ABOUT_VALUES: "weakref.WeakSet" = weakref.WeakSet()


def _collect() -> None:
    """gc.collect(), then freeze the survivors (libraries, spec, kept traces): scanned once, not
    at every trace (each full collection took 0.25 s with transformers loaded). Later garbage is
    still collected; what a freeze saw is freed by reference counts only."""
    gc.collect()
    gc.freeze()


def _trace_training(spec: ModelSpec, cfg: TraceConfig, *, fake: bool,
                    optimizer_from: Trace | None, backend: str, shadows: bool,
                    progress: Callable[[str], None] | None = None, builder=None) -> Trace:
    """Run ``cfg.steps`` optimizer steps of the model file's training loop and record memory.

    With ``fake=False`` the same loop runs on real CPU tensors (slow; for checks and smoke runs).
    ``optimizer_from``: take the optimizer steps' events from this trace of the same
    configuration at another batch size instead of running ``step()`` (raises
    :class:`SpliceMismatch` when the two traces do not line up).
    ``backend``: "auto" (meta with the CUDA emulation, fake CPU tensors without), or force
    "meta" / "fake" (the tests compare the two).
    """
    fake_mode = _fake_mode(cfg, fake, backend)
    # Cyclic garbage would otherwise be freed whenever the collector happens to run; collect
    # first so the trace starts clean and frees stay tied to reference counts.
    _collect()
    torch.manual_seed(0)
    on_meta = isinstance(fake_mode, torch.device)
    compiled: list[tuple[str, str]] = []
    recorders: list[Recorder] = []          # compiled step functions report to the recorder

    def fused():
        return recorders[0].fused() if recorders else contextlib.nullcontext()
    with fake_mode, (fake_trace(compiled, fused) if fake else contextlib.nullcontext()), \
            (cudaoptim.fused_optimizers_on_meta() if on_meta else contextlib.nullcontext()):
        notes: list[str] = []
        model, checkpointed, optimizer, defaults = _build(spec, cfg, fake, notes, builder)
        scaler = cudaoptim.GradScalerEmulation() if cfg.precision == "fp16" else None
        rec = Recorder()
        recorders.append(rec)
        rec.progress, rec.steps = progress, cfg.steps
        if shadows:
            rec.shadows = values.Shadows()
        loop = _Loop(spec, cfg, model, optimizer, scaler, rec, optimizer_from)
        model_state = _record_model_state(loop)
        held = _run_steps(loop, notes)
        state = _optimizer_state_bytes(loop, held)
        rec.closed = True
        notes = _loop_notes(loop, notes, defaults, compiled, held)
    return _result(loop, model_state, checkpointed, state, notes, defaults)


def _fake_mode(cfg: TraceConfig, fake: bool, backend: str) -> contextlib.AbstractContextManager:
    """What the trace's tensors are: the meta device, fake CPU tensors, or real ones."""
    # With the CUDA emulation the trace runs on the meta device: it is about 40% faster than
    # FakeTensorMode, and its kernels' output dtypes are CUDA's (layer/batch-norm statistics
    # in fp32 for 16-bit inputs, where the CPU keeps them 16-bit). Without the emulation the
    # trace must follow the CPU's own kernel choices (tests compare it with a real CPU run),
    # so it uses fake CPU tensors. tests/test_trace.py checks the two agree where CPU and
    # CUDA do.
    if backend not in ("auto", "meta", "fake"):
        raise ValueError(f"unknown trace backend {backend!r}")
    if not fake:
        return contextlib.nullcontext()
    if backend == "meta" or (backend == "auto" and cfg.emulate_cuda):
        return torch.device("meta")
    return FakeTensorMode()


def _build(spec: ModelSpec, cfg: TraceConfig, fake: bool, notes: list[str], builder=None
           ) -> tuple[torch.nn.Module, tuple[str, ...], torch.optim.Optimizer, list[str]]:
    """The model as ``.cuda()`` leaves it, the checkpointed blocks and the optimizer; the notes
    on CUDA's optimizer defaults (added to ``notes``, kept only if the loop steps).
    ``builder(build, notes)``: a repeat.Stack's, which builds once and cuts the stack."""
    def build() -> tuple[torch.nn.Module, tuple[str, ...]]:
        model, checkpointed = build_for_training(spec, cfg.precision, cfg.checkpointing,
                                                 cfg.checkpoint_class,
                                                 preserve_rng_state=not fake, notes=notes,
                                                 checkpoint_every=cfg.checkpoint_every,
                                                 checkpoint_policy=cfg.checkpoint_policy)
        if cfg.emulate_cuda and rnn.flatten_parameters(model):
            # .cuda() flattens RNN weights into cuDNN's one buffer (RNNBase.flatten_parameters)
            notes.append("RNN weights in one flat cuDNN buffer, as .cuda() leaves them")
        if checkpointed:
            notes.append(f"checkpointing {len(checkpointed)} blocks of class " + ",".join(
                dict.fromkeys(type(model.get_submodule(n)).__name__ for n in checkpointed)))
        return model, checkpointed
    model, checkpointed = build() if builder is None else builder(build, notes)
    # Optimizers that create state in __init__ (Adagrad) make host-side counters there too.
    with torch.device("cpu"):
        optimizer = make_configured_optimizer(spec, model, cfg.optimizer)
    foreach = cfg.emulate_cuda and versions.has(cfg.torch, versions.FOREACH_DEFAULT)
    defaults = cudaoptim.cuda_optimizer_defaults(optimizer) if foreach else []
    notes += defaults
    return model, checkpointed, optimizer, defaults


@dataclass
class _Loop:
    """One traced training loop: what its phases share and what they found. The trace keeps it
    to the end, so nothing it holds (model, optimizer, the scaler's tensors) is freed - and
    recorded as freed - before the recorder is closed."""

    spec: ModelSpec
    cfg: TraceConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: cudaoptim.GradScalerEmulation | None
    rec: Recorder
    optimizer_from: Trace | None        # splice the optimizer phases from this trace
    marks: list[PhaseMark] = field(default_factory=list)
    virtual: set[int] = field(default_factory=set)    # spliced storages not yet freed
    kernels: emulate.CudaKernels | None = None
    stepped: bool = False       # whether the loop's optimizer ever had a gradient to apply
    # Gradient bytes as held after the last backward (none for an optimizer stepped in
    # backward: its hooks free each gradient at once).
    gradient_bytes: int = 0
    # spec.keep_outputs: the model's output of each forward (a root forward hook) and the
    # last micro-batch's (outputs, loss), held until the next forward returns
    outputs: list = field(default_factory=list)
    kept: tuple = ()
    kept_bytes: int = 0         # the most that rebinding them ever freed


def _record_model_state(loop: _Loop) -> tuple[dict[int, torch.Tensor], ...]:
    """Record parameters and buffers as the setup phase's allocations; returns (parameters,
    buffers, trainable parameters), one tensor per storage."""
    rec, model = loop.rec, loop.model
    params = unique_storages(model.parameters())
    # bitsandbytes' quantization statistics are held like buffers (adapters.quant_states).
    buffers = unique_storages(b for b in (*model.buffers(), *adapters.quant_states(model))
                              if b.untyped_storage()._cdata not in params)
    trainable = unique_storages(p for p in model.parameters() if p.requires_grad)
    names = {t.untyped_storage()._cdata: n for n, t in (*model.named_buffers(),
                                                       *model.named_parameters())}
    with in_phase(rec, loop.marks, Phase.SETUP, 0, 0):
        for group, category, op in ((params, Category.PARAMETERS, "parameter"),
                                    (buffers, Category.BUFFERS, "buffer")):
            for key, t in group.items():
                h = rec.add(t.untyped_storage(), category, op)
                rec.storages[h].name = names.get(key, "")
    return params, buffers, trainable


def _run_steps(loop: _Loop, notes: list[str]) -> list[torch.optim.Optimizer]:
    """Run ``cfg.steps`` optimizer steps under the recorder, module hooks naming where each
    storage is made; the optimizers holding state: the loop's, then any stepped in backward."""
    cfg, rec = loop.cfg, loop.rec
    hooks = module_hooks(loop.model, rec)
    if loop.spec.keep_outputs and loop.spec.loss_fn is None:
        # the model's own output is the loop's `outputs` (a loss_fn's locals die with it)
        hooks.append(loop.model.register_forward_hook(lambda _m, _a, o: loop.outputs.append(o)))
    loop.kernels = (emulate.CudaKernels(cfg.compute_capability, notes, cfg.gpu_arch,
                                        cfg.torch)
                    if cfg.emulate_cuda else None)
    try:
        with rec, values.active(rec.shadows), \
                zero3.applied(loop.model, cfg.zero3_hooks, rec), \
                (emulate.autocast_on_meta() if cfg.emulate_cuda else contextlib.nullcontext()), \
                every_step(lambda opt: label_state(rec, cfg.emulate_cuda, opt)) as stepped:
            if loop.scaler is not None:
                loop.scaler.setup()
            for it in range(cfg.steps):
                _step(loop, it)
    finally:
        for h in hooks:
            h.remove()
    # Optimizers stepped inside backward hooks (optimizer-in-backward) hold state too.
    return [loop.optimizer] + [o for o in stepped if o is not loop.optimizer]


def _step(loop: _Loop, it: int) -> None:
    """One optimizer step: its micro-batches, ``step()`` (or the spliced events), zero_grad."""
    rec, marks, cfg = loop.rec, loop.marks, loop.cfg
    for micro in range(min(cfg.grad_accum, 2)):   # micro-batches 2..K repeat micro-batch 2
        _micro_batch(loop, it, micro)
    with in_phase(rec, marks, Phase.OPTIMIZER, it, 0):
        if loop.optimizer_from is not None:
            _splice_optimizer(rec, loop.optimizer_from, marks, loop.virtual)
        else:
            loop.stepped |= _optimizer_step(loop.optimizer, loop.scaler, cfg)
    with in_phase(rec, marks, Phase.ZERO_GRAD, it, 0):
        if cfg.zero_grad == "after-step":
            loop.optimizer.zero_grad(set_to_none=True)
        elif cfg.zero_grad == "in-place":
            # zero_grad(set_to_none=False), the default before torch 2.0:
            # gradients are zeroed and kept, so they exist during every forward.
            loop.optimizer.zero_grad(set_to_none=False)


def _micro_batch(loop: _Loop, it: int, micro: int) -> None:
    """One micro-batch: its data, forward and loss, backward."""
    spec, cfg, rec, marks = loop.spec, loop.cfg, loop.rec, loop.marks
    with in_phase(rec, marks, Phase.DATA, it, micro):
        batch = make_configured_batch(spec, cfg.batch_size, cfg.precision)
        if rec.shadows is not None:
            rec.shadows.attach(batch, values.real_batch(
                lambda: make_configured_batch(spec, cfg.batch_size, cfg.precision)))
    with in_phase(rec, marks, Phase.FORWARD, it, micro):
        loss = _forward(loop, batch, micro)
        if spec.keep_outputs:
            _keep_outputs(loop, loss)
    with in_phase(rec, marks, Phase.BACKWARD, it, micro):
        try:
            loss.backward()
        except RuntimeError as e:
            raise ModelFileError(
                f"{spec.path}: loss.backward() failed: {e}; check that "
                "the loss depends on trainable parameters") from e
        del loss, batch
        loop.gradient_bytes = label_gradients(rec, loop.model)


def _keep_outputs(loop: _Loop, loss: torch.Tensor) -> None:
    """``outputs = model(**batch); loss = outputs.loss`` with no ``del``: the names are rebound
    only once this forward has returned, so the previous micro-batch's outputs (logits, a
    decoder's key/value cache) and loss lived through it; they are freed now."""
    start = len(loop.rec.raw)
    loop.kept = (loop.outputs[-1] if loop.outputs else None, loss)
    loop.outputs.clear()
    freed = sum(n for is_alloc, _, n in loop.rec.raw[start:] if not is_alloc)
    loop.kept_bytes = max(loop.kept_bytes, freed)


def _forward(loop: _Loop, batch, micro: int) -> torch.Tensor:
    """Forward and loss under CUDA's kernels and autocast; the loss the backward starts from."""
    cfg = loop.cfg
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.precision)
    with contextlib.ExitStack() as stack:
        if loop.kernels is not None:
            stack.enter_context(loop.kernels)
        if amp_dtype is not None:
            stack.enter_context(emulate.CudaAutocast(amp_dtype))
        loss = compute_loss(loop.spec, loop.model, batch)
    if cfg.grad_accum > 1:
        loss = loss / cfg.grad_accum
    if loop.scaler is not None:
        loss = loop.scaler.scale(loss)
    if cfg.zero_grad == "after-forward" and micro == 0:
        # forward, zero_grad(), backward, step: last step's gradients
        # stay alive through this forward.
        loop.optimizer.zero_grad(set_to_none=True)
    return loss


def _optimizer_state_bytes(loop: _Loop, held: list[torch.optim.Optimizer]) -> int:
    """The optimizers' state after the last step (the loop's own from ``optimizer_from`` when
    its steps were spliced), host-side counters left out."""
    ref, cfg = loop.optimizer_from, loop.cfg
    return (ref.optimizer_state_bytes if ref is not None else 0) + sum(
        state_bytes(o, lambda k, v, o=o: not host_state(cfg.emulate_cuda, o, k, v))
        for o in held if ref is None or o is not loop.optimizer)


def _loop_notes(loop: _Loop, notes: list[str], defaults: list[str],
                compiled: list[tuple[str, str]], held: list[torch.optim.Optimizer]
                ) -> list[str]:
    """``notes`` with what the loop showed: compiled code, how the optimizers stepped, scalar
    reads taken as 1, questions answered from the batch's real values."""
    optimizer, rec = loop.optimizer, loop.rec
    notes += compile_notes(optimizer, compiled)
    if not loop.stepped and loop.optimizer_from is None:
        notes = [n for n in notes if n not in defaults]    # foreach: only if it steps
    notes += step_notes(optimizer, held)
    if rec.placeholders:
        notes.append(f"{type(optimizer).__name__}: {rec.placeholders} scalar reads of "
                     "tensor values in step() (such as update norms) taken as 1; they "
                     "scale the update, not its memory")
    if loop.spec.keep_outputs:
        notes.append(f"outputs kept (--keep-outputs / KEEP_OUTPUTS): the previous step's "
                     f"outputs and loss, {loop.kept_bytes / 2**20:.1f} MiB, stay alive through "
                     "the next forward; `del outputs, loss` after backward frees them")
    if rec.shadows is not None and rec.shadows.answered:
        notes.append(f"{rec.shadows.answered} data-dependent questions (such as whether "
                     "the attention mask has padding) answered from the batch's real "
                     "values, as on the GPU")
    return notes


def _result(loop: _Loop, model_state: tuple[dict[int, torch.Tensor], ...],
            checkpointed: tuple[str, ...], state: int, notes: list[str], defaults: list[str]
            ) -> Trace:
    """The finished trace: storages categorised, host-side ones as 0-byte events, the foreach
    notes checked against what the optimizer phases allocated."""
    rec, marks, model = loop.rec, loop.marks, loop.model
    params, buffers, trainable = model_state
    ends = label_activations(rec, marks)
    events = allocator_events(rec)
    param_bytes = sum(t.untyped_storage().nbytes() for t in params.values())
    steps = [(m.start, ends[m.start]) for m in marks     # a phase at the very end is empty
             if m.phase is Phase.OPTIMIZER and m.start < len(ends)]
    notes = foreach_measured(notes, defaults, steps, events, param_bytes,  # as traced
                             lambda h: rec.storages[h].category is Category.TEMPORARIES)
    said = [n for n in (weights_note(model), attention_note(model)) if n]
    notes = [*said, *notes]
    return Trace(
        config=loop.cfg, events=events, storages=rec.storages, marks=tuple(marks),
        parameter_bytes=param_bytes,
        trainable_parameter_bytes=sum(t.untyped_storage().nbytes() for t in trainable.values()),
        # Counted per parameter, not per storage: an RNN's parameters share one flat buffer.
        num_parameters=sum(adapters.logical_numel(p) for p in model.parameters()),
        num_trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        buffer_bytes=sum(t.untyped_storage().nbytes() for t in buffers.values()),
        gradient_bytes=loop.gradient_bytes, optimizer_state_bytes=state,
        checkpointed=checkpointed, notes=tuple(dict.fromkeys(notes)),
        raw_events=tuple(rec.raw), libraries=traced_versions(model, loop.optimizer),
        foreach_notes=tuple(defaults),
        autocast={"fp16": "float16", "bf16": "bfloat16"}.get(loop.cfg.precision, ""),
        weight_dtypes=weight_dtypes(model.parameters()))
