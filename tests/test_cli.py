"""The command line: exit codes, stdout vs stderr, JSON contract, --help everywhere."""
import json
import os

import pytest
from click.testing import CliRunner

from oomdoctor.cli import EXIT_MODEL, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, cli
from oomdoctor.plans.estimate import BREAKDOWN_KEYS
from oomdoctor.sim.gpus import PROFILES

ROOT = os.path.dirname(os.path.dirname(__file__))
MLP = os.path.join(ROOT, "sample_models", "tiny_mlp.py")


def run(*args):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_every_command_has_help(command):
    res = run(command, "--help")
    assert res.exit_code == 0 and "Usage:" in res.stdout
    # every option name is declared once (a duplicated option silently shadows another)
    params = cli.commands[command].params
    names = [o for p in params for o in p.opts]
    assert len(names) == len(set(names)), command


def test_estimate_json_contract():
    res = run("estimate", MLP, "-b", "32", "--gpu", "rtx3090", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    d = json.loads(res.stdout)
    for key in ("batch_size", "precision", "checkpointing", "grad_accum", "gpu",
                "device_total_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "fits",
                "breakdown", "peak_phase"):
        assert key in d
    assert d["gpu"] == "rtx3090" and d["batch_size"] == 32 and d["fits"] is True
    assert d["device_total_bytes"] == PROFILES["rtx3090"].total_bytes
    assert tuple(d["breakdown"]) == BREAKDOWN_KEYS
    assert all(isinstance(v, int) for v in d["breakdown"].values())
    # The breakdown is of the reserved peak plus the CUDA context.
    assert sum(d["breakdown"].values()) == d["peak_reserved_bytes"] + d["breakdown"]["cuda_context"]
    assert d["peak_reserved_bytes"] >= d["peak_allocated_bytes"] > 0


def test_estimate_does_not_fit_exit_code():
    res = run("estimate", MLP, "-b", "32", "--memory", "600MiB", "--overhead", "590MiB",
              "--json")
    assert res.exit_code == EXIT_PROBLEM
    assert json.loads(res.stdout)["fits"] is False


def test_estimate_text_goes_to_stdout_only():
    res = run("estimate", MLP, "-b", "8", "--gpu", "t4", "--precision", "fp16")
    assert res.exit_code == EXIT_OK
    assert "FITS" in res.stdout and "optimizer state" in res.stdout
    assert res.stderr == ""


@pytest.mark.parametrize("args,message", [
    (["--gpu", "gtx480"], "unknown GPU"),
    (["--memory", "24GB"], "ambiguous"),
    (["--gpu", "rtx3090", "--memory", "24GiB"], "not both"),
    (["--gpu", "rtx3090", "--margin", "150%"], "between 0% and 100%"),
    (["--gpu", "rtx3090", "--alloc-conf", "max_split_size_mb:5"], "max_split_size_mb"),
    (["--gpu", "t4", "--precision", "bf16"], "no bf16 support"),
])
def test_usage_errors(args, message):
    res = run("estimate", MLP, "-b", "8", *args)
    assert res.exit_code == EXIT_USAGE
    assert message in res.stderr


def test_no_gpu_defaults_to_rtx3090_and_says_so(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = run("estimate", MLP, "-b", "8", "--json")
    assert json.loads(res.stdout)["gpu"] == "rtx3090"
    assert "no CUDA GPU" in res.stderr


def test_probe_json_and_progress():
    res = run("probe", MLP, "--gpu", "rtx3090", "--precision", "bf16", "--no-checkpointing",
              "--max-batch-size", "4096", "-j", "1", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    d = json.loads(res.stdout)
    assert d["gpu"] == "rtx3090"
    [r] = d["results"]
    assert r["precision"] == "bf16" and r["checkpointing"] is False
    # A 400k-parameter MLP fits any batch up to the cap on a 24 GiB card.
    assert r["max_batch_size"] == 4096
    assert r["trials"] and all(set(t) >= {"batch_size", "fits", "method"} for t in r["trials"])
    assert "tracing batch size 2" in res.stderr
    assert "multi_gpu_plan" not in d            # one GPU: no GPU here and --num-gpus not given


def test_probe_on_two_gpus_ends_with_a_plan_for_them():
    """A card too small for the whole target batch: the plan spreads it over both GPUs at the
    probe's recommended precision, with micro-batch x accumulation x GPUs = the target, and a
    DDP micro-batch never above the single-GPU maximum (DDP replicates the model)."""
    res = run("probe", MLP, "--memory", "40MiB", "--overhead", "0", "--precision", "fp32",
              "--no-checkpointing", "--num-gpus", "2", "--target-batch", "1024", "-j", "1",
              "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    d = json.loads(res.stdout)
    [single] = d["results"]
    assert 0 < single["max_batch_size"] < 1024
    plan = d["multi_gpu_plan"]
    assert plan["num_gpus"] == 2 and plan["target_batch"] == 1024
    assert plan["best"] and plan["candidates"][0] == plan["best"]
    for c in plan["candidates"]:
        assert c["precision"] == "fp32" and c["checkpointing"] is False
        dp = 1 if c["strategy"] in ("single", "pipeline2") else c["num_gpus"]
        assert c["micro_batch"] * c["grad_accum"] * dp == 1024
        if c["strategy"] in ("ddp", "single"):
            assert c["micro_batch"] <= single["max_batch_size"]
    assert "planning 2 GPUs for an effective batch of 1024" in res.stderr
    text = run("probe", MLP, "--memory", "40MiB", "--overhead", "0", "--precision", "fp32",
               "--no-checkpointing", "--num-gpus", "2", "--target-batch", "1024", "-j", "1")
    assert "on 2 GPUs, at the recommended precision" in text.stdout
    assert "RECOMMENDED:" in text.stdout


def test_probe_nothing_fits():
    res = run("probe", MLP, "--memory", "600MiB", "--overhead", "595MiB", "--precision", "fp32",
              "--no-checkpointing", "-j", "1", "--json")
    assert res.exit_code == EXIT_PROBLEM
    assert json.loads(res.stdout)["results"][0]["max_batch_size"] is None


def test_python_dash_m_entry_point():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "oomdoctor", "--version"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0 and "oomdoctor" in out.stdout


def test_console_entry_point_skips_teardown_but_keeps_output_and_exit_codes(tmp_path):
    """The real entry point leaves through os._exit once torch is loaded: the output must still
    be complete when piped, and every exit code the command chose must survive."""
    import subprocess
    import sys

    def run_main(*args):
        return subprocess.run([sys.executable, "-m", "oomdoctor", *args], capture_output=True,
                              text=True, cwd=ROOT)
    ok = run_main("estimate", MLP, "-b", "4", "--gpu", "rtx3090", "--json")
    assert ok.returncode == EXIT_OK, ok.stderr
    assert json.loads(ok.stdout)["batch_size"] == 4          # the whole document arrived
    too_big = run_main("estimate", MLP, "-b", "4", "--memory", "600MiB", "--overhead", "599MiB")
    assert too_big.returncode == EXIT_PROBLEM and "DOES NOT FIT" in too_big.stdout
    bad = tmp_path / "broken.py"
    bad.write_text("def build_model(:\n")
    broken = run_main("estimate", str(bad), "-b", "1")
    assert broken.returncode == EXIT_MODEL and "broken.py" in broken.stderr
    usage = run_main("estimate", MLP, "-b", "0")
    assert usage.returncode == EXIT_USAGE and "Usage:" in usage.stderr


def test_explain_with_model_adds_the_simulators_numbers(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("RuntimeError: CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; 23.69 GiB "
                   "total capacity; 21.93 GiB already allocated; 111.88 MiB free; 23.27 GiB "
                   "reserved in total by PyTorch)\n")
    res = run("explain", str(log), "--model", MLP, "-b", "64", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    sim = json.loads(res.stdout)["simulation"]
    # The card is the one whose capacity the log states (23.69 GiB: an RTX 3090).
    assert sim["gpu"] == "rtx3090" and "simulating on rtx3090" in res.stderr
    assert sim["batch_size"] == 64 and sim["fits"] is True
    # tiny_mlp has no repeated blocks to checkpoint, so that configuration is left out.
    assert [m["config"] for m in sim["max_batch"]] == ["in fp32", "with bf16 AMP"]
    # Cross-check the needed bytes with `estimate` of the same configuration.
    est = json.loads(run("estimate", MLP, "-b", "64", "--gpu", "rtx3090", "--json").stdout)
    assert sim["needed_bytes"] == est["peak_reserved_bytes"] + est["breakdown"]["cuda_context"]


def test_explain_with_model_needs_a_card(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("RuntimeError: CUDA error: out of memory\n")
    res = run("explain", str(log), "--model", MLP)
    assert res.exit_code == EXIT_USAGE and "--gpu" in res.stderr


def test_estimate_with_a_strategy_is_per_gpu():
    """DDP holds the whole model on each GPU: its per-GPU peak is the single-GPU peak plus the
    bucket copy of the gradients (4 B x 399,370 tiny_mlp parameters), never less."""
    single = json.loads(run("estimate", MLP, "-b", "64", "--gpu", "rtx3090", "--json").stdout)
    res = run("estimate", MLP, "-b", "64", "--gpu", "rtx3090", "--strategy", "ddp",
              "--num-gpus", "2", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    [ddp] = json.loads(res.stdout)["strategies"]
    assert ddp["strategy"] == "ddp" and ddp["num_gpus"] == 2
    assert ddp["peak_device_bytes"] >= single["peak_reserved_bytes"] + \
        single["breakdown"]["cuda_context"]


def test_probe_recommends_amp_where_it_fits():
    res = run("probe", MLP, "--gpu", "t4", "--max-batch-size", "256", "-j", "1", "--json")
    rec = json.loads(res.stdout)["recommended"]
    # T4 has no bf16: fp16 AMP, without checkpointing, at the search cap (tiny_mlp fits more).
    assert {k: rec[k] for k in ("precision", "checkpointing", "batch_size", "capped")} == \
        {"precision": "fp16", "checkpointing": False, "batch_size": 256, "capped": True}
    text = run("probe", MLP, "--gpu", "rtx3090", "--max-batch-size", "64", "-j", "1").stdout
    assert "recommended: bf16 AMP" in text


def test_probe_smoke_runs_the_recommended_configuration():
    res = run("probe", MLP, "--gpu", "rtx3090", "--precision", "bf16", "--no-checkpointing",
              "--max-batch-size", "64", "-j", "1", "--smoke", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    smoke = json.loads(res.stdout)["smoke"]
    assert smoke["ok"] is True and len(smoke["losses"]) == 3


def test_probe_measured_on_a_device():
    """--device runs real steps (here on the CPU, where max_batch caps the search) seeded by the
    simulator; on this CPU-only torch, --device cuda exits 4 (no GPU) before simulating."""
    res = run("probe", MLP, "--gpu", "rtx3090", "--precision", "fp32", "--no-checkpointing",
              "--max-batch-size", "32", "-j", "1", "--device", "cpu", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    d = json.loads(res.stdout)
    [m] = d["measured"]
    assert m["max_batch_size"] == d["predicted"]["results"][0]["max_batch_size"] == 32
    import torch
    if not torch.cuda.is_available():
        res = run("probe", MLP, "--gpu", "rtx3090", "--precision", "fp32",
                  "--no-checkpointing", "--max-batch-size", "32", "-j", "1", "--device", "cuda")
        assert res.exit_code == 4 and "CUDA" in res.stderr


def test_probe_says_its_allocator_setting_and_what_expandable_segments_buy():
    """Issue #24 item 6: probe says which PYTORCH_CUDA_ALLOC_CONF its numbers assume, and when
    expandable segments buy the recommended configuration a larger micro-batch it says so, with
    the same answer `probe --alloc-conf` and `estimate --alloc-conf` give for that setting."""
    gpt2 = os.path.join(ROOT, "sample_models", "gpt2_small.py")
    args = ("probe", gpt2, "--gpu", "rtx3090", "--precision", "bf16", "--no-checkpointing",
            "-j", "1")
    res = run(*args, "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    d = json.loads(res.stdout)
    gain = d["allocator_gain"]
    assert d["allocator"] is None and gain["setting"] == "expandable_segments:True"
    assert gain["default_batch_size"] == d["recommended"]["batch_size"] < gain["batch_size"]
    text = run(*args).stdout
    assert "PYTORCH_CUDA_ALLOC_CONF unset (PyTorch's defaults)" in text
    assert (f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would allow micro-batch "
            f"{gain['batch_size']} instead of {gain['default_batch_size']}") in text
    # With the setting given, probe assumes it, says so, and finds the same batch.
    res = run(*args, "--alloc-conf", "expandable_segments:True", "--json")
    d = json.loads(res.stdout)
    assert d["allocator"] == "expandable_segments:True" and d["allocator_gain"] is None
    assert d["recommended"]["batch_size"] == gain["batch_size"]
    for b, code in ((gain["batch_size"], EXIT_OK), (gain["batch_size"] + 1, EXIT_PROBLEM)):
        res = run("estimate", gpt2, "--gpu", "rtx3090", "--precision", "bf16", "-b", str(b),
                  "--alloc-conf", "expandable_segments:True")
        assert res.exit_code == code, (b, res.stdout)


def test_steps_are_numbered_one_way_in_text_and_json():
    """Issue #25: the text's "in the backward of step N" and the JSON's peak_step are the same
    number, counted from 1 like the trace's progress ("step 1/2: forward")."""
    args = ("estimate", MLP, "--gpu", "rtx3090", "-b", "8")
    res = run(*args, "--json")
    step = json.loads(res.stdout)["peak_step"]
    assert step in (1, 2)
    assert f"of step {step}" in run(*args).stdout


# tiny_mlp's parameters from its layers: Linear(256, 512), Linear(512, 512), Linear(512, 10).
MLP_PARAMS = (256 * 512 + 512) + (512 * 512 + 512) + (512 * 10 + 10)


@pytest.mark.parametrize("args,read", [
    (("estimate", MLP, "-b", "8"),
     lambda d: (d["precision"], d["breakdown"]["parameters"])),
    (("probe", MLP, "--precision", "fp16-pure", "--no-checkpointing", "--max-batch-size", "64"),
     lambda d: (d["results"][0]["precision"], d["results"][0]["breakdown"]["parameters"])),
    (("parallel", MLP, "-b", "8", "--gpus", "2", "--strategy", "ddp"),
     lambda d: (d["precision"], d["strategies"][0]["gpus"][0]["breakdown"]["parameters"])),
    (("split", MLP, "-b", "8", "--gpus", "2"),
     lambda d: (d["precision"], sum(s["breakdown"]["parameters"] for s in d["stages"]))),
    (("recommend", MLP, "--gpus", "2", "--target-batch", "64", "--precision", "fp16-pure",
      "--quick", "-j", "1"),
     lambda d: (d["best"]["precision"], None)),
], ids=["estimate", "probe", "parallel", "split", "recommend"])
def test_every_planning_command_takes_fp16_pure_on_a_card_without_bf16(args, read):
    """--precision fp16-pure on a T4 (compute capability 7.5, no bf16): every command plans it,
    with fp16 weights (2 bytes per parameter; recommend: the plan is the precision asked)."""
    extra = () if "--precision" in args else ("--precision", "fp16-pure")
    res = run(*args, *extra, "--gpu", "t4", "--json")
    assert res.exit_code == EXIT_OK, res.output
    precision, param_bytes = read(json.loads(res.stdout))
    assert precision == "fp16-pure"
    assert param_bytes in (None, 2 * MLP_PARAMS)


def test_probe_recommends_pure_fp16_last_and_says_what_it_costs():
    res = run("probe", MLP, "--gpu", "t4", "--precision", "fp32", "--precision", "fp16-pure",
              "--no-checkpointing", "--max-batch-size", "64")
    assert res.exit_code == EXIT_OK, res.output
    assert "recommended: fp32" in res.stdout          # fp32 fits: it goes first
    res = run("probe", MLP, "--gpu", "t4", "--precision", "fp16-pure", "--no-checkpointing",
              "--max-batch-size", "64")
    assert "recommended: pure fp16 (model.half(), no GradScaler)" in res.stdout
    assert "riskiest precision" in res.stdout and "eps=1e-4" in res.stdout


def test_expandable_segments_are_not_probed_where_one_sample_more_cannot_fit(monkeypatch):
    """allocator_gain skips its second probe when the trial one sample above the recommended
    batch needs more than the budget in allocated bytes alone (replayed without the limit): no
    allocator setting can make that room, and the probe of a large model saves its traces."""
    from oomdoctor.plans import probe as probe_mod
    from oomdoctor.plans.estimate import Budget
    from oomdoctor.sim.gpus import PROFILES
    from oomdoctor.sim.trace import TraceConfig
    budget = Budget(PROFILES["rtx3090"])
    limit = budget.limit_bytes

    def result(one_more_allocated):
        trials = (probe_mod.Trial(4, True, limit - 2**30, limit - 2**28, "traced"),
                  probe_mod.Trial(5, False, one_more_allocated, limit + 2**30, "traced"))
        config = probe_mod.ConfigResult("bf16", True, 4, None, trials)
        return probe_mod.ProbeResult("m", "rtx3090", budget.gpu.total_bytes, limit, 0.0, 1,
                                     (config,))

    calls = []
    monkeypatch.setattr(probe_mod, "probe_config", lambda *a, **k: calls.append(a) or
                        probe_mod.ConfigResult("bf16", True, 4, None, ()))
    alloc = probe_mod.AllocatorConfig()
    assert probe_mod.allocator_gain(None, result(limit + 2**20), TraceConfig(1), budget,
                                    alloc) is None
    assert not calls                                  # over the budget in allocated bytes
    probe_mod.allocator_gain(None, result(limit - 2**20), TraceConfig(1), budget, alloc)
    assert len(calls) == 1                            # fragmentation could be what stops it
