"""Print the simulator's figures next to each committed real-GPU measurement.

    python benchmarks/calibration_report.py                        # every benchmarks/results/*.json
    python benchmarks/calibration_report.py path/to/results.json

For each record of a calibration file (written by benchmarks/calibrate.py on a CUDA machine):
the measured max_memory_allocated/reserved, oomdoctor's estimate of the same configuration
with the torch this process runs, and the error in percent; then the median and worst absolute
errors. tests/test_calibration.py asserts the tolerances; this prints the figures, including the
torch the measurement ran on next to the one simulating it.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB = 2**20


def budget_of(gpu: dict):
    """The budget a results file's records ran under: the whole card, no margin. The CUDA
    context is outside the allocator: it changes the budget (the max batch), never
    max_memory_allocated/reserved. It grows as kernels load lazily; where the file measured it
    after the runs too, that larger figure is what the largest batch saw."""
    from oomdoctor.plans.estimate import Budget
    from oomdoctor.runs.measure import profile_for_device
    profile = profile_for_device(gpu["name"], gpu["total_bytes"], tuple(gpu["compute_capability"]))
    context = max(gpu["context_bytes"], gpu.get("context_after_bytes") or grown_context(gpu))
    return Budget(profile, margin=0.0, context_bytes=context)


def grown_context(gpu: dict) -> int:
    """The context after the kernels loaded, for a file that measured it only at CUDA's first
    allocation: another results file's reading on the same card, driver and torch (the
    context is theirs, not the records'), else 0."""
    import glob
    import json
    for path in glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")):
        with open(path) as f:
            other = json.load(f)["gpu"]
        if other.get("context_after_bytes") and all(
                other.get(k) == gpu.get(k) for k in ("name", "total_bytes", "driver", "torch")):
            return other["context_after_bytes"]
    return 0


def torch_of(gpu: dict):
    """The torch release a results file measured (its CUDA facts are the ones to model,
    oomdoctor.sim.versions), or None (the installed torch's) where the file does not say."""
    from oomdoctor.sim.versions import parse_version
    return parse_version(gpu["torch"]) if gpu.get("torch") else None


def load_record_model(name: str, models_dir: str = os.path.join(ROOT, "sample_models")):
    """A record's model: a sample model's name, or a source `oomdoctor` takes by name
    (``torchvision:resnet50``, ``timm:NAME``): models outside sample_models, never tuned on."""
    from oomdoctor.models.loader import load_model, load_model_file
    if ":" in name:
        return load_model(name)
    return load_model_file(os.path.join(models_dir, f"{name}.py"))


def built_on_device(doc: dict) -> bool:
    """Whether a results file's runs built the model on the GPU (the harness's ``with dev:``,
    every file but those whose ``build`` is "host": built on the host, then moved, as a
    training script does and as ``oomdoctor estimate`` and ``probe`` place it)."""
    return doc.get("build", "device") == "device"


def estimate_record(spec, rec: dict, budget, torch_version=None, on_device: bool = True):
    """oomdoctor's estimate of the configuration one record measured, with the CUDA facts of
    ``torch_version`` (:func:`torch_of`; None: the installed torch's). Where the harness built
    the model on the GPU (oomdoctor/runs/measure.py ``_train``; ``on_device``), its
    construction is replayed ahead of the step (oomdoctor.runs.onbuild): under pure bf16 at
    small batches its fp32 weights are the measured peak."""
    from oomdoctor.plans.estimate import estimate
    from oomdoctor.runs.onbuild import harness_peaks
    from oomdoctor.sim.trace import TraceConfig
    cfg = TraceConfig(rec["batch_size"], precision=rec["precision"],
                      checkpointing=rec["checkpointing"], torch=torch_version)
    e = estimate(spec, cfg, budget)
    return harness_peaks(spec, cfg, budget, e) if on_device else e


def report(path: str) -> list[float]:
    import torch


    with open(path) as f:
        doc = json.load(f)
    gpu = doc["gpu"]
    budget = budget_of(gpu)
    print(f"{os.path.basename(path)}: {gpu['name']}, driver {gpu['driver']}, measured with torch "
          f"{gpu['torch']}; simulated with torch {torch.__version__}")
    print(f"{'model':<11} {'precision':<9} ck {'batch':>5}  {'alloc MiB':>10} {'pred':>10} "
          f"{'err':>6}  {'resv MiB':>10} {'pred':>10} {'err':>6}")
    specs: dict[str, object] = {}
    errors: list[float] = []
    for rec in doc["records"]:
        name = rec["model"]
        if name not in specs:
            specs[name] = load_record_model(name)
        e = estimate_record(specs[name], rec, budget, torch_of(gpu), built_on_device(doc))
        row = f"{name:<11} {rec['precision']:<9} {'y' if rec['checkpointing'] else 'n':>2} " \
              f"{rec['batch_size']:>5}"
        if rec["oom"]:
            print(f"{row}  OOM on the GPU; predicted {'fits' if e.fits else 'does not fit'}")
            continue
        cells = []
        for key, pred in (("max_memory_allocated", e.peak_allocated_bytes),
                          ("max_memory_reserved", e.peak_reserved_bytes)):
            err = 100 * (pred - rec[key]) / rec[key]
            errors.append(abs(err))
            cells.append(f"{rec[key] / MiB:>10.1f} {pred / MiB:>10.1f} {err:>+5.1f}%")
        extra = ""
        if rec.get("measured_max_batch") is not None:
            extra = f"  max batch measured {rec['measured_max_batch']}, " \
                    f"predicted {rec['predicted_max_batch']} (on the measuring machine)"
        print(f"{row}  {'  '.join(cells)}{extra}")
    return errors


def main(argv: list[str]) -> int:
    paths = argv or sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")))
    errors: list[float] = []
    for path in paths:
        errors += report(path)
        print()
    if errors:
        print(f"{len(errors)} figures: median |error| {statistics.median(errors):.2f}%, "
              f"worst {max(errors):.2f}%")
    else:
        print("no measurements found")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
