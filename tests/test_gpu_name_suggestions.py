"""An unknown --gpu name names the closest known profiles (issue 22, item 6)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from oomdoctor.cli import cli


@pytest.mark.parametrize("name, suggested", [("rtx309", "rtx3090"), ("a100-8", "a100-80"), ("rtx490", "rtx4090")])
def test_unknown_gpu_suggests_the_closest_names(name, suggested):
    res = CliRunner().invoke(cli, ["estimate", "sample_models/tiny_mlp.py", "-b", "4", "--gpu", name])
    assert res.exit_code == 2, res.output
    assert f"unknown GPU '{name}'; did you mean" in res.stderr and suggested in res.stderr.split("?")[0]


def test_nothing_close_keeps_the_plain_list():
    res = CliRunner().invoke(cli, ["estimate", "sample_models/tiny_mlp.py", "-b", "4", "--gpu", "zzzz"])
    assert res.exit_code == 2 and "did you mean" not in res.stderr and "rtx3090" in res.stderr
