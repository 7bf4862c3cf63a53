"""oomdoctor against published multi-GPU runs (tests/published_multi.py): FSDP2 under its bf16
mixed-precision policy with full and per-op checkpointing (torchtitan), and FSDP full fine-tuning
of a 7B model on two A100s (fms-acceleration), DeepSpeed's ZeRO-3 in its bf16 mode
(DeepSpeedExamples), each typed as a user would and within 5% of the published peak."""
import json

import pytest
from click.testing import CliRunner

from oomdoctor.cli import cli
from published_multi import ROWS, model_path, predicted


@pytest.mark.parametrize("row", [r for r in ROWS if r.within], ids=lambda r: r.name)
def test_published_multi_gpu_runs(row, tmp_path, monkeypatch):
    for key, value in row.env.items():
        monkeypatch.setenv(key, value)
    r = CliRunner().invoke(cli, row.command(model_path(row, str(tmp_path)), str(tmp_path)))
    assert r.exit_code in (0, 1), r.output
    got = predicted(json.loads(r.stdout), row)
    assert got == pytest.approx(row.published_bytes, rel=0.05), (
        f"{row.name}: {got / 2**30:.2f} GiB vs published {row.published_bytes / 2**30:.2f} GiB")
