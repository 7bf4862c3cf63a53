"""Unit tests for oomdoctor.sim.allocator.

Every expected number below was worked out by hand from the rules of
PyTorch's CUDACachingAllocator (see the walk-through in each test), not taken
from the simulator's own output.
"""

from __future__ import annotations

import importlib.util
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomdoctor.sim.allocator import (
    K_LARGE_BUFFER,
    K_SMALL_BUFFER,
    AllocatorConfig,
    AllocatorOOM,
    CachingAllocator,
    KiB,
    MiB,
    replay,
    round_size,
    segment_size,
)

EXP = AllocatorConfig(expandable_segments=True)


def layout(a: CachingAllocator) -> list[tuple[str, list[tuple[int, bool]]]]:
    """Segments as (pool, [(block size, allocated), ...]) in address order."""
    return [(s.pool, [(b.size, b.allocated) for b in s.blocks]) for s in a.segments()]


def stats(a: CachingAllocator) -> tuple[int, int, int]:
    return a.allocated_bytes, a.reserved_bytes, a.requested_bytes


# ----------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "nbytes, rounded",
    [(0, 512), (1, 512), (511, 512), (512, 512), (513, 1024), (1024, 1024), (1025, 1536)],
)
def test_round_size(nbytes, rounded):
    assert round_size(nbytes) == rounded


def test_round_size_rejects_negative():
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        round_size(-1)


@pytest.mark.parametrize(
    "request_bytes, seg",
    [
        (600 * KiB, 2 * MiB),  # small pool: 2 MiB segment
        (1 * MiB, 2 * MiB),  # 1 MiB is still small
        (1 * MiB + 512, 20 * MiB),  # just above: large pool, shared 20 MiB segment
        (3 * MiB, 20 * MiB),
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),  # from 10 MiB: own segment rounded up to 2 MiB
        (12 * MiB + 512 * KiB, 14 * MiB),
        (100 * MiB, 100 * MiB),
    ],
)
def test_segment_size(request_bytes, seg):
    assert segment_size(round_size(request_bytes)) == seg


# ----------------------------------------------------------------- pools, best fit, split


def test_small_request_splits_a_2mib_segment():
    a = CachingAllocator()
    a.malloc(1, 1000)  # rounded to 1024; remainder 2 MiB - 1024 >= 512 -> split
    assert stats(a) == (1024, 2 * MiB, 1000)
    assert layout(a) == [("small", [(1024, True), (2 * MiB - 1024, False)])]


def test_small_pool_packs_requests_into_2mib_segments():
    a = CachingAllocator()
    for h in range(4):
        a.malloc(h, 512 * KiB)  # four fit exactly into one 2 MiB segment
    assert a.reserved_bytes == 2 * MiB
    a.malloc(4, 512 * KiB)  # the fifth needs a second segment
    assert a.reserved_bytes == 4 * MiB
    assert [len(blocks) for _, blocks in layout(a)] == [4, 2]


def test_small_pool_splits_remainder_of_exactly_512():
    a = CachingAllocator()
    a.malloc(1, 1 * MiB)
    a.malloc(2, 1 * MiB - 512)  # leaves 512 B: still split off (>= kMinBlockSize)
    assert layout(a) == [("small", [(MiB, True), (MiB - 512, True), (512, False)])]
    a.malloc(3, 1)  # a 1-byte request fits that 512 B block exactly
    assert stats(a) == (2 * MiB, 2 * MiB, 2 * MiB - 512 + 1)
    assert layout(a) == [("small", [(MiB, True), (MiB - 512, True), (512, True)])]


def test_pools_are_separate():
    a = CachingAllocator()
    a.malloc(1, 512 * KiB)
    a.free(1)  # a free 2 MiB small segment is cached
    a.malloc(2, 1 * MiB + 512 * KiB)  # large request: cannot use it -> new 20 MiB
    assert a.reserved_bytes == 22 * MiB
    a.free(2)  # now a free 20 MiB large segment is cached as well
    a.malloc(3, 4 * KiB)  # small request: reuses the small segment, not the large one
    assert a.reserved_bytes == 22 * MiB
    assert layout(a) == [
        ("small", [(4 * KiB, True), (2 * MiB - 4 * KiB, False)]),
        ("large", [(20 * MiB, False)]),
    ]


def test_boundary_between_pools():
    a = CachingAllocator()
    a.malloc(1, 1 * MiB)  # <= 1 MiB: small
    a.malloc(2, 1 * MiB + 1)  # rounded to 1 MiB + 512: large
    assert [pool for pool, _ in layout(a)] == ["small", "large"]


def test_best_fit_takes_smallest_fitting_block_then_lowest_address():
    a = CachingAllocator()
    # One 20 MiB segment carved as [A 4][B 2][C 6][D 2][6 free]: every
    # remainder along the way is > 1 MiB, so each request splits.
    a.malloc("A", 4 * MiB)
    a.malloc("B", 2 * MiB)
    a.malloc("C", 6 * MiB)
    a.malloc("D", 2 * MiB)
    a.free("A")
    a.free("C")  # free blocks: 4 MiB @0, 6 MiB @6, 6 MiB @14 (no free neighbours)
    assert layout(a) == [("large", [(4 * MiB, False), (2 * MiB, True), (6 * MiB, False),
                                    (2 * MiB, True), (6 * MiB, False)])]
    # 3.5 MiB: the 4 MiB block is the smallest that fits; the 0.5 MiB
    # remainder is not > 1 MiB, so the whole 4 MiB block is handed out.
    a.malloc("E", 3 * MiB + 512 * KiB)
    assert a.allocated_bytes == (2 + 2 + 4) * MiB
    # 5 MiB: two 6 MiB blocks tie, the lower address wins; remainder 1 MiB is
    # not > 1 MiB -> unsplit.
    a.malloc("F", 5 * MiB)
    assert layout(a) == [("large", [(4 * MiB, True), (2 * MiB, True), (6 * MiB, True),
                                    (2 * MiB, True), (6 * MiB, False)])]
    assert a.reserved_bytes == 20 * MiB
    assert a.allocated_bytes == 14 * MiB


@pytest.mark.parametrize(
    "nbytes, blocks, allocated",
    [
        # 3 MiB in a 20 MiB segment: remainder 17 MiB > 1 MiB -> split.
        (3 * MiB, [(3 * MiB, True), (17 * MiB, False)], 3 * MiB),
        # 19 MiB -> 20 MiB segment, remainder 1 MiB is not > 1 MiB -> the
        # whole 20 MiB counts as allocated (alloc_found_block adds block->size).
        (19 * MiB, [(20 * MiB, True)], 20 * MiB),
        # 18.5 MiB -> 20 MiB segment, remainder 1.5 MiB > 1 MiB -> split.
        (18 * MiB + 512 * KiB, [(18 * MiB + 512 * KiB, True), (1 * MiB + 512 * KiB, False)],
         18 * MiB + 512 * KiB),
        # 10 MiB + 1 B -> 10 MiB + 512 -> 12 MiB segment, remainder 2 MiB - 512.
        (10 * MiB + 1, [(10 * MiB + 512, True), (2 * MiB - 512, False)], 10 * MiB + 512),
    ],
)
def test_large_pool_split_rule(nbytes, blocks, allocated):
    a = CachingAllocator()
    a.malloc(1, nbytes)
    assert layout(a) == [("large", blocks)]
    assert a.allocated_bytes == allocated
    assert a.requested_bytes == nbytes


# ----------------------------------------------------------------- free / merge / empty_cache


@pytest.mark.parametrize(
    "first, second, after_first",
    [
        # Free A: [3 free][B 3][14 free] (A has no free neighbour).
        ("A", "B", [(3 * MiB, False), (3 * MiB, True), (14 * MiB, False)]),
        # Free B: it merges with the 14 MiB tail: [A 3][17 free].
        ("B", "A", [(3 * MiB, True), (17 * MiB, False)]),
    ],
)
def test_free_merges_neighbours_into_one_block(first, second, after_first):
    a = CachingAllocator()
    a.malloc("A", 3 * MiB)
    a.malloc("B", 3 * MiB)  # [A 3][B 3][14 free]
    a.free(first)
    assert layout(a) == [("large", after_first)]
    a.free(second)
    assert layout(a) == [("large", [(20 * MiB, False)])]
    assert stats(a) == (0, 20 * MiB, 0)  # freed memory stays reserved
    a.empty_cache()
    assert stats(a) == (0, 0, 0)
    assert layout(a) == []


def test_blocks_never_merge_across_segments():
    a = CachingAllocator()
    a.malloc(1, 19 * MiB)  # a whole 20 MiB segment
    a.malloc(2, 19 * MiB)  # another one
    a.free(1)
    a.free(2)  # two free 20 MiB blocks, in different segments
    a.malloc(3, 30 * MiB)  # neither fits alone -> a new 30 MiB segment
    assert a.reserved_bytes == 70 * MiB


def test_empty_cache_keeps_segments_with_live_blocks():
    a = CachingAllocator()
    a.malloc("A", 3 * MiB)  # 20 MiB segment, stays partly used
    a.malloc("B", 30 * MiB)  # own 30 MiB segment
    a.free("B")
    a.empty_cache()
    assert a.reserved_bytes == 20 * MiB
    assert a.peak_reserved_bytes == 50 * MiB
    assert layout(a) == [("large", [(3 * MiB, True), (17 * MiB, False)])]


# ----------------------------------------------------------------- max_split_size


def test_oversize_block_not_used_for_small_request():
    big_then_small = [(True, "A", 40 * MiB), (False, "A", 0), (True, "B", 4 * MiB)]
    # Default: B takes the cached 40 MiB block and splits it -> 40 MiB reserved.
    assert replay(big_then_small).peak_reserved_bytes == 40 * MiB
    # max_split 32 MiB: the 40 MiB block is oversize, a 4 MiB request may not
    # take it -> a new 20 MiB segment: 60 MiB reserved.
    cfg = AllocatorConfig(max_split_size=32 * MiB)
    assert replay(big_then_small, cfg).peak_reserved_bytes == 60 * MiB


def test_oversize_block_only_serves_requests_within_20mib():
    a = CachingAllocator(AllocatorConfig(max_split_size=32 * MiB))
    a.malloc("A", 60 * MiB)
    a.free("A")
    a.malloc("B", 40 * MiB)  # 60 >= 40 + 20: not taken -> new 40 MiB segment
    assert a.reserved_bytes == 100 * MiB
    a.free("B")
    # 42 MiB: best fit is the 60 MiB block (the 40 MiB one is too small);
    # 60 < 42 + 20 so it is taken, and not split (request >= max_split_size).
    a.malloc("C", 42 * MiB)
    assert stats(a) == (60 * MiB, 100 * MiB, 42 * MiB)


def test_large_request_not_split_with_max_split_size():
    events = [(True, "A", 50 * MiB), (False, "A", 0), (True, "B", 32 * MiB)]
    # Default: 32 MiB takes the 50 MiB block and splits (18 MiB > 1 MiB left).
    assert replay(events).peak_allocated_bytes == 50 * MiB  # A's peak
    a = CachingAllocator()
    for is_alloc, h, n in events:
        a.malloc(h, n) if is_alloc else a.free(h)
    assert a.allocated_bytes == 32 * MiB
    # max_split 20 MiB: 32 MiB >= max_split -> never split -> all 50 MiB.
    a = CachingAllocator(AllocatorConfig(max_split_size=20 * MiB))
    for is_alloc, h, n in events:
        a.malloc(h, n) if is_alloc else a.free(h)
    assert a.allocated_bytes == 50 * MiB


def test_should_split_looks_at_request_not_block_size():
    # should_split tests the *request* against max_split_size: a 2 MiB request
    # splits its fresh 20 MiB segment even though 20 MiB >= max_split_size.
    a = CachingAllocator(AllocatorConfig(max_split_size=20 * MiB))
    a.malloc("A", 2 * MiB)
    assert layout(a) == [("large", [(2 * MiB, True), (18 * MiB, False)])]
    a.free("A")  # merges back into a 20 MiB block, which is oversize
    a.malloc("B", 2 * MiB)  # so it cannot be reused: a second segment
    assert a.reserved_bytes == 40 * MiB


# ----------------------------------------------------------------- OOM and retries


def test_oom_retry_releases_cached_segments_then_succeeds():
    a = CachingAllocator(limit_bytes=40 * MiB)
    a.malloc("A", 20 * MiB)
    a.free("A")  # cached 20 MiB segment
    # 30 MiB: no cached block fits; cudaMalloc(30) fails (20 + 30 > 40);
    # release_cached_blocks frees the 20 MiB segment; the retry succeeds.
    a.malloc("B", 30 * MiB)
    assert a.num_alloc_retries == 1
    assert a.num_ooms == 0
    assert a.reserved_bytes == 30 * MiB
    assert a.peak_reserved_bytes == 30 * MiB


def test_oom_when_request_cannot_fit():
    a = CachingAllocator(limit_bytes=40 * MiB)
    with pytest.raises(AllocatorOOM, match="Tried to allocate 50.00 MiB") as info:
        a.malloc("A", 50 * MiB)
    oom = info.value
    assert (oom.requested, oom.segment_size, oom.allocated, oom.reserved, oom.limit) == (
        50 * MiB, 50 * MiB, 0, 0, 40 * MiB)
    assert a.num_ooms == 1
    assert a.num_alloc_retries == 1  # the final retry is counted even though it fails


@pytest.mark.parametrize(
    "nbytes, limit, message, seg",
    [
        (3 * MiB, 10 * MiB, "Tried to allocate 20.00 MiB", 20 * MiB),
        (600 * KiB, 1 * MiB, "Tried to allocate 2.00 MiB", 2 * MiB),
        (12 * MiB + 512 * KiB, 10 * MiB, "Tried to allocate 14.00 MiB", 14 * MiB),
    ],
)
def test_oom_reports_segment_size(nbytes, limit, message, seg):
    a = CachingAllocator(limit_bytes=limit)
    with pytest.raises(AllocatorOOM, match=message) as info:
        a.malloc(1, nbytes)
    assert info.value.segment_size == seg
    assert info.value.requested == round_size(nbytes)


def test_oom_releases_only_wholly_free_segments():
    a = CachingAllocator(limit_bytes=40 * MiB)
    a.malloc("A", 3 * MiB)  # 20 MiB segment, 17 MiB free tail
    a.malloc("B", 18 * MiB)  # too big for the tail: own 18 MiB segment
    a.free("B")
    # 30 MiB: cudaMalloc fails (38 + 30 > 40); B's whole free segment is
    # released (reserved 20); 20 + 30 > 40 still -> OOM.  A's split segment,
    # with its 17 MiB free tail, cannot be released.
    with pytest.raises(AllocatorOOM) as info:
        a.malloc("C", 30 * MiB)
    assert (info.value.allocated, info.value.reserved) == (3 * MiB, 20 * MiB)
    assert a.reserved_bytes == 20 * MiB
    a.malloc("D", 8 * MiB)  # the allocator is still usable: fits the 17 MiB tail
    assert a.reserved_bytes == 20 * MiB


def test_release_available_cached_blocks_frees_one_oversize_block():
    a = CachingAllocator(AllocatorConfig(max_split_size=32 * MiB), limit_bytes=90 * MiB)
    a.malloc("A", 40 * MiB)
    a.malloc("B", 40 * MiB)
    a.free("A")  # cached oversize 40 MiB
    # 4 MiB may not use the oversize block; cudaMalloc(20) fails (80 + 20 > 90);
    # step 2 frees the smallest cached block >= max(4, 32) MiB = A's 40 MiB;
    # cudaMalloc(20) then fits.  No full retry happened.
    a.malloc("C", 4 * MiB)
    assert a.num_alloc_retries == 0
    assert a.reserved_bytes == 60 * MiB


def test_release_available_cached_blocks_frees_several_oversize_blocks():
    a = CachingAllocator(AllocatorConfig(max_split_size=20 * MiB), limit_bytes=76 * MiB)
    a.malloc("L", 12 * MiB)  # live, 12 MiB segment
    a.malloc("D", 12 * MiB)  # will be a cached non-oversize segment
    a.malloc("X", 24 * MiB)
    a.malloc("Y", 26 * MiB)  # 12 + 12 + 24 + 26 = 74 MiB reserved
    for h in ("D", "X", "Y"):
        a.free(h)
    # 50 MiB: no cached block >= 50; cudaMalloc(50) fails (124 > 76).  Step 2:
    # no single block >= 50, so oversize blocks go largest first: 26, then 24
    # (50 >= 50, done).  The 12 MiB cached segment is not oversize and stays.
    # 24 + 50 = 74 <= 76 -> success without the full retry.
    a.malloc("Z", 50 * MiB)
    assert a.num_alloc_retries == 0
    assert a.reserved_bytes == 74 * MiB
    # By address: Z reuses the range X and Y freed, below L and D (addresses.py: the driver
    # places later segments below earlier ones; L and D share one 32 MiB granule).
    assert layout(a) == [("large", [(50 * MiB, True)]), ("large", [(12 * MiB, True)]),
                         ("large", [(12 * MiB, False)])]


def _which_of_two_equal_segments_is_reused(a: CachingAllocator) -> str:
    """A and B get equal segments and are freed; the segment C then reuses, by name."""
    a.malloc("A", 100 * MiB)
    a.malloc("B", 100 * MiB)
    where = {name: a._live[name].addr for name in ("A", "B")}
    a.free("A")
    a.free("B")
    a.malloc("C", 100 * MiB)
    assert layout(a) == [("large", [(100 * MiB, True)]), ("large", [(100 * MiB, False)])]
    return next(name for name, addr in where.items() if addr == a._live["C"].addr)


def test_of_two_equal_cached_segments_the_newer_is_reused():
    # Best fit breaks ties by address, and the driver places each new segment below the
    # earlier ones (addresses.py; measured on an H200), so B's segment, not A's, is reused.
    assert _which_of_two_equal_segments_is_reused(CachingAllocator()) == "B"


def test_in_a_process_that_freed_earlier_runs_the_older_of_two_equal_segments_is_reused():
    # After earlier runs returned their segments (empty_cache), new segments fill that freed
    # range from its bottom up (addresses.py), so the first of two equal segments lies lower
    # and best fit reuses A's, the opposite of a fresh process (test above). What that does to
    # a whole run is checked against calibrate.py's long-lived H200 process in
    # tests/test_calibration.py (lora_gpt at batch 540: the peaks to the byte).
    a = CachingAllocator(freed_bytes=1024 * MiB)
    assert _which_of_two_equal_segments_is_reused(a) == "A"
    # Past the freed range, new granules go below everything, as in a fresh process.
    a.malloc("D", 2000 * MiB)
    assert a.segments()[0].size == 2000 * MiB


# ----------------------------------------------------------------- expandable segments

FRAGMENTING = [
    (True, "X", 40 * MiB),
    (False, "X", 0),
    (True, "Y", 20 * MiB),  # reuses X's block and splits it: [Y 20][20 free]
    (True, "Z", 30 * MiB),  # the 20 MiB sliver is too small
]


def test_fragmentation_costs_a_segment_without_expandable_segments():
    # Unlimited: Z needs its own 30 MiB segment -> 70 MiB reserved.
    res = replay(FRAGMENTING)
    assert res.peak_reserved_bytes == 70 * MiB
    # Limit 60 MiB: cudaMalloc(30) fails, nothing is wholly free -> OOM.
    res = replay(FRAGMENTING, limit_bytes=60 * MiB)
    assert res.oom is not None and res.oom_index == 3
    assert res.oom.segment_size == 30 * MiB
    assert res.oom.reserved == 40 * MiB


def test_expandable_segments_absorb_the_fragmentation():
    # X maps 2 pages (40 MiB).  Y splits the 40 MiB block.  Z: the 20 MiB free
    # tail borders unmapped space, so one more 20 MiB page makes it 40 MiB,
    # split into [Z 30][10 free] -> 60 MiB reserved, within the limit.
    a = CachingAllocator(EXP, limit_bytes=60 * MiB)
    for is_alloc, h, n in FRAGMENTING:
        a.malloc(h, n) if is_alloc else a.free(h)
    assert stats(a) == (50 * MiB, 60 * MiB, 50 * MiB)
    assert layout(a) == [("large", [(20 * MiB, True), (30 * MiB, True), (10 * MiB, False)])]
    assert a.segments()[0].expandable


def test_expandable_pages_and_splits():
    a = CachingAllocator(EXP)
    a.malloc("s", 1000)  # small pool page: 2 MiB
    assert a.reserved_bytes == 2 * MiB
    a.malloc("A", 30 * MiB)  # 2 large pages = 40 MiB; the 10 MiB tail is split off
    assert stats(a) == (1024 + 30 * MiB, 42 * MiB, 1000 + 30 * MiB)
    # 15 MiB: the 10 MiB free tail + one more page (20 MiB) = 30 MiB -> [15][15].
    a.malloc("B", 15 * MiB)
    assert a.reserved_bytes == 62 * MiB
    large = [s for s in a.segments() if s.pool == "large"]
    assert [(b.size, b.allocated) for b in large[0].blocks] == [
        (30 * MiB, True), (15 * MiB, True), (15 * MiB, False)]


def test_expandable_best_fit_prefers_block_not_at_growing_end():
    a = CachingAllocator(EXP)
    a.malloc("A", 6 * MiB)
    a.malloc("B", 2 * MiB)
    a.malloc("C", 7 * MiB)  # one 20 MiB page: [A 6][B 2][C 7][5 free, at the end]
    a.free("A")  # free: 6 MiB at the start and 5 MiB at the growing end
    # Plain best fit would take the 5 MiB end block, but get_free_block counts
    # it as 5 MiB + the unmapped space after it, so the 6 MiB block wins.
    a.malloc("D", 4 * MiB)
    assert layout(a) == [("large", [(4 * MiB, True), (2 * MiB, False), (2 * MiB, True),
                                    (7 * MiB, True), (5 * MiB, False)])]


def test_expandable_empty_cache_unmaps_only_whole_free_pages():
    a = CachingAllocator(EXP)
    a.malloc("A", 10 * MiB)
    a.malloc("B", 10 * MiB)  # both in the first 20 MiB page
    a.free("A")
    a.empty_cache()  # the free 10 MiB is half a page: nothing to unmap
    assert a.reserved_bytes == 20 * MiB
    a.free("B")
    a.empty_cache()
    assert a.reserved_bytes == 0
    assert layout(a) == []


def test_expandable_unmapped_hole_is_refilled_first():
    a = CachingAllocator(EXP)
    a.malloc("A", 40 * MiB)  # pages 0-1
    a.malloc("B", 20 * MiB)  # page 2
    a.free("A")
    a.empty_cache()  # unmaps pages 0-1: reserved 20 MiB, a 40 MiB hole at the start
    assert a.reserved_bytes == 20 * MiB
    assert layout(a) == [("large", [(20 * MiB, True)])]
    a.malloc("C", 30 * MiB)  # the hole is the lowest place with room: 2 pages there
    assert a.reserved_bytes == 60 * MiB
    assert layout(a) == [("large", [(30 * MiB, True), (10 * MiB, False), (20 * MiB, True)])]
    for h in ("B", "C"):
        a.free(h)
    a.empty_cache()
    assert a.reserved_bytes == 0


def test_expandable_oom_retry_unmaps_free_pages():
    a = CachingAllocator(EXP, limit_bytes=80 * MiB)
    a.malloc("A", 40 * MiB)
    a.malloc("B", 20 * MiB)  # [A 40][B 20], 60 MiB mapped
    a.free("A")
    # 45 MiB: no free block that large; mapping 3 pages after B would need
    # 60 + 60 > 80.  The retry unmaps A's 2 pages (reserved 20); the 40 MiB
    # hole is still too small, so 3 pages are mapped after B: 20 + 60 = 80.
    a.malloc("C", 45 * MiB)
    assert a.num_alloc_retries == 1
    assert a.reserved_bytes == 80 * MiB
    assert layout(a) == [("large", [(20 * MiB, True), (45 * MiB, True), (15 * MiB, False)])]


def test_expandable_oom_reports_allocation_size():
    a = CachingAllocator(EXP, limit_bytes=10 * MiB)
    with pytest.raises(AllocatorOOM, match="Tried to allocate 20.00 MiB"):
        a.malloc(1, 3 * MiB)  # one 20 MiB page does not fit in 10 MiB


# ----------------------------------------------------------------- handles and 0 bytes


def test_zero_byte_tensor_is_a_noop():
    a = CachingAllocator()
    a.malloc(1, 0)  # PyTorch does not call the allocator for 0 bytes
    assert stats(a) == (0, 0, 0)
    a.free(1)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(1)


def test_handle_errors():
    a = CachingAllocator()
    a.malloc(1, 10)
    with pytest.raises(ValueError, match="already allocated"):
        a.malloc(1, 10)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(2)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        a.malloc(3, -1)
    with pytest.raises(ValueError, match="limit_bytes"):
        CachingAllocator(limit_bytes=-1)


def test_oom_is_picklable():
    oom = AllocatorOOM(512, 2 * MiB, 0, 0, MiB, nbytes=10)
    back = pickle.loads(pickle.dumps(oom))
    assert (back.requested, back.segment_size, back.limit, back.nbytes) == (512, 2 * MiB, MiB, 10)
    assert str(back) == str(oom)


# ----------------------------------------------------------------- replay


def test_replay_peaks_and_indices():
    events = [
        (True, "A", 3 * MiB),  # 0: 20 MiB segment: reserved peak reached here
        (True, "B", 3 * MiB),  # 1: same segment: allocated peak 6 MiB here
        (False, "A", 0),
        (False, "B", 0),
        (True, "C", 0),  # 0-byte: nothing
        (False, "C", 0),
        (True, "D", 2 * MiB),  # reuses the cached segment
    ]
    res = replay(events)
    assert (res.peak_allocated_bytes, res.peak_allocated_index) == (6 * MiB, 1)
    assert (res.peak_reserved_bytes, res.peak_reserved_index) == (20 * MiB, 0)
    assert res.oom is None and res.oom_index is None
    assert res.num_alloc_retries == 0


def test_replay_stops_at_first_oom():
    events = [
        (True, 1, 3 * MiB),  # 20 MiB segment
        (True, 2, 25 * MiB),  # needs a 26 MiB segment: 46 > 30 -> OOM here
        (False, 1, 0),
        (True, 3, 1 * MiB),
    ]
    res = replay(events, limit_bytes=30 * MiB)
    assert res.oom_index == 1
    assert res.oom.segment_size == 26 * MiB
    assert (res.peak_allocated_bytes, res.peak_reserved_bytes) == (3 * MiB, 20 * MiB)
    assert res.num_alloc_retries == 1


def _random_events(n: int, seed: int = 0) -> list[tuple[bool, int, int]]:
    """The stream benchmarks/bench_allocator.py times: one generator for both."""
    spec = importlib.util.spec_from_file_location(
        "bench_allocator", Path(__file__).resolve().parent.parent / "benchmarks" /
        "bench_allocator.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.random_events(n, seed)


def test_replay_100k_events_keeps_its_invariants():
    # Speed is benchmarks/bench_allocator.py's business; here only what must hold at any size:
    # the allocated peak covers the largest live set of requests, and reserved covers allocated.
    events = _random_events(100_000)
    live: dict[int, int] = {}
    need = top = 0
    for is_alloc, handle, nbytes in events:
        if is_alloc:
            live[handle] = nbytes
            need += nbytes
            top = max(top, need)
        else:
            need -= live.pop(handle)
    res = replay(events)
    assert res.peak_reserved_bytes >= res.peak_allocated_bytes >= top > 0
    assert res.oom_index is None


# ----------------------------------------------------------------- property test

_sizes = st.one_of(
    st.integers(0, 2 * MiB),
    st.integers(1, 64 * MiB),
    st.sampled_from([512, MiB, MiB + 1, 10 * MiB - 1, 10 * MiB, 20 * MiB, 21 * MiB]),
)
_ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "alloc", "free", "empty"]), _sizes,
              st.integers(0, 1000)),
    max_size=40,
)
_configs = st.sampled_from([
    AllocatorConfig(),
    EXP,
    AllocatorConfig(max_split_size=20 * MiB),
    AllocatorConfig(expandable_segments=True, max_split_size=32 * MiB),
])


@settings(max_examples=120, deadline=None)
@given(_configs, st.one_of(st.none(), st.integers(0, 160 * MiB)), _ops)
def test_random_sequences_keep_invariants(config, limit, ops):
    a = CachingAllocator(config, limit_bytes=limit)
    live: list[int] = []
    peaks = (0, 0)
    for i, (op, nbytes, pick) in enumerate(ops):
        if op == "alloc":
            try:
                a.malloc(i, nbytes)
                live.append(i)
            except AllocatorOOM as oom:
                assert limit is not None and oom.limit == limit
                assert oom.reserved == a.reserved_bytes
                assert oom.requested == round_size(nbytes)
        elif op == "free" and live:
            a.free(live.pop(pick % len(live)))
        elif op == "empty":
            a.empty_cache()
        assert a.reserved_bytes >= a.allocated_bytes >= a.requested_bytes >= 0
        if limit is not None:
            assert a.reserved_bytes <= limit
        assert a.peak_allocated_bytes >= max(peaks[0], a.allocated_bytes)
        assert a.peak_reserved_bytes >= max(peaks[1], a.reserved_bytes)
        peaks = (a.peak_allocated_bytes, a.peak_reserved_bytes)
        a._check_invariants()
    for h in live:
        a.free(h)
    assert a.allocated_bytes == a.requested_bytes == 0
    a.empty_cache()
    assert a.reserved_bytes == 0
    assert a.segments() == []


# ----------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "value, expected",
    [
        ("", AllocatorConfig()),
        ("expandable_segments:True,max_split_size_mb:128",
         AllocatorConfig(expandable_segments=True, max_split_size=128 * MiB)),
        (" max_split_size_mb : 20 ", AllocatorConfig(max_split_size=20 * MiB)),
        ("expandable_segments:False", AllocatorConfig()),
        ("backend:native,expandable_segments:True", EXP),
        ("release_lock_on_cudamalloc:True,expandable_segments:True", EXP),
        ("pinned_use_cuda_host_register:True,pinned_num_register_threads:8", AllocatorConfig()),
    ],
)
def test_from_env_parses(value, expected):
    assert AllocatorConfig.from_env(value) == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("max_split_size_mb:19", "max_split_size_mb >= 20"),
        ("max_split_size_mb:abc", "whole number"),
        ("max_split_size_mb:-5", "whole number"),
        ("expandable_segments:true", "True or False"),
        ("expandable_segment:True", "unknown option.*Did you mean 'expandable_segments'"),
        ("garbage_collection_threshold:0.6", "not modelled"),
        ("roundup_power2_divisions:[256:1,>:4]", "not modelled"),
        ("max_non_split_rounding_mb:64", "not modelled"),
        ("backend:cudaMallocAsync", "not modelled"),
        ("backend:foo", "unknown allocator backend"),
        ("max_split_size_mb", "needs a value"),
        ("max_split_size_mb:", "no value"),
        ("expandable_segments:True,", "trailing ','"),
        ("expandable_segments:True max_split_size_mb:64", "True or False"),
        ("pinned_num_register_threads:3", "power of 2"),
    ],
)
def test_from_env_rejects(value, message):
    with pytest.raises(ValueError, match=message):
        AllocatorConfig.from_env(value)


def test_config_validates_fields():
    with pytest.raises(ValueError, match="below 20 MiB"):
        AllocatorConfig(max_split_size=10 * MiB)
    with pytest.raises(ValueError, match="must be a bool"):
        AllocatorConfig(expandable_segments="True")  # type: ignore[arg-type]
    assert AllocatorConfig(max_split_size=K_LARGE_BUFFER).max_split_size == 20 * MiB
    assert K_SMALL_BUFFER == 2 * MiB
