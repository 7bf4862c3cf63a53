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


def record_config(rec: dict, torch_version=None):
    """The TraceConfig of the configuration one record measured."""
    from oomdoctor.sim.trace import TraceConfig
    return TraceConfig(rec["batch_size"], precision=rec["precision"],
                       checkpointing=rec["checkpointing"], torch=torch_version)


def estimate_record(spec, rec: dict, budget, torch_version=None, on_device: bool = True,
                    freed_bytes: int = 0):
    """oomdoctor's estimate of the configuration one record measured, with the CUDA facts of
    ``torch_version`` (:func:`torch_of`; None: the installed torch's). Where the harness built
    the model on the GPU (oomdoctor/runs/measure.py ``_train``; ``on_device``), its
    construction is replayed ahead of the step (oomdoctor.runs.onbuild): under pure bf16 at
    small batches its fp32 weights are the measured peak. ``freed_bytes``: the address range
    the record's process had taken and returned before it (:func:`freed_before`)."""
    from oomdoctor.plans.estimate import estimate
    from oomdoctor.runs.onbuild import harness_peaks
    cfg = record_config(rec, torch_version)
    e = estimate(spec, cfg, budget)
    return harness_peaks(spec, cfg, budget, e, freed_bytes=freed_bytes) if on_device else e


# How a results file's runs shared processes (its "process" key): "fresh", one process per
# record (trace_sample.py); "per-model", the records of each model in one process, in file
# order (calibrate.py run once per model); "one", every record in one process (calibrate.py).
PROCESSES = ("fresh", "per-model", "one")


def freed_before(doc: dict, i: int, limit_bytes: int) -> int:
    """The address range record ``i``'s process had taken and returned before its run: the
    largest peak reserved of the runs before it there, each emptied from the cache when it
    ended (oomdoctor.runs.measure TorchRunner.cleanup), and the whole budget after a run that
    ran out of memory or a max-batch search (whose last trial did). Those segments' ranges,
    freed, are where the driver puts the next run's (oomdoctor.sim.allocator.addresses); 0 in
    a fresh process."""
    process = doc.get("process", "fresh")
    if process not in PROCESSES:
        raise ValueError(f"results file: unknown process {process!r}; one of {PROCESSES}")
    if process == "fresh":
        return 0
    model = doc["records"][i]["model"]
    freed = 0
    for r in doc["records"][:i]:
        if process == "one" or r["model"] == model:
            to_limit = r["oom"] or r.get("measured_max_batch") is not None
            freed = max(freed, limit_bytes if to_limit else r["max_memory_reserved"])
    return freed


class ReplayRunner:
    """The device half of oomdoctor.runs.measure.measured_probe, replayed: a trial runs out of
    memory where the harness's run (the model built on the GPU, then the step, in a process
    that freed ``freed_bytes`` before) does not fit ``budget`` in the replay. Lets a test run
    the harness's own max-batch search on the simulator and compare its answer with the GPU's."""

    device = "replay"

    def __init__(self, budget, freed_bytes: int = 0) -> None:
        self.budget = budget
        self.freed_bytes = freed_bytes

    def device_name(self) -> str:
        return self.budget.gpu.name

    def memory(self):
        return None, None

    def peaks(self):
        return None, None

    def reset_peaks(self) -> None:
        pass

    def cleanup(self) -> None:
        pass

    def train(self, spec, cfg) -> None:
        import torch
        from oomdoctor.plans.estimate import estimate
        from oomdoctor.runs.onbuild import harness_peaks
        e = harness_peaks(spec, cfg, self.budget, estimate(spec, cfg, self.budget),
                          freed_bytes=self.freed_bytes)
        if not e.fits:
            raise torch.OutOfMemoryError(f"replayed: batch {cfg.batch_size} does not fit")


def harness_max_batch(spec, rec: dict, budget, torch_version=None, freed_bytes: int = 0):
    """The largest batch the harness's search finds in the replay: measured_probe as
    calibrate.py ran it, seeded with the record's ``predicted_max_batch``, on a
    :class:`ReplayRunner`. A process's search runs after the configuration's own run at
    that batch, so ``freed_bytes`` is the budget's where the file shared processes."""
    from calibrate import MAX_SEARCH
    from oomdoctor.runs.measure import measured_probe
    from oomdoctor.sim.trace import TraceConfig
    base = TraceConfig(1, precision=rec["precision"], checkpointing=rec["checkpointing"],
                       torch=torch_version)
    return measured_probe(spec, base, runner=ReplayRunner(budget, freed_bytes),
                          predicted_max=rec["predicted_max_batch"],
                          max_batch=MAX_SEARCH).max_batch_size


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
    for i, rec in enumerate(doc["records"]):
        name = rec["model"]
        if name not in specs:
            specs[name] = load_record_model(name)
        e = estimate_record(specs[name], rec, budget, torch_of(gpu), built_on_device(doc),
                            freed_before(doc, i, budget.limit_bytes))
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
