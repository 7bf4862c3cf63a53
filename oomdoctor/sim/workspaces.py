"""Where a training step's BLAS workspaces appear: the first forward and backward that run a GEMM.

    oomdoctor estimate tests/models/rocm_amp_convnet.py -b 1 --gpu mi250   # no GEMM: none

PyTorch creates a BLAS handle, and takes its workspace from the caching allocator, inside the
first GEMM each thread runs (``getCurrentCUDABlasHandle`` / ``getCUDABlasLtWorkspace`` in
aten/src/ATen/cuda/CublasHandlePool.cpp, called from at::cuda::blas). The forward runs on the
Python thread and the backward on autograd's device thread, so a step with matmuls holds two.
A network of convolutions, norms and activations calls cuDNN/MIOpen and elementwise kernels and
never creates one. The size per handle is :attr:`oomdoctor.sim.gpus.GpuProfile.cublas_workspace_bytes`.

Known limitation: only the ATen ops below are recognised; a GEMM inside a library's own kernel
(cuDNN's, a Triton kernel) uses that library's memory, which no trace sees.
"""
from __future__ import annotations

from oomdoctor.sim.trace import Phase, PhaseMark, Trace

# The ATen ops that reach at::cuda::blas (aten/src/ATen/native/cuda/Blas.cpp): matmuls, linear
# layers (addmm), batched matmuls and matrix-vector products.
BLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot",
                      "_addmm_activation", "_scaled_mm", "_int_mm"})


def workspace_marks(trace: Trace) -> list[PhaseMark]:
    """The first step's first forward and backward phases that run a BLAS op: a workspace is
    allocated at the start of each (one per thread's handle, kept for the process's life)."""
    blas_at = sorted(s.t_alloc for s in trace.storages.values()
                     if s.op.split(".")[0] in BLAS_OPS)
    marks = list(trace.marks)
    out = []
    for i, mark in enumerate(marks):
        if mark.iteration or mark.micro or mark.phase not in (Phase.FORWARD, Phase.BACKWARD):
            continue
        end = marks[i + 1].start if i + 1 < len(marks) else len(trace.events)
        if any(mark.start <= t < end for t in blas_at):
            out.append(mark)
    return out
