"""Which torch release the CUDA facts are modelled for: `--torch VERSION`, each fact with its release.

    oomdoctor estimate sample_models/gpt2_small.py -b 8 --torch 2.0

The trace runs the installed torch's Python code (its modules, losses and optimizers), but what
oomdoctor adds because a CPU cannot show it - which optimizer implementation CUDA picks, what
``zero_grad()`` does by default, whether fused attention exists, the BLAS workspaces and whether
they come from the caching allocator - changed between releases. Each such fact is one row of
:data:`FACTS`: the release that changed it (and, where known, the first nightly that had it),
what it was before and after, and the pull request. ``--torch`` picks the side of every row; the
default is the installed torch, which gives what oomdoctor always gave. No torch import here.

Known limitations: only these rows change with ``--torch``; kernels that save different tensors
in another release (torch 1.10's softmax saved its input) and library code (transformers, peft)
are the installed ones. Releases before :data:`OLDEST` are refused, not guessed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class TorchVersion:
    """A torch release, or a nightly of one: 2.1.0, 2.2.0.dev20231105 (dev: the nightly's date;
    a source build like 2.3.0a0+git... is a pre-release of 2.3 with no date, dev=0)."""

    major: int
    minor: int
    patch: int = 0
    dev: int | None = None     # None: the release itself

    def __str__(self) -> str:
        base = f"{self.major}.{self.minor}.{self.patch}"
        if self.dev is None:
            return base
        return f"{base}.dev{self.dev}" if self.dev else f"{base}a0"

    @property
    def release(self) -> tuple[int, int]:
        return (self.major, self.minor)


@dataclass(frozen=True)
class Fact:
    """One CUDA behaviour oomdoctor models that changed in a torch release."""

    name: str
    since: tuple[int, int]     # the first release with ``after``
    before: str
    after: str
    source: str                # the pull request (or file at that tag) that changed it
    nightly: int | None = None  # the first nightly of ``since`` with ``after`` (YYYYMMDD)


# The oldest release modelled: torch 1.13 is the first that gives cuBLAS a workspace from the
# caching allocator (github.com/pytorch/pytorch/pull/83461, CUBLAS_WORKSPACE_CONFIG parsed in
# aten/src/ATen/cuda/CublasHandlePool.cpp); before it cuBLAS allocated its own with cudaMalloc,
# outside max_memory_allocated, and no row below says what else differed.
OLDEST = TorchVersion(1, 13)

FOREACH_DEFAULT = "foreach_default"
ZERO_GRAD_SET_TO_NONE = "zero_grad_set_to_none"
FUSED_SDPA = "fused_sdpa"
GQA_SDPA = "gqa_sdpa"
FOREACH_ADAM_ONE_INTERMEDIATE = "foreach_adam_one_intermediate"
HIPBLASLT_DEFAULT = "rocm_hipblaslt_default"
HIPBLAS_WORKSPACE_IN_ALLOCATOR = "rocm_hipblas_workspace_in_allocator"
HIPBLASLT_WORKSPACE_76MIB = "rocm_hipblaslt_workspace_76mib"
CUBLASLT_WORKSPACE_SHARED = "cublaslt_workspace_shared"

FACTS: tuple[Fact, ...] = (
    Fact(FOREACH_DEFAULT, (2, 0),
         "optimizers left with foreach=None run the for-loop implementation",
         "foreach on CUDA when foreach, fused and differentiable are unset",
         "github.com/pytorch/pytorch/pull/92306 and /pull/95862 (torch/optim/optimizer.py "
         "_default_to_fused_or_foreach)"),
    Fact(ZERO_GRAD_SET_TO_NONE, (2, 0),
         "optimizer.zero_grad() zeroes gradients in place (set_to_none=False): they live "
         "through every forward",
         "optimizer.zero_grad() sets gradients to None (set_to_none=True)",
         "github.com/pytorch/pytorch/pull/92731"),
    Fact(FUSED_SDPA, (2, 0),
         "no fused attention kernels: attention runs the math path",
         "F.scaled_dot_product_attention picks flash or memory-efficient kernels",
         "torch/nn/functional.py at v2.0.0 (scaled_dot_product_attention is new there) and "
         "aten/src/ATen/native/transformers/cuda/sdp_utils.cpp at v2.0.0"),
    Fact(FOREACH_ADAM_ONE_INTERMEDIATE, (2, 1),
         "foreach Adam/AdamW hold two parameter-sized intermediates in step() (sqrt of "
         "exp_avg_sq and denom = that + eps, out of place)",
         "one intermediate: eps is added in place",
         "github.com/pytorch/pytorch/pull/104898 (merged 2023-07-10); issue /issues/97712",
         nightly=20230711),
    Fact(GQA_SDPA, (2, 5),
         "no grouped-query SDPA: models repeat k and v to every query head before attention "
         "(transformers' repeat_kv), one copy each per layer, kept for backward",
         "F.scaled_dot_product_attention(enable_gqa=True) takes fewer key/value heads; flash "
         "runs them as they are",
         "github.com/pytorch/pytorch/pull/132689 (enable_gqa); sdp_utils.cpp "
         "check_batch_size_and_num_heads_dense<true /*supports GQA*/> for flash"),
    Fact(HIPBLASLT_DEFAULT, (2, 5),
         "ROCm GEMMs run hipBLAS (rocBLAS), whose workspace rocBLAS allocates itself, outside "
         "the caching allocator",
         "hipBLASLt is the default BLAS on Instinct targets (gfx90a, gfx942, ...), its "
         "workspace from the caching allocator",
         "github.com/pytorch/pytorch/pull/127944 (aten/src/ATen/Context.h "
         "blas_preferred_backend)"),
    Fact(HIPBLASLT_WORKSPACE_76MIB, (2, 6),
         "hipBLASLt's workspace is 1 MiB",
         "hipBLASLt's workspace is 76 MiB",
         "github.com/pytorch/pytorch/pull/139300 (CUDABlas.cpp _getWorkspaceSize)"),
    Fact(HIPBLAS_WORKSPACE_IN_ALLOCATOR, (2, 6),
         "hipBLAS's workspace is rocBLAS's own, outside the caching allocator",
         "hipBLAS's workspace (32 MiB; 128 MiB on gfx94x/95x) comes from the caching allocator",
         "github.com/pytorch/pytorch/pull/138791 (CublasHandlePool.cpp getNewWorkspace)"),
    # 2.11 (branch cut 2026-02-16..19, github.com/pytorch/pytorch/pull/171832) has the size
    # side unified by default but getCUDABlasLtWorkspace() unified only when the variable is
    # set: a real H200 snapshot of torch 2.11 (tests/snapshots/tiny_mlp_b64_fp32.pickle) shows
    # the forward's first linear take 32 MiB (cuBLAS) and then 1 MiB (cuBLASLt).
    Fact(CUBLASLT_WORKSPACE_SHARED, (2, 12),
         "cuBLASLt (addmm with a bias vector: at::cuda::blas::gemm_and_bias) takes its own 1 MiB "
         "workspace from the caching allocator per handle and stream (CUBLASLT_WORKSPACE_SIZE's "
         "default, 1024 KiB; TORCH_CUBLASLT_UNIFIED_WORKSPACE unset)",
         "cuBLASLt works in its handle's cuBLAS workspace and allocates none of its own",
         "github.com/pytorch/pytorch/pull/175879 (CublasHandlePool.cpp getCUDABlasLtWorkspace: "
         "unified unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=0, merged 2026-03-02) and /pull/173002",
         nightly=20260303),
)
_BY_NAME = {f.name: f for f in FACTS}


def parse_version(text: str) -> TorchVersion:
    """'2.1', '2.1.0+cu121', '2.2.0.dev20231105+rocm5.6', '2.3.0a0+git1234' -> TorchVersion.
    ValueError (one line: what, why, fix) for text that is no torch version or a release
    older than :data:`OLDEST`."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.(\d+))?(?:\.dev(\d{8})|([ab]|rc)\d+)?(?:\+\S*)?\s*",
                     str(text))
    if m is None:
        raise ValueError(f"--torch {text!r} is not a torch version; write it as torch."
                         "__version__ prints it, e.g. 2.1, 2.4.1+rocm6.0 or 2.2.0.dev20231105")
    major, minor, patch, date, pre = m.groups()
    v = TorchVersion(int(major), int(minor), int(patch or 0),
                     int(date) if date else (0 if pre else None))
    if v.release < OLDEST.release:
        raise ValueError(f"--torch {text}: oomdoctor models torch {OLDEST.major}.{OLDEST.minor} "
                         "and later (older releases gave cuBLAS its own workspace outside the "
                         "caching allocator, among differences not modelled); plan with "
                         f"--torch {OLDEST.major}.{OLDEST.minor} as an approximation, or measure "
                         "on the GPU")
    return v


def installed() -> TorchVersion:
    """The installed torch's version (imported here, never at module import)."""
    import torch
    return parse_version(torch.__version__)


def has(version: TorchVersion | None, name: str) -> bool:
    """Whether ``version`` (None: the installed torch) has the ``after`` side of fact ``name``."""
    fact = _BY_NAME[name]
    v = installed() if version is None else version
    if v.release != fact.since:
        return v.release > fact.since
    if v.dev is None or fact.nightly is None:
        return True            # the release, or a nightly of it where no date is known
    return v.dev >= fact.nightly


def differing(version: TorchVersion | None, rocm: bool = False) -> list[Fact]:
    """The facts where ``version`` is on another side than the installed torch (the ROCm
    ones only for an AMD card)."""
    if version is None:
        return []
    here = installed()
    return [f for f in FACTS if has(version, f.name) != has(here, f.name)
            and (rocm or not f.name.startswith("rocm_"))]


def modelled_note(version: TorchVersion | None, rocm: bool = False) -> str | None:
    """The estimate's note when ``--torch`` names another release than the installed one."""
    if version is None or version == installed():
        return None
    changed = differing(version, rocm)
    what = ("; ".join(f"{f.before if not has(version, f.name) else f.after} "
                      f"({'until' if not has(version, f.name) else 'since'} "
                      f"{f.since[0]}.{f.since[1]})" for f in changed)
            if changed else "on this card the same facts as the installed torch")
    return f"modelled torch {version}'s CUDA facts (--torch): {what}"


def default_zero_grad(version: TorchVersion | None) -> str:
    """The loop's ``optimizer.zero_grad()`` after ``step()`` as a --zero-grad mode: in place
    (gradients kept) before torch 2.0, set to None since."""
    return "after-step" if version is None or has(version, ZERO_GRAD_SET_TO_NONE) else "in-place"
