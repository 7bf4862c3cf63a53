"""DeepSpeed's ZeRO stages as DeepSpeed runs them (oomdoctor.plans.parallel.deepspeed).

The independent numbers: DeepSpeedExamples' offload_states benchmark printed the bytes rank 0
holds right after the step of a ZeRO-3 bf16 run (4 x Linear(32768), 4 GPUs, every setting
DeepSpeed's default); the peaks of published runs are in tests/published_multi.py."""
import json
import os

import pytest
from click.testing import CliRunner

from oomdoctor.cli import cli
from oomdoctor.models.loader import load_model_file
from oomdoctor.plans import parallel as par
from oomdoctor.plans.estimate import Budget, trace_for
from oomdoctor.plans.parallel.estimator import _build
from oomdoctor.sim.gpus import PROFILES
from oomdoctor.sim.trace import Phase, TraceConfig

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY = os.path.join(ROOT, "sample_models", "tiny_mlp.py")
GPU = PROFILES["a100-80"]


def _after_steps(spec, strategy: par.Strategy, precision: str) -> list[int]:
    """Bytes one rank holds at the end of each optimizer step."""
    trace = trace_for(spec, TraceConfig(1, par.trace_precision(strategy, precision)), GPU)
    layout = par.model_layout(spec, trace.config.precision)
    ctx, gpus, _, _ = _build(trace, layout, strategy, GPU, None, None)
    events, positions = gpus[0].events()
    out = []
    for ph in ctx.timing.marks_of(Phase.OPTIMIZER):
        end = ctx.timing.phases[ph][1]
        out.append(sum(n if alloc else -n for (alloc, _, n), p in zip(events, positions)
                       if p < end))
    return out


def test_offload_states_benchmark_bytes_after_the_step(monkeypatch):
    # DeepSpeedExamples training/offload_states (PR #942) README: "alloc_before_offload=
    # 18198419456" after iteration 0's step, rank 0; config {"zero_optimization": {"stage":
    # 3}, "bf16": {"enabled": true}, Adam}: bf16 partitions, fp32 master weights and Adam
    # moments, the bf16 gradient partitions, the 5e8-element reduce bucket, the biases whole
    # (under the 1e5-element persistence threshold)
    monkeypatch.setenv("DS_WIDTH", "32768")
    monkeypatch.setenv("DS_LAYERS", "4")
    spec = load_model_file(os.path.join(HERE, "models", "ds_linear_stack.py"))
    run = par.read_deepspeed_config({"train_micro_batch_size_per_gpu": 1,
                                     "optimizer": {"type": "Adam", "params": {"lr": 1e-6}},
                                     "zero_optimization": {"stage": 3},
                                     "bf16": {"enabled": True}})
    st = par.default_policy(par.Strategy(run.strategy, 4, deepspeed=run.config), run.precision)
    first, *_ = _after_steps(spec, st, run.precision)
    assert first == pytest.approx(18_198_419_456, rel=0.001)


def test_master_weights_and_state_shrink_by_stage():
    # what one rank of 2 holds after the step (every gradient buffer is dropped by then, but
    # stage 3's): stage 0 every fp32 master weight and Adam moment (12 B/param), stage 1 half;
    # stage 2 the same as 1; stage 3 half the 16-bit weights, and keeps half the 16-bit
    # gradients and its reduce bucket (stage3.py allocates both at start-up)
    spec = load_model_file(TINY)
    ds = par.DeepSpeedConfig(reduce_bucket_size=1024, param_persistence_threshold=0)
    held = {}
    for name in par.DEEPSPEED_STRATEGIES:
        st = par.default_policy(par.Strategy(name, 2, deepspeed=ds), "bf16")
        held[name] = _after_steps(spec, st, "bf16")[-1]
    p = sum(t.numel() for t in spec.build_model().parameters())
    # 16-bit weights 2P + fp32 master 4P + Adam 8P, sharded as the stage says
    assert held["ds0"] - held["ds1"] == pytest.approx(12 * p / 2, rel=0.01)
    assert held["ds2"] == pytest.approx(held["ds1"], rel=0.01)
    assert held["ds3"] - held["ds2"] == pytest.approx(-2 * p / 2 + 2 * p / 2 + 1024 * 2,
                                                      abs=64)


def test_config_file_reading():
    run = par.read_deepspeed_config({"bf16": {"enabled": "auto"},
                                     "zero_optimization": {"stage": 2,
                                                           "reduce_bucket_size": "auto",
                                                           "overlap_comm": True}})
    assert (run.strategy, run.precision) == ("ds2", "bf16")
    assert run.config.overlap_comm is True and run.config.auto == ("reduce_bucket_size",)
    assert run.config.reduce_bucket_size == 500_000_000          # DeepSpeed's default
    assert par.read_deepspeed_config({}).strategy == "ds0"
    off = par.read_deepspeed_config({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}})
    assert off.config.offload_optimizer and off.config.offload_param
    with pytest.raises(ValueError, match="NVMe"):
        par.read_deepspeed_config({"zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "nvme"}}})
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        par.read_deepspeed_config({"zero_optimization": {
            "stage": 2, "offload_param": {"device": "cpu"}}})
    with pytest.raises(ValueError, match="both fp16 and bf16"):
        par.read_deepspeed_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ValueError, match="stage3_max_live_parameters is 'lots'"):
        par.read_deepspeed_config({"zero_optimization": {
            "stage": 3, "stage3_max_live_parameters": "lots"}})
    assert par.read_deepspeed_config({"zero_optimization": {
        "stage": 3, "stage3_max_live_parameters": 1e8}}).config.max_live_parameters == 10**8


def test_every_stage_and_precision_runs(tmp_path):
    # the matrix on a tiny model: each stage in fp32, fp16 and bf16, with accumulation
    spec = load_model_file(TINY)
    budget = Budget(GPU)
    for precision in ("fp32", "fp16", "bf16"):
        for accum in (1, 2):
            r = par.estimate_strategies(spec, TraceConfig(4, precision, grad_accum=accum),
                                        budget, 2, par.DEEPSPEED_STRATEGIES)
            assert not r.errors, r.errors
            assert [e.strategy for e in r.estimates] == list(par.DEEPSPEED_STRATEGIES)
            assert all(e.gpus[0].peak_allocated_bytes > 0 for e in r.estimates)
            mode = "fp16/bf16 mode" if precision != "fp32" else "fp32 (no fp16/bf16 mode)"
            assert all(mode in e.notes[0] for e in r.estimates)


def test_cli_ds_config(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"fp16": {"enabled": True},
                               "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6}}))
    r = CliRunner().invoke(cli, ["parallel", TINY, "--gpus", "2", "--gpu", "a100-80",
                                 "--ds-config", str(cfg), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    [e] = doc["strategies"]
    assert (e["strategy"], doc["precision"]) == ("ds2", "fp16")
    assert any("reduce_bucket_size 1,000,000" in n for n in e["notes"])
    # a flag that contradicts the config is a usage error
    r = CliRunner().invoke(cli, ["parallel", TINY, "--gpus", "2", "--ds-config", str(cfg),
                                 "--precision", "bf16"])
    assert r.exit_code == 2 and "contradicts" in r.output
    r = CliRunner().invoke(cli, ["parallel", TINY, "--gpus", "2", "--ds-config", str(cfg),
                                 "--strategy", "zero3"])
    assert r.exit_code == 2 and "contradicts" in r.output
    # estimate takes the same config, and the same stages by name
    r = CliRunner().invoke(cli, ["estimate", TINY, "-b", "4", "--num-gpus", "2", "--ds-config",
                                 str(cfg), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["strategies"][0]["strategy"] == "ds2"
    r = CliRunner().invoke(cli, ["estimate", TINY, "-b", "4", "--num-gpus", "2", "--strategy",
                                 "ds1", "--precision", "bf16", "--json"])
    assert r.exit_code == 0, r.output
    # DeepSpeed keeps fp32 master weights: its stages take fp16/bf16, not the pure modes
    r = CliRunner().invoke(cli, ["parallel", TINY, "--gpus", "2", "--strategy", "ds3",
                                 "--precision", "bf16-pure", "--json"])
    assert "fp32 master weights" in json.loads(r.stdout)["errors"][0]["error"]


def test_aliases():
    assert par.parse_strategy("deepspeed-zero3") == "ds3"
    assert par.parse_strategy("DeepSpeed_Stage_2") == "ds2"


def test_readme_example_runs(tmp_path, monkeypatch):
    # the README's DeepSpeed example, as written there
    import re
    import shlex
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        block = next(b for b in re.findall(r"```bash\n(.*?)```", f.read(), re.S)
                     if "--ds-config ds.json" in b)
    echo, command = block.strip().splitlines()
    monkeypatch.chdir(tmp_path)
    config = shlex.split(echo)[1]
    (tmp_path / "ds.json").write_text(config)
    args = shlex.split(command)[1:]
    args = [os.path.join(ROOT, a) if a.startswith("sample_models/") else a for a in args]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert "ds3 x4" in r.output and "reduce_bucket_size 50,000,000" in r.output


@pytest.mark.parametrize("command,gpus", [("parallel", "--gpus"), ("estimate", "--num-gpus")])
def test_the_deepspeed_release_is_stated_settable_and_moves_the_bucket(command, gpus):
    """--deepspeed, in both commands that plan DeepSpeed: before 0.18.3 ZeRO-2 makes its reduce
    bucket as the backward starts, while the logits' gradients still live; since, at the first
    gradient's hook (measured on an H200, tests/test_deepspeed_gpu.py). The note names the
    release and why it was assumed; a release that is not one is a usage error."""
    model = os.path.join(HERE, "models", "ds_simple_transformer.py")   # 102 MB of logits

    def run(*extra):
        r = CliRunner().invoke(cli, [command, model, "--strategy", "ds2", gpus, "2",
                                     "-b", "2", "--precision", "bf16", "--json", *extra])
        return r
    old, new = run("--deepspeed", "0.9.2"), run("--deepspeed", "0.19.8")
    assert old.exit_code == 0 and new.exit_code == 0, old.output + new.output
    old_gpu, new_gpu = (json.loads(r.stdout)["strategies"][0] for r in (old, new))
    assert any("DeepSpeed 0.9.2 assumed (as given" in n for n in old_gpu["notes"])
    assert any("DeepSpeed 0.19.8 assumed (as given" in n and "first gradient" in n
               for n in new_gpu["notes"])
    # the bucket (954 MiB) on top of the loss's backward, or after it
    assert old_gpu["gpus"][0]["peak_allocated_bytes"] > new_gpu["gpus"][0]["peak_allocated_bytes"]
    bad = run("--deepspeed", "banana")
    assert bad.exit_code == 2 and "give it as 0.9.2" in bad.output


def test_offload_leaves_what_deepspeeds_estimators_keep_on_the_gpu():
    # DeepSpeed's estimators with cpu_offload (estimate_zero2_model_states_mem_needs: GPU 2P;
    # estimate_zero3_model_states_mem_needs: 2P/N with the optimizer offloaded, nothing at rest
    # with the parameters too - 4L is the layer being computed, gone after the step). What one
    # rank of 2 holds after the step, against the same with everything offloaded, is that
    # plus the buffers DeepSpeed's source keeps: ZeRO-2's temp_grad_buffer_for_gpu_offload (the
    # largest parameter, 16-bit) in place of stage 3's reduce bucket; and against no offload,
    # the fp32 master weights and Adam moments (12P/N) less that buffer.
    spec = load_model_file(TINY)
    sizes = [t.numel() for t in spec.build_model().parameters()]
    p, largest = sum(sizes), max(sizes)
    held = {}
    for key, name, kw in [("ds2", "ds2", {}), ("ds2-opt", "ds2", {"offload_optimizer": True}),
                          ("ds3-opt", "ds3", {"offload_optimizer": True}),
                          ("ds3-all", "ds3", {"offload_optimizer": True,
                                              "offload_param": True})]:
        ds = par.DeepSpeedConfig(reduce_bucket_size=1024, param_persistence_threshold=0, **kw)
        st = par.default_policy(par.Strategy(name, 2, deepspeed=ds), "bf16")
        held[key] = _after_steps(spec, st, "bf16")[-1]
    assert held["ds2-opt"] - held["ds3-all"] == 2 * p + 2 * largest - 1024 * 2
    assert held["ds3-opt"] - held["ds3-all"] == 2 * p // 2
    assert held["ds2"] - held["ds2-opt"] == 12 * p // 2 - 2 * largest
