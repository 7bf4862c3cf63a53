"""The dtype a Hugging Face model's weights load in, stated with its reason and settable
(--weights-dtype): transformers 5 loads a config's dtype by default (``dtype="auto"``), 4.x
float32 unless told (issue #31). Runs in the main environment and, marked hf_releases, in
.ci/run's transformers 4.40.2 environment, each checking what its own release does - against
``from_pretrained``'s own default, read from the installed library, never from oomdoctor."""
from __future__ import annotations

import importlib.util
import inspect
import json
import os

import pytest
from click.testing import CliRunner

from oomdoctor.cli import EXIT_MODEL, cli

pytestmark = [pytest.mark.hf_releases,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers not installed (pip install oomdoctor[hf])")]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
         "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
HERE = os.path.dirname(__file__)


def _config(tmp_path, **extra) -> str:
    folder = tmp_path / "llama"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA, **extra}))
    return str(folder)


def _estimate(folder: str, *extra: str) -> tuple[dict, str]:
    args = ["estimate", folder, "--seq-len", "32", "-b", "1", "--gpu", "rtx3090", *extra]
    text = CliRunner().invoke(cli, args)
    payload = CliRunner().invoke(cli, [*args, "--json"])
    assert text.exit_code == 0, text.output
    return json.loads(payload.stdout), text.output


def _from_pretrained_default() -> str:
    """What this transformers' from_pretrained loads a bf16 checkpoint as when given no dtype:
    read from its signature (5.x: dtype="auto"; 4.x: torch_dtype=None, i.e. float32)."""
    import transformers
    params = inspect.signature(transformers.PreTrainedModel.from_pretrained).parameters
    default = params["dtype"].default if "dtype" in params else None
    if default == "auto":
        return "bfloat16"
    major = int(transformers.__version__.split(".")[0])
    return "bfloat16" if major >= 5 else "float32"


def test_the_default_is_what_from_pretrained_loads_and_says_why(tmp_path):
    folder = _config(tmp_path, torch_dtype="bfloat16")
    payload, text = _estimate(folder)
    loaded = _from_pretrained_default()
    assert payload["weight_dtypes"]["trainable"] == [loaded]
    assert f"note: weights loaded as {loaded}: " in text
    assert ("its config's dtype" if loaded == "bfloat16" else "loads float32 unless") in text


@pytest.mark.parametrize("choice, dtype, width", [("fp32", "float32", 4), ("bf16", "bfloat16", 2),
                                                   ("fp16", "float16", 2),
                                                   ("auto", "bfloat16", 2)])
def test_weights_dtype_sets_it(tmp_path, choice, dtype, width):
    """The weights' gradients (every weight trains; a gradient has its weight's dtype) are the
    parameter count times the chosen width, exactly. (parameter_bytes also holds the rotary
    embedding's fp32 inv_freq buffer.)"""
    folder = _config(tmp_path, torch_dtype="bfloat16")
    payload, text = _estimate(folder, "--precision", "bf16", "--weights-dtype", choice)
    assert payload["weight_dtypes"]["trainable"] == [dtype]
    assert payload["gradient_bytes"] == payload["num_parameters"] * width
    assert f"weights loaded as {dtype}: " in text


def test_a_config_without_a_dtype_loads_float32(tmp_path):
    payload, text = _estimate(_config(tmp_path))
    assert payload["weight_dtypes"]["trainable"] == ["float32"]
    assert "weights loaded as float32: " in text


def test_a_model_file_refuses_it():
    mlp = os.path.join(HERE, "..", "sample_models", "tiny_mlp.py")
    r = CliRunner().invoke(cli, ["estimate", mlp, "-b", "2", "--weights-dtype", "bf16"])
    assert r.exit_code == EXIT_MODEL
    assert "--weights-dtype sets the dtype a Hugging Face model loads in" in r.output
