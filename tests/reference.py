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


def real_cpu_peak(path: str, batch_size: int, steps: int = 2) -> int:
    """Peak bytes allocated by a real CPU run of `steps` AdamW (for-loop, the CPU default)
    training steps of the model file, parameters and buffers included."""
    return real_cpu_peak_variant(path, batch_size, steps=steps)


def _profiled_peak(model, run) -> int:
    """Parameters/buffers already allocated plus the peak of the allocator events of `run()`
    (the raw allocator records, name "[memory]" with signed nbytes, not per-op aggregates)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(model.parameters()) + list(model.buffers())}
    base = sum(storages.values())
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return base + peak


def _checkpointed(fn):
    """`fn` run under non-reentrant torch.utils.checkpoint. preserve_rng_state=False: the RNG
    snapshot it would take is a host tensor (torch.get_rng_state() is a CPU ByteTensor, also
    for CUDA), never device memory, and the CPU profiler would otherwise count it."""
    def forward(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                                 preserve_rng_state=False, **kwargs)
    return forward


def real_cpu_peak_variant(path: str, batch_size: int, *, checkpoint: tuple[str, ...] = (),
                          grad_accum: int = 1, steps: int = 2) -> int:
    """Like :func:`real_cpu_peak`, with the training loop changed the way a user would:

    - ``checkpoint``: names of submodules whose forward runs under non-reentrant
      ``torch.utils.checkpoint`` (the caller names the blocks; nothing is searched for);
    - ``grad_accum``: K micro-batches per optimizer step, each ``(loss / K).backward()``,
      then ``step()`` and ``zero_grad(set_to_none=True)``.
    """
    mod = load(path)
    torch.manual_seed(0)
    model = mod.build_model().train()
    for name in checkpoint:
        sub = model.get_submodule(name)
        sub.forward = _checkpointed(sub.forward)
    opt = (mod.make_optimizer(model.parameters()) if hasattr(mod, "make_optimizer")
           else torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4))

    def run():
        for _ in range(steps):
            for _ in range(grad_accum):
                batch = mod.make_batch(batch_size)
                loss = _loss(mod, model, batch)
                if grad_accum > 1:
                    loss = loss / grad_accum
                loss.backward()
                del loss, batch
            opt.step()
            opt.zero_grad(set_to_none=True)
    return _profiled_peak(model, run)
