"""FSDP2's CPUOffloadPolicy as an option (`--cpu-offload`) in every command that plans FSDP:
parallel, estimate and probe give one answer for one configuration. The replay itself is checked
elsewhere: a script that offloads against the model file (test_script_fsdp), every offload plan
run as printed (test_plan_scripts), DeepSpeed's offload against its estimators (test_deepspeed)."""
import json
import os
import sys

from click.testing import CliRunner

from oomdoctor.cli import cli

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "models", "plan_lm.py")
CARD = ["--memory", "1GiB", "--num-gpus", "2", "--precision", "bf16"]


def _json(args):
    r = CliRunner().invoke(cli, [*args, "--json"])
    assert r.exit_code in (0, 1), r.output[-2000:]
    return json.loads(r.stdout)


def _gpu(doc) -> dict:
    [strategy] = doc["strategies"]
    assert strategy["strategy"] == "zero3"
    return max(strategy["gpus"], key=lambda g: g["device_peak_bytes"])


def test_parallel_estimate_and_probe_agree():
    """probe's largest batch under offload fits in `parallel` and the next does not; `estimate
    --strategy fsdp` gives `parallel`'s figure; no model state is left on the GPU after the step
    (all of it is the host's), and offload fits a larger batch than the same FSDP without it."""
    probe = _json(["probe", MODEL, *CARD, "--strategy", "fsdp", "--cpu-offload"])
    plain = _json(["probe", MODEL, *CARD, "--strategy", "fsdp"])
    best = {r["checkpointing"]: r["max_batch_size"] for r in probe["results"]}
    without = {r["checkpointing"]: r["max_batch_size"] for r in plain["results"]}
    b = best[False]
    assert b > without[False]
    at = {n: _json(["parallel", MODEL, *CARD, "--strategy", "fsdp", "--cpu-offload", "-b",
                    str(n)]) for n in (b, b + 1)}
    assert at[b]["strategies"][0]["fits"] and not at[b + 1]["strategies"][0]["fits"]
    gpu = _gpu(at[b])
    assert gpu["resting_state_bytes"] == 0
    est = _json(["estimate", MODEL, *CARD, "--strategy", "fsdp", "--cpu-offload", "-b", str(b)])
    assert _gpu(est)["device_peak_bytes"] == gpu["device_peak_bytes"]


def test_where_cpu_offload_does_not_apply():
    r = CliRunner().invoke(cli, ["estimate", MODEL, *CARD, "-b", "2", "--cpu-offload"])
    assert r.exit_code == 2 and "--strategy fsdp" in r.output
    r = CliRunner().invoke(cli, ["probe", MODEL, *CARD, "--strategy", "ddp", "--cpu-offload"])
    assert r.exit_code == 2 and "CPUOffloadPolicy" in r.output
    script = ["--", sys.executable, os.path.join(HERE, "scripts", "loop.py")]
    r = CliRunner().invoke(cli, ["estimate", "--gpu", "rtx3090", "--cpu-offload", *script])
    assert r.exit_code == 2 and "offload_policy" in r.output
