"""cuDNN's convolution workspaces (oomdoctor.sim.convolution) against the H200 grid measured by
benchmarks/cudnn_conv.py (benchmarks/results/cudnn_conv/: ten shapes, batches 2-1024, fp32 and
bf16, the allocator's own events of one forward and one backward each), and their place in a
step's events. The whole-network check - ResNet and ViT training runs, never fitted on - is
tests/test_calibration.py's, by the same rule."""
from __future__ import annotations

import glob
import json
import os
import statistics

import pytest
import torch

from oomdoctor.models.loader import load_model_file
from oomdoctor.plans.estimate import Budget, device_events, estimate, estimate_trace, trace_for
from oomdoctor.plans.probe import probe_config
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.sim.convolution import conv_calls, workspace_bytes
from oomdoctor.sim.gpus import get_profile
from oomdoctor.sim.trace import TraceConfig
from oomdoctor.sim.workspaces import conv_workspaces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "cudnn_conv", "*.json")))
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MB = 10**6


def _blocks(n: int) -> int:
    return -(-n // 512) * 512


def _measured(rec: dict) -> dict[str, int]:
    """The largest allocation of each pass that is not an output or a gradient."""
    t = rec["tensors"]
    fwd = [n for a, n in rec["forward"] if a == "alloc"]
    assert fwd[0] == t["output"]
    bwd = [n for a, n in rec["backward"] if a == "alloc"]
    at = bwd.index(t["weight"])
    return {"forward": max(fwd[1:], default=0),
            "data": max(bwd[1:at], default=0),
            "weight": max(bwd[at + 1:], default=0)}


def _predicted(rec: dict) -> dict[str, int]:
    dt, s, p = _DTYPES[rec["dtype"]], rec["stride"], rec["padding"]
    with torch.device("meta"):
        x = torch.empty(rec["batch"], rec["in_channels"], rec["size"], rec["size"], dtype=dt)
        w = torch.empty(rec["out_channels"], rec["in_channels"], rec["kernel"], rec["kernel"],
                        dtype=dt)
    geometry = ([s, s], [p, p], [1, 1], False, [0, 0], 1)
    calls = conv_calls("convolution_backward.default",
                       (None, x, w, None, *geometry, [not rec["first"], True, False]), {})
    calls[2] = conv_calls("convolution.default", (x, w, None, *geometry), {})[0]
    return {c.role: workspace_bytes(c) for c in calls.values()}


def _grid() -> list[dict]:
    out = []
    for path in FILES:
        with open(path) as f:
            out += [r for r in json.load(f)["records"] if not r["benchmark"]]
    return out


GRID = _grid()


def test_the_grid_is_there():
    assert len(GRID) >= 128, FILES
    assert {r["dtype"] for r in GRID} == {"float32", "bfloat16"}


def _pairs(role: str, records: list[dict]) -> list[tuple[int, int]]:
    return [(_measured(r)[role], _predicted(r)[role]) for r in records
            if role in _predicted(r)]


def test_forward_and_data_pass_against_the_grid():
    """Exact (the same 512-byte block, or a few hundred bytes where the rule takes none) for
    94 of 128 forwards and 98 of 104 data passes, never more than 8.7 MB low (a plan's extra
    scratch); where cuDNN picked a plan that stages fewer operands (first layers, fp32 3x3 at
    small batches, some 1x1 of stride 2) it errs high."""
    for role, exact_min, count in (("forward", 94, 128), ("data", 98, 104)):
        pairs = _pairs(role, GRID)
        assert len(pairs) == count
        exact = sum(_blocks(m) == _blocks(p) or abs(m - p) <= 4096 for m, p in pairs)
        assert exact >= exact_min, (role, exact)
        assert min(p - m for m, p in pairs) > -8.7 * MB, role


def test_weight_pass_against_the_grid():
    """The weight pass stages the same operands (a 1x1 plan that stages none keeps a partial
    filter per sample) and leaves out split-K partial sums (0 to 25 MB, per plan): a median
    within 2 MB, never more than 26 MB low."""
    errors = [p - m for m, p in _pairs("weight", GRID)]
    assert abs(statistics.median(errors)) < 2 * MB
    assert min(errors) > -26 * MB


def test_which_pointwise_convolutions_stage():
    """ResNet-50's 1x1 shapes (the -pointwise file): cuDNN stages input and output at stride 2,
    on a 7x7 output plane, and in 16 bits at 1024 x 512 channels on 14x14; elsewhere it takes
    a few hundred bytes. The rule's choice is the measured one in all 48 records, forward and
    data pass."""
    ones = [r for r in GRID if r["shape"].startswith("1x1-") and r["batch"] in (64, 512)]
    assert len(ones) == 48
    for role in ("forward", "data"):
        for m, p in _pairs(role, ones):
            assert _blocks(m) == _blocks(p) or (m < 1024 and p == 0), (role, m, p)


def test_a_large_batch_is_staged_in_pieces():
    """One operand holds at most 2**31 - 1 elements: ResNet's stem at batch 4096 (fp32) stages
    2674 samples, 10,197,005,072 bytes measured in the training run's forward
    (benchmarks/results/newpaths/traces/resnet_cnn-fp32-ck0-b4096). That plan stages the
    3-channel input unpadded where the patch embedding's pads it to 4 (vit_b16's events), as
    the rule does: 5.3% over."""
    with torch.device("meta"):
        x, w = torch.empty(4096, 3, 224, 224), torch.empty(64, 3, 7, 7)
    [call] = conv_calls("convolution.default",
                        (x, w, None, [2, 2], [3, 3], [1, 1], False, [0, 0], 1), {}).values()
    assert workspace_bytes(call) == workspace_bytes(call, batch=2674) \
        < workspace_bytes(call, batch=2675) * 2          # the cap, not the batch
    assert workspace_bytes(call) == pytest.approx(10_197_005_072, rel=0.06)


def test_grouped_transposed_and_3d_convolutions_are_left_out():
    with torch.device("meta"):
        x = torch.empty(2, 8, 16, 16)
        args = (x, torch.empty(8, 1, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 8)
        assert conv_calls("convolution.default", args, {}) == {}
        args = (x, torch.empty(8, 4, 3, 3), None, [2, 2], [1, 1], [1, 1], True, [0, 0], 1)
        assert conv_calls("convolution.default", args, {}) == {}
        x3 = torch.empty(2, 8, 4, 16, 16)
        args = (x3, torch.empty(8, 8, 3, 3, 3), None, [1] * 3, [1] * 3, [1] * 3, False,
                [0] * 3, 1)
        assert conv_calls("convolution.default", args, {}) == {}


@pytest.fixture(scope="module")
def resnet_trace():
    spec = load_model_file(os.path.join(ROOT, "sample_models", "resnet_cnn.py"))
    return spec, trace_for(spec, TraceConfig(2, precision="bf16-pure"), get_profile("h200"))


def test_each_pass_gets_its_workspace_after_its_output(resnet_trace):
    """ResNet-18's 20 convolutions in each of the two traced steps: a workspace after each
    forward output (the 1x1 shortcuts are 16-bit of stride 2: they stage input and output),
    each weight gradient, and each input gradient but the stem's (the batch needs none), each
    allocated and freed at once."""
    _, trace = resnet_trace
    at = conv_workspaces(trace, get_profile("h200"))
    roles = [trace.storages[trace.events[i][1]].conv.role for i in at]
    assert (roles.count("forward"), roles.count("data"), roles.count("weight")) == (40, 38, 40)
    dev = device_events(trace, get_profile("h200"))
    assert len(dev.events) == len(trace.events) + len(dev.workspace_handles) \
        + 2 * len(dev.scratch_handles)
    for i in at:                          # each right after its output: alloc, then free
        j = dev.trace_index.index(i) + 1
        assert dev.events[j][0] and not dev.events[j + 1][0]
        assert dev.events[j][1] == dev.events[j + 1][1] and dev.events[j][2] == at[i]


def test_only_on_cards_the_rule_was_measured_for(resnet_trace):
    _, trace = resnet_trace
    assert conv_workspaces(trace, get_profile("t4")) == {}        # sm75: no TF32 plans
    assert conv_workspaces(trace, get_profile("mi250")) == {}     # MIOpen
    assert conv_workspaces(trace, get_profile("rtx3090"))


def test_the_probe_sizes_them_at_the_batch_it_extrapolates_to(resnet_trace):
    """The probe replays the base trace with sizes extrapolated to batch b: the workspaces
    are sized at b, so its replay agrees with a trace made at b."""
    spec, base = resnet_trace
    budget = Budget(get_profile("h200"))
    big = trace_for(spec, TraceConfig(6, precision="bf16-pure"), budget.gpu)
    assert sorted(conv_workspaces(base, budget.gpu, batch=6).values()) == \
        sorted(conv_workspaces(big, budget.gpu).values())
    direct = estimate(spec, TraceConfig(6, precision="bf16-pure"), budget)
    assert probe_config(spec, TraceConfig(1, precision="bf16-pure"), budget,
                        AllocatorConfig()).max_batch_size > 6
    assert estimate_trace(big, budget).peak_reserved_bytes == direct.peak_reserved_bytes


def test_a_large_16_bit_batch_norm_input_takes_an_fp32_copy():
    """Measured in ResNet-50's bf16 events at batch 3312 (benchmarks/results/newpaths/traces/
    torchvision_resnet50-bf16-ck0-b3312-*): each batch norm whose input is past 2**31 - 1
    elements took 4 bytes per element, 10,635,706,368 for 64 x 112 x 112 per sample, in the
    forward only; at batch 64 none. Sized at the probe's batch, from a small trace."""
    from oomdoctor.models.loader import load_model
    from oomdoctor.sim.normalization import upcast_bytes
    from oomdoctor.sim.workspaces import norm_upcasts
    spec = load_model("torchvision:resnet50")
    trace = trace_for(spec, TraceConfig(2, precision="bf16"), get_profile("h200"))
    at = norm_upcasts(trace, get_profile("h200"), batch=3312)
    assert sorted(at.values()) == [10_635_706_368] * 10      # five a forward, two steps
    assert not norm_upcasts(trace, get_profile("h200"), batch=64)
    assert not norm_upcasts(trace, get_profile("mi250"), batch=3312)
    assert upcast_bytes(2**31 - 1) == 0 and upcast_bytes(2**31) == 2**33
