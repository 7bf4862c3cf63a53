"""The simulator against real GPU measurements committed under benchmarks/results/."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass

import pytest

from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.plans.estimate import Budget, estimate
from oomdoctor.models.loader import load_model_file
from oomdoctor.plans.probe import probe_config
from oomdoctor.sim.trace import TraceConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from calibration_report import (budget_of, built_on_device, estimate_record,  # noqa: E402
                                freed_before, harness_max_batch, load_record_model,
                                torch_of)   # (the report's own rules)

RESULTS = os.path.join(ROOT, "benchmarks", "results")
ALLOCATED_TOL, RESERVED_TOL = 0.03, 0.05


@dataclass(frozen=True)
class Mismatch:
    record: dict
    kind: str       # "allocated", "reserved", "oom" or "max batch"
    what: str

    def key(self, path: str) -> tuple:
        r = self.record
        return (os.path.basename(path), r["model"], r["precision"], r["checkpointing"],
                r["batch_size"], self.kind)


def check_file(path: str, models_dir: str = os.path.join(ROOT, "sample_models"),
               jobs: int | None = None) -> tuple[int, list[Mismatch]]:
    """Re-estimate every record of one results file; (records checked, mismatches). Records
    are independent: ``jobs`` forked workers share them (the suite runs in one process, and the
    re-estimates are most of this test's time); under pytest-xdist the workers have the cores."""
    global _WORK
    if jobs is None:
        jobs = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
    with open(path) as f:
        doc = json.load(f)
    assert doc["schema"] == 1, f"{path}: unknown schema {doc['schema']}"
    budget = budget_of(doc["gpu"])
    release = torch_of(doc["gpu"])      # the measured torch's CUDA facts (sim.versions)
    records = doc["records"]
    specs = {m: load_record_model(m, models_dir)
             for m in dict.fromkeys(r["model"] for r in records)}
    _WORK = (doc, specs, budget, release, built_on_device(doc))
    try:
        if jobs > 1 and len(records) > 4:
            from oomdoctor.plans.workers import forked_pool
            with forked_pool(jobs) as pool:
                found = list(pool.map(_check_record, range(len(records))))
        else:
            found = [_check_record(i) for i in range(len(records))]
    finally:
        _WORK = None
    return len(records), [Mismatch(records[i], kind, what)
                          for i, misses in enumerate(found) for kind, what in misses]


# The file being checked, inherited by forked workers: a model file's functions live in a
# module made at run time, which pickle cannot send.
_WORK: tuple | None = None


def _check_record(i: int) -> list[tuple[str, str]]:
    """(kind, what) for each way record ``i`` of the file in _WORK leaves the tolerances."""
    doc, specs, budget, release, on_device = _WORK
    rec = doc["records"][i]
    spec = specs[rec["model"]]
    e = estimate_record(spec, rec, budget, release, on_device,
                        freed_before(doc, i, budget.limit_bytes))
    bad = []
    if rec["oom"]:
        if e.fits:
            bad.append(("oom", f"OOMed on the GPU, predicted to fit ({e.peak_reserved_bytes} "
                               "reserved)"))
    else:
        for key, pred, tol in (("max_memory_allocated", e.peak_allocated_bytes, ALLOCATED_TOL),
                               ("max_memory_reserved", e.peak_reserved_bytes, RESERVED_TOL)):
            real = rec[key]
            if abs(pred - real) > tol * real:
                bad.append((key.split("_")[-1], f"{key}: measured {real}, predicted {pred} "
                                                f"({100 * (pred - real) / real:+.1f}%, "
                                                f"tolerance {100 * tol:.0f}%)"))
    if rec.get("measured_max_batch") is not None:
        got = _max_batch(spec, rec, budget, release, on_device, doc.get("process", "fresh"))
        if got not in (rec["measured_max_batch"], rec["measured_max_batch"] - 1):
            bad.append(("max batch", f"max batch: measured {rec['measured_max_batch']}, "
                                     f"predicted {got} (allowed: exact or one below)"))
    return bad


def _max_batch(spec, rec: dict, budget, release, on_device: bool, process: str) -> int | None:
    """The simulator's answer to the search the record's file ran. A ``build`` "host" file
    measured what `oomdoctor probe` answers (b trained and b + 1 did not, the model moved to
    the GPU, each in a fresh process): the probe's largest batch. The others ran calibrate.py's
    search, which builds the model on the GPU, in the process of the runs before it: that
    search replayed (calibration_report.harness_max_batch), its trials after a run at the
    card's limit."""
    if on_device:
        freed = 0 if process == "fresh" else budget.limit_bytes
        return harness_max_batch(spec, rec, budget, release, freed)
    return probe_config(spec, TraceConfig(1, precision=rec["precision"],
                                          checkpointing=rec["checkpointing"], torch=release),
                        budget, AllocatorConfig()).max_batch_size


# What the H200 run of 2026-11-26 (torch 2.11.0+cu130, driver 580.159.04) measured outside the
# tolerances, by cause as far as it is known. The test fails on any other record that leaves
# them, and on any of these that comes back inside (then delete it here): the list only shrinks.
_H200 = "nvidia-h200-2.11.0.json"
_MOVED = "nvidia-h200-2.11.0-moved.json"
_FRESH = "nvidia-h200-2.11.0-fresh.json"
KNOWN_DEVIATIONS: dict[str, list[tuple]] = {
    # The patch embedding's cuDNN forward workspace (measured, traces/vit_b16-fp32-ck0-b1209*:
    # 973,750,288 bytes at 1209, taken and freed inside the convolution): the input with its 3
    # channels padded to 4 and the filter staged channels-last, where the rule
    # (oomdoctor.sim.convolution, fitted on the cudnn_conv grid) stages the output too, as
    # cuDNN's plan does for this shape up to batch 128 and at 4-channel inputs: 728 MB over at
    # 1209, so the probe (and the harness's search replayed) stops at 1197. Before the rule the replay had no workspace and said
    # 1210, which ran out of memory. Which operands a plan stages is cuDNN's run-time choice.
    "vit_b16 fp32: the patch embedding's cuDNN workspace stages no output copy": [
        (_H200, "vit_b16", "fp32", False, 1209, "max batch"),
        (_MOVED, "vit_b16", "fp32", False, 1209, "max batch"),
    ],
    # Not the simulator: the GradScaler's first scale (65536) overflowed in both steps, so
    # optimizer.step() never ran and no AdamW state was made (checked on the same GPU: scale
    # 65536 -> 32768 -> 16384 with 0 state tensors at batch 1; at batch 2 the second step ran).
    # The measurement is two steps; training reaches the step the simulator counts.
    "fp16 GradScaler skipped both measured steps": [
        (_H200, "vit_b16", "fp16", False, 1, "allocated"),
        (_H200, "vit_b16", "fp16", False, 1, "reserved"),
    ],
    # ResNet fp32 at batch 4096: allocated within 0.1%, reserved low by the workspaces cuDNN's
    # fp32 convolutions take (measured, traces/resnet_cnn-fp32-ck0-b4096, a fresh process that
    # reserved what the long-lived one did, to the byte): up to 10.0 GiB, each cached as its own
    # segment, among them a 1.23 GB workspace for the 1x1 shortcut that no 1x1 convolution of
    # the cudnn_conv grid took. The rule (oomdoctor.sim.convolution) stages input, output and
    # filter channels-last, exact on the grid and at batches 1-4 here; which plan cuDNN picks
    # at 4096 no shape rule predicts: -10.6% (both files) and -6.5% with checkpointing.
    "cuDNN's fp32 plans at batch 4096": [
        (_H200, "resnet_cnn", "fp32", False, 4096, "reserved"),
        (_H200, "resnet_cnn", "fp32", True, 4096, "reserved"),
        (_FRESH, "resnet_cnn", "fp32", False, 4096, "reserved"),
    ],
    # ResNet in 16 bits at batch 4096, measured in calibrate.py's long-lived process, where
    # two measured effects move the reserve by GiBs and are not separated for these rows:
    # - the process's history: the same bf16 run reserved 59.37 GiB in a fresh process
    #   (-fresh.json, the replay -1.1%) and 55.54 GiB in the long-lived one (the replay with the
    #   freed range, freed_before, +1.6%). The replay's freed range is one range; on the GPU the
    #   CUDA context's lazily loaded kernels (it grew from 619 to 771 MiB over gpt2_small's
    #   runs, -search.json) sit between the freed segments (the events of lora_gpt's run after
    #   others, newpaths/traces/*-after, place segments in scattered holes);
    # - cuDNN's plans per dtype: fp16 and bf16, identical in every allocation the simulator
    #   sees, reserved 63.55 and 55.54 GiB without checkpointing, 46.82 and 47.81 with.
    # Replayed: -11.2%, -11.0%, -12.8%, and pure bf16 -5.4%; replayed with the process's whole
    # history instead (benchmarks/process_history.py: every earlier run of the file in one
    # allocator, the cache emptied between), the same figures to the byte, so no history the
    # allocator model sees explains them. Nor does a per-dtype constant: fp16 reserved more
    # than bf16 without checkpointing (+8.0 GiB) and less with it (-1.0 GiB), the same
    # convolutions running in both. Each row run fresh (prepared: benchmarks/results/README.md)
    # would say which.
    "ResNet's 16-bit workspaces after earlier runs, or cuDNN's fp16 plans": [
        (_H200, "resnet_cnn", p, ck, 4096, "reserved")
        for p, ck in (("fp16", False), ("fp16", True), ("bf16", True), ("bf16-pure", False))
    ],
    # ResNet fp32 at batch 4 with checkpointing: 10 MiB more allocated than simulated. The peak
    # is a backward workspace (13.5 MiB in the events of the same run without checkpointing,
    # traces/resnet_cnn-fp32-ck0-b4) of a weight pass: at small batches cuDNN's fp32 plans for
    # it take scratch of 2-53 times the filter, or split-K partial sums of up to 8.65 MB, on
    # top of what the rule stages (the cudnn_conv grid), a per-plan choice. The run without
    # checkpointing is inside since the rule (-3.0%).
    "ResNet fp32 at batch 4: a weight pass's split-K scratch": [
        (_H200, "resnet_cnn", "fp32", True, 4, "allocated"),
    ],
}


def test_committed_gpu_measurements():
    files = sorted(glob.glob(os.path.join(RESULTS, "*.json")))
    if not files:
        msg = ("no GPU measurements committed under benchmarks/results/ yet: the simulator is "
               "not checked against a real GPU here; run `python benchmarks/calibrate.py` on a "
               "CUDA machine and commit the JSON it writes")
        warnings.warn(msg)
        print(f"calibration: 0 records in 0 files ({msg})")
        return
    known = {key for keys in KNOWN_DEVIATIONS.values() for key in keys}
    total, found, new = 0, set(), []
    for path in files:
        n, bad = check_file(path)
        total += n
        for m in bad:
            found.add(m.key(path))
            if m.key(path) not in known:
                r = m.record
                new.append(f"{os.path.basename(path)}: {r['model']} {r['precision']} "
                           f"ck={r['checkpointing']} b={r['batch_size']}: {m.what}")
    print(f"calibration: {total} records in {len(files)} files, {len(found)} known deviations")
    assert not new, "\n".join(new)
    back_inside = sorted(known - found)
    assert not back_inside, f"now inside the tolerances, delete from KNOWN_DEVIATIONS: {back_inside}"


def _synthetic(tmp_path, allocated_scale: float = 1.0, oom: bool = False):
    """A results file whose "measurements" are oomdoctor's own estimate of tiny_mlp."""
    from oomdoctor.sim.gpus import PROFILES
    gpu = PROFILES["a10"]
    spec = load_model_file(os.path.join(ROOT, "sample_models", "tiny_mlp.py"))
    budget = Budget(gpu, margin=0.0, context_bytes=400 * 2**20)
    e = estimate(spec, TraceConfig(4), budget)
    records = [{"model": "tiny_mlp", "precision": "fp32", "checkpointing": False,
                "batch_size": 4, "max_memory_allocated": int(e.peak_allocated_bytes * allocated_scale),
                "max_memory_reserved": e.peak_reserved_bytes, "oom": oom}]
    doc = {"schema": 1, "gpu": {"name": "NVIDIA A10", "total_bytes": gpu.total_bytes,
                                "compute_capability": [8, 6], "profile": "a10",
                                "context_bytes": 400 * 2**20, "driver": None, "cuda": None,
                                "torch": None, "python": None},
           "records": records}
    path = tmp_path / "nvidia-a10-0.0.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_comparison_plumbing_on_a_synthetic_record(tmp_path):
    """Plumbing only, not accuracy: the "measurement" is oomdoctor's own estimate of tiny_mlp,
    so this checks that the file is read, the profile is picked from the device name, each record
    re-estimated and compared with the tolerances - never that the simulator matches a GPU."""
    n, bad = check_file(_synthetic(tmp_path))
    assert (n, bad) == (1, [])
    # 10% off in allocated memory is caught, with the numbers in the message.
    n, bad = check_file(_synthetic(tmp_path, allocated_scale=1.10))
    assert len(bad) == 1 and "max_memory_allocated" in bad[0].what and "tolerance 3%" in bad[0].what
    # An OOM where the estimate fits is caught.
    n, bad = check_file(_synthetic(tmp_path, oom=True))
    assert len(bad) == 1 and "OOMed on the GPU" in bad[0].what


def test_freed_before_follows_the_process_the_records_ran_in():
    """A record's process history, from the file's own measurements: the runs before it in its
    process, the largest peak reserved, the whole budget after an OOM or a search."""
    def rec(model, reserved, **kw):
        return {"model": model, "max_memory_reserved": reserved, "oom": False, **kw}
    records = [rec("a", 100), rec("a", 300), rec("b", 50), rec("b", 0, oom=True),
               rec("a", 200, measured_max_batch=7), rec("a", 10)]
    limit = 1000
    per_model = {"process": "per-model", "records": records}
    assert [freed_before(per_model, i, limit) for i in range(6)] == [0, 100, 0, 50, 300, 1000]
    one = {"process": "one", "records": records}
    assert [freed_before(one, i, limit) for i in range(6)] == [0, 100, 300, 300, 1000, 1000]
    assert [freed_before({"records": records}, i, limit) for i in range(6)] == [0] * 6
    with pytest.raises(ValueError, match="unknown process"):
        freed_before({"process": "shared", "records": records}, 1, limit)


def test_whole_process_history_replays_as_one_freed_range():
    """benchmarks/process_history.py's replay of tiny_mlp's long-lived process (every earlier
    run replayed in one allocator) against the GPU's measurements, next to the one freed range
    the calibration replays: both inside the tolerance on every record."""
    from process_history import history
    rows = history(os.path.join(RESULTS, "nvidia-h200-2.11.0.json"), "tiny_mlp")
    assert len(rows) >= 12
    for rec, one, whole in rows:
        measured = rec["max_memory_reserved"]
        for figure in (one, whole):
            assert abs(figure - measured) <= RESERVED_TOL * measured, (rec, one, whole)


def test_calibrate_without_cuda_exits_2():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: calibrate.py would measure")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "calibrate.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "no CUDA GPU" in r.stderr and "run it on a machine with an NVIDIA GPU" in r.stderr
