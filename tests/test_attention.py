"""The attention implementation, stated and settable (``--attn``): eager attention keeps every
layer's attention probabilities for the backward, SDPA and flash attention do not.

Independent check: the Hugging Face config built with ``--attn eager`` and traced as the CPU
runs is the real CPU run of the same model built by transformers with
``attn_implementation="eager"`` (tests/reference.py).
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from oomdoctor.cli import cli
from oomdoctor.models.loader import load_model
from oomdoctor.models.spec import ModelFileError
from oomdoctor.plans.estimate import Budget, estimate
from oomdoctor.sim.gpus import get_profile
from oomdoctor.sim.trace import TraceConfig, trace_training

pytest.importorskip("transformers")

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512}
T = 256


@pytest.fixture
def llama(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    return str(tmp_path)


def test_every_estimate_names_its_attention_and_eager_keeps_the_probabilities(llama):
    budget = Budget(get_profile("rtx3090"))
    sdpa = estimate(load_model(llama, seq_len=T), TraceConfig(2, "bf16"), budget)
    eager = estimate(load_model(llama, seq_len=T, attn="eager"), TraceConfig(2, "bf16"), budget)
    assert any(n.startswith("attention: sdpa") for n in sdpa.notes)
    assert any(n.startswith("attention: eager") for n in eager.notes)
    # at least one layer's (B, heads, T, T) probabilities more, in bf16
    assert eager.peak_allocated_bytes - sdpa.peak_allocated_bytes >= 2 * 4 * T * T * 2


def test_eager_attention_is_the_real_cpu_run(llama, tmp_path):
    from reference import real_cpu_peak
    model_file = tmp_path / "eager_llama.py"
    model_file.write_text(
        "import json, torch, transformers\n"
        f"CONFIG = json.loads({json.dumps(json.dumps(LLAMA))})\n"
        "def build_model():\n"
        "    config = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items()\n"
        "                                         if k != 'model_type'})\n"
        "    return transformers.LlamaForCausalLM._from_config(config,\n"
        "                                                      attn_implementation='eager')\n"
        f"def make_batch(b):\n    ids = torch.randint(0, 256, (b, {T}))\n"
        f"    return {{'input_ids': ids, 'attention_mask': torch.ones(b, {T}, dtype=torch.long),"
        " 'labels': ids}\n")
    sim = trace_training(load_model(llama, seq_len=T, attn="eager"),
                         TraceConfig(2, emulate_cuda=False))
    real = real_cpu_peak(str(model_file), 2)
    assert abs(sim.peak_live_bytes - real) <= 0.01 * real, (sim.peak_live_bytes, real)


def test_attn_in_every_command_and_its_refusals(llama, tmp_path):
    run = CliRunner()
    for args in (["estimate", llama, "-b", "2"],
                 ["probe", llama, "--precision", "bf16", "--no-checkpointing", "-j", "1"],
                 ["parallel", llama, "--gpus", "2", "--precision", "bf16"],
                 ["split", llama], ["probe", llama, "--seq-len", "max", "--precision", "bf16",
                                    "--no-checkpointing", "-j", "1"]):
        seq = [] if "--seq-len" in args else ["--seq-len", str(T)]
        r = run.invoke(cli, [*args, *seq, "--attn", "eager", "--gpu", "rtx3090"])
        assert r.exit_code in (0, 1), (args, r.output[-1500:])
    r = run.invoke(cli, ["estimate", llama, "-b", "1", "--attn", "flash_attention_2"])
    assert r.exit_code == 3 and "--attn sdpa" in r.output        # no flash-attn here
    with pytest.raises(ModelFileError, match="--attn sets a Hugging Face model's"):
        load_model("sample_models/tiny_mlp.py", attn="eager")
    r = run.invoke(cli, ["estimate", "--attn", "eager", "--", "python",
                         "tests/scripts/env_loop.py"])
    assert r.exit_code == 2


def test_a_check_case_keeps_its_attention(llama, tmp_path):
    cfg = tmp_path / "setup.cfg"
    cfg.write_text(f"[oomdoctor:eager]\nmodel = {llama}\nbatch_size = 2\nseq_len = {T}\n"
                   "attn = eager\n")
    r = CliRunner().invoke(cli, ["check", "--config", str(cfg), "--update", "-j", "1"])
    assert r.exit_code == 0, r.output
    case = json.loads((tmp_path / "oomdoctor-baseline.json").read_text())["cases"]["eager"]
    assert case["config"]["attn"] == "eager"
