"""`estimate --plot` (issue #21): the figure's data against the estimate, not its pixels."""
import json
import os

import pytest
from click.testing import CliRunner

from oomdoctor.cli import EXIT_OK, cli
from oomdoctor.models.loader import load_model
from oomdoctor.plans.estimate import Budget
from oomdoctor.plans.snapshot import estimate_views
from oomdoctor.plans.stepplot import CATEGORIES, figure
from oomdoctor.sim.gpus import PROFILES
from oomdoctor.sim.trace import TraceConfig

pytest.importorskip("matplotlib")
ROOT = os.path.dirname(os.path.dirname(__file__))
BLOCKS = os.path.join(ROOT, "tests", "models", "tiny_blocks.py")


@pytest.fixture(scope="module")
def views():
    est, _, series = estimate_views(load_model(BLOCKS), TraceConfig(64),
                                    Budget(PROFILES["rtx3090"]), snapshot=False, series=True)
    return est, series


def test_series_at_the_peak_are_the_breakdown(views):
    est, s = views
    p = s.peak_index
    for c in CATEGORIES:
        assert s.categories[c][p] == est.breakdown[c], c
    assert s.allocated[p] == est.peak_allocated_bytes == max(s.allocated)
    assert max(s.reserved) == est.peak_reserved_bytes
    # the stack is the live requests; allocated counts whole blocks (at most 512 B more each)
    assert 0 <= s.allocated[p] - sum(s.categories[c][p] for c in CATEGORIES)
    assert [n for _, n in s.phases][:3] == ["setup 1", "data 1", "forward 1"]
    assert s.peak_live[0] == max(((c, s.categories[c][p]) for c in CATEGORIES),
                                 key=lambda kv: kv[1])


def test_figure_draws_those_series(views):
    est, s = views
    fig = figure(s, est)
    ax = fig.axes[0]
    scale = 2 ** 20 if max(s.reserved) < 2 ** 30 else 2 ** 30
    lines = {ln.get_label(): ln for ln in ax.lines}
    assert list(lines["allocated"].get_ydata()) == [v / scale for v in s.allocated]
    assert max(lines["reserved"].get_ydata()) * scale == est.peak_reserved_bytes
    # one filled area per category, in the breakdown's order
    assert [c.get_label() for c in ax.collections][:len(CATEGORIES)] == \
        [c.replace("_", " ") for c in CATEGORIES]
    assert any("peak" in t.get_text() for t in ax.texts)


def test_cli_plot_formats(tmp_path):
    for ext in ("png", "svg", "html"):
        path = tmp_path / f"step.{ext}"
        res = CliRunner().invoke(cli, ["estimate", BLOCKS, "-b", "64", "--gpu", "rtx3090",
                                       "--plot", str(path), "--json"])
        assert res.exit_code == EXIT_OK, res.output
        doc = json.loads(res.stdout)
        assert doc["plot"]["path"] == str(path) and path.stat().st_size > 1000
        assert sum(doc["plot"]["at_peak"].values()) == sum(
            doc["breakdown"][c] for c in CATEGORIES)
    page = (tmp_path / "step.html").read_text()
    # one self-contained page: the SVG inline, nothing fetched
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "<script" not in page and " src=" not in page and "<link" not in page
    res = CliRunner().invoke(cli, ["estimate", BLOCKS, "-b", "2", "--plot", "x.jpg"])
    assert res.exit_code == 2 and ".png, .svg or .html" in res.stderr
