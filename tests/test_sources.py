"""Models given the way users have them: a Hugging Face config folder, its config.json, or a Hub
id (read here from a local Hub cache, offline) - built from the config alone.

Checked against: transformers' own parameter count; a hand-written model file of the same
architecture and batch (tests/models/hf_llama_lazy.py, itself checked against real CPU runs in
tests/test_reach.py), event for event; and each other (folder, file, id: byte-identical output).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from oomdoctor.cli import EXIT_MODEL, EXIT_OK, cli
from oomdoctor.models.loader import load_model, load_model_file
from oomdoctor.models.spec import ModelFileError
from oomdoctor.sim.trace import TraceConfig, trace_training

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers not installed (pip install oomdoctor[hf])")
MODELS = Path(__file__).resolve().parent / "models"
# the architecture of tests/models/hf_llama_lazy.py
LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             architectures=["LlamaForCausalLM"], model_type="llama")


def config_dir(root: Path, name: str = "tiny-llama", **over) -> Path:
    import transformers
    d = root / name
    cfg = transformers.LlamaConfig(**{k: v for k, v in {**LLAMA, **over}.items()
                                      if k not in ("model_type",)})
    cfg.save_pretrained(d)
    return d


def test_parameters_are_transformers_own_count(tmp_path):
    import transformers
    d = config_dir(tmp_path)
    tr = trace_training(load_model(str(d), seq_len=64), TraceConfig(2))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(d))
    assert tr.num_parameters == model.num_parameters()
    assert tr.parameter_bytes == 4 * model.num_parameters()


def test_a_config_traces_as_the_same_model_written_by_hand(tmp_path):
    d = config_dir(tmp_path)
    from_config = trace_training(load_model(str(d), seq_len=64), TraceConfig(2, precision="bf16"))
    by_hand = trace_training(load_model_file(str(MODELS / "hf_llama_lazy.py")),
                             TraceConfig(2, precision="bf16"))
    assert from_config.events == by_hand.events


def test_folder_config_file_and_hub_id_give_identical_estimates(tmp_path):
    d = config_dir(tmp_path)
    # a Hub cache as huggingface_hub lays it out, read offline
    cache = tmp_path / "hub"
    snap = cache / "models--test-org--tiny-llama" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text((d / "config.json").read_text())
    (cache / "models--test-org--tiny-llama" / "refs").mkdir()
    (cache / "models--test-org--tiny-llama" / "refs" / "main").write_text("0" * 40)
    args = ["--seq-len", "64", "-b", "2", "--gpu", "rtx3090", "--json"]
    outs = []
    for source in (str(d), str(d / "config.json")):
        r = CliRunner().invoke(cli, ["estimate", source, *args])
        assert r.exit_code == EXIT_OK, r.output
        outs.append(r.stdout)
    # huggingface_hub reads its cache location when imported: the Hub id runs in a fresh process
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "oomdoctor", "estimate", "test-org/tiny-llama",
                        *args], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == EXIT_OK, p.stderr
    outs.append(p.stdout)
    assert outs[0] == outs[1] == outs[2]
    assert json.loads(outs[0])["model"] == "tiny-llama (causal-lm, 64 tokens)"


def test_task_from_the_config_or_the_option(tmp_path):
    d = config_dir(tmp_path, architectures=["LlamaForSequenceClassification"], num_labels=3)
    spec = load_model(str(d), seq_len=16)
    assert spec.make_batch(2)["labels"].shape == (2,)
    assert load_model(str(d), task="causal-lm", seq_len=16).make_batch(2)["labels"].shape == (2, 16)
    bare = config_dir(tmp_path, "bare", architectures=None)
    with pytest.raises(ModelFileError, match="--task causal-lm"):
        load_model(str(bare))


def test_one_line_errors_for_what_cannot_be_read(tmp_path):
    r = CliRunner().invoke(cli, ["estimate", str(tmp_path / "nothing-here"), "-b", "1",
                                 "--gpu", "rtx3090"])
    assert r.exit_code == EXIT_MODEL
    d = config_dir(tmp_path)
    r = CliRunner().invoke(cli, ["estimate", str(d), "--seq-len", "100", "-b", "1", "--gpu",
                                 "rtx3090"])
    assert r.exit_code == EXIT_MODEL and "beyond the model's max_position_embeddings (64)" in r.stderr
    r = CliRunner().invoke(cli, ["estimate", str(MODELS / "fused_adamw_mlp.py"), "--seq-len", "8",
                                 "-b", "1", "--gpu", "rtx3090"])
    assert r.exit_code == EXIT_MODEL and "apply to Hugging Face models" in r.stderr


def test_a_check_case_can_name_a_config_folder(tmp_path):
    """`oomdoctor check` cases take a config folder (or a Hub id) with task and seq_len; the
    case's peak is the estimate of the same model and batch."""
    config_dir(tmp_path)
    cfg = tmp_path / "setup.cfg"
    cfg.write_text("[oomdoctor]\nbaseline = base.json\n\n[oomdoctor:tiny-llama]\n"
                   "model = tiny-llama\nseq_len = 64\ntask = causal-lm\nbatch_size = 2\n"
                   "precision = bf16\n")
    r = CliRunner().invoke(cli, ["check", "--config", str(cfg), "--update", "--json", "-j", "1"])
    assert r.exit_code == EXIT_OK, r.output
    row = json.loads(r.stdout)["cases"][0]
    e = CliRunner().invoke(cli, ["estimate", str(tmp_path / "tiny-llama"), "--seq-len", "64",
                                 "-b", "2", "--precision", "bf16", "--gpu", "rtx3090", "--json"])
    assert row["status"] == "ok", row
    assert row["now_reserved"] == json.loads(e.stdout)["peak_reserved_bytes"]
    baseline = json.loads((tmp_path / "base.json").read_text())
    assert baseline["cases"]["tiny-llama"]["config"]["seq_len"] == 64


# --- image classifiers by config (ViT, ConvNeXt, Swin, ...) --------------------------------------

VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
           image_size=32, patch_size=8, num_labels=5)
VIT_FILE = '''
import torch, transformers
def build_model():
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, image_size=32, patch_size=8, num_labels=7)
    return transformers.ViTForImageClassification(cfg)
def make_batch(b):
    return {"pixel_values": torch.randn(b, 3, 32, 32), "labels": torch.randint(0, 7, (b,))}
'''


def test_an_image_classifier_config_trains_on_images_like_a_real_run(tmp_path):
    """A Hugging Face image classifier by config: pixel_values at the config's image size and
    labels of --num-classes classes, the model's own loss. Checked against a real CPU run of
    the same transformers model written as a model file, and transformers' parameter count."""
    import transformers
    from reference import real_cpu_peak
    cfg = transformers.ViTConfig(**VIT)
    cfg.architectures = ["ViTForImageClassification"]
    cfg.save_pretrained(tmp_path / "vit")
    spec = load_model(str(tmp_path / "vit"), num_classes=7)
    assert spec.name == "vit (image-cls, 32x32, 7 classes)"
    batch = spec.make_batch(2)
    assert batch["pixel_values"].shape == (2, 3, 32, 32) and int(batch["labels"].max()) < 7
    sim = trace_training(spec, TraceConfig(2, emulate_cuda=False))
    real_model = transformers.ViTForImageClassification(transformers.ViTConfig(
        **{**VIT, "num_labels": 7}))
    assert sim.num_parameters == real_model.num_parameters()
    (tmp_path / "vit_file.py").write_text(VIT_FILE)
    real = real_cpu_peak(str(tmp_path / "vit_file.py"), 2)
    assert abs(sim.peak_live_bytes - real) <= 0.005 * real, (sim.peak_live_bytes, real)


def test_image_options_and_text_options_do_not_mix(tmp_path):
    import transformers
    cfg = transformers.ViTConfig(**VIT)
    cfg.architectures = ["ViTForImageClassification"]
    cfg.save_pretrained(tmp_path / "vit")
    with pytest.raises(ModelFileError, match="--seq-len applies to text models"):
        load_model(str(tmp_path / "vit"), seq_len=128)
    with pytest.raises(ModelFileError, match="not to causal-lm"):
        load_model(str(config_dir(tmp_path)), image_size=64)
    r = CliRunner().invoke(cli, ["estimate", str(tmp_path / "vit"), "-b", "2", "--image-size",
                                 "64", "--gpu", "rtx3090"])
    assert r.exit_code == EXIT_OK, r.output
    assert "(image-cls, 64x64, 5 classes)" in r.stdout


# --- speech-to-text by config (Whisper) --------------------------------------------------------

WHISPER = dict(vocab_size=100, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
               decoder_ffn_dim=64, max_source_positions=32, max_target_positions=16,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
WHISPER_FILE = '''
import torch, transformers
CFG = {cfg!r}
def build_model():
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**CFG))
def make_batch(b):
    return {{"input_features": torch.randn(b, 16, 64), "labels": torch.randint(0, 100, (b, 16))}}
'''


def test_a_whisper_config_trains_on_log_mel_features_like_a_real_run(tmp_path):
    """Whisper by config: the task from the config's model type (its architecture name,
    ...ForConditionalGeneration, is the text seq2seq models' too), input_features of 2 x
    max_source_positions frames, labels of max_target_positions tokens; against a real CPU run
    of the same transformers model written as a model file."""
    import transformers
    from reference import real_cpu_peak
    cfg = transformers.WhisperConfig(**WHISPER)
    cfg.architectures = ["WhisperForConditionalGeneration"]
    cfg.save_pretrained(tmp_path / "whisper")
    spec = load_model(str(tmp_path / "whisper"))
    assert spec.name == "whisper (speech-seq2seq, 64 frames, 16 tokens)"
    sim = trace_training(spec, TraceConfig(2, emulate_cuda=False))
    assert sim.num_parameters == transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(**WHISPER)).num_parameters()
    (tmp_path / "whisper_file.py").write_text(WHISPER_FILE.format(cfg=WHISPER))
    real = real_cpu_peak(str(tmp_path / "whisper_file.py"), 2)
    assert abs(sim.peak_live_bytes - real) <= 0.005 * real, (sim.peak_live_bytes, real)
    with pytest.raises(ModelFileError, match="beyond the model's max_target_positions"):
        load_model(str(tmp_path / "whisper"), seq_len=32)


def test_an_offline_hub_id_names_the_current_hub_cli(tmp_path):
    """huggingface_hub ships `hf` now (issue #24: the error named only huggingface-cli)."""
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "empty"), HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "oomdoctor", "estimate", "test-org/not-cached",
                        "-b", "1", "--gpu", "rtx3090"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == EXIT_MODEL, p.stderr
    assert "`hf download ID config.json`" in p.stderr and "`hf auth login`" in p.stderr


def test_a_suggested_command_rebuilds_the_same_model(tmp_path):
    """What recommend's "train adapters instead" line tells the user to run keeps the options
    that built the model (issue #24: it dropped --seq-len)."""
    from oomdoctor.models.loader import command_line
    d = config_dir(tmp_path)
    assert command_line(load_model(str(d), seq_len=48, task="causal-lm")) == \
        f"{d} --task causal-lm --seq-len 48"
    assert command_line(load_model(str(MODELS / "lora_mlp.py"))) == str(MODELS / "lora_mlp.py")


def test_traced_with_names_the_libraries_the_model_is_made_of():
    """The versions an estimate names come from the traced model's own classes, not from what
    the process imported earlier: a plain model file names torch alone even after peft and
    transformers were imported (in a long pytest run, or a notebook)."""
    import peft  # noqa: F401  (imported on purpose: it must not show up)
    import transformers  # noqa: F401

    from oomdoctor.sim.libraries import traced_versions
    mlp = load_model_file(str(Path(__file__).resolve().parent.parent / "sample_models" /
                              "tiny_mlp.py"))
    names = [n for n, _ in trace_training(mlp, TraceConfig(2)).libraries]
    assert names == ["torch"]
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2))
    assert [n for n, _ in traced_versions(llama)] == ["torch", "transformers"]
