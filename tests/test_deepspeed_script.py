"""DeepSpeed inside a training script (`sim.deepspeed_engine`): `oomdoctor estimate --
deepspeed --num_gpus 1 tests/scripts/ds_train.py --deepspeed_config ds.json`, against the real
H200 runs of the same model, configs and loop (benchmarks/results/deepspeed/, DeepSpeed 0.19.8,
torch 2.11, one GPU; written by benchmarks/measure_deepspeed.py), with the tolerances the model
file's route holds on them (tests/test_deepspeed_gpu.py). The script's route differs from the
model file's in everything before the replay: its own loop run on the fake GPU, the engine's
stand-in casting the module to the config's 16-bit mode, the ZeRO stage, precision and buckets
read from the config it passed to deepspeed.initialize.

Where DeepSpeed is not installed (the test environment does not build it), tests/stand_ins/
provides the import; the stand-in replaces initialize in the run either way.
"""
import importlib.util
import json
import os

import pytest
from click.testing import CliRunner

from oomdoctor.cli import cli
from test_deepspeed_gpu import (RECORDS, _estimate, _name, check_peaks,
                                _skips_steps, record_setup)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "ds_train.py")


def _script_estimate(rec: dict, env: dict, tmp_path, monkeypatch) -> dict:
    config = record_setup(rec, tmp_path, monkeypatch)
    zero = rec["ds_config"]["zero_optimization"]["stage"]
    args = ["estimate", "--gpu", "h200", "--deepspeed", env["deepspeed"], "--json", "--",
            "deepspeed", "--num_gpus", "1", SCRIPT, "--deepspeed_config", str(config),
            "--batch-size", str(rec["batch_size"])]
    args += ["--engine-backward"] if "fp16" in rec["ds_config"] or zero == 0 else []
    args += ["--activation_checkpointing"] if rec["checkpointing"] else []
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output[-3000:]
    [strategy] = json.loads(r.stdout)["strategies"]
    assert strategy["strategy"] == f"ds{zero}"
    [gpu] = strategy["gpus"]
    return gpu


@pytest.mark.parametrize("env,rec", [(e, r) for e, r in RECORDS if not _skips_steps(r)],
                         ids=lambda x: _name(x) if "setup" in x else "")
def test_a_deepspeed_script_matches_the_gpu(env, rec, tmp_path, monkeypatch,
                                            deepspeed_importable):
    check_peaks(_script_estimate(rec, env, tmp_path, monkeypatch), rec)


@pytest.mark.parametrize("setup", ["zero2-bf16-offload", "zero3-bf16-offload",
                                   "zero3-bf16-offload-all"])
def test_the_offload_measurements_run_as_their_model_file(setup, tmp_path, monkeypatch,
                                                          deepspeed_importable):
    """measure_deepspeed.py's ZeRO-Offload setups on a small model: the script's route (its
    train.py under the engine's stand-in) gives what `parallel --ds-config` of the same config
    gives (both routes are checked against the H200 offload records above)."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(HERE), "benchmarks"))
    from measure_deepspeed import ds_config
    rec = {"hidden": 256, "layers": 4, "heads": 4, "batch_size": 4, "checkpointing": False,
           "ds_config": ds_config(setup, 4)}
    env = {"deepspeed": "0.19.8"}
    want = _estimate(rec, env, tmp_path, monkeypatch)
    got = _script_estimate(rec, env, tmp_path, monkeypatch)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert got[key] == pytest.approx(want[key], rel=0.01), key


INLINE = """import torch, deepspeed
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                         config={CONFIG})
for _ in range(3):
    x = torch.randn(8, 256, device=engine.device, dtype=next(model.parameters()).dtype)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
"""


def _inline(tmp_path, config: dict):
    script = tmp_path / "train_inline.py"
    script.write_text(INLINE.replace("{CONFIG}", repr(config)))
    return CliRunner().invoke(cli, ["estimate", "--gpu", "rtx3090", "--json", "--", "deepspeed",
                                    "--num_gpus", "2", str(script)])


def test_a_config_dict_and_the_launchers_processes(tmp_path, deepspeed_importable):
    """A config given as a dict, under `deepspeed --num_gpus 2`: ZeRO-2 bf16 on two GPUs, its
    gradient partitions and optimizer state halved against one GPU's."""
    config = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e5}}
    r = _inline(tmp_path, config)
    assert r.exit_code == 0, r.output[-3000:]
    [est] = json.loads(r.stdout)["strategies"]
    assert (est["strategy"], est["num_gpus"], est["precision"]) == ("ds2", 2, "bf16")
    assert any("deepspeed.initialize: ZeRO stage 2, bf16 on 2 GPU(s)" in n for n in est["notes"])


def test_offload_in_a_scripts_config_is_followed(tmp_path, deepspeed_importable):
    """ZeRO-3 with the optimizer on the CPU, then the parameters too: the script's run is
    replayed with what the config offloads on the host - each GPU keeps less, and the notes
    say what moved (the replay's bytes are checked in test_deepspeed)."""
    peaks = []
    for offload in ({}, {"offload_optimizer": {"device": "cpu"}},
                    {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}):
        config = {"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": True},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                  "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e5,
                                        "stage3_param_persistence_threshold": 0, **offload}}
        r = _inline(tmp_path, config)
        assert r.exit_code == 0, r.output[-3000:]
        [est] = json.loads(r.stdout)["strategies"]
        peaks.append(est["gpus"][0]["resting_state_bytes"])
        assert any("ZeRO-Offload" in n for n in est["notes"]) == bool(offload)
    # 4 x Linear(256, 256) on 2 GPUs: the fp32 master and Adam moments of half, 12 B x P/2,
    # leave with the optimizer; the bf16 partitions, 2 B x P/2, with the parameters
    p = 4 * (256 * 256 + 256)
    assert peaks[0] - peaks[1] == pytest.approx(12 * p / 2 + 2 * p / 2, abs=4096)
    assert peaks[1] - peaks[2] == pytest.approx(2 * p / 2, abs=4096)


def test_readme_example_runs(tmp_path, monkeypatch, deepspeed_importable):
    """README's DeepSpeed script example, its two lines as printed (the config written by the
    first, in a scratch folder; the script's path from the repository)."""
    import re
    import shlex
    root = os.path.dirname(HERE)
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        [block] = [b for b in re.findall(r"```bash\n(.*?)```", f.read(), re.S)
                   if "tests/scripts/ds_train.py" in b]
    write, run = block.strip().splitlines()
    config, path = re.fullmatch(r"echo '(.*)' > (\S+)", write).groups()
    monkeypatch.chdir(tmp_path)
    (tmp_path / path).write_text(config)
    words = [os.path.join(root, w) if w.startswith("tests/") else w for w in shlex.split(run)]
    r = CliRunner().invoke(cli, words[1:])
    assert r.exit_code == 0, r.output[-3000:]
    assert "ds2 x1" in r.output and "deepspeed.initialize: ZeRO stage 2, bf16" in r.output


@pytest.mark.parametrize("stage", [2, 3])
def test_the_hf_trainers_deepspeed_gives_the_hf_sources_plan(stage, tmp_path):
    """The HF Trainer with `--deepspeed ds.json` ("auto" values the Trainer fills in; ZeRO-2 and
    3, the model built from its config, outside zero.Init), under
    `deepspeed --num_gpus 2`: its engine through accelerate's DeepSpeed integration reaches the
    stand-in, and each GPU equals `parallel` of the same GPT-2 config as a Hugging Face source
    with the config's values written out. Needs DeepSpeed itself (the Trainer checks its
    release and imports deepspeed.comm): run here with DeepSpeed 0.19.8 installed. Running it
    found that the Trainer's DeepSpeed config stayed set for the process after the script's
    run, so the next model transformers built went through deepspeed.zero.Init."""
    pytest.importorskip("transformers")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("the HF Trainer's DeepSpeed integration needs DeepSpeed installed")
    from transformers import GPT2Config
    folder = tmp_path / "gpt2-tiny"
    GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=128,
               use_cache=False, architectures=["GPT2LMHeadModel"]).save_pretrained(folder)
    auto = tmp_path / "auto.json"
    auto.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": "auto",
                                "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": stage}}))
    explicit = tmp_path / "explicit.json"
    explicit.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "bf16": {
        "enabled": True}, "zero_optimization": {"stage": stage}}))
    r = CliRunner().invoke(cli, [
        "estimate", "--gpu", "rtx3090", "--json", "--", "deepspeed", "--num_gpus", "2",
        os.path.join(HERE, "scripts", "hf_trainer_clm.py"), "--per_device_train_batch_size", "4",
        "--fixed_length", "64", "--bf16", "--deepspeed", str(auto)])
    assert r.exit_code == 0, r.output[-3000:]
    [got] = json.loads(r.stdout)["strategies"]
    r = CliRunner().invoke(cli, ["parallel", str(folder), "--seq-len", "64", "--gpu", "rtx3090",
                                 "--gpus", "2", "-b", "4", "--ds-config", str(explicit),
                                 "--json"])
    assert r.exit_code == 0, r.output[-3000:]
    [want] = json.loads(r.stdout)["strategies"]
    assert (got["strategy"], got["num_gpus"]) == (want["strategy"], want["num_gpus"]) \
        == (f"ds{stage}", 2)
    g, w = got["gpus"][0], want["gpus"][0]
    assert g["peak_allocated_bytes"] == pytest.approx(w["peak_allocated_bytes"], rel=0.005)
    # reserved: measured equal at ZeRO-2, -0.72% at ZeRO-3 (four 2 MiB segments of a 1.1 GiB
    # peak: the Trainer's step allocates in another order than the HF source's loop)
    assert g["peak_reserved_bytes"] == pytest.approx(w["peak_reserved_bytes"], rel=0.01)


DATA_SCRIPT = """import torch, deepspeed
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256),
                            torch.nn.Linear(256, 4))
groups = [{"params": list(model[0].parameters()), "weight_decay": 0.0},
          {"params": list(model[2].parameters())}]
data = torch.utils.data.TensorDataset(torch.randn(64, 256), torch.randint(0, 4, (64,)))
engine, opt, loader, sched = deepspeed.initialize(model=model, model_parameters=groups,
                                                  training_data=data, config={CONFIG})
dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
for x, y in loader:
    loss = torch.nn.functional.cross_entropy(engine(x.to(engine.device, dtype)).float(),
                                             y.to(engine.device))
    engine.backward(loss)
    engine.step()
    sched.step()
"""


def test_deepspeeds_batch_rules_groups_and_engine_queries(tmp_path, deepspeed_importable):
    """What DeepSpeedExamples' scripts lean on: only train_batch_size given (DeepSpeed derives
    the micro-batch, 16 over 2 GPUs: 8, and the loader it builds from training_data uses it),
    parameter groups as model_parameters, engine.bfloat16_enabled(), a scheduler from the
    config, and the old "bfloat16" key of the bf16 mode."""
    config = {"train_batch_size": 16, "bfloat16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
              "scheduler": {"type": "WarmupLR"}, "zero_optimization": {"stage": 1}}
    script = tmp_path / "train_data.py"
    script.write_text(DATA_SCRIPT.replace("{CONFIG}", repr(config)))
    r = CliRunner().invoke(cli, ["estimate", "--gpu", "rtx3090", "--json", "--no-input-check",
                                 "--", "deepspeed", "--num_gpus", "2", str(script)])
    assert r.exit_code == 0, r.output[-3000:]
    [est] = json.loads(r.stdout)["strategies"]
    assert (est["strategy"], est["precision"], est["micro_batch"]) == ("ds1", "bf16", 8)
