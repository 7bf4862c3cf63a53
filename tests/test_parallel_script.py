"""`oomdoctor parallel|split -- python train.py`: a single-GPU training script planned across the
strategies (the split included: what its blocks are handed is read from its first forward). Its one run on the fake GPU is rewritten per strategy as a model file's trace is;
the same network and loop written as a model file (whose strategies are checked against real
runs in test_parallel/test_fsdp) must give the same per-GPU peaks."""
import json
import os
import sys

import pytest
from click.testing import CliRunner

from oomdoctor.cli import cli

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LOOP = os.path.join(HERE, "scripts", "loop.py")
GPT2 = os.path.join(ROOT, "sample_models", "gpt2_small.py")
TINY = os.path.join(ROOT, "sample_models", "tiny_mlp.py")


def _parallel(*args):
    r = CliRunner().invoke(cli, ["parallel", "--gpus", "2", "--gpu", "rtx3090", "--json", *args])
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)


def _peaks(doc):
    return {(s["strategy"], g["label"]): (g["peak_allocated_bytes"], g["peak_reserved_bytes"])
            for s in doc["strategies"] for g in s["gpus"]}


@pytest.mark.parametrize("model,amp,precision,slack", [
    (TINY, "none", "fp32", 0),
    (GPT2, "bf16", "bf16", 512),    # the loop's loss / accum: one 4-byte tensor more
])
def test_a_script_plans_as_its_model_file(model, amp, precision, slack):
    by_script = _parallel("--", sys.executable, LOOP, "--model", model, "--batch-size", "4",
                          "--amp", amp)
    by_file = _parallel(model, "-b", "4", "--precision", precision, "--no-mp-policy")
    assert {e["strategy"] for e in by_script["errors"]} == {"dp"}
    got, want = _peaks(by_script), _peaks(by_file)
    assert {name for name, _ in got} == {"single", "ddp", "zero1", "zero2", "zero3", "pipeline2"}
    for name, (alloc, reserved) in got.items():
        assert abs(alloc - want[name][0]) <= slack, name
        assert reserved == want[name][1], name


def test_what_a_script_cannot_be_planned_as():
    script = ["--", sys.executable, LOOP, "--model", TINY, "--batch-size", "4"]
    r = CliRunner().invoke(cli, ["parallel", "--gpus", "2", "--precision", "bf16", *script])
    assert r.exit_code == 2 and "decides it in its own code" in r.output
    r = CliRunner().invoke(cli, ["parallel", "--gpus", "2", "--mp-policy", *script])
    assert r.exit_code == 2 and "a script decides its own" in r.output
    doc = _parallel("--strategy", "ds2", *script)        # fp32: DeepSpeed without its modes
    assert [s["strategy"] for s in doc["strategies"]] == ["ds2"]
    doc = _parallel("--strategy", "ds2", *script[:-2], "--batch-size", "4", "--amp", "bf16")
    assert "fp16/bf16 mode" in doc["errors"][0]["error"]
    r = CliRunner().invoke(cli, ["parallel", "--gpus", "2", "--", "torchrun",
                                 "--nproc_per_node", "2", LOOP, "--model", TINY])
    assert r.exit_code == 2 and "already runs data-parallel" in r.output


def test_readme_example_runs(monkeypatch):
    import re
    import shlex
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        [line] = [b.strip() for b in re.findall(r"```bash\n(.*?)```", f.read(), re.S)
                  if b.startswith("oomdoctor parallel --gpus 2 --gpu rtx3090 --")]
    monkeypatch.chdir(ROOT)
    r = CliRunner().invoke(cli, shlex.split(line)[1:])
    assert r.exit_code == 0, r.output
    assert "zero3 x2" in r.output and "the script's own bf16 autocast" in r.output


def test_split_of_a_script_is_the_model_files():
    script = ["--", sys.executable, LOOP, "--model", GPT2, "--batch-size", "4"]
    by_script = CliRunner().invoke(cli, ["split", "--gpus", "2", "--gpu", "rtx3090", "--json",
                                         *script])
    by_file = CliRunner().invoke(cli, ["split", GPT2, "--gpus", "2", "--gpu", "rtx3090", "-b",
                                       "4", "--json"])
    assert by_script.exit_code == by_file.exit_code == 0, by_script.output
    a, b = json.loads(by_script.stdout), json.loads(by_file.stdout)
    assert a["micro_batch"] == 4                 # the loop batches by hand: its forward's batch
    assert a["device_map"] == b["device_map"]
    assert [s["peak_reserved_bytes"] for s in a["stages"]] == [
        s["peak_reserved_bytes"] for s in b["stages"]]


def test_a_script_that_wraps_ddp_itself_is_refused():
    # a script whose model the run saw wrapped in DistributedDataParallel is estimated as it
    # is (estimate), even when launched without torchrun's process count
    from types import SimpleNamespace

    import torch

    from oomdoctor.models.script import parse_command
    from oomdoctor.plans.parallel.scripts import _refuse_distributed
    from oomdoctor.sim.ddp import ScriptDDP
    from oomdoctor.sim.script import TrainedModel
    script = parse_command(["python", LOOP, "--model", TINY])
    wrapped = SimpleNamespace(model=TrainedModel(ScriptDDP(torch.nn.Linear(4, 4))))
    with pytest.raises(ValueError, match="already runs data-parallel"):
        _refuse_distributed(script, wrapped)
    _refuse_distributed(script, SimpleNamespace(model=TrainedModel(torch.nn.Linear(4, 4))))


def test_a_scripts_split_shares_the_compute_as_the_model_files():
    """Each block's share of the step's FLOPs, from the forward the run counted by module: a
    ResNet's early convolutions are a few percent of its parameters and far more of its
    compute (shared by parameters, the split said GPU 0 0% / GPU 1 100%). The model file's
    route counts the same with torch's FlopCounterMode per module."""
    resnet = os.path.join(ROOT, "sample_models", "resnet_cnn.py")
    by_script = CliRunner().invoke(cli, ["split", "--gpus", "2", "--gpu", "rtx3090", "--json",
                                         "--", sys.executable, LOOP, "--model", resnet,
                                         "--batch-size", "32"])
    by_file = CliRunner().invoke(cli, ["split", resnet, "--gpus", "2", "--gpu", "rtx3090", "-b",
                                       "32", "--json"])
    assert by_script.exit_code == by_file.exit_code == 0, by_script.output
    a, b = json.loads(by_script.stdout), json.loads(by_file.stdout)
    assert a["device_map"] == b["device_map"]
    assert a["stages"][0]["utilisation"] == pytest.approx(b["stages"][0]["utilisation"], abs=0.05)


def test_cpu_offload_is_for_a_model_file_and_fsdp():
    script = ["--", sys.executable, LOOP, "--model", TINY, "--batch-size", "4"]
    r = CliRunner().invoke(cli, ["parallel", "--gpus", "2", "--cpu-offload", *script])
    assert r.exit_code == 2 and "offload_policy" in r.output
    r = CliRunner().invoke(cli, ["parallel", TINY, "--gpus", "2", "--cpu-offload",
                                 "--strategy", "ddp"])
    assert r.exit_code == 2 and "CPUOffloadPolicy" in r.output
