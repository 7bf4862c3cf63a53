"""`explain` of a pasted torch.cuda.memory_summary() table (issue #21): the counters read back
against the table's own cells (split here by hand), the fragmentation verdict, the OOM before it."""
import os
from collections import defaultdict

import pytest

from oomdoctor.explain import explain_text
from oomdoctor.explain.results import Kind

ROOT = os.path.dirname(os.path.dirname(__file__))
REAL = os.path.join(ROOT, "tests", "snapshots", "gpt2_small_b8_oom_summary.txt")
UNIT = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}


def _cells(text: str, row: str) -> list[int]:
    """The four cells of a table row, as bytes ("| Allocated memory | 66560 KiB | ..." )."""
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| {row} "))
    out = []
    for cell in line.split("|")[2:6]:
        number, unit = cell.split()
        out.append(int(number) * UNIT[unit])
    return out


def _summary(result):
    (f,) = [f for f in result.findings if f.kind is Kind.MEMORY_SUMMARY]
    return f


def test_the_h200_summary_reads_as_its_table_says():
    text = open(REAL).read()
    f = _summary(explain_text(text))
    alloc, res, nonrel = (_cells(text, r) for r in ("Allocated memory", "GPU reserved memory",
                                                    "Non-releasable memory"))
    assert (f.numbers["allocated"], f.numbers["allocated_peak"]) == (alloc[0], alloc[1]) \
        == (66560 * 2 ** 10, 2973 * 2 ** 20)
    assert (f.numbers["reserved"], f.numbers["reserved_peak"]) == (res[0], res[1])
    assert (f.numbers["non_releasable"], f.numbers["non_releasable_peak"]) == (nonrel[0], nonrel[1])
    assert f.gpus == (0,) and f.numbers["cuda_ooms"] == 1 and f.numbers["alloc_retries"] == 1
    assert f.numbers["segments"] == 79
    # the reserve above the allocated peak is the OOM message's "reserved but unallocated"
    # (56.34 MiB) to within the table's 1 MiB rounding of each of the two peaks
    assert f.derived["reserved_over_allocated_peak"] == res[1] - alloc[1] == 57 * 2 ** 20
    assert abs(f.derived["reserved_over_allocated_peak"] - 56.34 * 2 ** 20) < 2 * 2 ** 20
    # 62.47 MiB (non-releasable at the peak) of 2.96 GiB: no expandable_segments fix
    assert f.derived["fragmentation"] == nonrel[1]
    assert f.cause == "memory_summary" and "little_fragmentation" in [d.cause for d in f.diagnosis]
    assert not any(x.id == "expandable_segments" for x in f.fixes)
    # after the OOM the freed tensors stay cached in whole segments: said, and not fragmentation
    assert f.derived["releasable_cache"] == res[0] - alloc[0] - nonrel[0]
    assert any("not fragmentation" in n for n in f.notes)


def test_the_oom_message_before_it_is_explained_as_before():
    text = open(REAL).read()
    message = text[:text.index("|===")]
    (alone,) = explain_text(message).findings
    (oom,) = [f for f in explain_text(text).findings if f.kind is Kind.CUDA_OOM]
    assert oom.numbers == alone.numbers and oom.diagnosis == alone.diagnosis
    assert [x.id for x in oom.fixes] == [x.id for x in alone.fixes]
    assert oom.numbers["requested"] == 72 * 2 ** 20


def _torch_table(stats: dict, device: int = 0, abbreviated: bool = False) -> str:
    """The table torch's own memory_summary() prints for these allocator stats (no GPU needed)."""
    torch_memory = pytest.importorskip("torch.cuda.memory")
    full = defaultdict(int, num_ooms=2, num_alloc_retries=7)
    full.update(stats)
    saved = torch_memory.memory_stats
    torch_memory.memory_stats = lambda device=None: full
    try:
        return torch_memory.memory_summary(device, abbreviated=abbreviated)
    finally:
        torch_memory.memory_stats = saved


FRAGMENTED = {
    "allocated_bytes.all.current": 900 * 2 ** 10 + 100,          # printed in KiB
    "allocated_bytes.all.peak": 20 * 2 ** 30 + 123 * 2 ** 20 + 5,  # MiB
    "reserved_bytes.all.current": 30 * 2 ** 30,
    "reserved_bytes.all.peak": 30 * 2 ** 30 + 7 * 2 ** 20,
    "reserved_bytes.all.allocated": 800 * 2 ** 30,                 # GiB (from 768 GiB up)
    "inactive_split_bytes.all.current": 512,                       # bytes
    "inactive_split_bytes.all.peak": 3 * 2 ** 30,
    "segment.all.current": 80, "segment.all.peak": 120,
}


@pytest.mark.parametrize("abbreviated", [False, True])
def test_a_fragmented_summary_in_other_units_gets_expandable_segments(abbreviated):
    text = _torch_table(FRAGMENTED, device=3, abbreviated=abbreviated)
    assert " KiB " in text and " MiB " in text and " GiB " in text and " 512 B " in text
    f = _summary(explain_text("training step 400\n" + text))
    alloc, res, nonrel = (_cells(text, r) for r in ("Allocated memory", "GPU reserved memory",
                                                    "Non-releasable memory"))
    assert f.gpus == (3,) and f.numbers["cuda_ooms"] == 2 and f.numbers["alloc_retries"] == 7
    assert (f.numbers["allocated"], f.numbers["allocated_peak"]) == tuple(alloc[:2])
    assert (f.numbers["reserved"], f.numbers["reserved_peak"]) == tuple(res[:2])
    assert (f.numbers["non_releasable"], f.numbers["non_releasable_peak"]) == tuple(nonrel[:2])
    assert f.numbers["segments_peak"] == 120
    # floored to the printed unit: within one unit below the allocator's true value
    for key, stat, unit in (("allocated", "allocated_bytes.all.current", 2 ** 10),
                            ("allocated_peak", "allocated_bytes.all.peak", 2 ** 20),
                            ("non_releasable", "inactive_split_bytes.all.current", 1)):
        assert 0 <= FRAGMENTED[stat] - f.numbers[key] < unit, key
    # 10.0 GiB reserved above the allocated peak at least: fragmentation, expandable segments
    gap = res[1] - alloc[1]
    assert f.derived["fragmentation"] == gap > 9 * 2 ** 30
    assert "fragmentation" in [d.cause for d in f.diagnosis]
    (fix,) = [x for x in f.fixes if x.id == "expandable_segments"]
    assert fix.effect_bytes == gap and fix.effect_bound == "up to"
    assert "expandable_segments:True" in fix.title


def test_a_cut_table_says_what_is_missing():
    text = _torch_table(FRAGMENTED)
    cut = "\n".join(text.splitlines()[:6])          # the header only
    f = _summary(explain_text(cut))
    assert f.cause == "memory_summary_unreadable" and f.fixes == ()
