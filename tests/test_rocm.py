"""ROCm (AMD GPUs): oomdoctor's HIP model against a published ROCm measurement and PyTorch's source.

    python -m pytest tests/test_rocm.py -q

- RB-1/RB-2, the ROCm blog "Automatic mixed precision in PyTorch using AMD GPUs" (rocm-blogs,
  blogs/artificial-intelligence/automatic-mixed-precision; ROCm 6.0, a torch 2.3 nightly):
  ``torch.cuda.max_memory_allocated()`` over 512 training steps of a 1x1-conv net on one
  512x512 "image", 2061 MiB in fp32 and 1035 MiB with fp16 autocast + GradScaler. Rebuilt as
  tests/models/rocm_amp_convnet.py and compared within the band of tests/test_ground_truth.py
  (-6% / +3%: what a trace cannot see only adds memory - here MIOpen's convolution workspaces,
  which PyTorch takes from the caching allocator for the duration of each convolution). The blog
  does not name its GPU; the net has no GEMM and no attention, so neither the BLAS workspace nor
  the attention kernel of the target enters, and the MI250 profile stands for any of them.
- BLAS workspaces: exact differences from the constants of aten/src/ATen/cuda/
  CublasHandlePool.cpp (hipBLASLt 76 MiB per thread on Instinct targets, hipBLAS 32 MiB
  elsewhere, CUDA's 2 x 4096 KiB + 8 x 16 KiB before Hopper), and none at all for a step that
  runs no GEMM.
- Attention: the backend ROCm's select_sdp_backend picks (sdp_utils.cpp with AOTriton).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from oomdoctor.sim import rocm
from oomdoctor.cli import EXIT_OK, cli
from oomdoctor.plans.estimate import Budget, estimate_trace, trace_for
from oomdoctor.sim.gpus import MiB, get_profile
from oomdoctor.models.loader import load_model_file
from oomdoctor.sim.trace import TraceConfig

ROOT = Path(__file__).resolve().parent.parent
CONVNET = str(ROOT / "tests" / "models" / "rocm_amp_convnet.py")
TINY = str(ROOT / "sample_models" / "tiny_mlp.py")
GPT2 = str(ROOT / "sample_models" / "gpt2_small.py")
UNDER, OVER = 0.06, 0.03          # the band of tests/test_ground_truth.py
CUDA_AMPERE_WS = (2 * 4096 + 8 * 16) * 1024


def _estimate(*args) -> dict:
    r = CliRunner().invoke(cli, ["estimate", *args, "--json"])
    assert r.exit_code == EXIT_OK, r.output
    return json.loads(r.stdout)


@pytest.mark.parametrize("case, precision, published_mib", [
    ("RB-1 fp32", "fp32", 2061),
    ("RB-2 fp16 AMP", "fp16", 1035),
])
def test_rocm_blog_amp_max_memory_allocated(case, precision, published_mib):
    spec = load_model_file(CONVNET)
    budget = Budget(get_profile("mi250"), margin=0.0)
    e = estimate_trace(trace_for(spec, TraceConfig(1, precision=precision), budget.gpu), budget)
    # convs 2x256+256, 2 x (256x256+256), 256+1; three BatchNorms 2x256: the blog's ConvModel
    assert e.num_parameters == 768 + 2 * 65_792 + 257 + 3 * 512 == 134_145
    dev = e.peak_allocated_bytes / MiB / published_mib - 1
    assert -UNDER <= dev <= OVER, (
        f"{case}: oomdoctor {e.peak_allocated_bytes / MiB:,.1f} MiB vs published "
        f"{published_mib} MiB ({dev:+.2%}; band -{UNDER:.0%}/+{OVER:.0%}); peak in the "
        f"{e.peak_phase}, breakdown MiB { {k: round(v / MiB) for k, v in e.breakdown.items()} }")


@pytest.mark.parametrize("arch, per_thread", [
    ("gfx90a", rocm.HIPBLASLT_WORKSPACE),    # MI200: hipBLASLt preferred, 76 MiB
    ("gfx942", rocm.HIPBLASLT_WORKSPACE),    # MI300: hipBLASLt preferred (hipBLAS's would be 128)
    ("gfx1100", rocm.HIPBLAS_WORKSPACE),     # RX 7900: hipBLAS, 32 MiB
])
def test_rocm_blas_workspace_per_thread(arch, per_thread):
    """Two handles (forward and autograd's thread), each with its workspace from the caching
    allocator: the peak differs from an Ampere card's by exactly 2 x the difference."""
    ampere = _estimate(TINY, "-b", "64", "--memory", "64GiB", "--arch", "sm80")
    amd = _estimate(TINY, "-b", "64", "--memory", "64GiB", "--arch", arch)
    assert per_thread == {"gfx90a": 76, "gfx942": 76, "gfx1100": 32}[arch] * MiB
    assert amd["peak_allocated_bytes"] - ampere["peak_allocated_bytes"] == \
        2 * (per_thread - CUDA_AMPERE_WS)
    lib = "hipBLASLt" if arch != "gfx1100" else "hipBLAS"
    assert any(f"ROCm ({arch}): 2 x {per_thread // MiB} MiB {lib} workspace" in n
               for n in amd["notes"]), amd["notes"]


def test_a_step_without_gemm_takes_no_blas_workspace():
    """The conv net runs convolutions (MIOpen/cuDNN), norms and activations only: no handle is
    created, so Hopper's 32 MiB, Ampere's 8.1 MiB and MI250's 76 MiB workspaces all vanish.
    What stays is cuDNN's own convolution workspaces on the NVIDIA cards (oomdoctor.sim.
    convolution; MIOpen's are not modelled): the same on both, at most a few MiB here."""
    peaks = {arch: _estimate(CONVNET, "-b", "1", "--memory", "64GiB", "--arch", arch)
             ["peak_allocated_bytes"] for arch in ("sm80", "sm90", "gfx90a")}
    assert peaks["sm80"] == peaks["sm90"], peaks
    assert 0 <= peaks["sm80"] - peaks["gfx90a"] < 8 * 2**20, peaks


@pytest.mark.parametrize("arch, precision, kernel", [
    ("gfx90a", "bf16", "flash"),       # AOTriton flash: fp16/bf16, no mask
    ("gfx942", "fp32", "efficient"),   # AOTriton memory-efficient takes fp32 (flash does not)
    ("gfx1100", "bf16", "math"),       # Navi: AOTriton only with the experimental switch
])
def test_rocm_attention_kernel(arch, precision, kernel):
    e = _estimate(GPT2, "-b", "1", "--memory", "64GiB", "--arch", arch, "--precision", precision)
    assert any(f"ROCm would use the {kernel} kernel ({arch}" in n for n in e["notes"]), e["notes"]


def test_rocm_sdpa_rules_from_sdp_utils():
    """can_use_mem_efficient_attention on ROCm: a bool mask or one of q's dtype; head dims a
    multiple of 8 in 16 bit (4 in fp32), at most 256; no grouped-query heads."""
    k = rocm.sdpa_kernel
    assert k("gfx90a", "float16", True, "bool", 64, True) == "efficient"
    assert k("gfx90a", "float16", True, "float32", 64, True) == "math"
    assert k("gfx90a", "float32", False, None, 68, True) == "efficient"
    assert k("gfx90a", "float16", True, "bool", 68, True) == "math"
    assert k("gfx90a", "bfloat16", False, None, 320, True) == "flash"   # flash: up to 512
    assert k("gfx90a", "float32", False, None, 320, True) == "math"
    assert k("gfx90a", "float16", True, "bool", 64, False) == "math"


def _attention_backward_bytes(kernel: str, rocm_kernels: bool, b=2, h=4, t=300, d=64) -> int:
    """Bytes the emulated fused attention allocates in its backward (meta tensors)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from oomdoctor.sim import emulate

    class Allocations(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] in ("empty", "new_empty", "empty_like"):
                Allocations.total += out.untyped_storage().nbytes()
            return out

    q, k, v = (torch.empty(b, h, t, d, dtype=torch.bfloat16, device="meta", requires_grad=True)
               for _ in range(3))
    out = emulate._FusedAttention.apply(q, k, v, None, kernel, rocm_kernels)
    grad = torch.empty_like(out)
    with Allocations():
        torch.autograd.backward(out, grad)
    return Allocations.total


def test_aotriton_backward_keeps_no_fp32_dq_accumulator():
    """mha_bwd_aot (aten/src/ATen/native/transformers/hip/flash_attn/aot/mha_all_aot.hip)
    allocates dq, dk, dv and two (B, H, T) fp32 vectors (softmax_d, delta); CUDA's
    flash-attention-2 backward adds a (B, H, T rounded up to 128, D) fp32 dq accumulator and a
    (B, H, T128) softmax_d."""
    b, h, t, d = 2, 4, 300, 64
    grads = 3 * b * h * t * d * 2                       # dq, dk, dv in bf16
    t128 = 384
    assert _attention_backward_bytes("flash", True) == grads + 2 * b * h * t * 4
    assert _attention_backward_bytes("flash", False) == grads + b * h * t128 * (d + 1) * 4
