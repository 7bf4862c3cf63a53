"""torchao's low-bit AdamW (HF Trainer's optim="adamw_torch_8bit" / "adamw_torch_4bit").

Checked against: the state the library itself holds after a real CPU step (its tensor
subclasses flattened to the tensors that hold memory) and its documented layout; and a real CPU
run of the same training loop, where torch.compile really compiles the step with Inductor,
measured by torch.profiler after a warm-up step (the first step compiles, and the compiler's own
allocations are not training memory).
"""
from __future__ import annotations

import gc
import math
import os

import pytest
import torch

ao = pytest.importorskip("torchao.optim")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from oomdoctor.models.loader import load_model  # noqa: E402
from oomdoctor.sim.stepping import state_tensors, unique_storages  # noqa: E402
from oomdoctor.sim.trace import Category, TraceConfig, trace_training  # noqa: E402
from reference import load  # noqa: E402

MODEL = os.path.join(os.path.dirname(__file__), "models", "torchao_adamw8bit_mlp.py")
SHAPES = [(2048, 512), (2048,), (512, 2048), (512,), (10, 512), (10,)]


def _real_state_and_peak(batch: int) -> tuple[int, int]:
    """Two warm-up steps (state created, the step compiled for the first and again for the
    later steps), then one profiled step: the state's bytes, and the step's peak (parameters
    and state allocated before profiling included)."""
    mod = load(MODEL)
    torch.manual_seed(0)
    model = mod.build_model()
    opt = mod.make_optimizer(model.parameters())

    def step():
        mod.loss_fn(model, mod.make_batch(batch)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()
    step()
    state = sum(t.untyped_storage().nbytes()
                for t in unique_storages(v for _, v in state_tensors(opt)).values())
    base = sum(p.untyped_storage().nbytes() for p in model.parameters()) + state
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return state, base + peak


@pytest.fixture(scope="module")
def real():
    return _real_state_and_peak(64)


@pytest.fixture(scope="module")
def traced():
    return trace_training(load_model(MODEL), TraceConfig(64, emulate_cuda=False),
                          backend="meta")


def test_state_is_the_library_own(real, traced):
    # AdamW8bit: exp_avg and exp_avg_sq each hold uint8 codes (one per parameter), an fp32
    # scale per block of 256 and their 256-entry fp32 code map (torchao/optim/subclass_8bit.py);
    # tensors under 4096 elements keep fp32 state; a 4-byte step counter per tensor
    assert traced.optimizer_state_bytes == real[0] == layout(8)


def test_state_storages_are_labelled_state(traced):
    labelled = sum(s.nbytes for s in traced.storages.values()
                   if s.category is Category.OPTIMIZER_STATE)
    # all but what torch.tensor(data) makes (the 256-entry code map of the 6 quantized state
    # tensors, the 6 step counters): lift_fresh aliases its source, so the trace sees no new
    # storage there (a known gap of a few KiB, tests/test_trace.py)
    assert traced.optimizer_state_bytes - labelled == 6 * 256 * 4 + 6 * 4


def test_compiled_step_peak_matches_a_real_cpu_run(real, traced):
    # the eager step's temporaries (dequantized fp32 state, the update) would add about 80%;
    # Inductor keeps one fp32 copy of each state tensor while it is re-quantized
    assert traced.peak_live_bytes == pytest.approx(real[1], rel=0.005)
    assert any("compiles its step" in n for n in traced.notes)


def test_4bit_state_packs_two_codes_per_byte():
    # two 4-bit codes per byte, an fp32 scale per block of 128, a 16-entry fp32 code map
    t = trace_training(load_model(MODEL), TraceConfig(8, optimizer="torchao-adamw4bit", steps=1,
                                                      emulate_cuda=False), backend="meta")
    assert t.optimizer_state_bytes == layout(4)


def layout(bits: int) -> int:
    """torchao's state bytes for SHAPES (torchao/optim/subclass_8bit.py, subclass_4bit.py):
    block size 256 (8-bit) or 128 (4-bit), quantized only from 4096 elements."""
    block, codes = {8: (256, 256), 4: (128, 16)}[bits]
    total = 0
    for n in (math.prod(s) for s in SHAPES):
        quantized = n >= 4096 and n % block == 0
        per_state = (n * bits // 8 + 4 * (n // block) + 4 * codes) if quantized else 4 * n
        total += 2 * per_state + 4                 # exp_avg, exp_avg_sq, step
    return total


def test_the_cli_keeps_torchaos_import_chatter_off_stderr():
    # importing torchao next to a CPU-only torch logs a warning per CUDA-only .so it cannot load
    # (and torch's pytree logs a deprecation for it): noise between oomdoctor's own lines
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "oomdoctor", "estimate", MODEL, "-b", "8",
                          "--optimizer", "torchao-adamw8bit", "--gpu", "rtx3090"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Failed to load" not in out.stderr and "Enum subclass" not in out.stderr, out.stderr
    assert "peak" in out.stdout
