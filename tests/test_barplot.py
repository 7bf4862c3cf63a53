"""`probe --plot` and `recommend --plot` (issue #21): the bars against the results, not pixels."""
import json
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from oomdoctor.cli import EXIT_OK, cli
from oomdoctor.plans.barplot import STACKED, bar_figure, probe_bars, strategy_bars

pytest.importorskip("matplotlib")
ROOT = os.path.dirname(os.path.dirname(__file__))
BLOCKS = os.path.join(ROOT, "tests", "models", "tiny_blocks.py")
MLP = os.path.join(ROOT, "sample_models", "tiny_mlp.py")


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """A 1 GiB card, so the batch search ends below the cap and the budget line is drawn."""
    path = tmp_path_factory.mktemp("plot") / "probe.html"
    res = CliRunner().invoke(cli, ["probe", BLOCKS, "--memory", "1GiB", "--max-batch-size",
                                   "4096", "-j", "1", "--precision", "fp32", "--precision",
                                   "fp16", "--checkpointing", "--plot", str(path), "--json"])
    assert res.exit_code == EXIT_OK, res.output
    return json.loads(res.stdout), path


def test_probe_bars_are_each_configuration_at_its_max_batch(probed):
    doc, path = probed
    bars = doc["plot"]["bars"]
    assert doc["plot"]["path"] == str(path)
    assert doc["plot"]["budget_bytes"] == doc["budget_bytes"]
    assert len(bars) == len(doc["results"]) == 2
    for bar, r in zip(bars, doc["results"]):
        assert bar["label"] == r["precision"] + " + ckpt"
        assert bar["reserved_bytes"] == r["peak_reserved_bytes"]
        # the allocator's reserve is the categories + its overhead: the stack adds up to it
        assert bar["reserved_bytes"] == sum(v for k, v in r["breakdown"].items()
                                            if k != "cuda_context")
        assert bar["note"] == f"batch {r['max_batch_size']}" and r["max_batch_size"] < 4096
        assert bar["fits"] and bar["reserved_bytes"] <= doc["budget_bytes"]
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "<script" not in page and " src=" not in page and "<link" not in page


def _probe_result():
    from oomdoctor.models.loader import load_model
    from oomdoctor.plans.estimate import Budget
    from oomdoctor.plans.probe import probe
    from oomdoctor.sim.gpus import custom_profile
    from oomdoctor.sim.trace import TraceConfig
    budget = Budget(custom_profile(2 ** 30))
    return probe(load_model(BLOCKS), TraceConfig(1), budget, [("fp16", True)], max_batch=4096)


def test_the_figure_draws_those_bars_and_the_budget():
    r = _probe_result()
    (c,) = r.results
    b = probe_bars(r)
    assert b.totals == (c.estimate.peak_reserved_bytes,)
    assert {k: v[0] for k, v in b.stacks.items()} == {
        k: n for k, n in c.estimate.breakdown.items() if k in STACKED and n}
    fig = bar_figure(b)
    ax = fig.axes[0]
    scale = 2 ** 20          # a 1 GiB card: MiB
    heights = {cont.get_label(): [p.get_height() * scale for p in cont.patches]
               for cont in ax.containers}
    assert heights == {k.replace("_", " "): pytest.approx(list(v)) for k, v in b.stacks.items()}
    (budget,) = [ln for ln in ax.lines if ln.get_label().startswith("budget")]
    assert budget.get_ydata()[0] * scale == pytest.approx(r.budget_bytes)
    assert any(t.get_text() == f"batch {c.max_batch_size}" for t in ax.texts)
    # nothing fits: the batch-1 estimate is drawn and said to be that
    none = probe_bars(replace(r, results=(replace(c, max_batch_size=None),)))
    assert none.notes == ("none fits\n(batch 1)",) and none.fits == (False,)


def test_recommend_plot_is_every_strategy_per_gpu(tmp_path):
    path = tmp_path / "gpus.svg"
    res = CliRunner().invoke(cli, ["recommend", MLP, "--gpu", "rtx3090", "--num-gpus", "2",
                                   "--target-batch", "64", "-j", "1", "--precision", "fp16",
                                   "--plot", str(path), "--json"])
    assert res.exit_code == EXIT_OK, res.output
    doc = json.loads(res.stdout)
    gpus = [(e["strategy"], g) for e in doc["by_strategy"] for g in e["gpus"]]
    bars = doc["plot"]["bars"]
    assert len(bars) == len(gpus) >= 6                    # zero1 and pipeline2: a bar per GPU
    for bar, (strategy, g) in zip(bars, gpus):
        assert bar["label"].startswith(strategy)
        assert bar["reserved_bytes"] == g["peak_reserved_bytes"] == \
            sum(v for k, v in g["breakdown"].items() if k != "cuda_context")
        assert bar["fits"] == g["fits"]
    assert path.read_text().lstrip().startswith("<?xml") and "<svg" in path.read_text()


def test_recommend_plot_with_nothing_traced_says_why():
    with pytest.raises(ValueError, match="nothing to draw; drop --quick"):
        strategy_bars(SimpleNamespace(by_strategy=()))


def test_plot_needs_a_known_format_before_any_tracing():
    for cmd in (["probe", BLOCKS], ["recommend", BLOCKS, "--gpu", "rtx3090"]):
        res = CliRunner().invoke(cli, [*cmd, "--plot", "bars.jpg"])
        assert res.exit_code == 2 and ".png, .svg or .html" in res.stderr, res.output
