"""The multi-GPU layout of a deep stack from passes cut to 3 and 4 blocks
(oomdoctor.plans.parallel.stack) is the layout of the full passes: every block input, producer,
FLOP count, execution order and parameter owner, so every strategy's estimate built on it."""
from __future__ import annotations

import json

import pytest

from oomdoctor.models.adapters import Adapters
from oomdoctor.models.loader import load_model
from oomdoctor.plans.parallel import model_layout, stack

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_hidden_layers": 8}
DECODER = dict(SMALL, num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
CONFIGS = {
    "llama": dict(DECODER, model_type="llama", architectures=["LlamaForCausalLM"]),
    "mistral": dict(DECODER, model_type="mistral", architectures=["MistralForCausalLM"]),
    "qwen2": dict(DECODER, model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64,
             "n_head": 4, "n_layer": 8, "vocab_size": 256, "n_positions": 128},
    "bert": dict(SMALL, model_type="bert", architectures=["BertForSequenceClassification"],
                 vocab_size=256, max_position_embeddings=128),
    "vit": dict(SMALL, model_type="vit", architectures=["ViTForImageClassification"],
                image_size=32, patch_size=8),
}


def _spec(tmp_path, name: str, adapters: Adapters | None = None):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(CONFIGS[name]))
    return load_model(str(d), seq_len=None if name == "vit" else 64, adapters=adapters)


@pytest.fixture
def extended(monkeypatch):
    """Records whether each deep layout was extended from its cuts (True) or run in full."""
    seen: list[bool] = []
    real = stack._extended

    def spy(span, passes):
        try:
            out = real(span, passes)
        except stack.NotExtendable:
            seen.append(False)
            raise
        seen.append(True)
        return out
    monkeypatch.setattr(stack, "_extended", spy)
    return seen


def _same(spec, precision: str) -> None:
    whole = model_layout(spec, precision, min_blocks=None)
    fast = model_layout(spec, precision, min_blocks=5)
    for field in whole.__dataclass_fields__:
        assert getattr(fast, field) == getattr(whole, field), field


@pytest.mark.parametrize("name, precision, adapters", [
    ("llama", "fp32", None),
    ("llama", "bf16", None),
    ("llama", "bf16-pure", None),
    ("llama", "bf16", Adapters(4)),
    ("llama", "bf16", Adapters(4, quantize="nf4")),
    ("mistral", "fp16", None),
    ("qwen2", "bf16", None),
    ("gpt2", "fp32", None),
    ("bert", "bf16", None),
    ("vit", "fp32", None),
])
def test_cut_layout_is_the_full_layout(tmp_path, extended, name, precision, adapters):
    _same(_spec(tmp_path, name, adapters), precision)
    assert extended == [True, True]         # the batch-2 pass and the batch-1 pass


def test_a_block_unlike_the_others_runs_in_full(tmp_path, extended, monkeypatch):
    """An extension is only ever made from cuts that agree: a stack whose third block is
    handed an extra input (so cut 3 and cut 4 tell different stories) runs in full."""
    spec = _spec(tmp_path, "llama")
    real = stack._shape

    def odd(span, p, k):
        calls = list(p.calls)
        third = [i for i, c in enumerate(calls) if c[0] == span.base + 2]
        if third:
            calls.insert(third[0], calls[third[0]])
        return real(span, type(p)(tuple(calls), *list(vars(p).values())[1:]), k)
    monkeypatch.setattr(stack, "_shape", odd)
    _same(spec, "fp32")
    assert extended == [False]


def test_shallow_models_run_in_full(tmp_path, extended):
    spec = _spec(tmp_path, "gpt2")
    model_layout(spec, "fp32")               # 8 < MIN_BLOCKS
    assert extended == []


def test_whisper_runs_in_full(tmp_path, extended):
    """Whisper's decoder layers do not count the same FLOPs: torch's FlopCounterMode puts the
    backward of the encoder output's gradient, summed over the layers, on a layer that grows
    with its index. The cuts disagree, so the layout runs in full - the same layout."""
    transformers = pytest.importorskip("transformers")
    from test_sources import WHISPER
    cfg = transformers.WhisperConfig(**dict(WHISPER, encoder_layers=6, decoder_layers=6))
    cfg.architectures = ["WhisperForConditionalGeneration"]
    cfg.save_pretrained(tmp_path / "whisper")
    _same(load_model(str(tmp_path / "whisper")), "fp32")
    assert extended == [False]


@pytest.mark.parametrize("precision, checkpointing, adapters", [
    ("bf16", False, None), ("bf16", True, Adapters(4, quantize="nf4"))])
def test_every_strategy_is_the_full_ones(tmp_path, precision, checkpointing, adapters):
    """What users see: every strategy's per-GPU peaks from the unrolled trace and the cut
    layout equal those from the full trace and the full layout, to the byte."""
    from oomdoctor.plans.estimate import Budget
    from oomdoctor.plans.parallel import STRATEGIES, Strategy, estimate_strategy
    from oomdoctor.sim.gpus import PROFILES
    from oomdoctor.sim.trace import TraceConfig, trace_training
    spec = _spec(tmp_path, "llama", adapters)
    cfg = TraceConfig(2, precision=precision, checkpointing=checkpointing)
    budget = Budget(PROFILES["rtx3090"])
    fast = (trace_training(spec, cfg, min_blocks=5), model_layout(spec, precision, min_blocks=5))
    full = (trace_training(spec, cfg, min_blocks=None),
            model_layout(spec, precision, min_blocks=None))
    for name in STRATEGIES:
        st = Strategy(name, 1 if name == "single" else 2)
        a, b = (estimate_strategy(*pair, st, budget) for pair in (fast, full))
        assert [(g.device_peak_bytes, g.peak_allocated_bytes) for g in a.gpus] == \
            [(g.device_peak_bytes, g.peak_allocated_bytes) for g in b.gpus], name
