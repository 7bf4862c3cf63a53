"""The CUDA caching allocator's events of a run, compact enough to commit and to compare with
oomdoctor's replay event by event (issue 34: the first event where the two part is the cause).

``torch.cuda.memory._snapshot()`` holds every alloc/free/segment event since
``_record_memory_history`` was switched on, each with its Python stack; a pickle of it runs to
tens of MB. :func:`write_trace` keeps, per event, ``[action, address, size, stream, where]``
(``where``: the innermost six frames outside torch's own helpers, as ``file:line:function``)
and the segments held at the end, as gzipped JSON.
"""
from __future__ import annotations

import gzip
import json
import os


def _where(frames: list) -> str:
    keep = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames
            if "torch/utils/_" not in f["filename"]][:6]
    return " < ".join(keep)


def write_trace(path: str) -> str | None:
    """Write the events recorded so far to ``path``; the error as text if that failed (the
    run's peaks matter more than its trace)."""
    import torch
    try:
        snap = torch.cuda.memory._snapshot()
        events = [[e["action"], e.get("addr", 0), e["size"], e.get("stream", 0),
                   _where(e.get("frames", []))]
                  for trace in snap["device_traces"] for e in trace]
        segments = [{"address": s["address"], "total_size": s["total_size"],
                     "stream": s["stream"], "allocated_size": s["allocated_size"],
                     "segment_type": s.get("segment_type")} for s in snap["segments"]]
        with gzip.open(path, "wt") as f:
            json.dump({"events": events, "segments": segments}, f)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"[:300]
