"""The newest paths against a real GPU: benchmarks/results/newpaths/ (an H200, torch 2.11.0,
transformers 5.17.0, peft 0.21.0, bitsandbytes 0.50.2; benchmarks/measure_newpaths.py).

A grouped-query Llama (hidden 1024, 8 query and 2 key/value heads, 8 layers, 4096 tokens) with
LoRA, with QLoRA (nf4 + double quantization), under FSDP2 on a one-GPU mesh with a bf16
MixedPrecisionPolicy, and LoRA under that FSDP2, each estimated on the CPU as a user would type
it and compared with ``max_memory_allocated`` and ``max_memory_reserved``. Measured once and
never tuned on; the allocator's own events of the same runs are in newpaths/traces/.

Two causes found in those events are modelled since (issue 34): the backward's cuBLAS workspace
comes with its first matmul, not at the phase's start (LoRA's reserved at batch 1 was 12-18%
low), and FSDP2's reduce output lives on its own stream, whose blocks the default stream never
reuses (the FSDP rows' reserved were 9% low to 5% high), with a one-GPU mesh gathering nothing.
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
_DIR = os.path.join(ROOT, "benchmarks", "results", "newpaths")
with open(os.path.join(_DIR, "nvidia-h200-2.11.0.json")) as f:
    RESULTS = json.load(f)
with open(os.path.join(_DIR, "nvidia-h200-2.11.0-traced.json")) as f:
    TRACED = json.load(f)
SCRIPT = os.path.join(ROOT, "benchmarks", "measure_newpaths.py")
H200 = Budget(get_profile("h200"))


def _record(setup: str, batch: int, checkpointing: bool, doc: dict = RESULTS) -> dict:
    return next(r for r in doc["records"] if r["setup"] == setup
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


LORA = Adapters(16, ("q_proj", "v_proj"))
QLORA = Adapters(16, ("q_proj", "v_proj"), quantize="nf4", double_quant=True)


@pytest.mark.parametrize("setup,adapters,precision", [
    ("lora-bf16-amp", LORA, "bf16"), ("lora-bf16", LORA, "bf16-pure"),
    ("qlora-nf4-dq-bf16-amp", QLORA, "bf16")])
@pytest.mark.parametrize("batch,ckpt", [(1, False), (2, False), (1, True), (2, True)])
def test_grouped_query_lora_and_qlora(tmp_path, setup, adapters, precision, batch, ckpt):
    """`estimate CONFIG --seq-len 4096 --precision bf16|bf16-pure --lora 16 --lora-targets
    q_proj,v_proj [--quantize nf4 --double-quant] [--checkpointing]`: allocated within 0.1%,
    reserved within 1% (largest: +0.63%, LoRA AMP at batch 1)."""
    spec = load_model(_config_dir(tmp_path, "bfloat16"), seq_len=4096, adapters=adapters)
    e = estimate(spec, TraceConfig(batch, precision, ckpt), H200)
    measured = _record(setup, batch, ckpt)
    _close(e.peak_allocated_bytes, measured["max_memory_allocated"], 0.001)
    _close(e.peak_reserved_bytes, measured["max_memory_reserved"], 0.01)


def _fsdp2(tmp_path, batch: int, ckpt: bool, adapters: Adapters | None,
           cpu_offload: bool = False):
    """`parallel CONFIG --strategy fsdp --gpus 1 --precision bf16 [--lora 16 ...]
    [--cpu-offload]` (the policy is bf16's default under FSDP): one GPU's figures."""
    spec = load_model(_config_dir(tmp_path, "bfloat16" if adapters else None), seq_len=4096,
                      adapters=adapters)
    st = par.Strategy("zero3", 1, mixed_precision=True, cpu_offload=cpu_offload)
    cast = par.trace_precision(st, "bf16")
    trace = trace_for(spec, TraceConfig(batch, cast, ckpt), H200.gpu)
    return par.estimate_strategy(trace, par.model_layout(spec, cast), st, H200).gpus[0]


@pytest.mark.parametrize("batch,ckpt", [(1, False), (2, False), (1, True), (2, True)])
def test_fsdp2_bf16_mixed_precision_policy(tmp_path, batch, ckpt):
    """Full fine-tuning of the fp32 model: allocated within 0.2% (-0.14% to -0.05%), reserved
    within 1% (-0.69% to +0.09%). The autocast reading of the same run is 10% high, pure bf16
    20% low (issue #31)."""
    g = _fsdp2(tmp_path, batch, ckpt, None)
    measured = _record("fsdp2-bf16-mp", batch, ckpt)
    _close(g.peak_allocated_bytes, measured["max_memory_allocated"], 0.002)
    _close(g.peak_reserved_bytes, measured["max_memory_reserved"], 0.01)


@pytest.mark.parametrize("batch,ckpt", [(1, False), (2, False), (1, True), (2, True)])
def test_fsdp2_lora_under_the_policy(tmp_path, batch, ckpt):
    """LoRA on the bf16 model, fully_shard per layer under the policy (-traced.json, measured
    2026-11-27 with the allocator's events). The adapters compute in bf16 as FSDP casts them
    (configs.WRAPPER_CASTS; traced with peft's fp32 adapters it was 8% high). Allocated within
    0.1% (+0.02% to +0.07%), reserved within 0.3%. It was 22 MiB over at every batch (+0.4% to
    +1.1%): the events showed no layer gathered while the loss's backward peaks, where the
    replay gathered the last one at the backward's start; its pre_backward waits for its
    output's gradient (fsdp._pre_backwards)."""
    g = _fsdp2(tmp_path, batch, ckpt, LORA)
    measured = _record("fsdp2-lora-bf16-mp", batch, ckpt, TRACED)
    _close(g.peak_allocated_bytes, measured["max_memory_allocated"], 0.002)
    _close(g.peak_reserved_bytes, measured["max_memory_reserved"], 0.01)


with open(os.path.join(_DIR, "nvidia-h200-2.11.0-offload.json")) as f:
    OFFLOADED = json.load(f)
with open(os.path.join(_DIR, "nvidia-h200-2.11.0-8192.json")) as f:
    LONG = json.load(f)


@pytest.mark.parametrize("batch,ckpt", [(1, False), (2, False), (1, True), (2, True)])
def test_fsdp2_cpu_offload_policy(tmp_path, batch, ckpt):
    """`parallel CONFIG --strategy fsdp --gpus 1 --precision bf16 --cpu-offload`: FSDP2's
    CPUOffloadPolicy (-offload.json, measured 2026-11-28 with the allocator's events). Unseen,
    allocated was within 0.1% at every batch and reserved within 1.3% but for batch 1 with
    checkpointing, +16%: the events showed the one-GPU unshard parameter by parameter and
    fully_shard's start-up moves, whose cached segments took the backward's cuBLAS workspace
    (fsdp._unshard_offloaded, fsdp._offload_setup). Now within 0.01% and 0.05%."""
    g = _fsdp2(tmp_path, batch, ckpt, None, cpu_offload=True)
    measured = _record("fsdp2-offload-bf16-mp", batch, ckpt, OFFLOADED)
    _close(g.peak_allocated_bytes, measured["max_memory_allocated"], 0.002)
    _close(g.peak_reserved_bytes, measured["max_memory_reserved"], 0.005)


def test_fsdp2_at_8192_tokens_without_checkpointing(tmp_path):
    """FSDP2 under the policy at twice the sequence (-8192.json): the torchtitan row whose
    reserve stays unexplained (tests/published_multi.py, 8192 tokens, no AC, 8 GPUs) asked
    whether long sequences part the replay from the allocator on one GPU. They do not:
    allocated -0.12%, reserved +0.09%, unseen."""
    rec = LONG["records"][0]
    cfg = dict(rec["model_config"], model_type="llama", architectures=["LlamaForCausalLM"],
               max_position_embeddings=rec["seq_len"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model(str(tmp_path), seq_len=rec["seq_len"])
    st = par.Strategy("zero3", 1, mixed_precision=True)
    cast = par.trace_precision(st, "bf16")
    trace = trace_for(spec, TraceConfig(1, cast, False), H200.gpu)
    g = par.estimate_strategy(trace, par.model_layout(spec, cast), st, H200).gpus[0]
    _close(g.peak_allocated_bytes, rec["max_memory_allocated"], 0.002)
    _close(g.peak_reserved_bytes, rec["max_memory_reserved"], 0.01)


@pytest.mark.parametrize("setup,batch,ckpt", [("lora-bf16-amp", 1, False),
                                              ("fsdp2-lora-bf16-mp", 1, True)])
def test_the_measuring_script_itself(setup, batch, ckpt):
    """The measurement's own code (measure_newpaths.py --child, which builds, shards and trains
    as described, and reads torch.cuda's peaks) run as it is through `estimate -- python`:
    the script source's figures for the same run, within 1.5% allocated and 1% reserved."""
    from click.testing import CliRunner
    from oomdoctor.cli import cli
    doc = TRACED if setup.startswith("fsdp2-lora") else RESULTS
    rec = _record(setup, batch, ckpt, doc)
    job = {k: rec[k] for k in ("setup", "model_config", "seq_len", "batch_size", "checkpointing")}
    job.update(dry_run=False, port=29511)
    r = CliRunner().invoke(cli, ["estimate", "--gpu", "h200", "--torch", "2.11", "--json", "--",
                                 "python", SCRIPT, "--child", json.dumps(job)])
    assert r.exit_code == 0, r.output[-3000:]
    out = json.loads("\n".join(line for line in r.stdout.splitlines()
                               if not line.startswith("RESULT ")))
    got = out["strategies"][0]["gpus"][0] if "strategies" in out else out
    _close(got["peak_allocated_bytes"], rec["max_memory_allocated"], 0.015)
    _close(got["peak_reserved_bytes"], rec["max_memory_reserved"], 0.01)


def test_the_offload_measurement_runs_as_its_plan(tmp_path):
    """FSDP2 with CPUOffloadPolicy, the setup that waits for a GPU (no record yet): its code
    (measure_newpaths.py --child) run through `estimate -- python` needs what `--strategy fsdp
    --cpu-offload` of the same config gives, so the measurement will check both routes."""
    from click.testing import CliRunner
    from oomdoctor.cli import cli
    rec = _record("fsdp2-bf16-mp", 1, False)
    job = {"setup": "fsdp2-offload-bf16-mp", "model_config": rec["model_config"],
           "seq_len": rec["seq_len"], "batch_size": 1, "checkpointing": False,
           "dry_run": False, "port": 29512}
    r = CliRunner().invoke(cli, ["estimate", "--gpu", "h200", "--torch", "2.11", "--json", "--",
                                 "python", SCRIPT, "--child", json.dumps(job)])
    assert r.exit_code == 0, r.output[-3000:]
    out = json.loads("\n".join(line for line in r.stdout.splitlines()
                               if not line.startswith("RESULT ")))
    [strategy] = out["strategies"]
    got = strategy["gpus"][0]
    assert any("CPUOffloadPolicy" in n for n in strategy["notes"])
    want = _fsdp2(tmp_path, 1, False, None, cpu_offload=True)
    _close(got["peak_allocated_bytes"], want.peak_allocated_bytes, 0.01)
    _close(got["peak_reserved_bytes"], want.peak_reserved_bytes, 0.01)
