"""`--memory SIZE --arch smXY`: any card by capacity and architecture.

The architecture decides bf16 (sm80+), the attention kernel (flash from sm80, for 16-bit
inputs) and the cuBLAS workspace each thread's handle takes from the caching allocator:
torch's default CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8" (2 x 4096 KiB + 8 x 16 KiB) before
Hopper, 32 MiB on sm90 (aten/src/ATen/cuda/CublasHandlePool.cpp); the forward and autograd's
backward thread each have one.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from oomdoctor.cli import EXIT_OK, EXIT_USAGE, cli
from oomdoctor.sim.gpus import parse_arch

SAMPLES = Path(__file__).parent.parent / "sample_models"


def _estimate(*args):
    r = CliRunner().invoke(cli, ["estimate", *args, "--json"])
    assert r.exit_code == EXIT_OK, r.output
    return json.loads(r.stdout)


def test_hopper_takes_the_larger_cublas_workspaces():
    tiny = str(SAMPLES / "tiny_mlp.py")
    ampere = _estimate(tiny, "-b", "64", "--memory", "24GiB", "--arch", "sm86")
    hopper = _estimate(tiny, "-b", "64", "--memory", "24GiB", "--arch", "sm90")
    per_handle = 32 * 2**20 - (2 * 4096 + 8 * 16) * 2**10
    assert hopper["peak_allocated_bytes"] - ampere["peak_allocated_bytes"] == 2 * per_handle


def test_turing_has_no_bf16_and_no_flash_attention():
    gpt2 = str(SAMPLES / "gpt2_small.py")
    turing = _estimate(gpt2, "-b", "1", "--memory", "16GiB", "--arch", "sm75",
                       "--precision", "fp16")
    ampere = _estimate(gpt2, "-b", "1", "--memory", "16GiB", "--arch", "sm80",
                       "--precision", "fp16")
    assert any("efficient kernel (sm75" in n for n in turing["notes"])
    assert any("flash kernel (sm80" in n for n in ampere["notes"])
    r = CliRunner().invoke(cli, ["probe", gpt2, "--memory", "16GiB", "--arch", "sm75",
                                 "--precision", "bf16"])
    assert r.exit_code == EXIT_USAGE and "no bf16 support" in r.output


def test_arch_forms_and_refusals():
    assert parse_arch("sm89") == parse_arch("sm_89") == parse_arch("8.9") == (8, 9)
    assert parse_arch("sm120") == (12, 0)
    with pytest.raises(ValueError, match="AMD target"):
        parse_arch("gfx90a")
    tiny = str(SAMPLES / "tiny_mlp.py")
    for args, text in ((["--memory", "64GiB", "--arch", "gfx-mi250"], "cannot read --arch"),
                       (["--memory", "64GiB", "--arch", "gfx805"], "unknown AMD target"),
                       (["--gpu", "rtx3090", "--arch", "sm90"], "--arch goes with --memory"),
                       (["--memory", "8GiB", "--arch", "ampere"], "cannot read --arch")):
        r = CliRunner().invoke(cli, ["estimate", tiny, "-b", "1", *args])
        assert r.exit_code == EXIT_USAGE and text in r.output, r.output


def test_the_python_api_takes_arch():
    import oomdoctor
    tiny = str(SAMPLES / "tiny_mlp.py")
    e = oomdoctor.estimate(tiny, 64, memory=24 * 2**30, arch="sm90")
    assert e.peak_allocated_bytes == _estimate(tiny, "-b", "64", "--memory", "24GiB", "--arch",
                                               "sm90")["peak_allocated_bytes"]


@pytest.mark.parametrize("message,profile", [
    # github.com/stepfun-ai/Step-Video-T2V/issues/8 (8 x L40S)
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 216.00 MiB. GPU  has a "
     "total capacity of 44.42 GiB of which 118.12 MiB is free. Including non-PyTorch memory, "
     "this process has 44.29 GiB memory in use. Of the allocated memory 43.88 GiB is allocated "
     "by PyTorch, and 582.00 KiB is reserved by PyTorch but unallocated.", "l40s"),
    # github.com/Wan-Video/Wan2.1/issues/465 (RTX 5090)
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has a "
     "total capacity of 31.37 GiB of which 15.88 MiB is free. Including non-PyTorch memory, "
     "this process has 31.34 GiB memory in use. Of the allocated memory 30.74 GiB is allocated "
     "by PyTorch, and 19.41 MiB is reserved by PyTorch but unallocated.", "rtx5090"),
])
def test_profiles_match_the_capacity_real_cards_report(message, profile, tmp_path):
    """`explain --model` picks the card from the log's capacity: these published OOM messages
    name the capacity the driver reported, which the profiles must equal."""
    log = tmp_path / "oom.log"
    log.write_text(message + "\n")
    r = CliRunner().invoke(cli, ["explain", str(log), "--model", str(SAMPLES / "tiny_mlp.py"),
                                 "--batch-size", "1", "--json"])
    assert f"simulating on {profile}" in r.stderr, r.output


@pytest.mark.parametrize("message,profiles", [
    # github.com/boson-ai/higgs-audio/issues/48 (RTX 4060 Ti 16 GB). The 4070 Ti SUPER reports
    # 15.56 GiB (gpus.py), within 10 MiB: a capacity cannot tell the two apart.
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total "
     "capacity of 15.55 GiB of which 43.25 MiB is free. Including non-PyTorch memory, this "
     "process has 15.38 GiB memory in use. Of the allocated memory 14.87 GiB is allocated by "
     "PyTorch, with 411.21 MiB allocated in private pools (e.g., CUDA Graphs), and 266.35 MiB is "
     "reserved by PyTorch but unallocated.", ("rtx4060ti-16", "rtx4070ti-super")),
    # github.com/aigc-apps/sd-webui-EasyPhoto/issues/281 (RTX 4080, the pre-2.1 format)
    ("OutOfMemoryError: CUDA out of memory. Tried to allocate 11.39 GiB (GPU 0; 15.99 GiB total "
     "capacity; 8.01 GiB already allocated; 5.48 GiB free; 8.14 GiB reserved in total by "
     "PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
     "fragmentation.", ("rtx4080",)),
    # 8 x H200 and 8 x B200 training logs (public benchmark summary, see gpus.py)
    ("[rank5]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 37.09 GiB. GPU 5 "
     "has a total capacity of 139.80 GiB of which 35.64 GiB is free.", ("h200",)),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 55.88 GiB. GPU 0 has a total "
     "capacity of 178.35 GiB of which 10.00 GiB is free. Including non-PyTorch memory, this "
     "process has 168.34 GiB memory in use. Of the allocated memory 167.64 GiB is allocated by "
     "PyTorch, and 4.62 MiB is reserved by PyTorch but unallocated.", ("b200",)),
    # rocm.blogs.amd.com/artificial-intelligence/gptq/README.html (one GPU of an MI300X node)
    ("OutOfMemoryError: HIP out of memory. Tried to allocate 672.00 MiB. GPU 0 has a total "
     "capacity of 191.98 GiB of which 0 bytes is free. Of the allocated memory 191.53 GiB is "
     "allocated by PyTorch, and 520.00 KiB is reserved by PyTorch but unallocated. If reserved "
     "but unallocated memory is large try setting PYTORCH_HIP_ALLOC_CONF=expandable_segments:True "
     "to avoid fragmentation.", ("mi300x",)),
    # github.com/RooCodeInc/Roo-Code/issues/6541 (a 64 GiB gfx90a device: one MI250 GCD)
    ("OutOfMemoryError('HIP out of memory. Tried to allocate 1.63 GiB. GPU 0 has a total "
     "capacity of 63.98 GiB of which 1.18 GiB is free. Of the allocated memory 57.09 GiB is "
     "allocated by PyTorch, with 26.00 MiB allocated in private pools (e.g., HIP Graphs), and "
     "1.23 GiB is reserved by PyTorch but unallocated.')", ("mi250",)),
])
def test_new_profiles_match_published_capacities(message, profiles, tmp_path):
    """The same check for the profiles of issue 13, each against its published message."""
    log = tmp_path / "oom.log"
    log.write_text(message + "\n")
    r = CliRunner().invoke(cli, ["explain", str(log), "--model", str(SAMPLES / "tiny_mlp.py"),
                                 "--batch-size", "1", "--json"])
    picked = r.stderr.split("simulating on ")[1].split()[0] if "simulating on" in r.stderr else None
    assert picked in profiles, r.stderr


def test_every_profile_is_offered_by_gpu_help():
    """`--gpu` lists every profile, so a new one needs no second edit."""
    from oomdoctor.sim.gpus import PROFILES
    r = CliRunner().invoke(cli, ["estimate", "--help"])
    text = " ".join(r.output.split())
    for name in ("rtx4060ti-16", "rtx4070ti-super", "rtx4080", "h200", "b200", "mi250", "mi300x"):
        assert name in PROFILES and name in text, name
