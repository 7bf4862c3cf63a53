"""Patterns of public training scripts (pytorch/examples' imagenet, word_language_model and dcgan,
nanoGPT, accelerate's cv_example: each run through every command that takes a script) that
oomdoctor's run of a script did not follow, rebuilt in tests/scripts/patterns_loop.py.

Independent checks: the same script's real CPU run under torch.profiler (tests/reference.py,
stopped where oomdoctor's run stops) for what the run allocates, and the script's own batch and
data for what the report says.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
from click.testing import CliRunner

from oomdoctor.cli import cli
from oomdoctor.models.script import parse_command
from oomdoctor.sim.fakecuda import FakeGpu
from oomdoctor.sim.script import trace_script
from oomdoctor.sim.trace import TraceConfig

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "patterns_loop.py")


def _estimate(*args):
    r = CliRunner().invoke(cli, ["estimate", "--gpu", "rtx3090", "--json", "--no-input-check",
                                 "--", sys.executable, SCRIPT, *args])
    assert r.exit_code == 0, r.output[-3000:]
    return json.loads(r.stdout)


def _matches_a_real_cpu_run(args: list[str]) -> None:
    from reference import real_cpu_script_peak
    real = real_cpu_script_peak(SCRIPT, args)
    trace = trace_script(parse_command(["python", SCRIPT, *args]),
                         TraceConfig(1, emulate_cuda=False), FakeGpu("x", 2**34, (8, 0)))
    assert abs(trace.peak_live_bytes - real) <= 0.005 * real, (trace.peak_live_bytes, real)


def test_a_transform_module_in_the_dataset_is_not_the_model():
    """Its per-sample calls run on the CPU inside the DataLoader: not forwards of the model
    (at a batch of 256 they were 256 'forwards' without a step, over the 200-forward limit, and
    the model's block calls went unrecorded). The step's memory is the same as without it."""
    with_transform = _estimate("--batch-size", "256", "--transform")
    without = _estimate("--batch-size", "256")
    assert with_transform["peak_reserved_bytes"] == without["peak_reserved_bytes"]
    assert with_transform["batch_size"] == 256


def test_evaluation_forwards_before_the_first_step_are_not_counted():
    """300 forwards under no_grad (an evaluation at iteration 0) before the first step: above the
    200-forward limit for a script that never steps, and no training forwards."""
    doc = _estimate("--evals", "300")
    assert doc["batch_size"] == 8


def test_a_hand_written_sgd_update_is_the_step():
    """No optimizer: the backward, then the next forward, is a step; the run matches a real CPU
    run of the script."""
    doc = _estimate("--manual-sgd")
    assert doc["grad_accum"] == 1
    _matches_a_real_cpu_run(["--manual-sgd"])


def test_a_gan_is_estimated_and_named_where_one_model_is_planned():
    """Two models: the discriminator's real and fake losses are one batch, not two
    micro-batches; `parallel`, which lays out one model, names both (exit 3)."""
    doc = _estimate("--gan", "--batch-size", "16")
    assert (doc["batch_size"], doc["grad_accum"], doc["effective_batch_size"]) == (16, 1, 16)
    _matches_a_real_cpu_run(["--gan", "--batch-size", "16"])
    r = CliRunner().invoke(cli, ["parallel", "--gpus", "2", "--gpu", "rtx3090", "--",
                                 sys.executable, SCRIPT, "--gan"])
    assert r.exit_code == 3, r.output[-2000:]
    assert "more than one model" in r.output and "Sequential" in r.output


def test_a_sequence_first_corpus_reports_its_batch_and_probes_past_its_upload():
    """word_language_model's pattern: the corpus on the GPU once as (tokens/batch, batch), so
    every batch size uploads the same bytes - not a sign that the data ran out - and (seq, batch)
    inputs, whose batch is the second dimension."""
    doc = _estimate("--batchify", "--batch-size", "20")
    assert doc["batch_size"] == 20
    r = CliRunner().invoke(cli, ["probe", "--memory", "2GiB", "--json",
                                 "--no-input-check", "--", sys.executable, SCRIPT, "--batchify",
                                 "--batch-size", "{batch}"])
    assert r.exit_code == 0, r.output[-3000:]
    probe = json.loads(r.stdout)
    assert not probe.get("data_bound") and probe["max_batch_size"] > 64, probe


def test_formatting_the_gpu_loss_reads_a_stand_in():
    """f"{loss:.3f}" of a GPU scalar (imagenet's AverageMeter) formats the stand-in .item()
    gives, instead of failing on a tensor with no data."""
    assert _estimate("--format")["batch_size"] == 8


def test_a_scripts_run_leaves_cuda_uninitialised(tmp_path):
    """A BatchNorm's integer buffer has real values beside its meta copy; following its
    `.cuda()` on the real value initialised CUDA in this CPU build under the fake device's
    answers, and every later `.cuda()` of the process failed as "not linked with CUDA" - so a
    model file's misplaced .cuda() was no longer recognised (tests/test_loader.py failed after
    a DeepSpeed script test in CI)."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA build: nothing to initialise wrongly")
    script = tmp_path / "bn.py"
    script.write_text("import torch\n"
                      "bn, fc = torch.nn.BatchNorm1d(4).cuda(), torch.nn.Linear(4, 4).cuda()\n"
                      "opt = torch.optim.AdamW(fc.parameters())\n"
                      "for _ in range(3):\n"
                      "    fc(bn(torch.randn(2, 4).cuda())).sum().backward()\n"
                      "    opt.step()\n"
                      "    opt.zero_grad()\n")
    r = CliRunner().invoke(cli, ["estimate", "--gpu", "rtx3090", "--no-input-check", "--",
                                 sys.executable, str(script)])
    assert r.exit_code == 0, r.output[-2000:]
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        torch.ones(1).cuda()
