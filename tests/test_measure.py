"""The measured probe's search and cleanup, on a fake-OOM runner, and one real CPU run."""
from __future__ import annotations

import os

import pytest
import torch

from oomdoctor.models.loader import load_model_file
from oomdoctor.models.spec import ModelFileError
from oomdoctor.runs.measure import (MeasureError, MeasuredProbe, TorchRunner, measured_probe,
                               profile_for_device)
from oomdoctor.sim.trace import TraceConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "sample_models", "tiny_mlp.py")
MiB = 2**20


class FakeRunner:
    """A device with an OOM threshold: batch b needs ``b`` MiB; above ``threshold`` it raises
    torch.OutOfMemoryError part-way, with its memory still "allocated" until cleanup."""

    device = "fake:0"

    def __init__(self, threshold: int, raise_at: dict[int, BaseException] | None = None,
                 base_allocated: int = 7 * MiB) -> None:
        self.threshold = threshold
        self.raise_at = raise_at or {}
        self.base = base_allocated          # what the caller held before the probe
        self.allocated = base_allocated
        self.reserved = base_allocated
        self.peak = (0, 0)
        self.log: list[tuple[str, int | None]] = []   # ("train", b) / ("cleanup", None)

    def device_name(self) -> str:
        return "Fake GPU"

    def memory(self):
        return self.allocated, self.reserved

    def reset_peaks(self) -> None:
        self.peak = (self.allocated, self.reserved)

    def peaks(self):
        return self.peak

    def train(self, spec, cfg) -> None:
        b = cfg.batch_size
        self.log.append(("train", b))
        # Allocate as a real step would; a trial that fails leaves its tensors behind.
        self.allocated += min(b, self.threshold + 1) * MiB
        self.reserved = max(self.reserved, self.allocated)
        self.peak = (max(self.peak[0], self.allocated), max(self.peak[1], self.reserved))
        if b in self.raise_at:
            raise self.raise_at[b]
        if b > self.threshold:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {b} MiB.\nmore")
        self.allocated -= b * MiB             # a finished step drops its activations

    def cleanup(self) -> None:
        self.log.append(("cleanup", None))
        self.allocated = self.base
        self.reserved = self.base

    def trained(self) -> list[int]:
        return [b for what, b in self.log if what == "train"]

    def assert_cleaned_after_every_trial(self) -> None:
        for i, (what, _) in enumerate(self.log):
            if what == "train":
                assert i + 1 < len(self.log) and self.log[i + 1][0] == "cleanup", self.log


@pytest.fixture(scope="module")
def spec():
    return load_model_file(TINY)


@pytest.mark.parametrize("threshold", [1, 2, 3, 7, 8, 37, 100, 1000])
@pytest.mark.parametrize("seed_offset", [None, 0, 1, -1, 3, -3, 20])
def test_finds_the_threshold(spec, threshold, seed_offset):
    runner = FakeRunner(threshold)
    seed = None if seed_offset is None else max(0, threshold + seed_offset)
    r = measured_probe(spec, TraceConfig(1), predicted_max=seed, runner=runner, max_batch=4096)
    assert r.max_batch_size == threshold
    assert not r.capped
    # Every trial's verdict matches the device, and no batch runs twice.
    assert all(t.fits == (t.batch_size <= threshold) for t in r.trials)
    assert len(runner.trained()) == len(set(runner.trained())) == r.num_trials
    runner.assert_cleaned_after_every_trial()
    assert (r.allocated_after, r.reserved_after) == (r.allocated_before, r.reserved_before)


def test_good_seed_needs_at_most_three_trials_and_fewer_than_doubling(spec):
    for threshold in (5, 37, 300, 1000):
        for offset in (0, 1, -1):
            seeded = measured_probe(spec, TraceConfig(1), predicted_max=threshold + offset,
                                    runner=FakeRunner(threshold))
            assert seeded.max_batch_size == threshold
            assert seeded.num_trials <= 3, [t.batch_size for t in seeded.trials]
        plain = measured_probe(spec, TraceConfig(1), runner=FakeRunner(threshold))
        assert plain.max_batch_size == threshold
        assert plain.num_trials > 3
        assert plain.predicted_max_batch_size is None


def test_exact_seed_trials_the_prediction_then_one_above(spec):
    runner = FakeRunner(37)
    r = measured_probe(spec, TraceConfig(1), predicted_max=37, runner=runner)
    assert runner.trained() == [37, 38]
    assert [t.fits for t in r.trials] == [True, False]
    oom = r.trials[1]
    assert oom.error == "CUDA out of memory. Tried to allocate 38 MiB."
    assert oom.max_memory_allocated == 7 * MiB + 38 * MiB     # measured at the OOM


def test_nothing_fits(spec):
    class Never(FakeRunner):
        def train(self, spec, cfg):
            self.log.append(("train", cfg.batch_size))
            raise torch.OutOfMemoryError("CUDA out of memory.")
    for seed in (None, 0, 1, 5):
        runner = Never(0)
        r = measured_probe(spec, TraceConfig(1), predicted_max=seed, runner=runner)
        assert r.max_batch_size is None
        assert 1 in runner.trained()
        runner.assert_cleaned_after_every_trial()


@pytest.mark.parametrize("seed", [None, 10, 64, 500])
def test_capped_at_max_batch(spec, seed):
    runner = FakeRunner(10**6)
    r = measured_probe(spec, TraceConfig(1), predicted_max=seed, runner=runner, max_batch=64)
    assert (r.max_batch_size, r.capped) == (64, True)
    assert max(runner.trained()) == 64


def test_predicted_bytes_recorded_next_to_measured(spec):
    r = measured_probe(spec, TraceConfig(1), predicted_max=4, runner=FakeRunner(4),
                       predict=lambda b: (b * MiB, 2 * b * MiB))
    for t in r.trials:
        assert (t.predicted_allocated_bytes, t.predicted_reserved_bytes) == (
            t.batch_size * MiB, 2 * t.batch_size * MiB)
        assert t.max_memory_allocated is not None
    d = r.to_json()
    assert d["num_trials"] == len(d["trials"]) == 2
    assert isinstance(d["trials"][0]["max_memory_reserved"], int)


def test_progress_reports_each_trial(spec):
    lines: list[str] = []
    measured_probe(spec, TraceConfig(1, precision="bf16", checkpointing=True), predicted_max=3,
                   runner=FakeRunner(3), progress=lines.append)
    assert lines == ["bf16 + checkpointing: batch size 3 fits (peak reserved 0.01 GiB)",
                     "bf16 + checkpointing: batch size 4 does not fit (peak reserved 0.01 GiB)"]


def test_keyboard_interrupt_cleans_up_and_propagates(spec):
    runner = FakeRunner(100, raise_at={101: KeyboardInterrupt()})
    with pytest.raises(KeyboardInterrupt):
        measured_probe(spec, TraceConfig(1), predicted_max=100, runner=runner)
    assert runner.trained() == [100, 101]
    assert runner.log[-1] == ("cleanup", None)
    runner.assert_cleaned_after_every_trial()
    assert runner.memory() == (7 * MiB, 7 * MiB)


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: an illegal memory access"),
                                   ModelFileError("model.py: loss_fn raised ValueError: x"),
                                   ValueError("shape mismatch")])
def test_non_oom_errors_propagate_after_cleanup(spec, error):
    runner = FakeRunner(100, raise_at={50: error})
    with pytest.raises(type(error), match=str(error)[:10]):
        measured_probe(spec, TraceConfig(1), predicted_max=50, runner=runner)
    assert runner.log[-1] == ("cleanup", None)
    assert runner.memory() == (7 * MiB, 7 * MiB)


def test_bad_arguments(spec):
    with pytest.raises(MeasureError, match="max_batch must be >= 1"):
        measured_probe(spec, TraceConfig(1), runner=FakeRunner(3), max_batch=0)
    with pytest.raises(MeasureError, match="predicted_max must be >= 0"):
        measured_probe(spec, TraceConfig(1), runner=FakeRunner(3), predicted_max=-1)
    with pytest.raises(MeasureError, match="not supported"):
        TorchRunner("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_says_so(spec):
    with pytest.raises(MeasureError, match="sees none.*without --device"):
        measured_probe(spec, TraceConfig(1), device="cuda", predicted_max=4)


@pytest.mark.parametrize("precision,checkpointing", [("fp32", False), ("bf16", False),
                                                     ("bf16-pure", True)])
def test_real_cpu_trials_end_to_end(spec, precision, checkpointing):
    """The real runner on device "cpu": the training loop runs for real (2 optimizer steps),
    no CUDA call is made and the memory numbers are None. max_batch caps the search, since
    nothing OOMs on the host."""
    # tiny_mlp has no ModuleList of blocks: checkpoint its Linear layers by class name.
    cfg = TraceConfig(1, precision=precision, checkpointing=checkpointing,
                      checkpoint_class="Linear" if checkpointing else None)
    r = measured_probe(spec, cfg, device="cpu", predicted_max=3, max_batch=4,
                       predict=lambda b: (b, b))
    assert isinstance(r, MeasuredProbe)
    assert (r.max_batch_size, r.capped) == (4, True)
    assert [t.batch_size for t in r.trials] == [3, 4]
    assert all(t.fits and t.max_memory_allocated is None and t.max_memory_reserved is None
               for t in r.trials)
    assert (r.device, r.device_name, r.allocated_before, r.reserved_after) == (
        "cpu", "cpu", None, None)


def test_real_cpu_trial_trains(spec, monkeypatch):
    """The trial really steps the optimizer twice (the simulator's 2 steps)."""
    steps = []
    orig = torch.optim.AdamW.step

    def counting(self, *a, **k):
        steps.append(1)
        return orig(self, *a, **k)
    monkeypatch.setattr(torch.optim.AdamW, "step", counting)
    TorchRunner("cpu").train(spec, TraceConfig(2))
    assert len(steps) == 2


def test_real_cpu_model_errors_propagate(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n"
                   "def build_model():\n    return torch.nn.Linear(4, 2)\n"
                   "def make_batch(b):\n    return torch.randn(b, 5)\n"
                   "def loss_fn(model, batch):\n    return model(batch).sum()\n")
    with pytest.raises(ModelFileError, match="loss_fn raised RuntimeError"):
        measured_probe(load_model_file(str(bad)), TraceConfig(1), device="cpu", predicted_max=2)


@pytest.mark.parametrize("name,total,cc,key", [
    ("NVIDIA H100 80GB HBM3", 79 * 2**30, (9, 0), "h100-80"),
    ("NVIDIA A100-SXM4-40GB", 39 * 2**30, (8, 0), "a100-40"),
    ("NVIDIA A100-SXM4-80GB", 79 * 2**30, (8, 0), "a100-80"),
    ("NVIDIA A10", 22 * 2**30, (8, 6), "a10"),
    ("NVIDIA GeForce RTX 3090", 23 * 2**30, (8, 6), "rtx3090"),
    ("Tesla T4", 14 * 2**30, (7, 5), "t4"),
    ("NVIDIA L4", 22 * 2**30, (8, 9), "l4"),
    ("NVIDIA H200", 150109880320, (9, 0), "h200"),      # as torch 2.11 reported it
    ("NVIDIA L40S", 44 * 2**30, (8, 9), "l40s"),
    ("NVIDIA L40", 44 * 2**30, (8, 9), "custom"),
    ("NVIDIA GeForce RTX 4080", 15 * 2**30, (8, 9), "rtx4080"),
])
def test_profile_for_device(name, total, cc, key):
    p = profile_for_device(name, total, cc)
    assert p.name == key
    assert p.total_bytes == total
    assert p.compute_capability == cc


@pytest.mark.parametrize("on_device", [True, False])
def test_runner_builds_where_asked(spec, monkeypatch, on_device):
    """The calibration harness builds under ``with device:``; ``build_on_device=False`` builds
    on the host and moves the model, as a training script (and the simulator) does."""
    moved = []
    orig = torch.nn.Module.to

    def recording(self, *a, **k):
        moved.append(a)
        return orig(self, *a, **k)
    monkeypatch.setattr(torch.nn.Module, "to", recording)
    TorchRunner("cpu", build_on_device=on_device).train(spec, TraceConfig(2))
    assert (torch.device("cpu"),) in moved if not on_device else (torch.device("cpu"),) not in moved


# A model whose step raises what CUDA raises past batch 3, from inside its forward (loss_fn),
# where an OOM on a real GPU happens most often.
_OOM_ABOVE_3 = ("import torch\n"
                "def build_model():\n    return torch.nn.Linear(4, 2)\n"
                "def make_batch(b):\n    return torch.randn(b, 4)\n"
                "def loss_fn(model, batch):\n"
                "    if batch.shape[0] > 3:\n"
                "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
                "    return model(batch).sum()\n")


def test_an_oom_inside_the_forward_is_an_oom_not_a_model_error(tmp_path):
    path = tmp_path / "oom_above_3.py"
    path.write_text(_OOM_ABOVE_3)
    r = measured_probe(load_model_file(str(path)), TraceConfig(1), device="cpu",
                       predicted_max=5, max_batch=8)
    assert r.max_batch_size == 3
    assert [(t.batch_size, t.fits) for t in r.trials] == [(5, False), (4, False), (3, True)]
    assert r.trials[0].error == "CUDA out of memory. Tried to allocate 2.00 GiB"


def test_fresh_process_runner_runs_each_trial_in_a_new_process(tmp_path):
    """Each trial in a spawned child (oomdoctor.runs.fresh_process): the model rebuilt there
    from its file, the child's OOM reported to the search as an OOM."""
    from oomdoctor.models.loader import load_model
    from oomdoctor.runs.fresh_process import FreshProcessRunner
    path = tmp_path / "oom_above_3.py"
    pids = tmp_path / "pids"
    path.write_text(_OOM_ABOVE_3 + "import os\n_build = build_model\n"
                    f"def build_model():\n    open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
                    "    return _build()\n")
    r = measured_probe(load_model(str(path)), TraceConfig(1), predicted_max=3, max_batch=8,
                       runner=FreshProcessRunner("cpu"))
    assert (r.max_batch_size, r.device_name) == (3, "cpu")
    assert [(t.batch_size, t.fits) for t in r.trials] == [(3, True), (4, False)]
    assert r.trials[1].error == "CUDA out of memory. Tried to allocate 2.00 GiB"
    built_in = pids.read_text().split()
    assert len(set(built_in)) == 2 and str(os.getpid()) not in built_in
    from oomdoctor.runs.fresh_process import first_context
    assert first_context("cpu") is None      # no CUDA context to measure on the host
    with pytest.raises(MeasureError, match="cuda:5"):
        FreshProcessRunner("cuda:5")


def test_a_trial_whose_process_dies_is_an_error_not_a_verdict(tmp_path):
    """A child that dies without a result (here os._exit in build_model; on a GPU, the host
    out of memory or a crashing extension) stops the probe with an error - exit 5 through the
    CLI's guard, one line - never "does not fit", as an OOM would be counted."""
    from oomdoctor.models.loader import load_model
    from oomdoctor.runs.fresh_process import FreshProcessRunner
    path = tmp_path / "dies.py"
    path.write_text(_OOM_ABOVE_3)
    spec = load_model(str(path))           # loaded here; the child rebuilds it from the file
    path.write_text(_OOM_ABOVE_3.replace("def build_model():\n",
                                         "def build_model():\n    import os; os._exit(3)\n"))
    with pytest.raises(RuntimeError, match="died without a result"):
        measured_probe(spec, TraceConfig(1), predicted_max=2, max_batch=4,
                       runner=FreshProcessRunner("cpu"))
