"""The allocator's blocks, expandable segments and per-pool free-block sets."""

from __future__ import annotations

from bisect import bisect_left, insort

from oomdoctor.sim.allocator.sizes import _EXPANDABLE_PAGES


class _ExpSeg:
    """An expandable segment: a virtual address range mapped page by page."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int) -> None:
        self.base = base
        self.page = page
        self.size = page * _EXPANDABLE_PAGES


class _Block:
    __slots__ = ("addr", "size", "small", "seg", "prev", "next", "allocated", "mapped",
                 "requested")

    def __init__(self, addr: int, size: int, small: bool, seg: _ExpSeg | None) -> None:
        self.addr = addr
        self.size = size
        self.small = small
        self.seg = seg  # None for a cudaMalloc segment
        self.prev: _Block | None = None  # neighbours inside the segment
        self.next: _Block | None = None
        self.allocated = False
        self.mapped = True
        self.requested = 0


def _expandable_size(b: _Block) -> int:
    # get_free_block's expandable_size: a free block's size plus the unmapped
    # range right after it (the room it could grow into).
    nxt = b.next
    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


class _Pool:
    """Free blocks of one pool, ordered like PyTorch's ``BlockPool::blocks``
    (by size, then address), plus the unmapped ranges of its expandable
    segment ordered by address (``BlockPool::unmapped``)."""

    __slots__ = ("small", "keys", "free", "unmapped_addrs", "unmapped", "exp_seg")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []  # sorted (size, addr) of free blocks
        self.free: dict[int, _Block] = {}  # addr -> free block
        self.unmapped_addrs: list[int] = []
        self.unmapped: dict[int, _Block] = {}
        self.exp_seg: _ExpSeg | None = None

    def add_free(self, b: _Block) -> None:
        insort(self.keys, (b.size, b.addr))
        self.free[b.addr] = b

    def remove_free(self, b: _Block) -> None:
        keys = self.keys
        del keys[bisect_left(keys, (b.size, b.addr))]
        del self.free[b.addr]

    def add_unmapped(self, b: _Block) -> None:
        insort(self.unmapped_addrs, b.addr)
        self.unmapped[b.addr] = b

    def remove_unmapped(self, b: _Block) -> None:
        addrs = self.unmapped_addrs
        del addrs[bisect_left(addrs, b.addr)]
        del self.unmapped[b.addr]
