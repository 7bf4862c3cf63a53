"""What PyTorch does differently on AMD GPUs (ROCm/HIP): gfx targets, BLAS workspaces, attention.

    oomdoctor estimate sample_models/gpt2_small.py -b 8 --precision bf16 --memory 64GiB --arch gfx90a

PyTorch's ROCm build is the CUDA code hipified: the caching allocator, autocast and the optimizers
behave as on CUDA, so the trace and the allocator replay are the same. Three things differ, and
they live here (no torch import: the CLI reads this before it decides to load torch):

- **BLAS workspaces.** Both are taken from the caching allocator, once per thread's handle and
  stream, and kept (aten/src/ATen/cuda/CublasHandlePool.cpp, ``getNewWorkspace`` and
  ``getNewCUDABlasLtWorkspace``: ``CUDACachingAllocator::get()->allocate``). hipBLAS (rocBLAS,
  ``rocblas_set_workspace``) gets 32 MiB, 128 MiB on gfx94x/gfx95x (``parseChosenWorkspaceSize``,
  ``HIPBLAS_WORKSPACE_CONFIG``); hipBLASLt gets its own 76 MiB (``parseCUDABlasLtWorkspaceSize``,
  ``HIPBLASLT_WORKSPACE_SIZE``): on ROCm a hipBLAS handle does not hold a hipBLASLt one, so the
  pools are separate (Note [hipblaslt handles]), where CUDA's cuBLASLt shares cuBLAS's.
  Which one a GEMM uses is ``torch.backends.cuda.preferred_blas_library()``: hipBLASLt when every
  visible GPU is an Instinct target (gfx90a, gfx942, gfx950; gfx1200/gfx1201 from ROCm 6.4,
  ``Context::blasPreferredBackend`` in aten/src/ATen/Context.cpp), hipBLAS elsewhere. So an
  MI200/MI300 training thread holds 76 MiB where an Ampere card holds 8.1 MiB.
- **Attention.** ``scaled_dot_product_attention`` has no cuDNN backend on ROCm; flash and
  memory-efficient attention both run AOTriton kernels, compiled for MI200 (gfx90a) and MI300
  (gfx942) - Navi 3x only with TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1
  (``check_flash_attention_hardware_support`` in aten/src/ATen/native/transformers/cuda/
  sdp_utils.cpp). A torch 2.2 ROCm nightly had neither ("Torch was not compiled with flash
  attention", github.com/pytorch/pytorch/issues/112997); the 2.4 release had both
  (github.com/ROCm/pytorch/pull/1818 patches its efficient backend). Flash: fp16/bf16, no explicit mask, equal head dims up to 512 (AOTriton >= 0.9;
  256 before). Memory-efficient: fp32/fp16/bf16, a bool mask or one of the inputs' dtype, head
  dims a multiple of 8 (16-bit) or 4 (fp32) up to 256, no grouped-query heads. The memory
  differs from CUDA's: AOTriton's backward keeps no fp32 dq accumulator (mha_bwd_aot in
  aten/src/ATen/native/transformers/hip/flash_attn/aot/mha_all_aot.hip allocates dq, dk, dv and
  two (B, H, T) fp32 vectors, softmax_d and delta), and the logsumexp is (B, H, T), unpadded.
- **Reported architecture.** ``torch.cuda.get_device_properties`` reports the gfx target as a
  compute capability: gfx90a as 9.0 (the number Hopper has on CUDA), gfx942 as 9.4; here the
  target name decides, never that number.

Known limitations: older releases' workspaces are modelled only through ``--torch``
(:func:`release_workspace_bytes`: before 2.5 rocBLAS allocated its own outside the caching
allocator); before AOTriton ROCm had no fused attention, which is not modelled; a hipBLASLt GEMM without a solution falls back to hipBLAS and
then holds both workspaces; MIOpen's convolution workspaces, like cuDNN's, are invisible.
"""
from __future__ import annotations

import re

MiB = 1024**2

# Context::blasPreferredBackend (aten/src/ATen/Context.cpp): hipBLASLt is the default where every
# visible GPU is one of these ("AMD Instinct targets prefer hipblaslt").
HIPBLASLT_PREFERRED = ("gfx90a", "gfx942", "gfx950", "gfx1200", "gfx1201")
# parseCUDABlasLtWorkspaceSize: "size_t workspace_size = 76*1024; /* Use 76 MB for hipBLASLt */"
HIPBLASLT_WORKSPACE = 76 * MiB
# parseChosenWorkspaceSize: "/* 32MiB default, 128MiB for gfx942/gfx950/gfx1250 */"
HIPBLAS_WORKSPACE, HIPBLAS_WORKSPACE_GFX94_95 = 32 * MiB, 128 * MiB
# aotriton::v2::flash::check_gpu: the targets AOTriton ships kernels for without the
# experimental switch. MI200/MI300 from the start ("Accelerated SDPA only supports
# MI200/MI300X/Navi31 GPUs" in mha_all_aot.hip); gfx950 (MI350) and gfx1201 officially from
# AOTriton 0.10b (github.com/pytorch/pytorch/pull/156499). Navi 3x (gfx1100, ...) needs
# TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1, so the default plan is math there.
AOTRITON_TARGETS = ("gfx90a", "gfx942", "gfx950", "gfx1201")
AOTRITON_FLASH_MAX_HEAD_DIM = 512       # aotriton_max_hdim(), AOTriton >= 0.9
AOTRITON_EFFICIENT_MAX_HEAD_DIM = 256   # check_head_dim_size_flash_nested<caller_is_meff>

# What torch.cuda.get_device_properties() says for a target (hipDeviceProp_t major/minor: the
# target's digits, gfx942 -> 9.4). PyTorch itself once told MI300 by "major == 9 && minor == 4"
# (an earlier CublasHandlePool.cpp); targets not listed are refused rather than guessed.
_REPORTED_CC = {"gfx900": (9, 0), "gfx906": (9, 0), "gfx908": (9, 0), "gfx90a": (9, 0),
                "gfx940": (9, 4), "gfx941": (9, 4), "gfx942": (9, 4), "gfx950": (9, 5),
                "gfx1030": (10, 3), "gfx1100": (11, 0), "gfx1101": (11, 0), "gfx1102": (11, 0),
                "gfx1151": (11, 5), "gfx1200": (12, 0), "gfx1201": (12, 0)}
# bf16 matrix instructions: CDNA from MI100 (gfx908), RDNA3 and later. gfx900/gfx906 have none.
_NO_BF16 = ("gfx900", "gfx906", "gfx1030")


def parse_gfx(text: str) -> str:
    """'gfx90a', 'GFX942', 'gfx942:sramecc+:xnack-' -> the target name ('gfx942')."""
    t = text.strip().lower().split(":")[0]
    if not re.fullmatch(r"gfx[0-9a-f]{3,4}", t):
        raise ValueError(f"cannot read --arch {text!r} as an AMD target; write it like gfx90a "
                         "(MI200: MI210, MI250), gfx942 (MI300X) or gfx1100 (RX 7900)")
    if t not in _REPORTED_CC:
        raise ValueError(f"--arch {text}: unknown AMD target; known: {', '.join(_REPORTED_CC)}")
    return t


def reported_capability(arch: str) -> tuple[int, int]:
    """The compute capability PyTorch on ROCm reports for ``arch`` (gfx90a -> 9.0)."""
    return _REPORTED_CC[arch]


def has_bf16(arch: str) -> bool:
    return arch not in _NO_BF16


def prefers_hipblaslt(arch: str) -> bool:
    return arch in HIPBLASLT_PREFERRED


def blas_workspace_bytes(arch: str) -> int:
    """The workspace one thread's first GEMM takes from the caching allocator on ``arch``, with
    PyTorch's default BLAS backend: hipBLASLt's on Instinct targets, else hipBLAS's."""
    if prefers_hipblaslt(arch):
        return HIPBLASLT_WORKSPACE
    return HIPBLAS_WORKSPACE_GFX94_95 if arch.startswith(("gfx94", "gfx95")) else HIPBLAS_WORKSPACE


def release_workspace_bytes(arch: str, profile_bytes: int, torch_version) -> int:
    """The BLAS workspace one thread takes from the caching allocator on ``arch`` under
    ``torch_version`` (a :class:`oomdoctor.sim.versions.TorchVersion`, None: installed):
    ``profile_bytes`` (today's, above) from 2.6; in 2.5 hipBLASLt's 1 MiB on the targets that
    prefer it (allocated per GEMM then; taken as held) and nothing elsewhere; before 2.5 nothing,
    rocBLAS kept its workspace outside the caching allocator (facts in sim.versions)."""
    from oomdoctor.sim import versions
    if not versions.has(torch_version, versions.HIPBLASLT_DEFAULT):
        return 0
    lt = prefers_hipblaslt(arch)
    if not versions.has(torch_version, versions.HIPBLASLT_WORKSPACE_76MIB) and lt:
        return 1 * MiB
    if not versions.has(torch_version, versions.HIPBLAS_WORKSPACE_IN_ALLOCATOR) and not lt:
        return 0
    return profile_bytes


def sdpa_kernel(arch: str, dtype: str, has_mask: bool, mask_dtype: str | None,
                head_dim: int, same_heads: bool) -> str:
    """The backend ROCm's ``select_sdp_backend`` picks: 'flash', 'efficient' or 'math'.
    ``dtype`` and ``mask_dtype`` are torch dtype names without the prefix ('bfloat16')."""
    if arch not in AOTRITON_TARGETS:
        return "math"
    # Flash: head dims that are not a multiple of 8 are padded before the kernel (mha_fwd_aot:
    # "this is ensured by padding!"); memory-efficient checks the alignment instead.
    if dtype in ("float16", "bfloat16") and not has_mask and head_dim <= AOTRITON_FLASH_MAX_HEAD_DIM:
        return "flash"
    align = 4 if dtype == "float32" else 8
    mask_ok = not has_mask or mask_dtype in ("bool", dtype)
    if (dtype in ("float16", "bfloat16", "float32") and mask_ok and same_heads
            and head_dim % align == 0 and head_dim <= AOTRITON_EFFICIENT_MAX_HEAD_DIM):
        return "efficient"
    return "math"
