"""Reduce.cuh's global-reduction buffer (oomdoctor.sim.reductions) and cuBLASLt's own workspace
in torch <= 2.11 (sim.versions CUBLASLT_WORKSPACE_SHARED), against what an H200 measured."""
from __future__ import annotations

import os

import torch

from oomdoctor.models.loader import load_model_file
from oomdoctor.plans.estimate import Budget, estimate
from oomdoctor.sim.gpus import PROFILES
from oomdoctor.sim.reductions import reduce_shape, scratch_bytes
from oomdoctor.sim.trace import TraceConfig
from oomdoctor.sim.versions import parse_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20


def _scratch(x: torch.Tensor, dim, gpu: str = "h200"):
    r = reduce_shape("sum.dim_IntList", (x, dim), {})
    return scratch_bytes(r, *PROFILES[gpu].multiprocessors)


def test_a_bias_gradient_over_4096_rows_stages_16_mib_on_an_h200():
    """setReduceConfig for (4096, 512).sum(0): 4-wide output vectors, blocks of 32 x 4 threads,
    4 blocks across the outputs and 64 along the rows: 4 B x 512 x 64 x 32 x 4 = 16 MiB, and
    4 B of semaphore per output block. Measured: tiny_mlp at batch 4096 allocated 16 MiB more
    than the trace at fc2's bias gradient, in fp32, AMP and pure bf16 alike."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.empty(4096, 512, dtype=dtype, device="meta")
        assert _scratch(x, [0]) == (16 * MiB, 16)


def test_small_or_row_reductions_need_no_global_buffer():
    assert _scratch(torch.empty(64, 512, device="meta"), [0]) is None     # tiny_mlp_b64 snapshot
    assert _scratch(torch.empty(4096, 10, device="meta"), [1]) is None    # along contiguous rows
    assert reduce_shape("mul.Tensor", (torch.empty(4, device="meta"),), {}) is None


def test_tiny_mlp_matches_the_h200_with_the_measured_torch():
    """nvidia-h200-2.11.0.json, tiny_mlp fp32 at batch 4096: 120,194,560 B allocated and
    153,092,096 B reserved; with torch 2.11's facts the estimate is the same to the MiB, and
    2.12's has no cuBLASLt workspace of its own (1 MiB less)."""
    spec = load_model_file(os.path.join(ROOT, "sample_models", "tiny_mlp.py"))
    budget = Budget(PROFILES["h200"], margin=0.0)
    e11 = estimate(spec, TraceConfig(4096, torch=parse_version("2.11.0")), budget)
    e12 = estimate(spec, TraceConfig(4096, torch=parse_version("2.12.0")), budget)
    assert abs(e11.peak_allocated_bytes - 120194560) < MiB // 4
    assert e11.peak_reserved_bytes == 153092096
    assert e11.peak_allocated_bytes - e12.peak_allocated_bytes == MiB
