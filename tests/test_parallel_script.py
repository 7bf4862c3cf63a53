"""`oomdoctor parallel -- python train.py`: a single-GPU training script planned across the
strategies. Its one run on the fake GPU is rewritten per strategy as a model file's trace is;
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
    return {s["strategy"]: (s["gpus"][0]["peak_allocated_bytes"],
                            s["gpus"][0]["peak_reserved_bytes"]) for s in doc["strategies"]}


@pytest.mark.parametrize("model,amp,precision,slack", [
    (TINY, "none", "fp32", 0),
    (GPT2, "bf16", "bf16", 512),    # the loop's loss / accum: one 4-byte tensor more
])
def test_a_script_plans_as_its_model_file(model, amp, precision, slack):
    by_script = _parallel("--", sys.executable, LOOP, "--model", model, "--batch-size", "4",
                          "--amp", amp)
    by_file = _parallel(model, "-b", "4", "--precision", precision, "--no-mp-policy")
    assert {e["strategy"] for e in by_script["errors"]} == {"dp", "pipeline2"}
    got, want = _peaks(by_script), _peaks(by_file)
    assert set(got) == {"single", "ddp", "zero1", "zero2", "zero3"}
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
