"""LoRA/QLoRA and user `.to()` calls through every multi-GPU planner (issue #24).

The question the product exists for - a model too big for one card, fine-tuned the way people
do it (peft LoRA, QLoRA on bitsandbytes 4-bit weights) on two GPUs - crashed in every planner
but `estimate`: the layout pass rebuilt the model on fake CPU tensors, where peft's and a user's
`Module.to` failed to swap tensors and 4-bit weights cannot be built at all. Checked here:

- a matrix of the multi-GPU commands x {LoRA, QLoRA} on a tiny Llama config: each exits 0 with
  a plan that fits;
- each strategy's per-GPU model states against a hand count from the architecture (4-bit packed
  weights, fp32 block-wise absmax, fp32 non-quantized weights after
  prepare_model_for_kbit_training, fp32 adapters; gradients and AdamW's two moments for the
  adapters only): DDP and ZeRO-1/2 replicate the frozen base, ZeRO-3 shards it;
- recommend's lower bound counts gradients and optimizer state for what trains only;
- a model file whose build_model calls `.to(memory_format=torch.channels_last)` in parallel,
  split, recommend and probe --num-gpus 2.
"""
from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from oomdoctor.cli import EXIT_OK, cli
from tiny_configs import LLAMA_26M, config_folder

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "peft", "bitsandbytes")),
    reason="needs transformers, peft and bitsandbytes (pip install -e '.[test]')")

# A Llama small enough to trace in a second: every linear layer is a multiple of bitsandbytes'
# 64-element blocks, the output layer is untied (kept unquantized, as transformers does).
H, I, LAYERS, KV, VOCAB = 64, 128, 2, 32, 512
LLAMA = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             architectures=["LlamaForCausalLM"], tie_word_embeddings=False)
RANK = 8
ADAPTERS = {"lora": ["--lora", str(RANK)], "qlora": ["--lora", str(RANK), "--quantize", "nf4"]}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    import transformers
    d = tmp_path_factory.mktemp("cfg") / "tiny-llama"
    transformers.LlamaConfig(**LLAMA).save_pretrained(d)
    return str(d)


def _run(*argv: str):
    return CliRunner().invoke(cli, [*argv], catch_exceptions=False)


COMMANDS = {
    "estimate-ddp": ["estimate", "{m}", "-b", "2", "--strategy", "ddp", "--num-gpus", "2"],
    "estimate-zero2": ["estimate", "{m}", "-b", "2", "--strategy", "zero2", "--num-gpus", "2"],
    "estimate-fsdp": ["estimate", "{m}", "-b", "2", "--strategy", "fsdp", "--num-gpus", "2"],
    "parallel": ["parallel", "{m}", "--gpus", "2", "-b", "2"],
    "split": ["split", "{m}", "--gpus", "2", "-b", "2"],
    "recommend": ["recommend", "{m}", "--num-gpus", "2", "--target-batch", "8", "--quick",
                  "-j", "1"],
    "probe": ["probe", "{m}", "--num-gpus", "2", "-j", "1", "--target-batch", "8"],
}


@pytest.mark.parametrize("adapters", sorted(ADAPTERS))
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_multi_gpu_command_plans_lora_and_qlora(llama, command, adapters):
    argv = [a.format(m=llama) for a in COMMANDS[command]]
    r = _run(*argv, "--seq-len", "32", "--gpu", "rtx3090", "--precision", "bf16",
             *ADAPTERS[adapters], "--json")
    assert r.exit_code == EXIT_OK, r.output
    doc = json.loads(r.stdout)
    assert "LoRA" in json.dumps(doc)           # the plan is for the adapted model


# -- model states by hand ------------------------------------------------------------------
QUANTIZED = LAYERS * (2 * H * H + 2 * KV * H + 3 * H * I)     # q,o + k,v + gate,up,down
UNQUANTIZED = 2 * VOCAB * H + (2 * LAYERS + 1) * H            # embeddings, lm_head, norms
LORA = LAYERS * (RANK * H + H * RANK + RANK * H + KV * RANK)  # A and B of q_proj and v_proj
PACKED = QUANTIZED // 2                      # two 4-bit codes per byte
ABSMAX = QUANTIZED // 64 * 4                 # one fp32 scale per 64-element block
PARAMS = PACKED + 4 * UNQUANTIZED + 4 * LORA
TRAINABLE = 4 * LORA                          # fp32 adapters: their gradients
STATE = 2 * TRAINABLE                         # AdamW's exp_avg and exp_avg_sq


def test_qlora_model_states_per_strategy_by_hand(llama):
    """Parameters + gradients + optimizer state each GPU holds after the step."""
    from oomdoctor.models.adapters import Adapters
    from oomdoctor.models.loader import load_model
    from oomdoctor.plans import parallel as par
    from oomdoctor.plans import recommend as rec
    from oomdoctor.plans.estimate import Budget, trace_for
    from oomdoctor.sim.gpus import get_profile
    from oomdoctor.sim.trace import TraceConfig
    gpu = get_profile("rtx3090")
    spec = load_model(llama, seq_len=32, adapters=Adapters(RANK, quantize="nf4"))
    trace = trace_for(spec, TraceConfig(2, precision="bf16"), gpu)
    assert (trace.parameter_bytes, trace.gradient_bytes, trace.optimizer_state_bytes) == \
        (PARAMS, TRAINABLE, STATE)
    layout = par.model_layout(spec, "bf16")
    assert layout.num_trainable == LORA

    def resting(name: str) -> list[int]:
        e = par.estimate_strategy(trace, layout, par.Strategy(name, 2), Budget(gpu))
        return [g.resting_state_bytes for g in e.gpus]
    full = PARAMS + TRAINABLE + STATE
    # The 4-bit weights' statistics (absmax, code tables) are held with the weights, whole on
    # every rank; the estimator counts the model's buffers (rotary inv_freq) with them.
    stats = ABSMAX + _codebooks(spec)
    held = stats + _buffer_bytes(spec)
    assert resting("ddp") == [full + held]                            # a replica each
    # ZeRO-1 gives each rank whole adapters' state (ZeroRedundancyOptimizer): the two ranks
    # together hold it once, each holds every parameter and gradient.
    z1 = resting("zero1")
    assert sum(z1) == 2 * (PARAMS + held + TRAINABLE) + STATE
    assert resting("zero2")[0] == pytest.approx(PARAMS + held + (TRAINABLE + STATE) / 2,
                                                abs=64 * 8)
    # ZeRO-3/FSDP shards the frozen 4-bit base too (every parameter storage split in two).
    assert resting("zero3")[0] == pytest.approx(full / 2 + held, abs=64 * 8)
    # recommend's lower bound: the same counts, measured on the built model (no trace).
    facts = rec.model_facts(spec, ["bf16"])
    assert facts.num_trainable == LORA
    assert facts.state_bytes("bf16") == (PARAMS, TRAINABLE)
    assert rec.floor_bytes(facts, "bf16", par.Strategy("ddp", 2)) == full + stats
    assert rec.floor_bytes(facts, "bf16", par.Strategy("zero2", 2)) == \
        PARAMS + (TRAINABLE + STATE) // 2 + stats
    assert rec.floor_bytes(facts, "bf16", par.Strategy("zero3", 2)) == full // 2 + stats


def _buffer_bytes(spec) -> int:
    """The Llama's own buffers (rotary inv_freq and its original copy)."""
    from oomdoctor.models.training import build_for_training
    from oomdoctor.sim.device import on_meta
    from oomdoctor.sim.stepping import unique_storages
    with on_meta():
        model, _ = build_for_training(spec, "bf16")
    return sum(t.untyped_storage().nbytes() for t in unique_storages(model.buffers()).values())


def _codebooks(spec) -> int:
    """bitsandbytes' 16-entry fp32 NF4 code table, one storage per quantized layer or shared:
    whichever the installed library does, counted from the built model."""
    from oomdoctor.models.adapters import named_quant_states
    from oomdoctor.models.training import build_for_training
    from oomdoctor.sim.device import on_meta
    from oomdoctor.sim.stepping import unique_storages
    with on_meta():
        model, _ = build_for_training(spec, "bf16")
    codes = [t for n, t in named_quant_states(model) if n.endswith(".code")]
    assert all(t.numel() == 16 for t in codes)
    return 64 * len(unique_storages(codes))


# -- a user's .to() in build_model ---------------------------------------------------------
CHANNELS_LAST = textwrap.dedent('''
    """The tests' U-Net as a user trains it on a GPU: weights and inputs in channels_last."""
    import torch
    from unet import SIZE, UNet, loss_fn  # noqa: F401

    def build_model():
        return UNet().to(memory_format=torch.channels_last)

    def make_batch(batch_size):
        x = torch.randn(batch_size, 3, SIZE, SIZE).to(memory_format=torch.channels_last)
        return x, torch.randint(0, 2, (batch_size, SIZE, SIZE))
''')


@pytest.mark.parametrize("command", ["parallel", "split", "recommend", "probe"])
def test_a_model_file_that_moves_its_model_plans_on_two_gpus(tmp_path, command):
    unet = Path(__file__).resolve().parent / "models" / "unet.py"
    (tmp_path / "unet.py").write_text(unet.read_text())
    model = tmp_path / "unet_channels_last.py"
    model.write_text(CHANNELS_LAST)
    argv = {"parallel": ["parallel", str(model), "--gpus", "2", "-b", "4"],
            "split": ["split", str(model), "--gpus", "2", "-b", "4"],
            "recommend": ["recommend", str(model), "--num-gpus", "2", "--target-batch", "16",
                          "--quick", "-j", "1", "--precision", "fp16"],
            "probe": ["probe", str(model), "--num-gpus", "2", "-j", "1", "--precision", "fp16",
                      "--target-batch", "16"]}[command]
    r = _run(*argv, "--gpu", "rtx3090")
    assert r.exit_code == EXIT_OK, r.output
    assert "swap" not in r.output and "error" not in r.output.lower()


def test_a_failed_multi_gpu_plan_never_hides_the_single_gpu_probe(monkeypatch):
    """probe on several GPUs ends with a plan; when that part fails, the finished single-GPU
    table is still printed, then the plan's error with its own exit code (not a verdict)."""
    from oomdoctor.cli import EXIT_INTERNAL
    from oomdoctor.plans import recommend as rec

    def broken(*args, **kwargs):
        raise RuntimeError("_apply(): Couldn't swap Linear.weight")
    monkeypatch.setattr(rec, "recommend", broken)
    mlp = str(Path(__file__).resolve().parent.parent / "sample_models" / "tiny_mlp.py")
    r = CliRunner().invoke(cli, ["probe", mlp, "--gpu", "rtx3090", "--num-gpus", "2", "-j", "1",
                                 "--precision", "fp32"])
    assert r.exit_code == EXIT_INTERNAL
    assert "max batch" in r.stdout and "recommended" in r.stdout
    assert "the 2-GPU plan could not be simulated (RuntimeError: _apply()" in r.stderr
    assert "single-GPU result above stands" in r.stderr


def test_the_adapters_hint_on_several_gpus_runs_as_printed(tmp_path):
    """Full fine-tuning fits nowhere, LoRA does not fit one card but fits the two under FSDP:
    the hint says so (it offered one card only), and the command it prints gives its figure."""
    import re
    import shlex

    from oomdoctor.cli import cli
    # 201M parameters, most in the blocks: sharding the frozen bf16 base saves more than FSDP
    # costs (its flat all-gather outputs and reduce outputs, each stream's own expandable
    # segment mapped in 20 MiB pages), which on LLAMA_26M's 52 MB base it does not
    d = config_folder(tmp_path, dict(LLAMA_26M, hidden_size=1024, intermediate_size=2816,
                                     num_hidden_layers=16))
    # a 400 MiB card: LoRA needs 442 MiB reserved on one, 322 MiB per GPU on two
    args = ["recommend", d, "--seq-len", "64", "--num-gpus", "2", "--memory", "400MiB",
            "--overhead", "0", "--json", "-j", "1"]
    r = CliRunner().invoke(cli, args)
    hint = next(a for a in json.loads(r.stdout)["alternatives"] if "adapters" in a)
    assert "fits the 2 under FSDP (zero3)" in hint, hint
    figure = float(re.search(r"([\d.]+) GiB on the fullest GPU", hint).group(1))
    printed = re.search(r"`oomdoctor (parallel [^`]*)`", hint).group(1)
    again = CliRunner().invoke(cli, [*shlex.split(printed), "--overhead", "0", "--json"])
    [e] = json.loads(again.stdout)["strategies"]
    assert round(e["gpus"][0]["device_peak_bytes"] / 2**30, 2) == figure


def test_the_one_card_adapters_hint_names_the_command_that_gives_its_figure(tmp_path):
    """The hint said LoRA "needs 12.1 GiB" where `estimate` of what it suggested said 12.72 GiB
    reserved (issue #32): it now names the estimate command of its own configuration
    (precision, checkpointing, micro-batch 1, the allocator setting), and that command prints
    the same figure."""
    import re
    import shlex

    from oomdoctor.cli import cli
    d = config_folder(tmp_path, LLAMA_26M)
    # a 150 MiB card: full fine-tuning (420 MB of fp32 states) fits nowhere, LoRA fits one
    r = CliRunner().invoke(cli, ["recommend", d, "--seq-len", "64", "--num-gpus", "2",
                                 "--memory", "150MiB", "--overhead", "0", "--json", "-j", "1"])
    hint = next(a for a in json.loads(r.stdout)["alternatives"] if "adapters" in a)
    assert "on one custom" in hint, hint
    figure = float(re.search(r"needs ([\d.]+) GiB reserved", hint).group(1))
    printed = re.search(r"`oomdoctor (estimate [^`]*)`", hint).group(1)
    again = CliRunner().invoke(cli, [*shlex.split(printed), "--overhead", "0", "--json"])
    assert round(json.loads(again.stdout)["peak_reserved_bytes"] / 2**30, 2) == figure
