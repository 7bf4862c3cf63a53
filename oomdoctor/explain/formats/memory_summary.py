"""A pasted `torch.cuda.memory_summary()` table: the allocator's counters, its fragmentation, the fix.

The table (torch/cuda/memory.py, memory_summary) has one row per metric with four columns - Cur
Usage, Peak Usage, Tot Alloc, Tot Freed - and, unless abbreviated, "from large pool" / "from small
pool" rows under it. Sizes are printed by its ``_format_size``: the value floored to the largest
unit (B, KiB, MiB, GiB, ...) that keeps the row's all-pool value at 768 or more of it, so every
size read here is exact to under one unit of the printed figure. Counts (``_format_count``) take
K or M the same way. The scanner squashes whitespace, so the rows read "|Allocatedmemory|66560KiB|".
"""
from __future__ import annotations

import re

from ..diagnosis import _QUALITY_NONE, _SPEED_NONE, _Ctx, _F, _Out, _pct
from ..draft import _Draft
from ..results import Kind, Phase
from ..sizes import GiB, MiB, _to_bytes
from .patterns import _I, _AnchorSpec

_ANCHORS: tuple[_AnchorSpec, ...] = (
    _AnchorSpec(Kind.MEMORY_SUMMARY, ("pytorchcudamemorysummary",),
                re.compile(r"PyTorchCUDAmemorysummary,deviceID(\d+)", _I), absorb=400),
)

_SIZE_CELL = r"\|(\d+)(B|KiB|MiB|GiB|TiB|PiB)"
_COUNT_CELL = r"\|(\d+)([KM]?)"
_COUNT_SCALE = {"": 1, "K": 1000, "M": 1000 ** 2}

# (key prefix in Finding.numbers, the row's squashed name, bytes?) - the rows a diagnosis uses.
_ROWS = (
    ("allocated", "Allocatedmemory", True),
    ("reserved", "GPUreservedmemory", True),
    ("non_releasable", "Non-releasablememory", True),
    ("segments", "GPUreservedsegments", False),
)
_ROW_RES = {key: re.compile(r"\|" + name + (_SIZE_CELL if size else _COUNT_CELL) * 4 + r"\|", _I)
            for key, name, size in _ROWS}
_F_HEADER = re.compile(r"CUDAOOMs:(\d+)\|cudaMallocretries:(\d+)", _I)

# Below this much reserved-but-unusable memory fragmentation is noise (the one-block rounding of
# a few hundred tensors); the OOM message's diagnosis uses the same floor (torch_caching.py).
_FRAGMENTATION_FLOOR = 64 * MiB


def _cells(m: re.Match, size: bool) -> tuple[int, int]:
    """Cur Usage and Peak Usage of a row, in bytes (sizes) or units (counts)."""
    if size:
        return _to_bytes(m.group(1), m.group(2)), _to_bytes(m.group(3), m.group(4))
    return (int(m.group(1)) * _COUNT_SCALE[m.group(2).upper()],
            int(m.group(3)) * _COUNT_SCALE[m.group(4).upper()])


def _x_summary(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.MEMORY_SUMMARY)
    d.gpus.append(int(m.group(1)))
    header = _F_HEADER.search(span)
    if header:
        d.numbers["cuda_ooms"] = int(header.group(1))
        d.numbers["alloc_retries"] = int(header.group(2))
    for key, _, size in _ROWS:
        row = _ROW_RES[key].search(span)
        if row:
            d.numbers[key], d.numbers[f"{key}_peak"] = _cells(row, size)
    d.sig = (int(m.group(1)), d.numbers.get("allocated_peak"), d.numbers.get("reserved_peak"))
    return d


def _diag_summary(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    n = d.numbers
    if "allocated" not in n or "reserved" not in n:
        out.diag("memory_summary_unreadable", "The table's Allocated memory and GPU reserved memory rows "
                 "could not be read (cut off, or reformatted): paste the whole memory_summary() output.")
        return
    alloc, res = n["allocated"], n["reserved"]
    alloc_peak, res_peak = n.get("allocated_peak", alloc), n.get("reserved_peak", res)
    nonrel, nonrel_peak = n.get("non_releasable", 0), n.get("non_releasable_peak", 0)
    out.derived["reserved_unallocated"] = res - alloc
    # Reserved at its peak minus the allocated peak: allocated was at most its peak when reserved
    # peaked, so the reserve held at least this much that no tensor used.
    out.derived["reserved_over_allocated_peak"] = gap = max(0, res_peak - alloc_peak)
    out.derived["releasable_cache"] = releasable = max(0, res - alloc - nonrel)
    counts = ""
    if "cuda_ooms" in n:
        counts = (f" The allocator has raised {n['cuda_ooms']} CUDA OOM(s) and retried cudaMalloc "
                  f"{n['alloc_retries']} time(s) after freeing its cache.")
    out.diag("memory_summary",
             f"The allocator's counters (torch.cuda.memory_summary(), device {d.gpus[0]}): {_F(alloc)} "
             f"allocated now, {_F(alloc_peak)} at the peak; {_F(res)} reserved now, {_F(res_peak)} at the "
             f"peak; {_F(nonrel)} non-releasable now, {_F(nonrel_peak)} at the peak." + counts)
    _fragmentation(out, res_peak, gap, nonrel_peak)
    if releasable >= GiB or (res and releasable >= res // 2 and releasable >= _FRAGMENTATION_FLOOR):
        out.notes.append(
            f"{_F(releasable)} is cached in whole free segments now (reserved {_F(res)} - allocated "
            f"{_F(alloc)} - non-releasable {_F(nonrel)}): tensors freed since the peak, e.g. after the "
            "OOM was caught. It is not fragmentation - the next allocation of this process reuses it; "
            "torch.cuda.empty_cache() would only hand it back to other processes.")
    out.fix("memory_snapshot", "See which tensors make the peak: record a memory snapshot "
            "(torch.cuda.memory._record_memory_history(), then torch.cuda.memory._dump_snapshot("
            "\"step.pickle\") after the step or at the OOM) and run `oomdoctor explain step.pickle`",
            None, None, "slower while recording", _QUALITY_NONE,
            "The summary says how much; the snapshot says what: bytes by category (parameters, "
            "optimizer state, activations by source line) and the allocation sites at the peak.",
            cost=1)
    out.notes.append("memory_summary() floors every size to the unit it prints (torch/cuda/memory.py, "
                     "_format_size): each figure here is exact to under one of its units.")


def _fragmentation(out: _Out, res_peak: int, gap: int, nonrel_peak: int) -> None:
    """The reserve that tensors could not use near the peak; expandable segments when it is large.
    Non-releasable memory is the free part of split blocks (the allocator's inactive_split_bytes,
    c10/cuda/CUDACachingAllocator.cpp): free, but inside segments that also hold live tensors."""
    frag = max(gap, nonrel_peak)
    out.derived["fragmentation"] = frag
    if frag < _FRAGMENTATION_FLOOR or (frag < res_peak // 10 and frag < GiB):
        out.diag("little_fragmentation",
                 f"Fragmentation is small: about {_F(frag)} of the {_F(res_peak)} reserved at the peak "
                 f"({_pct(frag, res_peak)}) was free but unusable, so the reserve was not what ran out - "
                 "the tensors were; expandable segments would buy little.")
        return
    out.diag("fragmentation",
             f"{_F(frag)} ({_pct(frag, res_peak)} of the {_F(res_peak)} reserved at the peak) was reserved but "
             f"unusable: the reserved peak is {_F(gap)} above the allocated peak and up to {_F(nonrel_peak)} "
             "sat free inside segments that also held live tensors (non-releasable).")
    out.fix("expandable_segments", "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process "
            "starts", frag, "up to", _SPEED_NONE, _QUALITY_NONE,
            "Segments grow in place instead of being carved into fixed blocks, so memory freed between "
            "live tensors becomes usable for the next request. It does not help the cudaMallocAsync "
            "backend.", cost=0, primary=True)
