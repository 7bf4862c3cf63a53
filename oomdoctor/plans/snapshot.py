"""The simulated training step as a CUDA memory snapshot that PyTorch's memory_viz opens.

    oomdoctor estimate sample_models/gpt2_small.py -b 8 --gpu rtx3090 --snapshot step.pickle

then drop ``step.pickle`` on https://pytorch.org/memory_viz. The file has the layout of
``torch.cuda.memory._snapshot()`` (torch/cuda/memory.py, ``Snapshot``): ``device_traces[0]``
lists what the allocator did, in order (alloc, free_requested + free_completed, segment_alloc,
segment_free, segment_map/unmap with expandable segments, and an ``oom`` when the step does not
fit); ``segments`` are the allocator's segments with their blocks where the trace ends - after
the last traced step, or at the failing allocation like the OOM observer's snapshot - because
memory_viz reconstructs every earlier state (the peak included) by undoing the trace from them.

Each allocation's ``frames`` (innermost first, as torch stores them) name where the step made
it: the module path and the ATen op (``h.3.mlp.c_proj:0:aten::addmm``), its parent
modules, then one frame ``oomdoctor:<step>:<phase>: <category>`` with the estimate's breakdown
category. Parameters are named by their qualified name, optimizer state by its key and
parameter (``AdamW.step:0:exp_avg of h.3.mlp.c_proj.weight``).

Known limitations:
- An ``alloc`` event's ``size`` is the block the allocator hands out (rounded to 512 bytes, with
  an unsplit tail), which is what ``max_memory_allocated`` counts, so memory_viz's timeline peaks
  at the estimate's ``peak_allocated_bytes``; torch records the unrounded request there (a few
  KiB less on a real run). The request is each block's ``requested_size``.
- Addresses are the simulator's, time is the event index (``time_us``), one stream.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, replace
from typing import Any, Callable

from oomdoctor.models.spec import ModelSpec
from oomdoctor.plans.estimate import (_CATEGORY_KEY, Budget, Estimate, allocator_conf_string,
                                      device_events, estimate_trace, trace_for)
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.sim.allocator.history import Action, History, replay_history
from oomdoctor.sim.recorder import Category, Storage
from oomdoctor.sim.trace import Trace, TraceConfig

MARKER = "oomdoctor"     # the filename of the frame that carries the category


@dataclass(frozen=True)
class _Namer:
    """Frames for each handle of one trace."""

    trace: Trace
    workspaces: frozenset[int]
    trace_index: list[int]       # device event -> trace event (estimate.DeviceEvents)
    scratch: frozenset[int] = frozenset()   # reductions' global buffers (sim.reductions)

    def frames(self, handle: int, event: int) -> list[dict[str, Any]]:
        if handle in self.workspaces or handle in self.scratch:
            mark = self.trace.phase_at(self.trace_index[event])
            what = (_frame("cuBLAS", "workspace") if handle in self.workspaces
                    else _frame("Reduce.cuh", "gpu_reduce_kernel"))
            return [what,
                    _frame(f"{MARKER}:{mark.iteration + 1}:{mark.phase.value}", "temporaries")]
        s = self.trace.storages[handle]
        return [*_where(s), _frame(f"{MARKER}:{s.iteration + 1}:{s.phase.value}",
                                   _CATEGORY_KEY[s.category])]


def _frame(filename: str, name: str) -> dict[str, Any]:
    return {"filename": filename, "line": 0, "name": name}


def _where(s: Storage) -> list[dict[str, Any]]:
    """The frames inside the marker: the tensor's name or its module path and op, then the
    parent modules (``a.b.c`` -> ``a.b``, ``a``)."""
    if s.category in (Category.PARAMETERS, Category.BUFFERS):
        return [_frame(s.name or "(unnamed)", s.op)]
    if s.category is Category.OPTIMIZER_STATE and ": " in s.name:
        owner, what = s.name.split(": ", 1)
        return [_frame(owner, what)]
    op = f"aten::{s.op.split('.')[0]}"
    if s.category is Category.GRADIENTS and s.name:
        return [_frame(s.name, op)]
    if not s.module:
        return [_frame("(no module)", op)]
    parts = s.module.split(".")
    return [_frame(s.module, op)] + [_frame(".".join(parts[:i]), "forward")
                                    for i in range(len(parts) - 1, 0, -1)]


def _entry(a: Action, action: str, frames: list[dict[str, Any]]) -> dict[str, Any]:
    e = {"action": action, "addr": a.addr, "size": a.size, "stream": 0, "time_us": a.index,
         "compile_context": "N/A", "user_metadata": "", "frames": frames}
    if action == "oom":
        del e["addr"]
        e["device_free"] = a.device_free
    return e


def _device_trace(history: History, namer: _Namer) -> list[dict[str, Any]]:
    out = []
    for a in history.actions:
        frames = namer.frames(a.handle, a.index) if a.handle is not None else []
        if a.action == "free":
            out.append(_entry(a, "free_requested", frames))
            out.append(_entry(a, "free_completed", frames))
        else:
            out.append(_entry(a, a.action, frames))
    return out


def _segments(history: History, namer: _Namer, index: int) -> list[dict[str, Any]]:
    """The segments where the trace ends, in ``_snapshot()``'s layout."""
    out = []
    for seg in history.segments:
        addr, blocks = seg.address, []
        for b in seg.blocks:
            h = history.block_handles.get(addr) if b.allocated else None
            blocks.append({"address": addr, "size": b.size, "requested_size": b.requested,
                           "state": "active_allocated" if b.allocated else "inactive",
                           "frames": namer.frames(h, index) if h is not None else []})
            addr += b.size
        used = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        out.append({"device": 0, "address": seg.address, "total_size": seg.size,
                    "allocated_size": used, "active_size": used,
                    "requested_size": sum(b["requested_size"] for b in blocks),
                    "stream": 0, "segment_type": seg.pool, "segment_pool_id": (0, 0),
                    "is_expandable": seg.expandable, "frames": [], "blocks": blocks})
    return out


def build_snapshot(trace: Trace, budget: Budget,
                   alloc: AllocatorConfig = AllocatorConfig()) -> dict[str, Any]:
    """The traced step replayed under ``budget`` as a ``torch.cuda.memory._snapshot()`` dict:
    plain dicts, lists, tuples, str, int and bool, as torch pickles it."""
    dev = device_events(trace, budget.gpu)
    history = replay_history(dev.events, alloc, budget.limit_bytes)
    namer = _Namer(trace, dev.workspace_handles, dev.trace_index, dev.scratch_handles)
    end = history.oom_index if history.oom_index is not None else len(dev.events) - 1
    return {
        "segments": _segments(history, namer, max(end, 0)),
        "device_traces": [_device_trace(history, namer)],
        "allocator_settings": {
            "PYTORCH_CUDA_ALLOC_CONF": allocator_conf_string(alloc),
            "max_split_size": -1 if alloc.max_split_size is None else alloc.max_split_size,
            "expandable_segments": alloc.expandable_segments},
        "external_annotations": [],
    }


def write_snapshot(snapshot: dict[str, Any], path: str) -> None:
    """Pickle it as ``torch.cuda.memory._dump_snapshot`` does."""
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)


def estimate_with_snapshot(spec: ModelSpec, cfg: TraceConfig, budget: Budget,
                           alloc: AllocatorConfig = AllocatorConfig(),
                           progress: Callable[[str], None] | None = None
                           ) -> tuple[Estimate, dict[str, Any]]:
    """``estimate`` and the snapshot of the same trace (one trace for both)."""
    trace = trace_for(spec, cfg, budget.gpu, progress=progress)
    return estimate_trace(trace, budget, alloc, spec.name), build_snapshot(trace, budget, alloc)


def estimate_views(spec: ModelSpec, cfg: TraceConfig, budget: Budget,
                   alloc: AllocatorConfig = AllocatorConfig(), snapshot: bool = True,
                   series: bool = False, progress: Callable[[str], None] | None = None
                   ) -> tuple[Estimate, dict[str, Any] | None, Any]:
    """``estimate`` with, from the same trace, its snapshot and/or its plot's series
    (:func:`oomdoctor.plans.stepplot.step_series`); None for those not asked for."""
    return trace_views(trace_for(spec, cfg, budget.gpu, progress=progress), spec.name, budget,
                       alloc, snapshot, series)


def trace_views(trace: Trace, name: str, budget: Budget,
                alloc: AllocatorConfig = AllocatorConfig(), snapshot: bool = True,
                series: bool = False) -> tuple[Estimate, dict[str, Any] | None, Any]:
    """The estimate of a finished trace (a model file's or a script's), with its snapshot and/or
    its plot's series."""
    from oomdoctor.plans.stepplot import step_series
    return (estimate_trace(trace, budget, alloc, name),
            build_snapshot(trace, budget, alloc) if snapshot else None,
            step_series(trace, budget, alloc) if series else None)


def snapshot_path(path: str, label: str) -> str:
    """``step.pickle`` + ``bf16-ckpt`` -> ``step.bf16-ckpt.pickle`` (probe: one per configuration)."""
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.{label}.{ext}" if dot and "/" not in ext else f"{path}.{label}"


def probe_snapshots(spec: ModelSpec, base: TraceConfig, budget: Budget, result: Any,
                    alloc: AllocatorConfig = AllocatorConfig()
                    ) -> list[tuple[str, Estimate, dict[str, Any]]]:
    """`probe --snapshot`: each probed configuration traced again at its largest batch that
    fits (batch 1 when none does), as (label, estimate, snapshot)."""
    out = []
    for r in result.results:
        if r.error:
            continue
        cfg = replace(base, precision=r.precision, checkpointing=r.checkpointing,
                      batch_size=r.max_batch_size or 1)
        label = r.precision + ("-ckpt" if r.checkpointing else "")
        out.append((label, *estimate_with_snapshot(spec, cfg, budget, alloc)))
    return out
