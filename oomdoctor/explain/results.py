"""The result types: Kind, Category, Phase, Fix, Diagnosis, ProcessUse, Collective, Finding, ExplainResult."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping


class Kind(str, Enum):
    """What an error is. The value is the stable name used in --json."""

    CUDA_OOM = "cuda_oom"
    CUDA_ASYNC_OOM = "cuda_malloc_async_oom"
    CUDA_ERROR_OOM = "cuda_error_oom"
    CUBLAS_ALLOC = "cublas_alloc_failed"
    CUDNN_FAILURE = "cudnn_failure"
    HIP_OOM = "hip_oom"
    MPS_OOM = "mps_oom"
    CPU_OOM = "cpu_oom"
    WINDOWS_PAGING_FILE = "windows_paging_file"
    OOM_KILLER = "oom_killer"
    DATALOADER_KILLED = "dataloader_worker_killed"
    SHARED_MEMORY = "shared_memory"
    TF_OOM = "tensorflow_oom"
    JAX_OOM = "jax_oom"
    MISSING_LAUNCH_ENV = "missing_launch_env"
    INVALID_DEVICE_ORDINAL = "invalid_device_ordinal"
    NCCL_TIMEOUT = "nccl_timeout"
    PORT_IN_USE = "port_in_use"
    PORT_PERMISSION = "port_permission_denied"
    P2P = "p2p_unsupported"
    NCCL_CUDA_OOM = "nccl_cuda_oom"
    ILLEGAL_MEMORY_ACCESS = "illegal_memory_access"
    DEVICE_ASSERT = "device_side_assert"
    MISALIGNED_ADDRESS = "misaligned_address"
    NCCL_ERROR = "nccl_error"
    RANK_FAILED = "rank_failed"
    EXCEPTION = "unrecognised_exception"
    MEMORY_SUMMARY = "cuda_memory_summary"
    NATIVE_CRASH = "native_crash"
    OMP_THREADS = "omp_num_threads"


class Category(str, Enum):
    GPU_MEMORY = "gpu_memory"
    HOST_MEMORY = "host_memory"
    LAUNCH = "launch"
    NOT_OOM = "not_oom"


class Phase(str, Enum):
    """Where in a training step the error happened, read from the traceback frames."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer_step"
    EVALUATION = "evaluation"
    DATA_LOADING = "data_loading"
    MODEL_LOADING = "model_loading"


_KIND_INFO: dict[Kind, tuple[Category, str]] = {
    Kind.CUDA_OOM: (Category.GPU_MEMORY, "PyTorch CUDA out of memory"),
    Kind.CUDA_ASYNC_OOM: (Category.GPU_MEMORY, "PyTorch CUDA out of memory (cudaMallocAsync backend)"),
    Kind.CUDA_ERROR_OOM: (Category.GPU_MEMORY, "CUDA error: out of memory (no allocator report)"),
    Kind.CUBLAS_ALLOC: (Category.GPU_MEMORY, "cuBLAS could not allocate its handle or workspace"),
    Kind.CUDNN_FAILURE: (Category.GPU_MEMORY, "cuDNN failure (usually memory)"),
    Kind.HIP_OOM: (Category.GPU_MEMORY, "PyTorch ROCm/HIP out of memory"),
    Kind.MPS_OOM: (Category.GPU_MEMORY, "PyTorch Apple MPS out of memory"),
    Kind.CPU_OOM: (Category.HOST_MEMORY, "Host (CPU) memory allocation failed"),
    Kind.WINDOWS_PAGING_FILE: (Category.HOST_MEMORY, "Windows paging file too small (WinError 1455)"),
    Kind.OOM_KILLER: (Category.HOST_MEMORY, "Process killed with SIGKILL (Linux OOM killer)"),
    Kind.DATALOADER_KILLED: (Category.HOST_MEMORY, "DataLoader worker died"),
    Kind.SHARED_MEMORY: (Category.HOST_MEMORY, "Shared memory (/dev/shm) exhausted"),
    Kind.TF_OOM: (Category.GPU_MEMORY, "TensorFlow out of memory (ResourceExhausted)"),
    Kind.JAX_OOM: (Category.GPU_MEMORY, "JAX/XLA out of memory (RESOURCE_EXHAUSTED)"),
    Kind.MISSING_LAUNCH_ENV: (Category.LAUNCH, "Distributed environment variable missing"),
    Kind.INVALID_DEVICE_ORDINAL: (Category.LAUNCH, "CUDA error: invalid device ordinal"),
    Kind.NCCL_TIMEOUT: (Category.LAUNCH, "NCCL watchdog timeout"),
    Kind.PORT_IN_USE: (Category.LAUNCH, "Rendezvous port already in use"),
    Kind.PORT_PERMISSION: (Category.LAUNCH, "Permission denied binding the rendezvous port"),
    Kind.P2P: (Category.LAUNCH, "GPU peer-to-peer (P2P) access problem"),
    Kind.NCCL_CUDA_OOM: (Category.GPU_MEMORY, "NCCL could not allocate its CUDA buffers (out of memory)"),
    Kind.ILLEGAL_MEMORY_ACCESS: (Category.NOT_OOM, "Illegal memory access - not an out-of-memory error"),
    Kind.DEVICE_ASSERT: (Category.NOT_OOM, "Device-side assert - not an out-of-memory error"),
    Kind.MISALIGNED_ADDRESS: (Category.NOT_OOM, "Misaligned address - not an out-of-memory error"),
    Kind.NCCL_ERROR: (Category.LAUNCH, "NCCL error (a CUDA or system call inside NCCL failed)"),
    Kind.RANK_FAILED: (Category.LAUNCH, "A rank failed - the launcher's report, not the error itself"),
    Kind.EXCEPTION: (Category.NOT_OOM, "The log's last error, not a known out-of-memory message"),
    Kind.MEMORY_SUMMARY: (Category.GPU_MEMORY, "PyTorch CUDA memory summary (torch.cuda.memory_summary())"),
    Kind.NATIVE_CRASH: (Category.NOT_OOM, "A crash in native code (a signal, not a Python error)"),
    Kind.OMP_THREADS: (Category.LAUNCH, "torchrun set OMP_NUM_THREADS=1 in each process (a performance warning, "
                                        "not an error)"),
}

# Kinds that report something without being an error: they never stand in for the error of a log
# (the last exception and a rank's failed exit are still reported beside them), and they come after
# the errors in a result.
REPORT_KINDS = frozenset({Kind.MEMORY_SUMMARY, Kind.OMP_THREADS})

# Keys of Finding.numbers and Finding.derived that hold bytes; every other key is a plain count
# whose unit is in its name (timeout_ms, port, ...).
BYTE_KEYS = frozenset({
    "requested", "capacity", "free", "allocated", "reserved", "reserved_unallocated",
    "private_pools", "this_process", "limit", "other_allocations", "in_use", "max_in_use",
    "total_allocation", "temp_allocation", "parameter_allocation", "other_processes",
    "outside_allocator", "non_pytorch_in_process", "shortfall", "model_states", "activations",
    "anon_rss", "total_vm", "file_rss", "shmem_rss", "cgroup_usage", "cgroup_limit",
    "allocated_peak", "reserved_peak", "non_releasable", "non_releasable_peak",
    "reserved_over_allocated_peak", "releasable_cache", "fragmentation",
    "host_used", "host_total", "hbm_capacity", "hbm_free", "hbm_allocated", "hbm_reserved", "hbm_reservable",
})


# --- results ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fix:
    """One remedy. effect_bytes is what it frees on the failing GPU (None when the log cannot
    tell); effect_bound says how to read it: "about", "up to" or "at least"."""

    id: str
    title: str
    effect_bytes: int | None
    effect_bound: str | None
    speed: str
    quality: str
    detail: str


@dataclass(frozen=True)
class Diagnosis:
    cause: str     # stable machine name, e.g. "fragmentation", "other_process"
    text: str


@dataclass(frozen=True)
class ProcessUse:
    pid: int
    bytes: int


@dataclass(frozen=True)
class Collective:
    """One rank's timed-out NCCL operation, from the watchdog message."""

    rank: int | None
    seq: int | None           # None: PyTorch <= 1.10 did not print it
    op: str
    numel: int | None
    timeout_ms: int
    elapsed_ms: int


@dataclass(frozen=True)
class Finding:
    kind: Kind
    title: str
    line: int                        # 1-based line of the first occurrence
    occurrences: int
    ranks: tuple[int, ...]
    gpus: tuple[int, ...]
    phase: Phase | None
    numbers: Mapping[str, int]       # as stated in the message
    derived: Mapping[str, int]       # computed from the stated numbers
    processes: tuple[ProcessUse, ...]
    collectives: tuple[Collective, ...]
    details: Mapping[str, str]
    diagnosis: tuple[Diagnosis, ...]
    fixes: tuple[Fix, ...]
    notes: tuple[str, ...]
    excerpt: str

    @property
    def category(self) -> Category:
        return _KIND_INFO[self.kind][0]

    @property
    def cause(self) -> str | None:
        return self.diagnosis[0].cause if self.diagnosis else None

    @property
    def gpu(self) -> int | None:
        return self.gpus[0] if self.gpus else None


@dataclass(frozen=True)
class ExplainResult:
    findings: tuple[Finding, ...]
    lines_read: int
    context: Mapping[str, int]       # facts read from the log: parameter counts, batch size, ...
    dropped_findings: int = 0        # distinct findings beyond _MAX_FINDINGS
    skipped_regions: int = 0         # regions the parser failed on (a bug; reported, not fatal)
