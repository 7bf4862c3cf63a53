"""The constants of CUDACachingAllocator.cpp and its size rules: request rounding, segment sizes."""

from __future__ import annotations

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
