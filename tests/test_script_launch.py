"""What a script's launcher gives it, and what a script's run reports about itself.

The launcher variables are checked against the launcher itself: torchrun is run for real on the
CPU and its rank 0's environment compared with the one oomdoctor gives the script. Plain
``python`` gives none, so a script that picks DDP when RANK is set (tests/scripts/env_loop.py,
nanoGPT's pattern) runs its single-GPU branch: its trace with the CUDA emulation off is the real
CPU run of the same command (tests/reference.py). Accumulation is read from the backward passes
per optimizer step, and a probe whose data runs out reports the batch that trained.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from oomdoctor.models.script import parse_command
from oomdoctor.plans.estimate import Budget, estimate_script
from oomdoctor.sim.fakecuda import FakeGpu
from oomdoctor.sim.gpus import get_profile
from oomdoctor.sim.script import DataExhausted, trace_script
from oomdoctor.sim.trace import TraceConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP = os.path.join(ROOT, "tests", "scripts", "env_loop.py")
BUDGET = Budget(get_profile("rtx3090"))
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
               "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
               "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "LOCAL_SIZE",
               "CROSS_RANK", "CROSS_SIZE", "ACCELERATE_MIXED_PRECISION")
# What this script does: dump the launch variables it sees (and its argv), train one step.
DUMP = """import json, os, sys, torch
keys = {keys!r}
if int(os.environ.get("RANK", "0")) == 0:
    with open({out!r}, "w") as f:
        json.dump({{"env": {{k: os.environ[k] for k in keys if k in os.environ}},
                   "argv": sys.argv[1:]}}, f)
device = "cuda" if torch.cuda.is_available() else "cpu"
m = torch.nn.Linear(8, 8).to(device)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    m(torch.randn(4, 8, device=device)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def _dump_script(tmp_path, name: str) -> tuple[str, str]:
    out = str(tmp_path / f"{name}.json")
    path = tmp_path / f"{name}.py"
    path.write_text(DUMP.format(keys=LAUNCH_VARS, out=out))
    return str(path), out


def _seen(tmp_path, name: str, *launcher: str) -> dict:
    """What the script saw when oomdoctor ran it behind ``launcher``."""
    path, out = _dump_script(tmp_path, name)
    trace_script(parse_command([*launcher, path]), TraceConfig(1), FakeGpu("x", 2**34, (8, 0)))
    with open(out) as f:
        return json.load(f)


def test_plain_python_sees_no_launcher_variables(tmp_path, monkeypatch):
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    seen = _seen(tmp_path, "plain", "python")
    assert seen == {"env": {}, "argv": []}
    assert not any(k in os.environ for k in LAUNCH_VARS)      # nothing left behind


def test_torchrun_variables_are_torchruns_own(tmp_path, monkeypatch):
    """The real torchrun (2 processes, gloo-free: the script only reads its environment) and
    oomdoctor's stand-in give rank 0 the same variables."""
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    path, out = _dump_script(tmp_path, "real")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    "--master_port", "29731", path], check=True, env=env, timeout=240,
                   capture_output=True)
    with open(out) as f:
        real = json.load(f)
    ours = _seen(tmp_path, "ours", "torchrun", "--nproc_per_node", "2", "--master_port", "29731")
    assert ours == real


def test_deepspeed_and_accelerate_variables(tmp_path, monkeypatch):
    """DeepSpeed's launcher (deepspeed/launcher/launch.py): its variables and --local_rank;
    accelerate's multi-process launch runs through torchrun's agent, plus its precision."""
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    ds = _seen(tmp_path, "ds", "deepspeed", "--num_gpus", "2")
    assert ds["argv"] == ["--local_rank=0"]
    assert ds["env"] == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_SIZE": "2",
                         "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": "29500"}
    acc = _seen(tmp_path, "acc", "accelerate", "launch", "--num_processes", "2",
                "--mixed_precision", "bf16")
    assert acc["env"]["WORLD_SIZE"] == "2" and acc["env"]["LOCAL_RANK"] == "0"
    assert acc["env"]["ACCELERATE_MIXED_PRECISION"] == "bf16"
    one = _seen(tmp_path, "acc1", "accelerate", "launch", "--num_processes", "1")
    assert one["env"] == {}                   # one process: accelerate's simple launcher


def test_a_script_that_branches_on_rank_takes_its_single_gpu_way(monkeypatch):
    """Under plain python the script does not wrap DDP (no buckets): the trace with the CUDA
    emulation off is the real CPU run of the same command, to 0.5%."""
    from reference import real_cpu_script_peak
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    args = ["--samples", "64", "--batch-size", "16", "--width", "128"]
    real = real_cpu_script_peak(LOOP, args)
    trace = trace_script(parse_command(["python", LOOP, *args]),
                         TraceConfig(1, emulate_cuda=False), FakeGpu("x", 2**34, (8, 0)))
    assert abs(trace.peak_live_bytes - real) <= 0.005 * real, (trace.peak_live_bytes, real)
    assert not any("DistributedDataParallel" in n for n in trace.notes)
    under_torchrun = estimate_script(parse_command(
        ["torchrun", "--nproc_per_node", "2", LOOP, *args]), TraceConfig(1), BUDGET)
    assert any("DistributedDataParallel" in n for n in under_torchrun.notes)


@pytest.mark.parametrize("launcher,processes", [(["python"], 1),
                                                (["torchrun", "--nproc_per_node", "2"], 2)])
def test_the_report_says_what_the_script_did(launcher, processes):
    e = estimate_script(parse_command([*launcher, LOOP, "--accum", "4", "--batch-size", "8",
                                       "--amp", "bf16", "--width", "64"]), TraceConfig(1),
                        BUDGET)
    d = e.to_json()
    assert (d["batch_size"], d["grad_accum"], d["processes"], d["effective_batch_size"]) == \
        (8, 4, processes, 32 * processes)
    assert (d["precision"], d["autocast_dtype"]) == ("bf16", "bfloat16")
    assert d["weight_dtypes"] == {"trainable": ["float32"], "frozen": []}
    from oomdoctor.plans.estimate import render_text
    head = render_text(e).splitlines()[0]
    assert head.startswith("env_loop.py: micro-batch 8 x 4 accumulation"
                           + (" x 2 processes" if processes > 1 else "")
                           + f" (effective {32 * processes}), bf16")


def test_a_batch_larger_than_the_dataset_is_the_datas_limit():
    with pytest.raises(DataExhausted, match="4,096 samples.*at most 4,096"):
        estimate_script(parse_command(["python", LOOP, "--width", "32"]), TraceConfig(1),
                        BUDGET, batch_size=8192)
    from oomdoctor.plans.script_probe import probe_script, render_text
    found = probe_script(parse_command(["python", LOOP, "--samples", "3000", "--width", "32"]),
                         TraceConfig(1), BUDGET)
    assert (found.max_batch_size, found.data_samples) == (3000, 3000)
    assert found.at_max.fits and 3001 not in found.trials
    assert "dataset, 3,000 samples, not the GPU" in render_text(found)


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "oomdoctor", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def test_probe_cli_ends_with_its_table_when_the_data_runs_out():
    r = _cli("probe", "--gpu", "rtx3090", "--", "python", LOOP, "--samples", "1000",
             "--width", "32")
    assert r.returncode == 0, r.stderr
    assert "largest batch that fits: 1000" in r.stdout and "not the GPU" in r.stdout


def test_check_records_what_a_script_did_and_annotates_its_file(tmp_path):
    import shutil
    shutil.copy(LOOP, tmp_path / "train.py")
    cfg = tmp_path / "setup.cfg"
    cfg.write_text("[oomdoctor]\ntolerance = 1%%\n\n[oomdoctor:train]\n"
                   "command = torchrun --nproc_per_node 2 train.py --accum 4 --batch-size 8 "
                   "--amp bf16 --width 64\ngpu = rtx3090\n")
    assert _cli("check", "--config", str(cfg), "--update", cwd=tmp_path).returncode == 0
    case = json.loads((tmp_path / "oomdoctor-baseline.json").read_text())["cases"]["train"]
    assert set(case["config"]) == {"command", "gpu", "budget_bytes", "margin"}
    assert case["run"] == {"batch_size": 8, "grad_accum": 4, "processes": 2,
                           "effective_batch_size": 64, "precision": "bf16",
                           "autocast_dtype": "bfloat16",
                           "weight_dtypes": {"trainable": ["float32"], "frozen": []}}
    script = tmp_path / "train.py"              # the model grows: a regression, annotated
    script.write_text(script.read_text().replace("4 * w", "8 * w"))
    r = _cli("check", "--config", str(cfg), "--format", "github", cwd=tmp_path)
    assert r.returncode == 1
    assert "::error file=train.py,title=oomdoctor train: regression" in r.stdout
    _cli("check", "--config", str(cfg), "--junit-xml", str(tmp_path / "junit.xml"), cwd=tmp_path)
    assert 'file="train.py"' in (tmp_path / "junit.xml").read_text()
