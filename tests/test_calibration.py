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
from oomdoctor.runs.measure import profile_for_device
from oomdoctor.plans.probe import probe_config
from oomdoctor.sim.trace import TraceConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
ALLOCATED_TOL, RESERVED_TOL = 0.03, 0.05


@dataclass(frozen=True)
class Mismatch:
    record: dict
    what: str


def check_file(path: str, models_dir: str = os.path.join(ROOT, "sample_models")
               ) -> tuple[int, list[Mismatch]]:
    """Re-estimate every record of one results file; (records checked, mismatches)."""
    with open(path) as f:
        doc = json.load(f)
    assert doc["schema"] == 1, f"{path}: unknown schema {doc['schema']}"
    gpu = doc["gpu"]
    profile = profile_for_device(gpu["name"], gpu["total_bytes"], tuple(gpu["compute_capability"]))
    # The CUDA context is outside the allocator: it changes the budget (the max batch), never
    # max_memory_allocated/reserved.
    budget = Budget(profile, margin=0.0, context_bytes=gpu["context_bytes"])
    specs: dict[str, object] = {}
    bad: list[Mismatch] = []
    for rec in doc["records"]:
        spec = specs.get(rec["model"]) or specs.setdefault(
            rec["model"], load_model_file(os.path.join(models_dir, f"{rec['model']}.py")))
        cfg = TraceConfig(rec["batch_size"], precision=rec["precision"],
                          checkpointing=rec["checkpointing"])
        e = estimate(spec, cfg, budget)
        if rec["oom"]:
            if e.fits:
                bad.append(Mismatch(rec, f"OOMed on the GPU, predicted to fit "
                                         f"({e.peak_reserved_bytes} reserved)"))
        else:
            for key, pred, tol in (("max_memory_allocated", e.peak_allocated_bytes, ALLOCATED_TOL),
                                   ("max_memory_reserved", e.peak_reserved_bytes, RESERVED_TOL)):
                real = rec[key]
                if abs(pred - real) > tol * real:
                    bad.append(Mismatch(rec, f"{key}: measured {real}, predicted {pred} "
                                             f"({100 * (pred - real) / real:+.1f}%, tolerance "
                                             f"{100 * tol:.0f}%)"))
        if rec.get("measured_max_batch") is not None:
            got = probe_config(spec, TraceConfig(1, precision=rec["precision"],
                                                 checkpointing=rec["checkpointing"]),
                               budget, AllocatorConfig()).max_batch_size
            if got not in (rec["measured_max_batch"], rec["measured_max_batch"] - 1):
                bad.append(Mismatch(rec, f"max batch: measured {rec['measured_max_batch']}, "
                                         f"predicted {got} (allowed: exact or one below)"))
    return len(doc["records"]), bad


def test_committed_gpu_measurements():
    files = sorted(glob.glob(os.path.join(RESULTS, "*.json")))
    if not files:
        msg = ("no GPU measurements committed under benchmarks/results/ yet: the simulator is "
               "not checked against a real GPU here; run `python benchmarks/calibrate.py` on a "
               "CUDA machine and commit the JSON it writes")
        warnings.warn(msg)
        print(f"calibration: 0 records in 0 files ({msg})")
        return
    total = 0
    problems: list[str] = []
    for path in files:
        n, bad = check_file(path)
        total += n
        problems += [f"{os.path.basename(path)}: {m.record['model']} {m.record['precision']} "
                     f"ck={m.record['checkpointing']} b={m.record['batch_size']}: {m.what}"
                     for m in bad]
    print(f"calibration: {total} records in {len(files)} files")
    assert not problems, "\n".join(problems)


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
