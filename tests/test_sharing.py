"""Several trainings on the same GPUs (issue #24 item 5): recommend --trainings N."""
import json
import os

from click.testing import CliRunner

from oomdoctor.cli import EXIT_OK, cli
from oomdoctor.plans.estimate import Budget
from oomdoctor.plans.recommend.sharing import other_process_note, side_by_side_budget
from oomdoctor.sim.gpus import get_profile

ROOT = os.path.dirname(os.path.dirname(__file__))
MLP = os.path.join(ROOT, "sample_models", "tiny_mlp.py")
# A card small enough that tiny_mlp's micro-batch depends on the memory it gets.
CARD = ("--memory", "160MiB", "--overhead", "40MiB", "--margin", "0", "--target-batch", "4096",
        "--precision", "fp32", "--quick")


def _recommend(*args):
    res = CliRunner().invoke(cli, ["recommend", MLP, *CARD, "--json", *args])
    assert res.exit_code == EXIT_OK, res.output
    return json.loads(res.stdout)


def test_side_by_side_budget_splits_what_is_left_after_each_context():
    """N processes on one card: each holds its own CUDA context, the rest is split evenly."""
    budget = Budget(get_profile("rtx3090"), margin=0.05)
    ctx, alone = budget.cuda_context_bytes, budget.limit_bytes
    for n in (2, 3, 4):
        each = side_by_side_budget(budget, n).limit_bytes
        assert each == (alone - (n - 1) * ctx) // n
        assert n * each + (n - 1) * ctx <= alone < n * (each + 1) + (n - 1) * ctx


def test_three_ways_against_recommend_on_their_own_hardware():
    """Each way's plan is what recommend says for that hardware and budget by itself: one per
    GPU = recommend on one GPU; one after the other = the plan on both; side by side = the
    plan with half the memory, at half the compute."""
    d = _recommend("--num-gpus", "2", "--trainings", "2", "-j", "2")
    ways = {w["name"]: w for w in d["sharing"]["ways"]}
    assert set(ways) == {"one per GPU", "one after the other", "side by side"}
    alone, one_gpu = d["best"], _recommend("--num-gpus", "1")["best"]
    assert ways["one after the other"]["plan"]["micro_batch"] == alone["micro_batch"]
    assert ways["one after the other"]["makespan"] == 2.0
    own = ways["one per GPU"]["plan"]
    assert (own["num_gpus"], own["micro_batch"]) == (1, one_gpu["micro_batch"])
    assert ways["one per GPU"]["makespan"] == alone["samples_per_second"] / own["samples_per_second"]
    side = ways["side by side"]["plan"]
    half = _recommend("--num-gpus", "2", "--other", str(_half_other()) + "B")["best"]
    assert side["micro_batch"] == half["micro_batch"] < alone["micro_batch"]
    assert ways["side by side"]["makespan"] == 2 * alone["samples_per_second"] / side["samples_per_second"]
    assert d["sharing"]["best"] == min(ways.values(), key=lambda w: w["makespan"])["name"]


def _half_other() -> int:
    """--other that leaves one of two processes its share: the other's context and half."""
    from oomdoctor.sim.gpus import custom_profile, parse_size
    budget = Budget(custom_profile(parse_size("160MiB")), margin=0.0,
                    context_bytes=parse_size("40MiB"))
    return side_by_side_budget(budget, 2).other_bytes


def test_text_says_the_ways_and_the_other_process_compute():
    res = CliRunner().invoke(cli, ["recommend", MLP, *CARD, "--num-gpus", "2", "--trainings",
                                   "2", "-j", "1"])
    assert res.exit_code == EXIT_OK, res.output
    assert "2 trainings on these 2 GPUs" in res.stdout
    assert "CUDA_VISIBLE_DEVICES=0 / CUDA_VISIBLE_DEVICES=1" in res.stdout or \
        "-> one per GPU" not in res.stdout
    budget = Budget(get_profile("rtx3090"), other_bytes=2**30)
    assert "time-slices" in other_process_note(budget) and other_process_note(Budget(
        get_profile("rtx3090"))) == ""
    res = CliRunner().invoke(cli, ["recommend", MLP, *CARD, "--num-gpus", "2", "--other",
                                   "8MiB", "-j", "1"])
    assert "if that process computes too" in res.stdout
