"""``DeviceCachingAllocator`` simulated (malloc, free, the OOM path, streams), and replay."""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterable

from oomdoctor.sim.allocator.addresses import AddressSpace
from oomdoctor.sim.allocator.config import AllocatorConfig
from oomdoctor.sim.allocator.pools import _Block, _expandable_size, _ExpSeg, _Pool
from oomdoctor.sim.allocator.results import AllocatorOOM, BlockInfo, ReplayResult, SegmentInfo
from oomdoctor.sim.allocator.sizes import (
    _UNLIMITED,
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    round_size,
    segment_size,
)


class CachingAllocator:
    """Simulates one device's ``DeviceCachingAllocator``.

    Blocks belong to the stream they were allocated on: a request only takes a cached block of
    its own stream (``BlockComparatorSize`` orders by stream first, ``get_free_block`` looks in
    the request's), so each stream has its own pools here. Stream 0 is the default stream;
    FSDP2's reduce-scatter output, for one, is made on its own stream.

    ``limit_bytes`` is how much the allocator may reserve in total (card
    capacity minus CUDA context minus other processes); ``None`` means
    unlimited.  Handles are caller-chosen hashable ids, one per live tensor
    storage.

    Statistics (plain attributes, like ``torch.cuda.memory_stats()``):
    ``allocated_bytes`` (sum of the handed-out blocks' sizes, including an
    unsplit tail), ``reserved_bytes`` (segments obtained from ``cudaMalloc`` /
    mapped pages), ``requested_bytes`` (sum of the unrounded requests), their
    peaks, ``num_alloc_retries`` and ``num_ooms``.
    """

    def __init__(self, config: AllocatorConfig = AllocatorConfig(),
                 limit_bytes: int | None = None, freed_bytes: int = 0) -> None:
        if not isinstance(config, AllocatorConfig):
            raise ValueError(f"config must be an AllocatorConfig, got {config!r}")
        if limit_bytes is not None and (isinstance(limit_bytes, bool)
                                        or not isinstance(limit_bytes, int)
                                        or limit_bytes < 0):
            raise ValueError(f"limit_bytes must be None or an int >= 0, got {limit_bytes!r}")
        self.config = config
        self.limit_bytes = limit_bytes
        self._expandable = config.expandable_segments
        self._max_split = _UNLIMITED if config.max_split_size is None else config.max_split_size
        self._small = _Pool(True)
        self._large = _Pool(False)
        self._pools: dict[int, tuple[_Pool, _Pool]] = {0: (self._small, self._large)}
        self._side: dict[int, _Pool] = {}     # live handle on another stream -> its pool
        self._live: dict[int, _Block] = {}
        self._zero: set[int] = set()  # handles of 0-byte tensors (no block)
        self._next_addr = 1 << 40  # expandable segments' address ranges, increasing
        # cudaMalloc'd segments' addresses (addresses.py: they break best fit's ties)
        self._addresses = AddressSpace(freed=freed_bytes)
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.requested_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    # ------------------------------------------------------------ public API

    def malloc(self, handle: int, nbytes: int, stream: int = 0) -> None:
        """Allocate ``nbytes`` for ``handle`` (``DeviceCachingAllocator::malloc``).

        A 0-byte request is a no-op: PyTorch's ``allocate()`` returns a null
        pointer without calling ``malloc`` for size 0 (its later free is a
        no-op too).  Raises :class:`AllocatorOOM` when the request cannot be
        served within ``limit_bytes``; the allocator stays usable afterwards
        (the cache it released while retrying stays released, as in PyTorch).
        """
        if handle in self._live or handle in self._zero:
            raise ValueError(
                f"malloc: handle {handle!r} is already allocated; free it first or use a "
                f"unique handle per tensor storage."
            )
        if nbytes <= 0:
            if nbytes == 0:
                self._zero.add(handle)
                return
            raise ValueError(f"malloc: nbytes must be >= 0, got {nbytes}")

        size = round_size(nbytes)
        small, large = self._pools[stream] if stream in self._pools else self._new_pools(stream)
        pool = small if size <= K_SMALL_SIZE else large

        # 1. A cached free block (get_free_block).
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_with_retries(pool, size, nbytes)

        # should_split: in the small pool, or with expandable segments, any
        # tail of at least 512 bytes becomes its own free block.  In the large
        # pool the tail must exceed 1 MiB, and the *request*, not the block, must be below
        # max_split_size (c10/cuda/CUDACachingAllocator.cpp, should_split(): size < max_split_size()).
        remaining = block.size - size
        if pool.small or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = remaining > K_SMALL_SIZE and size < self._max_split

        # alloc_found_block: the request takes the front of the block and the
        # tail stays free.  Without a split the whole block is handed out, and
        # the source adds block->size (not the request) to allocated_bytes: an
        # unsplit tail counts as allocated, so max_memory_allocated includes it.
        # requested_bytes gets the caller's unrounded size (orig_size).
        if split:
            tail = block
            block = _Block(tail.addr, size, tail.small, tail.seg)
            prev = tail.prev
            block.prev = prev
            if prev is not None:
                prev.next = block
            block.next = tail
            tail.prev = block
            tail.addr += size
            tail.size = remaining
            pool.add_free(tail)
        block.allocated = True
        block.requested = nbytes
        self._live[handle] = block
        if stream:
            self._side[handle] = pool
        self.allocated_bytes += block.size
        self.requested_bytes += nbytes
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes

    def free(self, handle: int) -> None:
        """Free ``handle``'s block (``free`` / ``free_block``).

        The block merges with free neighbours of the same segment
        (``try_merge_blocks``) and goes back to its pool's cache; the memory
        stays reserved until :meth:`empty_cache` or the OOM retry path.
        """
        block = self._live.pop(handle, None)
        if block is None:
            if handle in self._zero:
                self._zero.discard(handle)
                return
            raise ValueError(
                f"free: handle {handle!r} is not allocated (never allocated, or already "
                f"freed); every free must match an earlier malloc of the same handle."
            )
        self.allocated_bytes -= block.size
        self.requested_bytes -= block.requested
        block.allocated = False
        block.requested = 0
        pool = self._side.pop(handle, None) or (self._small if block.small else self._large)
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.add_free(block)

    def _new_pools(self, stream: int) -> tuple[_Pool, _Pool]:
        self._pools[stream] = (_Pool(True), _Pool(False))
        return self._pools[stream]

    def _all_pools(self, large_first: bool = False) -> list[_Pool]:
        return [p for pair in self._pools.values()
                for p in (pair[::-1] if large_first else pair)]

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()`` (``release_cached_blocks``).

        Returns every wholly free segment to the driver; with expandable
        segments, unmaps every wholly free page.  Segments that still hold a
        live block keep their free parts reserved.
        """
        self._release_cached_blocks()

    def segments(self) -> list[SegmentInfo]:
        """The segments, ordered by address, with their blocks (for tests and
        debugging; like ``torch.cuda.memory_snapshot()``)."""
        blocks: list[_Block] = list(self._live.values())
        for pool in self._all_pools():
            blocks.extend(pool.free.values())
            blocks.extend(pool.unmapped.values())
        out: list[SegmentInfo] = []
        for head in blocks:
            if head.prev is not None and head.prev.mapped:
                continue  # not the first block of a (mapped run of a) segment
            if not head.mapped:
                continue
            infos = []
            b: _Block | None = head
            while b is not None and b.mapped:
                infos.append(BlockInfo(b.size, b.allocated, b.requested))
                b = b.next
            out.append(SegmentInfo(
                address=head.addr,
                size=sum(i.size for i in infos),
                pool="small" if head.small else "large",
                blocks=tuple(infos),
                expandable=head.seg is not None,
            ))
        out.sort(key=lambda s: s.address)
        return out

    # ------------------------------------------------------------ internals

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        # get_free_block: lower_bound on (size, address) = the smallest free
        # block that fits, the lowest address among equals (best fit).
        keys = pool.keys
        i = bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        free = pool.free
        block = free[keys[i][1]]
        if self._expandable:
            # With expandable segments, a free block followed by unmapped
            # address space counts as its size plus that space, so the block
            # at the growing end of the segment is chosen last: step forward
            # while the next candidate "expands" to less.
            exp_size = _expandable_size
            cur = exp_size(block)
            n = len(keys)
            while i + 1 < n:
                cand = free[keys[i + 1][1]]
                c = exp_size(cand)
                if c >= cur:
                    break
                i += 1
                block, cur = cand, c
        mss = self._max_split
        # Oversize rules: a request below max_split_size never takes a block
        # of at least max_split_size; a request at or above it only takes a
        # block less than 20 MiB (kLargeBuffer) larger than itself.  Larger
        # blocks only come after this one in the order, so PyTorch gives up
        # here rather than searching on.
        if size < mss:
            if block.size >= mss:
                return None
        elif block.size >= size + K_LARGE_BUFFER:
            return None
        pool.remove_free(block)
        return block

    def _alloc_with_retries(self, pool: _Pool, size: int, nbytes: int) -> _Block:
        # The rest of DeviceCachingAllocator::malloc: cudaMalloc a new segment
        # (alloc_block); if that fails, free cached oversize blocks and retry
        # (release_available_cached_blocks, only when max_split_size is set);
        # if that fails, free every wholly free cached segment and retry
        # (release_cached_blocks + alloc_block(isRetry=true), which counts a
        # num_alloc_retries whether or not it then succeeds); then OOM.
        alloc_size = segment_size(size)
        block = self._alloc_block(pool, size, alloc_size)
        if block is not None:
            return block
        # With expandable segments every cached block lives in an expandable
        # segment, which release_available_cached_blocks skips (newer sources
        # skip them explicitly; older ones would assert in release_block), so
        # that step cannot free anything.
        if self._max_split != _UNLIMITED and not self._expandable:
            if self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size, alloc_size)
                if block is not None:
                    return block
        self._release_cached_blocks()
        self.num_alloc_retries += 1
        block = self._alloc_block(pool, size, alloc_size)
        if block is not None:
            return block
        self.num_ooms += 1
        raise AllocatorOOM(
            requested=size,
            segment_size=alloc_size,
            allocated=self.allocated_bytes,
            reserved=self.reserved_bytes,
            limit=self.limit_bytes if self.limit_bytes is not None else 0,
            nbytes=nbytes,
        )

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> _Block | None:
        """alloc_block: a new segment, or (expandable) more mapped pages.
        Returns the block to serve ``size`` from (not in the free set)."""
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size)
        limit = self.limit_bytes
        if limit is not None and self.reserved_bytes + alloc_size > limit:
            return None  # cudaMalloc fails with cudaErrorMemoryAllocation
        addr = self._addresses.place(alloc_size)
        self._add_reserved(alloc_size)
        return _Block(addr, alloc_size, pool.small, None)

    def _add_reserved(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        if self.reserved_bytes > self.peak_reserved_bytes:
            self.peak_reserved_bytes = self.reserved_bytes

    def _merge(self, pool: _Pool, dst: _Block, src: _Block | None) -> None:
        # try_merge_blocks: absorb a free neighbour in the same state (mapped
        # or unmapped) into dst.  dst must not be in any of the pool's sets.
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            pool.remove_free(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _release_segment(self, pool: _Pool, block: _Block) -> None:
        # release_block: cudaFree a wholly free (unsplit) cudaMalloc segment.
        pool.remove_free(block)
        self.reserved_bytes -= block.size
        self._addresses.release(block.addr, block.size)

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        # release_available_cached_blocks: free the smallest cached block of at
        # least max(size, max_split_size); if there is none, free oversize
        # blocks from the largest down until that many bytes were freed.
        # (Cached blocks this large are always whole segments: a split in the
        # large pool needs a request below max_split_size and leaves a tail
        # that cannot reach it.)
        mss = self._max_split
        key = size if size >= mss else mss
        keys = pool.keys
        i = bisect_left(keys, (key, -1))
        if i < len(keys):
            block = pool.free[keys[i][1]]
            if block.prev is not None or block.next is not None:
                return False  # defensive; cannot happen, see above
            self._release_segment(pool, block)
            return True
        released = 0
        j = i - 1
        while released < key and j >= 0 and keys[j][0] >= mss:
            block = pool.free[keys[j][1]]
            if block.prev is None and block.next is None:
                released += block.size
                self._release_segment(pool, block)  # deletes keys[j] only
            j -= 1
        return released >= key

    def _release_cached_blocks(self) -> None:
        # release_cached_blocks -> release_blocks for each pool: cudaFree every
        # free block that is a whole segment (no prev/next); for expandable
        # segments, unmap the whole pages inside every free block.
        for pool in self._all_pools(large_first=True):
            if self._expandable:
                for block in list(pool.free.values()):
                    self._unmap_block(pool, block)
            else:
                for block in [b for b in pool.free.values()
                              if b.prev is None and b.next is None]:
                    self._release_segment(pool, block)

    # ---------------------------------------------------- expandable segments

    def _expandable_segment(self, pool: _Pool) -> _ExpSeg:
        seg = pool.exp_seg
        if seg is None:
            page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
            seg = _ExpSeg(self._next_addr, page)
            self._next_addr += seg.size
            pool.exp_seg = seg
            tail = _Block(seg.base, seg.size, pool.small, seg)
            tail.mapped = False
            pool.add_unmapped(tail)
        return seg

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        # find_expandable_block: the lowest address where a free block and/or
        # unmapped range(s) give room for size bytes; an unmapped range right
        # after a free block starts at that free block.
        self._expandable_segment(pool)
        unmapped = pool.unmapped
        for addr in pool.unmapped_addrs:
            c = unmapped[addr]
            p = c.prev
            if p is not None and not p.allocated:
                c = p
            room = 0
            b: _Block | None = c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
        raise AssertionError("expandable segment address space exhausted")  # pragma: no cover

    def _map_block(self, pool: _Pool, to_map: _Block, size: int) -> bool:
        # map_block: map whole pages at the start of an unmapped range (it is
        # page aligned), merge them with free neighbours, and count them as
        # reserved.  Fails like cuMemCreate when the limit would be exceeded.
        page = to_map.seg.page
        mapped = -(-size // page) * page
        limit = self.limit_bytes
        if limit is not None and self.reserved_bytes + mapped > limit:
            return False
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, pool.small, to_map.seg)
            rest.mapped = False
            rest.prev = to_map
            rest.next = to_map.next
            if rest.next is not None:
                rest.next.prev = rest
            to_map.next = rest
            pool.add_unmapped(rest)
            to_map.size = mapped
        self._merge(pool, to_map, to_map.prev)
        self._merge(pool, to_map, to_map.next)
        pool.add_free(to_map)
        self._add_reserved(mapped)
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        # try_allocate_expandable_block: take the candidate from
        # find_expandable_block and map pages after it (map_block) until it
        # holds size bytes.  This is how the segment grows at its end, reusing
        # a trailing free block (the source has no function called "map_more";
        # this pair of functions is that step).  Pages mapped before a failure
        # stay mapped, as in the source.
        c = self._find_expandable_block(pool, size)
        if not c.mapped:
            if not self._map_block(pool, c, min(c.size, size)):
                return None
        while c.size < size:
            nxt = c.next  # unmapped, by construction of the candidate
            if not self._map_block(pool, nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt  # nxt absorbed c in map_block's merge
        pool.remove_free(c)
        return c

    def _unmap_block(self, pool: _Pool, block: _Block) -> None:
        # unmap_block: unmap the whole pages inside a free block; the
        # unaligned ends stay mapped as free blocks of their own.
        seg = block.seg
        page, base = seg.page, seg.base
        off = block.addr - base
        begin = base + -(-off // page) * page
        end = base + ((off + block.size) // page) * page
        if begin >= end:
            return
        pool.remove_free(block)
        if begin > block.addr:
            before = _Block(block.addr, begin - block.addr, pool.small, seg)
            before.prev = block.prev
            if before.prev is not None:
                before.prev.next = before
            before.next = block
            block.prev = before
            pool.add_free(before)
        after_size = block.addr + block.size - end
        if after_size > 0:
            after = _Block(end, after_size, pool.small, seg)
            after.next = block.next
            if after.next is not None:
                after.next.prev = after
            after.prev = block
            block.next = after
            pool.add_free(after)
        block.addr = begin
        block.size = end - begin
        block.mapped = False
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.add_unmapped(block)
        self.reserved_bytes -= end - begin

    # ----------------------------------------------------------- self check

    def _check_invariants(self) -> None:
        """Assert the internal structure is consistent (used by the tests)."""
        allocated = sum(b.size for b in self._live.values())
        requested = sum(b.requested for b in self._live.values())
        assert allocated == self.allocated_bytes, (allocated, self.allocated_bytes)
        assert requested == self.requested_bytes
        segs = self.segments()
        reserved = sum(s.size for s in segs)
        assert reserved == self.reserved_bytes, (reserved, self.reserved_bytes)
        assert self.reserved_bytes >= self.allocated_bytes >= self.requested_bytes >= 0
        assert self.peak_reserved_bytes >= self.reserved_bytes
        assert self.peak_allocated_bytes >= self.allocated_bytes
        for s in segs:
            for a, b in zip(s.blocks, s.blocks[1:]):
                assert a.allocated or b.allocated, "two adjacent free blocks"
        for pool in self._all_pools():
            assert pool.keys == sorted((b.size, b.addr) for b in pool.free.values())
            for addr, b in pool.free.items():
                assert b.addr == addr and b.mapped and not b.allocated
            for addr, b in pool.unmapped.items():
                assert b.addr == addr and not b.mapped and not b.allocated
                assert b.addr % b.seg.page == b.seg.base % b.seg.page


# --------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------


# The handle of a free event that stands for ``torch.cuda.empty_cache()`` in an event list
# (DeepSpeed's stage 3 empties the cache as it moves its partitions into one buffer). Far below
# any storage's handle: oomdoctor.runs.onbuild numbers construction's storages -1, -2, ..., and
# at -1 the free of a tied weight's first copy became an empty_cache that kept the copy alive.
EMPTY_CACHE = -(1 << 62)


def replay(events: Iterable[tuple[bool, int, int]],
           config: AllocatorConfig = AllocatorConfig(),
           limit_bytes: int | None = None, streams: dict[int, int] | None = None,
           freed_bytes: int = 0) -> ReplayResult:
    """Replay ``(is_alloc, handle, nbytes)`` events through a fresh allocator.

    For frees, ``nbytes`` is ignored.  ``streams``: handle -> the stream it is allocated on,
    for those not on the default stream.  Stops at the first OOM, which is
    returned in the result (not raised) together with its event index.
    A free of :data:`EMPTY_CACHE` empties the cache. ``freed_bytes``: the address range
    earlier runs in the same process took and returned (:class:`AddressSpace`); 0, a fresh
    process.
    """
    alloc = CachingAllocator(config, limit_bytes, freed_bytes)
    malloc = alloc.malloc
    if streams:
        def malloc(handle: int, nbytes: int) -> None:
            alloc.malloc(handle, nbytes, streams.get(handle, 0))
    free = alloc.free
    peak_a = peak_r = 0
    idx_a = idx_r = 0
    for i, (is_alloc, handle, nbytes) in enumerate(events):
        if is_alloc:
            try:
                malloc(handle, nbytes)
            except AllocatorOOM as oom:
                return ReplayResult(peak_a, peak_r, idx_a, idx_r, alloc.num_alloc_retries,
                                    oom, i)
            # Peaks can only rise on a malloc.
            if alloc.peak_allocated_bytes > peak_a:
                peak_a = alloc.peak_allocated_bytes
                idx_a = i
            if alloc.peak_reserved_bytes > peak_r:
                peak_r = alloc.peak_reserved_bytes
                idx_r = i
        elif handle == EMPTY_CACHE:
            alloc.empty_cache()
        else:
            free(handle)
    return ReplayResult(peak_a, peak_r, idx_a, idx_r, alloc.num_alloc_retries, None, None)
