"""The construct matrix: every way real models keep their blocks, through every command.

Each break this catches ran once and stopped: blocks in an ``nn.Sequential`` (the repeated-stack
cut rebuilt containers with ModuleList's signature), double quantization and LLM.int8 under any
multi-GPU strategy (the layout called ``state_dict()`` and bitsandbytes' meta kernels, which read
values). The models are tiny (tests/constructs.py): a language model whose blocks sit in a
ModuleList, a Sequential, a Sequential over an OrderedDict, a ModuleDict, two nested stacks, or
a ModuleList indexed up to a count, with tied weights, persistent and non-persistent buffers and
``.to("cuda")`` in build_model; and a 16-layer Llama config for the adapter options.

Independent checks: the stack traced cut and unrolled is the full trace, to the byte; the full
trace with the CUDA emulation off is a real CPU run of the same model (tests/reference.py).
"""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import constructs
from oomdoctor.cli import cli
from oomdoctor.models.loader import load_model, load_model_file
from oomdoctor.plans.estimate import Budget, estimate_trace
from oomdoctor.sim.gpus import PROFILES
from oomdoctor.sim.trace import TraceConfig, trace_training

DEEP = 32          # above repeat.MIN_BLOCKS: the stack is cut (nested: each stage holds 16)
# What each container's deep stack does (the unroll's outcomes): cut and unrolled ([True]);
# cut, but the cuts do not extend, so traced whole ([False]: two identical 16-block stacks in a
# row, where the first one's frees have no single relation); not cut ([]: a model that indexes
# its blocks up to its own count cannot run cut, and is traced whole).
UNROLLS = {"modulelist": [True], "sequential": [True], "sequential-named": [True],
           "moduledict": [True], "nested": [False], "indexed": []}


@pytest.mark.parametrize("depth", [4, DEEP])
@pytest.mark.parametrize("container", constructs.CONTAINERS)
def test_a_cut_stack_is_the_full_trace(tmp_path, unrolled, container, depth):
    spec = load_model_file(constructs.write(tmp_path, container, depth))
    cfg = TraceConfig(4, "bf16")
    fast = trace_training(spec, cfg)
    whole = trace_training(spec, cfg, min_blocks=None)
    assert fast.events == whole.events and fast.storages == whole.storages
    assert fast.notes == whole.notes
    budget = Budget(PROFILES["rtx3090"])
    a, b = estimate_trace(fast, budget), estimate_trace(whole, budget)
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == \
        (b.peak_allocated_bytes, b.peak_reserved_bytes)
    assert unrolled == (UNROLLS[container] if depth == DEEP else [])


@pytest.mark.parametrize("container", constructs.CONTAINERS)
def test_the_trace_is_a_real_cpu_run(tmp_path, container):
    """Tied weights, both kinds of buffer and the container, traced as the CPU runs, against
    the same model run for real; ``.to("cuda")`` in build_model is left to oomdoctor (the file
    without it traces the same events)."""
    from reference import real_cpu_peak
    on_gpu = load_model_file(constructs.write(tmp_path, container, 20))
    cpu_path = constructs.write(tmp_path, container, 20, to_cuda=False)
    cfg = TraceConfig(8, emulate_cuda=False)
    trace = trace_training(on_gpu, cfg)
    assert trace.events == trace_training(load_model_file(cpu_path), cfg).events
    real = real_cpu_peak(cpu_path, 8)
    assert abs(trace.peak_live_bytes - real) <= 0.01 * real, (trace.peak_live_bytes, real)
    emb = 128 * 32 * 4                          # the tied embedding, counted once
    assert trace.parameter_bytes == emb + 20 * (2 * 32 * 4 + 2 * 32 * 64 * 4 + 64 * 4 + 32 * 4)


def _run(*args: str) -> str:
    """The command's stdout; it must give an answer (exit 0: fits, 1: does not), no error."""
    r = CliRunner().invoke(cli, [*args, "--gpu", "rtx3090"])
    assert r.exit_code in (0, 1), (args, r.output[-2000:])
    assert "error:" not in r.output, r.output[-2000:]
    return r.stdout


COMMANDS = [("estimate", "-b", "4"), ("probe", "--precision", "bf16", "--no-checkpointing",
                                      "-j", "1"),
            ("parallel", "--gpus", "2", "-b", "4"), ("split", "-b", "4")]


@pytest.mark.parametrize("container", constructs.CONTAINERS)
def test_every_command_runs_every_container(tmp_path, container):
    """20 blocks: above the repeated-stack threshold, so each flat container is cut (nested:
    two 10-block stacks, traced whole)."""
    path = constructs.write(tmp_path, container, 20)
    for command, *args in COMMANDS:
        _run(command, path, *args)
    # DeepSpeed ZeRO-3 module by module (plans/parallel/zero3_gathers): the container's
    # modules, the tied weight fetched by both its modules, checkpointed blocks recomputed,
    # limits small enough that the coordinator prefetches, keeps and releases
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 3,
                                                    "stage3_prefetch_bucket_size": 2000,
                                                    "stage3_max_live_parameters": 20000,
                                                    "stage3_max_reuse_distance": 5000,
                                                    "stage3_param_persistence_threshold": 0}}))
    for ck in ((), ("--checkpointing",)):
        plan = json.loads(_run("parallel", path, "--gpus", "2", "--ds-config", str(ds),
                               "--json", *ck))
        assert [s["strategy"] for s in plan["strategies"]] == ["ds3"]
    if container == "sequential-named":          # named blocks, cut in place (CI time: one)
        out = _run("recommend", path, "--num-gpus", "2", "--precision", "bf16")
        assert "fsdp" in out.lower() or "ddp" in out.lower()


LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 16, "vocab_size": 256, "max_position_embeddings": 256}
ADAPTERS = {
    "lora-targets-dropout": ["--lora", "4", "--lora-targets", "q_proj,v_proj,o_proj",
                             "--lora-dropout", "0.05"],
    "nf4": ["--lora", "4", "--quantize", "nf4"],
    "fp4": ["--lora", "4", "--quantize", "fp4"],
    "nf4-double-quant": ["--lora", "4", "--quantize", "nf4", "--double-quant"],
    "int8": ["--lora", "4", "--quantize", "int8"],
}
STRATEGIES = ("single", "ddp", "dp", "zero1", "zero2", "zero3", "pipeline2")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama16")
    (d / "config.json").write_text(json.dumps(LLAMA))
    return str(d)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_every_adapter_option_under_every_strategy(llama, name):
    out = _run("parallel", llama, "--seq-len", "64", "--gpus", "2", "--precision", "bf16",
               "--json", *ADAPTERS[name])
    plan = json.loads(out)
    assert plan["errors"] == []
    assert [s["strategy"] for s in plan["strategies"]] == list(STRATEGIES)
    assert all(s["peak_device_bytes"] > 0 for s in plan["strategies"])


def test_double_quant_in_recommend_and_the_fsdp_probe(llama):
    qlora = ADAPTERS["nf4-double-quant"]
    _run("recommend", llama, "--seq-len", "64", "--num-gpus", "2", "--precision", "bf16",
         *qlora)
    _run("probe", llama, "--seq-len", "64", "--strategy", "fsdp", "--num-gpus", "2",
         "--precision", "bf16", "--no-checkpointing", *qlora)


def test_timm_vit_large_estimates_probes_and_plans(unrolled):
    """timm keeps ViT's 24 blocks in an nn.Sequential: cut and unrolled, the full trace's
    estimate; probe and the 2-GPU plan run."""
    pytest.importorskip("timm")
    spec = load_model("timm:vit_large_patch16_224", num_classes=10)
    cfg = TraceConfig(4, "bf16")
    budget = Budget(PROFILES["rtx3090"])
    fast = estimate_trace(trace_training(spec, cfg), budget)
    whole = estimate_trace(trace_training(spec, cfg, min_blocks=None), budget)
    assert unrolled == [True]
    assert fast.to_json() == whole.to_json()
    name = ("timm:vit_large_patch16_224", "--num-classes", "10")
    _run("probe", *name, "--precision", "bf16", "--no-checkpointing", "-j", "1")
    _run("parallel", *name, "--gpus", "2", "-b", "4", "--precision", "bf16")
