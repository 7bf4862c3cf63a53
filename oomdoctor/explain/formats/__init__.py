"""The families of error messages, one module each, and the tables that join them: anchors, extractors, diagnoses."""
from __future__ import annotations

from ..results import REPORT_KINDS, Kind
from .cuda import _ANCHORS as _CUDA_ANCHORS
from .cuda import _diag_cublas, _diag_cuda_error, _diag_cudnn, _x_cublas, _x_cuda_error, _x_cudnn
from .frameworks import _ANCHORS as _FRAMEWORK_ANCHORS
from .frameworks import _diag_jax, _diag_tf, _x_jax, _x_tf
from .host import _ANCHORS as _HOST_ANCHORS
from .host import (_diag_cpu, _diag_dataloader, _diag_oom_killer, _diag_paging, _diag_shm, _x_cpu, _x_dataloader,
                   _x_oom_killer, _x_shm)
from .launch import _ANCHORS as _LAUNCH_ANCHORS
from .launch import (_diag_missing_env, _diag_nccl, _diag_nccl_oom, _diag_ordinal, _diag_p2p, _diag_port,
                     _x_missing_env, _x_nccl, _x_nccl_oom, _x_ordinal, _x_p2p, _x_port)
from ..exceptions import _diag_exception
from .kills import _ANCHORS as _KILL_ANCHORS
from .kills import _diag_rank_failed, _x_rank_failed
from .lookalikes import _ANCHORS as _LOOKALIKE_ANCHORS
from .lookalikes import _diag_lookalike, _x_assert
from .memory_summary import _ANCHORS as _SUMMARY_ANCHORS
from .memory_summary import _diag_summary, _x_summary
from .nccl import _ANCHORS as _NCCL_ANCHORS
from .nccl import _diag_nccl_error, _x_nccl_error
from .nccl_debug import _ANCHORS as _NCCL_DEBUG_ANCHORS
from .omp import _ANCHORS as _OMP_ANCHORS
from .omp import _diag_omp, _x_omp
from .patterns import _AnchorSpec, _x_simple
from .signals import _ANCHORS as _SIGNAL_ANCHORS
from .signals import _diag_native_crash, _x_signal
from .torch_async_mps import _ANCHORS as _ASYNC_MPS_ANCHORS
from .torch_async_mps import _diag_async, _diag_mps, _x_async, _x_mps
from .torch_caching import _ANCHORS as _CACHING_ANCHORS
from .torch_caching import _diag_torch, _x_torch

# Every anchor, in one fixed order: matches that start at the same squashed character keep this
# order (the scanner sorts them by position with a stable sort), so the families are joined in the
# order of the single table they were written as.
_ANCHORS: tuple[_AnchorSpec, ...] = (
    _CACHING_ANCHORS + _ASYNC_MPS_ANCHORS + _CUDA_ANCHORS + _FRAMEWORK_ANCHORS + _HOST_ANCHORS + _LAUNCH_ANCHORS
    + _LOOKALIKE_ANCHORS + _NCCL_ANCHORS + _KILL_ANCHORS + _SUMMARY_ANCHORS + _SIGNAL_ANCHORS + _OMP_ANCHORS
    + _NCCL_DEBUG_ANCHORS
)

# An anchor of kind K is dropped when it starts within N squashed characters after a kept anchor
# of one of these kinds: it is a second sentence of the same message.
_ABSORBED_BY: dict[Kind, tuple[frozenset[Kind], int]] = {
    Kind.CUDA_OOM: (frozenset({Kind.CUDA_OOM, Kind.HIP_OOM, Kind.MPS_OOM}), 80),
    Kind.SHARED_MEMORY: (frozenset({Kind.DATALOADER_KILLED}), 400),
    Kind.CUDA_ERROR_OOM: (frozenset({Kind.CUBLAS_ALLOC, Kind.CUDNN_FAILURE, Kind.NCCL_CUDA_OOM}), 200),
    Kind.PORT_PERMISSION: (frozenset({Kind.PORT_IN_USE}), 200),
}


_EXTRACT = {
    Kind.CUDA_OOM: _x_torch,
    Kind.CUDA_ASYNC_OOM: _x_async,
    Kind.MPS_OOM: _x_mps,
    Kind.CUDA_ERROR_OOM: _x_cuda_error,
    Kind.CUBLAS_ALLOC: _x_cublas,
    Kind.CUDNN_FAILURE: _x_cudnn,
    Kind.TF_OOM: _x_tf,
    Kind.JAX_OOM: _x_jax,
    Kind.CPU_OOM: _x_cpu,
    Kind.WINDOWS_PAGING_FILE: _x_simple(Kind.WINDOWS_PAGING_FILE),
    Kind.OOM_KILLER: _x_oom_killer,
    Kind.DATALOADER_KILLED: _x_dataloader,
    Kind.SHARED_MEMORY: _x_shm,
    Kind.MISSING_LAUNCH_ENV: _x_missing_env,
    Kind.INVALID_DEVICE_ORDINAL: _x_ordinal,
    Kind.NCCL_TIMEOUT: _x_nccl,
    Kind.PORT_IN_USE: _x_port(Kind.PORT_IN_USE),
    Kind.PORT_PERMISSION: _x_port(Kind.PORT_PERMISSION),
    Kind.P2P: _x_p2p,
    Kind.NCCL_CUDA_OOM: _x_nccl_oom,
    Kind.ILLEGAL_MEMORY_ACCESS: _x_simple(Kind.ILLEGAL_MEMORY_ACCESS),
    Kind.DEVICE_ASSERT: _x_assert,
    Kind.MISALIGNED_ADDRESS: _x_simple(Kind.MISALIGNED_ADDRESS),
    Kind.NCCL_ERROR: _x_nccl_error,
    Kind.RANK_FAILED: _x_rank_failed,
    Kind.MEMORY_SUMMARY: _x_summary,
    Kind.NATIVE_CRASH: _x_signal,
    Kind.OMP_THREADS: _x_omp,
}


_DIAGNOSE = {
    Kind.CUDA_OOM: _diag_torch,
    Kind.HIP_OOM: _diag_torch,
    Kind.CUDA_ASYNC_OOM: _diag_async,
    Kind.MPS_OOM: _diag_mps,
    Kind.CUDA_ERROR_OOM: _diag_cuda_error,
    Kind.CUBLAS_ALLOC: _diag_cublas,
    Kind.CUDNN_FAILURE: _diag_cudnn,
    Kind.TF_OOM: _diag_tf,
    Kind.JAX_OOM: _diag_jax,
    Kind.CPU_OOM: _diag_cpu,
    Kind.WINDOWS_PAGING_FILE: _diag_paging,
    Kind.OOM_KILLER: _diag_oom_killer,
    Kind.DATALOADER_KILLED: _diag_dataloader,
    Kind.SHARED_MEMORY: _diag_shm,
    Kind.MISSING_LAUNCH_ENV: _diag_missing_env,
    Kind.INVALID_DEVICE_ORDINAL: _diag_ordinal,
    Kind.NCCL_TIMEOUT: _diag_nccl,
    Kind.PORT_IN_USE: _diag_port,
    Kind.PORT_PERMISSION: _diag_port,
    Kind.P2P: _diag_p2p,
    Kind.NCCL_CUDA_OOM: _diag_nccl_oom,
    Kind.ILLEGAL_MEMORY_ACCESS: _diag_lookalike,
    Kind.DEVICE_ASSERT: _diag_lookalike,
    Kind.MISALIGNED_ADDRESS: _diag_lookalike,
    Kind.NCCL_ERROR: _diag_nccl_error,
    Kind.RANK_FAILED: _diag_rank_failed,
    Kind.EXCEPTION: _diag_exception,
    Kind.MEMORY_SUMMARY: _diag_summary,
    Kind.NATIVE_CRASH: _diag_native_crash,
    Kind.OMP_THREADS: _diag_omp,
}

# A finding of kind K is left out when the log has a finding of one of these kinds: the more specific
# report of the same event. NCCL's generic codes relay the CUDA or system error that its own WARN
# line names (out of memory, peer access, /dev/shm, a device index), which those kinds explain.
_EXPLAINED_BY: dict[Kind, frozenset[Kind]] = {
    Kind.NCCL_ERROR: frozenset({Kind.NCCL_CUDA_OOM, Kind.P2P, Kind.SHARED_MEMORY, Kind.CUDA_ERROR_OOM,
                                Kind.INVALID_DEVICE_ORDINAL}),
    # A rank's failed exit and the log's last exception are what is left when nothing known explains the
    # failure; either one goes with every known error (that rank's error is the known one). A memory
    # summary or torchrun's OMP_NUM_THREADS warning is a report, not an error: it explains no failure.
    Kind.RANK_FAILED: frozenset(Kind) - {Kind.RANK_FAILED, Kind.EXCEPTION} - REPORT_KINDS,
    Kind.EXCEPTION: frozenset(Kind) - {Kind.RANK_FAILED, Kind.EXCEPTION} - REPORT_KINDS,
}
