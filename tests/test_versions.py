"""`--torch VERSION`: each release-dependent CUDA fact on both sides of its release, the
refusal of releases older than the oldest modelled, and --torch in every planning command.

    python -m pytest tests/test_versions.py -q
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from oomdoctor.cli import cli
from oomdoctor.cli.group import EXIT_OK, EXIT_USAGE
from oomdoctor.models.loader import load_model_file
from oomdoctor.plans.estimate import Budget, estimate
from oomdoctor.sim import emulate, versions
from oomdoctor.sim.allocator import round_size
from oomdoctor.sim.gpus import MiB, get_profile
from oomdoctor.sim.trace import TraceConfig
from oomdoctor.sim.versions import FACTS, TorchVersion, has, parse_version

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "sample_models" / "tiny_mlp.py")
MODELS = ROOT / "tests" / "models"


def _v(text: str) -> TorchVersion:
    return parse_version(text)


def _estimate(torch_version: str | None, gpu: str = "a100-80", batch: int = 64, **kw):
    spec = load_model_file(MLP)
    cfg = TraceConfig(batch, torch=_v(torch_version) if torch_version else None, **kw)
    return estimate(spec, cfg, Budget(get_profile(gpu)))


# -- the version strings torch prints, and the refusal --------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("2.1", TorchVersion(2, 1, 0)),
    ("2.1.0+cu121", TorchVersion(2, 1, 0)),
    ("2.4.1+rocm6.0", TorchVersion(2, 4, 1)),
    ("2.2.0.dev20231105+rocm5.6", TorchVersion(2, 2, 0, 20231105)),
    ("2.3.0a0+git1234abc", TorchVersion(2, 3, 0, 0)),
    ("1.13.1", TorchVersion(1, 13, 1)),
])
def test_parse_version(text, expected):
    assert parse_version(text) == expected


def test_installed_torch_parses():
    assert versions.installed() == parse_version(torch.__version__)


@pytest.mark.parametrize("text", ["1.12.1", "1.10", "0.4.1"])
def test_older_than_the_oldest_modelled_is_refused(text):
    with pytest.raises(ValueError, match=r"models torch 1\.13 and later .*plan with --torch "
                                         r"1\.13 as an approximation"):
        parse_version(text)


def test_not_a_version_is_refused():
    with pytest.raises(ValueError, match="is not a torch version; write it as torch.__version__"):
        parse_version("latest")


# -- every fact on both sides of its release ------------------------------------------------

@pytest.mark.parametrize("fact", FACTS, ids=[f.name for f in FACTS])
def test_each_fact_changes_at_its_release(fact):
    major, minor = fact.since
    before = TorchVersion(major, minor - 1, 9) if minor else TorchVersion(1, 13, 1)
    assert not has(before, fact.name)
    assert has(TorchVersion(major, minor, 0), fact.name)
    assert fact.source and fact.before and fact.after


def test_nightly_before_and_after_the_foreach_adam_change():
    """pytorch#104898 merged 2023-07-10: 2.1 nightlies from the 11th have it."""
    name = versions.FOREACH_ADAM_ONE_INTERMEDIATE
    assert not has(_v("2.1.0.dev20230601"), name)
    assert not has(_v("2.1.0.dev20230710"), name)
    assert has(_v("2.1.0.dev20230711"), name)
    assert has(_v("2.1.0a0+gitabc"), name) is False        # a source build, date unknown: 0


def test_installed_torch_is_on_the_after_side_of_every_fact():
    """The default (no --torch) is what oomdoctor always modelled: today's facts."""
    assert all(has(None, f.name) for f in FACTS)
    assert versions.modelled_note(None) is None
    assert versions.modelled_note(versions.installed()) is None


# foreach as the CUDA default (2.0): the optimizer's step temporaries

def test_foreach_default_before_and_after_2_0():
    new, old = _estimate("2.0"), _estimate("1.13.1")
    assert any("foreach implementation, the CUDA default" in n for n in new.notes)
    assert not any("foreach implementation" in n for n in old.notes)
    assert any("for-loop implementation (until 2.0)" in n for n in old.notes)


# zero_grad(set_to_none=True) as the default (2.0)

def test_zero_grad_default_before_and_after_2_0():
    assert versions.default_zero_grad(_v("1.13.1")) == "in-place"
    assert versions.default_zero_grad(_v("2.0.0")) == "after-step"
    assert versions.default_zero_grad(None) == "after-step"
    peaks = {}
    for release, mode in (("1.13", None), ("1.13", "after-step"), ("2.0", None),
                          ("2.0", "in-place")):
        extra = ["--zero-grad", mode] if mode else []
        res = CliRunner().invoke(cli, ["estimate", MLP, "-b", "4096", "--gpu", "a100-80",
                                       "--torch", release, *extra, "--json"])
        assert res.exit_code == EXIT_OK, res.output
        peaks[release, mode] = json.loads(res.stdout)["peak_allocated_bytes"]
    # at batch 4096 the peak is in backward, where kept gradients add to it
    assert peaks["1.13", None] > peaks["1.13", "after-step"]
    assert peaks["2.0", None] < peaks["2.0", "in-place"]
    assert peaks["1.13", None] == _estimate("1.13", batch=4096,
                                            zero_grad="in-place").peak_allocated_bytes


# fused SDPA kernels (2.0)

@pytest.mark.parametrize("release, kernel", [("1.13", "math"), ("2.0", "flash")])
def test_fused_sdpa_before_and_after_2_0(release, kernel):
    q = torch.randn(2, 4, 64, 32, dtype=torch.bfloat16, requires_grad=True)
    notes: list[str] = []
    with emulate.CudaKernels((8, 0), notes, "", _v(release)):
        F.scaled_dot_product_attention(q, q, q)
    assert notes == [f"scaled_dot_product_attention: CUDA would use the {kernel} kernel "
                     "(sm80, bfloat16)"]
    assert has(_v("2.0"), versions.FUSED_SDPA) and not has(_v("1.13"), versions.FUSED_SDPA)


# grouped-query SDPA (2.5): before it, k and v repeated to every query head

@pytest.mark.parametrize("release, expanded", [("2.4.1", True), ("2.5.0", False)])
def test_grouped_query_attention_before_and_after_2_5(release, expanded):
    """8 query heads, 2 key/value heads, bf16 on sm90. From 2.5 flash saves the small k and v
    (the inputs: nothing new); before it the model repeats them (transformers' repeat_kv) and
    attention keeps the two (B, H, T, D) copies."""
    B, H, Hkv, T, D = 2, 8, 2, 64, 32
    with torch.device("meta"):
        q = torch.randn(B, H, T, D, dtype=torch.bfloat16, requires_grad=True)
        k, v = [torch.randn(B, Hkv, T, D, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2)]
        packed: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                      lambda t: t), \
                emulate.CudaKernels((9, 0), [], "", _v(release)):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    shapes = sorted(tuple(t.shape) for t in packed)
    assert out.shape == q.shape
    assert shapes.count((B, H, T, D)) == (4 if expanded else 2)     # + q and out
    assert shapes.count((B, Hkv, T, D)) == (0 if expanded else 2)
    assert not [s for s in shapes if s[-2:] == (T, T)]               # flash either way


# foreach Adam/AdamW: a second parameter-sized intermediate until 2.1

@pytest.mark.parametrize("before, after", [("2.0.1", "2.1.0"),
                                           ("2.1.0.dev20230710", "2.1.0.dev20230711")])
def test_foreach_adamw_second_intermediate_until_2_1(before, after):
    """torch 2.0's _multi_tensor_adam held sqrt(exp_avg_sq) and denom = that + eps: one more
    set of the parameters' bytes at the step's peak (tiny_mlp's peak is in the step)."""
    old, new = _estimate(before), _estimate(after)
    with torch.device("meta"):
        model = load_model_file(MLP).build_model()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert new.peak_phase == old.peak_phase == "optimizer"
    assert old.breakdown["temporaries"] - new.breakdown["temporaries"] == param_bytes
    # in the allocator, each tensor's copy rounded to 512 B
    blocks = sum(round_size(p.numel() * p.element_size()) for p in model.parameters())
    assert old.peak_allocated_bytes - new.peak_allocated_bytes == blocks
    # the same as the installed torch's, but for cuBLASLt's own 1 MiB workspace (until 2.12,
    # sim.versions CUBLASLT_WORKSPACE_SHARED): tiny_mlp's linear layers run addmm with a bias
    assert new.peak_allocated_bytes == _estimate(None).peak_allocated_bytes + 2**20


def test_foreach_adam_change_leaves_the_for_loop_alone():
    old = _estimate("2.0.1", optimizer="sgd-momentum")
    assert old.peak_allocated_bytes == _estimate("2.1", optimizer="sgd-momentum").peak_allocated_bytes


# ROCm: hipBLASLt default (2.5), its 76 MiB workspace and hipBLAS's from the allocator (2.6)

def _blas_workspaces(e) -> int:
    """The BLAS workspace bytes the estimate's ROCm note counted (0 when there is none)."""
    for n in e.notes:
        if n.startswith("ROCm (") and "workspace" in n:
            count, size = n.split(": ", 1)[1].split(" MiB")[0].split(" x ")
            return int(count) * int(size) * MiB
    return 0


@pytest.mark.parametrize("gpu, release, per_thread", [
    ("mi250", "2.4.1", 0),                  # hipBLAS default, rocBLAS's own workspace
    ("mi250", "2.5.0", 1 * MiB),            # hipBLASLt default, 1 MiB
    ("mi250", "2.6.0", 76 * MiB),           # hipBLASLt's 76 MiB
    ("mi300x", "2.4.1", 0),
    ("mi300x", "2.6.0", 76 * MiB),
])
def test_rocm_blas_workspaces_by_release(gpu, release, per_thread):
    e = _estimate(release, gpu=gpu)
    assert _blas_workspaces(e) == 2 * per_thread
    if per_thread == 0:
        assert e.peak_allocated_bytes < _estimate(release, gpu="a100-80").peak_allocated_bytes


def test_rocm_hipblas_workspace_in_the_allocator_from_2_6():
    """gfx1100 (RX 7900) prefers hipBLAS: its 32 MiB workspace is the allocator's from 2.6,
    rocBLAS's own before."""
    from oomdoctor.sim.gpus import card_for_arch
    spec = load_model_file(MLP)
    budget = Budget(card_for_arch(24 * 2**30, "gfx1100"))
    got = {r: _blas_workspaces(estimate(spec, TraceConfig(64, torch=_v(r)), budget))
           for r in ("2.5.1", "2.6.0")}
    assert got == {"2.5.1": 0, "2.6.0": 2 * 32 * MiB}


# -- published rows from older releases, with --torch set to theirs -------------------------
# (the ROCm rows of optimum-benchmark's CI on torch 2.2-2.4: tests/test_old_releases.py)

def test_pt1_tutorial_on_its_release_stays_in_the_band():
    """PT-1 (pytorch/tutorials optimizer_step_in_backward_tutorial.py, written for 2.1,
    pytorch/tutorials#2568): "~6GB" with one foreach intermediate ("~1.2 GB"). With --torch
    2.1 the estimate is the default one; --torch 2.0 would add the second intermediate."""
    spec = load_model_file(str(MODELS / "vit_l16_sum_loss.py"))
    budget = Budget(get_profile("a100-80"))
    e = estimate(spec, TraceConfig(1, torch=_v("2.1.0")), budget)
    assert 5.5e9 <= e.peak_allocated_bytes <= 6.5e9, e.peak_allocated_bytes / 1e9
    assert e.modelled_torch == "2.1.0" and e.peak_phase == "optimizer"


# -- --torch in every command that takes a GPU ----------------------------------------------

@pytest.mark.parametrize("args", [
    ("estimate", MLP, "-b", "8"),
    ("probe", MLP, "--precision", "fp32", "--no-checkpointing", "--max-batch-size", "64",
     "-j", "1"),
    ("parallel", MLP, "-b", "8", "--gpus", "2", "--strategy", "ddp"),
    ("split", MLP, "-b", "8", "--gpus", "2"),
    ("recommend", MLP, "--gpus", "2", "--target-batch", "64", "--precision", "fp32",
     "--quick", "-j", "1"),
], ids=["estimate", "probe", "parallel", "split", "recommend"])
@pytest.mark.parametrize("release, code", [("2.0", EXIT_OK), ("1.12", EXIT_USAGE)])
def test_every_planning_command_takes_torch(args, release, code):
    res = CliRunner().invoke(cli, [*args, "--gpu", "rtx3090", "--torch", release, "--json"])
    assert res.exit_code == code, res.output
    if code == EXIT_OK:
        json.loads(res.stdout)
    else:
        assert res.stderr.count("\n") == 1 and "models torch 1.13 and later" in res.stderr


def test_estimate_says_which_release_it_modelled():
    res = CliRunner().invoke(cli, ["estimate", MLP, "-b", "8", "--torch", "2.0.1"])
    assert res.exit_code == EXIT_OK, res.output
    assert "note: modelled torch 2.0.1's CUDA facts (--torch): foreach Adam/AdamW hold two" \
        in res.stdout
    res = CliRunner().invoke(cli, ["estimate", MLP, "-b", "8", "--torch", "2.0.1", "--json"])
    assert json.loads(res.stdout)["modelled_torch"] == "2.0.1"
    res = CliRunner().invoke(cli, ["estimate", MLP, "-b", "8", "--json"])
    assert "modelled_torch" not in json.loads(res.stdout)


def test_the_api_and_check_take_the_release_as_the_cli_does(tmp_path):
    """oomdoctor.estimate(torch=) and a check case's `torch = X.Y` give the CLI's --torch
    answer; without it, the default release (baselines recorded before stay valid)."""
    import json as json_mod

    import oomdoctor
    from oomdoctor.plans.check import load_config, measure_case
    res = CliRunner().invoke(cli, ["estimate", MLP, "-b", "64", "--gpu", "rtx3090", "--torch",
                                   "2.0.1", "--json"])
    by_cli = json_mod.loads(res.output)["peak_allocated_bytes"]
    by_api = oomdoctor.estimate(MLP, 64, gpu="rtx3090", torch="2.0.1")
    now = oomdoctor.estimate(MLP, 64, gpu="rtx3090")
    assert by_api.peak_allocated_bytes == by_cli != now.peak_allocated_bytes
    cfg = tmp_path / "setup.cfg"
    cfg.write_text(f"[oomdoctor:old]\nmodel = {MLP}\nbatch_size = 64\ntorch = 2.0.1\n\n"
                   f"[oomdoctor:new]\nmodel = {MLP}\nbatch_size = 64\n")
    old, new = load_config(str(cfg)).cases
    assert old.config()["torch"] == "2.0.1" and "torch" not in new.config()
    assert measure_case(old, str(tmp_path)).peak_allocated_bytes == by_cli
    assert measure_case(new, str(tmp_path)).peak_allocated_bytes == now.peak_allocated_bytes
    cfg.write_text(f"[oomdoctor:bad]\nmodel = {MLP}\nbatch_size = 64\ntorch = 1.8\n")
    with pytest.raises(ValueError, match="1.13"):
        load_config(str(cfg))
