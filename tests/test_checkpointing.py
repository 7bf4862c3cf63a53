"""Which blocks checkpointing wraps by default, and whether the output says what it bought.

Checked on a model outside sample_models/ (tests/models/unet.py, the standard U-Net: its
repeated block, DoubleConv, is a container of Conv2d/BatchNorm2d/ReLU inside an nn.Sequential)
against a real CPU run of the same loop with the same blocks checkpointed by hand
(tests/reference.py). Measured on a 2-core runner, batch 4, fp32, emulation off, the CPU
convolution backward read as the trace sees it (its inputs and outputs; its private per-thread
scratch grows with the thread count and is no CUDA allocation - see tests/test_trace.py):
without checkpointing -0.003 % of the real peak, with it -0.002 %; checkpointing frees 18.14 %
of both. Counting that scratch the real peak was 1.4-2.5 % higher, by thread count. The old default (the most numerous
ModuleList/Sequential child class, Conv2d) froze nothing.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

import torch
from click.testing import CliRunner

from oomdoctor.models import checkpointing
from oomdoctor.cli import EXIT_OK, cli
from oomdoctor.models.loader import load_model_file
from oomdoctor.models.training import build_checked_model
from oomdoctor.sim.trace import TraceConfig, trace_training
from reference import real_cpu_peak, real_cpu_peak_variant

UNET = str(Path(__file__).resolve().parent / "models" / "unet.py")
CONV_BACKWARD = ("aten::convolution_backward",)
DOUBLE_CONVS = ("inc", "down1.maxpool_conv.1", "down2.maxpool_conv.1", "down3.maxpool_conv.1",
                "down4.maxpool_conv.1", "up1.conv", "up2.conv", "up3.conv", "up4.conv")


def test_default_blocks_are_the_unets_double_convs():
    with torch.device("meta"):
        model = build_checked_model(load_model_file(UNET))
    assert tuple(checkpointing.find_repeated_blocks(model)) == DOUBLE_CONVS


def test_unet_checkpointing_saves_what_a_real_run_saves():
    spec = load_model_file(UNET)
    plain = trace_training(spec, TraceConfig(4, emulate_cuda=False))
    ckpt = trace_training(spec, TraceConfig(4, emulate_cuda=False, checkpointing=True))
    assert ckpt.checkpointed == DOUBLE_CONVS
    # the CPU convolution backward's per-thread scratch is not part of what the trace (or a
    # CUDA kernel) allocates, and its size follows the runner's thread count: read it as the
    # trace sees the op, its inputs and outputs only
    real_plain = real_cpu_peak(UNET, 4, opaque=CONV_BACKWARD)
    real_ckpt = real_cpu_peak_variant(UNET, 4, checkpoint=DOUBLE_CONVS, opaque=CONV_BACKWARD)
    for sim, real in ((plain.peak_live_bytes, real_plain), (ckpt.peak_live_bytes, real_ckpt)):
        assert abs(sim - real) <= 0.005 * real, (sim, real)
    saved_sim = 1 - ckpt.peak_live_bytes / plain.peak_live_bytes
    saved_real = 1 - real_ckpt / real_plain
    assert saved_real > 0.15                       # the real run says it is worth it
    assert abs(saved_sim - saved_real) < 0.01, (saved_sim, saved_real)


def test_probe_names_the_class_and_warns_when_it_frees_nothing():
    runner = CliRunner()
    args = ["probe", UNET, "--gpu", "rtx3090", "--precision", "fp32", "-j", "1"]
    r = runner.invoke(cli, args)
    assert r.exit_code == EXIT_OK, r.output
    assert "ckpt: 9 blocks of class DoubleConv" in r.stdout
    assert "warning: checkpointing" not in r.stdout
    # leaf layers: each Conv2d keeps its input for backward anyway - nothing is freed
    r = runner.invoke(cli, [*args, "--checkpoint-class", "Conv2d"])
    assert r.exit_code == EXIT_OK, r.output
    assert "ckpt: 19 blocks of class Conv2d" in r.stdout
    assert "warning: checkpointing Conv2d frees under 5% of the activations" in r.stdout


SEQ2SEQ = '''
import torch, torch.nn as nn
V, T = 64, 16
class M(nn.Module):
    # nn.Transformer's layers, each built on its own (nn.Transformer deep-copies one layer,
    # which fake CPU tensors - the real-run comparison's trace - cannot follow)
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.encoder = nn.ModuleList(nn.TransformerEncoderLayer(32, 2, 64, 0.0, batch_first=True)
                                     for _ in range(2))
        self.decoder = nn.ModuleList(nn.TransformerDecoderLayer(32, 2, 64, 0.0, batch_first=True)
                                     for _ in range(3))
        self.out = nn.Linear(32, V)
    def forward(self, src, tgt):
        memory, x = self.emb(src), self.emb(tgt)
        for layer in self.encoder:
            memory = layer(memory)
        for layer in self.decoder:
            x = layer(x, memory)
        return self.out(x)
def build_model():
    return M()
def make_batch(b):
    return torch.randint(0, V, (b, T)), torch.randint(0, V, (b, T)), torch.randint(0, V, (b, T))
def loss_fn(model, batch):
    src, tgt, y = batch
    return nn.functional.cross_entropy(model(src, tgt).flatten(0, 1), y.flatten())
'''
STACKS = ("encoder.0", "encoder.1", "decoder.0", "decoder.1", "decoder.2")


def test_an_encoder_decoder_checkpoints_both_stacks_as_a_real_run(tmp_path):
    """nn.Transformer's layers: the decoder's hold the most parameters, the encoder's are a
    second stack beside them - both are wrapped (only the decoder's were). Checked against a
    real CPU run with the same five layers checkpointed by hand."""
    path = tmp_path / "seq2seq.py"
    path.write_text(SEQ2SEQ)
    spec = load_model_file(str(path))
    ckpt = trace_training(spec, TraceConfig(4, emulate_cuda=False, checkpointing=True))
    assert ckpt.checkpointed == STACKS
    assert ("checkpointing 5 blocks of class TransformerEncoderLayer,TransformerDecoderLayer"
            in ckpt.notes)
    real = real_cpu_peak_variant(str(path), 4, checkpoint=STACKS)
    assert abs(ckpt.peak_live_bytes - real) <= 0.005 * real, (ckpt.peak_live_bytes, real)
    # --checkpoint-class takes several classes too
    with torch.device("meta"):
        model = build_checked_model(spec)
    assert tuple(checkpointing.find_repeated_blocks(
        model, "TransformerDecoderLayer,TransformerEncoderLayer")) == STACKS


def test_whisper_checkpoints_the_layers_transformers_does(tmp_path):
    """transformers' gradient_checkpointing_enable() wraps Whisper's encoder and decoder
    layers; --checkpointing must wrap the same ones (same bytes under bf16)."""
    transformers = pytest.importorskip("transformers")
    from oomdoctor.models.loader import load_model
    from test_sources import WHISPER
    cfg = transformers.WhisperConfig(**WHISPER)
    cfg.architectures = ["WhisperForConditionalGeneration"]
    cfg.save_pretrained(tmp_path / "whisper")
    ours = trace_training(load_model(str(tmp_path / "whisper")),
                          TraceConfig(2, precision="bf16", checkpointing=True))
    assert len(ours.checkpointed) == 4
    spec = load_model(str(tmp_path / "whisper"))
    build = spec.build_model

    def theirs_model():
        model = build()
        model.gradient_checkpointing_enable({"use_reentrant": False})
        return model
    theirs = trace_training(dataclasses.replace(spec, build_model=theirs_model),
                            TraceConfig(2, precision="bf16"))
    assert theirs.peak_live_bytes == ours.peak_live_bytes, (theirs.peak_live_bytes,
                                                            ours.peak_live_bytes)


def test_checkpointed_batchnorm_is_said_to_update_its_statistics_twice():
    """torch.utils.checkpoint re-runs a block's forward in train mode during backward, so a
    BatchNorm inside counts every batch twice (a real CPU run shows it); the estimate says so."""
    import torch
    from torch.utils.checkpoint import checkpoint
    from oomdoctor.models.loader import load_model_file
    from oomdoctor.models.training import BATCHNORM_RECOMPUTED
    from oomdoctor.sim.trace import TraceConfig, trace_training
    block = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    checkpoint(block, torch.randn(2, 3, 8, 8, requires_grad=True),
               use_reentrant=False).sum().backward()
    assert int(block[1].num_batches_tracked) == 2            # one step, two updates
    unet = load_model_file(os.path.join(os.path.dirname(__file__), "models", "unet.py"))
    assert BATCHNORM_RECOMPUTED in trace_training(unet, TraceConfig(1, checkpointing=True)).notes
    assert BATCHNORM_RECOMPUTED not in trace_training(unet, TraceConfig(1)).notes
