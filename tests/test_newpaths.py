"""The newest paths against a real GPU: benchmarks/results/newpaths/ (an H200, torch 2.11.0,
transformers 5.17.0, peft 0.21.0, bitsandbytes 0.50.2; benchmarks/measure_newpaths.py).

A grouped-query Llama (hidden 1024, 8 query and 2 key/value heads, 8 layers, 4096 tokens) with
LoRA, with QLoRA (nf4 + double quantization), and under FSDP2 on a one-GPU mesh with a bf16
MixedPrecisionPolicy, each estimated on the CPU as a user would type it and compared with
``max_memory_allocated``. Measured once and never tuned on. The reserved peaks are reported by
the same comparison; the LoRA rows at batch 1 are the reserved deviation of issue #34
(allocated exact, reserved 12-18% low), not modelled yet, so this file asserts allocated.
"""
from __future__ import annotations

import json
import os

import pytest

from oomdoctor.models.adapters import Adapters
from oomdoctor.models.loader import load_model
from oomdoctor.plans import parallel as par
from oomdoctor.plans.estimate import Budget, estimate, trace_for
from oomdoctor.sim.gpus import get_profile
from oomdoctor.sim.trace import TraceConfig

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "benchmarks", "results", "newpaths",
                       "nvidia-h200-2.11.0.json")) as f:
    RESULTS = json.load(f)
H200 = Budget(get_profile("h200"))


def _record(setup: str, batch: int, checkpointing: bool) -> dict:
    return next(r for r in RESULTS["records"] if r["setup"] == setup
                and r["batch_size"] == batch and r["checkpointing"] == checkpointing)


def _config_dir(tmp_path, dtype: str | None) -> str:
    """The measured model's config, as a Hub config.json says it (torch_dtype where the run
    loaded bf16 weights)."""
    cfg = dict(RESULTS["records"][0]["model_config"], model_type="llama",
               architectures=["LlamaForCausalLM"])
    if dtype:
        cfg["torch_dtype"] = dtype
    d = tmp_path / (dtype or "fp32")
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _close(predicted: int, measured: int, share: float) -> None:
    assert abs(predicted - measured) <= share * measured, \
        (predicted, measured, f"{predicted / measured - 1:+.2%}")


@pytest.mark.parametrize("setup,adapters,batch,ckpt", [
    ("lora-bf16-amp", Adapters(16, ("q_proj", "v_proj")), 2, False),
    ("lora-bf16-amp", Adapters(16, ("q_proj", "v_proj")), 1, True),
    ("qlora-nf4-dq-bf16-amp", Adapters(16, ("q_proj", "v_proj"), quantize="nf4",
                                       double_quant=True), 1, False),
    ("qlora-nf4-dq-bf16-amp", Adapters(16, ("q_proj", "v_proj"), quantize="nf4",
                                       double_quant=True), 2, True),
])
def test_grouped_query_lora_and_qlora(tmp_path, setup, adapters, batch, ckpt):
    """`estimate CONFIG --seq-len 4096 --precision bf16 --lora 16 --lora-targets q_proj,v_proj
    [--quantize nf4 --double-quant] [--checkpointing]`: allocated within 0.1%."""
    spec = load_model(_config_dir(tmp_path, "bfloat16"), seq_len=4096, adapters=adapters)
    e = estimate(spec, TraceConfig(batch, "bf16", ckpt), H200)
    _close(e.peak_allocated_bytes, _record(setup, batch, ckpt)["max_memory_allocated"], 0.001)


@pytest.mark.parametrize("ckpt", [False, True])
def test_fsdp2_bf16_mixed_precision_policy(tmp_path, ckpt):
    """`parallel CONFIG --strategy fsdp --gpus 1 --precision bf16` (the policy is bf16's
    default under FSDP) on the fp32 model: allocated +0.03% and +0.001% (with checkpointing).
    Before FSDP2's own allocations were modelled (plans/parallel/fsdp.py: the forward's
    all-gather output held to the next copy-out, the reduce-scatter input to the next
    post_backward) it was 1-2% low, about 68 MB missing. The autocast reading of the same run is
    10% high, pure bf16 20% low (issue #31)."""
    spec = load_model(_config_dir(tmp_path, None), seq_len=4096)
    st = par.Strategy("zero3", 1, mixed_precision=True)
    pure = par.trace_precision(st, "bf16")
    trace = trace_for(spec, TraceConfig(1, pure, ckpt), H200.gpu)
    e = par.estimate_strategy(trace, par.model_layout(spec, pure), st, H200)
    measured = _record("fsdp2-bf16-mp", 1, ckpt)["max_memory_allocated"]
    _close(e.gpus[0].peak_allocated_bytes, measured, 0.002)
