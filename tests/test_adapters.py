"""LoRA and QLoRA (oomdoctor.models.adapters) against independent numbers.

- Real CPU runs: the same model adapted by a plain script with peft and bitsandbytes on real
  tensors (the way a user's training script does it), measured by torch.profiler.
- bitsandbytes' storage layout, computed here from its documented format: 4-bit weights packed
  two per byte, one fp32 absmax per block of 64, or with double quantization one uint8 per
  block plus fp32 statistics per 256 blocks.
- peft's own count of trainable parameters.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
import peft  # noqa: E402

from click.testing import CliRunner  # noqa: E402

from oomdoctor.models.adapters import Adapters  # noqa: E402
from oomdoctor.cli import cli  # noqa: E402
from oomdoctor.models.loader import load_model  # noqa: E402
from oomdoctor.sim.trace import TraceConfig, trace_training  # noqa: E402
from published_peft import RUNS, command, write_config  # noqa: E402
from reference import _profiled_peak, load  # noqa: E402

HERE = os.path.dirname(__file__)
MLP = os.path.join(HERE, "models", "lora_mlp.py")
TARGETS = ("up", "mid", "head")

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
         "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 8, "vocab_size": 1000, "max_position_embeddings": 2048}


def _real_cpu_peak(quant: str | None, double_quant: bool, dropout: float, batch: int) -> int:
    """A user's QLoRA script on real CPU tensors: swap the hidden layers for Linear4bit (moving
    them to the device quantizes), prepare_model_for_kbit_training, get_peft_model, two AdamW
    steps. The quantization statistics are counted like the parameters (allocated before)."""
    mod = load(MLP)
    torch.manual_seed(0)
    model = mod.build_model().train()
    if quant:
        for name in ("up", "mid"):     # the head holds the last parameter: kept, as in transformers
            lin = getattr(model, name)
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, compute_dtype=torch.float32,
                                  compress_statistics=double_quant, quant_type=quant)
            q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False,
                                         compress_statistics=double_quant, quant_type=quant)
            q.bias = lin.bias
            setattr(model, name, q.to("cpu"))
        model.is_loaded_in_4bit = True
        peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=list(TARGETS),
                                                       lora_dropout=dropout))
    stats = {}
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        while qs is not None:
            for t in (qs.absmax, qs.code, qs.offset):
                if isinstance(t, torch.Tensor):
                    stats[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            qs = qs.state2 if qs.nested else None
    opt = mod.make_optimizer(model.parameters())

    def run():
        for _ in range(2):
            loss = mod.loss_fn(model, mod.make_batch(batch))
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    return _profiled_peak(model, run) + sum(stats.values())


@pytest.mark.parametrize("quant,double_quant,dropout", [
    (None, False, 0.1),          # LoRA: fake CPU tensors, so dropout keeps the CPU's float mask
    ("nf4", False, 0.0),         # QLoRA: traced on meta with the CUDA emulation
    ("nf4", True, 0.0),
    ("fp4", False, 0.0),
])
def test_peak_matches_a_real_cpu_run(quant, double_quant, dropout):
    # 20 x 32 = 640 tokens: past 512 rows, where CUDA's 4-bit matmul dequantizes the weight
    # as the CPU build always does, so the CPU run is the reference for that too.
    real = _real_cpu_peak(quant, double_quant, dropout, batch=20)
    spec = load_model(MLP, adapters=Adapters(lora_rank=4, lora_targets=TARGETS, quantize=quant,
                                             double_quant=double_quant, lora_dropout=dropout))
    fake_cpu = quant is None
    trace = trace_training(spec, TraceConfig(batch_size=20, emulate_cuda=not fake_cpu),
                           backend="fake" if fake_cpu else "auto")
    assert trace.peak_live_bytes == pytest.approx(real, rel=0.005)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    (d / "config.json").write_text(json.dumps(LLAMA))
    return str(d)


def _linear_numels() -> tuple[list[int], int]:
    """The tiny LLaMA's linear weights (q, k, v, o, gate, up, down per layer) and what stays
    unquantized (embeddings, lm_head, norms)."""
    h, i, n = LLAMA["hidden_size"], LLAMA["intermediate_size"], LLAMA["num_hidden_layers"]
    per_layer = [h * h] * 4 + [h * i] * 3
    rest = 2 * LLAMA["vocab_size"] * h + (2 * n + 1) * h
    return per_layer * n, rest


@pytest.mark.parametrize("double_quant", [False, True])
def test_qlora_storage_is_bitsandbytes_layout(llama_dir, double_quant):
    spec = load_model(llama_dir, seq_len=64, adapters=Adapters(
        lora_rank=8, quantize="nf4", double_quant=double_quant))
    bf16 = trace_training(spec, TraceConfig(batch_size=1, precision="bf16", steps=1))
    pure = trace_training(spec, TraceConfig(batch_size=1, precision="bf16-pure", steps=1))
    linears, rest = _linear_numels()
    h, layers = LLAMA["hidden_size"], LLAMA["num_hidden_layers"]
    lora = layers * 2 * (h * 8 + 8 * h)          # peft's default targets for llama: q_proj, v_proj
    packed = sum(math.ceil(n / 2) for n in linears)
    # AMP: prepare_model_for_kbit_training upcasts what is not 4-bit to fp32; pure bf16 keeps it.
    assert bf16.parameter_bytes == packed + 4 * rest + 4 * lora
    assert pure.parameter_bytes == packed + 2 * rest + 4 * lora
    blocks = [math.ceil(n / 64) for n in linears]
    nf4_code = 16 * 4                             # the 16-value NF4 codebook, fp32, per layer
    if double_quant:   # uint8 absmax, fp32 absmax per 256 blocks, fp32 offset, 256-entry map
        stats = sum(b + 4 * math.ceil(b / 256) + 4 + nf4_code + 256 * 4 for b in blocks)
    else:
        stats = sum(4 * b + nf4_code for b in blocks)
    base = trace_training(load_model(llama_dir, seq_len=64),
                          TraceConfig(batch_size=1, precision="bf16-pure", steps=1))
    assert pure.buffer_bytes - base.buffer_bytes == stats
    # Parameters as the layer has them (not packed bytes); trainable ones as peft counts them.
    assert pure.num_parameters == sum(linears) + rest + lora
    assert pure.num_trainable_parameters == lora


def test_trainable_parameters_are_pefts_own_count(llama_dir):
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama_dir))
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules="all-linear"))
    trainable, total = model.get_nb_trainable_parameters()
    spec = load_model(llama_dir, seq_len=64, adapters=Adapters(
        lora_rank=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj")))
    trace = trace_training(spec, TraceConfig(batch_size=1, precision="bf16", steps=1))
    assert trace.num_trainable_parameters == trainable
    assert trace.num_parameters == total
    assert trace.gradient_bytes == 4 * trainable          # fp32 adapters (peft's autocast dtype)
    assert trace.optimizer_state_bytes == pytest.approx(8 * trainable, abs=4 * 64)


def test_cuda_dequantizes_the_weight_past_512_tokens(llama_dir):
    """bitsandbytes' CUDA dispatch: the custom 4-bit kernel up to 512 rows, dequantize + dense
    matmul past that; the dequantized bf16 copy of the largest weight (688 x 256) shows up."""
    spec = load_model(llama_dir, seq_len=256, adapters=Adapters(lora_rank=8, quantize="nf4"))
    weight = LLAMA["intermediate_size"] * LLAMA["hidden_size"] * 2

    def dequantized(batch):
        t = trace_training(spec, TraceConfig(batch_size=batch, precision="bf16", steps=1))
        return sum(1 for s in t.storages.values()
                   if s.nbytes == weight and s.phase.name == "FORWARD")
    assert dequantized(2) == 0                    # 512 tokens: the custom kernel
    assert dequantized(4) == 3 * LLAMA["num_hidden_layers"]   # gate, up, down per layer


def test_lora_saves_what_full_fine_tuning_spends(llama_dir):
    """Gradients and AdamW state exist only for the adapters."""
    full = trace_training(load_model(llama_dir, seq_len=128),
                          TraceConfig(batch_size=1, precision="bf16", steps=1))
    lora = trace_training(load_model(llama_dir, seq_len=128, adapters=Adapters(lora_rank=8)),
                          TraceConfig(batch_size=1, precision="bf16", steps=1))
    assert full.gradient_bytes == full.parameter_bytes
    assert lora.gradient_bytes < full.gradient_bytes / 50
    # The frozen base is 16-bit under AMP, as LoRA recipes load it.
    assert lora.parameter_bytes - lora.gradient_bytes == full.parameter_bytes // 2


def test_cli_lora_and_qlora(llama_dir):
    r = CliRunner().invoke(cli, ["estimate", llama_dir, "-b", "1", "--seq-len", "128",
                                  "--precision", "bf16", "--lora", "8", "--quantize", "nf4",
                                  "--double-quant", "--json"])
    assert r.exit_code in (0, 1), r.output
    out = json.loads(r.stdout)
    assert "QLoRA r8 (nf4+dq)" in out["model"]
    assert any("stored as bitsandbytes nf4 with double quantization" in n for n in out["notes"])
    assert any(n.startswith("LoRA r=8 on q_proj, v_proj") for n in out["notes"])
    import oomdoctor               # the Python API takes the same options
    api = oomdoctor.estimate(llama_dir, 1, seq_len=128, precision="bf16", gpu="rtx3090",
                             lora=8, quantize="nf4")
    r = CliRunner().invoke(cli, ["estimate", llama_dir, "-b", "1", "--seq-len", "128",
                                 "--precision", "bf16", "--lora", "8", "--quantize", "nf4",
                                 "--gpu", "rtx3090", "--json"])
    assert api.peak_reserved_bytes == json.loads(r.stdout)["peak_reserved_bytes"]

    r = CliRunner().invoke(cli, ["estimate", llama_dir, "-b", "1", "--quantize", "nf4"])
    assert r.exit_code == 2 and "add --lora RANK" in r.output
    r = CliRunner().invoke(cli, ["estimate", llama_dir, "-b", "1", "--lora", "4",
                                  "--lora-targets", "nothere", "--gpu", "rtx3090"])
    assert r.exit_code == 3
    assert "--lora-targets" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_check_case_can_train_qlora(llama_dir, tmp_path):
    cfg = tmp_path / "setup.cfg"
    cfg.write_text(f"[oomdoctor]\nbaseline = base.json\n\n[oomdoctor:qlora]\nmodel = {llama_dir}\n"
                   "seq_len = 64\nbatch_size = 2\nprecision = bf16\nlora = 8\nquantize = nf4\n"
                   "\n[oomdoctor:bad]\nmodel = x\nbatch_size = 1\nquantize = nf4\n")
    r = CliRunner().invoke(cli, ["check", "--config", str(cfg), "--update", "-j", "1"])
    assert r.exit_code == 2 and "need lora = RANK" in r.output
    cfg.write_text(cfg.read_text().split("\n[oomdoctor:bad]")[0])
    r = CliRunner().invoke(cli, ["check", "--config", str(cfg), "--update", "--json", "-j", "1"])
    assert r.exit_code == 0, r.output
    row = json.loads(r.stdout)["cases"][0]
    e = CliRunner().invoke(cli, ["estimate", llama_dir, "--seq-len", "64", "-b", "2",
                                 "--precision", "bf16", "--gpu", "rtx3090", "--lora", "8",
                                 "--quantize", "nf4", "--json"])
    assert row["now_reserved"] == json.loads(e.stdout)["peak_reserved_bytes"]
    config = json.loads((tmp_path / "base.json").read_text())["cases"]["qlora"]["config"]
    assert (config["lora"], config["quantize"]) == (8, "nf4") and "lora_targets" not in config


def test_smoke_processes_train_the_adapters():
    """Each DDP rank rebuilds the model with its LoRA: step 2's loss is LoRA's (lora_B starts
    at zero, so the first update barely moves it), not full fine-tuning's."""
    def losses(*extra):
        r = CliRunner().invoke(cli, ["smoke", MLP, *extra, "--gpus", "2", "--strategy", "ddp",
                                     "-b", "8", "--steps", "2", "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["losses"]
    full, lora = losses(), losses("--lora", "4")
    assert full[0] == pytest.approx(lora[0])
    assert abs(lora[1] - lora[0]) < abs(full[1] - full[0]) / 10


def test_checkpointing_wraps_the_layers_not_peft_adapters(llama_dir):
    """peft's LoRA layers contain modules but wrap one Linear each: the blocks to checkpoint
    stay the decoder layers, even with every linear layer adapted."""
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    spec = load_model(llama_dir, seq_len=64, adapters=Adapters(lora_rank=8, lora_targets=targets))
    trace = trace_training(spec, TraceConfig(batch_size=1, precision="bf16", steps=1,
                                             checkpointing=True))
    assert len(trace.checkpointed) == LLAMA["num_hidden_layers"]
    assert all(n.endswith(f"layers.{i}") for i, n in enumerate(trace.checkpointed))


@pytest.mark.parametrize("run", [r for r in RUNS if r.batch in (1, 4)], ids=lambda r: r.name)
def test_published_lora_and_qlora_runs(run, tmp_path):
    """fms-acceleration's A100 measurements of Mistral-7B LoRA / QLoRA at 4 x 4096 tokens
    (tests/published_peft.py; batch 8 in benchmarks/published_peft.py): LoRA -4.2%, QLoRA
    +1.7%. The runs used transformers 4.48 with flash-attention 2 and TRL, this trace the
    installed transformers with SDPA's flash kernel. lit-gpt's Llama-2-7B LoRA at 1 x 1304
    tokens: +0.03% (micro-batch 2, in the benchmark: -0.4%)."""
    folder = write_config(str(tmp_path), run)
    r = CliRunner().invoke(cli, command(run, folder))
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["peak_allocated_bytes"]
    assert got == pytest.approx(run.published_bytes, rel=0.05), (
        f"{run.name}: {got / 1e9:.2f} GB vs published {run.published_bytes / 1e9:.2f} GB")


def test_probe_offers_adapters_when_nothing_fits():
    tiny = os.path.join(HERE, "..", "sample_models", "tiny_mlp.py")
    args = ["probe", tiny, "--memory", "3MiB", "--overhead", "0", "--precision", "fp32",
            "--no-checkpointing", "-j", "1"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 1 and "probe it again with --lora 16" in r.stdout
    r = CliRunner().invoke(cli, args + ["--lora", "4"])
    assert r.exit_code == 1 and "--lora 16" not in r.stdout      # it already trains adapters


def test_int8_storage_is_bitsandbytes_layout(llama_dir):
    """load_in_8bit: one int8 byte per weight and one fp32 scale (SCB) per output row; what is
    not quantized is upcast to fp32 by prepare_model_for_kbit_training under AMP."""
    spec = load_model(llama_dir, seq_len=64, adapters=Adapters(lora_rank=8, quantize="int8"))
    trace = trace_training(spec, TraceConfig(batch_size=1, precision="bf16", steps=1))
    linears, rest = _linear_numels()
    h, i, layers = (LLAMA[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers"))
    lora = layers * 2 * (h * 8 + 8 * h)
    assert trace.parameter_bytes == sum(linears) + 4 * rest + 4 * lora
    rows = layers * (4 * h + 2 * i + h)            # q, k, v, o and down: h rows; gate, up: i
    base = trace_training(load_model(llama_dir, seq_len=64),
                          TraceConfig(batch_size=1, precision="bf16", steps=1))
    assert trace.buffer_bytes - base.buffer_bytes == 4 * rows
    assert trace.num_trainable_parameters == lora
    assert trace.gradient_bytes == 4 * lora


def test_int8_ops_give_what_the_library_kernels_give():
    """The emulated CUDA int8 ops return what bitsandbytes' own kernels return on real CPU
    tensors (shapes and dtypes; outlier columns: none when no |x| reaches the threshold)."""
    from oomdoctor.models.adapters import int8_as_cuda
    torch.manual_seed(0)
    a = (torch.rand(48, 64) - 0.5).to(torch.float16)       # |x| < 6: no outliers
    cb, scb, _ = torch.ops.bitsandbytes.int8_vectorwise_quant(torch.randn(32, 64).half())
    real_q = torch.ops.bitsandbytes.int8_vectorwise_quant(a, 6.0)
    real_mm = torch.ops.bitsandbytes.int8_mixed_scaled_mm(a.float(), real_q[0], cb, real_q[1],
                                                           scb, real_q[2], None)
    meta = {k: v.to("meta") for k, v in dict(a=a, cb=cb, scb=scb).items()}
    emu_q = int8_as_cuda("int8_vectorwise_quant.default", (meta["a"], 6.0), {})
    emu_mm = int8_as_cuda("int8_mixed_scaled_mm", (meta["a"].float(), emu_q[0], meta["cb"],
                                                   emu_q[1], meta["scb"], emu_q[2], None), {})
    for real, emu in zip((*real_q, *real_mm), (*emu_q, *emu_mm)):
        assert (real.shape, real.dtype) == (emu.shape, emu.dtype)


def test_int8_backward_dequantizes_each_weight(llama_dir):
    """MatMul8bitLt's backward rebuilds the weight in the input's dtype (CB.to(dtype_A) *
    SCB / 127) before the grad-input matmul: one weight-sized temporary per quantized layer."""
    spec = load_model(llama_dir, seq_len=64, adapters=Adapters(lora_rank=8, quantize="int8"))
    t = trace_training(spec, TraceConfig(batch_size=3, precision="bf16", steps=1))
    h, i, layers = (LLAMA[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers"))
    copies = [s for s in t.storages.values() if s.phase.name == "BACKWARD"
              and s.nbytes in (4 * h * i, 2 * h * i) and s.op == "_to_copy.default"]
    assert len(copies) == 3 * layers                # gate, up, down in every layer


def test_int8_options():
    with pytest.raises(ValueError, match="--double-quant applies to 4-bit"):
        Adapters(lora_rank=8, quantize="int8", double_quant=True)
    assert Adapters(lora_rank=8, quantize="int8").label == " + LoRA r8 (int8 base)"


def test_the_lora_shortfall_is_transformers_448s_loss_copy(tmp_path):
    """fms-acceleration ran transformers 4.48, whose ``ForCausalLMLoss`` upcasts the logits and
    then copies the shifted ones (``logits[..., :-1, :].contiguous()``): one more fp32
    tokens x vocabulary tensor while the loss is computed. The installed transformers pads the
    labels instead and makes no such copy, so the trace, which follows the installed library,
    is -4.2% on that run. Added at the forward's peak (an exact size from 4.48's source), the
    trace gives the published 26.70 GB within 0.5%."""
    from oomdoctor.sim.trace import Phase
    run = next(r for r in RUNS if r.name == "standard-peft b4")
    spec = load_model(write_config(str(tmp_path), run), seq_len=4096, adapters=Adapters(
        16, ("q_proj", "k_proj", "v_proj", "o_proj"), lora_dropout=0.1))
    trace = trace_training(spec, TraceConfig(4, precision="bf16-pure", checkpointing=True))
    live = forward_peak = 0
    phases = iter(trace.marks)
    mark, phase = next(phases), None
    for i, (alloc, _, nbytes) in enumerate(trace.events):
        while mark is not None and mark.start <= i:
            phase, mark = mark.phase, next(phases, None)
        live += nbytes if alloc else -nbytes
        if phase is Phase.FORWARD:
            forward_peak = max(forward_peak, live)
    shifted_fp32_logits = 4 * 4096 * 32000 * 4
    with_copy = max(trace.peak_live_bytes, forward_peak + shifted_fp32_logits)
    assert with_copy == pytest.approx(run.published_bytes, rel=0.005)


def test_a_missing_library_and_a_broken_one_get_different_fixes():
    from oomdoctor.models.adapters import missing_library
    gone = missing_library("no_such_module_oomdoctor", "--lora", ImportError("x"))
    assert "not installed" in gone and "pip install 'oomdoctor[peft]'" in gone
    # and the README's way, from a clone (issue #24: the hint named only the PyPI form)
    assert "pip install -e '.[peft]'" in gone
    # installed but failing inside its own imports (peft -> transformers -> a torchvision built
    # for another torch): installing the extra again would not help
    broken = missing_library("json", "--lora", ImportError("operator torchvision::nms does "
                                                           "not exist\nmore"))
    assert "installed but does not import (operator torchvision::nms does not exist)" in broken
    assert "pip install" not in broken
