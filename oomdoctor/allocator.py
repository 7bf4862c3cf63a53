"""A pure-Python simulator of PyTorch's CUDA caching allocator.

It reproduces the bookkeeping of ``DeviceCachingAllocator`` in
``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x) for one device and one
stream, so that ``torch.cuda.max_memory_allocated()`` /
``max_memory_reserved()`` and the point of an out-of-memory error can be
predicted from a trace of tensor allocations and frees, without a GPU.

What is modelled, and where it comes from in the C++ source:

* ``round_size``: every request is rounded up to a multiple of 512 bytes.
* ``get_pool``: requests of at most 1 MiB (after rounding) use the *small*
  pool, the rest the *large* pool; a block never moves between pools.
* ``get_allocation_size`` (here :func:`segment_size`): the size asked from
  ``cudaMalloc`` when no cached block fits.
* ``get_free_block``: best fit (the smallest free block that is large enough,
  ties broken by the lower address), plus the ``max_split_size`` "oversize"
  rules.
* ``should_split`` / ``alloc_found_block``: whether the unused tail of the
  chosen block becomes a separate free block, and the statistics.
* ``free_block`` / ``try_merge_blocks``: a freed block merges with the free
  neighbours of its segment.
* ``malloc`` / ``alloc_block`` / ``release_available_cached_blocks`` /
  ``release_cached_blocks``: the order in which the allocator tries cached
  blocks, new segments and the two "free the cache and retry" steps before
  raising an out-of-memory error.
* Expandable segments (``expandable_segments:True``): ``find_expandable_block``,
  ``map_block``, ``try_allocate_expandable_block`` and ``unmap_block``, with
  pages of 2 MiB (small pool) and 20 MiB (large pool).

Simplifications (none of them changes the numbers for the ordinary case of
one stream and no CUDA graphs):

* One device, one stream; no ``record_stream`` events, no CUDA graph private
  pools, no ``torch.cuda.MemPool``.
* ``cudaMalloc`` never fails for fragmentation of the device memory: it
  succeeds exactly when ``reserved + segment size <= limit_bytes``.  The
  driver-level limit is the only notion of "capacity"; the GPU's own
  rounding of ``cudaMalloc`` sizes (to 2 MiB pages) is not added.
* ``cudaMalloc`` addresses are handed out in increasing order and never
  reused; they only matter to break ties between equally sized free blocks.
* An expandable segment has an (effectively) unbounded virtual address
  range, where PyTorch reserves 1 1/8 of the GPU's memory; so a second
  expandable segment per pool is never needed.  Free pages anywhere in the
  segment (not only at its end) are unmapped by ``empty_cache`` and by the
  OOM retry, and later mappings fill the lowest-address holes first, as in
  ``find_expandable_block``.
* ``garbage_collection_threshold``, ``roundup_power2_divisions``,
  ``max_non_split_rounding_mb`` and ``backend:cudaMallocAsync`` are not
  modelled: :meth:`AllocatorConfig.from_env` rejects them instead of
  silently producing numbers that would differ from the real run.
"""

from __future__ import annotations

import difflib
from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Iterable

__all__ = [
    "KiB",
    "MiB",
    "GiB",
    "K_MIN_BLOCK_SIZE",
    "K_SMALL_SIZE",
    "K_SMALL_BUFFER",
    "K_MIN_LARGE_ALLOC",
    "K_LARGE_BUFFER",
    "K_ROUND_LARGE",
    "AllocatorConfig",
    "AllocatorOOM",
    "BlockInfo",
    "SegmentInfo",
    "CachingAllocator",
    "ReplayResult",
    "format_size",
    "replay",
    "round_size",
    "segment_size",
]

KiB = 1024
MiB = 1024**2
GiB = 1024**3

# The constants of CUDACachingAllocator.cpp.
K_MIN_BLOCK_SIZE = 512  # every block is a multiple of this
K_SMALL_SIZE = 1 * MiB  # largest request served by the small pool
K_SMALL_BUFFER = 2 * MiB  # small-pool segment size (and expandable small page)
K_MIN_LARGE_ALLOC = 10 * MiB  # requests below this share 20 MiB segments
K_LARGE_BUFFER = 20 * MiB  # that shared segment size (and expandable large page)
K_ROUND_LARGE = 2 * MiB  # larger requests get a segment rounded up to this

# "No max_split_size": PyTorch stores SIZE_MAX; any int comparison works the
# same with infinity.
_UNLIMITED = float("inf")

# Expandable segments: number of pages of virtual address space per segment.
# PyTorch reserves 1 1/8 of the GPU's memory; we cannot know the GPU, so we
# reserve far more than any GPU has (2**24 pages = 32 TiB / 320 TiB).
_EXPANDABLE_PAGES = 1 << 24


# --------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------


def round_size(nbytes: int) -> int:
    """Size of the block a request of ``nbytes`` needs (``round_size``).

    Below 512 bytes the answer is 512; otherwise ``nbytes`` rounded up to a
    multiple of 512.  (PyTorch can instead round to power-of-two divisions
    when ``roundup_power2_divisions`` is set; that knob is not modelled.)
    ``round_size(0)`` is 512 as in the C++ code, but note that PyTorch never
    calls the allocator for a 0-byte tensor.
    """
    if nbytes < 0:
        raise ValueError(f"round_size: nbytes must be >= 0, got {nbytes}")
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def segment_size(rounded: int) -> int:
    """Size of the segment ``cudaMalloc`` is asked for (``get_allocation_size``).

    ``rounded`` is the output of :func:`round_size`.  Small requests
    (<= 1 MiB) get a 2 MiB segment; requests below 10 MiB a 20 MiB segment
    (so that several of them share it); larger ones their own size rounded up
    to 2 MiB.  This is also the size printed as "Tried to allocate X" in the
    OOM message, even with expandable segments.
    """
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-rounded // K_ROUND_LARGE) * K_ROUND_LARGE


def format_size(nbytes: int) -> str:
    """Format a byte count the way PyTorch's OOM message does (``format_size``)."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= MiB:
        return f"{nbytes / KiB:.2f} KiB"
    if nbytes <= GiB:
        return f"{nbytes / MiB:.2f} MiB"
    return f"{nbytes / GiB:.2f} GiB"


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------

_ENV = "PYTORCH_CUDA_ALLOC_CONF"

# Keys PyTorch accepts that change how device memory is laid out, but that
# this simulator does not reproduce.  Accepting them silently would give
# numbers that differ from the real run, so they are refused.
_NOT_MODELLED = {
    "garbage_collection_threshold": (
        "it makes the allocator free old cached blocks before cudaMalloc once a "
        "memory fraction is set"
    ),
    "roundup_power2_divisions": (
        "it changes how request sizes are rounded (power-of-two divisions instead "
        "of multiples of 512 bytes)"
    ),
    "max_non_split_rounding_mb": (
        "it changes how much larger than the request an oversize cached block may be"
    ),
}

# Keys PyTorch accepts that do not change device-memory accounting (they
# concern the pinned host allocator, or locking): validated, then ignored
# because they have no effect on what is simulated.
_NO_EFFECT_BOOL = {
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_background_threads",
    "graph_capture_record_stream_reuse",
}
_NO_EFFECT_INT = {"pinned_num_register_threads", "pinned_reserve_segment_size_mb"}

_MODELLED = {"expandable_segments", "max_split_size_mb", "backend"}
_KNOWN_KEYS = sorted(_MODELLED | set(_NOT_MODELLED) | _NO_EFFECT_BOOL | _NO_EFFECT_INT)


def _tokenize(value: str) -> list[str]:
    # Same lexing as PyTorch's ConfigTokenizer: ',', ':', '[' and ']' are
    # tokens of their own, whitespace is dropped, anything else is glued.
    tokens: list[str] = []
    buf: list[str] = []
    for ch in value:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` settings the simulator models.

    ``expandable_segments``: one growing segment per pool instead of one
    ``cudaMalloc`` per segment.  ``max_split_size``: in bytes; blocks at least
    this large are "oversize" (see ``get_free_block`` / ``should_split``);
    ``None`` means unlimited, PyTorch's default.  PyTorch only accepts values
    of at least 20 MiB (``max_split_size_mb >= 20``).
    """

    expandable_segments: bool = False
    max_split_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.expandable_segments, bool):
            raise ValueError(
                f"AllocatorConfig.expandable_segments must be a bool, got "
                f"{self.expandable_segments!r}; pass True or False."
            )
        mss = self.max_split_size
        if mss is not None:
            if isinstance(mss, bool) or not isinstance(mss, int):
                raise ValueError(
                    f"AllocatorConfig.max_split_size must be an int number of bytes or "
                    f"None, got {mss!r}; for max_split_size_mb:N pass N * MiB."
                )
            if mss < K_LARGE_BUFFER:
                raise ValueError(
                    f"AllocatorConfig.max_split_size={mss} bytes is below 20 MiB; PyTorch "
                    f"refuses max_split_size_mb below 20 (kLargeBuffer), so such an "
                    f"allocator cannot exist. Use at least {K_LARGE_BUFFER} bytes, or None."
                )

    @classmethod
    def from_env(cls, value: str) -> "AllocatorConfig":
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string.

        Example: ``"expandable_segments:True,max_split_size_mb:128"``.  The
        grammar is PyTorch's (``key:value`` pairs separated by commas,
        whitespace ignored, ``True``/``False`` spelled exactly so).  Raises
        :class:`ValueError` for unknown keys, malformed values, and keys that
        PyTorch knows but this simulator does not model.  Keys that only
        affect the pinned host allocator or locking
        (``release_lock_on_cudamalloc``, ``pinned_*``,
        ``graph_capture_record_stream_reuse``) are validated and accepted,
        since they do not change device memory.  ``backend:native`` is the
        modelled allocator and accepted; ``backend:cudaMallocAsync`` is not.
        """
        if not isinstance(value, str):
            raise ValueError(f"{_ENV} must be a string, got {type(value).__name__}")
        tokens = _tokenize(value)
        expandable = False
        max_split: int | None = None
        i = 0
        n = len(tokens)
        while i < n:
            key = tokens[i]
            if key in ",:[]":
                raise ValueError(
                    f"{_ENV}={value!r}: expected an option name at token {i + 1}, found "
                    f"{key!r}. The format is key:value pairs separated by commas, e.g. "
                    f"'expandable_segments:True,max_split_size_mb:128'."
                )
            if key not in _KNOWN_KEYS:
                close = difflib.get_close_matches(key, _KNOWN_KEYS, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"{_ENV}={value!r}: unknown option {key!r}; PyTorch would refuse it "
                    f"('Unrecognized key').{hint} Known options: {', '.join(_KNOWN_KEYS)}."
                )
            if key in _NOT_MODELLED:
                raise ValueError(
                    f"{_ENV}={value!r}: option {key!r} exists in PyTorch but is not "
                    f"modelled by oomdoctor's allocator simulator ({_NOT_MODELLED[key]}), so "
                    f"a prediction would differ from the real run. Remove {key!r} from the "
                    f"string given to oomdoctor; modelled options are expandable_segments "
                    f"and max_split_size_mb."
                )
            if i + 1 >= n or tokens[i + 1] != ":":
                raise ValueError(
                    f"{_ENV}={value!r}: option {key!r} needs a value, written "
                    f"'{key}:VALUE'."
                )
            if i + 2 >= n or tokens[i + 2] in ",:[]":
                raise ValueError(
                    f"{_ENV}={value!r}: option {key!r} has no value after ':' (lists in "
                    f"[...] are only used by options this simulator does not model)."
                )
            val = tokens[i + 2]
            if key == "expandable_segments" or key in _NO_EFFECT_BOOL:
                if val not in ("True", "False"):
                    raise ValueError(
                        f"{_ENV}={value!r}: {key} must be True or False (capitalised, as "
                        f"PyTorch requires), got {val!r}."
                    )
                if key == "expandable_segments":
                    expandable = val == "True"
            elif key == "max_split_size_mb" or key in _NO_EFFECT_INT:
                if not val.isdigit():
                    raise ValueError(
                        f"{_ENV}={value!r}: {key} must be a whole number"
                        f"{' of MiB' if key.endswith('_mb') else ''}, got {val!r}."
                    )
                num = int(val)
                if key == "max_split_size_mb":
                    if num < K_LARGE_BUFFER // MiB:
                        raise ValueError(
                            f"{_ENV}={value!r}: max_split_size_mb:{num} is too small; "
                            f"PyTorch requires max_split_size_mb >= {K_LARGE_BUFFER // MiB} "
                            f"(the 20 MiB large-segment size) and refuses to start otherwise. "
                            f"Use a value of at least {K_LARGE_BUFFER // MiB}, or drop the "
                            f"option (unlimited)."
                        )
                    max_split = num * MiB
                elif key == "pinned_num_register_threads" and (num & (num - 1) or num == 0):
                    raise ValueError(
                        f"{_ENV}={value!r}: pinned_num_register_threads must be a power of "
                        f"2, got {num}."
                    )
                elif key == "pinned_reserve_segment_size_mb" and num == 0:
                    raise ValueError(
                        f"{_ENV}={value!r}: pinned_reserve_segment_size_mb must be > 0."
                    )
            elif key == "backend":
                if val == "cudaMallocAsync":
                    raise ValueError(
                        f"{_ENV}={value!r}: backend:cudaMallocAsync exists in PyTorch but is "
                        f"not modelled by oomdoctor's allocator simulator (the CUDA driver's "
                        f"stream-ordered pool replaces the caching allocator, so its reserved "
                        f"memory follows different rules). Drop the option or use "
                        f"backend:native to simulate the default caching allocator."
                    )
                if val != "native":
                    raise ValueError(
                        f"{_ENV}={value!r}: unknown allocator backend {val!r}; PyTorch's "
                        f"options are native and cudaMallocAsync."
                    )
            i += 3
            if i < n:
                if tokens[i] != ",":
                    raise ValueError(
                        f"{_ENV}={value!r}: expected ',' after {key}:{val}, found "
                        f"{tokens[i]!r}. Separate options with commas."
                    )
                i += 1
                if i == n:
                    raise ValueError(
                        f"{_ENV}={value!r}: trailing ',' with no option after it."
                    )
        return cls(expandable_segments=expandable, max_split_size=max_split)


# --------------------------------------------------------------------------
# Results and errors
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# The allocator
# --------------------------------------------------------------------------


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


class CachingAllocator:
    """Simulates one device's ``DeviceCachingAllocator`` on a single stream.

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
                 limit_bytes: int | None = None) -> None:
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
        self._live: dict[int, _Block] = {}
        self._zero: set[int] = set()  # handles of 0-byte tensors (no block)
        self._next_addr = 1 << 40  # fake device addresses, increasing
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.requested_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    # ------------------------------------------------------------ public API

    def malloc(self, handle: int, nbytes: int) -> None:
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
        pool = self._small if size <= K_SMALL_SIZE else self._large

        # 1. A cached free block (get_free_block).
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_with_retries(pool, size, nbytes)

        # should_split: in the small pool, or with expandable segments, any
        # tail of at least 512 bytes becomes its own free block.  In the large
        # pool the tail must exceed 1 MiB, and the *request* (not the block,
        # as docs/allocator.md puts it) must be below max_split_size.
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
        pool = self._small if block.small else self._large
        self._merge(pool, block, block.prev)
        self._merge(pool, block, block.next)
        pool.add_free(block)

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
        for pool in (self._small, self._large):
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
        addr = self._next_addr
        self._next_addr += -(-alloc_size // K_ROUND_LARGE) * K_ROUND_LARGE
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
        for pool in (self._large, self._small):
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
        for pool in (self._small, self._large):
            assert pool.keys == sorted((b.size, b.addr) for b in pool.free.values())
            for addr, b in pool.free.items():
                assert b.addr == addr and b.mapped and not b.allocated
            for addr, b in pool.unmapped.items():
                assert b.addr == addr and not b.mapped and not b.allocated
                assert b.addr % b.seg.page == b.seg.base % b.seg.page


# --------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------


def replay(events: Iterable[tuple[bool, int, int]],
           config: AllocatorConfig = AllocatorConfig(),
           limit_bytes: int | None = None) -> ReplayResult:
    """Replay ``(is_alloc, handle, nbytes)`` events through a fresh allocator.

    For frees, ``nbytes`` is ignored.  Stops at the first OOM, which is
    returned in the result (not raised) together with its event index.
    """
    alloc = CachingAllocator(config, limit_bytes)
    malloc = alloc.malloc
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
        else:
            free(handle)
    return ReplayResult(peak_a, peak_r, idx_a, idx_r, alloc.num_alloc_retries, None, None)
