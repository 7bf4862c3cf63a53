"""`oomdoctor explain snapshot.pickle`: what a memory snapshot shows, in words, and its fixes."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, BinaryIO

from tabulate import tabulate

from .results import Fix
from .sizes import format_bytes as _F
from .snapshot import (OPTIMIZER_STATE, Fragmentation, Live, NotASnapshot, already_done, fragmentation,
                       live_at_moment, load_snapshot, oom_request)

_LABELS = {
    "parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
    "activations": "activations", "temporaries": "temporaries",
    "backward": "backward (gradients and their temporaries)", "other": "other",
}
_TOP = 8
# What the step already does (snapshot.already_done), in words, and the fixes that would only repeat it.
_ALREADY = {"autocast": "mixed precision (autocast)", "checkpointing": "activation checkpointing",
            "expandable_segments": "expandable segments", "8bit_optimizer": "an 8-bit optimizer"}
_REPEATS = {"autocast": "mixed_precision", "checkpointing": "activation_checkpointing",
            "expandable_segments": "expandable_segments", "8bit_optimizer": "lighter_optimizer"}


@dataclass(frozen=True)
class SnapshotReport:
    """Bytes are ints; ``by_*`` are (name, bytes) largest first, ``sites`` (site, bytes, count)."""

    path: str
    simulated: bool                       # written by oomdoctor estimate --snapshot
    events: int
    segments: int
    live: Live
    by_category: tuple[tuple[str, int], ...]
    by_module: tuple[tuple[str, int], ...]     # activations
    sites: tuple[tuple[str, int, int], ...]
    oom_requested: int | None
    oom_device_free: int | None
    fragmentation: Fragmentation
    expandable_helps: bool | None         # None: nothing to decide (no OOM, no free memory)
    expandable_text: str
    fixes: tuple[Fix, ...]
    already: tuple[str, ...] = ()         # what the step already does: keys of _ALREADY


def explain_snapshot(stream: BinaryIO, path: str = "-") -> SnapshotReport:
    """Load a snapshot with the restricted unpickler and explain it (UnsafeSnapshot,
    NotASnapshot when it is not one)."""
    data = load_snapshot(stream)
    try:
        live, frag, oom = live_at_moment(data), fragmentation(data), oom_request(data)
    except (KeyError, TypeError, AttributeError) as e:
        raise NotASnapshot(f"a snapshot entry lacks a field ({type(e).__name__}: {e}); dump "
                           "it with torch.cuda.memory._dump_snapshot") from None
    cats: dict[str, int] = defaultdict(int)
    mods: dict[str, int] = defaultdict(int)
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in live.blocks:
        cats[where.category] += size
        if where.category == "activations" and where.module:
            mods[where.module] += size
        sites[where.site][0] += size
        sites[where.site][1] += 1
    done = already_done(data)
    helps, text = _expandable(frag, live, oom)
    if "expandable_segments" in done:
        helps, text = None, "already on: the allocator ran with expandable segments"
    entries = [t for t in data.get("device_traces") or [] if t]
    return SnapshotReport(
        path=path, simulated=_simulated(data), events=len(entries[0]) if entries else 0,
        segments=len(data["segments"]), live=live, by_category=_ranked(cats),
        by_module=_ranked(mods)[:_TOP],
        sites=tuple(sorted(((s, b, n) for s, (b, n) in sites.items()),
                           key=lambda x: (-x[1], x[0])))[:_TOP],
        oom_requested=oom[0] if oom else None, oom_device_free=oom[1] if oom else None,
        fragmentation=frag, expandable_helps=helps, expandable_text=text,
        fixes=tuple(f for f in _fixes(dict(cats), frag, helps, live, oom)
                    if f.id not in {_REPEATS[k] for k in done}),
        already=tuple(sorted(done)))


def _simulated(data: dict[str, Any]) -> bool:
    for seg in data["segments"]:
        for b in seg.get("blocks", []):
            frames = b.get("frames") or []
            if frames:
                return str(frames[-1].get("filename", "")).startswith("oomdoctor:")
    return False


def _ranked(d: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))


def _expandable(frag: Fragmentation, live: Live, oom: tuple[int, int] | None
                ) -> tuple[bool | None, str]:
    """Would PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True have helped? With it, each pool
    is one segment that maps and unmaps 2 MiB / 20 MiB pages (CUDACachingAllocator.cpp,
    ExpandableSegment), so free pages anywhere can serve one request together."""
    free, largest = frag.free_bytes, frag.largest_free_bytes
    if oom is not None:
        req = oom[0]
        if free >= req:
            return True, (f"yes: {_F(free)} was reserved but free in {frag.free_blocks} blocks, "
                          f"the largest {_F(largest)}, too small for the {_F(req)} request but "
                          "enough together; with expandable_segments:True those pages could "
                          "have been remapped to serve it")
        return False, (f"no: only {_F(free)} was reserved but free (largest block "
                       f"{_F(largest)}), {_F(req - free)} short of the {_F(req)} request even "
                       "if it were one block; the memory is held by live tensors")
    over = live.reserved_bytes - live.allocated_bytes
    if over <= 0:
        return None, "no reserved-but-unallocated memory at the peak: nothing to reclaim"
    return True, (f"up to {_F(over)}: at the peak {_F(live.reserved_bytes)} was reserved for "
                  f"{_F(live.allocated_bytes)} allocated; expandable segments shrink that "
                  "cache-and-split overhead, usually to a few page-roundings")


def _fixes(cats: dict[str, int], frag: Fragmentation, helps: bool | None, live: Live,
           oom: tuple[int, int] | None) -> tuple[Fix, ...]:
    """The explain catalogue's fixes with what each frees, computed from the live bytes."""
    act, opt = cats.get("activations", 0), cats.get(OPTIMIZER_STATE, 0)
    states = cats.get("parameters", 0) + cats.get("gradients", 0) + opt
    fixes = []
    if act:
        fixes += [
            Fix("halve_micro_batch", "Halve the micro-batch and double gradient accumulation",
                act // 2, "about", "slightly slower per sample, same optimizer steps",
                "none: the effective batch is unchanged",
                f"The live activations ({_F(act)}) scale with the micro-batch."),
            Fix("activation_checkpointing", "Activation checkpointing: torch.utils.checkpoint "
                "on the repeated blocks", act, "up to", "about 20-30% slower",
                "none", "Keeps each block's input and recomputes the rest in backward."),
            Fix("mixed_precision", "Train with mixed precision: torch.autocast(dtype=torch."
                "bfloat16)", act // 2, "about", "faster on tensor-core GPUs",
                "practically none", "If the model runs in fp32 today, saved activations "
                "halve; model states stay fp32.")]
    if opt:
        fixes.append(Fix("lighter_optimizer", "8-bit AdamW (bitsandbytes) instead of AdamW",
                         opt * 3 // 4, "about", "about the same",
                         "near-identical in practice",
                         f"AdamW's state ({_F(opt)} live) takes 8 bytes per parameter, 8-bit "
                         "AdamW 2."))
    if helps:
        gain = frag.free_bytes if oom is not None else live.reserved_bytes - live.allocated_bytes
        fixes.append(Fix("expandable_segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:"
                         "True", gain, "up to", "none", "none",
                         "Free pages of one growing segment serve any request."))
    if states:
        fixes.append(Fix("shard_model_states", "Shard weights, gradients and optimizer state "
                         "over 2 GPUs: FSDP or DeepSpeed ZeRO-3", states // 2, "about",
                         "slower: collectives every step", "none",
                         f"Each GPU keeps half of the {_F(states)} of model states live here "
                         "(gradients of a real run are under 'backward')."))
    return tuple(sorted(fixes, key=lambda f: -(f.effect_bytes or 0)))


def _moment_line(r: SnapshotReport) -> str:
    live = r.live
    where = f" (trace entry {live.index + 1:,} of {r.events:,})" if live.index >= 0 else ""
    phase = f", in the {live.phase}" if live.phase else ""
    head = {"oom": f"At the OOM{where}{phase}: a request of {_F(r.oom_requested or 0)} failed",
            "peak": f"At the peak{where}{phase}", "end": "At the snapshot"}[live.moment]
    return (f"{head}: {_F(live.allocated_bytes)} allocated in {len(live.blocks):,} blocks, "
            f"{_F(live.reserved_bytes)} reserved.")


def render_snapshot_text(r: SnapshotReport) -> str:
    """Terminal text of a snapshot's explanation (IEC units, ASCII only)."""
    who = "simulated by oomdoctor" if r.simulated else "recorded by PyTorch"
    total = max(r.live.allocated_bytes, 1)
    out = [f"CUDA memory snapshot {r.path} ({who}): {r.events:,} allocator events, "
           f"{r.segments} segments.", _moment_line(r), ""]
    out.append(tabulate([(_LABELS.get(c, c), _F(b), f"{100 * b / total:.1f}%")
                         for c, b in r.by_category],
                        headers=("live by category", "bytes", "share"),
                        colalign=("left", "right", "right")))
    if r.by_module:
        out += ["", tabulate([(m, _F(b)) for m, b in r.by_module],
                             headers=("activations by module", "bytes"),
                             colalign=("left", "right"))]
    out += ["", tabulate([(s, _F(b), n) for s, b, n in r.sites],
                         headers=("top allocation sites", "bytes", "blocks"),
                         colalign=("left", "right", "right"))]
    f = r.fragmentation
    req = (f" vs the failed {_F(r.oom_requested)} request" if r.oom_requested else "")
    out += ["", f"Fragmentation ({'at the OOM' if r.live.moment == 'oom' else 'in the final segments'}): "
            f"{_F(f.reserved_bytes)} reserved, {_F(f.allocated_bytes)} allocated, "
            f"{_F(f.free_bytes)} reserved but unallocated in {f.free_blocks} free blocks over "
            f"{len(f.segments)} segments; largest free block {_F(f.largest_free_bytes)}{req}."]
    for s in f.segments[:5]:
        out.append(f"  segment 0x{s.address:x} ({s.pool}, {_F(s.total_bytes)}): "
                   f"{_F(s.free_bytes)} free in {s.free_blocks} blocks, largest "
                   f"{_F(s.largest_free_bytes)}")
    out += [f"Would expandable_segments have helped? {r.expandable_text}."]
    if r.already:
        out.append("The step already uses " + ", ".join(_ALREADY[k] for k in r.already)
                   + ": no fix below repeats it.")
    out += ["", "Fixes, ranked by what they buy (bytes from this snapshot)"]
    for i, fix in enumerate(r.fixes, 1):
        out.append(f"  {i}. {fix.title}")
        out.append(f"     frees: {fix.effect_bound} {_F(fix.effect_bytes or 0)} | speed: "
                   f"{fix.speed} | quality: {fix.quality}")
    return "\n".join(out) + "\n"


def snapshot_to_json(r: SnapshotReport) -> dict[str, Any]:
    """The explanation as a JSON-ready dict (bytes as ints)."""
    f = r.fragmentation
    return {
        "snapshot": r.path, "simulated": r.simulated, "events": r.events,
        "segments": r.segments, "moment": r.live.moment, "trace_index": r.live.index,
        "phase": r.live.phase, "allocated_bytes": r.live.allocated_bytes,
        "reserved_bytes": r.live.reserved_bytes, "live_blocks": len(r.live.blocks),
        "by_category": [{"category": c, "bytes": b} for c, b in r.by_category],
        "activations_by_module": [{"module": m, "bytes": b} for m, b in r.by_module],
        "top_sites": [{"site": s, "bytes": b, "blocks": n} for s, b, n in r.sites],
        "oom": None if r.oom_requested is None else {
            "requested_bytes": r.oom_requested, "device_free_bytes": r.oom_device_free},
        "fragmentation": {
            "reserved_bytes": f.reserved_bytes, "allocated_bytes": f.allocated_bytes,
            "requested_bytes": f.requested_bytes, "free_bytes": f.free_bytes,
            "free_blocks": f.free_blocks, "largest_free_bytes": f.largest_free_bytes,
            "largest_free_large_pool_bytes": f.largest_free_large_pool_bytes,
            "segments_with_free": [vars(s) for s in f.segments]},
        "expandable_segments": {"helps": r.expandable_helps, "why": r.expandable_text},
        "already_uses": list(r.already),
        "fixes": [{"id": x.id, "title": x.title, "effect_bytes": x.effect_bytes,
                   "effect_bound": x.effect_bound, "speed": x.speed, "quality": x.quality,
                   "detail": x.detail} for x in r.fixes],
    }
