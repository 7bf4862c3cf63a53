"""A deep stack traced cut to 2, 3 and 4 blocks and unrolled (oomdoctor.sim.repeat/unroll)
gives the full trace's events, storages, marks and notes, and so its peaks, to the byte."""
from __future__ import annotations

import json

import pytest

from oomdoctor.models.adapters import Adapters
from oomdoctor.models.loader import load_model
from oomdoctor.plans.estimate import Budget, estimate_trace
from oomdoctor.sim import repeat
from oomdoctor.sim.gpus import PROFILES
from oomdoctor.sim.trace import TraceConfig, trace_training

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 256, "max_position_embeddings": 256}


def _spec(tmp_path, layers: int, adapters: Adapters | None = None, **extra):
    d = tmp_path / f"llama{layers}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(LLAMA, num_hidden_layers=layers, **extra)))
    return load_model(str(d), seq_len=64, adapters=adapters)


def _same(spec, cfg: TraceConfig) -> None:
    whole = trace_training(spec, cfg, min_blocks=None)
    fast = trace_training(spec, cfg, min_blocks=5)
    assert fast.events == whole.events
    assert fast.storages == whole.storages
    assert (fast.marks, fast.notes) == (whole.marks, whole.notes)
    for f in repeat.SUMS + ("checkpointed",):
        assert getattr(fast, f) == getattr(whole, f), f
    budget = Budget(PROFILES["h100-80"])
    a, b = estimate_trace(whole, budget), estimate_trace(fast, budget)
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == \
        (b.peak_allocated_bytes, b.peak_reserved_bytes)


@pytest.mark.parametrize("cfg, adapters", [
    (TraceConfig(2), None),
    (TraceConfig(2, checkpointing=True), None),
    (TraceConfig(2, precision="bf16"), None),
    (TraceConfig(1, precision="fp16", checkpointing=True), None),
    (TraceConfig(1, optimizer="sgd", zero_grad="in-place"), None),
    (TraceConfig(1, checkpointing=True), Adapters(4, quantize="nf4")),
    (TraceConfig(1), Adapters(4)),
    # pure 16-bit: a layer frees, as it starts, a tensor made two layers before, reaching into
    # the first layer's run, which differs from the others (unroll._Spill)
    (TraceConfig(2, precision="bf16-pure"), None),
    (TraceConfig(1, precision="fp16-pure", checkpointing=True), None),
])
def test_unrolled_stack_is_the_full_trace(tmp_path, unrolled, cfg, adapters):
    _same(_spec(tmp_path, 8, adapters), cfg)
    assert unrolled == [True]


def test_32_layers_with_qlora_to_the_byte(tmp_path, unrolled):
    _same(_spec(tmp_path, 32, Adapters(8, quantize="nf4")),
          TraceConfig(1, precision="bf16", checkpointing=True))
    assert unrolled == [True]


def test_blocks_that_differ_are_not_cut(tmp_path):
    import torch
    spec = _spec(tmp_path, 6)
    with torch.device("meta"):
        model = spec.build_model()
    assert repeated_path(model) == "model.layers"
    model.model.layers[3].self_attn.sliding_window = 16     # one layer unlike the others
    assert repeat.repeated_stack(model, 5) is None


def repeated_path(model):
    found = repeat.repeated_stack(model, 5)
    return found and found[0]


def test_shallow_models_trace_as_before(tmp_path, unrolled):
    spec = _spec(tmp_path, 4)
    t = trace_training(spec, TraceConfig(1))            # 4 < MIN_BLOCKS: the full trace
    assert unrolled == [] and t.events == trace_training(spec, TraceConfig(1),
                                                         min_blocks=None).events


def _hf(tmp_path, name, config, **kw):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return load_model(str(d), **kw)


SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_hidden_layers": 8}


@pytest.mark.parametrize("name,config,kw,cfg", [
    ("mistral", dict(SMALL, model_type="mistral", architectures=["MistralForCausalLM"],
                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=256),
     {"seq_len": 64}, TraceConfig(1, precision="bf16", checkpointing=True)),
    ("qwen2", dict(SMALL, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=256),
     {"seq_len": 64}, TraceConfig(2, precision="fp16")),
    ("vit", dict(SMALL, model_type="vit", architectures=["ViTForImageClassification"],
                 image_size=32, patch_size=8), {}, TraceConfig(2, precision="bf16")),
])
def test_other_architectures_unroll_to_the_byte(tmp_path, unrolled, name, config, kw, cfg):
    """Mistral, Qwen2 and ViT stacks: the unrolled trace is the full trace (events, storages,
    marks: so every strategy's per-GPU lists, built from them, are the full trace's too)."""
    _same(_hf(tmp_path, name, config, **kw), cfg)
    assert unrolled == [True]


def test_whisper_traces_in_full(tmp_path, unrolled):
    """An encoder-decoder's two stacks (the decoder's layers all read the encoder's output) do
    not read as one repeated unit per block: the trace is the full one."""
    transformers = pytest.importorskip("transformers")
    from test_sources import WHISPER
    cfg = transformers.WhisperConfig(**dict(WHISPER, encoder_layers=6, decoder_layers=6))
    cfg.architectures = ["WhisperForConditionalGeneration"]
    cfg.save_pretrained(tmp_path / "whisper")
    _same(load_model(str(tmp_path / "whisper")), TraceConfig(1, precision="bf16"))
    assert unrolled == [False]
