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
* ``cudaMalloc`` addresses follow the driver as measured in a fresh process
  (addresses.py: top-down in 32 MiB granules, freed ranges reused); they only
  matter to break ties between equally sized free blocks, where they decide
  which cached segments stay whole for the OOM retry to free.
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

# The package: sizes.py (the C++ constants and rounding rules), config.py
# (PYTORCH_CUDA_ALLOC_CONF), results.py (the OOM error and what a replay
# reports), pools.py (blocks and free-block pools), addresses.py (where the
# driver puts each segment), caching.py (the allocator and replay).
from oomdoctor.sim.allocator.caching import EMPTY_CACHE, CachingAllocator, replay
from oomdoctor.sim.allocator.config import AllocatorConfig
from oomdoctor.sim.allocator.results import AllocatorOOM, BlockInfo, ReplayResult, SegmentInfo
from oomdoctor.sim.allocator.sizes import (
    GiB,
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    KiB,
    MiB,
    format_size,
    round_size,
    segment_size,
)


__all__ = [
    "EMPTY_CACHE",
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
