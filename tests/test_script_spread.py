"""One process over two GPUs inside a script (`sim.spreading`): DataParallel and accelerate's
dispatch_model, estimated per GPU by `oomdoctor estimate -- python train.py`.

The script (tests/scripts/spread_loop.py) trains a model file's network; the same network as a
model file, planned by `oomdoctor parallel` (the replay tests/test_parallel.py checks against
real runs), must give the same per-GPU peaks: the script's route differs in everything before
the replay - its run on the fake GPU, the stand-ins, the second run at one GPU's share of a
DataParallel batch, the cut read from its device map. Printed plans run the same way in
tests/test_plan_scripts.py.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
from click.testing import CliRunner

from oomdoctor.cli import cli

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "spread_loop.py")
MODEL = os.path.join(HERE, "models", "plan_lm.py")
TWO = {"CUDA_VISIBLE_DEVICES": "0,1"}
CARD = ["--gpu", "rtx3090"]


def _estimate(*script_args, env=TWO):
    r = CliRunner().invoke(cli, ["estimate", *CARD, "--json", "--", sys.executable, SCRIPT,
                                 "--model", MODEL, *script_args], env=env)
    return r, (json.loads(r.stdout) if r.exit_code in (0, 1) else None)


def _per_gpu(doc):
    return [g["device_peak_bytes"] for g in doc["strategies"][0]["gpus"]]


def _close(got, want, tol=0.005):
    assert len(got) == len(want) and all(abs(g - w) <= tol * w for g, w in zip(got, want)), \
        (got, want)


def test_a_data_parallel_script_is_estimated_per_gpu():
    """DataParallel over the two visible GPUs at a loader batch of 16: 8 per GPU, as
    `parallel --strategy dp -b 8` plans the model file (GPU 0: the whole batch's outputs and
    the loss, the optimizer; GPU 1: a replica's step)."""
    r, doc = _estimate("--spread", "dp", "--batch-size", "16")
    assert r.exit_code == 0, r.output[-2000:]
    est = doc["strategies"][0]
    assert (est["strategy"], est["num_gpus"], est["micro_batch"]) == ("dp", 2, 8)
    plan = CliRunner().invoke(cli, ["parallel", MODEL, *CARD, "--gpus", "2", "-b", "8",
                                    "--strategy", "dp", "--json"])
    _close(_per_gpu(doc), _per_gpu(json.loads(plan.stdout)))
    assert any("DataParallel over GPUs 0, 1" in n for n in est["notes"])


def test_data_parallel_on_one_visible_gpu_is_the_plain_script():
    """With one GPU visible DataParallel calls the module as it is: one GPU's estimate, the
    same as the script without it."""
    one = {"CUDA_VISIBLE_DEVICES": "0"}
    r, dp = _estimate("--spread", "dp", "--batch-size", "8", env=one)
    _, plain = _estimate("--spread", "none", "--batch-size", "8", env=one)
    assert r.exit_code == 0 and "strategies" not in dp, r.output[-2000:]
    assert abs(dp["peak_reserved_bytes"] - plain["peak_reserved_bytes"]) <= 4096


@pytest.mark.parametrize("cut", [2, 3])
def test_a_split_script_is_estimated_at_its_own_cut(cut):
    """dispatch_model with the script's map: each GPU as the model file's split at that cut
    (the Python API takes the cut; `parallel` would pick its own best)."""
    from oomdoctor.models.loader import load_model_file
    from oomdoctor.plans import parallel as par
    from oomdoctor.plans.estimate import Budget, trace_for
    from oomdoctor.sim.gpus import get_profile
    from oomdoctor.sim.trace import TraceConfig
    r, doc = _estimate("--spread", "split", "--cut", str(cut), "--batch-size", "8")
    assert r.exit_code == 0, r.output[-2000:]
    assert doc["strategies"][0]["strategy"] == "pipeline2"
    spec = load_model_file(MODEL)
    budget = Budget(get_profile("rtx3090"))
    trace = trace_for(spec, TraceConfig(8), budget.gpu)
    layout = par.model_layout(spec, "fp32")
    want = par.estimate_strategy(trace, layout, par.Strategy("pipeline2", 2), budget,
                                 cut=layout.blocks.index(f"layers.{cut}"))
    _close(_per_gpu(doc), [g.device_peak_bytes for g in want.gpus])


@pytest.mark.parametrize("device_map,words", [
    ({"embed": 0, "layers": 1, "norm": "cpu", "head": "cpu"}, "offload"),
    ({"embed": 0, "layers": 1, "norm": 2, "head": 2}, "3 GPUs"),
    ({"embed": 0, "layers.0": 1, "layers.1": 0, "layers.2": 1, "layers.3": 1, "norm": 1,
      "head": 1}, "one cut"),
])
def test_a_split_oomdoctor_cannot_replay_is_named(device_map, words):
    """Offload, more than two GPUs, more than one cut: one line that names it, exit 3."""
    r, _ = _estimate("--spread", "split", "--map", json.dumps(device_map), "--batch-size", "8",
                     env={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert r.exit_code == 3, r.output[-2000:]
    assert words in r.output and "Traceback" not in r.output


def test_parallel_plans_a_dataparallel_scripts_model_across_the_strategies():
    """`parallel -- <a DataParallel script>`: its run is the model whole on one GPU, as a
    single-GPU script's; every strategy is planned for that model (the advice a DataParallel
    user needs: DDP), each as for the same script without DataParallel, with a note."""
    def plan(spread):
        r = CliRunner().invoke(cli, ["parallel", *CARD, "--gpus", "2", "--json", "--",
                                     sys.executable, SCRIPT, "--model", MODEL, "--spread",
                                     spread, "--batch-size", "8"], env=TWO)
        assert r.exit_code in (0, 1), r.output[-2000:]
        return {s["strategy"]: s for s in json.loads(r.stdout)["strategies"]}
    with_dp, plain = plan("dp"), plan("none")
    assert set(with_dp) == set(plain) and "ddp" in with_dp
    assert _per_gpu({"strategies": [with_dp["ddp"]]}) == _per_gpu({"strategies": [plain["ddp"]]})
    assert any("DataParallel set aside" in n for n in with_dp["ddp"]["notes"])


def test_a_deepspeed_script_without_deepspeed_installed_says_what_to_do(tmp_path):
    """Its import fails: one line with the two ways on (install it, or plan the model with
    `parallel --ds-config`), exit 3. (With DeepSpeed installed the script is estimated per
    GPU: tests/test_deepspeed_script.py.)"""
    import importlib.util
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("DeepSpeed is installed here")
    script = tmp_path / "train_ds.py"
    script.write_text("import torch, deepspeed\n")
    r = CliRunner().invoke(cli, ["estimate", *CARD, "--", sys.executable, str(script)])
    assert r.exit_code == 3, r.output[-2000:]
    assert "install DeepSpeed" in r.output and "--ds-config" in r.output


def test_readme_example_runs(monkeypatch):
    """README's DataParallel example, as printed (its environment prefix set as the shell
    would): the per-GPU dp report."""
    import re
    import shlex
    root = os.path.dirname(HERE)
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        [line] = [b.strip() for b in re.findall(r"```bash\n(.*?)```", f.read(), re.S)
                  if b.startswith("CUDA_VISIBLE_DEVICES=0,1 oomdoctor estimate")]
    env, words = shlex.split(line)[0], shlex.split(line)[2:]
    monkeypatch.chdir(root)
    r = CliRunner().invoke(cli, words, env=dict([env.split("=", 1)]))
    assert r.exit_code == 0, r.output[-2000:]
    assert "dp x2" in r.output and "the script's DataParallel over GPUs 0, 1" in r.output


DROPOUT_LM = f"""import sys
sys.path.insert(0, {os.path.join(HERE, "models")!r})
import torch.nn as nn
import plan_lm
from plan_lm import make_batch, loss_fn
class DropLM(plan_lm.PlanLM):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)
    def forward(self, ids):
        x = self.drop(self.embed(ids))
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))
def build_model():
    return DropLM()
"""


def test_a_device_map_need_not_name_a_block_without_parameters(tmp_path):
    """accelerate places parameters; a dropout between the embedding and the first layer is in
    no map (its check_device_map passes without it) and runs on the GPU of the block before."""
    model = tmp_path / "drop_lm.py"
    model.write_text(DROPOUT_LM)
    dmap = {"embed": 0, "layers.0": 0, "layers.1": 0, "layers.2": 1, "layers.3": 1, "norm": 1,
            "head": 1}
    r = CliRunner().invoke(cli, ["estimate", *CARD, "--json", "--", sys.executable, SCRIPT,
                                 "--model", str(model), "--spread", "split", "--map",
                                 json.dumps(dmap), "--batch-size", "8"], env=TWO)
    assert r.exit_code == 0, r.output[-2000:]
    [est] = json.loads(r.stdout)["strategies"]
    assert est["partition"]["stages"][0][:2] == ["embed", "drop"]


def test_a_batch_smaller_than_dataparallels_gpus_is_named():
    r, _ = _estimate("--spread", "dp", "--batch-size", "2", env={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert r.exit_code == 3, r.output[-2000:]
    assert "smaller than the 3 GPUs" in r.output
