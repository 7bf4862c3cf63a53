"""Exit codes that keep their meaning: bad input is a usage error (2), never a verdict, and a
construct oomdoctor cannot follow leaves with its own code (5), never with 1 ("does not fit")."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from oomdoctor.cli import EXIT_INTERNAL, EXIT_USAGE, cli

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "sample_models" / "tiny_mlp.py")


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("args, message", [
    (["--memory", "24"], "give a unit, e.g. --memory 24GiB"),
    (["--memory", "0GiB"], "less than any GPU has"),
    (["--gpu", "rtx3090", "--other", "30GiB"], "more than the 23.69 GiB card"),
    (["--gpu", "rtx3090", "--margin", "abc"], "write a share of the capacity, e.g. 5% or 0.05"),
    (["--gpu", "rtx3090", "--overhead", "4x"], "--overhead 4x: unknown unit"),
])
@pytest.mark.parametrize("command", [["estimate", MLP, "-b", "8"], ["parallel", MLP]])
def test_bad_sizes_are_usage_errors_not_verdicts(command, args, message):
    r = run(*command, *args)
    assert r.exit_code == EXIT_USAGE, r.output
    assert message in r.stderr
    assert "FITS" not in r.stdout


def test_a_construct_the_simulator_cannot_follow_is_not_a_verdict(tmp_path):
    # fused Adagrad has a CPU kernel only: no CUDA kernel and no meta kernel, so stepping it
    # on the meta tensors that stand for CUDA ones fails inside torch.
    model = tmp_path / "fused_adagrad.py"
    model.write_text((ROOT / "tests" / "models" / "fused_adamw_mlp.py").read_text().replace(
        "torch.optim.AdamW(params, lr=1e-3, **OPTIMIZER)",
        "torch.optim.Adagrad(params, lr=1e-2, fused=True)"))
    r = run("estimate", model, "-b", "8", "--gpu", "rtx3090")
    assert r.exit_code == EXIT_INTERNAL, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: oomdoctor could not simulate this: ")
    assert "fused_adagrad" in lines[0]
    assert "not a verdict on memory" in lines[0] and "Traceback" not in r.stderr
    r = run("estimate", model, "-b", "8", "--gpu", "rtx3090", "--debug")
    assert r.exit_code == EXIT_INTERNAL and "Traceback (most recent call last)" in r.stderr


def test_no_gpu_where_one_is_required_is_exit_4():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    from oomdoctor.cli import EXIT_NO_GPU
    for args in (["smoke", MLP, "--device", "cuda"], ["probe", MLP, "--device", "cuda"]):
        r = run(*args)
        assert r.exit_code == EXIT_NO_GPU, (args, r.output)
        assert r.stderr.strip().splitlines()[-1].startswith("error: ")
