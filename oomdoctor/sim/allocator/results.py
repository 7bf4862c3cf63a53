"""What the simulator reports: the simulated OOM error, segment snapshots, a replay's result."""

from __future__ import annotations

from dataclasses import dataclass

from oomdoctor.sim.allocator.sizes import format_size


class AllocatorOOM(Exception):
    """``torch.cuda.OutOfMemoryError`` as the simulator sees it.

    Raised by :meth:`CachingAllocator.malloc` after every retry of
    ``malloc`` failed.  ``requested`` is the rounded request; ``segment_size``
    the size ``cudaMalloc`` was asked for (PyTorch's "Tried to allocate");
    ``allocated`` / ``reserved`` the allocator's state at the time of the
    error, i.e. *after* the retry path released the cache, exactly what
    PyTorch prints; ``limit`` the ``limit_bytes`` in force.
    """

    def __init__(
        self,
        requested: int,
        segment_size: int,
        allocated: int,
        reserved: int,
        limit: int,
        nbytes: int | None = None,
    ) -> None:
        self.requested = requested
        self.segment_size = segment_size
        self.allocated = allocated
        self.reserved = reserved
        self.limit = limit
        self.nbytes = requested if nbytes is None else nbytes
        super().__init__(
            f"CUDA out of memory (simulated). Tried to allocate {format_size(segment_size)} "
            f"(request of {self.nbytes} bytes, a {format_size(requested)} block). The "
            f"allocator may reserve {format_size(limit)} in total. Of the allocated memory "
            f"{format_size(allocated)} is allocated by PyTorch, and "
            f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated."
        )

    def __reduce__(self):  # keep it picklable despite the custom __init__
        return (
            type(self),
            (self.requested, self.segment_size, self.allocated, self.reserved, self.limit,
             self.nbytes),
        )


@dataclass(frozen=True)
class BlockInfo:
    size: int
    allocated: bool
    requested: int  # bytes the caller asked for (0 for a free block)


@dataclass(frozen=True)
class SegmentInfo:
    """One segment (for expandable segments: one contiguous mapped range,
    as ``torch.cuda.memory_snapshot()`` reports them)."""

    address: int
    size: int
    pool: str  # 'small' or 'large'
    blocks: tuple[BlockInfo, ...]
    expandable: bool = False


@dataclass(frozen=True)
class ReplayResult:
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    # Index of the event at which each peak was first reached (0 when the
    # peak is 0, i.e. nothing was ever allocated).
    peak_allocated_index: int
    peak_reserved_index: int
    num_alloc_retries: int
    oom: AllocatorOOM | None  # first OOM hit (the replay stops there)
    oom_index: int | None
