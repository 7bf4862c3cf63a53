"""Reading a CUDA memory snapshot (torch.cuda.memory._dump_snapshot) safely, and what it shows.

    oomdoctor explain snapshot.pickle

A snapshot is a pickle, and unpickling an untrusted pickle can run any code it names. A real
snapshot (torch/cuda/memory.py, ``_snapshot``) holds only dicts, lists, tuples, strings,
numbers, booleans and None, which pickle stores with opcodes of their own; a class or function
can only enter through ``find_class``. :class:`_PlainUnpickler` refuses every ``find_class``
(and persistent ids), so a crafted file is refused before anything in it runs.

:func:`analyse` then reads the allocator's history (``device_traces``, as memory_viz replays
it: allocations made before recording started are taken from their free events and from the
final segments) for what was live at the OOM - or at the peak when there was none - by category
and allocation site, and the final ``segments`` for fragmentation.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, BinaryIO

_USER_SKIP = ("/torch/", "site-packages", "dist-packages")
OPTIMIZER_STATE, TEMPORARIES = "optimizer_state", "temporaries"


class UnsafeSnapshot(ValueError):
    """The pickle names a Python object (a class or a function): not a plain snapshot."""


class NotASnapshot(ValueError):
    """A plain pickle, but not in the layout of torch.cuda.memory._snapshot()."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeSnapshot(
            f"refused: the pickle names the Python object {module}.{name}, so it is not a plain "
            "memory snapshot (torch.cuda.memory._dump_snapshot writes only dicts, lists, strings "
            "and numbers) and loading it could run code; nothing in it was run. Dump the "
            "snapshot again with torch.cuda.memory._dump_snapshot, or check where the file "
            "came from")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeSnapshot("refused: the pickle refers to external (persistent) objects, so it "
                             "is not a plain memory snapshot; nothing in it was run")


def is_pickle(head: bytes) -> bool:
    """A binary pickle (protocol 2 and later) starts with PROTO: 0x80 and the protocol."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def load_snapshot(stream: BinaryIO) -> dict[str, Any]:
    """The snapshot dict, refusing any pickle that names a Python object (UnsafeSnapshot)."""
    try:
        data = _PlainUnpickler(stream).load()
    except UnsafeSnapshot:
        raise
    except Exception as e:      # truncated or corrupt: pickle raises many kinds
        raise NotASnapshot(f"not a readable pickle ({type(e).__name__}: {e}); pass the file "
                           "torch.cuda.memory._dump_snapshot wrote") from None
    if isinstance(data, list):      # torch.cuda.memory_snapshot(): the segments alone
        data = {"segments": data, "device_traces": []}
    traces = data.get("device_traces") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or not isinstance(data.get("segments"), list)
            or not all(isinstance(s, dict) and isinstance(s.get("blocks", []), list)
                       and "total_size" in s and "address" in s for s in data["segments"])
            or not isinstance(traces or [], list)
            or not all(isinstance(t, list) and all(isinstance(e, dict) and "action" in e
                                                   for e in t) for t in traces or [])):
        raise NotASnapshot("a plain pickle, but not a torch.cuda.memory._snapshot() dict "
                           "(segments with blocks, device_traces of actions); dump it with "
                           "torch.cuda.memory._dump_snapshot")
    return data


@dataclass(frozen=True)
class Site:
    """Where an allocation was made, read from its frames."""

    category: str      # the estimate's breakdown keys, plus "backward" and "other" for real runs
    site: str          # innermost frame, and the user's line when it is another
    module: str        # the module (simulated) or the user's source line (real) it belongs to


@dataclass(frozen=True)
class Live:
    """What was allocated at one moment of the history."""

    moment: str                            # "oom", "peak" or "end"
    index: int                             # trace entry of that moment (-1: no history)
    allocated_bytes: int
    reserved_bytes: int
    blocks: tuple[tuple[int, Site], ...]   # (bytes, where) of each live allocation
    phase: str | None = None               # "backward of step 1": simulated snapshots say


@dataclass(frozen=True)
class SegmentFree:
    address: int
    total_bytes: int
    free_bytes: int
    free_blocks: int
    largest_free_bytes: int
    pool: str


@dataclass(frozen=True)
class Fragmentation:
    """From the final segments (at the OOM for the OOM observer's snapshot)."""

    reserved_bytes: int
    allocated_bytes: int        # active blocks (their rounded sizes)
    requested_bytes: int        # what the callers asked for in those blocks
    free_bytes: int             # reserved but unallocated: the inactive blocks
    free_blocks: int
    largest_free_bytes: int
    largest_free_large_pool_bytes: int
    segments: tuple[SegmentFree, ...] = field(default_factory=tuple)   # with free blocks, largest first


def frame_text(f: dict[str, Any]) -> str:
    return f"{str(f.get('filename', '?')).split('/')[-1]}:{f.get('line', 0)}:{f.get('name', '?')}"


def classify(frames: list[dict[str, Any]]) -> Site:
    """The category and site of one allocation from its frames (innermost first)."""
    if frames and str(frames[-1].get("filename", "")).startswith("oomdoctor:"):
        # Written by oomdoctor estimate --snapshot: the last frame names the category.
        first = frames[0]
        where = f"{first.get('filename')}: {first.get('name')}"
        name = str(first.get("filename", ""))
        # Grouped by block like the estimate's top_activations ("blocks.3.mlp.up" -> "blocks.3.mlp").
        module = "" if name.startswith("(") else ".".join(name.split(".")[:3])
        return Site(str(frames[-1].get("name", "other")), where, module)
    if not frames:
        # The autograd engine runs backward on its own thread, which has no Python frames.
        return Site("backward", "(no Python frames: autograd's backward thread, or C++)", "")
    names = [str(f.get("name", "")) for f in frames]
    files = [str(f.get("filename", "")) for f in frames]
    user = next((f for f in frames if not any(s in str(f.get("filename", "")) for s in _USER_SKIP)
                 and not str(f.get("filename", "")).startswith("<")), None)
    site = frame_text(frames[0]) + (f" < {frame_text(user)}" if user and user is not frames[0]
                                    else "")
    module = frame_text(user).rsplit(":", 1)[0] if user else ""
    if any("/torch/optim/" in fn for fn in files):
        return Site(OPTIMIZER_STATE if "_init_group" in names else TEMPORARIES, site, module)
    if any(n == "_apply" and fn.endswith("torch/nn/modules/module.py")
           for n, fn in zip(names, files)):
        return Site("parameters", site, module)
    if "backward" in names:
        return Site("backward", site, module)
    if "forward" in names:
        return Site("activations", site, module)
    return Site("other", site, module)


def _entries(data: dict[str, Any]) -> list[dict[str, Any]]:
    traces = [t for t in data.get("device_traces") or [] if t]
    return traces[0] if traces else []


def _active_blocks(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for seg in data["segments"] for b in seg.get("blocks", [])
            if b.get("state") == "active_allocated"]


def _initial(entries: list[dict[str, Any]], active: list[dict[str, Any]]
             ) -> dict[int, tuple[int, list]]:
    """Allocations made before the history starts, as memory_viz finds them: freed without
    an alloc in the history, or still active at the end without one."""
    live: set[int] = set()
    initial: dict[int, tuple[int, list]] = {}
    for e in entries:
        if e["action"] == "alloc":
            live.add(e["addr"])
        elif e["action"] == "free_completed":
            if e["addr"] in live:
                live.discard(e["addr"])
            else:
                initial.setdefault(e["addr"], (e["size"], e.get("frames", [])))
    for b in active:
        if b["address"] not in live and b["address"] not in initial:
            initial[b["address"]] = (b.get("requested_size", b["size"]), b.get("frames", []))
    return initial


def live_at_moment(data: dict[str, Any]) -> Live:
    """The allocations live at the first OOM of the history, else at its peak."""
    entries, active = _entries(data), _active_blocks(data)
    reserved_end = sum(s["total_size"] for s in data["segments"])
    if not entries:
        return Live("end", -1, sum(b["size"] for b in active), reserved_end,
                    tuple((b["size"], classify(b.get("frames", []))) for b in active))
    initial = _initial(entries, active)
    delta = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    reserved = reserved_end - sum(delta.get(e["action"], 0) * e["size"] for e in entries)
    cur = sum(size for size, _ in initial.values())
    peak, peak_at, moment = cur, -1, "peak"
    for i, e in enumerate(entries):
        a = e["action"]
        if a == "alloc":
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif a == "free_completed":
            cur -= e["size"]
        elif a == "oom":
            peak_at, moment = i, "oom"
            break
    return _replay_to(entries, initial, peak_at, moment, reserved, delta)


def _replay_to(entries, initial, stop, moment, reserved, delta) -> Live:
    live = dict(initial)
    for e in entries[:stop + 1]:
        a = e["action"]
        if a == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
        elif a == "free_completed":
            live.pop(e["addr"], None)
        reserved += delta.get(a, 0) * e.get("size", 0)
    blocks = tuple((size, classify(frames)) for size, frames in live.values())
    phase = None
    if 0 <= stop < len(entries):
        marker = (entries[stop].get("frames") or [{}])[-1].get("filename", "")
        parts = str(marker).split(":")
        if parts[0] == "oomdoctor" and len(parts) == 3:     # oomdoctor:<step>:<phase>
            phase = f"{parts[2]} of step {parts[1]}"
    return Live(moment, stop, sum(s for s, _ in blocks), reserved, blocks, phase)


def fragmentation(data: dict[str, Any]) -> Fragmentation:
    segs, largest_large = [], 0
    for seg in data["segments"]:
        free = [b["size"] for b in seg.get("blocks", []) if b.get("state") == "inactive"]
        if seg.get("segment_type") == "large" and free:
            largest_large = max(largest_large, max(free))
        if free:
            segs.append(SegmentFree(seg["address"], seg["total_size"], sum(free), len(free),
                                    max(free), str(seg.get("segment_type", "?"))))
    active = _active_blocks(data)
    segs.sort(key=lambda s: (-s.free_bytes, s.address))
    return Fragmentation(
        reserved_bytes=sum(s["total_size"] for s in data["segments"]),
        allocated_bytes=sum(b["size"] for b in active),
        requested_bytes=sum(b.get("requested_size", b["size"]) for b in active),
        free_bytes=sum(s.free_bytes for s in segs), free_blocks=sum(s.free_blocks for s in segs),
        largest_free_bytes=max((s.largest_free_bytes for s in segs), default=0),
        largest_free_large_pool_bytes=largest_large, segments=tuple(segs))


def oom_request(data: dict[str, Any]) -> tuple[int, int] | None:
    """(bytes requested, device_free) of the first OOM in the history."""
    for e in _entries(data):
        if e["action"] == "oom":
            return int(e.get("size", 0)), int(e.get("device_free", 0))
    return None


# ATen ops that only a forward pass runs: allocated again in the backward phase, they were recomputed there
# (activation checkpointing). Generic ops (add, mm, mul, new_empty, _to_copy) run in both passes anyway.
_FORWARD_ONLY_OPS = frozenset({
    "aten::native_layer_norm", "aten::native_batch_norm", "aten::native_group_norm", "aten::gelu", "aten::silu",
    "aten::relu", "aten::native_dropout", "aten::convolution", "aten::addmm", "aten::_softmax",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention"})


def _all_frames(data: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Every stack in the history and the final blocks. Frees count: leaving torch.autocast frees its
    cast weights under autocast_mode.py's __exit__, the only trace autocast leaves in python stacks."""
    stacks = [e.get("frames") or [] for e in _entries(data) if e.get("action") in ("alloc", "free_requested")]
    return stacks + [b.get("frames") or [] for b in _active_blocks(data)]


def already_done(data: dict[str, Any]) -> frozenset[str]:
    """What the recorded step already does, read from the snapshot, so that no fix suggests it again:
    "autocast" (mixed precision), "checkpointing", "expandable_segments", "8bit_optimizer".

    autocast: a frame of torch.amp (a real bf16 autocast step recorded with stacks="python" on an H200
    frees its cached weight casts in torch/amp/autocast_mode.py's __exit__: tests/logs/snapshots) or of
    ATen's autocast (C++ stacks, stacks="all"), or - in oomdoctor's simulated
    snapshots - the forward's casts of a module's own weights (aten::_to_copy in a module that holds a
    parameter). checkpointing: torch/utils/checkpoint.py on the stack, or forward-only ops allocating in
    the backward phase. expandable_segments: the allocator settings or an expandable segment."""
    done = set()
    settings = data.get("allocator_settings") or {}
    if settings.get("expandable_segments") or any(seg.get("is_expandable") for seg in data["segments"]):
        done.add("expandable_segments")
    stacks = _all_frames(data)
    owners = {str(f[0].get("filename", "")).rsplit(".", 1)[0] for f in stacks
              if f and len(f) > 1 and str(f[-1].get("name")) == "parameters"}
    for frames in stacks:
        text = " ".join(f"{f.get('filename', '')} {f.get('name', '')}" for f in frames)
        # (torch's own files and ATen's symbols, not any file with the word in its name)
        if "at::autocast::" in text or "/torch/amp/" in text or "/torch/cuda/amp/" in text:
            done.add("autocast")
        if "/torch/utils/checkpoint.py" in text:
            done.add("checkpointing")
        if "bitsandbytes" in text or "8bit" in text.lower():
            done.add("8bit_optimizer")
        if not frames or not str(frames[-1].get("filename", "")).startswith("oomdoctor:"):
            continue
        phase, op = str(frames[-1]["filename"]).split(":")[-1], str(frames[0].get("name", ""))
        if phase == "forward" and op == "aten::_to_copy" and frames[0].get("filename") in owners:
            done.add("autocast")
        elif phase == "backward" and op in _FORWARD_ONLY_OPS:
            done.add("checkpointing")
    return frozenset(done)
