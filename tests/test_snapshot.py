"""Memory snapshots (issue #21): `estimate --snapshot` read by torch's own _memory_viz, and
`explain snapshot.pickle` on simulated and real (H200) snapshots, with the safe unpickler."""
import io
import json
import os
import pickle
import re
from collections import defaultdict

import pytest
import torch.cuda._memory_viz as mv
from click.testing import CliRunner

from oomdoctor.cli import EXIT_OK, EXIT_USAGE, cli
from oomdoctor.explain import parse_size
from oomdoctor.explain.snapshot import UnsafeSnapshot, load_snapshot
from oomdoctor.explain.snapshot_report import explain_snapshot, snapshot_to_json
from oomdoctor.models.loader import load_model
from oomdoctor.plans.estimate import Budget
from oomdoctor.plans.snapshot import estimate_with_snapshot
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.sim.gpus import PROFILES, custom_profile
from oomdoctor.sim.trace import TraceConfig

ROOT = os.path.dirname(os.path.dirname(__file__))
BLOCKS = os.path.join(ROOT, "tests", "models", "tiny_blocks.py")
MLP = os.path.join(ROOT, "sample_models", "tiny_mlp.py")
REAL = os.path.join(ROOT, "tests", "snapshots")
with open(os.path.join(REAL, "snapshots.json")) as f:
    REAL_RUNS = json.load(f)["runs"]


@pytest.fixture(scope="module")
def blocks_snapshot():
    spec = load_model(BLOCKS)
    return estimate_with_snapshot(spec, TraceConfig(64), Budget(PROFILES["rtx3090"]))


def _walk(trace):
    """An independent replay of device_traces as memory_viz's timeline draws it: the running
    sum of alloc minus free_completed sizes; its maximum, the live blocks at the maximum and at
    the end (address -> entry)."""
    live, cur, peak, at_peak = {}, 0, 0, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif e["action"] == "free_completed":
            cur -= live.pop(e["addr"])["size"]
    return peak, at_peak, live


def test_estimate_snapshot_renders_in_torch_memory_viz(blocks_snapshot):
    est, snap = blocks_snapshot
    assert est.fits
    trace = snap["device_traces"][0]
    # torch's own functions read it without error.
    stats = mv.segsum(snap)
    assert f"total_reserved: {mv._format_size(est.peak_reserved_bytes)}" in stats
    assert "entries" in mv.trace(snap)
    for html in (mv.trace_plot(snap), mv.segment_plot(snap)):
        assert "snapshot.pickle" in html and "add_local_files" in html
    # The flamegraph lines of memory() carry bytes: their sum is every segment's bytes.
    lines = mv.memory(snap, format_flamegraph=lambda s: s).splitlines()
    assert sum(int(ln.rsplit(" ", 1)[1]) for ln in lines) == est.peak_reserved_bytes
    assert sum(s["total_size"] for s in snap["segments"]) == est.peak_reserved_bytes
    # The timeline's peak is max_memory_allocated.
    peak, _, end = _walk(trace)
    assert peak == est.peak_allocated_bytes
    # memory_viz rebuilds earlier states by undoing the trace from the segments: the blocks
    # live at the end of the trace must be exactly the active blocks of the segments.
    active = {b["address"]: b["size"] for s in snap["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated"}
    assert active == {a: e["size"] for a, e in end.items()}
    assert sum(mv.calc_active(s) for s in snap["segments"]) == sum(active.values())
    assert {e["action"] for e in trace} >= {"alloc", "free_requested", "free_completed",
                                            "segment_alloc"}


def test_snapshot_frames_name_module_op_and_category(blocks_snapshot):
    est, snap = blocks_snapshot
    _, at_peak, _ = _walk(snap["device_traces"][0])
    by_cat = defaultdict(int)
    texts = set()
    for e in at_peak.values():
        marker = e["frames"][-1]
        assert marker["filename"].startswith("oomdoctor:")
        by_cat[marker["name"]] += e["size"]
        texts.add(f"{e['frames'][0]['filename']}: {e['frames'][0]['name']}")
    # Block sizes are the requests rounded to 512 bytes: each category within that of the
    # estimate's breakdown (which counts the requests).
    for cat in ("parameters", "gradients", "optimizer_state", "activations", "temporaries"):
        n = sum(1 for e in at_peak.values() if e["frames"][-1]["name"] == cat)
        assert 0 <= by_cat[cat] - est.breakdown[cat] < 512 * max(n, 1), cat
    assert "blocks.0.up: aten::addmm" in texts
    assert any(t.startswith("AdamW.step: exp_avg of blocks.0.up.weight") for t in texts)


def test_explain_of_simulated_snapshot_matches_the_estimate(blocks_snapshot):
    est, snap = blocks_snapshot
    r = explain_snapshot(io.BytesIO(pickle.dumps(snap)), "step.pickle")
    assert r.simulated and r.live.moment == "peak"
    assert r.live.allocated_bytes == est.peak_allocated_bytes
    assert r.live.phase == f"{est.peak_phase} of step {est.peak_step}"
    cats = dict(r.by_category)
    assert abs(cats["activations"] - est.breakdown["activations"]) < 512 * len(r.live.blocks)
    # The estimate's largest activations at the peak, grouped by block the same way.
    mods = dict(r.by_module)
    for module, nbytes in est.top_activations:
        assert 0 <= mods[module] - nbytes < 512 * 8, module
    assert r.fragmentation.reserved_bytes == est.peak_reserved_bytes
    assert [f.effect_bytes for f in r.fixes] == sorted((f.effect_bytes for f in r.fixes),
                                                       reverse=True)
    halve = next(f for f in r.fixes if f.id == "halve_micro_batch")
    assert halve.effect_bytes == cats["activations"] // 2
    json.dumps(snapshot_to_json(r))


def test_snapshot_of_a_step_that_does_not_fit_ends_at_the_oom():
    spec = load_model(BLOCKS)
    budget = Budget(custom_profile(40 * 2**20), margin=0.0, context_bytes=0)
    est, snap = estimate_with_snapshot(spec, TraceConfig(64), budget,
                                       AllocatorConfig(expandable_segments=True))
    assert not est.fits
    trace = snap["device_traces"][0]
    assert trace[-1]["action"] == "oom"
    assert "segment_map" in {e["action"] for e in trace}
    assert sum(s["total_size"] for s in snap["segments"]) <= budget.limit_bytes
    mv.segsum(snap)
    r = explain_snapshot(io.BytesIO(pickle.dumps(snap)))
    assert r.live.moment == "oom" and r.oom_requested == trace[-1]["size"]


def _summary_numbers():
    """The real OOM's own message (snapshots.json): allocated and reserved-but-unallocated."""
    err = REAL_RUNS["gpt2_small_b8_fp32_oom.pickle"]["error"]
    alloc = parse_size(re.search(r"memory ([\d.]+ \w+) is allocated by PyTorch", err).group(1))
    free = parse_size(re.search(r"and ([\d.]+ \w+) is reserved by PyTorch but", err).group(1))
    req = parse_size(re.search(r"Tried to allocate ([\d.]+ \w+)", err).group(1))
    return alloc, free, req


def test_explain_real_oom_observer_snapshot():
    with open(os.path.join(REAL, "gpt2_small_b8_fp32_oom.pickle"), "rb") as f:
        r = explain_snapshot(f)
    alloc, free, req = _summary_numbers()
    assert not r.simulated and r.live.moment == "oom"
    assert r.oom_requested == req
    # Numbers printed with two decimals: within half a unit of the last digit.
    assert abs(r.live.allocated_bytes - alloc) <= 0.005 * 2**30
    assert abs(r.fragmentation.free_bytes - free) <= 0.005 * 2**20
    assert r.fragmentation.largest_free_bytes < req
    assert r.expandable_helps is False          # 56 MiB free cannot hold 72 MiB
    assert r.by_category[0][0] == "activations"  # failed in the first forward
    assert dict(r.by_category)["parameters"] > 0
    assert "gpt2_small.py" in r.sites[0][0]


@pytest.mark.parametrize("name", ["gpt2_small_b2_fp32.pickle", "tiny_mlp_b64_fp32.pickle"])
def test_explain_real_training_snapshots(name):
    with open(os.path.join(REAL, name), "rb") as f:
        r = explain_snapshot(f)
    real = REAL_RUNS[name]
    assert r.live.moment == "peak"
    # memory_viz counts requests; max_memory_allocated the rounded blocks: within 1%.
    assert 0.99 * real["max_memory_allocated"] <= r.live.allocated_bytes \
        <= real["max_memory_allocated"]
    assert r.live.reserved_bytes <= real["max_memory_reserved"]
    cats = dict(r.by_category)
    # AdamW holds exp_avg and exp_avg_sq: twice the parameters' bytes.
    assert cats["optimizer_state"] == 2 * cats["parameters"]
    assert {"activations", "backward", "parameters"} <= set(cats)


def test_malicious_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [Evil()], "device_traces": []}))
    with pytest.raises(UnsafeSnapshot, match=r"system.*not a plain memory snapshot"):
        load_snapshot(io.BytesIO(evil.read_bytes()))
    res = CliRunner().invoke(cli, ["explain", str(evil)])
    assert res.exit_code == EXIT_USAGE
    assert "refused" in res.stderr and "nothing in it was run" in res.stderr
    assert res.stdout == ""
    assert not marker.exists()


def test_cli_estimate_snapshot_then_explain(tmp_path):
    path = tmp_path / "step.pickle"
    res = CliRunner().invoke(cli, ["estimate", MLP, "-b", "64", "--gpu", "rtx3090",
                                   "--snapshot", str(path), "--json"])
    assert res.exit_code == EXIT_OK, res.output
    doc = json.loads(res.stdout)
    assert doc["snapshot"]["path"] == str(path) and doc["snapshot"]["events"] > 0
    assert "memory_viz" in res.stderr
    res = CliRunner().invoke(cli, ["explain", str(path), "--json"])
    assert res.exit_code == EXIT_OK, res.output
    out = json.loads(res.stdout)
    assert out["simulated"] and out["allocated_bytes"] == doc["peak_allocated_bytes"]
    assert out["fragmentation"]["reserved_bytes"] == doc["peak_reserved_bytes"]
    text = CliRunner().invoke(cli, ["explain", str(path)])
    assert "live by category" in text.stdout and "expandable_segments" in text.stdout


def test_cli_probe_snapshot_per_configuration(tmp_path):
    path = tmp_path / "probe.pickle"
    res = CliRunner().invoke(cli, ["probe", MLP, "--gpu", "t4", "--precision", "fp32",
                                   "--precision", "fp16", "--no-checkpointing", "-j", "1",
                                   "--max-batch-size", "256", "--snapshot", str(path), "--json"])
    assert res.exit_code == EXIT_OK, res.output
    doc = json.loads(res.stdout)
    results = {r["precision"]: r for r in doc["results"]}
    assert {s["configuration"] for s in doc["snapshots"]} == {"fp32", "fp16"}
    for s in doc["snapshots"]:
        r = results[s["configuration"]]
        assert s["path"] == str(tmp_path / f"probe.{s['configuration']}.pickle")
        assert s["batch_size"] == r["max_batch_size"]
        with open(s["path"], "rb") as f:
            snap = load_snapshot(f)
        # The probe's own estimate at its maximum, and the snapshot's timeline peak.
        assert _walk(snap["device_traces"][0])[0] == r["peak_allocated_bytes"]


def test_simulated_snapshot_against_the_real_h200_snapshot(tmp_path):
    """gpt2_small b2 fp32 two AdamW steps: the simulator's snapshot on an H200 profile and the
    one torch recorded on an H200, both read by explain (about 5 s: a 124M-parameter trace)."""
    spec = load_model(os.path.join(ROOT, "sample_models", "gpt2_small.py"))
    est, snap = estimate_with_snapshot(spec, TraceConfig(2), Budget(PROFILES["h200"]))
    sim = explain_snapshot(io.BytesIO(pickle.dumps(snap)))
    with open(os.path.join(REAL, "gpt2_small_b2_fp32.pickle"), "rb") as f:
        real = explain_snapshot(f)
    measured = REAL_RUNS["gpt2_small_b2_fp32.pickle"]
    assert abs(est.peak_allocated_bytes / measured["max_memory_allocated"] - 1) < 0.01
    assert abs(est.peak_reserved_bytes / measured["max_memory_reserved"] - 1) < 0.02
    s, r = dict(sim.by_category), dict(real.by_category)
    assert abs(s["parameters"] / r["parameters"] - 1) < 0.01
    assert abs(s["optimizer_state"] / r["optimizer_state"] - 1) < 0.01
    assert abs(s["activations"] / r["activations"] - 1) < 0.05
    # The real run's backward has no Python frames; the simulator names its categories.
    assert abs((s.get("temporaries", 0) + s.get("gradients", 0)) / r["backward"] - 1) < 0.1
