"""The Python API: oomdoctor.estimate / oomdoctor.probe give the objects the CLI renders."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import oomdoctor
from oomdoctor.cli import cli
from oomdoctor.models.loader import load_model_file

MLP = str(Path(__file__).resolve().parent.parent / "sample_models" / "tiny_mlp.py")


def test_estimate_is_the_cli_estimate():
    e = oomdoctor.estimate(MLP, batch_size=64, precision="fp16", gpu="t4")
    r = CliRunner().invoke(cli, ["estimate", MLP, "-b", "64", "--precision", "fp16", "--gpu",
                                 "t4", "--json"])
    assert e.to_json() == json.loads(r.stdout)


def test_a_module_factory_and_a_batch_factory():
    """The same model given as functions (a notebook's nn.Module) instead of a file."""
    spec = load_model_file(MLP)
    by_file = oomdoctor.estimate(MLP, batch_size=64)
    by_factory = oomdoctor.estimate(spec.build_model, 64, batch=spec.make_batch,
                                    loss_fn=spec.loss_fn)
    assert by_factory.peak_reserved_bytes == by_file.peak_reserved_bytes
    assert by_factory.breakdown == by_file.breakdown
    with pytest.raises(ValueError, match="needs batch="):
        oomdoctor.estimate(spec.build_model, 64)


def test_probe_returns_the_probe_result():
    r = oomdoctor.probe(MLP, precisions=("fp32",), checkpointing=False, memory=64 * 2**20,
                        overhead=0)
    cli_r = CliRunner().invoke(cli, ["probe", MLP, "--precision", "fp32", "--no-checkpointing",
                                     "--memory", "64MiB", "--overhead", "0", "--json", "-j", "1"])
    assert r.to_json() == json.loads(cli_r.stdout)


def test_importing_oomdoctor_loads_no_torch():
    code = "import sys, oomdoctor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False"
