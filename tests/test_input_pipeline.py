"""Will the GPU wait for data? (oomdoctor.runs.input_pipeline)

The data side is measured, never guessed: the script's own DataLoader is run again at each worker
count on this CPU. The slow script (tests/scripts/data_loop.py) sleeps in ``__getitem__`` as a
dataset waiting on disk does, so its time per batch has a floor no machine load can lower: 0.8 ms
x 128 samples = 102 ms at num_workers=0 against an 85 ms GPU step (a T4 in fp32), and about half
of that with 2 workers - a margin of a third of the step for a loaded CI machine. The GPU side is checked against an exact FLOP formula and against the
figure recommend's step-time model gives the same network as a model file.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from oomdoctor.models.script import parse_command
from oomdoctor.plans.estimate import Budget, script_trace
from oomdoctor.runs.input_pipeline import WAITS, check_input, render_text
from oomdoctor.sim.gpus import get_profile
from oomdoctor.sim.trace import TraceConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP = os.path.join(ROOT, "tests", "scripts", "data_loop.py")
T4 = Budget(get_profile("t4"))
WIDTH, HIDDEN, BATCH = 8192, 8, 128


def _trace(*args: str, launcher=("python",)):
    return script_trace(parse_command([*launcher, LOOP, "--batch-size", str(BATCH), "--hidden",
                                       str(HIDDEN), *args]), TraceConfig(1), T4)


@pytest.fixture(scope="module")
def slow():
    return _trace("--delay-ms", "0.8")


def test_the_step_flops_are_the_networks(slow):
    """Linear(w, 8w) -> GELU -> Linear(8w, 10): forward 2BP, backward 4BP, less the first
    layer's input gradient (the batch needs none); biases are not matmul FLOPs."""
    first, second = WIDTH * HIDDEN * WIDTH, HIDDEN * WIDTH * 10
    assert slow.flops == 4 * BATCH * first + 6 * BATCH * second


def test_the_gpu_step_is_recommends(slow, tmp_path):
    """The same network as a model file: recommend's step time for it at this micro-batch on
    one GPU is the input check's GPU step."""
    from oomdoctor.models.loader import load_model_file
    from oomdoctor.plans import parallel as par
    from oomdoctor.plans.recommend.cost import step_time
    from oomdoctor.plans.recommend.machine import Hardware
    path = tmp_path / "mlp.py"
    path.write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        f"W, H = {WIDTH}, {HIDDEN * WIDTH}\n"
        "def build_model():\n"
        "    return nn.Sequential(nn.Linear(W, H), nn.GELU(), nn.Linear(H, 10))\n"
        "def make_batch(b):\n    return torch.randn(b, W), torch.randint(0, 10, (b,))\n"
        "def loss_fn(m, b):\n    return F.cross_entropy(m(b[0]), b[1])\n")
    spec = load_model_file(str(path))
    layout = par.model_layout(spec, "fp32")
    hw = Hardware(T4.gpu, 1, "pcie", 16.0, 2)
    planned = step_time(layout, slow, par.Strategy("single"), hw, "fp32", False, BATCH, 1)
    check = check_input(slow, T4.gpu)
    assert check.gpu_seconds == pytest.approx(planned.compute_seconds, rel=1e-9)


def test_a_slow_dataset_is_data_bound_and_the_fix_is_measured(slow):
    check = check_input(slow, T4.gpu)
    own = check.as_run
    assert own.num_workers == 0 and own.seconds_per_batch >= BATCH * 0.8e-3
    assert check.data_bound and check.waiting(own) > WAITS
    fix = check.fix
    assert fix is not None and fix in check.timings        # a measurement, not a guess
    assert fix.num_workers == 2 and check.waiting(fix) <= WAITS
    text = render_text(check)
    assert "DATA-BOUND: at num_workers=0" in text
    assert "num_workers=2 removes the wait (measured:" in text
    assert "pin_memory=True" in text


def test_in_memory_tensors_are_gpu_bound():
    check = check_input(_trace("--in-memory"), T4.gpu)
    assert not check.data_bound and check.fix is None
    assert [t.num_workers for t in check.timings] == [0]     # nothing more to try
    assert "GPU-BOUND" in render_text(check)


def test_a_loop_that_reads_the_loss_every_step_cannot_overlap_loading():
    """``loss.item()`` each step makes the host wait for the GPU: at num_workers=0 loading and
    computing add up."""
    trace = _trace("--in-memory", "--log-every-step")
    assert trace.syncs_per_step >= 1
    check = check_input(trace, T4.gpu)
    own = check.as_run
    assert check.step_seconds(own) == pytest.approx(
        own.seconds_per_batch + check.gpu_seconds + check.copy_seconds(False))


def test_under_torchrun_each_rank_gets_its_share_of_the_cores():
    trace = _trace("--in-memory", launcher=("torchrun", "--nproc_per_node", "2"))
    check = check_input(trace, T4.gpu, processes=2, cpus=16)
    assert (check.host.cores, check.host.cores_per_rank, check.host.given) == (16, 8, True)
    assert check.omp_threads(2) == 6
    text = render_text(check)
    assert "2 processes on one host: 8 core(s) per rank (16 / 2)" in text
    assert "for a training host of 16: each core's speed is this machine's" in text


def test_the_cli_reports_it_and_its_json():
    r = subprocess.run([sys.executable, "-m", "oomdoctor", "estimate", "--gpu", "t4", "--json",
                        "--", "python", LOOP, "--batch-size", str(BATCH), "--in-memory"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["input_pipeline"]
    assert got["data_bound"] is False and got["script_num_workers"] == 0
    assert got["measured"][0]["num_workers"] == 0
    r = subprocess.run([sys.executable, "-m", "oomdoctor", "estimate", "--gpu", "t4",
                        "--no-input-check", "--", "python", LOOP, "--in-memory"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and "input pipeline" not in r.stdout


def test_watch_says_the_same_from_a_real_run():
    """The measured counterpart: the working GPU's idle share between its first and last
    busy sample (NVML utilisation), worded as the prediction is."""
    from oomdoctor.runs.watch import Reading, Tick, render_text as watch_text, summarize
    gib = 2**30
    ticks = [Tick(0.0, (Reading(0, gib, 24 * gib, 0),)),          # start-up: not counted
             Tick(1.0, (Reading(0, 9 * gib, 24 * gib, 60),)),
             Tick(2.0, (Reading(0, 9 * gib, 24 * gib, 70),)),
             Tick(3.0, (Reading(0, 9 * gib, 24 * gib, 65),)),
             Tick(4.0, (Reading(0, gib, 24 * gib, 0),))]           # shutdown: not counted
    s = summarize(ticks, 5.0)
    assert s.idle_share == pytest.approx(0.35)
    assert "sat idle 35% of the time: it WAITED" in watch_text(s)
    busy = summarize([Tick(float(t), (Reading(0, gib, 24 * gib, 98),)) for t in range(5)], 5.0)
    assert "GPU-BOUND" in watch_text(busy)


def test_pin_memory_is_timed_where_this_machine_can_pin(slow, monkeypatch):
    """Pinning needs a CUDA device: without one nothing is claimed; with one (stood in for
    here by the answer torch.cuda gives) the recommended setting is timed again pinned - on a
    CPU-only torch the DataLoader then warns and does not pin, which the timing reflects."""
    import torch
    assert check_input(slow, T4.gpu).pinned is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check = check_input(slow, T4.gpu)
    assert check.pinned is not None and check.pinned.pin_memory
    assert check.pinned.num_workers == check.fix.num_workers
    assert "pin_memory=True: " in render_text(check)
