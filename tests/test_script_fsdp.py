"""FSDP inside a training script (`estimate -- torchrun ... train.py` where train.py calls
fully_shard or FullyShardedDataParallel): the run records how the script shards
(oomdoctor.sim.sharding) and is replayed per GPU as that FSDP. The same model written as a model
file and planned with `parallel --strategy zero3` (whose FSDP2/FSDP1 replay is checked against
real fully_shard and FSDP1 runs in test_fsdp/test_fsdp1) must need the same per GPU: this checks
that the script's wrapping, policy, casts and resharding are read as the script sets them."""
import json
import os

import pytest
from click.testing import CliRunner

from oomdoctor.cli import cli

HERE = os.path.dirname(os.path.abspath(__file__))
LOOP = os.path.join(HERE, "scripts", "fsdp_loop.py")
MODEL = os.path.join(HERE, "models", "plan_lm.py")
TORCHRUN = ["torchrun", "--nproc_per_node", "2", LOOP, "--model", MODEL]


def _json(args):
    # expandable segments: the per-GPU figure without the segment layout, which follows the
    # order the parameters reach the GPU (the script's: each block as fully_shard takes it)
    r = CliRunner().invoke(cli, [*args[:1], "--gpu", "rtx3090", "--json", "--alloc-conf",
                                 "expandable_segments:True", *args[1:]])
    assert r.exit_code in (0, 1), r.output[-2000:]
    return json.loads(r.stdout)


def _gpu(doc):
    (s,) = doc["strategies"]
    return s["strategy"], s["num_gpus"], s["gpus"][0]


@pytest.mark.parametrize("flags,plan", [
    ([], ["--strategy", "zero3"]),
    (["--policy"], ["--strategy", "zero3", "--precision", "bf16"]),
    (["--no-reshard"], ["--strategy", "zero2"]),
    (["--fsdp", "1"], ["--strategy", "zero3", "--fsdp-version", "1"]),
    (["--fsdp", "1", "--policy"], ["--strategy", "zero3", "--fsdp-version", "1",
                                   "--precision", "bf16"]),
    # CPUOffloadPolicy: the states on the host, each block copied in to be gathered
    (["--offload"], ["--strategy", "zero3", "--cpu-offload"]),
    (["--offload", "--policy"], ["--strategy", "zero3", "--precision", "bf16",
                                 "--cpu-offload"]),
])
def test_a_sharded_script_needs_what_its_model_file_plans(flags, plan):
    script = _json(["estimate", "--", *TORCHRUN, *flags])
    model = _json(["parallel", MODEL, "-b", "8", "--num-gpus", "2", *plan])
    (name, n, got), (want_name, _, want) = _gpu(script), _gpu(model)
    assert (name, n) == (want_name, 2)
    # within 1%: the loop holds its batch (16 KiB of token ids) on its own schedule; with the
    # policy the script's run peaks 3 MiB (0.6%) lower than the model file's pure-bf16 trace
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert abs(got[key] - want[key]) <= 0.01 * want[key], (key, got[key], want[key])
    assert any("the script's" in note for s in script["strategies"] for note in s["notes"])


def test_a_2d_mesh_is_hybrid_sharding():
    name, n, _ = _gpu(_json(["estimate", "--", *TORCHRUN, "--mesh", "2,2"]))
    assert (name, n) == ("hsdp", 4)


def test_what_is_not_simulated_is_named():
    r = CliRunner().invoke(cli, ["parallel", "--gpu", "rtx3090", "--", *TORCHRUN])
    assert r.exit_code == 2 and "shards its model with FSDP" in r.output
    r = CliRunner().invoke(cli, ["estimate", "--gpu", "rtx3090", "--snapshot", "s.json", "--",
                                 *TORCHRUN])
    assert r.exit_code == 2 and "per GPU" in r.output


def test_probe_finds_the_largest_batch_per_gpu_of_a_sharded_script():
    """`probe -- torchrun ... fully_shard script`: every trial is the per-GPU replay, and the
    answer is where the model file's route (`parallel --strategy zero3` with the policy) stops
    fitting too."""
    import json as _json
    from click.testing import CliRunner
    from oomdoctor.cli import cli
    r = CliRunner().invoke(cli, ["probe", "--memory", "3GiB", "--json", "--no-input-check", "--",
                                 "torchrun", "--nproc_per_node", "2", LOOP, "--model",
                                 MODEL, "--policy", "--batch-size", "{batch}"])
    assert r.exit_code == 0, r.output[-3000:]
    best = _json.loads(r.stdout)["max_batch_size"]
    assert best > 8

    def fits(batch):
        r = CliRunner().invoke(cli, ["parallel", MODEL, "--memory", "3GiB", "--gpus", "2",
                                     "--strategy", "zero3", "--precision", "bf16", "-b",
                                     str(batch), "--json"])
        return _json.loads(r.stdout)["strategies"][0]["fits"]
    assert fits(best) and not fits(best + 1)


def test_a_check_case_of_a_sharded_script_gates_its_fullest_gpu(tmp_path):
    """`command = torchrun ... fully_shard script` in check: the recorded peak is the per-GPU
    replay's (what `estimate -- <command>` prints), not the whole model on one GPU."""
    import json as _json
    from click.testing import CliRunner
    from oomdoctor.cli import cli
    command = f"torchrun --nproc_per_node 2 {LOOP} --model {MODEL} --policy --batch-size 8"
    cfg = tmp_path / "setup.cfg"
    cfg.write_text(f"[oomdoctor]\ntolerance = 1%%\n\n[oomdoctor:fsdp]\ncommand = {command}\n"
                   "gpu = rtx3090\n")
    r = CliRunner().invoke(cli, ["check", "--config", str(cfg), "--update"])
    assert r.exit_code == 0, r.output[-3000:]
    case = _json.loads((tmp_path / "oomdoctor-baseline.json").read_text())["cases"]["fsdp"]
    est = CliRunner().invoke(cli, ["estimate", "--gpu", "rtx3090", "--json", "--no-input-check",
                                   "--", *command.split()])
    [gpu] = _json.loads(est.stdout)["strategies"][0]["gpus"]
    assert case["peak_reserved_bytes"] == gpu["peak_reserved_bytes"]
