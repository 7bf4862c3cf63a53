"""The measured harness's model construction on the device, for calibration.

The simulator places the model as ``.cuda()`` leaves a model built on the host: its SETUP
phase holds only the final parameters (oomdoctor/sim/trace.py _record_model_state). The
real-GPU harness that wrote benchmarks/results (oomdoctor/runs/measure.py ``_train``) builds
the model under ``with dev:`` instead, so every ``torch.empty`` of ``nn.Module.__init__`` is a
CUDA allocation counted by ``max_memory_allocated``: the fp32 weights as the constructors make
them, a tied weight's first copy until the tie drops it (``self.wte.weight =
self.lm_head.weight``), and, for a pure precision, the fp32 weights next to their 16-bit copies
while ``to_dtype`` casts them one by one (oomdoctor/models/casting.py). Where training peaks
lower than that - pure bf16 LoRA at batch 1: 81.7M weights, 459 MiB in fp32 with the untied
embedding, against 155.8 MiB in bf16 - the measured peak is the construction's.

:func:`harness_peaks` replays the construction's allocations and frees (recorded on the meta
device) through the allocator model ahead of the training step's, the final weights kept as
the very blocks construction left them in, as on the GPU.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from oomdoctor.models.spec import ModelSpec
from oomdoctor.models.training import build_for_training
from oomdoctor.sim.allocator import AllocatorConfig, replay
from oomdoctor.sim.recorder import Category, Recorder
from oomdoctor.sim.stepping import unique_storages


def construction_events(spec: ModelSpec, cfg) -> tuple[list[tuple[bool, int, int]], dict]:
    """``(is_alloc, handle, nbytes)`` of building ``cfg``'s model as ``_train`` does it on the
    device (meta here), handles negative; and {parameter or buffer name: (handle, nbytes)}
    of the storages the built model holds."""
    rec = Recorder()
    with torch.device("meta"), rec:
        model, _ = build_for_training(spec, cfg.precision, cfg.checkpointing,
                                      cfg.checkpoint_class, preserve_rng_state=False,
                                      checkpoint_every=cfg.checkpoint_every,
                                      checkpoint_policy=cfg.checkpoint_policy)
    # named as trace.py's _record_model_state names them: one name per storage
    state = unique_storages((*model.parameters(), *model.buffers()))
    names = {t.untyped_storage()._cdata: n for n, t in (*model.named_buffers(),
                                                       *model.named_parameters())}
    final = {}
    for key in state:
        h = rec.live.get(key)
        if h is not None and key in names:
            final[names[key]] = (-1 - h, rec.storages[h].nbytes)
    rec.closed = True           # the model is dropped here; on the GPU it lives on
    events = [(a, -1 - h, n) for a, h, n in rec.raw]
    return events, final


def chained_events(spec: ModelSpec, cfg, trace, gpu) -> list[tuple[bool, int, int]]:
    """Construction's events, then the step's (oomdoctor.plans.estimate.device_events) with
    each setup allocation of a weight construction already holds dropped: the step trains
    the blocks construction left."""
    from oomdoctor.plans.estimate import device_events
    events, final = construction_events(spec, cfg)
    held = set()
    for is_alloc, h, n in device_events(trace, gpu).events:
        s = trace.storages.get(h) if is_alloc else None
        if (s is not None and s.category in (Category.PARAMETERS, Category.BUFFERS)
                and final.get(s.name, (0, -1))[1] == n and s.name not in held):
            held.add(s.name)
            continue
        events.append((is_alloc, h, n))
    return events


def harness_events(spec: ModelSpec, cfg, gpu) -> list[tuple[bool, int, int]]:
    """The harness's run of ``cfg`` as allocator events: construction on the device, then the
    step traced for ``gpu``."""
    from oomdoctor.plans.estimate import trace_for
    return chained_events(spec, cfg, trace_for(spec, cfg, gpu), gpu)


def harness_peaks(spec: ModelSpec, cfg, budget, estimate, alloc=AllocatorConfig(),
                  freed_bytes: int = 0):
    """``estimate`` (oomdoctor.plans.estimate.estimate of ``cfg``) with the peaks and fit of
    the harness's run: construction on the device, then the step. ``freed_bytes``: the address
    range the process's earlier runs took and returned (oomdoctor.sim.allocator.addresses);
    0 for a run in a fresh process."""
    events = harness_events(spec, cfg, budget.gpu)
    limited = replay(events, alloc, budget.limit_bytes, freed_bytes=freed_bytes)
    result = limited if limited.oom is None else replay(events, alloc, None,
                                                        freed_bytes=freed_bytes)
    return replace(estimate, peak_allocated_bytes=result.peak_allocated_bytes,
                   peak_reserved_bytes=result.peak_reserved_bytes, fits=limited.oom is None)
