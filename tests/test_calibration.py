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
                                load_record_model, torch_of)   # (the report's own rules)

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
    _WORK = (records, specs, budget, release, built_on_device(doc))
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
    records, specs, budget, release, on_device = _WORK
    rec = records[i]
    spec = specs[rec["model"]]
    e = estimate_record(spec, rec, budget, release, on_device)
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
        got = _max_batch(spec, rec, budget, release, on_device)
        if got not in (rec["measured_max_batch"], rec["measured_max_batch"] - 1):
            bad.append(("max batch", f"max batch: measured {rec['measured_max_batch']}, "
                                     f"predicted {got} (allowed: exact or one below)"))
    return bad


def _max_batch(spec, rec: dict, budget, release, on_device: bool) -> int | None:
    """`oomdoctor probe`'s largest batch for the record's configuration: the step alone, the
    model moved to the GPU. A ``build`` "host" file measured exactly that (b trained and
    b + 1 did not, each in a fresh process); the others searched with the harness, which
    builds the model on the GPU (not modelled by the probe: its construction's cached
    segments can change the OOM retry's outcome at the card's limit)."""
    return probe_config(spec, TraceConfig(1, precision=rec["precision"],
                                          checkpointing=rec["checkpointing"], torch=release),
                        budget, AllocatorConfig()).max_batch_size


# What the H200 run of 2026-11-26 (torch 2.11.0+cu130, driver 580.159.04) measured outside the
# tolerances, by cause as far as it is known. The test fails on any other record that leaves
# them, and on any of these that comes back inside (then delete it here): the list only shrinks.
_H200 = "nvidia-h200-2.11.0.json"
_MOVED = "nvidia-h200-2.11.0-moved.json"
KNOWN_DEVIATIONS: dict[str, list[tuple]] = {
    # The patch embedding's cuDNN forward workspace (measured, traces/vit_b16-fp32-ck0-b1209*:
    # 973,750,288 bytes at 1209, taken and freed inside the convolution): the input with its 3
    # channels padded to 4 and the filter staged channels-last, where the rule
    # (oomdoctor.sim.convolution, fitted on the cudnn_conv grid) stages the output too, as
    # cuDNN's plan does for this shape up to batch 128 and at 4-channel inputs: 728 MB over at
    # 1209, so the probe stops at 1197. Before the rule the replay had no workspace and said
    # 1210, which ran out of memory. Which operands a plan stages is cuDNN's run-time choice.
    "vit_b16 fp32: the patch embedding's cuDNN workspace stages no output copy": [
        (_H200, "vit_b16", "fp32", False, 1209, "max batch"),
        (_MOVED, "vit_b16", "fp32", False, 1209, "max batch"),
    ],
    # The probe replays the step of a model moved to the GPU, and says 359: measured so
    # (-moved.json: 359 trains, 360 does not). The harness built the model on the GPU, and 359
    # ran out of memory there, as the record's own estimate (construction replayed ahead of the
    # step, oomdoctor.runs.onbuild) says: the probe does not model a model built on the device.
    "built on the GPU: the probe models a model moved there": [
        (_H200, "lora_gpt", "fp32", False, 358, "max batch"),
    ],
    # Not the simulator: the GradScaler's first scale (65536) overflowed in both steps, so
    # optimizer.step() never ran and no AdamW state was made (checked on the same GPU: scale
    # 65536 -> 32768 -> 16384 with 0 state tensors at batch 1; at batch 2 the second step ran).
    # The measurement is two steps; training reaches the step the simulator counts.
    "fp16 GradScaler skipped both measured steps": [
        (_H200, "vit_b16", "fp16", False, 1, "allocated"),
        (_H200, "vit_b16", "fp16", False, 1, "reserved"),
    ],
    # ResNet at batch 4096: allocated within 0.1%, reserved off either way by the workspaces
    # cuDNN's convolutions take (measured, traces/resnet_cnn-*-b4096): up to 10.0 GiB (fp32)
    # and 6.0 GiB (bf16), each cached as its own segment. The rule (oomdoctor.sim.convolution)
    # stages input, output and filter channels-last, exact on the grid's 3x3 convolutions and
    # at batches 1-4 here (bf16 to 0.00%; without it the replay was 8-20% off at 4096); at 4096
    # cuDNN picks other plans for some layers - a 1.23 GB workspace for the fp32 1x1 shortcut
    # that the grid's 1x1 convolutions never took, none where the rule stages for the 16-bit
    # ones - which no shape rule predicts: -10.6% / -6.5% (fp32), -7.6% (fp16), +5.8% (bf16),
    # -5.4% (pure bf16). fp16, bf16 and pure bf16 with checkpointing are inside (pure bf16
    # since the stem's batch norm takes its fp32 copy, oomdoctor.sim.normalization: +19% before).
    "cuDNN's plan choice at batch 4096": [
        (_H200, "resnet_cnn", p, ck, 4096, "reserved")
        for p, ck in (("fp32", False), ("fp32", True), ("fp16", False), ("bf16", False),
                      ("bf16-pure", False))
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
    # The -search file's own search: 441 trained, the probe says 426. What fits is not monotonic
    # in the batch size there, on the GPU as in the replay (measured one fresh process per batch,
    # nvidia-h200-2.11.0-fresh.json: 429, 433, 437, 441 train; 430-432, 434, 436, 438, 440 run
    # out of memory in the second step at the third logits-sized block: in the replay an
    # activation block sits in one of the two cached logits segments, and the GPU's OOM message
    # counts the same allocated bytes); the harness's replay agrees at all eleven.
    # The probe replays the step alone, without the harness's construction on the GPU and the
    # cached segments it leaves for the OOM retry to free: nothing from 427 to 445 fits there.
    "max batch under pure bf16 with checkpointing": [
        ("nvidia-h200-2.11.0-search.json", "gpt2_small", "bf16-pure", True, 441, "max batch"),
    ],
    # calibrate.py measures every record in one long-lived process, emptying the cache between
    # runs. lora_gpt at 540 trained there; in a fresh process (-fresh.json) it runs out of
    # memory in the second step, with the peaks and the OOM message the replay gives, to the
    # byte. Likely cause (not measured): the driver places new segments in the address ranges
    # earlier runs freed, in another order than a fresh process's (sim/allocator/addresses.py),
    # and best fit breaks ties by address. The replay models a fresh process; the probe says 459
    # (not measured fresh).
    "measured in a process that had freed earlier runs' segments": [
        (_H200, "lora_gpt", "fp16", True, 540, "reserved"),
        (_H200, "lora_gpt", "bf16", True, 540, "reserved"),
        (_H200, "lora_gpt", "bf16", True, 540, "max batch"),
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


def test_calibrate_without_cuda_exits_2():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: calibrate.py would measure")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "calibrate.py")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "no CUDA GPU" in r.stderr and "run it on a machine with an NVIDIA GPU" in r.stderr
