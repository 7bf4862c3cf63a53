"""Where a training step's BLAS workspaces appear: the first forward and backward that run a GEMM.

    oomdoctor estimate tests/models/rocm_amp_convnet.py -b 1 --gpu mi250   # no GEMM: none

PyTorch creates a BLAS handle, and takes its workspace from the caching allocator, inside the
first GEMM each thread runs (``getCurrentCUDABlasHandle`` / ``getCUDABlasLtWorkspace`` in
aten/src/ATen/cuda/CublasHandlePool.cpp, called from at::cuda::blas). The forward runs on the
Python thread and the backward on autograd's device thread, so a step with matmuls holds two.
A network of convolutions, norms and activations calls cuDNN/MIOpen and elementwise kernels and
never creates one. The size per handle is :attr:`oomdoctor.sim.gpus.GpuProfile.cublas_workspace_bytes`.

Reductions take scratch memory from the caching allocator too, for the length of one kernel:
:func:`reduction_scratch` says where and how much (:mod:`oomdoctor.sim.reductions`); so do
cuDNN's convolutions, for the length of each pass (:func:`conv_workspaces`,
:mod:`oomdoctor.sim.convolution`).

Known limitation: only the ATen ops below are recognised; a GEMM inside a library's own kernel
(cuDNN's, a Triton kernel) uses that library's memory, which no trace sees.
"""
from __future__ import annotations

from oomdoctor.sim import convolution, normalization
from oomdoctor.sim.gpus import GpuProfile
from oomdoctor.sim.reductions import scratch_bytes
from oomdoctor.sim.trace import Phase, Trace

# getCUDABlasLtWorkspaceSize() in aten/src/ATen/cuda/CublasHandlePool.cpp: CUBLASLT_WORKSPACE_SIZE
# (KiB) defaults to 1024 on CUDA, capped at the cuBLAS workspace's size.
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024

# The ATen ops that reach at::cuda::blas (aten/src/ATen/native/cuda/Blas.cpp): matmuls, linear
# layers (addmm), batched matmuls and matrix-vector products.
BLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot",
                      "_addmm_activation", "_scaled_mm", "_int_mm"})


def workspace_points(trace: Trace, lt: bool = False) -> list[int]:
    """Where the step's BLAS workspaces are allocated: in the first step's first forward and
    backward phases that run a BLAS op, right after that op's output (at::cuda::blas asks for
    the handle, and so the workspace, once the output exists). Returned as the trace event
    index each workspace goes before. One per thread's handle, kept for the process's life.
    ``lt``: the phases' first cuBLASLt GEMM (its own workspace until torch 2.12, see
    oomdoctor.sim.versions CUBLASLT_WORKSPACE_SHARED).

    Measured on an H200 (torch 2.11, benchmarks/results/newpaths): the backward's workspace
    comes with the lm_head's gradient mm, after the loss's backward has taken its 500 MiB
    blocks; placed at the phase's start, it split a freed 250 MiB logits block, and the
    replay's reserved was 500 MiB short."""
    blas_at = sorted(s.t_alloc for s in trace.storages.values()
                     if (s.blas_lt if lt else s.op.split(".")[0] in BLAS_OPS))
    marks = list(trace.marks)
    out = []
    for i, mark in enumerate(marks):
        if mark.iteration or mark.micro or mark.phase not in (Phase.FORWARD, Phase.BACKWARD):
            continue
        end = marks[i + 1].start if i + 1 < len(marks) else len(trace.events)
        first = next((t for t in blas_at if mark.start <= t < end), None)
        if first is not None:
            out.append(first + 1)
    return out


def reduction_scratch(trace: Trace, gpu: GpuProfile) -> dict[int, tuple[int, int]]:
    """Trace event index of each reduction output's allocation -> the (buffer, semaphores)
    bytes its CUDA kernel then allocates and frees on ``gpu`` (gpu_reduce_kernel in
    aten/src/ATen/native/cuda/Reduce.cuh). None on ROCm, whose grid rule differs."""
    if gpu.is_rocm:
        return {}
    mps, threads = gpu.multiprocessors
    out = {}
    for i, (is_alloc, handle, _) in enumerate(trace.events):
        s = trace.storages.get(handle) if is_alloc else None
        if s is not None and s.reduce is not None:
            scratch = scratch_bytes(s.reduce, mps, threads)
            if scratch is not None:
                out[i] = scratch
    return out


def conv_workspaces(trace: Trace, gpu: GpuProfile, batch: int | None = None) -> dict[int, int]:
    """Trace event index of each convolution pass's output allocation -> the bytes of the
    workspace cuDNN then allocates and frees on ``gpu`` at ``batch`` (the traced one by
    default). None on ROCm and on NVIDIA cards before compute capability 8.0, whose kernels
    the rule was not measured on (oomdoctor.sim.convolution)."""
    if gpu.is_rocm or gpu.compute_capability < (8, 0):
        return {}
    scale = None if batch is None else batch / trace.config.batch_size
    out = {}
    for i, (is_alloc, handle, _) in enumerate(trace.events):
        s = trace.storages.get(handle) if is_alloc else None
        if s is not None and s.conv is not None:
            b = None if scale is None else max(1, round(s.conv.batch * scale))
            ws = convolution.workspace_bytes(s.conv, b)
            if ws:
                out[i] = ws
    return out


def norm_upcasts(trace: Trace, gpu: GpuProfile, batch: int | None = None) -> dict[int, int]:
    """Trace event index of each 16-bit batch norm output whose input is past 32-bit indexing
    at ``batch`` -> the fp32 copy CUDA's kernel then allocates and frees (sim.normalization).
    None on ROCm."""
    if gpu.is_rocm:
        return {}
    scale = 1.0 if batch is None else batch / trace.config.batch_size
    out = {}
    for i, (is_alloc, handle, _) in enumerate(trace.events):
        s = trace.storages.get(handle) if is_alloc else None
        if s is not None and s.upcast:
            copy = normalization.upcast_bytes(round(s.upcast * scale))
            if copy:
                out[i] = copy
    return out


def conv_note(ws: dict[int, int]) -> str | None:
    """What an estimate says of the convolutions' workspaces it counted (:func:`conv_workspaces`),
    or None."""
    if not ws:
        return None
    return (f"cuDNN convolution workspaces: {len(ws)} passes each take one from the caching "
            f"allocator for the call, the largest {max(ws.values()) / 2**20:.0f} MiB (operands "
            "staged channels-last, a rule measured on an H200 with cuDNN 9.19; another card's "
            "or release's plans can stage more or less)")
