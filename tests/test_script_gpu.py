"""Training scripts as they are, against their real peaks on a GPU.

benchmarks/results/scripts/nvidia-h100-2.11.0.json holds torch.cuda.max_memory_allocated/
reserved of each script in tests/scripts/, run on an NVIDIA H100 80GB HBM3 (driver 580.159.04,
torch 2.11.0+cu130, transformers 5.17.0, lightning 2.6.6) and stopped where oomdoctor's run
stops (benchmarks/measure_scripts.py). oomdoctor runs the same scripts here on a fake H100
(`oomdoctor estimate --gpu h100-80 -- python SCRIPT ARGS`): every allocated peak within the
ground-truth band (-6% / +3%, tests/test_ground_truth.py); the transformer scripts, whose
memory is all tensors the trace sees, within 0.6% allocated and 1% reserved. What the others
miss is what their model files' estimates miss (tests/test_calibration.py): cuDNN's
convolution workspaces (resnet_cnn: reserved -19%) and the allocator's small-segment behaviour
on models of a few MiB (pad_loop: -3.2 MiB allocated, reserved -17%).
"""
from __future__ import annotations

import json
import os

import pytest

from oomdoctor.models.script import parse_command
from oomdoctor.plans.estimate import Budget, estimate_script
from oomdoctor.sim.gpus import get_profile
from oomdoctor.sim.trace import TraceConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "scripts", "nvidia-h100-2.11.0.json")
RECORDS = json.load(open(RESULTS))["records"]
UNDER, OVER = 0.06, 0.03
TRANSFORMERS = ("gpt2_small", "bert_base", "hf_trainer_clm", "lightning_loop")


def _id(r):
    return r["script"] + ":" + " ".join(a.replace("sample_models/", "") for a in r["args"])


@pytest.mark.parametrize("record", RECORDS, ids=_id)
def test_a_script_lands_on_its_real_gpu_peak(record):
    if record["script"] == "hf_trainer_clm.py":
        pytest.importorskip("transformers")
    if record["script"] == "lightning_loop.py":
        pytest.importorskip("lightning")
    assert record["ended"] == "steps" and record["steps"] == 2
    script = parse_command(["python", os.path.join(ROOT, "tests", "scripts", record["script"]),
                            *record["args"]])
    e = estimate_script(script, TraceConfig(1), Budget(get_profile("h100-80")))
    real_alloc, real_res = record["peak_allocated_bytes"], record["peak_reserved_bytes"]
    assert -UNDER <= e.peak_allocated_bytes / real_alloc - 1 <= OVER, \
        (e.peak_allocated_bytes, real_alloc)
    if any(k in _id(record) for k in TRANSFORMERS):
        assert abs(e.peak_allocated_bytes / real_alloc - 1) <= 0.006
        assert abs(e.peak_reserved_bytes / real_res - 1) <= 0.01
