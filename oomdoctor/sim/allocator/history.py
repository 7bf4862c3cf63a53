"""A replay that keeps the allocator's actions and its final segments: what a memory snapshot holds.

``torch.cuda.memory._record_memory_history()`` makes the caching allocator log every action it
takes (``TraceEntry`` in c10/cuda/CUDACachingAllocator.h: alloc, free_requested,
free_completed, segment_alloc, segment_free, segment_map, segment_unmap, oom), and
``torch.cuda.memory._snapshot()`` adds the segments with their blocks at the moment it is
called. :func:`replay_history` replays events like :func:`oomdoctor.sim.allocator.replay` and
records the same actions, with the simulated addresses, and the segments where the replay ends
(at the end of the events, or at the first OOM, as the OOM observer would see them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from oomdoctor.sim.allocator.caching import EMPTY_CACHE, CachingAllocator
from oomdoctor.sim.allocator.config import AllocatorConfig
from oomdoctor.sim.allocator.pools import _Block, _Pool
from oomdoctor.sim.allocator.results import AllocatorOOM, SegmentInfo


@dataclass(frozen=True)
class Action:
    """One entry of the allocator's history. ``index`` is the replayed event it belongs to;
    ``handle`` the storage of an alloc or free (None for segment actions and the OOM)."""

    action: str        # alloc | free | segment_alloc | segment_free | segment_map | segment_unmap | oom
    addr: int
    size: int          # block size for alloc/free (rounded, as max_memory_allocated counts it)
    index: int
    handle: int | None = None
    requested: int = 0  # the caller's bytes
    device_free: int = 0  # an oom's room left under the limit (torch: what CUDA reports free)


@dataclass(frozen=True)
class History:
    actions: tuple[Action, ...]
    segments: tuple[SegmentInfo, ...]   # where the replay stopped
    block_handles: dict[int, int]       # address of each live block -> its handle, at that point
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_allocated_index: int           # event index where max_memory_allocated was first reached
    oom: AllocatorOOM | None
    oom_index: int | None


class _Recording(CachingAllocator):
    """The caching allocator with a log of its segment actions (the block actions are logged
    by :func:`replay_history`, which knows the event index)."""

    def __init__(self, config: AllocatorConfig, limit_bytes: int | None) -> None:
        super().__init__(config, limit_bytes)
        self.log: list[Action] = []
        self.index = 0

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> _Block | None:
        block = super()._alloc_block(pool, size, alloc_size)
        if block is not None and not self._expandable:
            self.log.append(Action("segment_alloc", block.addr, block.size, self.index))
        return block

    def _release_segment(self, pool: _Pool, block: _Block) -> None:
        self.log.append(Action("segment_free", block.addr, block.size, self.index))
        super()._release_segment(pool, block)

    def _map_block(self, pool: _Pool, to_map: _Block, size: int) -> bool:
        addr, page = to_map.addr, to_map.seg.page
        ok = super()._map_block(pool, to_map, size)
        if ok:
            self.log.append(Action("segment_map", addr, -(-size // page) * page, self.index))
        return ok

    def _unmap_block(self, pool: _Pool, block: _Block) -> None:
        # The first whole page inside the block, as _unmap_block computes it.
        seg = block.seg
        begin = seg.base + -(-(block.addr - seg.base) // seg.page) * seg.page
        before = self.reserved_bytes
        super()._unmap_block(pool, block)
        if self.reserved_bytes < before:
            self.log.append(Action("segment_unmap", begin, before - self.reserved_bytes,
                                   self.index))


def replay_history(events: Iterable[tuple[bool, int, int]],
                   config: AllocatorConfig = AllocatorConfig(),
                   limit_bytes: int | None = None) -> History:
    """Replay ``(is_alloc, handle, nbytes)`` events and keep every action the allocator took.
    Stops at the first OOM, which ends the history with an ``oom`` action."""
    alloc = _Recording(config, limit_bytes)
    log = alloc.log
    peak, peak_index = 0, 0
    oom, oom_index = None, None
    for i, (is_alloc, handle, nbytes) in enumerate(events):
        alloc.index = i
        if not is_alloc and handle == EMPTY_CACHE:
            alloc.empty_cache()
            continue
        if not is_alloc:
            block = alloc._live.get(handle)
            if block is not None:     # a 0-byte tensor never reaches the allocator
                # Logged before the free: free() merges the block with its free neighbours.
                log.append(Action("free", block.addr, block.size, i, handle, block.requested))
            alloc.free(handle)
            continue
        try:
            alloc.malloc(handle, nbytes)
        except AllocatorOOM as e:
            free = (limit_bytes or 0) - alloc.reserved_bytes
            log.append(Action("oom", 0, e.segment_size, i, handle, nbytes, max(free, 0)))
            oom, oom_index = e, i
            break
        block = alloc._live.get(handle)
        if block is not None:
            log.append(Action("alloc", block.addr, block.size, i, handle, nbytes))
        if alloc.peak_allocated_bytes > peak:
            peak, peak_index = alloc.peak_allocated_bytes, i
    handles = {b.addr: h for h, b in alloc._live.items()}
    return History(tuple(log), tuple(alloc.segments()), handles, alloc.peak_allocated_bytes,
                   alloc.peak_reserved_bytes, peak_index, oom, oom_index)
