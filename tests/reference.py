"""Independent reference: a real (non-fake) CPU run of the training loop, measured by torch.profiler.

Written in plain PyTorch, separately from oomdoctor's tracer, so tests compare the simulator with
what the CPU allocator really did: the peak of the profiler's allocator events (``[memory]``
records, bytes allocated/freed by c10's CPU allocator) plus the parameters and buffers that were
allocated before profiling started.
"""
from __future__ import annotations

import gc
import importlib.util

import torch
import torch.utils.checkpoint
from torch.profiler import ProfilerActivity, profile


def load(path):
    spec = importlib.util.spec_from_file_location("ref_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _loss(mod, model, batch):
    if hasattr(mod, "loss_fn"):
        return mod.loss_fn(model, batch)
    out = model(**batch) if isinstance(batch, dict) else (
        model(*batch) if isinstance(batch, (tuple, list)) else model(batch))
    return out if isinstance(out, torch.Tensor) else out.loss


def real_cpu_peak(path: str, batch_size: int, steps: int = 2, opaque: tuple[str, ...] = ()
                  ) -> int:
    """Peak bytes allocated by a real CPU run of `steps` AdamW (for-loop, the CPU default)
    training steps of the model file, parameters and buffers included (``opaque``: see
    :func:`_profiled_peak`)."""
    return real_cpu_peak_variant(path, batch_size, steps=steps, opaque=opaque)


def _profiled_peak(model, run, opaque: tuple[str, ...] = ()) -> int:
    """Parameters/buffers already allocated plus :func:`allocator_peak` of ``run()``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(model.parameters()) + list(model.buffers())}
    return sum(storages.values()) + allocator_peak(run, opaque)


def allocator_peak(run, opaque: tuple[str, ...] = ()) -> int:
    """Peak of the bytes the CPU allocator held during ``run()``, counted from its start: the
    raw allocator records (name "[memory]", signed nbytes), not per-op aggregates.

    ``opaque``: ops (e.g. "aten::convolution_backward") whose private scratch is not counted:
    inside each call the live bytes are capped at the larger of the values before and after
    it, which is all of the call a dispatcher-level view (oomdoctor's trace) can see: its
    inputs and its outputs. The CPU convolution backward allocates a per-thread weight-gradient
    buffer there that the CUDA kernels do not have."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    everything = prof.profiler.kineto_results.events()
    events = sorted((e for e in everything if e.name() == "[memory]"), key=lambda e: e.start_ns())
    calls = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in everything
                   if e.name() in opaque)
    live = peak = 0
    i = 0
    while i < len(events):
        inside = next(((a, b) for a, b in calls if a <= events[i].start_ns() <= b), None)
        if inside is None:
            live += events[i].nbytes()
            peak = max(peak, live)
            i += 1
            continue
        before = live
        while i < len(events) and events[i].start_ns() <= inside[1]:
            live += events[i].nbytes()
            i += 1
        peak = max(peak, before, live)
    return peak


def _checkpointed(fn, context_fn=None):
    """`fn` run under non-reentrant torch.utils.checkpoint (``context_fn``: a selective
    checkpointing policy's contexts, as torch.utils.checkpoint takes them). preserve_rng_state
    =False: the RNG snapshot it would take is a host tensor (torch.get_rng_state() is a CPU
    ByteTensor, also for CUDA), never device memory, and the CPU profiler would otherwise
    count it."""
    selective = {} if context_fn is None else {"context_fn": context_fn}

    def forward(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                                 preserve_rng_state=False, **selective,
                                                 **kwargs)
    return forward


def _cast_floats(batch, dtype):
    """The batch with its float tensors in ``dtype``, as a ``model.half()`` script feeds it."""
    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    if isinstance(batch, dict):
        return {k: cast(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(cast(t) for t in batch)
    return cast(batch)


def real_cpu_peak_variant(path: str, batch_size: int, *, checkpoint: tuple[str, ...] = (),
                          grad_accum: int = 1, steps: int = 2, opaque: tuple[str, ...] = (),
                          pure: torch.dtype | None = None, context_fn=None) -> int:
    """Like :func:`real_cpu_peak`, with the training loop changed the way a user would:

    - ``checkpoint``: names of submodules whose forward runs under non-reentrant
      ``torch.utils.checkpoint`` (the caller names the blocks; nothing is searched for),
      with ``context_fn`` if given (selective checkpointing);
    - ``grad_accum``: K micro-batches per optimizer step, each ``(loss / K).backward()``,
      then ``step()`` and ``zero_grad(set_to_none=True)``;
    - ``pure``: ``model.to(pure)`` before the optimizer is built (``model.half()`` for
      torch.float16) and the batch's float tensors cast to it - no autocast, no GradScaler.
    """
    mod = load(path)
    torch.manual_seed(0)
    model = mod.build_model().train()
    if pure is not None:
        model = model.to(pure)
    for name in checkpoint:
        sub = model.get_submodule(name)
        sub.forward = _checkpointed(sub.forward, context_fn)
    opt = (mod.make_optimizer(model.parameters()) if hasattr(mod, "make_optimizer")
           else torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4))

    def run():
        for _ in range(steps):
            for _ in range(grad_accum):
                batch = mod.make_batch(batch_size)
                if pure is not None:
                    batch = _cast_floats(batch, pure)
                loss = _loss(mod, model, batch)
                if grad_accum > 1:
                    loss = loss / grad_accum
                loss.backward()
                del loss, batch
            opt.step()
            opt.zero_grad(set_to_none=True)
    return _profiled_peak(model, run, opaque)


def real_cpu_script_peak(path: str, args: list[str], steps: int = 2) -> int:
    """Peak bytes the CPU allocator held during a real CPU run of a training script, from
    its start until, after ``steps`` optimizer steps, it starts its next forward or backward
    (where oomdoctor's run of a script stops). The script runs as it is, with no GPU: it
    picks the CPU itself. Everything it allocates counts, its dataset included - scripts
    checked this way keep their data small."""
    import os
    import runpy
    import sys
    # the stop point, shared with the GPU measurements (benchmarks/measure_scripts.py)
    benchmarks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    from measure_scripts import StopRun, stopped_after
    def run() -> None:
        try:
            runpy.run_path(path, run_name="__main__")
        except StopRun:
            pass
    saved = sys.argv
    sys.argv = [path, *args]
    try:
        with stopped_after(steps):
            return allocator_peak(run)
    finally:
        sys.argv = saved
        # The HF Trainer (accelerate's PartialState) sets up a one-process default group on the
        # CPU; stopped mid-run, the script never tears it down, and the smoke tests' forked
        # rank processes would inherit it.
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
