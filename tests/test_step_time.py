"""The step-time model's ranking of QLoRA against LoRA (issue #32): a 4-bit base computes the
same matmuls as a 16-bit one (bitsandbytes' gemm_4bit now counts its FLOPs) and dequantizes
each weight first, so QLoRA steps slower, as published: fms-acceleration's Mistral-7B on one
A100-80GB, 4 x 4096 packed tokens, checkpointing (scripts/benchmarks/refs/a100_80gb.csv,
train_tokens_per_second): LoRA 3324.155, QLoRA (nf4, double quantization) 2903.78 - QLoRA
takes 1.145x LoRA's time."""
import json

import pytest

from oomdoctor.models.adapters import Adapters
from oomdoctor.models.loader import load_model
from oomdoctor.plans.estimate import trace_for
from oomdoctor.plans.parallel import Strategy, model_layout
from oomdoctor.plans.recommend.cost import dequant_seconds, step_time
from oomdoctor.plans.recommend.machine import Hardware
from oomdoctor.sim.gpus import get_profile
from oomdoctor.sim.trace import TraceConfig

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
        "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 512,
        "tie_word_embeddings": False}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PUBLISHED_RATIO = 3324.155 / 2903.78


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    with open(folder / "config.json", "w") as f:
        json.dump(TINY, f)
    return str(folder)


def _step(folder: str, adapters: Adapters, precision: str, gpu: str = "a100-80",
          seq_len: int = 256):
    spec = load_model(folder, seq_len=seq_len, adapters=adapters)
    profile = get_profile(gpu)
    layout = model_layout(spec, precision)
    trace = trace_for(spec, TraceConfig(1, precision=precision, checkpointing=True), profile)
    hw = Hardware(profile, 1, "pcie", 25.0, 8)
    return layout, step_time(layout, trace, Strategy("single", 1), hw, precision, True, 4, 1)


def test_qlora_counts_its_base_matmuls_and_steps_slower(config_dir):
    lora_layout, lora = _step(config_dir, Adapters(16, TARGETS), "bf16-pure")
    qlora_layout, qlora = _step(config_dir, Adapters(16, TARGETS, quantize="nf4",
                                                     double_quant=True), "bf16")
    # the same matmuls, counted through bitsandbytes' op (they were missing: 2.65 vs 4.27 GFLOP)
    assert qlora_layout.flops_per_sample == pytest.approx(lora_layout.flops_per_sample, rel=1e-6)
    # every linear of the 4 blocks is 4-bit: 4 x (4 x 256^2 + 3 x 256 x 688) parameters
    assert qlora_layout.dequantized_params == 4 * (4 * 256 * 256 + 3 * 256 * 688)
    assert qlora.seconds > lora.seconds
    extra = dequant_seconds(qlora_layout, get_profile("a100-80"), True)
    assert qlora.seconds - lora.seconds == pytest.approx(extra, rel=1e-6)


def test_qlora_to_lora_ratio_against_the_published_one(tmp_path):
    """Mistral-7B as fms-acceleration ran it (tests/published_peft.py): the modelled ratio is
    1.006 against the published 1.145 (0.88x it, within 25%). The dequantization the model
    counts (7.0e9 parameters x 2.5 B x 3 passes at 70% of 2039 GB/s: 37 ms of a 6.1 s step)
    explains 0.6 points of the published 14.5; the rest (bitsandbytes' kernels below the
    bandwidth bound, autocast's casts in the QLoRA run) is not modelled."""
    from published_multi import _peft_configs     # tests/published_peft.py, loaded by path
    with open(tmp_path / "config.json", "w") as f:
        json.dump(_peft_configs()["mistral-7b"], f)
    folder = str(tmp_path)
    _, lora = _step(folder, Adapters(16, TARGETS, 0.1), "bf16-pure", seq_len=4096)
    _, qlora = _step(folder, Adapters(16, TARGETS, 0.1, "nf4", True), "bf16", seq_len=4096)
    ratio = qlora.seconds / lora.seconds
    assert ratio > 1
    assert 0.75 < ratio / PUBLISHED_RATIO < 1.25, ratio
