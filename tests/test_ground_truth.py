"""oomdoctor's estimates against GPU memory measured and published by others.

    python -m pytest tests/test_ground_truth.py -q

Each published setup of docs/ground-truth.md is rebuilt as a model file in tests/models/ (own
code, plain torch, faithful to what was measured: architecture, training loop and, where it
matters, the torch version) and estimated on fake tensors. Every case compares like with like:

- HF-1..HF-6 read NVML "used" on a V100 16 GB right after ``trainer.train()`` returned: the
  allocator's segments (which it never gave back, so peak reserved) plus the CUDA context,
  1343 MiB on that card and driver (HF-0). nvidia-smi's "MB" are MiB.
- VF-* print ``torch.cuda.max_memory_reserved() / 1e9``: decimal GB, no context. The card is
  not named; we use an A100 40 GB (sm80: flash attention for 16-bit SDPA, memory-efficient for
  fp32 - the kernels any Ampere or Hopper card picks; Hopper only has bigger cuBLAS workspaces,
  +48 MiB).
- PT-1 reads allocated memory from a memory snapshot: ``peak_allocated_bytes``.
- LS-* print ``torch.cuda.memory_reserved() / 1024**3`` after an epoch (never emptied, so the
  segments' high-water mark; GiB): rasbt/LLMs-from-scratch's GPT-2-sized model with fused AdamW.

Tolerance band (``UNDER``/``OVER``). What the simulator leaves out of these readings only ever
adds memory: for the NVML readings, context that HF-0 did not load yet (cuBLAS/cuBLASLt modules
on the first GEMM - CUDA 11.2 has no lazy loading) and the allocator's history over 128 steps;
for the ViT runs, cuDNN workspaces of the patch-embedding convolution, cuBLASLt workspaces,
torchmetrics, the validation loop and the ragged last batch of each of 3 epochs, all inside the
same max_memory_reserved. So oomdoctor may come out up to 6% below a reading but only 3% above
it (kernels of the measured torch - 1.10 / 2.1 - saving slightly different tensors than 2.13).
A case more than 15% off gets xfail(strict=True) with the analysis, never a wider band; none
is at the time of writing. Two things the measured runs did that oomdoctor's default loop does
not are written into the model files, because without them the estimates are 10-22% low:
the gradients of the previous step are alive during the forward (the Trainer zeroed them in
place; the ViT scripts called zero_grad() between the loss and backward()), and torch 1.10's
softmax saved its input for backward (tests/models/hf_bert_large_seqcls.py,
TORCH_1_10_SOFTMAX).
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from oomdoctor.sim.allocator import replay, round_size
from oomdoctor.plans.estimate import Budget, Estimate, estimate_trace, trace_for
from oomdoctor.sim.gpus import MiB, get_profile
from oomdoctor.models.loader import load_model_file
from oomdoctor.sim.trace import Phase, Trace, TraceConfig

MODELS = Path(__file__).resolve().parent / "models"
HF0_CONTEXT_BYTES = 1343 * MiB  # HF-0: torch.ones((1, 1)).to("cuda") on the same V100
UNDER = 0.06  # oomdoctor may be this much below a reading (unmodelled memory only adds)
OVER = 0.03  # ... and this much above it


@dataclass(frozen=True)
class Setup:
    """One measured training configuration, as oomdoctor is asked about it."""

    model: str  # file in tests/models
    batch_size: int
    precision: str = "fp32"
    checkpointing: bool = False
    grad_accum: int = 1
    gpu: str = "a100-40"
    context_bytes: int | None = None


BERT = "hf_bert_large_seqcls.py"
HF = dict(gpu="v100-16", context_bytes=HF0_CONTEXT_BYTES)
HF_2 = Setup(BERT, 4, **HF)
HF_3 = Setup(BERT, 1, grad_accum=4, **HF)
HF_4 = Setup(BERT, 1, grad_accum=4, checkpointing=True, **HF)
HF_5 = Setup(BERT, 4, precision="fp16", **HF)
HF_6 = Setup(BERT, 1, precision="fp16", grad_accum=4, checkpointing=True, **HF)
ADAFACTOR = "hf_bert_large_adafactor.py"     # the same run with the Trainer's optim="adafactor"
HF_7 = Setup(ADAFACTOR, 4, **HF)
HF_8 = Setup(ADAFACTOR, 1, precision="fp16", grad_accum=4, checkpointing=True, **HF)
ADAM8BIT = "hf_bert_large_adam8bit.py"       # ... with bitsandbytes' Adam8bit
HF_9 = Setup(ADAM8BIT, 4, **HF)
HF_10 = Setup(ADAM8BIT, 1, precision="fp16", grad_accum=4, checkpointing=True, **HF)
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                               reason="bitsandbytes not installed")
VIT_B = "vit_b16_cifar10.py"
VIT_L = "vit_l16_cifar10.py"
PT_1 = Setup("vit_l16_sum_loss.py", 1, gpu="a100-80")
PT_2 = Setup("vit_l16_adam_in_backward.py", 1, gpu="a100-80")


@functools.lru_cache(maxsize=None)
def traced(s: Setup) -> tuple[Trace, Estimate]:
    spec = load_model_file(str(MODELS / s.model))
    cfg = TraceConfig(s.batch_size, precision=s.precision, checkpointing=s.checkpointing,
                      grad_accum=s.grad_accum)
    # margin 0: we ask what the run used, not whether it fits with room to spare
    budget = Budget(get_profile(s.gpu), margin=0.0, context_bytes=s.context_bytes)
    trace = trace_for(spec, cfg, budget.gpu)
    return trace, estimate_trace(trace, budget, model=spec.name)


def reading(name: str, *values) -> pytest.param:
    return pytest.param(name, *values, id=name.replace(" ", "-"))


def check(case: str, predicted: float, published: float, unit: str,
          e: Estimate | None = None) -> None:
    dev = predicted / published - 1
    msg = (f"{case}: oomdoctor {predicted:,.2f} {unit} vs published {published:,.2f} {unit} "
           f"({dev:+.1%}; band -{UNDER:.0%}/+{OVER:.0%})")
    if e is not None:
        msg += (f"; peak in the {e.peak_phase} of step {e.peak_step}, breakdown MiB "
                f"{ {k: round(v / MiB) for k, v in e.breakdown.items()} }")
    print(msg)  # the deviation stays in the output (pytest -s, or -rA for passed tests' output)
    assert -UNDER <= dev <= OVER, msg


# -- HF: bert-large-uncased, HF Trainer (transformers ~4.16, torch ~1.10), V100 16 GB -----------

def test_hf1_weights_only_nvml():
    """HF-1: the model moved to the card, nothing else: 2631 MiB on NVML. The trace's setup
    events (every parameter and buffer, in order) replayed through the allocator give the
    segments ``model.to("cuda")`` leaves behind."""
    trace, _ = traced(HF_2)
    setup_end = next(m.start for m in trace.marks if m.phase is not Phase.SETUP)
    reserved = replay(trace.events[:setup_end]).peak_reserved_bytes
    assert trace.num_parameters == 335_143_938  # bert-large-uncased 335,141,888 + 1024x2+2
    check("HF-1", (reserved + HF0_CONTEXT_BYTES) / MiB, 2631, "MiB")


@pytest.mark.parametrize("case, setup, published_mib", [
    reading("HF-2", HF_2, 14949),  # bs 4, fp32
    reading("HF-3", HF_3, 8681),  # bs 1 x 4 accumulation
    reading("HF-4", HF_4, 6775),  # bs 1 x 4, gradient checkpointing
    reading("HF-5", HF_5, 13939),  # bs 4, fp16 AMP
    reading("HF-6", HF_6, 7275),  # bs 1 x 4, checkpointing, fp16 AMP
    reading("HF-7", HF_7, 12295),  # bs 4, fp32, Adafactor (measured +0.1%)
    reading("HF-8", HF_8, 4847),  # bs 1 x 4, checkpointing, fp16 AMP, Adafactor (-2.4%)
    pytest.param("HF-9", HF_9, 13085, id="HF-9", marks=needs_bnb),  # bs 4, Adam8bit (-0.02%)
    pytest.param("HF-10", HF_10, 5363, id="HF-10", marks=needs_bnb),  # + ckpt, fp16 (+0.3%)
])
def test_hf_trainer_nvml_after_training(case, setup, published_mib):
    _, e = traced(setup)
    assert e.fits and e.num_alloc_retries == 0  # NVML at the end = peak reserved + context
    check(case, e.device_peak_bytes / MiB, published_mib, "MiB", e)


def test_hf_batch_slope():
    """HF-2 - HF-3: three more samples of activations and their temporaries, with the CUDA
    context and every fixed cost cancelled out. Published: 6268 MiB."""
    _, e2 = traced(HF_2)
    _, e3 = traced(HF_3)
    check("HF-2 - HF-3", (e2.device_peak_bytes - e3.device_peak_bytes) / MiB, 14949 - 8681,
          "MiB")


# -- VF: torchvision ViT fine-tuned on CIFAR-10 (rasbt/ViT-finetuning-scripts, torch 2.1) -------

# fp16 and bf16 AMP hold the same bytes but for GradScaler's few scalars: one fp16-AMP trace per
# model stands for both AMP readings (it keeps the file within its time budget). Pure fp16
# ("16-true", model.half()) and pure bf16 ("bf16-true") are each traced as what they are.
@pytest.mark.parametrize("case, setup, published_gb", [
    reading("VF-7 fp32", Setup(VIT_B, 16), 3.71),
    reading("VF-8 fp16 AMP", Setup(VIT_B, 16, precision="fp16"), 3.03),
    reading("VF-8 bf16 AMP", Setup(VIT_B, 16, precision="fp16"), 3.03),
    reading("VF-9 fp16 pure", Setup(VIT_B, 16, precision="fp16-pure"), 1.94),
    reading("VF-9 bf16 pure", Setup(VIT_B, 16, precision="bf16-pure"), 1.95),
    reading("VF-1 fp32", Setup(VIT_L, 32), 16.70),
    reading("VF-3 fp16 AMP", Setup(VIT_L, 32, precision="fp16"), 12.30),
    reading("VF-4 bf16 AMP", Setup(VIT_L, 32, precision="fp16"), 12.24),
    reading("VF-5 fp16 pure", Setup(VIT_L, 32, precision="fp16-pure"), 8.43),
    reading("VF-6 bf16 pure", Setup(VIT_L, 32, precision="bf16-pure"), 8.43),
])
def test_vit_finetune_max_memory_reserved(case, setup, published_gb):
    _, e = traced(setup)
    # torchvision vit_b_16 / vit_l_16 with the 1000-class head swapped for a 10-class one
    assert e.num_parameters == {VIT_B: 85_806_346, VIT_L: 303_311_882}[setup.model]
    assert e.num_alloc_retries == 0  # max_memory_reserved is then the segments' high-water mark
    check(case, e.peak_reserved_bytes / 1e9, published_gb, "GB", e)


# -- PT-1: vit_l_16, batch 1, loss = output.sum(), Adam (foreach) ------------------------------

def test_pt1_peak_is_the_foreach_adam_step():
    """The tutorial's snapshot peaks during ``optimizer.step()`` at "~6GB": parameters,
    gradients, exp_avg, exp_avg_sq and ``torch._foreach_sqrt(exp_avg_sqs)`` - five
    parameter-sized sets (activations are gone by then). Exactly: 5 x the parameters' blocks
    (each rounded to 512 B) + the two cuBLAS workspaces (forward and backward thread)."""
    _, e = traced(PT_1)
    with torch.device("meta"):
        model = load_model_file(str(MODELS / PT_1.model)).build_model()
    assert sum(p.numel() for p in model.parameters()) == 304_326_632  # torchvision vit_l_16
    param_blocks = sum(round_size(p.numel() * p.element_size()) for p in model.parameters())
    workspaces = 2 * get_profile(PT_1.gpu).cublas_workspace_bytes
    expected = 5 * param_blocks + workspaces
    assert e.peak_phase == Phase.OPTIMIZER.value, f"peak in the {e.peak_phase}, not optimizer"
    dev = e.peak_allocated_bytes / expected - 1
    assert abs(dev) < 0.005, (f"PT-1: peak allocated {e.peak_allocated_bytes:,} B vs 5 x "
                              f"{param_blocks:,} + {workspaces:,} = {expected:,} B ({dev:+.2%})")
    # one parameter-sized set of foreach intermediates, nothing else temporary but workspaces
    foreach = e.breakdown["temporaries"] - workspaces
    assert abs(foreach / param_blocks - 1) < 0.01, (f"foreach temporaries {foreach:,} B vs "
                                                    f"parameters {param_blocks:,} B")
    # the published reading, "~6GB", is one significant figure: 5.5 to 6.5 GB
    assert 5.5e9 <= e.peak_allocated_bytes <= 6.5e9, (
        f"PT-1: {e.peak_allocated_bytes / 1e9:.2f} GB vs published ~6 GB")


# -- PT-2: the same run with Adam stepped inside backward -----------------------------------------

def test_pt2_optimizer_in_backward_moves_the_peak_into_backward():
    """The tutorial's second snapshot: with one Adam per parameter stepped from
    ``register_post_accumulate_grad_hook``, no gradient outlives its parameter's step, so the
    peak is in backward at "~4GB": 3.6 GB of parameters and Adam state "plus ~0.4 GB of
    activations". Exactly, at that peak: the parameters and both Adam moments (3 x the
    parameters' blocks), no gradient set, and the activations of one image."""
    _, e = traced(PT_2)
    with torch.device("meta"):
        model = load_model_file(str(MODELS / PT_2.model)).build_model()
    param_blocks = sum(round_size(p.numel() * p.element_size()) for p in model.parameters())
    assert e.peak_phase == Phase.BACKWARD.value, f"peak in the {e.peak_phase}, not backward"
    assert e.breakdown["parameters"] == pytest.approx(param_blocks, rel=1e-6)
    assert e.breakdown["optimizer_state"] == pytest.approx(2 * param_blocks, rel=1e-6)
    assert e.gradient_bytes == 0 and e.breakdown["gradients"] < param_blocks / 100
    states = 3 * param_blocks
    assert abs(states / 3.6e9 - 1) < 0.02, f"params + Adam state {states / 1e9:.2f} GB vs 3.6"
    # "~4GB" and "~0.4 GB of activations": one significant figure each
    assert 3.5e9 <= e.peak_allocated_bytes <= 4.5e9, (
        f"PT-2: {e.peak_allocated_bytes / 1e9:.2f} GB vs published ~4 GB")
    assert 0.25e9 <= e.peak_allocated_bytes - states <= 0.55e9
    # PT-1 - PT-2 is the tutorial's point: about 2 GB saved (gradients and foreach temporaries)
    saved = traced(PT_1)[1].peak_allocated_bytes - e.peak_allocated_bytes
    assert 1.5e9 <= saved <= 2.5e9, f"PT-1 - PT-2 = {saved / 1e9:.2f} GB vs ~6 - ~4"


# -- LS: "LLMs from scratch" GPT-2 size, fused AdamW (rasbt/LLMs-from-scratch, torch 2.6, A100) --

# ch05/10_llm-training-speed/README.md prints torch.cuda.memory_reserved() / 1024**3 ("GB" are
# GiB) after the first epoch of 8 x 1024-token batches; no empty_cache, so the segments'
# high-water mark. LS-0 is 00_orig.py as published (foreach AdamW); every later reading has
# torch.optim.AdamW(fused=True) (the README's step 3 on). The card is "A100" without its size
# (A100 40 and 80 GB give the same estimates). Model files: tests/models/scratch_gpt*.py.
LS_0 = Setup("scratch_gpt_orig.py", 8)                             # 00_orig.py, foreach AdamW
LS_3 = Setup("scratch_gpt_step3.py", 8)                            # fp32, from-scratch layers
LS_5 = Setup("scratch_gpt_step3.py", 8, precision="bf16-pure")     # + model.to(bfloat16)
LS_6 = Setup("scratch_gpt_step6.py", 8, precision="bf16-pure")     # + nn.LayerNorm, nn.GELU
LS_7 = Setup("scratch_gpt_step7.py", 8, precision="bf16-pure")     # + SDPA (flash)


@pytest.mark.parametrize("case, setup, published_gib", [
    reading("LS-0 00_orig.py", LS_0, 26.2617),
    reading("LS-3 fp32 fused AdamW", LS_3, 26.2422),
    reading("LS-5 bf16 pure", LS_5, 13.7871),
    reading("LS-6 native LayerNorm GELU", LS_6, 11.5645),
    reading("LS-7 SDPA", LS_7, 5.9004),
])
def test_llms_from_scratch_memory_reserved(case, setup, published_gib):
    _, e = traced(setup)
    assert e.num_parameters == 163_009_536  # GPT_CONFIG_124M with an untied output head
    assert e.num_alloc_retries == 0
    check(case, e.peak_reserved_bytes / 2**30, published_gib, "GiB", e)


def test_llms_from_scratch_fused_adamw_changes_nothing_at_this_peak():
    """The README's step 3 (``fused=True``) left the reading unchanged: 26.2422 GiB before
    (foreach AdamW, torch 2.6's CUDA default) and after. Here too: the peak is in backward,
    where the optimizer holds only its state, and the foreach step's parameter-sized
    temporaries (about 0.6 GiB) fit in segments the activations have left free."""
    _, fused = traced(LS_3)
    spec = load_model_file(str(MODELS / LS_3.model))
    spec = replace(spec, make_optimizer=lambda params: torch.optim.AdamW(
        params, lr=5e-4, weight_decay=0.1))  # no fused: foreach on CUDA
    budget = Budget(get_profile(LS_3.gpu), margin=0.0)
    foreach = estimate_trace(trace_for(spec, TraceConfig(LS_3.batch_size), budget.gpu), budget)
    assert fused.peak_phase == foreach.peak_phase == Phase.BACKWARD.value
    assert foreach.peak_reserved_bytes == fused.peak_reserved_bytes
    check("LS-2 (foreach AdamW)", foreach.peak_reserved_bytes / 2**30, 26.2422, "GiB", foreach)
