"""A training script as it is (`oomdoctor estimate -- python train.py ARGS`).

The independent check is the model file: the same network, batch, loss and optimizer written in
oomdoctor's model-file protocol is traced by the model-file loop, which these scripts never use.
A script's run must give that trace's peak (tests/scripts/loop.py wraps the sample models in a
plain loop; hf_trainer_clm.py is a Hugging Face Trainer script checked against the HF config
source). The rest checks what only a script has: its own data pipeline, its arguments, its
failures.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from oomdoctor.models.loader import load_model
from oomdoctor.models.script import is_command, parse_command
from oomdoctor.models.spec import ModelFileError
from oomdoctor.plans.estimate import Budget, estimate, estimate_script, script_trace
from oomdoctor.sim.gpus import get_profile
from oomdoctor.sim.recorder import Category
from oomdoctor.sim.script import ScriptError, ScriptLimits, trace_script
from oomdoctor.sim.fakecuda import FakeGpu
from oomdoctor.sim.trace import TraceConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
BUDGET = Budget(get_profile("a100-80"))
MiB = 2**20


def _script(name, *args):
    return parse_command(["python", os.path.join(SCRIPTS, name), *map(str, args)])


def _close(script_value, file_value, share=0.005, slack=0):
    return abs(script_value - file_value) <= share * file_value + slack


@pytest.mark.parametrize("model,batch,amp,accum", [
    ("tiny_mlp", 64, "none", 1), ("tiny_mlp", 64, "fp16", 1), ("tiny_mlp", 64, "bf16", 2),
    ("gpt2_small", 2, "bf16", 2), ("resnet_cnn", 8, "none", 1), ("bert_base", 2, "fp16", 1),
    ("lora_gpt", 2, "bf16", 1),
])
def test_a_plain_loop_gives_the_model_files_peak(model, batch, amp, accum):
    path = os.path.join(ROOT, "sample_models", f"{model}.py")
    run = estimate_script(_script("loop.py", "--model", path, "--batch-size", batch,
                                  "--amp", amp, "--accum", accum), TraceConfig(1), BUDGET)
    precision = {"none": "fp32"}.get(amp, amp)
    ref = estimate(load_model(path), TraceConfig(batch, precision, grad_accum=accum), BUDGET)
    assert run.precision == precision
    assert _close(run.peak_allocated_bytes, ref.peak_allocated_bytes), \
        (run.peak_allocated_bytes, ref.peak_allocated_bytes)
    assert _close(run.peak_reserved_bytes, ref.peak_reserved_bytes)
    assert (run.parameter_bytes, run.optimizer_state_bytes) == (ref.parameter_bytes,
                                                                ref.optimizer_state_bytes)
    assert run.peak_phase == ref.peak_phase


@pytest.fixture(scope="module")
def tiny_gpt2_config(tmp_path_factory):
    """The HF Trainer script's model as a config folder, for the HF source (the Trainer turns
    the KV cache off in training, TrainingArguments.use_cache; so does this config)."""
    from transformers import GPT2Config
    folder = tmp_path_factory.mktemp("gpt2-tiny")
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=128,
                        use_cache=False, architectures=["GPT2LMHeadModel"])
    config.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("batch,bf16,checkpointing", [(2, False, False), (4, True, True)])
def test_an_hf_trainer_script_gives_the_hf_sources_peak(tiny_gpt2_config, batch, bf16,
                                                        checkpointing):
    pytest.importorskip("transformers")
    args = ["--per_device_train_batch_size", batch, "--fixed_length", 64]
    args += ["--bf16"] * bf16 + ["--gradient_checkpointing"] * checkpointing
    run = estimate_script(_script("hf_trainer_clm.py", *args), TraceConfig(1), BUDGET)
    ref = estimate(load_model(tiny_gpt2_config, seq_len=64),
                   TraceConfig(batch, "bf16" if bf16 else "fp32", checkpointing), BUDGET)
    assert run.batch_size == batch
    assert _close(run.peak_allocated_bytes, ref.peak_allocated_bytes)
    # reserved: within 0.5% or one 2 MiB block (small models' segments are that coarse)
    assert _close(run.peak_reserved_bytes, ref.peak_reserved_bytes, slack=2 * MiB)


def test_the_data_pipeline_runs_for_real():
    """The padding collator's real batches reach the GPU: each batch's input copy is
    (B, longest in that batch) int64, as the data makes them - the two traced steps' and the
    third's, which the loop loads before the forward where the run stops."""
    sys.path.insert(0, SCRIPTS)
    try:
        import pad_loop
    finally:
        sys.path.remove(SCRIPTS)
    batch = 4
    lengths = pad_loop.lengths(64)
    expected = [batch * max(lengths[i:i + batch]) * 8 for i in (0, batch, 2 * batch)]
    trace = script_trace(_script("pad_loop.py", "--bs", "{batch}"), TraceConfig(1), BUDGET,
                         batch_size=batch)
    inputs = [s.nbytes for s in sorted(trace.storages.values(), key=lambda s: s.t_alloc)
              if s.category is Category.INPUTS and s.nbytes > batch * 8]
    assert inputs == expected


def test_batch_size_reaches_the_dataloader_and_the_placeholder():
    by_loader = estimate_script(_script("mlp_loop.py"), TraceConfig(1), BUDGET, batch_size=96)
    by_argument = estimate_script(_script("mlp_loop.py", "--batch-size", 96), TraceConfig(1),
                                  BUDGET)
    own = estimate_script(_script("mlp_loop.py"), TraceConfig(1), BUDGET)
    assert by_loader.batch_size == by_argument.batch_size == 96 and own.batch_size == 32
    assert by_loader.peak_allocated_bytes == by_argument.peak_allocated_bytes
    assert own.peak_allocated_bytes < by_loader.peak_allocated_bytes


def test_the_script_sees_the_chosen_card(tmp_path):
    """torch.cuda answers as --gpu says; memory_allocated follows the simulation."""
    out = tmp_path / "seen.json"
    script = tmp_path / "ask.py"
    script.write_text(
        "import json, sys, torch\n"
        "p = torch.cuda.get_device_properties(0)\n"
        "m = torch.nn.Linear(1024, 1024).cuda()\n"
        "seen = dict(available=torch.cuda.is_available(), count=torch.cuda.device_count(),\n"
        "            name=p.name, total=p.total_memory, bf16=torch.cuda.is_bf16_supported(),\n"
        "            allocated=torch.cuda.memory_allocated())\n"
        "json.dump(seen, open(sys.argv[1], 'w'))\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    m(torch.randn(8, 1024).cuda()).sum().backward(); opt.step(); opt.zero_grad()\n")
    gpu = get_profile("rtx3090")
    trace_script(parse_command(["python", str(script), str(out)]), TraceConfig(1),
                 FakeGpu(gpu.name, gpu.total_bytes, gpu.compute_capability, count=2))
    seen = json.loads(out.read_text())
    assert seen == {"available": True, "count": 2, "name": "rtx3090", "total": gpu.total_bytes,
                    "bf16": True, "allocated": 1024 * 1024 * 4 + 1024 * 4}


def _write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def test_a_script_without_a_step_and_one_that_fails_say_where(tmp_path):
    never = _write(tmp_path, "infer.py", "import torch\nm = torch.nn.Linear(4, 4).cuda()\n"
                   "while True:\n    m(torch.randn(2, 4).cuda())\n")
    with pytest.raises(ScriptError, match=r"3 forward passes without an optimizer step "
                                          r"\(the script was at infer.py:4\)"):
        trace_script(parse_command(["python", never]), TraceConfig(1),
                     FakeGpu("x", 2**30, (8, 0)), limits=ScriptLimits(forwards=3))
    ends = _write(tmp_path, "ends.py", "import torch\nprint(torch.cuda.is_available())\n")
    with pytest.raises(ScriptError, match="ended without an optimizer step"):
        trace_script(parse_command(["python", ends]), TraceConfig(1), FakeGpu("x", 2**30, (8, 0)))
    fails = _write(tmp_path, "fails.py", "import torch\n\n\ndef main():\n"
                   "    raise RuntimeError('no data in /data/train')\n\n\nmain()\n")
    with pytest.raises(ScriptError, match=r"fails.py:5 .*RuntimeError: no data in /data/train"):
        trace_script(parse_command(["python", fails]), TraceConfig(1), FakeGpu("x", 2**30, (8, 0)))


def test_command_lines():
    loop = os.path.join(SCRIPTS, "loop.py")
    assert not is_command(["sample_models/tiny_mlp.py"]) and is_command(["python", loop])
    s = parse_command(["torchrun", "--nproc_per_node", "2", "--master-port=29501", loop, "--x"])
    assert (s.path, s.args, s.processes, s.launcher) == (loop, ("--x",), 2, "torchrun")
    s = parse_command(["accelerate", "launch", "--num_processes=4", loop])
    assert (s.path, s.processes) == (loop, 4)
    s = parse_command(["python3", "-u", loop, "--bs", "{batch}", "--len={seq}"])
    assert s.placeholders == {"batch", "seq"}
    assert s.argv(8, 512) == [loop, "--bs", "8", "--len=512"]
    with pytest.raises(ModelFileError, match="pass --seq-len"):
        s.argv(8, None)
    with pytest.raises(ModelFileError, match="no such Python script"):
        parse_command(["python", "missing.py"])


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "oomdoctor", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_cli_json_stays_clean_and_errors_are_one_line(tmp_path):
    """The script prints every step; --json on stdout still parses. A failing script exits 3
    with one line; a model-file option exits 2."""
    r = _cli("estimate", "--gpu", "rtx3090", "--json", "--", "python",
             "tests/scripts/mlp_loop.py", "--batch-size", "16")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["batch_size"] == 16 and doc["model"] == "mlp_loop.py"
    assert "loss" in r.stderr                       # the script's own print, kept off stdout
    fails = _write(tmp_path, "fails.py", "import torch\nx = torch.ones(3).cuda()\n"
                   "torch.nonzero(x)\n")
    r = _cli("estimate", "--gpu", "rtx3090", "--", "python", fails)
    assert r.returncode == 3
    assert r.stderr.count("\n") == 1 and "fails.py:3" in r.stderr and "nonzero" in r.stderr
    r = _cli("estimate", "--gpu", "rtx3090", "--precision", "bf16", "--", "python",
             "tests/scripts/mlp_loop.py")
    assert r.returncode == 2 and "its autocast" in r.stderr


def test_a_random_mix_of_script_arguments_matches_the_model_file():
    """One more draw of the equivalence, on arguments nobody picked by hand."""
    rng = random.Random(20261126)
    batch, amp, accum = rng.choice([3, 17, 40]), rng.choice(["none", "fp16", "bf16"]), \
        rng.choice([1, 3])
    path = os.path.join(ROOT, "sample_models", "tiny_mlp.py")
    run = estimate_script(_script("loop.py", "--model", path, "--batch-size", batch, "--amp", amp,
                                  "--accum", accum), TraceConfig(1), BUDGET)
    ref = estimate(load_model(path), TraceConfig(batch, {"none": "fp32"}.get(amp, amp),
                                                 grad_accum=accum), BUDGET)
    assert _close(run.peak_allocated_bytes, ref.peak_allocated_bytes)


def test_probe_agrees_with_the_model_file_at_its_edges():
    """`probe -- python loop.py --batch-size {batch}` searches by real runs; at the edge it
    finds (the largest that fits, one more that does not), and at the model file's probe's
    edge, the script's runs and the model file's traces give the same verdicts. (Reserved
    memory is not monotonic in the batch size - allocator rounding - so two searches may stop
    at different edges: here the model file's probe stops at 13312 and the doubling search
    jumps to 14336, both fitting, 13313 not.)"""
    from oomdoctor.plans import probe as probe_mod
    from oomdoctor.plans.script_probe import probe_script
    from oomdoctor.sim.gpus import custom_profile
    path = os.path.join(ROOT, "sample_models", "tiny_mlp.py")
    budget = Budget(custom_profile(160 * MiB), context_bytes=0)
    script = _script("loop.py", "--model", path, "--batch-size", "{batch}")
    found = probe_script(script, TraceConfig(1), budget)
    ref = probe_mod.probe_config(load_model(path), TraceConfig(1), budget).max_batch_size
    assert found.trials[found.max_batch_size].fits
    assert not found.trials[found.max_batch_size + 1].fits
    for batch in (found.max_batch_size, found.max_batch_size + 1, ref, ref + 1):
        by_file = estimate(load_model(path), TraceConfig(batch), budget)
        by_script = estimate_script(script, TraceConfig(1), budget, batch_size=batch)
        assert (by_script.fits, by_script.peak_allocated_bytes) == (
            by_file.fits, by_file.peak_allocated_bytes)
        # The script's loop divides its loss by its accumulation (`loss / args.accum`: a
        # 4-byte tensor the model file's loop does not make), so the small pool's segments can
        # fall one 2 MiB segment apart where the step does not fit (the unlimited replay)
        assert abs(by_script.peak_reserved_bytes - by_file.peak_reserved_bytes) <= (
            0 if by_file.fits else 2 * MiB)


def test_probe_says_when_the_data_bounds_the_batch():
    from oomdoctor.plans.script_probe import probe_script
    found = probe_script(_script("pad_loop.py", "--bs", "{batch}"), TraceConfig(1), BUDGET)
    assert found.data_bound == found.max_batch_size == 64     # the dataset's 64 samples


@pytest.mark.parametrize("name,args", [
    ("mlp_loop.py", ["--samples", "32", "--batch-size", "16"]),
    ("pad_loop.py", ["--bs", "8"]),                    # a padding collator
    ("hf_trainer_clm.py", ["--per_device_train_batch_size", "4", "--n_layer", "2"]),
])
def test_the_fake_device_off_matches_a_real_cpu_run(name, args):
    """With the CUDA emulation off, the script's trace is what its real run on the CPU
    allocates (tests/reference.py: the same script run for real under torch.profiler, stopped
    at the same point). The real run also counts the script's CPU-side data (its dataset, the
    collator's scratch), which is not GPU memory: the scripts keep it small."""
    from reference import real_cpu_script_peak
    path = os.path.join(SCRIPTS, name)
    real = real_cpu_script_peak(path, args)
    trace = trace_script(parse_command(["python", path, *args]),
                         TraceConfig(1, emulate_cuda=False), FakeGpu("x", 2**34, (8, 0)))
    assert abs(trace.peak_live_bytes - real) <= 0.005 * real, (trace.peak_live_bytes, real)


def test_the_python_api_runs_a_script_as_the_cli_does():
    import oomdoctor
    path = os.path.join(SCRIPTS, "mlp_loop.py")
    by_api = oomdoctor.estimate(script=path, args=["--amp", "bf16"], batch_size=24,
                                gpu="rtx3090")
    by_plan = estimate_script(_script("mlp_loop.py", "--amp", "bf16"), TraceConfig(1),
                              Budget(get_profile("rtx3090")), batch_size=24)
    assert by_api.to_json() == by_plan.to_json()
    assert by_api.precision == "bf16" and by_api.batch_size == 24
    probed = oomdoctor.probe(script=os.path.join(SCRIPTS, "pad_loop.py"),
                             args=["--bs", "{batch}"], gpu="rtx3090")
    assert probed.data_bound == 64
    with pytest.raises(ValueError, match="not both"):
        oomdoctor.estimate(path, 8, script=path)


def test_check_gates_a_script(tmp_path):
    """A `command = python train.py` case in check: recorded (as the script's own estimate),
    then failing when the script's model grows; its prints stay off the JSON report."""
    import shutil
    shutil.copy(os.path.join(SCRIPTS, "mlp_loop.py"), tmp_path / "train.py")
    cfg = tmp_path / "setup.cfg"
    cfg.write_text("[oomdoctor]\ntolerance = 1%%\n\n[oomdoctor:train]\n"
                   "command = python train.py --batch-size 512\ngpu = rtx3090\n")
    r = _cli("check", "--config", str(cfg), "--update", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    recorded = json.loads((tmp_path / "oomdoctor-baseline.json").read_text())
    assert recorded["cases"]["train"]["config"]["command"] == "python train.py --batch-size 512"
    direct = estimate_script(parse_command(["python", str(tmp_path / "train.py"), "--batch-size",
                                            "512"]), TraceConfig(1), Budget(get_profile("rtx3090")))
    assert recorded["cases"]["train"]["peak_reserved_bytes"] == direct.peak_reserved_bytes
    assert doc["passed"]
    script = tmp_path / "train.py"              # the script's hidden width grows: a regression
    script.write_text(script.read_text().replace("512", "1024"))
    r = _cli("check", "--config", str(cfg), "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["cases"][0]["status"] == "regression"


@pytest.mark.parametrize("model,batch,amp,bucket_view", [
    ("gpt2_small", 2, "bf16", False), ("tiny_mlp", 64, "none", True),
])
def test_a_torchrun_ddp_script_gives_the_ddp_planners_per_gpu_peak(model, batch, amp,
                                                                   bucket_view):
    """`-- torchrun --nproc_per_node 2 ddp_loop.py`: rank 0 with DDP's broadcast and buckets is
    the per-GPU peak `oomdoctor parallel --strategy ddp` plans for the model file (whose DDP
    model is built from the layout, apart from the script's stand-in)."""
    from oomdoctor.plans import parallel as par
    path = os.path.join(ROOT, "sample_models", f"{model}.py")
    budget = Budget(get_profile("rtx3090"))
    script = parse_command(["torchrun", "--nproc_per_node", "2", os.path.join(SCRIPTS, "ddp_loop.py"),
                            "--model", path, "--batch-size", str(batch), "--amp", amp]
                           + ["--bucket-view"] * bucket_view)
    run = estimate_script(script, TraceConfig(1), budget)
    plan = par.estimate_strategies(load_model(path), TraceConfig(batch, {"none": "fp32"}.get(amp, amp)),
                                   budget, 2, ["ddp"], bucket_view=bucket_view)
    gpu = plan.estimates[0].gpus[0]
    assert _close(run.peak_allocated_bytes, gpu.peak_allocated_bytes)
    assert _close(run.peak_reserved_bytes, gpu.peak_reserved_bytes)
    assert any("rank 0 of the 2 processes torchrun" in n for n in run.notes)


def test_fsdp_a_script_uses_that_is_not_simulated_is_refused_in_one_line(tmp_path):
    """FSDP in a script is replayed per GPU (test_script_fsdp); what is not modelled of it is
    named where the script asks for it."""
    script = _write(tmp_path, "fsdp.py", "import torch, torch.distributed as dist\n"
                    "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, "
                    "ShardingStrategy\n"
                    "dist.init_process_group('nccl')\n"
                    "model = FSDP(torch.nn.Linear(8, 8).cuda(), "
                    "sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)\n")
    r = _cli("estimate", "--gpu", "rtx3090", "--", "torchrun", "--nproc_per_node", "2", script)
    assert r.returncode == 3 and r.stderr.count("\n") == 1
    assert "fsdp.py:4" in r.stderr and "SHARD_GRAD_OP" in r.stderr


def test_a_checkpoint_of_gpu_tensors_is_skipped_with_a_note(tmp_path):
    script = _write(tmp_path, "saves.py", "import torch, sys\n"
                    "m = torch.nn.Linear(16, 16).cuda()\n"
                    "torch.save(m.state_dict(), sys.argv[1] + '/init.pt')\n"
                    "torch.save({'epoch': 0}, sys.argv[1] + '/meta.pt')\n"
                    "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                    "for _ in range(3):\n"
                    "    m(torch.randn(4, 16).cuda()).sum().backward(); opt.step(); opt.zero_grad()\n")
    trace = trace_script(parse_command(["python", script, str(tmp_path)]), TraceConfig(1),
                         FakeGpu("x", 2**30, (8, 0)))
    assert sorted(os.listdir(tmp_path)) == ["meta.pt", "saves.py"]     # the CPU object is saved
    assert any("1 torch.save call(s) of GPU tensors skipped" in n for n in trace.notes)


@pytest.mark.parametrize("model,batch,precision", [
    ("gpt2_small", 2, "bf16-mixed"), ("bert_base", 2, "16-mixed"), ("tiny_mlp", 64, "32-true"),
])
def test_a_lightning_script_gives_the_model_files_peak(model, batch, precision):
    """Lightning's own loop (`Trainer.fit`, its precision plugin): its automatic optimization
    zeroes the gradients inside the step's closure, after training_step and before backward
    (lightning/pytorch/loops/optimization/automatic.py, Closure.closure), so last step's
    gradients live through the forward - the model file's `--zero-grad after-forward`."""
    pytest.importorskip("lightning")
    path = os.path.join(ROOT, "sample_models", f"{model}.py")
    run = estimate_script(_script("lightning_loop.py", "--model", path, "--batch-size", batch,
                                  "--precision", precision), TraceConfig(1), BUDGET)
    ours = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}[precision]
    ref = estimate(load_model(path), TraceConfig(batch, ours, zero_grad="after-forward"),
                   BUDGET)
    assert (run.batch_size, run.precision) == (batch, ours)
    assert _close(run.peak_allocated_bytes, ref.peak_allocated_bytes)
    assert _close(run.peak_reserved_bytes, ref.peak_reserved_bytes)


def _hf_config(tmp_path, kind):
    import transformers
    small = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                 intermediate_size=512)
    if kind == "bert":
        config = transformers.BertConfig(architectures=["BertForSequenceClassification"],
                                         **small)
    else:
        config = transformers.ViTConfig(image_size=64, patch_size=8,
                                        architectures=["ViTForImageClassification"], **small)
    config.save_pretrained(tmp_path / kind)
    return str(tmp_path / kind)


@pytest.mark.parametrize("kind,precision,checkpointing", [
    ("bert", "fp32", False), ("bert", "bf16", True), ("vit", "bf16", False),
])
def test_hf_trainer_classifiers_give_the_hf_sources_peak(tmp_path, kind, precision,
                                                         checkpointing):
    """BERT (sequence classification) and ViT (image classification) trained by the HF Trainer
    from a config folder: the HF source's peak for the same folder. The Trainer's default
    optimizer in transformers 5 is fused AdamW, which a model-file loop does not build: the
    scripts run with --optim adamw_torch (foreach AdamW) for this comparison."""
    pytest.importorskip("transformers")
    folder = _hf_config(tmp_path, kind)
    args = ["--config_dir", folder, "--per_device_train_batch_size", 8, "--optim", "adamw_torch"]
    args += ["--seq_len", 128] * (kind == "bert") + ["--bf16"] * (precision == "bf16")
    args += ["--gradient_checkpointing"] * checkpointing
    run = estimate_script(_script("hf_trainer_classify.py", *args), TraceConfig(1), BUDGET)
    ref = estimate(load_model(folder, seq_len=128 if kind == "bert" else None),
                   TraceConfig(8, precision, checkpointing), BUDGET)
    assert _close(run.peak_allocated_bytes, ref.peak_allocated_bytes)
    assert _close(run.peak_reserved_bytes, ref.peak_reserved_bytes, slack=2 * MiB)


def test_smoke_runs_a_plain_python_script_and_says_where_a_launched_one_goes():
    """smoke runs a script as one process (tests/test_smoke_script.py); a torchrun command is
    refused in one line that names the plain way and the command that plans the launch."""
    r = _cli("smoke", "--", "torchrun", "--nproc_per_node", "2", "tests/scripts/mlp_loop.py")
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "torchrun launches several" in line and "plain python" in line
    assert "`oomdoctor estimate -- torchrun ...`" in line


def test_the_hf_trainers_default_optimizer_is_fused_adamw(tmp_path):
    """transformers' TrainingArguments defaults to optim="adamw_torch_fused" on torch >= 2.8;
    a Trainer script left at its default gives the HF source's peak with --optimizer
    adamw-fused (and not the foreach AdamW a model file's loop builds by default)."""
    pytest.importorskip("transformers")
    folder = _hf_config(tmp_path, "bert")
    run = estimate_script(_script("hf_trainer_classify.py", "--config_dir", folder,
                                  "--per_device_train_batch_size", 8, "--seq_len", 128),
                          TraceConfig(1), BUDGET)
    spec = load_model(folder, seq_len=128)
    fused = estimate(spec, TraceConfig(8, optimizer="adamw-fused"), BUDGET)
    foreach = estimate(spec, TraceConfig(8), BUDGET)
    assert _close(run.peak_allocated_bytes, fused.peak_allocated_bytes)
    assert not _close(run.peak_allocated_bytes, foreach.peak_allocated_bytes)
