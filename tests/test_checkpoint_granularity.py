"""--checkpoint-every N and --checkpoint-policy op: which blocks and which ops are checkpointed,
checked against real CPU runs of the same step and against torchtitan's rules.

The real runs (tests/reference.py) wrap the blocks by hand, and the per-op run gets a policy
written here from torchtitan's source (pytorch/torchtitan c5d93d1,
torchtitan/distributed/activation_checkpoint.py: ``_get_default_save_ops`` and
``SelectiveAC._wrap_block``), not oomdoctor's. Measured on a 2-core runner, tests/models/
ckpt_lm.py at batch 8, fp32, emulation off, peak bytes of the trace vs the real CPU
allocator: no checkpointing 7,860,232 vs 7,860,384; every block 4,892,680 vs 4,892,832;
every 2nd block 6,475,784 vs 6,475,936; per op on every block 6,131,720 vs 6,131,872; per op
on every 2nd block 7,065,608 vs 7,065,760 (each 152 bytes, 0.002%, under the real run).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from oomdoctor.cli import EXIT_OK, EXIT_USAGE, cli
from oomdoctor.models import checkpointing
from oomdoctor.models.loader import load_model_file
from oomdoctor.sim import repeat
from oomdoctor.sim.trace import TraceConfig, trace_training
from reference import real_cpu_peak_variant

LM = str(Path(__file__).resolve().parent / "models" / "ckpt_lm.py")
BLOCKS = tuple(f"blocks.{i}" for i in range(4))


def titan_policy_context():
    """torchtitan's per-op selective checkpointing, transcribed from its source: save the
    compute-intensive ops (torch's partitioner list), the SDPA kernels, max, linear, topk and
    the collectives, except every second mm/linear; recompute everything else."""
    from torch._functorch.partitioners import get_default_op_list
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    aten = torch.ops.aten
    save = {op.default for op in get_default_op_list().compute_intensive_ops} | {
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_attention_math.default,
        aten._scaled_dot_product_fused_attention_overrideable.default,
        aten.max.default, aten.linear.default, aten.topk.default}
    mm = (aten.mm.default, aten.linear.default)
    meta = {"forward_mm_count": 0, "recompute_mm_count": 0}

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func in mm:
            meta[key] += 1
        if func in save:
            if func in mm and meta[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def _trace(every=1, policy="full", ckpt=True, **kw):
    return trace_training(load_model_file(LM), TraceConfig(
        8, emulate_cuda=False, checkpointing=ckpt, checkpoint_every=every,
        checkpoint_policy=policy), **kw)


def test_every_nth_counts_from_one_as_torchtitan():
    """torchtitan's _apply_layer_sac: `_layer_sac_count += 1; if _layer_sac_count % ac_freq
    == 0: wrap` - for "2" the 2nd and 4th blocks, not the 1st and 3rd."""
    assert checkpointing.every_nth(list(BLOCKS), 1) == list(BLOCKS)
    assert checkpointing.every_nth(list(BLOCKS), 2) == ["blocks.1", "blocks.3"]
    assert checkpointing.every_nth(list(BLOCKS), 3) == ["blocks.2"]
    with pytest.raises(ValueError, match=r"wraps none of the 4 blocks.*choose N <= 4"):
        checkpointing.every_nth(list(BLOCKS), 5)
    with pytest.raises(ValueError, match="unknown checkpoint policy"):
        TraceConfig(1, checkpointing=True, checkpoint_policy="selective")


def test_every_nth_block_saves_what_a_real_run_saves():
    none, full = _trace(ckpt=False), _trace()
    every1, every2 = _trace(every=1), _trace(every=2)
    assert every1.checkpointed == BLOCKS and every1.events == full.events
    assert every2.checkpointed == ("blocks.1", "blocks.3")
    assert full.peak_live_bytes < every2.peak_live_bytes < none.peak_live_bytes
    real = real_cpu_peak_variant(LM, 8, checkpoint=("blocks.1", "blocks.3"))
    assert abs(every2.peak_live_bytes - real) <= 0.005 * real, (every2.peak_live_bytes, real)


def test_per_op_policy_saves_what_a_real_run_with_torchtitans_policy_saves():
    none, full, op = _trace(ckpt=False), _trace(), _trace(policy="op")
    assert full.peak_live_bytes < op.peak_live_bytes < none.peak_live_bytes
    real = real_cpu_peak_variant(LM, 8, checkpoint=BLOCKS, context_fn=titan_policy_context)
    assert abs(op.peak_live_bytes - real) <= 0.005 * real, (op.peak_live_bytes, real)
    # both together: the op policy on the 2nd and 4th blocks
    both = _trace(every=2, policy="op")
    real = real_cpu_peak_variant(LM, 8, checkpoint=("blocks.1", "blocks.3"),
                                 context_fn=titan_policy_context)
    assert abs(both.peak_live_bytes - real) <= 0.005 * real, (both.peak_live_bytes, real)


def test_per_op_policy_keeps_the_emulated_fused_attention(monkeypatch):
    """On a GPU the policy keeps _scaled_dot_product_flash/efficient_attention's outputs; the
    CUDA emulation's stand-in for them (oomdoctor::fused_attention) must be kept alike: its
    forward outputs live on into the backward under the op policy, not under full
    checkpointing, which recomputes them."""
    spec = load_model_file(LM)

    def forward_attention_freed_in_backward(policy):
        t = trace_training(spec, TraceConfig(8, checkpointing=True, checkpoint_policy=policy))
        forward_end = next(m.start for m in t.marks if m.phase.value == "backward")
        kept = [s for s in t.storages.values() if s.op.startswith("fused_attention")
                and s.t_alloc < forward_end]
        assert kept, "no fused attention traced"
        return all(s.t_free is not None and s.t_free > forward_end for s in kept)
    assert forward_attention_freed_in_backward("op")
    assert not forward_attention_freed_in_backward("full")


def _deep(tmp_path) -> str:
    path = tmp_path / "deep_lm.py"
    path.write_text(Path(LM).read_text().replace("LAYERS = 4 ", "LAYERS = 16 "))
    return str(path)


@pytest.mark.parametrize("every,policy,cut", [(2, "full", False), (4, "op", False),
                                              (1, "op", True)])
def test_the_repeated_stack_cut_agrees_with_the_full_trace(tmp_path, unrolled, every, policy,
                                                          cut):
    """A stack of 16 blocks is traced cut to 2, 3 and 4 and unrolled (oomdoctor.sim.repeat)
    when its blocks are identical. Every N-th block checkpointed makes them differ (the wrapped
    ones have their own forward, which repeat.signature compares), so that stack is traced in
    full; the op policy on every block keeps them identical and is cut. Either way the events
    are the full trace's, to the byte."""
    spec = load_model_file(_deep(tmp_path))
    cfg = TraceConfig(2, checkpointing=True, checkpoint_every=every, checkpoint_policy=policy)
    fast = trace_training(spec, cfg)
    assert unrolled == ([True] if cut else [])
    whole = trace_training(spec, cfg, min_blocks=None)
    assert len(fast.checkpointed) == 16 // every
    assert fast.events == whole.events
    assert fast.peak_live_bytes == whole.peak_live_bytes
    assert fast.notes == whole.notes


GRANULARITY = ["--checkpointing", "--checkpoint-every", "2", "--checkpoint-policy", "op"]


def test_estimate_cli(tmp_path):
    runner = CliRunner()
    r = runner.invoke(cli, ["estimate", LM, "-b", "8", "--gpu", "rtx3090", *GRANULARITY,
                            "--json"])
    assert r.exit_code == EXIT_OK, r.output
    doc = json.loads(r.stdout)
    assert (doc["checkpointing"], doc["checkpoint_every"], doc["checkpoint_policy"]) == (
        True, 2, "op")
    assert "checkpointing 2 blocks of class Block" in doc["notes"]
    api = __import__("oomdoctor").estimate(LM, 8, gpu="rtx3090", checkpointing=True,
                                            checkpoint_every=2, checkpoint_policy="op")
    assert api.peak_reserved_bytes == doc["peak_reserved_bytes"]
    r = runner.invoke(cli, ["estimate", LM, "-b", "8", "--gpu", "rtx3090", *GRANULARITY])
    assert "fp32, per-op checkpointing every 2nd block on rtx3090" in r.stdout
    r = runner.invoke(cli, ["estimate", LM, "-b", "8", "--checkpoint-every", "2"])
    assert r.exit_code == EXIT_USAGE and "add --checkpointing" in r.output


def test_probe_cli():
    r = CliRunner().invoke(cli, ["probe", LM, "--gpu", "rtx3090", "--precision", "fp32",
                                 "-j", "1", "--max-batch-size", "64", *GRANULARITY])
    assert r.exit_code == EXIT_OK, r.output
    assert ("ckpt: 2 blocks of class Block (--checkpoint-class NAME for others; per-op "
            "checkpointing every 2nd block)") in r.stdout


def test_parallel_fsdp_cli():
    """The granularity reaches the sharded trace: per GPU, every 2nd block per op holds more
    than every block in full and less than no checkpointing."""
    runner = CliRunner()
    args = ["parallel", LM, "-b", "8", "--gpus", "2", "--gpu", "rtx3090", "--strategy",
            "fsdp", "--json"]

    def peak(*extra):
        r = runner.invoke(cli, [*args, *extra])
        assert r.exit_code == EXIT_OK, r.output
        return json.loads(r.stdout)["strategies"][0]["gpus"][0]["peak_allocated_bytes"]
    assert peak("--checkpointing") < peak(*GRANULARITY) < peak()


def test_check_config_key(tmp_path):
    cfg = tmp_path / "setup.cfg"
    case = f"[oomdoctor]\nbaseline = base.json\n\n[oomdoctor:lm]\nmodel = {LM}\n" \
           "batch_size = 8\ncheckpointing = true\n"
    cfg.write_text(case + "checkpoint_every = 2\ncheckpoint_policy = op\n")
    runner = CliRunner()
    r = runner.invoke(cli, ["check", "-j", "1", "--config", str(cfg), "--update"])
    assert r.exit_code == EXIT_OK, r.output
    recorded = json.loads((tmp_path / "base.json").read_text())["cases"]["lm"]
    assert recorded["config"]["checkpoint_every"] == 2
    assert recorded["config"]["checkpoint_policy"] == "op"
    assert runner.invoke(cli, ["check", "-j", "1", "--config", str(cfg)]).exit_code == EXIT_OK
    cfg.write_text(case.replace("true", "false") + "checkpoint_every = 2\n")
    r = runner.invoke(cli, ["check", "-j", "1", "--config", str(cfg)])
    assert r.exit_code == EXIT_USAGE and "checkpointing = true" in r.output
