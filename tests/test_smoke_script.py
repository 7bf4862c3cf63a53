"""`oomdoctor smoke -- python train.py`: the user's script run for real in a child process,
stopped after its N-th optimizer step. Without a GPU (here) its CUDA calls run on the CPU; the
losses are checked against what the script itself prints, and the CUDA verdict (measured peaks
against the estimate) against hand-made records of a GPU run."""
import json
import math
import os
import re
from dataclasses import dataclass

import pytest
import torch
from click.testing import CliRunner

from oomdoctor.cli import EXIT_MODEL, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, cli
from oomdoctor.models.script import parse_command
from oomdoctor.models.spec import ModelFileError
from oomdoctor.runs import smoke_script
from oomdoctor.runs.script_steps import StepWatch, StopRun, watching
from oomdoctor.runs.smoke_script_result import CPU_NOTE, judge_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP_LOOP = os.path.join(ROOT, "tests", "scripts", "mlp_loop.py")
LOOP = os.path.join(ROOT, "tests", "scripts", "loop.py")
TINY_MLP = os.path.join(ROOT, "sample_models", "tiny_mlp.py")
GiB = 2**30

# A script written for a GPU: .cuda(), device="cuda", CUDA autocast and torch.cuda.amp's
# GradScaler, two micro-batches per step (loss / 2 each). It prints each step's loss as it
# computes it (the two micro-batches' values summed), the measurement the smoke's is held to.
SEEDED_CUDA_LOOP = '''
import torch
import torch.nn.functional as F
print("cuda available", torch.cuda.is_available(), torch.cuda.device_count())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                            torch.nn.Linear(32, 4)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.cuda.amp.GradScaler()
for step in range(100):
    total = 0.0
    for micro in range(2):
        x = torch.randn(8, 16, device="cuda")
        y = torch.randint(0, 4, (8,)).to("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y) / 2
        scaler.scale(loss).backward()
        total += loss.item()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    print(f"STEP {step + 1} LOSS {total!r}")
'''


def smoke(*args):
    return CliRunner().invoke(cli, ["smoke", *args])


def _finite_and_moving(losses):
    assert all(x is not None and math.isfinite(x) for x in losses), losses
    assert len(set(losses)) > 1, losses


def test_a_plain_loop_runs_its_steps_on_the_cpu():
    """mlp_loop.py picks "cuda" when torch.cuda says there is one: it does here, and its
    tensors stay on the CPU. Three steps, finite and moving losses, the first the loss the script
    printed itself, and the note that GPU memory was not measured."""
    res = smoke("--steps", "3", "--json", "--", "python", MLP_LOOP, "--samples", "128",
                "--batch-size", "16")
    assert res.exit_code == EXIT_OK, res.stderr
    doc = json.loads(res.stdout)
    assert (doc["steps"], doc["steps_done"], doc["ended"]) == (3, 3, "steps")
    assert len(doc["losses"]) == len(doc["step_seconds"]) == 3
    _finite_and_moving(doc["losses"])
    assert all(t > 0 for t in doc["step_seconds"])
    assert doc["device"] == "cpu" and doc["cuda_exercised"] is False and doc["memory"] == []
    assert doc["ok"] is True and doc["problems"] == []
    assert CPU_NOTE in doc["notes"] and "GPU memory was NOT measured" in CPU_NOTE
    # the script logs `loss.item()` of its step 0: the smoke's first loss
    printed = float(re.search(r"epoch 0 step 0 loss ([0-9.]+)", res.stderr).group(1))
    assert doc["losses"][0] == pytest.approx(printed, abs=5e-5)
    for i in (1, 2, 3):
        assert f"step {i}/3: " in res.stderr
    assert "step 4/3" not in res.stderr


def test_the_text_report_names_the_script_and_says_memory_was_not_measured():
    res = smoke("--steps", "2", "--", "python", LOOP, "--model", TINY_MLP, "--batch-size", "4")
    assert res.exit_code == EXIT_OK, res.stderr
    out = res.stdout
    assert out.startswith("SMOKE PASSED: loop.py, 2 of 2 optimizer steps on the CPU")
    assert f"command: python {LOOP} --model {TINY_MLP} --batch-size 4" in out
    assert "GPU memory was NOT measured" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[12]\s", line)]
    assert [r[0] for r in rows] == ["1", "2"]
    _finite_and_moving([float(r[1]) for r in rows])


def test_amp_and_accumulation_of_loop_py_run_as_cpu_autocast_without_a_scaler():
    """loop.py with fp16 autocast, a GradScaler and two micro-batches per step: autocast("cuda",
    fp16) runs as CPU bf16 autocast, the scaler disabled, and the report says both."""
    res = smoke("--steps", "3", "--json", "--", "python", LOOP, "--model", TINY_MLP,
                "--batch-size", "4", "--amp", "fp16", "--accum", "2")
    assert res.exit_code == EXIT_OK, res.stderr
    doc = json.loads(res.stdout)
    assert doc["steps_done"] == 3 and len(doc["losses"]) == 3
    _finite_and_moving(doc["losses"])
    notes = " ".join(doc["notes"])
    assert "autocast (float16) ran as CPU autocast in bfloat16" in notes
    assert "GradScaler ran disabled" in notes


AUTOCAST_DTYPE = '''
import torch
model = torch.nn.Linear(8, 8).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    with torch.autocast("cuda", dtype=torch.float16):
        out = model(torch.randn(4, 8, device="cuda"))
    print("OUTPUT DTYPE", out.dtype, out.device)
    out.float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
'''


@pytest.mark.parametrize("fast_bf16, dtype", [(True, "torch.bfloat16"), (False, "torch.float32")])
def test_cuda_autocast_is_cpu_bf16_or_off_where_bf16_is_slow(tmp_path, monkeypatch, fast_bf16,
                                                              dtype):
    """What the script's own matmul under autocast("cuda", fp16) returns: bf16 on a CPU with
    fast bf16, fp32 (autocast off) on one without, as a model file's CPU smoke falls back."""
    monkeypatch.setattr(smoke_script, "cpu_has_fast_bf16", lambda: fast_bf16)
    script = tmp_path / "amp.py"
    script.write_text(AUTOCAST_DTYPE)
    res = smoke("--steps", "2", "--json", "--", "python", str(script))
    assert res.exit_code == EXIT_OK, res.stderr
    assert set(re.findall(r"OUTPUT DTYPE (\S+) (\S+)", res.stderr)) == {(dtype, "cpu")}
    notes = " ".join(json.loads(res.stdout)["notes"])
    assert ("ran as CPU autocast in bfloat16" in notes) is fast_bf16
    assert ("ran in fp32: this CPU has no fast bf16" in notes) is not fast_bf16


def test_the_losses_are_what_the_script_computes(tmp_path):
    """Each step's loss is the sum of the scalars backward() started from (before the
    GradScaler's scaling), the number the script prints for the step; the script saw one CUDA
    GPU and ran its .cuda(), device="cuda", autocast and GradScaler on the CPU."""
    script = tmp_path / "seeded.py"
    script.write_text(SEEDED_CUDA_LOOP)
    res = smoke("--steps", "4", "--json", "--", "python", str(script))
    assert res.exit_code == EXIT_OK, res.stderr
    doc = json.loads(res.stdout)
    assert "cuda available True 1" in res.stderr
    printed = [float(x) for x in re.findall(r"STEP \d+ LOSS (\S+)", res.stderr)]
    assert len(printed) == 4 and doc["steps_done"] == 4
    assert doc["losses"] == pytest.approx(printed, rel=1e-6)
    _finite_and_moving(doc["losses"])


def test_a_script_that_raises_is_a_script_error_in_one_line(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("import torch\n"
                      "model = torch.nn.Linear(4, 1).cuda()\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "for step in range(10):\n"
                      "    model(torch.randn(2, 4, device='cuda')).sum().backward()\n"
                      "    opt.step()\n"
                      "    if step == 1:\n"
                      "        raise ValueError('the data ran dry')\n")
    res = smoke("--steps", "5", "--", "python", str(script))
    assert res.exit_code == EXIT_MODEL, res.stderr
    assert res.stdout == ""
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("error: boom.py failed at boom.py:8 ")
    assert "after 2 optimizer step(s): ValueError: the data ran dry" in line
    assert f"run `python {script}`" in line


def test_a_script_whose_arguments_are_wrong_says_what_it_said(tmp_path):
    res = smoke("--", "python", MLP_LOOP, "--no-such-flag")
    assert res.exit_code == EXIT_MODEL
    line = res.stderr.strip().splitlines()[-1]
    assert "exited with 2" in line and "unrecognized arguments: --no-such-flag" in line


def test_a_script_that_never_steps_fails_clearly(tmp_path):
    script = tmp_path / "nostep.py"
    script.write_text("import torch\n"
                      "model = torch.nn.Linear(4, 1).cuda()\n"
                      "for _ in range(3):\n"
                      "    model(torch.randn(2, 4, device='cuda')).sum().backward()\n")
    res = smoke("--json", "--", "python", str(script))
    assert res.exit_code == EXIT_PROBLEM, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["steps_done"] == 0 and doc["losses"] == []
    assert doc["ended"] == "script end"
    assert any("without an optimizer step" in p for p in doc["problems"])


def test_a_script_that_only_runs_forwards_is_stopped(tmp_path):
    """An endless forward-only loop is stopped after ScriptSmokeConfig.forwards forwards."""
    script = tmp_path / "forever.py"
    script.write_text("import torch\n"
                      "model = torch.nn.Linear(4, 1)\n"
                      "while True:\n"
                      "    model(torch.randn(2, 4))\n")
    res = smoke("--", "python", str(script))
    assert res.exit_code == EXIT_PROBLEM, res.stderr
    assert "SMOKE FAILED" in res.stdout
    assert "200 forward passes without an optimizer step (the script was at forever.py:4" \
        in res.stdout


@pytest.mark.parametrize("args, flag", [
    (["-b", "8"], "--batch-size"), (["--precision", "bf16"], "--precision"),
    (["--strategy", "ddp"], "--strategy"), (["--grad-accum", "2"], "--grad-accum"),
    (["--gpus", "2"], "--num-gpus")])
def test_options_of_a_model_files_loop_are_refused(args, flag):
    res = smoke(*args, "--", "python", MLP_LOOP)
    assert res.exit_code == EXIT_USAGE
    assert f"{flag} describes a model file's training loop" in res.stderr


def test_launchers_and_placeholders_are_refused_before_anything_runs():
    res = smoke("--", "torchrun", "--nproc_per_node", "2", MLP_LOOP)
    assert res.exit_code == EXIT_USAGE
    assert len(res.stderr.strip().splitlines()) == 1 and "torchrun launches several" in res.stderr
    res = smoke("--", "python", MLP_LOOP, "--batch-size", "{batch}")
    assert res.exit_code == EXIT_USAGE and "replace {batch}" in res.stderr


# ---------------------------------------------------------------------------------------------
# The CUDA verdict, from records of a GPU run
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Predicted:
    """The two figures of an Estimate the verdict reads."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int


def _steps(*losses):
    return [{"step": i + 1, "loss": x, "seconds": 0.5, "skipped": False}
            for i, x in enumerate(losses)]


def _end(allocated, reserved, ended="steps", **extra):
    return {"ended": ended, "steps": 3, "skipped": 0, "autocast": [], "grad_scaler": False,
            "memory": [["cuda:0", allocated, reserved]], "gpu": "NVIDIA H100", **extra}


def test_peaks_within_ten_percent_of_the_estimate_pass():
    pred = Predicted(10 * GiB, 12 * GiB)
    memory, problems, notes = judge_script(_steps(2.3, 2.1, 1.9),
                                           _end(int(10.9 * GiB), int(11.0 * GiB)), True, pred, 3)
    assert problems == []
    (check,) = memory
    assert check.ok and check.predicted_reserved_bytes == 12 * GiB
    assert check.off("allocated") == pytest.approx(0.09)
    assert check.off("reserved") == pytest.approx(11 / 12 - 1)
    assert any("optimizer step 3" in n and "estimate --steps 3" in n for n in notes)
    assert CPU_NOTE not in notes


@pytest.mark.parametrize("allocated, reserved", [(11.2, 12.0), (10.0, 10.6), (8.9, 12.0)])
def test_a_peak_more_than_ten_percent_off_fails(allocated, reserved):
    pred = Predicted(10 * GiB, 12 * GiB)
    _, problems, _ = judge_script(_steps(2.3, 2.1, 1.9),
                                  _end(int(allocated * GiB), int(reserved * GiB)), True, pred, 3)
    assert len(problems) == 1 and "more than 10% off the prediction" in problems[0]
    assert problems[0].startswith("cuda:0: measured peak")


def test_an_oom_fails_and_names_the_step():
    end = _end(23 * GiB, 24 * GiB, ended="oom", message="CUDA out of memory. Tried to allocate")
    _, problems, _ = judge_script(_steps(2.3), end, True, Predicted(23 * GiB, 24 * GiB), 3)
    assert problems == ["CUDA out of memory at step 2: CUDA out of memory. Tried to allocate"]


@pytest.mark.parametrize("losses, problem", [
    ((2.3, float("nan"), float("nan")), "loss is not finite"),
    ((2.3, 2.3, 2.3), "loss did not change over 3 steps")])
def test_a_loss_not_finite_or_not_moving_fails_on_the_gpu_too(losses, problem):
    pred = Predicted(10 * GiB, 12 * GiB)
    _, problems, _ = judge_script(_steps(*losses), _end(10 * GiB, 12 * GiB), True, pred, 3)
    assert len(problems) == 1 and problems[0].startswith(problem)


def test_without_a_prediction_peaks_are_measured_not_compared():
    memory, problems, notes = judge_script(_steps(2.3, 2.1, 1.9), _end(10 * GiB, 12 * GiB),
                                           True, None, 3)
    assert problems == [] and memory[0].predicted_allocated_bytes is None
    assert "no prediction given: peaks measured, not compared" in notes


def test_steps_the_grad_scaler_skipped_are_said():
    end = _end(10 * GiB, 12 * GiB, skipped=2)
    _, problems, notes = judge_script(_steps(2.3, 2.1, 1.9), end, True,
                                      Predicted(10 * GiB, 12 * GiB), 3)
    assert problems == [] and any("skipped the update of 2 step(s)" in n for n in notes)


def test_a_cuda_run_is_compared_with_the_estimate_it_is_given(monkeypatch):
    """run_script_smoke with CUDA (faked: the child's records handed in): the predictor is
    asked, its figures land in the memory check, and a predictor that fails leaves a note."""
    records = smoke_script._Run(steps=_steps(2.3, 2.0), end=_end(int(5.25 * GiB), 6 * GiB,
                                                                    steps=2))
    monkeypatch.setattr(smoke_script, "_use_cuda", lambda device: True)
    monkeypatch.setattr(smoke_script, "_launch", lambda *a: records)
    script = parse_command(["python", MLP_LOOP])
    cfg = smoke_script.ScriptSmokeConfig(steps=2)
    result = smoke_script.run_script_smoke(script, cfg, lambda: Predicted(5 * GiB, 6 * GiB))
    assert result.cuda_exercised and result.gpu == "NVIDIA H100"
    assert result.ok is True and result.losses == (2.3, 2.0)
    assert result.to_json()["memory"][0]["allocated_off"] == pytest.approx(0.05)

    def broken():
        raise ModelFileError("the fake GPU could not follow it")
    result = smoke_script.run_script_smoke(script, cfg, broken)
    assert result.ok and result.memory[0].predicted_allocated_bytes is None
    assert any("no prediction: oomdoctor's estimate of the script failed" in n
               for n in result.notes)


# ---------------------------------------------------------------------------------------------
# The step watch, in this process
# ---------------------------------------------------------------------------------------------

def test_the_watch_stops_after_its_steps_and_unscales_the_loss():
    """Under a GradScaler with a 1024 scale the recorded loss is the unscaled one; the script is
    stopped by StopRun at its first forward after step 2, which its `except Exception` does
    not catch."""
    seen = []
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    computed = []
    with watching(StepWatch(2, seen.append)):
        with pytest.raises(StopRun):
            for _ in range(5):
                try:
                    loss = model(torch.ones(2, 3)).pow(2).mean()
                    computed.append(loss.item())
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad()
                except Exception:       # noqa: BLE001 - what a script's guard would do
                    pass
    assert [r.step for r in seen] == [1, 2] and len(computed) == 2
    assert [r.loss for r in seen] == pytest.approx(computed)


def test_a_step_the_scaler_skips_still_counts():
    """An inf gradient: GradScaler skips optimizer.step() (no step hook), and the step counts,
    as it does in oomdoctor's estimate of the script."""
    seen = []
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    real = (torch.autograd.backward, torch.amp.GradScaler.scale, torch.amp.GradScaler.step)
    before = model.weight.detach().clone()
    with watching(StepWatch(5, seen.append)) as watch:
        scaler.scale(model(torch.ones(2, 3)).sum() * float("inf")).backward()
        scaler.step(opt)
        scaler.update()
    assert torch.equal(model.weight, before)        # the update was skipped
    assert [(r.step, r.skipped) for r in seen] == [(1, True)] and watch.skipped == 1
    # everything the watch hooked is put back
    assert (torch.autograd.backward, torch.amp.GradScaler.scale,
            torch.amp.GradScaler.step) == real


def test_the_documented_example_runs(monkeypatch):
    """The command README.md shows, also the last example of `smoke --help`, passes here and
    prints the report's first line as shown."""
    import shlex
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    command, shown = re.search(r"\$ (oomdoctor smoke --steps 3 -- python \S+ [^\n]*)\n([^\n]+)",
                               readme).groups()
    assert command in CliRunner().invoke(cli, ["smoke", "--help"]).stdout
    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(cli, shlex.split(command)[1:])
    assert res.exit_code == EXIT_OK, res.stderr
    assert res.stdout.splitlines()[0] == shown


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_datasets_transform_modules_are_not_the_models_forwards(workers, tmp_path):
    """A per-sample nn.Module transform (torchvision's v1 transforms are modules), in the
    smoke's process or in DataLoader workers that inherit its hooks: 256 samples a batch were
    256 'forwards' without a step, over the limit (or a worker killed by the stop)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\n"
        "class Norm(torch.nn.Module):\n"
        "    def forward(self, x): return (x - 0.5) / 0.25\n"
        "class Data(torch.utils.data.Dataset):\n"
        "    def __init__(self): self.t = Norm()\n"
        "    def __len__(self): return 1024\n"
        "    def __getitem__(self, i): return self.t(torch.rand(16)), torch.rand(1)\n"
        "loader = torch.utils.data.DataLoader(Data(), batch_size=256,\n"
        "                                     num_workers=int(sys.argv[1]))\n"
        "model = torch.nn.Linear(16, 1).cuda()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for x, y in loader:\n"
        "    loss = torch.nn.functional.mse_loss(model(x.cuda()), y.cuda())\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n")
    r = smoke("--steps", "2", "--json", "--", "python", str(script), workers)
    assert r.exit_code == EXIT_OK, r.output[-2000:]
    assert json.loads(r.stdout)["steps_done"] == 2
