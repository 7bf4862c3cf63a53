"""recommend: what fits, what it costs, what to run - against formulas and direct estimates."""
import json
import os
import re

import pytest
from click.testing import CliRunner

from oomdoctor.plans import parallel as par
from oomdoctor.plans import recommend as rec
from oomdoctor.cli import EXIT_OK, EXIT_PROBLEM, cli
from oomdoctor.plans.estimate import Budget, estimate, trace_for
from oomdoctor.sim.gpus import MiB, custom_profile, get_profile
from oomdoctor.models.loader import load_model_file
from oomdoctor.sim.trace import TraceConfig, trace_training

ROOT = os.path.dirname(os.path.dirname(__file__))
MLP_PATH = os.path.join(ROOT, "sample_models", "tiny_mlp.py")
MLP = load_model_file(MLP_PATH)
LLAMA_PATH = os.path.join(ROOT, "sample_models", "llama7b.py")
LLAMA_PARAMS = 6_738_415_616          # sample_models/README.md, the published LLaMA-7B count
RTX3090 = get_profile("rtx3090")


@pytest.fixture(scope="module")
def llama_plan():
    """LLaMA-7B, two RTX 3090s, AdamW (the file's default optimizer): no trace needed."""
    spec = load_model_file(LLAMA_PATH)
    return rec.recommend(spec, rec.hardware(RTX3090, 2), 64, Budget(RTX3090), detail=False)


def test_llama7b_cannot_train_with_ddp_on_two_3090s(llama_plan):
    r = llama_plan
    assert r.best is None and not r.candidates
    assert any("DDP cannot train" in n for n in r.notes)
    floors = {(f.strategy, f.precision): f for f in r.floors}
    # AdamW with fp32 (or AMP's fp32) weights: 4 + 4 + 8 bytes per parameter on every DDP rank.
    assert floors["ddp", "fp32"].bytes == 16 * LLAMA_PARAMS
    assert floors["ddp", "bf16"].bytes == 16 * LLAMA_PARAMS
    # Sharded by 2 (ZeRO-3) or split in two (at best): half of it, still over 22 GiB; in pure
    # bf16, 8 bytes per parameter halved - 25.1 GiB, still over the 22.12 GiB budget.
    assert floors["zero3", "fp32"].bytes == 8 * LLAMA_PARAMS
    assert floors["zero2", "fp32"].bytes == 4 * LLAMA_PARAMS + 12 * LLAMA_PARAMS // 2
    assert floors["zero1", "bf16-pure"].bytes == 4 * LLAMA_PARAMS + 4 * LLAMA_PARAMS // 2
    assert floors["pipeline2", "bf16-pure"].bytes == 4 * LLAMA_PARAMS
    assert not any(f.fits for f in r.floors)
    # GeForce cards default to a link without P2P, where DataParallel is not searched
    assert rec.default_link(RTX3090) == "pcie-no-p2p"
    assert {s for s, _ in floors} == set(par.STRATEGIES) - {"dp"}


def test_llama7b_says_what_would_fit(llama_plan):
    text = " ".join(llama_plan.alternatives)
    # The GPU count comes from the strategy estimator (issue #24: a formula holding the foreach
    # temporaries constant said 18 where 8 fit). `estimate --strategy zero3 --num-gpus N` of the
    # same configuration, the command a user checks it with, must agree: N fits, N - 1 not.
    m = re.search(r"more GPUs: ZeRO-3/FSDP over (\d+) x rtx3090 fits: ([0-9.]+) GiB .*"
                  r"\((bf16-pure) \+ checkpointing, micro-batch 1,", text)
    assert m, text
    n, p = int(m.group(1)), m.group(3)
    # Model states alone (8 bytes per parameter in pure bf16, sharded) set a floor on N.
    assert n >= -(-8 * LLAMA_PARAMS // int(22.12 * 2**30))
    spec = load_model_file(LLAMA_PATH)
    budget = Budget(RTX3090)
    cfg = TraceConfig(1, precision=p, checkpointing=True)
    trace = trace_for(spec, cfg, RTX3090)
    layout = par.model_layout(spec, p)
    # recommend plans with the allocator its launch line sets (expandable segments)
    alloc = rec.LAUNCH_ALLOCATOR
    fit = par.estimate_strategy(trace, layout, par.Strategy("zero3", n), budget, alloc)
    short = par.estimate_strategy(trace, layout, par.Strategy("zero3", n - 1), budget, alloc)
    assert fit.fits and not short.fits
    assert f"{fit.peak_device_bytes / 2**30:.1f} GiB on the fullest GPU" in text
    assert "SGD" in text and "offload" in text
    # LoRA is traced (peft on the meta device): at least its frozen bf16 weights, 2P bytes,
    # and it fits one 3090 at micro-batch 1 with checkpointing.
    m = re.search(r"LoRA r16 \(bf16, checkpointing, micro-batch 1\) needs ([0-9.]+) GiB", text)
    assert m and 2 * LLAMA_PARAMS / 2**30 < float(m.group(1)) < 22.12
    assert f"`oomdoctor probe {LLAMA_PATH} --gpu rtx3090 --lora 16`" in text
    # DeepSpeed's ZeRO-3 estimator with the optimizer offloaded: 4L + 2P/N (L: the 32000 x 4096
    # embedding or head), beside the plan's replayed figure; "what would fit" quotes the table's
    # leanest plan, not another estimate.
    plans = {o.name: o for o in llama_plan.offload}
    ds = 4 * 32000 * 4096 + int(2 * LLAMA_PARAMS / 2)
    assert plans["zero3-offload"].gpu_model_state_bytes == ds
    lean = min(plans.values(), key=lambda o: o.gpu_bytes)
    assert (f"CPU offload (the plans above): {lean.name} needs {lean.gpu_bytes / 2**30:.1f} GiB "
            "per GPU") in text
    out = rec.render_text(llama_plan)
    assert "NOTHING FITS" in out and "what would fit" in out and "lower bound" in out


def test_every_candidate_has_the_target_batch_and_fits_on_a_direct_estimate():
    """A card just too small for micro-batch 256 on one GPU: the data-parallel plans split it.
    Each candidate's micro-batch, estimated directly on one GPU (a different code path), fits
    where the single-GPU view says it must."""
    card = custom_profile(48 * MiB)
    budget = Budget(card, margin=0.0, context_bytes=0)
    hw = rec.hardware(card, 2, "pcie")
    r = rec.recommend(MLP, hw, 256, budget, precisions=["fp32"], detail=False)
    assert r.candidates and r.best is r.candidates[0]
    for c in r.candidates:
        dp = par.Strategy(c.strategy, c.num_gpus).data_parallel
        assert c.micro_batch * c.grad_accum * dp == 256
        if c.strategy == "single":
            assert estimate(MLP, TraceConfig(c.micro_batch), budget).fits
    shown = [float(f"{c.score:.3g}") for c in r.candidates]    # the table's 3 digits
    assert shown == sorted(shown)
    # Going one micro-batch step up does not fit (the search keeps the largest).
    single = [c for c in r.candidates if c.strategy == "single"]
    if single and single[0].micro_batch < 256:
        assert not estimate(MLP, TraceConfig(single[0].micro_batch * 2), budget).fits


def test_step_time_formulas():
    """compute = FLOPs / (datasheet x efficiency); checkpointing +1/3; DDP's all-reduce
    2(N-1)/N x gradient bytes over the link, less what hides behind the backward."""
    trace = trace_training(MLP, TraceConfig(1))
    layout = par.model_layout(MLP)
    hw = rec.hardware(RTX3090, 2, "pcie-no-p2p")
    flops = 2_127_872                        # per sample, from the architecture (test_parallel)
    t = rec.step_time(layout, trace, par.Strategy("single"), hw, "fp32", False, 64, 2)
    assert t.compute_seconds == pytest.approx(2 * 64 * flops / (35.6e12 * rec.COMPUTE_EFFICIENCY))
    ck = rec.step_time(layout, trace, par.Strategy("single"), hw, "fp32", True, 64, 2)
    assert ck.compute_seconds == pytest.approx(t.compute_seconds * 4 / 3)
    d = rec.step_time(layout, trace, par.Strategy("ddp", 2), hw, "fp32", False, 64, 2)
    micro = 64 * flops / (35.6e12 * rec.COMPUTE_EFFICIENCY)
    grads = 399_370 * 4
    assert d.communication_seconds == pytest.approx(max(0, grads / 12.5e9 - 2 / 3 * micro))
    z3 = rec.step_time(layout, trace, par.Strategy("zero3", 2), hw, "fp32", False, 64, 2)
    assert z3.communication_seconds >= d.communication_seconds
    # Bytes sent per GPU per step, hidden or not (ZeRO paper, section 7): DDP all-reduces the
    # gradients once (2(N-1)/N), ZeRO-3 moves 3(N-1)/N of the parameters every micro-batch.
    params = 399_370 * 4
    assert d.traffic_bytes == round(2 * 0.5 * grads)
    assert z3.traffic_bytes == round(2 * 3 * 0.5 * params)


def test_equal_step_times_prefer_the_plan_that_moves_fewer_bytes():
    """On a link so fast that every strategy's communication hides behind compute, DDP and the
    ZeRO stages tie on step time; DDP moves the fewest bytes (and is the simplest), so among
    plans with the same micro-batch it must rank first - never ZeRO-3 for a model DDP fits."""
    card = custom_profile(48 * MiB)
    hw = rec.Hardware(card, 2, "nvlink", 1e9, cores=4)
    r = rec.recommend(MLP, hw, 256, Budget(card, margin=0.0, context_bytes=0),
                      precisions=["fp32"], strategies=["ddp", "zero1", "zero2", "zero3"],
                      detail=False)
    same = [c for c in r.candidates if (c.micro_batch, c.grad_accum) ==
            (r.best.micro_batch, r.best.grad_accum)]
    assert len(same) >= 2 and all(c.score == pytest.approx(same[0].score, rel=1e-6) for c in same)
    assert r.best.strategy == "ddp"
    assert [c.traffic_bytes for c in same] == sorted(c.traffic_bytes for c in same)


def test_links():
    assert rec.default_link(RTX3090) == "pcie-no-p2p"
    assert rec.link_gbps(RTX3090, "pcie-no-p2p") == 12.5
    assert rec.link_gbps(RTX3090, "nvlink") == 56.25
    assert rec.default_link(get_profile("a100-80")) == "nvlink"
    assert rec.link_gbps(get_profile("t4"), "pcie") == 12.0
    with pytest.raises(ValueError, match="no NVLink"):
        rec.link_gbps(get_profile("rtx4090"), "nvlink")


def _candidate(**kw):
    base = dict(strategy="ddp", num_gpus=2, precision="fp16", checkpointing=True, micro_batch=8,
                grad_accum=16, effective_batch=256, peak_device_bytes=0, per_gpu_bytes=(0, 0),
                step_seconds=1.0, compute_seconds=1.0, communication_seconds=0.0,
                samples_per_second=256.0, numerics="", score=1.0)
    base.update(kw)
    return rec.Candidate(**base)


def test_launch_line_environment_and_snippet():
    c = _candidate()
    hw = rec.Hardware(RTX3090, 2, "pcie-no-p2p", 12.5, cores=16)
    facts = rec._Facts(10, 10, 2, True, "layers")
    launch = rec._launch(c, hw, MLP, facts)
    assert launch.command.startswith("torchrun --standalone --nproc_per_node=2 train.py")
    assert launch.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert launch.env["OMP_NUM_THREADS"] == "8"          # 16 cores / 2 processes
    s = launch.snippet
    for needle in ("torch.autocast('cuda', dtype=torch.float16)", "GradScaler", "no_sync",
                   "DistributedSampler", "set_epoch", "checkpoint(self.block",
                   "model.layers[i] = Checkpointed(block)", "K = 16"):
        assert needle in s, needle
    compile(s.replace("build_model()", "None"), "snippet", "exec")     # valid Python
    notes = " ".join(launch.quality_notes)
    assert "256/B" in notes and "practically neutral" in notes
    assert "smaller effective batch is not neutral" in notes


def test_pure_bf16_is_flagged_and_pipeline_launches_one_process():
    c = _candidate(strategy="pipeline2", precision="bf16-pure", checkpointing=False)
    hw = rec.Hardware(RTX3090, 2, "pcie-no-p2p", 12.5, cores=16)
    launch = rec._launch(c, hw, MLP, rec._Facts(10, 10, 2, False))
    assert launch.command.startswith("python train.py") and launch.env["OMP_NUM_THREADS"] == "16"
    assert "dispatch_model" in launch.snippet and "autocast" not in launch.snippet
    assert "not neutral" in " ".join(launch.quality_notes)


def test_bf16_refused_on_a_card_without_it():
    t4 = get_profile("t4")
    with pytest.raises(ValueError, match="no bf16 support"):
        rec.recommend(MLP, rec.hardware(t4, 2), 64, Budget(t4), precisions=["bf16"],
                      detail=False)


def test_recommend_cli_llama_nothing_fits():
    res = CliRunner().invoke(cli, ["recommend", LLAMA_PATH, "--gpu", "rtx3090", "--gpus", "2",
                                   "--target-batch", "64", "--quick", "--json"])
    assert res.exit_code == EXIT_PROBLEM, res.stderr
    d = json.loads(res.stdout)
    assert d["best"] is None and d["alternatives"] and d["num_gpus"] == 2
    assert "not traced" in res.stderr


def test_recommend_cli_text_plan():
    res = CliRunner().invoke(cli, ["recommend", MLP_PATH, "--gpu", "rtx3090", "--gpus", "2",
                                   "--target-batch", "128", "--precision", "fp32", "-j", "1",
                                   "--quick"])
    assert res.exit_code == EXIT_OK, res.stderr
    assert "RECOMMENDED" in res.stdout and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" \
        in res.stdout and "quality:" in res.stdout


def test_speedup_over_one_gpu_is_n_when_communication_is_free():
    """Same effective batch: one GPU computes all of it, each of N data-parallel GPUs 1/N of it.
    On a link that hides every byte, the plan's throughput is exactly N times one GPU's."""
    card = custom_profile(48 * MiB)
    hw = rec.Hardware(card, 4, "nvlink", 1e9, cores=8)
    r = rec.recommend(MLP, hw, 256, Budget(card, margin=0.0, context_bytes=0),
                      precisions=["fp32"], strategies=["single", "ddp"], checkpointing=[False],
                      detail=False)
    assert r.best.strategy == "ddp" and r.best.num_gpus == 4
    assert r.speedup == pytest.approx(4.0, rel=1e-6)
    assert "up to ~4.0x the throughput of one GPU" in rec.render_text(r)
    assert rec.Recommendation.to_json(r)["speedup"] == pytest.approx(4.0, rel=1e-6)


def test_batchnorm_models_get_syncbatchnorm_in_data_parallel_plans():
    c = _candidate(strategy="ddp", num_gpus=8, micro_batch=64, grad_accum=1, effective_batch=512)
    facts = rec._Facts(10, 10, 2, True, "layers", has_batchnorm=True)
    hw = rec.Hardware(RTX3090, 8, "pcie-no-p2p", 12.5, cores=32)
    launch = rec._launch(c, hw, MLP, facts)
    assert "SyncBatchNorm.convert_sync_batchnorm(model)" in launch.snippet
    # Converted before DDP wraps the model (DDP must see the SyncBatchNorm layers).
    assert launch.snippet.index("convert_sync_batchnorm") < launch.snippet.index("Distributed" "DataParallel(")
    assert any("own 64 samples" in n for n in launch.quality_notes)
    plain = rec._launch(c, hw, MLP, rec._Facts(10, 10, 2, True, "layers"))
    assert "SyncBatchNorm" not in plain.snippet
    single = rec._launch(_candidate(strategy="single", num_gpus=1), hw, MLP, facts)
    assert "convert_sync_batchnorm" not in single.snippet


def test_recommend_and_explain_agree_on_dataparallel_without_p2p():
    """One truth about links (issue #24): where `explain` of a `nvidia-smi topo -p2p r` table
    with NS says DataParallel hangs or crawls and DDP needs no P2P, `recommend` on such GPUs
    does not offer DataParallel, says why, and ranks it last when asked for by name."""
    from oomdoctor import explain as ex
    log = os.path.join(ROOT, "tests", "logs", "topo_p2p_not_supported.log")
    finding = ex.explain_text(open(log).read()).findings[0]
    assert finding.diagnosis[0].cause == "dataparallel_p2p"
    assert "hangs or is very slow" in finding.diagnosis[0].text
    card = custom_profile(48 * MiB)
    budget = Budget(card, margin=0.0, context_bytes=0)
    no_p2p = rec.Hardware(card, 2, "pcie-no-p2p", 12.5, cores=4)
    r = rec.recommend(MLP, no_p2p, 256, budget, precisions=["fp32"], detail=False)
    assert r.candidates and all(c.strategy != "dp" for c in r.candidates)
    assert any(n.startswith("DataParallel left out") and "hangs or crawls" in n
               and "DDP needs no P2P" in n for n in r.notes)
    asked = rec.recommend(MLP, no_p2p, 256, budget, precisions=["fp32"],
                          strategies=["dp", "ddp"], detail=False)
    assert asked.candidates[-1].strategy == "dp" and asked.best.strategy == "ddp"
    assert any(n.startswith("DataParallel ranks last") for n in asked.notes)
    # With P2P (--link pcie) DataParallel is searched as before.
    p2p = rec.Hardware(card, 2, "pcie", 25.0, cores=4)
    r = rec.recommend(MLP, p2p, 256, budget, precisions=["fp32"], detail=False)
    assert any(c.strategy == "dp" for c in r.candidates)
    assert not any("DataParallel" in n for n in r.notes)
