"""`probe --seq-len max`: the longest context per configuration (oomdoctor.plans.context).

The search is checked against its definition with plain estimates (not the search's own
bookkeeping): the length it returns fits, 64 tokens more do not; the model's own maximum stops
it; a model file is refused with a one-line error.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")
from oomdoctor.cli import EXIT_MODEL, EXIT_OK, EXIT_USAGE, cli  # noqa: E402
from oomdoctor.plans.estimate import Budget, estimate  # noqa: E402
from oomdoctor.sim.gpus import custom_profile, parse_size  # noqa: E402
from oomdoctor.models.loader import load_model  # noqa: E402
from oomdoctor.sim.trace import TraceConfig  # noqa: E402

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
         "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 4000}


def _config(tmp_path, max_positions: int) -> str:
    (tmp_path / "config.json").write_text(json.dumps(
        dict(LLAMA, max_position_embeddings=max_positions)))
    return str(tmp_path)


def test_longest_context_fits_and_64_more_do_not(tmp_path):
    folder = _config(tmp_path, 65536)
    r = CliRunner().invoke(cli, ["probe", folder, "--seq-len", "max", "-b", "2", "--memory",
                                 "1GiB", "--precision", "bf16", "--no-checkpointing",
                                 "--json"])
    assert r.exit_code == EXIT_OK, r.output
    out = json.loads(r.stdout)
    (res,) = out["results"]
    n = res["max_seq_len"]
    assert res["limited_by"] == "memory" and res["exact"] and n % 64 == 0
    budget = Budget(custom_profile(parse_size("1GiB")))
    cfg = TraceConfig(2, "bf16")

    def at(tokens):
        return estimate(load_model(folder, seq_len=tokens), cfg, budget)
    fits, over = at(n), at(n + 64)
    assert fits.fits and not over.fits
    assert res["peak_reserved_bytes"] == fits.peak_reserved_bytes


def test_the_models_maximum_stops_the_search(tmp_path):
    folder = _config(tmp_path, 512)
    r = CliRunner().invoke(cli, ["probe", folder, "--seq-len", "max", "--memory", "8GiB",
                                 "--precision", "bf16", "--checkpointing"])
    assert r.exit_code == EXIT_OK, r.output
    assert "512" in r.stdout and "the model's maximum" in r.stdout


def test_seq_len_max_errors(tmp_path):
    folder = _config(tmp_path, 512)
    r = CliRunner().invoke(cli, ["estimate", folder, "-b", "1", "--seq-len", "max"])
    assert r.exit_code == EXIT_USAGE and "is for `oomdoctor probe`" in r.output
    tiny = str(Path(__file__).parent.parent / "sample_models" / "tiny_mlp.py")
    r = CliRunner().invoke(cli, ["probe", tiny, "--seq-len", "max",
                                 "--memory", "8GiB"])
    assert r.exit_code in (EXIT_USAGE, EXIT_MODEL)
    assert "--seq-len" in r.output
    r = CliRunner().invoke(cli, ["probe", folder, "-b", "2", "--memory", "8GiB"])
    assert r.exit_code == EXIT_USAGE and "goes with --seq-len max" in r.output
