"""The measuring harness's model construction on the device (oomdoctor.runs.onbuild)."""
from __future__ import annotations

import os

from oomdoctor.models.loader import load_model_file
from oomdoctor.plans.estimate import Budget, estimate
from oomdoctor.runs.onbuild import construction_events, harness_peaks
from oomdoctor.sim.allocator import replay
from oomdoctor.sim.gpus import PROFILES
from oomdoctor.sim.trace import TraceConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spec(name):
    return load_model_file(os.path.join(ROOT, "sample_models", f"{name}.py"))


def test_pure_bf16_construction_holds_the_fp32_weights_and_the_untied_embedding():
    # lora_gpt: 81,702,912 fp32 weights plus the embedding's first (50304, 768) copy, alive
    # until `self.wte.weight = self.lm_head.weight`; the H200 measured 483,180,544 bytes at
    # batch 1 in pure bf16 (benchmarks/results/nvidia-h200-2.11.0.json), with and without
    # checkpointing.
    events, final = construction_events(_spec("lora_gpt"), TraceConfig(1, precision="bf16-pure"))
    weights = 81_702_912 * 4 + 50304 * 768 * 4
    peak = replay(events).peak_allocated_bytes
    assert weights <= peak <= weights + 2 * 2**20
    assert sum(n for _, n in final.values()) == 81_702_912 * 2    # what is left: bf16 weights
    assert "wte.weight" in final and "lm_head.weight" not in final   # tied: one storage


def test_the_step_trains_the_blocks_construction_left():
    spec = _spec("tiny_mlp")
    budget = Budget(PROFILES["a10"], margin=0.0, context_bytes=400 * 2**20)
    cfg = TraceConfig(4)
    e = estimate(spec, cfg, budget)
    h = harness_peaks(spec, cfg, budget, e)
    # fp32, no tied weights: construction allocates exactly the weights the step starts with
    assert h.peak_allocated_bytes == e.peak_allocated_bytes and h.fits
