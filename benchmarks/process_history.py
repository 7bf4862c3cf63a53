"""Replay one model's records of a long-lived process in order, through one allocator.

    python benchmarks/process_history.py resnet_cnn
    python benchmarks/process_history.py lora_gpt benchmarks/results/nvidia-h200-2.11.0.json

calibrate.py runs a model's records one after another in one process, emptying the cache
between them (`"process": "per-model"` or `"one"` in a results file). The calibration replays
each record after one freed address range as large as the earlier runs' largest peak
(calibration_report.freed_before, oomdoctor.sim.allocator.addresses). This script replays the
history itself: every earlier run's construction and step, its blocks freed and the cache
emptied, so that the next run's segments are placed in the ranges those runs really left free.
It prints, per record, the measured peak reserved, the one-range replay and the whole-history
replay (a max-batch search's trials are not records, so they are not replayed). Where the two
replays agree and both miss the measurement, the process's history as the allocator model sees
it does not explain the gap (the CUDA context's lazily loaded kernels between the freed ranges,
and the driver's own placement, are outside it). On the H200 file (2026-11-28) the two agree
on all 124 records of gpt2_small, lora_gpt, vit_b16, resnet_cnn and tiny_mlp.

For a diagnosis, not a test: it compares two replays of the simulator with a measurement.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calibration_report import (ROOT, budget_of, freed_before, load_record_model,  # noqa: E402
                                record_config, torch_of)

GIB = 2**30
HANDLES_PER_RUN = 10**9      # each run's handles apart from every other's


def _in_history(alloc, events: list, offset: int) -> int:
    """Replay one run on ``alloc`` (the process's allocator so far), then free what it left
    and empty the cache as the harness's cleanup does; the run's peak reserved."""
    alloc.peak_reserved_bytes = alloc.reserved_bytes
    live: set[int] = set()
    for is_alloc, h, n in events:
        h = h + offset if h >= 0 else h - offset
        if is_alloc:
            alloc.malloc(h, n)
            live.add(h)
        else:
            alloc.free(h)
            live.discard(h)
    peak = alloc.peak_reserved_bytes
    for h in live:
        alloc.free(h)
    alloc.empty_cache()
    return peak


def history(path: str, model: str) -> list[tuple[dict, int, int]]:
    """(record, one-range replay's peak reserved, whole-history replay's) for each of
    ``model``'s records in ``path``, in the order the process ran them."""
    from oomdoctor.runs.onbuild import harness_events
    from oomdoctor.sim.allocator import AllocatorConfig, replay
    from oomdoctor.sim.allocator.caching import CachingAllocator
    with open(path) as f:
        doc = json.load(f)
    if doc.get("process", "fresh") == "fresh":
        raise SystemExit(f"{path}: every record ran in a fresh process; there is no history")
    budget, tv = budget_of(doc["gpu"]), torch_of(doc["gpu"])
    specs: dict[str, object] = {}
    alloc = CachingAllocator(AllocatorConfig())
    rows = []
    for i, rec in enumerate(doc["records"]):
        if doc["process"] == "per-model" and rec["model"] != model:
            continue
        if rec["model"] not in specs:
            specs[rec["model"]] = load_record_model(rec["model"])
        events = harness_events(specs[rec["model"]], record_config(rec, tv), budget.gpu)
        whole = _in_history(alloc, events, (i + 1) * HANDLES_PER_RUN)
        if rec["model"] != model or rec["oom"]:
            continue
        one = replay(events, AllocatorConfig(), None,
                     freed_bytes=freed_before(doc, i, budget.limit_bytes))
        rows.append((rec, one.peak_reserved_bytes, whole))
    return rows


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    model = argv[0]
    path = argv[1] if len(argv) > 1 else os.path.join(ROOT, "benchmarks", "results",
                                                      "nvidia-h200-2.11.0.json")
    print(f"{os.path.basename(path)}: {model}'s records in their process's order; "
          "peak reserved GiB (error)")
    print(f"{'precision':<9} ck {'batch':>5} {'measured':>9} {'one freed range':>17} "
          f"{'whole history':>17}")
    for rec, one, whole in history(path, model):
        measured = rec["max_memory_reserved"]
        cells = "".join(f" {v / GIB:>9.2f} ({(v - measured) / measured:>+6.1%})"
                        for v in (one, whole))
        print(f"{rec['precision']:<9} {'y' if rec['checkpointing'] else 'n':>2} "
              f"{rec['batch_size']:>5} {measured / GIB:>9.2f}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
