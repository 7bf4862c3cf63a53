"""DeepSpeed's ZeRO stages against real runs on an H200 (benchmarks/results/deepspeed/, written
by benchmarks/measure_deepspeed.py: DeepSpeed 0.19.8, torch 2.11, one GPU, DeepSpeedExamples'
bf16_master_weight transformer trained as its train.py does: ZeRO-0 to 3, bf16, fp16 and fp32,
torch's AdamW and DeepSpeed's FusedAdam, small overlapped buckets, accumulation, checkpointing.
The second file was measured once the model matched the first; before it was read, stage 1,
the overlapped buckets and FusedAdam were already within 0.13% allocated, fp32 -11.5% (its
master copy) and accumulation +4.4%, and four reserved peaks 9-13% off, each then traced to its
cause in the events). Each record is typed as a user
would (`oomdoctor parallel MODEL --ds-config ds.json --deepspeed 0.19.8`) and both peaks are
asserted: what DeepSpeed allocates besides the shards (flat 16-bit buffers, fp32 master
sub-groups, reduce buckets and stage 3's reduce-scatter buffers on their stream, the gradient
norm's float64 copies, start-up transients and the cache it empties) is what a world size of one measures."""
import glob
import json
import os

import pytest
from click.testing import CliRunner

from oomdoctor.cli import cli

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = os.path.join(HERE, "models", "ds_simple_transformer.py")
FILES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "deepspeed", "*.json")))
# the calibration's tolerances (tests/test_calibration.py) are 3% and 5%; these runs hold
# tighter, and are asserted so (the widest: accumulation -1.2% allocated, where the trace adds
# the second micro-batch's gradients into the first's and DeepSpeed, having dropped those,
# gets new ones; FP16_UnfusedOptimizer's per-parameter start-up copies, -1.7% reserved)
ALLOCATED_TOL, RESERVED_TOL = 0.015, 0.02


def _records() -> list[tuple[dict, dict]]:
    out = []
    for path in FILES:
        with open(path) as f:
            doc = json.load(f)
        out += [(doc["environment"], r) for r in doc["records"]]
    return out


RECORDS = _records()


def _skips_steps(rec: dict) -> bool:
    """fp16 at ZeRO 1-3: the optimizer state is made by the first step that runs (stage 0's
    FP16_UnfusedOptimizer makes it at start-up)."""
    return "fp16" in rec["ds_config"] and rec["ds_config"]["zero_optimization"]["stage"] > 0


def _name(rec: dict) -> str:
    return f"{rec['setup']}-{rec['model']}-b{rec['batch_size']}-ck{int(rec['checkpointing'])}"


def record_setup(rec: dict, tmp_path, monkeypatch):
    """The record's model sizes in the environment (the model file reads them) and its
    DeepSpeed config as a file; the file's path."""
    monkeypatch.setenv("DS_HIDDEN", str(rec["hidden"]))
    monkeypatch.setenv("DS_LAYERS", str(rec["layers"]))
    monkeypatch.setenv("DS_HEADS", str(rec["heads"]))
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(rec["ds_config"]))
    return config


def _estimate(rec: dict, env: dict, tmp_path, monkeypatch) -> dict:
    """oomdoctor's one GPU for the record's run, from `parallel --json`."""
    config = record_setup(rec, tmp_path, monkeypatch)
    args = ["parallel", MODEL, "--gpus", "1", "--gpu", "h200", "-b", str(rec["batch_size"]),
            "--ds-config", str(config), "--deepspeed", env["deepspeed"], "--json"]
    accumulation = rec["ds_config"].get("gradient_accumulation_steps", 1)
    args += ["--grad-accum", str(accumulation)] if accumulation > 1 else []
    r = CliRunner().invoke(cli, args + (["--checkpointing"] if rec["checkpointing"] else []))
    assert r.exit_code == 0, r.output
    [strategy] = json.loads(r.stdout)["strategies"]
    [gpu] = strategy["gpus"]
    return gpu


def test_the_records_are_there():
    assert len(RECORDS) >= 20, FILES
    assert all(r["error"] is None for _, r in RECORDS)


# Outside the tolerances with a cause read in the events, not modelled yet; each asserted
# outside (delete it here once it comes inside). Empty since the held-out 1.4B run with its
# parameters offloaded (-33% allocated, -28% reserved) came inside: its events showed 2.0 GiB
# gathered after the forward, which DeepSpeed's coordinator keeps (its prefetch runs ahead by
# up to stage3_max_live_parameters and keeps what it passes, oomdoctor.plans.parallel.
# zero3_coordinator) plus the attention projections whose views the backward saves
# (oomdoctor.sim.zero3), all gathered on the all-gather stream, and the start-up gathers of
# create_reduce_and_remove_grad_hooks on the default stream.
KNOWN_DEVIATIONS: dict[str, tuple[str, ...]] = {}


def check_peaks(gpu: dict, rec: dict) -> None:
    """Both peaks within the tolerances, or outside where KNOWN_DEVIATIONS says so."""
    close = {"allocated": gpu["peak_allocated_bytes"] == pytest.approx(
                 rec["max_memory_allocated"], rel=ALLOCATED_TOL),
             "reserved": gpu["peak_reserved_bytes"] == pytest.approx(
                 rec["max_memory_reserved"], rel=RESERVED_TOL)}
    for kind in KNOWN_DEVIATIONS.get(_name(rec), ()):
        assert not close[kind], f"{_name(rec)}: {kind} now inside, delete it from the list"
        close[kind] = True
    assert all(close.values()), (_name(rec), gpu["peak_allocated_bytes"],
                                 rec["max_memory_allocated"], gpu["peak_reserved_bytes"],
                                 rec["max_memory_reserved"])


@pytest.mark.parametrize("env,rec", [(e, r) for e, r in RECORDS if not _skips_steps(r)],
                         ids=lambda x: _name(x) if "setup" in x else "")
def test_peaks_match_the_gpu(env, rec, tmp_path, monkeypatch):
    check_peaks(_estimate(rec, env, tmp_path, monkeypatch), rec)


def _phase(rec: dict, name: str) -> dict:
    return next(p for p in rec["phases"] if p["phase"] == name)


@pytest.mark.parametrize("env,rec", [(e, r) for e, r in RECORDS if _skips_steps(r)],
                         ids=lambda x: _name(x) if "setup" in x else "")
def test_fp16_runs_that_skip_their_first_steps(env, rec, tmp_path, monkeypatch):
    """fp16: DeepSpeed's dynamic loss scale starts at 2**16, the first steps overflow and are
    skipped, so a three-step run holds no optimizer state until its last step (measured: the
    allocated bytes after steps 0 and 1 equal those before them) and its peak is below the
    steady state's. The bytes before any step must match the model's; the whole-run
    estimate (the steady state) must match the same run in bf16, which steps every time."""
    after = [_phase(rec, f"step{i}")["memory_allocated"] for i in range(3)]
    assert after[0] == after[1] < after[2]              # two skipped steps, then the state
    gpu = _estimate(rec, env, tmp_path, monkeypatch)
    twin = next((r for _, r in RECORDS if r["setup"] == rec["setup"].replace("fp16", "bf16")
                 and r["model"] == rec["model"] and r["batch_size"] == rec["batch_size"]
                 and r["checkpointing"] == rec["checkpointing"]), None)
    assert twin is not None, "measure_deepspeed.py pairs every fp16 ZeRO run with a bf16 one"
    for phase in ("forward0", "backward0"):             # nothing stepped yet: the same bytes
        assert _phase(rec, phase)["max_memory_allocated"] == pytest.approx(
            _phase(twin, phase)["max_memory_allocated"], rel=0.001)
    assert gpu["peak_allocated_bytes"] == pytest.approx(twin["max_memory_allocated"],
                                                        rel=ALLOCATED_TOL)
    assert gpu["peak_reserved_bytes"] == pytest.approx(twin["max_memory_reserved"],
                                                       rel=RESERVED_TOL)
