"""`oomdoctor watch`: the summary from synthetic samples, the runner with a fake sampler."""
import json
import sys

import pytest
from click.testing import CliRunner

from oomdoctor.runs import nvml, watch
from oomdoctor.cli import cli
from oomdoctor.sim.gpus import GiB
from oomdoctor.runs.watch import Reading, Tick

TOTAL = 24 * GiB


def ticks(utils_per_gpu, used=GiB, dt=1.0):
    """One tick per second; utils_per_gpu[g][i] is GPU g's util at second i."""
    n = len(utils_per_gpu[0])
    return [Tick(i * dt, tuple(Reading(g, used, TOTAL, u[i]) for g, u in enumerate(utils_per_gpu)))
            for i in range(n)]


def test_alternating_halves_overlap_zero():
    s = watch.summarize(ticks([[90] * 5 + [0] * 5, [0] * 5 + [90] * 5]), 10.0)
    assert s.overlap_s == 0.0 and s.overlap_share == 0.0
    assert [g.busy_s for g in s.gpus] == [5.0, 5.0]


def test_both_busy_whole_time_overlap_full():
    s = watch.summarize(ticks([[80] * 10, [95] * 10]), 10.0)
    assert s.overlap_s == 10.0 and s.overlap_share == 1.0
    assert s.warnings == ()


def test_overlap_is_time_weighted_and_threshold_is_10_percent():
    # both busy for 3 of 4 s; util 9 is not busy, 10 is
    s = watch.summarize(ticks([[50, 10, 50, 50], [50, 50, 9, 50]]), 4.0)
    assert s.overlap_s == 3.0 and s.overlap_share == 0.75
    # uneven spacing: the tick at t=0 stands for 3 s, the one at t=3 for 1 s
    t = [Tick(0.0, (Reading(0, 0, TOTAL, 50), Reading(1, 0, TOTAL, 50))),
         Tick(3.0, (Reading(0, 0, TOTAL, 50), Reading(1, 0, TOTAL, 0)))]
    assert watch.summarize(t, 4.0).overlap_share == 0.75


def test_peak_and_percentiles():
    utils = list(range(0, 100, 5))          # 20 samples: 0, 5, ..., 95
    t = [Tick(i, (Reading(0, (i + 1) * GiB, TOTAL, u),)) for i, u in enumerate(utils)]
    g = watch.summarize(t, 20.0).gpus[0]
    assert g.peak_used_bytes == 20 * GiB and g.total_bytes == TOTAL
    assert g.util_mean == 47.5 and g.util_p50 == 45.0 and g.util_p95 == 90.0


def test_percentile_nearest_rank():
    assert watch.percentile([0, 100], 50) == 0.0
    assert watch.percentile([7], 95) == 7.0


def test_warning_mostly_idle():
    s = watch.summarize(ticks([[20] * 10, [25] * 10]), 10.0, cores=16)
    w = [w for w in s.warnings if "mostly idle" in w]
    assert len(w) == 1 and "num_workers" in w[0] and "pin_memory" in w[0]
    assert "OMP_NUM_THREADS=8" in w[0]          # 16 cores / 2 processes


def test_warning_one_gpu_idle():
    s = watch.summarize(ticks([[95] * 10, [0] * 10]), 10.0)
    w = [w for w in s.warnings if "stayed idle" in w]
    assert len(w) == 1 and w[0].startswith("GPU 1 stayed idle while GPU 0 worked")
    assert not any("mostly idle" in w for w in s.warnings)   # the working GPU was busy


def test_warning_memory_near_limit():
    s = watch.summarize(ticks([[90] * 10], used=int(0.95 * TOTAL)), 10.0)
    assert any("GPU 0 peaked at 22.80 of 24.00 GiB (95%)" in w for w in s.warnings)
    assert not watch.summarize(ticks([[90] * 10], used=int(0.85 * TOTAL)), 10.0).warnings


def test_no_sampling_reports_time_only():
    s = watch.summarize([], 3.25, ["python", "x.py"], 0,
                        sampling_error="GPU sampling unavailable: no driver")
    assert not s.sampling and s.gpus == () and s.warnings == ()
    text = watch.render_text(s)
    assert "exited 0 after 3.2 s" in text or "exited 0 after 3.3 s" in text
    assert "GPU sampling unavailable" in text and "only the time" in text
    json.dumps(s.to_json())


# -- the runner -------------------------------------------------------------------------------

def test_runner_passes_exit_code_and_output_through(capfd):
    calls = []

    def sampler():
        calls.append(1)
        return [Reading(0, GiB, TOTAL, 50)]
    r = watch.run_watched([sys.executable, "-c",
                           "import sys,time; print('out'); print('err', file=sys.stderr); "
                           "time.sleep(0.3); sys.exit(7)"], sampler, interval_s=0.02)
    out, err = capfd.readouterr()
    assert r.exit_code == 7 and out == "out\n" and err == "err\n"
    # One tick per sampler call, except a last call that can land between the child's exit and
    # the sampler's stop: run_watched drops it (it describes the GPU after the run).
    assert r.sampling_error is None and len(r.ticks) >= 3 and len(calls) - len(r.ticks) in (0, 1)
    assert r.duration_s >= 0.3 and all(0 <= k.t <= r.duration_s for k in r.ticks)


def test_runner_without_sampler_and_with_a_failing_one(capfd):
    r = watch.run_watched([sys.executable, "-c", "pass"], None, unavailable="no NVML")
    assert r.exit_code == 0 and r.ticks == () and r.sampling_error == "no NVML"

    def broken():
        raise RuntimeError("GPU is lost")
    r = watch.run_watched([sys.executable, "-c", "import time; time.sleep(0.1)"], broken, 0.01)
    assert r.exit_code == 0 and r.sampling_error == "GPU sampling stopped: GPU is lost"


def test_runner_signal_exit_code():
    r = watch.run_watched([sys.executable, "-c", "import os,signal; os.kill(os.getpid(), "
                           "signal.SIGTERM)"], None)
    assert r.exit_code == 128 + 15


def test_runner_command_not_found():
    with pytest.raises(watch.CommandError, match="command not found") as e:
        watch.run_watched(["oomdoctor-no-such-command-xyz"], None)
    assert e.value.exit_code == 127


# -- the command ------------------------------------------------------------------------------

@pytest.fixture
def no_driver(monkeypatch):
    def init(self, lib=None):
        self._lib, self._ready, self.error = None, False, "NVML could not start (test)"
    monkeypatch.setattr(nvml.Nvml, "__init__", init)


def test_cli_watch_without_nvml(no_driver, capfd):
    res = CliRunner().invoke(cli, ["watch", "--", sys.executable, "-c",
                                   "import sys; sys.exit(3)"])
    assert res.exit_code == 3
    assert "exited 3" in res.stderr and "GPU sampling unavailable" in res.stderr
    assert res.stdout == ""


def test_cli_watch_json_file(no_driver, tmp_path):
    path = tmp_path / "r.json"
    res = CliRunner().invoke(cli, ["watch", "--json", str(path), sys.executable, "-c", "pass"])
    assert res.exit_code == 0, res.output
    d = json.loads(path.read_text())
    assert d["exit_code"] == 0 and d["sampling"] is False and d["gpus"] == []
    assert d["command"][0] == sys.executable and "report written" in res.stderr


def test_cli_watch_command_options_are_not_ours(no_driver):
    # `--json` after the command belongs to the command, not to watch
    res = CliRunner().invoke(cli, ["watch", sys.executable, "-c",
                                   "import sys; sys.exit(len(sys.argv))", "--json"])
    assert res.exit_code == 2


def test_cli_watch_plot_without_matplotlib(no_driver, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import raises ImportError
    res = CliRunner().invoke(cli, ["watch", "--plot", "x.png", "--", sys.executable, "-c", "1"])
    assert res.exit_code == 2 and "needs matplotlib" in res.stderr


def test_cli_watch_samples_visible_gpus_through_fake_nvml(monkeypatch):
    from test_nvml import FakeNvml, rtx3090
    fake = FakeNvml([rtx3090(used=23 * GiB, util=80), rtx3090(util=0)])
    monkeypatch.setattr(nvml.Nvml, "__init__", lambda self, lib=None: (
        setattr(self, "_lib", fake), setattr(self, "_ready", None),
        setattr(self, "error", None))[0])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    res = CliRunner().invoke(cli, ["watch", "--interval", "0.02", "--", sys.executable, "-c",
                                   "import time; time.sleep(0.3)"])
    assert res.exit_code == 0, res.stderr
    assert "GPU 0: 23552/24576 MiB (95.8%) peak" in res.stderr
    assert "GPU 1" not in res.stderr                   # hidden by CUDA_VISIBLE_DEVICES
    assert "peaked at 23.00 of 24.00 GiB" in res.stderr


# ----------------------------------------------------------------------------- the plot

def test_plot_draws_each_gpus_memory_capacity_and_utilisation(tmp_path):
    """The figure's lines carry the samples (GiB, %), a dashed capacity line per GPU, and a gap
    (NaN) where NVML gave no utilisation; the PNG on disk has the figure's 900 x 500 pixels."""
    pytest.importorskip("matplotlib")
    import math

    import matplotlib.image
    import matplotlib.pyplot as plt
    samples = [Tick(0.0, (Reading(0, 2 * GiB, TOTAL, 10), Reading(1, GiB, 12 * GiB, None))),
               Tick(0.5, (Reading(0, 20 * GiB, TOTAL, 95), Reading(1, 3 * GiB, 12 * GiB, 40))),
               Tick(1.0, (Reading(0, 22 * GiB, TOTAL, 99), Reading(1, 3 * GiB, 12 * GiB, 41)))]
    fig = watch.figure(samples)
    ax_m, ax_u = fig.axes
    mem = [list(line.get_ydata()) for line in ax_m.lines]
    # GPU 0's samples, its 24 GiB capacity, GPU 1's samples, its 12 GiB capacity.
    assert mem[0] == [2.0, 20.0, 22.0] and mem[2] == [1.0, 3.0, 3.0]
    assert mem[1] == [24.0, 24.0] and mem[3] == [12.0, 12.0]
    assert ax_m.lines[1].get_linestyle() == "--"
    util = [list(line.get_ydata()) for line in ax_u.lines]
    assert util[0] == [10, 95, 99]
    assert math.isnan(util[1][0]) and util[1][1:] == [40, 41]
    assert list(ax_m.lines[0].get_xdata()) == [0.0, 0.5, 1.0]
    plt.close(fig)
    path = tmp_path / "run.png"
    watch.plot(samples, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(str(path)).shape[:2] == (500, 900)


def test_cli_watch_plot_writes_the_png(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    from test_nvml import FakeNvml, rtx3090
    fake = FakeNvml([rtx3090(used=5 * GiB, util=60)])
    monkeypatch.setattr(nvml.Nvml, "__init__", lambda self, lib=None: (
        setattr(self, "_lib", fake), setattr(self, "_ready", None),
        setattr(self, "error", None))[0])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "gpus.png"
    res = CliRunner().invoke(cli, ["watch", "--interval", "0.02", "--plot", str(path), "--",
                                   sys.executable, "-c", "import time; time.sleep(0.2)"])
    assert res.exit_code == 0, res.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
