"""Issue 12, items 5 and 7: long runs are never silent, and the headline comes first."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from oomdoctor.runs import smoke
from oomdoctor.cli import cli
from oomdoctor.cli.group import EXIT_NO_GPU, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP = os.path.join(ROOT, "sample_models", "tiny_mlp.py")
OOM = ("RuntimeError: CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; 23.69 GiB total "
       "capacity; 21.93 GiB already allocated; 111.88 MiB free; 23.27 GiB reserved in total by "
       "PyTorch)\n")


def run(*args):
    return CliRunner().invoke(cli, list(args))


# --- 5. silent long runs ----------------------------------------------------------------------

def test_smoke_reports_every_step_on_stderr():
    res = run("smoke", MLP, "--strategy", "single", "-b", "2", "--steps", "2", "--gpu", "rtx3090")
    assert res.exit_code == EXIT_OK, res.stderr
    assert "step 1/2: " in res.stderr and "step 2/2: " in res.stderr
    assert "step 1/2" not in res.stdout


def test_distributed_smoke_reports_rank0_steps():
    res = run("smoke", MLP, "--strategy", "ddp", "--gpus", "2", "-b", "2", "--steps", "2",
              "--gpu", "rtx3090")
    assert res.exit_code == EXIT_OK, res.stderr
    assert "step 1/2: " in res.stderr and "step 2/2: " in res.stderr


def test_bf16_smoke_on_a_cpu_without_fast_bf16_runs_fp32(monkeypatch):
    monkeypatch.setattr(smoke, "cpu_has_fast_bf16", lambda: False)
    res = run("smoke", MLP, "--strategy", "single", "-b", "2", "--steps", "2",
              "--precision", "bf16", "--gpu", "rtx3090", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    doc = json.loads(res.stdout)
    assert doc["precision"] == "bf16" and doc["ran_precision"] == "fp32"
    assert any("ran in fp32" in n for n in doc["notes"])
    assert "no fast bf16" in res.stderr


def test_bf16_smoke_with_fast_bf16_stays_bf16(monkeypatch):
    monkeypatch.setattr(smoke, "cpu_has_fast_bf16", lambda: True)
    res = run("smoke", MLP, "--strategy", "single", "-b", "2", "--steps", "2",
              "--precision", "bf16", "--gpu", "rtx3090", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    assert json.loads(res.stdout)["ran_precision"] == "bf16"


def test_timeout_says_slow_when_steps_completed():
    cfg = smoke.SmokeConfig("ddp", 2, steps=3, timeout_s=60)
    slow = smoke._timeout_message(cfg, 0, [25.0, 31.5])
    assert "slow, not stuck" in slow and "2 of 3 steps" in slow and "stuck (" not in slow
    stuck = smoke._timeout_message(cfg, 0, [])
    assert "stuck" in stuck and "rendezvous" in stuck


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_probe_device_cuda_without_a_gpu_exits_4_before_simulating(monkeypatch, device):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = run("probe", MLP, "--gpu", "rtx3090", "--device", device)
    assert res.exit_code == EXIT_NO_GPU
    assert "sees none" in res.stderr and "tracing" not in res.stderr and res.stdout == ""


def test_probe_device_unknown_is_a_usage_error():
    res = run("probe", MLP, "--gpu", "rtx3090", "--device", "tpu")
    assert res.exit_code == EXIT_USAGE and res.stdout == ""


# --- 7. the headline first ----------------------------------------------------------------------

def test_explain_model_puts_the_simulated_answer_first(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(OOM)
    res = run("explain", str(log), "--model", MLP, "-b", "64")
    assert res.exit_code == EXIT_OK, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("Found 1 error(s)")
    assert lines[1].startswith("Simulated with tiny_mlp on rtx3090")
    assert "not computable" not in res.stdout
    assert "simulated: batch" in res.stdout and "fits with bf16 AMP" in res.stdout
    doc = json.loads(run("explain", str(log), "--model", MLP, "-b", "64", "--json").stdout)
    assert "mixed_precision" in doc["simulation"]["fix_effects"]
    # tiny_mlp fits any batch the probe tries on a 24 GiB card: the cap, said as the cap
    assert "at least 65536 in fp32 (the search cap)" in " ".join(lines[1:3])
    assert "batch 65536 and more fits with bf16 AMP (the search cap)" in res.stdout
    assert all(m["capped"] for m in doc["simulation"]["max_batch"])


def test_explain_without_model_is_unchanged(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("RuntimeError: CUDA error: out of memory\n")
    res = run("explain", str(log))
    assert res.exit_code == EXIT_OK and "not computable" in res.stdout
    assert "Simulated" not in res.stdout


def test_estimate_verdict_names_the_budget():
    res = run("estimate", MLP, "-b", "4", "--gpu", "rtx3090")
    assert res.exit_code == EXIT_OK
    verdict = res.stdout.splitlines()[1]
    assert verdict.startswith("FITS: peak ") and "of the 22.12 GiB budget (23.69 GiB card - " in \
        verdict and "CUDA context" in verdict and "margin)" in verdict
    res = run("estimate", MLP, "-b", "4", "--memory", "600MiB", "--overhead", "599MiB")
    assert res.exit_code == EXIT_PROBLEM
    verdict = res.stdout.splitlines()[1]
    assert verdict.startswith("DOES NOT FIT: needs ") and "budget (600.00 MiB card - " in verdict


def test_estimate_verdict_names_other_processes():
    res = run("estimate", MLP, "-b", "4", "--gpu", "rtx3090", "--other", "1GiB", "--json")
    assert json.loads(res.stdout)["other_bytes"] == 2**30
    res = run("estimate", MLP, "-b", "4", "--gpu", "rtx3090", "--other", "1GiB")
    assert "other processes" in res.stdout.splitlines()[1]


def test_parallel_has_a_verdict_line_first():
    res = run("parallel", MLP, "--gpus", "2", "-b", "8", "--gpu", "rtx3090",
              "--strategy", "ddp", "--strategy", "zero3")
    assert res.exit_code == EXIT_OK, res.stderr
    verdict = res.stdout.splitlines()[1]
    assert verdict.startswith("FITS the ") and "ddp" in verdict and "best: ddp" in verdict
    doc = json.loads(run("parallel", MLP, "--gpus", "2", "-b", "8", "--gpu", "rtx3090",
                         "--strategy", "ddp", "--strategy", "zero3", "--json").stdout)
    assert doc["best"] == "ddp" and set(doc["fits"]) == {"ddp", "zero3"}
    assert doc["does_not_fit"] == []


def test_parallel_verdict_when_nothing_fits():
    res = run("parallel", MLP, "--gpus", "2", "-b", "8", "--memory", "600MiB",
              "--overhead", "599MiB", "--strategy", "ddp")
    assert res.exit_code == EXIT_PROBLEM
    assert res.stdout.splitlines()[1].startswith("NOTHING FITS")


def test_probe_capped_says_search_cap():
    res = run("probe", MLP, "--gpu", "rtx3090", "--precision", "fp32", "--no-checkpointing",
              "--max-batch-size", "64")
    assert res.exit_code == EXIT_OK, res.stderr
    assert "at least 64 (the search cap; --max-batch-size to search further)" in res.stdout
    assert "(the largest that fits)" not in res.stdout
    doc = json.loads(run("probe", MLP, "--gpu", "rtx3090", "--precision", "fp32",
                         "--no-checkpointing", "--max-batch-size", "64", "--json").stdout)
    rec = doc["recommended"]
    assert rec["batch_size"] == 64 and rec["capped"] is True
    assert "search cap" in rec["batch_size_meaning"]


@pytest.mark.parametrize("command", [["estimate", "-b", "8"],
                                     ["probe", "--precision", "fp32", "--no-checkpointing"]])
def test_every_estimate_names_the_releases_it_traced(command):
    """The installed code decides the answer (issue #25): text and JSON name the torch that
    ran the trace (and transformers/peft/bitsandbytes when the step loaded them)."""
    import torch
    name, *opts = command
    args = [name, MLP, *opts, "--gpu", "rtx3090"]
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == EXIT_OK, text.output
    assert f"traced with torch {torch.__version__}" in text.stdout
    doc = json.loads(CliRunner().invoke(cli, [*args, "--json"]).stdout)
    assert doc["traced_with"]["torch"] == torch.__version__


@pytest.mark.parametrize("command", [["estimate", "-b", "8"],
                                     ["probe", "--precision", "fp32", "--no-checkpointing"]])
def test_keep_outputs_is_taken_by_every_command_and_said(command):
    name, *opts = command
    r = CliRunner().invoke(cli, [name, MLP, *opts, "--gpu", "rtx3090", "--keep-outputs"])
    assert r.exit_code == EXIT_OK, r.output
    if name == "estimate":
        assert "outputs kept (--keep-outputs" in r.stdout
