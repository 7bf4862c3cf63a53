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

from pathlib import Path

import torch
from click.testing import CliRunner

from oomdoctor import checkpointing
from oomdoctor.cli import EXIT_OK, cli
from oomdoctor.loader import build_checked_model, load_model_file
from oomdoctor.trace import TraceConfig, trace_training
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
