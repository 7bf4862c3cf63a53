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

A process that ran training before and emptied the cache (a notebook, a batch-size search, a
benchmark harness) starts with the range those segments took free: ``AddressSpace(freed=N)``.
The driver puts new segments there, lowest first, so addresses increase and best fit takes the
older of two equal segments. Measured on the same H200 in calibrate.py's long-lived process
(benchmarks/results/nvidia-h200-2.11.0.json): lora_gpt AMP with checkpointing at batch 540
trained there, peaks 145,512,678,912 / 146,383,306,752 bytes, and runs out of memory in a fresh
process (-fresh.json); replayed after a freed range as large as the earlier runs', it trains
with those two peaks to the byte (fp16 and bf16), and a search replayed so finds the 540, 441,
358 and 213 that process found.

Known limitations: the freed range is one range here; on the GPU the CUDA context's lazily
loaded kernels sit between the freed segments, so which hole a segment lands in depends on the
order earlier runs loaded kernels and placed segments (ResNet's 6 GiB workspace segments:
measured -6.5% reserved between a fresh and a long-lived process, replayed -3.9%, and up to 13%
off after other runs). In a fresh process only the run's own frees are reused.
"""
from __future__ import annotations

from bisect import insort

GRANULE = 32 * 1024**2   # the driver's virtual-address granule, as measured


class AddressSpace:
    """The device's virtual addresses for cudaMalloc'd segments: free ranges, best fit, and new
    granules below everything handed out so far."""

    def __init__(self, top: int = 1 << 47, freed: int = 0) -> None:
        """``top``: x86-64 user space's top, as real addresses. ``freed``: bytes of segments
        the process handed out and returned before (an earlier run, then ``empty_cache``):
        one range just below the top, whole granules, which new segments fill from its
        bottom up before any new granule is taken below it."""
        span = -(-freed // GRANULE) * GRANULE
        self._low = top - span
        self._free: list[list[int]] = [[self._low, span]] if span else []   # by address

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
