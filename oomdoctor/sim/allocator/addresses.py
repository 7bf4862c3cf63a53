"""Where cudaMalloc puts each segment: the addresses that break the allocator's best-fit ties.

Among cached free blocks of one size, ``get_free_block`` takes the one with the lowest address
(``BlockComparatorSize`` in c10/cuda/CUDACachingAllocator.cpp orders by stream, size, then
pointer), so which of two equal segments is reused depends on where the driver placed them.
Measured in fresh processes on an H200 (driver 580, torch 2.11; issue 34,
benchmarks/results/newpaths/traces/): the driver hands out virtual addresses top-down in 32 MiB
granules, each new segment below every earlier one (33 of the 34 large-pool segments of every
gpt2_small run), and a segment that fits in the unused rest of an earlier granule goes there (a
2 MiB small-pool segment right after a 20 MiB one; two 16 MiB segments share a granule, the
second above the first). With this order the replay says which of gpt2_small's pure-bf16 runs
at batches 429-441 fit and which run out of memory, as measured (nvidia-h200-2.11.0-fresh.json),
the fitting ones' reserved peaks to 2 MiB. With increasing addresses best fit took the older of
two equal cached activation segments: the replay fitted 432, 436 and 440 (and gpt2_small fp32
at 214), which ran out of memory.

Known limitations: in a process that already freed segments (an earlier run, ``empty_cache``),
the driver reuses their addresses, which this models only for the process's own frees; the CUDA
context's own allocations (lazily loaded kernels) that fall between segments are not modelled.
"""
from __future__ import annotations

from bisect import insort

GRANULE = 32 * 1024**2   # the driver's virtual-address granule, as measured


class AddressSpace:
    """The device's virtual addresses for cudaMalloc'd segments: free ranges, best fit, and new
    granules below everything handed out so far."""

    def __init__(self, top: int = 1 << 47) -> None:   # x86-64 user space's top, as real ones
        self._low = top
        self._free: list[list[int]] = []   # [address, size] of unused ranges, by address

    def place(self, size: int) -> int:
        """The address of a new ``size``-byte segment."""
        free = self._free
        best = None
        for i, (_, n) in enumerate(free):
            if n >= size and (best is None or n < free[best][1]):
                best = i
        if best is None:
            chunk = -(-size // GRANULE) * GRANULE
            self._low -= chunk
            free.insert(0, [self._low, chunk])
            best = 0
        addr, n = free[best]
        if n == size:
            del free[best]
        else:
            free[best] = [addr + size, n - size]
        return addr

    def release(self, addr: int, size: int) -> None:
        """cudaFree: the range can be handed out again."""
        insort(self._free, [addr, size])
        merged: list[list[int]] = []
        for a, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == a:
                merged[-1][1] += n
            else:
                merged.append([a, n])
        self._free = merged
