"""Every printed plan runs as printed, and needs what it says on each GPU.

`recommend` prints a training loop and a launch line. Completed only with what the sketch leaves
to the user (``build_model``, ``dataset``, ``loss_fn``, ``epochs``, ``lr``: from a model file) and
run as its launch line says, with its environment, through oomdoctor's script source
(`oomdoctor estimate -- torchrun ...`), each plan must need its own per-GPU figure within 2%.

What this checks that the plans' own arithmetic cannot: the code. The script's run reads the
wrapping, the MixedPrecisionPolicy, the casts, checkpointing, the micro-batch, the accumulation
and the allocator setting from the printed lines, and DDP/ZeRO-1 in a script are estimated by a
separate route (DDP's buffers allocated in the run itself, sim.ddp) from the plans' replay.
"""
from __future__ import annotations

import json
import os
import shlex

import pytest
from click.testing import CliRunner

from oomdoctor.cli import cli

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "models", "plan_lm.py")
# What the sketch leaves to the user, from the model file.
PRELUDE = f"""import sys, torch
sys.path.insert(0, {os.path.dirname(MODEL)!r})
from plan_lm import build_model, make_batch, loss_fn
dataset = torch.utils.data.TensorDataset(*make_batch(256))
epochs, lr = 1, 1e-3
"""
TOLERANCE = 0.02


def _invoke(args, env=None):
    r = CliRunner().invoke(cli, args, env=env)
    assert r.exit_code in (0, 1), r.output[-2000:]
    return json.loads(r.stdout)


def _estimate_as_printed(launch: dict, tmp_path, card: list[str]) -> dict:
    """The plan's code as train.py, started by its launch line with its environment, through
    the script source: `estimate --json`'s document."""
    script = tmp_path / "train.py"
    script.write_text(PRELUDE + launch["snippet"] + "\n")
    words = shlex.split(launch["command"])
    words[words.index("train.py")] = str(script)
    return _invoke(["estimate", *card, "--json", "--", *words], env=launch["env"])


def _run_as_printed(launch: dict, tmp_path, card: list[str]) -> int:
    """Each GPU's peak (reserved + context) of the plan's code as the script source estimates
    it (the fullest, where the script spreads itself)."""
    doc = _estimate_as_printed(launch, tmp_path, card)
    if "strategies" in doc:        # the script spreads itself: a per-GPU report, the fullest
        return max(g["device_peak_bytes"] for g in doc["strategies"][0]["gpus"])
    return doc["peak_reserved_bytes"] + doc["breakdown"]["cuda_context"]


@pytest.mark.parametrize("strategy,precision,card", [
    ("single", "fp32", ["--gpu", "rtx3090"]),
    ("ddp", "bf16", ["--gpu", "rtx3090"]),
    ("ddp", "bf16-pure", ["--gpu", "rtx3090"]),
    ("zero1", "fp32", ["--gpu", "rtx3090"]),
    ("zero2", "fp32", ["--gpu", "rtx3090"]),
    ("zero3", "fp32", ["--gpu", "rtx3090"]),
    ("zero3", "bf16", ["--gpu", "rtx3090"]),            # FSDP2's MixedPrecisionPolicy
    ("zero3", "bf16", ["--memory", "1.2GiB"]),          # a small card: accumulation
    ("dp", "fp32", ["--gpu", "rtx3090"]),               # one process, DataParallel
    ("dp", "bf16", ["--memory", "1.2GiB"]),
    ("pipeline2", "fp32", ["--gpu", "rtx3090"]),        # one process, dispatch_model's split
    ("pipeline2", "bf16-pure", ["--memory", "1GiB"]),
])
def test_recommended_plan_runs_as_printed(strategy, precision, card, tmp_path):
    doc = _invoke(["recommend", MODEL, *card, "--num-gpus", "2", "--strategy", strategy,
                   "--precision", precision, "--target-batch", "64", "--json"])
    best = doc["best"]
    assert (best["strategy"], best["precision"]) == (strategy, precision)
    got = _run_as_printed(doc["launch"], tmp_path, card)
    assert abs(got - best["peak_device_bytes"]) <= TOLERANCE * best["peak_device_bytes"], \
        (got, best)


def test_the_hybrid_sharding_plan_runs_as_printed_on_node_0(tmp_path):
    """Two nodes of two GPUs, hybrid sharding (FSDP2 over a 2-D mesh, the bf16 policy): node
    0's torchrun line with the printed code needs the plan's per-GPU figure."""
    card = ["--gpu", "rtx3090"]
    doc = _invoke(["recommend", MODEL, *card, "--nodes", "2", "--num-gpus", "2", "--strategy",
                   "hsdp", "--precision", "bf16", "--target-batch", "64", "--json"])
    best = doc["best"]
    assert (best["strategy"], best["nodes"]) == ("hsdp", 2)
    assert doc["launch"]["command"] == doc["launch"]["node_commands"][0]
    got = _run_as_printed(doc["launch"], tmp_path, card)
    assert abs(got - best["peak_device_bytes"]) <= TOLERANCE * best["peak_device_bytes"], \
        (got, best)


@pytest.mark.parametrize("strategy,precision", [("zero3", "bf16"), ("ddp", "fp16")])
def test_checkpointed_plan_runs_as_printed(strategy, precision, tmp_path):
    """A checkpointed plan with accumulation (recommend prefers accumulation alone on this
    model): its code from the plan's launch, its figure as `parallel` computes the same
    configuration with the code's settings (DDP's gradient_as_bucket_view)."""
    from oomdoctor.models.loader import load_model_file
    from oomdoctor.plans import recommend as rec
    from oomdoctor.sim.gpus import get_profile
    c = rec.Candidate(strategy=strategy, num_gpus=2, precision=precision, checkpointing=True,
                      micro_batch=8, grad_accum=2, effective_batch=32, peak_device_bytes=0,
                      per_gpu_bytes=(0, 0), step_seconds=1.0, compute_seconds=1.0,
                      communication_seconds=0.0, samples_per_second=1.0, numerics="", score=1.0)
    hw = rec.Hardware(get_profile("rtx3090"), 2, "pcie-no-p2p", 12.5, cores=16)
    launch = rec._launch(c, hw, load_model_file(MODEL), rec._Facts(0, 0, 2, True, "layers"))
    card = ["--gpu", "rtx3090"]
    assert "gradient_as_bucket_view=True" in launch.snippet or strategy != "ddp"
    plan = _invoke(["parallel", MODEL, *card, "--strategy", strategy, "--num-gpus", "2",
                    "-b", "8", "--grad-accum", "2", "--precision", precision, "--checkpointing",
                    "--alloc-conf", launch.env["PYTORCH_CUDA_ALLOC_CONF"], "--bucket-view",
                    "--json"])
    want = plan["strategies"][0]["gpus"][0]["device_peak_bytes"]
    got = _run_as_printed({"snippet": launch.snippet, "command": launch.command,
                           "env": launch.env}, tmp_path, card)
    assert abs(got - want) <= TOLERANCE * want, (got, want)


# A Hugging Face model the way the LoRA/QLoRA plans load it: from_pretrained(MODEL_ID) of a
# folder with weights (a 3.7M-parameter Llama saved here with random bf16 weights, 7 MB).
HF_PRELUDE = """import torch
MODEL_ID = {folder!r}
dataset = torch.utils.data.TensorDataset(torch.randint(0, 1000, (64, 128)))
def loss_fn(model, batch):
    return model(input_ids=batch[0], labels=batch[0]).loss
epochs, lr = 1, 1e-4
"""


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    import torch
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688,
                                      num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=8, max_position_embeddings=512,
                                      tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16) \
        .save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("strategy,precision,adapters", [
    ("zero3", "bf16", ["--lora", "16"]),                 # FSDP2 + policy, checkpointed
    ("zero3", "bf16-pure", ["--lora", "16"]),
    ("ddp", "bf16", ["--lora", "16"]),
    ("single", "bf16", ["--lora", "16"]),
    ("single", "bf16", ["--lora", "16", "--quantize", "nf4", "--double-quant"]),
    ("ddp", "bf16", ["--lora", "16", "--quantize", "nf4"]),
    # FSDP-QLoRA: the 4-bit weights stored as bf16 and sharded by fully_shard
    ("zero3", "bf16", ["--lora", "16", "--quantize", "nf4"]),
    ("zero3", "bf16", ["--lora", "16", "--quantize", "nf4", "--double-quant"]),
    # pure bf16: nothing upcast - the printed code called prepare_model_for_kbit_training,
    # which casts the embeddings, norms and head to fp32 (+8.4% over the plan under FSDP)
    ("zero3", "bf16-pure", ["--lora", "16", "--quantize", "nf4"]),
    ("single", "bf16-pure", ["--lora", "16", "--quantize", "nf4"]),
])
def test_adapter_plan_runs_as_printed(saved_llama, strategy, precision, adapters, tmp_path):
    """The LoRA/QLoRA plans' code (from_pretrained, BitsAndBytesConfig, peft, fully_shard of
    the base model's blocks) run by their launch lines: each needs its plan's figure. Running
    them found three faults in the printed code or the plan: FSDP's loop reached for
    `model.model.layers` on the PeftModel (an AttributeError), the model stayed in the eval
    mode from_pretrained leaves it in (no checkpointing: 6.6% over the plan), and the plan's
    own check traced without the KV cache because an earlier checkpointed trace had switched
    it off in a shared config (3.4% under the code). Under FSDP the run needed bitsandbytes'
    quantization statistics labelled as the layout counts them (a codebook made outside the
    dispatcher is not seen: 64 bytes each), and the pure-bf16 QLoRA code upcast what the plan
    keeps 16-bit (+8.4% under FSDP). Measured: 0.00% but QLoRA on one GPU (+0.34%, pure bf16
    +0.36%) and FSDP-QLoRA without double quantization (+0.40%).
    pytest tests/test_plan_scripts.py -k adapter"""
    pytest.importorskip("peft")
    if "--quantize" in adapters:
        pytest.importorskip("bitsandbytes")
    card = ["--gpu", "rtx3090"]
    doc = _invoke(["recommend", saved_llama, "--seq-len", "128", *card, "--num-gpus", "2",
                   *adapters, "--strategy", strategy, "--precision", precision,
                   "--target-batch", "16", "--json", "-j", "1"])
    best = doc["best"]
    assert (best["strategy"], best["precision"]) == (strategy, precision)
    launch = doc["launch"]
    script = tmp_path / "train.py"
    script.write_text(HF_PRELUDE.format(folder=saved_llama) + launch["snippet"] + "\n")
    words = shlex.split(launch["command"])
    words[words.index("train.py")] = str(script)
    got = _invoke(["estimate", *card, "--json", "--", *words], env=launch["env"])
    got = (got["strategies"][0]["gpus"][0]["device_peak_bytes"] if "strategies" in got
           else got["peak_reserved_bytes"] + got["breakdown"]["cuda_context"])
    assert abs(got - best["peak_device_bytes"]) <= TOLERANCE * best["peak_device_bytes"], \
        (got, best)



@pytest.fixture(scope="module", params=[1, 2], ids=["1-node", "2-nodes"])
def offload_plans(request):
    """Nothing fits two 0.5 GiB cards (on each of one or two nodes), so recommend prints its
    CPU offload plans."""
    doc = _invoke(["recommend", MODEL, "--memory", "0.5GiB", "--num-gpus", "2", "--nodes",
                   str(request.param), "--target-batch", "8", "--json"])
    assert doc["best"] is None
    return {o["name"]: o for o in doc["offload"]}


@pytest.mark.parametrize("name", ["zero2-offload", "zero3-offload", "zero3-offload-all",
                                  "fsdp-offload"])
def test_offload_plan_runs_as_printed(offload_plans, name, tmp_path, deepspeed_importable):
    """Each CPU offload plan's code (DeepSpeed's engine with the config inline, or FSDP2 with
    CPUOffloadPolicy) run by its launch line (on two nodes, one node's: DeepSpeed's hostfile
    launch, torchrun's rendezvous) needs the plan's per-GPU figure: the script's run reads the
    ZeRO stage, the offload, the 16-bit mode, the accumulation and the checkpointing from the
    printed lines. Where DeepSpeed is not installed, the stand-in package gives the import.
    Measured: 0.00% for all eight."""
    plan = offload_plans[name]
    assert plan["gpu_replayed_bytes"] is not None
    doc = _estimate_as_printed({"snippet": plan["sketch"], "command": plan["launch"].split("#")[0],
                                "env": plan["env"]}, tmp_path, ["--memory", "0.5GiB"])
    [strategy] = doc["strategies"]
    got = max(g["device_peak_bytes"] for g in strategy["gpus"])
    want = plan["gpu_replayed_bytes"]
    assert abs(got - want) <= TOLERANCE * want, (got, want)
    # the plan's verdict is the estimate's (reserved against the budget, not the device peak)
    assert plan["fits_gpu"] == strategy["fits"]


def test_the_split_plans_device_map_is_one_accelerate_takes():
    """The split plan prints its device map; accelerate's own check (every parameter and
    buffer of the real model placed exactly once) accepts it for the model built on the CPU."""
    import torch
    from accelerate.utils.modeling import check_device_map

    from oomdoctor.models.loader import load_model_file
    doc = _invoke(["recommend", MODEL, "--memory", "1GiB", "--num-gpus", "2", "--strategy",
                   "pipeline2", "--precision", "bf16-pure", "--target-batch", "64", "--json"])
    line = next(x for x in doc["launch"]["snippet"].splitlines() if x.startswith("device_map ="))
    device_map = eval(line.split("=", 1)[1])                    # noqa: S307 - our own literal
    assert sorted(set(device_map.values())) == [0, 1]
    with torch.device("cpu"):
        model = load_model_file(MODEL).build_model()
    check_device_map(model, device_map)
