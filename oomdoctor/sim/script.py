"""Trace a user's training script as it is: run it on a fake GPU until it has taken N optimizer
steps, recording every GPU storage it allocates and frees.

    oomdoctor estimate -- python train.py --lr 3e-4

The script runs in this process with ``sys.argv`` set to its arguments, under the fake CUDA device
of :mod:`oomdoctor.sim.fakecuda` and the same recorder, CUDA kernels and values mirror as a model
file's trace (:mod:`oomdoctor.sim.trace`). Its data pipeline (files, tokenizers, collators) runs
for real on the CPU, so batch shapes and padding are its own. Where a model file's loop marks its
phases itself, a script's phases are read from what it calls (:mod:`oomdoctor.sim.script_phases`:
a forward of a module that is not inside another, ``backward()``, ``optimizer.step()``). The run
stops when, after the N-th optimizer step, the script starts its next forward or
backward (so the step's ``zero_grad`` is seen), or when it ends.

Known limits: one process (a ``torchrun`` script's rank 0; its FSDP, DeepSpeed, DataParallel or
split is recorded and replayed per GPU by the planners); tensors made inside C++/CUDA
extensions that bypass the dispatcher are not seen; a value the weights decide
(``loss.item()``) is read as a stand-in (1, or False for a question), so a script that branches
on it (skips a step on a NaN loss) takes the branch a healthy run takes.
"""
from __future__ import annotations

import contextlib
import gc
import os
import runpy
import shlex
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_leaves

from oomdoctor.models import adapters
from oomdoctor.models.script import ScriptSpec
from oomdoctor.models.spec import failed_import, first_line, import_failure, user_frame
from oomdoctor.sim import (cudaoptim, ddp, deepspeed_engine, eager, emulate, fakecuda, sharding,
                          spreading, values)
from oomdoctor.sim.labels import allocator_events, label_activations, label_state
from oomdoctor.sim.libraries import attention_note, traced_versions, weight_dtypes
from oomdoctor.sim.recorder import Category, PhaseMark, Recorder
from oomdoctor.sim.script_phases import (DataExhausted, LoaderSeen, NoStep, Phases,  # noqa: F401
                                         ScriptError, ScriptLimits, ScriptRun, Stop, hooks,
                                         parameters)
from oomdoctor.sim.stepping import every_step, host_state, state_bytes, unique_storages
from oomdoctor.sim.trace import Trace, TraceConfig


@dataclass(frozen=True)
class TrainedModel:
    """The module a script trained, and what its blocks were handed in its first forward
    (positional tensor arguments: a global forward pre-hook sees no keyword ones)."""

    module: torch.nn.Module
    calls: tuple = ()
    sharding: Any = None       # sim.sharding.Sharding: FSDP inside the script (None: none)
    spread: Any = None         # sim.spreading.Spread: one process over several GPUs (None: one)
    output_bytes: int = 0      # its first forward's output tensors, at the run's batch
    deepspeed: dict | None = None  # deepspeed.initialize's config (None: no DeepSpeed)
    # the other modules the script trained (a GAN's discriminator): "Name (N parameters)"
    others: tuple = ()


class ScriptRecorder(Recorder):
    """The recorder of a script's run: only GPU (meta, not host) storages are memory; ops on a
    module's host weights are not; a scalar read of a value the weights decide gets a
    stand-in."""

    def __init__(self, device: fakecuda.Device) -> None:
        super().__init__()
        self.device_only = True
        self.count_flops = True                # the step's FLOPs: its modelled GPU time
        self.device = device
        self.shadows = device.shadows

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dev = self.device
        if dev.quiet or (not dev.uploads and self._on_host(args, kwargs)):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "meta":
                    dev.host.add(t)
            return out
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except Exception:
            if func not in values.SCALAR_READS or not args:
                raise
            dev.reads.scalars += 1
            return False if args[0].dtype == torch.bool else values.placeholder(args[0])
        if dev.uploads and isinstance(out, torch.Tensor) and out.device.type == "meta" \
                and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            self.relabel(out, Category.INPUTS)        # a batch's copy to the GPU
        return out

    def _on_host(self, args: tuple, kwargs: dict | None) -> bool:
        tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        host = self.device.host
        return any(t in host for t in tensors) and all(
            t.device.type == "cpu" or t in host for t in tensors)

    def usage(self) -> tuple[int, int]:
        """(live bytes, peak live bytes) so far: what torch.cuda.memory_allocated answers."""
        live = peak = 0
        for is_alloc, _, n in self.raw:
            live += n if is_alloc else -n
            peak = max(peak, live)
        return live, peak


@contextlib.contextmanager
def _loaders(batch_size: int | None, run: ScriptRun) -> Iterator[None]:
    """Every DataLoader the script makes: in this process (num_workers=0: the workers' memory
    is host memory), with ``batch_size`` when oomdoctor sets it."""
    import inspect
    loader = torch.utils.data.DataLoader
    real = loader.__init__
    signature = inspect.signature(real)

    def init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        asked = (int(bound.arguments.get("num_workers", 0) or 0),
                 bool(bound.arguments.get("pin_memory", False)))
        bound.arguments["num_workers"] = 0
        bound.arguments.pop("prefetch_factor", None)
        bound.arguments.pop("persistent_workers", None)
        if batch_size is not None and bound.arguments.get("batch_size", 1) is not None \
                and bound.arguments.get("batch_sampler") is None:
            bound.arguments["batch_size"] = batch_size
        run.loader_batches.append(bound.arguments.get("batch_size", 1))
        real(*bound.args, **bound.kwargs)
        run.loaders.append(LoaderSeen(self, *asked))
    loader.__init__ = init
    try:
        yield
    finally:
        loader.__init__ = real


def _run_file(script: ScriptSpec, argv: list[str]) -> str:
    """Run the script as ``__main__``; how it ended."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script.path)))
    try:
        runpy.run_path(script.path, run_name="__main__")
        return "script end"
    except Stop:
        return "steps"
    except SystemExit as e:
        if e.code not in (None, 0):
            raise ScriptError(f"{script.name} exited with {e.code!r} before its optimizer "
                              f"steps; run `{script.command()}` to see why") from None
        return "script end"
    except ScriptError:
        raise
    except sharding.UnsupportedParallel as e:
        raise ScriptError(f"{user_frame(e) or script.name}: {e}") from None
    except Exception as e:
        raise ScriptError(_failure(script, e)) from e
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def _failure(script: ScriptSpec, e: BaseException) -> str:
    """One line: where the script failed, what, and the fallback."""
    where = user_frame(e) or script.name
    if isinstance(e, ImportError) and "deepspeed" in str(e).lower():
        return (f"{where}: {type(e).__name__}: {first_line(e)}; install DeepSpeed here to "
                f"estimate the script, or {deepspeed_engine.NOT_FOLLOWED}")
    if failed_import(e):
        # the script runs in oomdoctor's process: its imports must load here
        name = getattr(e, "name", None)
        return str(import_failure(where, f"{name} (imported where oomdoctor runs)" if name
                                  else "an import (where oomdoctor runs)", e))
    return (f"{where}: {type(e).__name__}: {first_line(e)}; the fake GPU could not follow the "
            "script here. If it runs on a GPU, write a model file for it (see `oomdoctor probe "
            "--help`) or stop earlier with --steps 1")


def trace_script(script: ScriptSpec, cfg: TraceConfig, gpu: fakecuda.FakeGpu, *,
                 batch_size: int | None = None, seq_len: int | None = None,
                 limits: ScriptLimits = ScriptLimits(),
                 progress: Callable[[str], None] | None = None) -> Trace:
    """Run ``script`` for ``cfg.steps`` optimizer steps on the fake ``gpu`` and record its GPU
    memory. ``batch_size``: every DataLoader's batch size and the ``{batch}`` placeholder
    (None: the script's own); ``seq_len``: the ``{seq}`` placeholder."""
    argv = script.argv(batch_size, seq_len)
    gc.collect()
    reads = fakecuda.Reads()
    device = fakecuda.Device(gpu, values.Shadows(), reads)
    rec = ScriptRecorder(device)
    gpu.usage = rec.usage
    run = ScriptRun()
    phases = Phases(rec, run, cfg, limits, progress)
    notes: list[str] = []
    with eager.fake_trace([], rec.fused), cudaoptim.fused_optimizers_on_meta(), \
            fakecuda.fake_cuda(device), \
            ddp.rank_zero(script.world, script.environment()) as sharded, \
            spreading.stand_ins() as spread, \
            deepspeed_engine.stand_ins(script.source(), script.args, rec) as engine, \
            _loaders(batch_size, run), \
            (emulate.CudaKernels(cfg.compute_capability, notes, cfg.gpu_arch,
                                 cfg.torch)
             if cfg.emulate_cuda else contextlib.nullcontext()), \
            values.active(device.shadows), rec, \
            every_step(lambda opt: label_state(rec, True, opt)) as stepped, hooks(phases):
        run.ended = _run_file(script, argv)
        run.sharding, run.spread, run.deepspeed = sharded.sharding, spread.spread, engine.config
        rec.closed = True
        held = list(dict.fromkeys([*run.optimizers, *stepped]))
        state = sum(state_bytes(o, lambda k, v, o=o: not host_state(True, o, k, v))
                    for o in held)
    if run.steps_done == 0:
        _raise_if_exhausted(script, run)
        raise NoStep(f"{script.name} ended without an optimizer step; oomdoctor measures "
                     "training steps: check the script trains with these arguments")
    attention = [n for n in map(attention_note, run.roots.values()) if n][:1]
    return _result(script, batch_size, cfg, run, rec, device, phases.marks, state,
                   attention + notes + _run_notes(script, argv, cfg, run, device, batch_size))


def _raise_if_exhausted(script: ScriptSpec, run: ScriptRun) -> None:
    """DataExhausted when a DataLoader the script made has no batch to give."""
    for loader in (seen.loader for seen in run.loaders):
        try:
            if len(loader) > 0:
                continue
            samples = len(loader.dataset)
        except TypeError:              # an iterable dataset: its length is unknown
            continue
        raise DataExhausted(
            f"{script.name}: its DataLoader yields no batch of {loader.batch_size}: the dataset "
            f"holds {samples:,} samples" + (" and drop_last=True drops the partial batch"
                                             if loader.drop_last else "")
            + f"; train with a batch of at most {samples:,}", samples)


def _run_notes(script: ScriptSpec, argv: list[str], cfg: TraceConfig, run: ScriptRun,
               device: fakecuda.Device, batch_size: int | None) -> list[str]:
    launcher = {"accelerate": "accelerate launch"}.get(script.launcher, script.launcher)
    notes = [f"ran {launcher} {shlex.join(argv)} on a fake {device.gpu.name} until "
             + (f"its step {cfg.steps}" if run.ended == "steps" else
                f"it ended, after {run.steps_done} optimizer step(s)")]
    if script.processes > 1:
        notes.append(f"run as rank 0 of the {script.processes} processes {script.launcher} "
                     "starts, one per GPU: every GPU holds what this one does (collectives move "
                     "no data in the simulation)")
    wrapped = [m for m in run.roots.values() if isinstance(m, ddp.ScriptDDP)]
    if wrapped:
        notes.append("DistributedDataParallel: its start-up broadcast and gradient buckets "
                     "allocated as DDP does" + (" (gradient_as_bucket_view: the gradients are "
                                               "the buckets)" if wrapped[0]._view else
                                               "; gradient_as_bucket_view=True drops the "
                                               "second copy of the gradients"))
    if batch_size is not None and run.loader_batches and "batch" not in script.placeholders:
        notes.append(f"every DataLoader's batch_size set to {batch_size}")
    reads = device.reads
    if reads.scalars or reads.copies:
        notes.append(f"{reads.scalars + reads.copies} reads of values the weights decide "
                     "(such as loss.item()) answered with stand-ins; a branch on them takes "
                     "a healthy run's way")
    if reads.saves:
        notes.append(f"{reads.saves} torch.save call(s) of GPU tensors skipped (a checkpoint of "
                     "the fake GPU has no data to write)")
    if device.shadows.answered:
        notes.append(f"{device.shadows.answered} data-dependent questions answered from the "
                     "batch's real values")
    return notes


def _result(script: ScriptSpec, batch_size: int | None, cfg: TraceConfig, run: ScriptRun,
            rec: ScriptRecorder, device: fakecuda.Device,
            marks: list[PhaseMark], state: int, notes: list[str]) -> Trace:
    """The finished trace, labelled as a model file's is."""
    params = parameters(run)
    buffers = [b for m in run.roots.values() for b in m.buffers()]
    _label_model(rec, run)
    label_activations(rec, marks)
    on_gpu = [p for p in params.values() if rec.handle_of(p) is not None]
    weights = unique_storages(on_gpu)
    trainable = unique_storages(p for p in on_gpu if p.requires_grad)
    buf = unique_storages(b for b in buffers if rec.handle_of(b) is not None
                          and b.untyped_storage()._cdata not in weights)
    return Trace(
        config=replace(cfg, batch_size=(batch_size if batch_size is not None
                                        and "batch" in script.placeholders
                                        else _batch_size(run)),
                       precision=_precision(device, on_gpu),
                       grad_accum=run.micro_batches[0] if run.micro_batches else 1),
        events=allocator_events(rec), storages=rec.storages, marks=tuple(marks),
        parameter_bytes=sum(t.untyped_storage().nbytes() for t in weights.values()),
        trainable_parameter_bytes=sum(t.untyped_storage().nbytes() for t in trainable.values()),
        num_parameters=sum(adapters.logical_numel(p) for p in on_gpu),
        num_trainable_parameters=sum(p.numel() for p in on_gpu if p.requires_grad),
        buffer_bytes=sum(t.untyped_storage().nbytes() for t in buf.values()),
        gradient_bytes=run.gradient_bytes, optimizer_state_bytes=state, checkpointed=(),
        notes=tuple(dict.fromkeys(notes)), raw_events=tuple(rec.raw),
        batch_from=("placeholder" if "batch" in script.placeholders else
                    "dataloader" if batch_size is not None and run.loader_batches else "script"),
        libraries=traced_versions(next(iter(run.roots.values()), None),
                                  run.optimizers[0] if run.optimizers else None),
        processes=script.world, weight_dtypes=weight_dtypes(on_gpu),
        flops=rec.flops // max(run.steps_done, 1), module_flops=tuple(rec.module_flops.items()),
        loaders=tuple(run.loaders),
        model=_trained(run),
        syncs_per_step=(device.reads.scalars + device.reads.copies) / max(run.steps_done, 1),
        autocast=("bfloat16" if torch.bfloat16 in device.autocast else "float16"
                  if device.autocast else ""))


def _trained(run: ScriptRun) -> TrainedModel | None:
    """The root with the most parameters: the model the script trains (a loss module is a root
    too)."""
    root = max(run.roots.values(), key=lambda m: sum(p.numel() for p in m.parameters()),
               default=None)
    if root is None:
        return None
    inside = {id(m) for m in root.modules()}       # a part of it called on its own is not another
    others = tuple(f"{type(m).__name__} ({sum(p.numel() for p in m.parameters()):,} parameters)"
                   for m in run.roots.values()
                   if id(m) not in inside and any(p.requires_grad for p in m.parameters()))
    return TrainedModel(root, tuple(run.calls.get(id(root), ())), run.sharding, run.spread,
                        run.output_bytes, run.deepspeed, others)


def _batch_size(run: ScriptRun) -> int:
    """The batch size to report: the first DataLoader's (the training one, as a rule), else the
    first forward's leading dimension."""
    sizes = [b for b in run.loader_batches if isinstance(b, int) and b > 0]
    return sizes[0] if sizes else run.forward_batch or 1


def _precision(device: fakecuda.Device, params: list[torch.Tensor]) -> str:
    """What the script trains in, as oomdoctor names it: autocast's dtype, else the weights'."""
    if device.autocast:
        return "bf16" if torch.bfloat16 in device.autocast else "fp16"
    dtypes = {p.dtype for p in params if p.requires_grad}
    return {frozenset({torch.bfloat16}): "bf16-pure",
            frozenset({torch.float16}): "fp16-pure"}.get(frozenset(dtypes), "fp32")


def _label_model(rec: Recorder, run: ScriptRun) -> None:
    """Parameters and buffers of every module the script ran, by name."""
    for root in run.roots.values():
        for name, p in root.named_parameters():
            rec.relabel(p, Category.PARAMETERS, name=name)
        for name, b in root.named_buffers():
            rec.relabel(b, Category.BUFFERS, name=name)
        # bitsandbytes' quantization statistics: buffers in effect, as the layout counts them
        for name, t in adapters.named_quant_states(root):
            if rec.handle_of(t) is not None:
                rec.relabel(t, Category.BUFFERS, name=name)


