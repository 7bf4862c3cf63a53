"""Explain the out-of-memory and multi-GPU launch errors found in a pasted log.

    oomdoctor explain train.log
    python train.py 2>&1 | oomdoctor explain -
    oomdoctor explain train.log --json

`explain_stream(lines)` reads any iterable of log lines - a terminal scroll-back, a notebook
cell, a Slurm or torchrun log, an issue thread - and finds every known error in it: PyTorch
CUDA/HIP/MPS out-of-memory errors in all their versions, cuBLAS/cuDNN allocation failures,
host-memory failures (CPU allocator, Windows paging file, OOM killer, DataLoader workers,
shared memory), TensorFlow and JAX OOMs, launch errors (missing LOCAL_RANK, invalid device
ordinal, NCCL watchdog timeouts, port clashes, P2P) and look-alikes that are not OOMs. For each
it returns the numbers the message states (bytes as ints), a diagnosis those numbers support and
fixes ranked by the memory they buy, with their speed and quality trade-offs.
`explain_file(stream)` does the same for a binary file or stdin, faster (the CLI uses it), and
`render_text(result)` and `to_json(result)` turn the result into terminal text or a JSON-ready
dict. Nothing in this module prints, imports torch, or touches a GPU, and nothing in the input
is ever executed: it is only matched against fixed regular expressions.

Exit codes of `oomdoctor explain` (set in cli.py, documented in docs/explain.md):
    0  at least one known error was found and explained
    1  no known error was found in the input
    2  usage error (unknown option, FILE missing or unreadable) - click's own

Streaming: the input is consumed line by line in batches; quiet batches are rejected by a cheap
substring pre-filter, and only short "regions" around keyword hits are kept and parsed. Memory
is bounded by constants below (_BATCH_CHARS, _REGION_MAX_CHARS, _MAX_KEYS, _MAX_FINDINGS), not
by the size of the log.

How a message is read: each line loses its prefixes (timestamps, `[rank3]:`, `(pid=12)`,
pytest `E   `, markdown `> `, log levels) and the lines of a region are concatenated with all
whitespace removed. That makes hard wraps harmless - `31.75` newline `GiB` and `capa` newline
`city` both become contiguous - and every number is then found by its own pattern, so a message
that is truncated or has another rank's line spliced into it still yields the fields it has.

Known limitations:
- Two processes writing to one terminal *without* rank prefixes can interleave lines; their
  messages are then parsed as one text, and a number may be attributed to the wrong message.
- The phase (forward, backward, optimizer step, ...) comes from the Python traceback printed
  before the message (or just after it, VS Code style); logs without a traceback get no phase.
- Fix effects need numbers the log may not contain. Parameter counts, micro-batch size and
  accumulation steps are read when the log prints them (PEFT, HF Trainer, Lightning, nanoGPT,
  argparse namespaces); otherwise effects that depend on them are reported as unknown.
- Localised Windows messages are recognised by the error code (1455), not by their text.
- A keyword split by a hard wrap narrower than ~30 columns can hide a message.
"""
from __future__ import annotations

import bisect
import codecs
import re
import textwrap
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from enum import Enum
from typing import IO, Iterable, Iterator, Mapping

from tabulate import tabulate

GiB = 1 << 30
MiB = 1 << 20

# --- limits that bound memory and work (see "Streaming" in the module docstring) -------------
_READ_CHUNK = 1 << 16        # bytes read from a file at a time
_MAX_LINE = 1 << 16          # longer physical lines are cut into pieces of this many characters
_MAX_LOGICAL = 1 << 13       # the parser looks at most this many characters of a piece at once
_BATCH_LINES = 256           # lines pre-filtered together
_BATCH_CHARS = 1 << 17
_SUB_BATCH = 16              # a batch with a hit is re-checked in sub-batches of this many lines
_REGION_TAIL = 8             # a region closes after this many lines without a keyword ...
_REGION_TAIL_CHARS = 800     # ... that also hold this many characters (narrow hard wraps),
_REGION_GLOBAL_QUIET = 32    # or once this many lines of the whole log passed without its keyword:
                             # a rank that prints rarely must not keep every other rank's lines
                             # on the slow path
_REGION_MAX_LINES = 400      # ... or when it grows this long (then it is split, with overlap)
_REGION_MAX_CHARS = 1 << 16
_REGION_CARRY = 12           # lines carried into the next region when one is split
_LOOKBACK = 2                # lines before a hit added to its region (a wrapped keyword)
_MAX_KEYS = 64               # rank streams tracked at once (least recently used is dropped)
_MAX_FINDINGS = 200          # distinct findings kept; more are counted in dropped_findings
_MAX_RANKS = 4096
_ANCHOR_SPAN = 4000          # squashed characters read after the start of a message
_PRE_SPAN = 160              # squashed characters read before it (exception class, [Rank N])
_TB_REACH = 1500             # a traceback header this many lines back can explain an error
_FRAMES_KEEP = 256
_FRAMES_PER_FINDING = 64
_EXCERPT = 200


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
    ILLEGAL_MEMORY_ACCESS = "illegal_memory_access"
    DEVICE_ASSERT = "device_side_assert"
    MISALIGNED_ADDRESS = "misaligned_address"


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
    Kind.ILLEGAL_MEMORY_ACCESS: (Category.NOT_OOM, "Illegal memory access - not an out-of-memory error"),
    Kind.DEVICE_ASSERT: (Category.NOT_OOM, "Device-side assert - not an out-of-memory error"),
    Kind.MISALIGNED_ADDRESS: (Category.NOT_OOM, "Misaligned address - not an out-of-memory error"),
}

# Keys of Finding.numbers and Finding.derived that hold bytes; every other key is a plain count
# whose unit is in its name (timeout_ms, port, ...).
BYTE_KEYS = frozenset({
    "requested", "capacity", "free", "allocated", "reserved", "reserved_unallocated",
    "private_pools", "this_process", "limit", "other_allocations", "in_use", "max_in_use",
    "total_allocation", "temp_allocation", "parameter_allocation", "other_processes",
    "outside_allocator", "non_pytorch_in_process", "shortfall", "model_states", "activations",
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


# --- sizes -----------------------------------------------------------------------------------

_UNIT_BYTES = {
    "b": 1, "byte": 1, "bytes": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50,
    # PyTorch's MPS allocator (before 2.3) and the old TH CPU allocator divide by 1024 but label
    # the result "KB/MB/GB" (aten/src/ATen/mps/MPSAllocator.mm format_size; TH/THGeneral.cpp),
    # so these labels are binary too.
    "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40, "pb": 1 << 50,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGTP]i?B|bytes?|B)\s*$", re.I)
# 2**64 bytes printed as "17179869184.00 GiB" is PyTorch's "no limit" sentinel (the default
# allowed memory of cudaMallocAsync); anything this large is not a real amount.
_NO_LIMIT = 1 << 60
_NO_GPU_HAS = 1 << 40          # 1 TiB: no single accelerator has this much memory (2026: <= 288 GB)


def parse_size(text: str) -> int:
    """'1.50 GiB' -> 1610612736. Raises ValueError for anything that is not a size."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r}; expected a number and a unit such as '1.50 GiB'")
    return _to_bytes(m.group(1), m.group(2))


def _to_bytes(number: str, unit: str) -> int:
    # Decimal, not float: "111.88 MiB" must give exactly int(111.88 * 2**20) for every input.
    try:
        return int(Decimal(number) * _UNIT_BYTES[unit.lower()])
    except (InvalidOperation, KeyError) as exc:
        raise ValueError(f"not a size: {number!r} {unit!r}") from exc


def format_bytes(n: int) -> str:
    """IEC units with two decimals, like PyTorch's own messages: 1610612736 -> '1.50 GiB'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n} bytes"
    for unit, scale in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30)):
        if n < scale * 1024:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n / (1 << 40):.2f} TiB"


def _parse_count(text: str) -> int | None:
    """'6,742,609,920' / '124 M' / '7.24B' / '124.44M' -> parameter count."""
    t = text.replace(",", "").replace("_", "").strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMBT]?)", t, re.I)
    if not m:
        return None
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}[m.group(2).lower()]
    try:
        value = int(Decimal(m.group(1)) * scale)
    except InvalidOperation:
        return None
    return value if 0 < value < 10**14 else None


# --- line normalisation ----------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")
_WS = re.compile(r"\s+")
_RANK_SPLIT = re.compile(r"(?=\[(?:rank|default)\d+\]:)")
# One prefix at the start of a line; applied repeatedly. Named groups carry a rank.
_PREFIX = re.compile(
    r"""^(?:
      [ \t\u00a0]+                                          # indentation
    | \[(?:rank|default)\s?(?P<r1>\d+)\]:?                  # [rank3]: / torchrun --tee [default0]:
    | \[Rank\s?(?P<r2>\d+)\]:?                              # [Rank 0] (NCCL, DeepSpeed log_dist)
    | \[\d+,(?P<r3>\d+)\]<std(?:out|err)>:                  # OpenMPI --tag-output
    | \((?:[\w.]+\s+)?pid=\d+(?:,\s*ip=[\d.:a-f]+)?\)       # Ray (pid=123) (Worker pid=1, ip=..)
    | (?P<r4>\d{1,4}):\s                                    # srun --label "3: "
    | \[\d{1,9}\]                                           # [123] line numbers or pids
    | \d{4}-\d\d-\d\d[T\ ]\d\d:\d\d:\d\d(?:[.,]\d+)?Z?(?:\s?[+-]\d\d:?\d\d)?(?:\s?[-|:])?  # ISO time
    | \[\d{4}-\d\d-\d\d[T\ ][\d:.,]+\]                      # [2023-10-13 17:40:02,544]
    | \d\d:\d\d:\d\d(?:[.,]\d+)?(?=\s)                      # 23:34:07.661
    | [IWEF]\d{4}\ [\d:.]+\s+\d+\s[^\]\s]+\]                # glog: E0325 20:57:27.620000 2606 api.py:869]
    | \[[IWEF]\d{4}\ [\d:.]+\ [^\]]*\]                      # [E1206 18:44:12.715 ProcessGroupNCCL.cpp:607]
    | \[[IWEF]\ [\w.]+:\d+\]                                # [E ProcessGroupNCCL.cpp:737]
    | [IWEF]\ [\w/\\.:\-]+:\d+\]                            # I tensorflow/core/...cc:692]
    | \[(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\]  # [ERROR]
    | (?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)(?::[\w.<>]*:|\s*[:|\-]\s|\s)  # ERROR:root:
    | \|\s*(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*\|[^|]*?-\s  # loguru | ERROR | mod:fn:1 -
    | E\ {2,}|E\t                                           # pytest
    | >\ ?                                                  # quoted markdown
    | [│┃|]\ ?                                              # rich/box drawing frames
    | SUBPROCESS:\s?
    | !!!\s?Exception\ during\ processing\s?!!!             # ComfyUI
    )""",
    re.X,
)


def _strip_prefixes(text: str) -> tuple[int | None, str]:
    rank = None
    for _ in range(8):
        m = _PREFIX.match(text)
        if not m or m.end() == 0:
            break
        for g in ("r1", "r2", "r3", "r4"):
            if m.group(g) is not None:
                rank = int(m.group(g))
        text = text[m.end():]
    return rank, text


# --- the pre-filter --------------------------------------------------------------------------

# Lower-case substrings; a line without any of them cannot start a message (a region, once open,
# stays open for a tail of quiet lines). Plain `in` tests: about 7x faster than one alternation
# regex on the same text (measured). Kept short on purpose: each costs ~1 ns/byte of log, and
# words common in healthy multi-GPU logs ("nccl", "p2p" in NCCL INFO lines) would send whole
# logs down the slow path.
_KEYWORDS = (
    "memory", "allocat", "oom", "exhausted", "cublas", "cudnn", "bad_alloc", "killed", "sigkill",
    "signal 9", "exit", "return code", "bus error", "unexpectedly", "paging file", "1455", "keyerror",
    "not set", "ordinal", "device_count", "watchdog", "already in use", "errno", "eacces", "peer",
    "illegal", "device-side", "misaligned", "assertion", "inuse", "params", "parameters =",
    "parameters:", "batch size", "batch_size",
    "accumulat", "world_size", "world size", "nproc", "unable to write", "unable to find", "tried to",
    "'local_rank'",
)
_TRACEBACK_HINTS = ("Traceback (most recent", 'File "', "File ~", "Cell In[", ".py:")


def _has_keyword(text: str) -> bool:
    low = text.lower()
    for k in _KEYWORDS:
        if k in low:
            return True
    return False


# --- message anchors -------------------------------------------------------------------------
# Patterns run on "squashed" text (all whitespace removed), so spaces never appear in them.

_SZ = r"(\d+(?:\.\d*)?|\.\d+)([KMGTP]i?B|bytes?|B)"
_I = re.I


@dataclass(frozen=True)
class _AnchorSpec:
    kind: Kind
    triggers: tuple[str, ...]   # lower-case literals, one of which the match must contain: the
    pattern: re.Pattern         # regex only runs on regions that have one (regexes cost ~50 ns/char)
    absorb: int = 150           # a same-kind anchor this close after a kept one is the same message
    fallback: bool = False      # a fragment (a quoted part, a cut message): kept only when no other
                                # anchor of its kind is in the region, and only once per region


_ANCHORS: tuple[_AnchorSpec, ...] = (
    _AnchorSpec(Kind.CUDA_OOM, ("outofmemory",), re.compile(r"(CUDA|HIP)outofmemory", _I), absorb=60),
    # An excerpt that starts mid-message ("ut of memory. Tried to allocate ...").
    _AnchorSpec(Kind.CUDA_OOM, ("triedtoallocate",),
                re.compile(r"Triedtoallocate(?=" + _SZ + r"(?:\(GPU\d|\.GPU\d))", _I), absorb=60),
    # Fragments quoted without the first sentence: the bracket of torch 1.0-2.0 ("(GPU 0; 15.75 GiB
    # total capacity; ...)") or the sentences of torch>=2.2 ("Of the allocated memory ...").
    _AnchorSpec(Kind.CUDA_OOM, ("totalcapacity",), re.compile(
        r"\(GPU\d+;" + _SZ + r"totalcapacity;" + _SZ + r"alreadyallocated", _I), fallback=True),
    _AnchorSpec(Kind.CUDA_OOM, ("isallocatedbypytorch",), re.compile(
        r"(?:Includingnon-PyTorchmemory,thisprocesshas" + _SZ + r"memoryinuse\.)?"
        r"Oftheallocatedmemory" + _SZ + r"isallocatedbyPyTorch", _I), fallback=True),
    _AnchorSpec(Kind.CUDA_ASYNC_OOM, ("wouldexceedallowedmemory",),
                re.compile(r"Allocationondevice-?\d+wouldexceedallowedmemory", _I)),
    _AnchorSpec(Kind.MPS_OOM, ("mpsbackendoutofmemory",), re.compile(r"MPSbackendoutofmemory", _I)),
    _AnchorSpec(Kind.CUDA_ERROR_OOM, ("outofmemory", "out_of_memory", "memoryallocation",
                                      "hiperror_t(1002)"), re.compile(
        r"(?:CUDA|HIP)(?:runtime)?(?:error|failure|failedwitherror)\W{0,3}\d{0,3}\W{0,3}outofmemory"
        r"|error=2:outofmemory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|hipErrorOutOfMemory"
        # Caffe and other glog CHECKs: "Check failed: error == cudaSuccess (2 vs. 0)  out of memory".
        r"|cudaSuccess\(2vs\.0\)outofmemory"
        # TensorFlow's ROCm driver (rocm_driver.cc): "failed to allocate 890.06M (933298432
        # bytes) from device: HIP_ERROR_OutOfMemory", older builds print the raw hipError_t 1002.
        r"|HIP_ERROR_OutOfMemory|fromdevice:hipError_t\(1002\)", _I)),
    _AnchorSpec(Kind.CUBLAS_ALLOC, ("cublas_status",),
                re.compile(r"CUBLAS_STATUS_(?:ALLOC_FAILED|NOT_INITIALIZED)", _I)),
    _AnchorSpec(Kind.CUDNN_FAILURE, ("cudnn_status", "cudnnalgorithm", "unabletofindanengine",
                                     "convolutionalgorithms"), re.compile(
        r"CUDNN_STATUS_(?:ALLOC_FAILED|NOT_SUPPORTED|NOT_ENOUGH_WORKSPACE|NOT_INITIALIZED|INTERNAL_ERROR"
        r"|MAPPING_ERROR)"
        r"|Unabletofindavalidcudnnalgorithm|(?:GET|FIND)wasunabletofindanengine"
        # torch 1.x: "no valid convolution algorithms available in CuDNN"
        r"|novalidconvolutionalgorithmsavailableinCuDNN", _I), absorb=300),
    _AnchorSpec(Kind.TF_OOM, ("oomwhenallocating", "ranoutofmemory", "failedtoallocatememory"), re.compile(
        r"OOMwhenallocatingtensor|Allocator\(\w+\)ranoutofmemorytryingtoallocate"
        r"|ResourceExhaustedError:failedtoallocatememory", _I)),
    _AnchorSpec(Kind.JAX_OOM, ("resource_exhausted", "resourceexhausted", "memoryspace", "xlaruntimeerror"), re.compile(
        r"RESOURCE_?EXHAUSTED:(?:Outofmemory|XLA:TPUcompile|Failedtoallocate)|Ranoutofmemoryinmemoryspace"
        # the same shortage under another status: "INTERNAL: Failed to allocate N bytes for new constant"
        r"|XlaRuntimeError:INTERNAL:Failedtoallocate(?=\d+bytes)", _I)),
    _AnchorSpec(Kind.CPU_OOM, ("defaultcpuallocator", "notenoughmemory", "foranarray", "bad_alloc", "errno12"), re.compile(
        r"DefaultCPUAllocator:(?:can'?tallocatememory|notenoughmemory)|Torch:notenoughmemory"
        r"|Unabletoallocate" + _SZ + r"foranarray|std::bad_alloc|\[Errno12\]Cannotallocatememory", _I), absorb=40),
    _AnchorSpec(Kind.CPU_OOM, ("memoryerror",), re.compile(r"(?<![A-Za-z_])MemoryError(?![A-Za-z_])")),
    _AnchorSpec(Kind.WINDOWS_PAGING_FILE, ("1455", "pagingfile", "页面文件", "auslagerungsdatei"), re.compile(
        r"WinError1455|pagingfileisto+small|页面文件太小|Auslagerungsdateiistzuklein", _I), absorb=400),
    _AnchorSpec(Kind.OOM_KILLER, ("-9", "sigkill", "oom", "137"), re.compile(
        r"exitcode:?-9(?!\d)|Signal9\(SIGKILL\)receivedbyPID|terminatedwithsignalSIGKILL"
        r"|(?:exits|exited)withreturncode=?-9(?!\d)|Outofmemory:Kill(?:ed)?process|oom[-_]kill"
        r"|OOMKilled|(?:exitcode|exitstatus|exitedwithcode|returnedexitcode)137(?!\d)", _I), absorb=80),
    _AnchorSpec(Kind.DATALOADER_KILLED, ("dataloaderworker",), re.compile(
        r"DataLoaderworker\(pid(?:\(s\))?[\d,]*\)(?:iskilledbysignal|exitedunexpectedly)", _I), absorb=300),
    _AnchorSpec(Kind.SHARED_MEMORY, ("sharedmemory", "</torch_", "buserror", "sharedmemorysegment", "-7",
                                     "semlock"), re.compile(
        r"insufficientsharedmemory|outofsharedmemory|raiseyoursharedmemorylimit"
        r"|unabletowritetofile</torch_|Unexpectedbuserrorencounteredinworker"
        r"|unabletoopensharedmemoryobject</torch_"
        # a DataLoader's semaphores live in /dev/shm too: "SemLock(...) OSError: [Errno 28] No space
        # left on device" is a full /dev/shm, not a full disk
        r"|_multiprocessing\.SemLock\(.{0,400}?\[Errno28\]Nospaceleftondevice"
        r"|Errorwhilecreatingsharedmemorysegment"
        # torchrun reports a child killed by SIGBUS as exitcode -7: a full /dev/shm, almost always.
        r"|exitcode:?-7(?!\d)", _I), absorb=400),
    _AnchorSpec(Kind.MISSING_LAUNCH_ENV, ("keyerror", "butnotset"), re.compile(
        r"KeyError:['\"](?:LOCAL_RANK|RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT)['\"]"
        r"|environmentvariable(?:LOCAL_RANK|RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT)expected,?butnotset")),
    _AnchorSpec(Kind.INVALID_DEVICE_ORDINAL, ("ordinal", "invaliddevice", "deserialize"), re.compile(
        r"invaliddeviceordinal|cudaErrorInvalidDevice|hipErrorInvalidDevice"
        r"|AttemptingtodeserializeobjectonCUDAdevice\d+buttorch\.cuda\.device_count\(\)is\d+", _I), absorb=200),
    _AnchorSpec(Kind.NCCL_TIMEOUT, ("watchdog",),
                re.compile(r"Watchdogcaughtcollectiveoperationtimeout", _I), absorb=0),
    _AnchorSpec(Kind.PORT_IN_USE, ("alreadyinuse", "eaddrinuse", "errno:98"), re.compile(
        r"(?:errno:98-?)?Addressalreadyinuse|EADDRINUSE|errno:98(?!\d)", _I), absorb=300),
    _AnchorSpec(Kind.PORT_PERMISSION, ("errno:13", "eacces"),
                re.compile(r"errno:13-?Permissiondenied|EACCES", _I), absorb=300),
    _AnchorSpec(Kind.P2P, ("peeraccess", "peermapping", "p2p"), re.compile(
        r"peeraccessisnotsupport(?:ed)?betweenthesetwodevices|cudaErrorPeerAccessUnsupported"
        r"|peermappingresourcesexhausted|P2P(?:access)?(?:is)?notsupported", _I), absorb=300),
    _AnchorSpec(Kind.ILLEGAL_MEMORY_ACCESS, ("illegalmemoryaccess", "illegaladdress"), re.compile(
        r"anillegalmemoryaccesswasencountered|cudaErrorIllegalAddress", _I), absorb=400),
    _AnchorSpec(Kind.DEVICE_ASSERT, ("device-sideassert", "cudaerrorassert"),
                re.compile(r"device-sideasserttriggered|cudaErrorAssert", _I), absorb=400),
    # The kernel's own report, printed once per failing thread before the RuntimeError (which a
    # pasted excerpt may leave out): "Loss.cu:103: nll_loss_forward_kernel: block: [5,0,0],
    # thread: [996,0,0] Assertion `t >= 0 && t < n_classes` failed."
    _AnchorSpec(Kind.DEVICE_ASSERT, ("assertion",), re.compile(
        r"\.cuh?:\d+:(?:\w+:)?block:\[[\d,]+\],thread:\[[\d,]+\]Assertion`", _I), fallback=True),
    _AnchorSpec(Kind.MISALIGNED_ADDRESS, ("misaligned",),
                re.compile(r"misalignedaddress|cudaErrorMisalignedAddress", _I), absorb=400),
)

# Anchors matched per (unsquashed) line, for messages whose meaning depends on being alone.
# bash's job report ("./run.sh: line 7: 48213 Killed   python x.py", "[1]+  Killed ...") or a bare "Killed".
_KILLED_LINE = re.compile(r"^(?:.*?\bline\s\d+:\s+\d+\s+|\[\d+\]\+?\s+|\+\s+|\d+\s+)?"
                          r"Killed(?:\s{2,}\S.*|\s+\S+\.py.*)?$")
_BUS_ERROR_LINE = re.compile(r"^(?:.*\s)?Bus error(?: \(core dumped\))?\.?$")
# cudaMallocAsync's OOM cut right after "device": the device index is an int8 streamed as a char,
# so device 0 writes a NUL that ends the C string (pytorch/pytorch#168369). ComfyUI, which runs
# cudaMallocAsync by default, shows only "torch.OutOfMemoryError: Allocation on device ".
_CUT_ASYNC_LINE = re.compile(r"(?:^|[\s:*])Allocation on device\s*\x00?$")
# A KeyError printed by str() (an IDE, a logger): a line that is only the quoted variable.
_BARE_ENV_LINE = re.compile(r"^(?:KeyError:\s*)?['\"](LOCAL_RANK|RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR"
                            r"|MASTER_PORT)['\"]$")
# A line that starts something of its own, never the wrapped rest of the line before.
_STARTS_ANEW = re.compile(r"Traceback \(|File \"|During handling|The above exception|[\w.]+(?:Error|Exception|"
                          r"Warning|Interrupt)\b:?")
# Markdown emphasis around a whole line ("**Killed**").
_EMPHASIS = "*_`"
# details["format"] of the messages PyTorch itself cut at a NUL device byte (see above).
_CUT_AT_DEVICE = "unknown (cut after 'Allocation on device')"
_CUT_AT_GPU = "unknown (cut after 'GPU')"

# An anchor of kind K is dropped when it starts within N squashed characters after a kept anchor
# of one of these kinds: it is a second sentence of the same message.
_ABSORBED_BY: dict[Kind, tuple[frozenset[Kind], int]] = {
    Kind.CUDA_OOM: (frozenset({Kind.CUDA_OOM, Kind.HIP_OOM, Kind.MPS_OOM}), 80),
    Kind.SHARED_MEMORY: (frozenset({Kind.DATALOADER_KILLED}), 400),
    Kind.CUDA_ERROR_OOM: (frozenset({Kind.CUBLAS_ALLOC, Kind.CUDNN_FAILURE}), 200),
    Kind.PORT_PERMISSION: (frozenset({Kind.PORT_IN_USE}), 200),
}


# --- field patterns (squashed text) ----------------------------------------------------------

def _rx(p: str) -> re.Pattern:
    return re.compile(p, _I)


_F_REQUESTED = _rx(r"Triedtoallocate" + _SZ)
_F_GPU_OLD = _rx(r"\(GPU(\d+);")
_F_GPU_NEW = _rx(r"GPU(\d+)hasatotalcapac")
# The old format's fields follow a ';'. A message wrapped and pasted as a comment or a quote
# carries the marker into the joined line ("...allocated;\n # 0 bytes free;"), hence [#>*]*.
_SEP = r";[#>*]{0,3}"
_F_CAP_OLD = _rx(_SEP + _SZ + r"totalcapa(?:city|cit?$)")   # also cut mid-word at the end
_F_CAP_NEW = _rx(r"hasatotalcapac\w{0,4}?of" + _SZ)
_F_FREE_OLD = _rx(_SEP + _SZ + r"free")
_F_FREE_NEW = _rx(r"ofwhich" + _SZ + r"isfree")
_F_ALLOC_OLD = _rx(_SEP + _SZ + r"alreadyallocated")
_F_ALLOC_NEW = _rx(r"Oftheallocatedmemory" + _SZ + r"isallocatedbyPyTorch")
_F_CACHED = _rx(_SEP + _SZ + r"cached")
_F_RESERVED = _rx(_SEP + _SZ + r"reservedintotalbyPyTorch")
_F_ALLOWED = _rx(_SZ + r"allowed;")
_F_POOLS = _rx(r"with" + _SZ + r"allocatedinprivatepools")
_F_UNALLOC = _rx(r"and" + _SZ + r"isreservedbyPyTorchbutunallocated")
_F_THIS = _rx(r"thisprocesshas" + _SZ + r"memoryinuse")
_F_PROCESS = _rx(r"Process(\d+)has" + _SZ + r"memoryinuse")
_F_HINT_ENV = _rx(r"PYTORCH_(CUDA|HIP)_ALLOC_CONF=expandable_segments")

_F_ASYNC_ALLOC = _rx(r"Currentlyallocated:?" + _SZ)
_F_ASYNC_REQ = _rx(r"Requested:?" + _SZ)
_F_ASYNC_LIMIT = _rx(r"Devicelimit:?" + _SZ)
_F_ASYNC_FREE = _rx(r"Free\(accordingtoCUDA\):?" + _SZ)
_F_ASYNC_PTLIMIT = _rx(r"PyTorchlimit\(setbyuser-suppliedmemoryfraction\):?" + _SZ)
_F_ASYNC_DEV = _rx(r"Allocationondevice-?(\d+)wouldexceed")

_F_MPS_ALLOC = _rx(r"MPSallocated:?" + _SZ)
_F_MPS_OTHER = _rx(r"otherallocations:?" + _SZ)
_F_MPS_MAX = _rx(r"maxallowed:?" + _SZ)
_F_MPS_REQ = _rx(r"Triedtoallocate" + _SZ + r"on(private|shared)pool")

_F_TF_SHAPE = _rx(r"OOMwhenallocatingtensor(?:with|of)shape\[?([\d,]*)\]?")
_F_TF_DTYPE = _rx(r"andtype(bfloat16|float16|float32|float64|complex128|complex64|half|float|double"
                  r"|uint8|uint16|uint32|uint64|int8|int16|int32|int64|qint8|quint8|qint32|bool)")
_F_TF_DEVICE = _rx(r"device:(GPU|CPU|TPU):(\d+)")
_F_TF_ALLOCATOR = _rx(r"(?:byallocator|Allocator\()(GPU_\d+_bfc|gpu_\d+_bfc|cpu|mklcpu|\w+?_bfc)")
_F_TF_RAN_OUT = _rx(r"ranoutofmemorytryingtoallocate" + _SZ + r"(?:\(roundedto(\d+)\))?")
_F_TF_LIMIT = re.compile(r"(?<![A-Za-z])Limit:(\d+)")
_F_TF_INUSE = re.compile(r"(?<![A-Za-z])InUse:(\d+)")
_F_TF_MAXINUSE = re.compile(r"MaxInUse:(\d+)")

# XLA's two wordings: "Out of memory while trying to allocate N bytes" and the PJRT client's
# "Failed to allocate request for 2.99GiB (3206250496B) on device ordinal 0".
_F_JAX_REQ = _rx(r"(?:Outofmemory(?:whiletryingto)?allocat(?:e|ing)|Failedtoallocaterequestfor|Failedtoallocate)"
                 + _SZ + r"(?:\((\d+)B?\))?")
_F_JAX_TOTAL = _rx(r"totalallocation:" + _SZ)
_F_JAX_TEMP = _rx(r"preallocatedtempallocation:" + _SZ)
_F_JAX_PARAM = _rx(r"parameterallocation:" + _SZ)

_F_CPU_BYTES = _rx(r"youtriedtoallocate(\d+)bytes")
_F_CPU_GB = _rx(r"youtriedtoallocate(\d+)GB")
_F_NUMPY = _rx(r"Unabletoallocate" + _SZ + r"foranarraywithshape\(([\d,]*)\)anddatatype(\w+)")

_F_DL_PIDS = _rx(r"DataLoaderworker\(pid(?:\(s\))?([\d,]+)\)")
_F_DL_SIGNAL = _rx(r"iskilledbysignal:(Killed|Buserror|Segmentationfault|Aborted|Terminated|\w{1,20}?)(?:\.|It|$)")
_F_ENV_VAR = re.compile(r"(LOCAL_WORLD_SIZE|LOCAL_RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT|RANK)")
_F_DESERIALIZE = _rx(r"AttemptingtodeserializeobjectonCUDAdevice(\d+)buttorch\.cuda\.device_count\(\)is(\d+)")
# (PyTorch <= 1.10 prints no SeqNum)
_F_NCCL = _rx(r"WorkNCCL\((?:SeqNum=(\d+),)?OpType=(\w+?)(?:,NumelIn=(\d+))?(?:,NumelOut=\d+)?,Timeout\(ms\)=(\d+)\)"
              r"ranfor(\d+)milliseconds")
_F_RANK_IN_TEXT = _rx(r"\[(?:PG[^\]]*)?Rank(\d+)\]")
_F_PORT = _rx(r"(?:port[:=]|\]:|0\.0\.0\.0:|localhost:|127\.0\.0\.1:|MASTER_PORT=)(\d{2,5})")
_F_ASSERT = re.compile(r"Assertion`(.{1,120}?)`failed")
_ASSERT_TEXT = re.compile(r"Assertion `(.{1,200}?)` failed")
_F_RANK_TORCHRUN = _rx(r"(?:^|\W)rank:(\d+)\(local_rank|local_rank:(\d+)")

_TF_DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float64": 8, "double": 8,
    "complex64": 8, "complex128": 16, "uint8": 1, "int8": 1, "qint8": 1, "quint8": 1, "uint16": 2,
    "int16": 2, "uint32": 4, "int32": 4, "qint32": 4, "uint64": 8, "int64": 8, "bool": 1,
}


def _size(pattern: re.Pattern, text: str) -> int | None:
    m = pattern.search(text)
    if not m:
        return None
    value = _to_bytes(m.group(1), m.group(2))
    return value if value < _NO_LIMIT else None


# --- facts the log states outside the error messages (used to size the fixes) ---------------

# (triggers in the squashed lower-case region, "|"-separated; fact; pattern on the original line)
_FACTS: tuple[tuple[str, str, re.Pattern], ...] = (
    ("params", "trainable_params", re.compile(r"trainable params:\s*([\d,]+)", re.I)),
    ("params", "total_params", re.compile(r"\|\|\s*all params:\s*([\d,]+)", re.I)),
    ("parameters", "trainable_params", re.compile(r"Number of trainable parameters\s*=\s*([\d,]+)", re.I)),
    ("parameters", "trainable_params", re.compile(r"Trained Parameters:\s*([\d,]+)", re.I)),
    ("param", "total_params",
     re.compile(r"Total\s+(?:number\s+of\s+)?param(?:eter)?s\s*[:=]\s*([\d,.]+\s?[KMBT]?)\b", re.I)),
    ("param", "trainable_params", re.compile(r"^Trainable\s+param(?:eter)?s\s*[:=]\s*([\d,.]+\s?[KMBT]?)\b", re.I)),
    ("params", "total_params", re.compile(r"^([\d.]+\s?[KMBT]?)\s+Total params", re.I)),
    ("params", "trainable_params", re.compile(r"^([\d.]+\s?[KMBT]?)\s+Trainable params", re.I)),
    ("parameters", "total_params", re.compile(r"number of parameters:\s*([\d.]+\s?M)\b", re.I)),
    ("batch", "batch_size", re.compile(
        r"(?:Instantaneous batch size per device\s*=|per_device_train_batch_size\s*[=:]|\bbatch[_ ]size\s*[=:])"
        r"\s*(\d+)", re.I)),
    ("accum", "grad_accum", re.compile(
        r"(?:Gradient Accumulation steps\s*=|gradient_accumulation_steps\s*[=:]|accumulate_grad_batches\s*[=:])"
        r"\s*(\d+)", re.I)),
    ("world|nproc", "world_size",
     re.compile(r"(?:\bworld[_ ]size\s*[=:]|nproc[_-]per[_-]node[= ]|\bWORLD_SIZE=)\s*(\d+)", re.I)),
)


# --- traceback frames and phase --------------------------------------------------------------

_TB_HEADER = "Traceback (most recent call last)"
_FRAME_RES = (
    re.compile(r'^File "(?P<file>[^"]*)", line \d+, in (?P<func>\S+)'),
    re.compile(r"^File (?P<file>\S+?):\d+, in (?P<func>[\w.<>]+)"),          # IPython 8
    re.compile(r"^(?P<file>Cell In\s?\[\d*\]), line \d+(?:, in (?P<func>[\w.<>]+))?"),  # Jupyter cell
    re.compile(r"^(?P<file>\S+\.py):\d+ in (?P<func>[\w<>]+)"),                # rich tracebacks
    re.compile(r"^(?P<file>\S+\.py) in (?P<func>[\w<>]+)\("),                  # IPython 7
)
_CODE_MARKER = re.compile(r"^(?:-*>|\u2771)\s*\d+\s+(.*)")   # IPython "---->", rich "\u2771"
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Warning)\b")


class _Frame:
    __slots__ = ("line", "tb", "func", "file", "code")

    def __init__(self, line: int, tb: int, func: str, file: str) -> None:
        self.line, self.tb, self.func, self.file, self.code = line, tb, func, file, ""


_P_OPTIM_FILE = re.compile(r"[/\\]optim[/\\]|adamw?\.py|_functional\.py|bitsandbytes[/\\]optim")
_P_OPTIM_FUNC = re.compile(r"^(?:step|_multi_tensor_\w+|_single_tensor_\w+|_fused_\w+|adamw?|_init_group"
                           r"|_update_step)$")
_P_OPTIM_CODE = re.compile(r"\b(?:optimizer|optim|opt|scaler)\.step\(|\.step\(\)")
_P_BACKWARD_FUNC = re.compile(r"^(?:backward|_engine_run_backward|run_backward|grad)$")
_P_BACKWARD_FILE = re.compile(r"_tensor\.py|autograd[/\\]|graph\.py")
_P_BACKWARD_CODE = re.compile(r"\.backward\(|autograd\.grad\(")
_P_DATA_FILE = re.compile(r"torch[/\\]utils[/\\]data")
_P_DATA_FUNC = re.compile(r"^(?:__getitem__|__getitems__|collate\w*|default_collate|_next_data|pin_memory\w*|fetch)$")
_P_LOAD_FUNC = re.compile(r"^(?:_apply|cuda|load_state_dict|_load_from_state_dict|from_pretrained|load_checkpoint"
                          r"|_load_state_dict_into\w*|dispatch_model|load_model|_load\w*|set_module_tensor_to_device)$")
_P_LOAD_CODE = re.compile(r"\b(?:model|net|module)\s*(?:=\s*\w+\s*)?\.(?:to|cuda)\(|from_pretrained\(|torch\.load\("
                          r"|load_state_dict\(")
_P_FORWARD = re.compile(r"^(?:forward|_call_impl|_wrapped_call_impl|__call__)$")
_P_EVAL = re.compile(r"(?:^|_)(?:eval\w*|evaluat\w*|valid\w*|validation\w*|test_step|predict\w*|prediction_step"
                     r"|inference|infer|generate|sample|sampling)$", re.I)
_P_NOGRAD = re.compile(r"no_grad|inference_mode|decorate_context|_contextlib|grad_mode")
# Library functions known to disable autograd themselves (HF Trainer.prediction_step wraps the
# forward in torch.no_grad(); generate() is decorated with it).
_P_NOGRAD_FUNCS = frozenset({"prediction_step", "evaluation_loop", "generate", "decorate_context"})


def _phase_of(frames: list[_Frame]) -> tuple[Phase | None, bool]:
    """Phase from the innermost recognisable frame; second value: autograd visibly disabled."""
    phase: Phase | None = None
    for f in reversed(frames):
        func, file, code = f.func, f.file, f.code
        if _P_OPTIM_FILE.search(file) and (_P_OPTIM_FUNC.match(func) or func == "step") or _P_OPTIM_CODE.search(code):
            phase = Phase.OPTIMIZER_STEP
        elif (_P_BACKWARD_FUNC.match(func) and _P_BACKWARD_FILE.search(file)) or _P_BACKWARD_CODE.search(code):
            phase = Phase.BACKWARD
        elif _P_DATA_FILE.search(file) or (_P_DATA_FUNC.match(func) and not re.search(r"[/\\]os\.py$", file)):
            phase = Phase.DATA_LOADING
        elif _P_LOAD_FUNC.match(func) or _P_LOAD_CODE.search(code):
            phase = Phase.MODEL_LOADING
        if phase is not None:
            break
    if phase is None and any(_P_FORWARD.match(f.func) or "functional.py" in f.file for f in frames):
        phase = Phase.FORWARD
    in_eval = any(_P_EVAL.search(f.func) for f in frames)
    no_grad = any(_P_NOGRAD.search(f.code) or _P_NOGRAD.search(f.file) or f.func in _P_NOGRAD_FUNCS for f in frames)
    if in_eval and phase in (None, Phase.FORWARD):
        phase = Phase.EVALUATION
    return phase, no_grad


# --- scanning --------------------------------------------------------------------------------

class _Draft:
    """A finding under construction; equal drafts (same error repeated) are merged."""

    __slots__ = ("kind", "line", "excerpt", "numbers", "details", "processes", "collectives",
                 "ranks", "gpus", "frames", "occurrences", "sig")

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self.line = 0
        self.excerpt = ""
        self.numbers: dict[str, int] = {}
        self.details: dict[str, str] = {}
        self.processes: list[ProcessUse] = []
        self.collectives: list[Collective] = []
        self.ranks: list[int] = []
        self.gpus: list[int] = []
        self.frames: list[_Frame] = []
        self.occurrences = 1
        self.sig: tuple = ()


class _KeyState:
    """Per rank stream: what is needed to assemble that rank's messages."""

    __slots__ = ("recent", "region", "region_chars", "quiet", "quiet_chars", "last_hit", "last_region_end", "frames",
                 "tb_id", "tb_headers", "tb_closed_at", "code_wanted")

    def __init__(self) -> None:
        self.recent: deque[tuple[int, str]] = deque(maxlen=_LOOKBACK)
        self.region: list[tuple[int, str]] | None = None
        self.region_chars = 0
        self.quiet = 0
        self.quiet_chars = 0
        self.last_hit = 0
        self.last_region_end = 0
        self.frames: deque[_Frame] = deque(maxlen=_FRAMES_KEEP)
        self.tb_id = 0
        self.tb_headers: deque[tuple[int, int]] = deque(maxlen=16)   # (tb id, line)
        self.tb_closed_at: dict[int, int] = {}
        self.code_wanted = 0


# Set by tests: re-raise parser bugs instead of counting them in skipped_regions.
_STRICT = False


class _Scanner:
    def __init__(self) -> None:
        self.keys: OrderedDict[int | None, _KeyState] = OrderedDict()
        self.lineno = 0
        self.by_kind: dict[Kind, list[_Draft]] = {}
        self.dropped = 0
        self.skipped = 0
        self.facts: dict[str, int] = {}
        self.ranks_seen: set[int] = set()
        self.tf_stats: tuple[int, dict[str, int]] | None = None
        # A rank-prefixed line that stops mid-sentence, hard-wrapped by a terminal: the next line
        # arrives without the prefix but belongs to the same rank ("... Of the allocated memory 4"
        # / "0.30 GiB is allocated by PyTorch, ...").
        self.wrap_rank: int | None = None
        self.wrap_line = -1

    # batches: a cheap pre-filter decides which lines need real work
    def feed_batch(self, batch: list[str]) -> None:
        start = self.lineno
        if self._busy(start) or self._interesting("\n".join(batch)):
            for i in range(0, len(batch), _SUB_BATCH):
                sub = batch[i:i + _SUB_BATCH]
                text = "\n".join(sub)
                keyword = _has_keyword(text)
                if not keyword and not self._busy(start + i) and not self._has_traceback(text):
                    self._remember_tail(sub, start + i)
                    continue
                # Without a keyword in the sub-batch no line needs its own keyword check.
                for j, line in enumerate(sub):
                    self._line(line, start + i + j + 1, keyword)
        else:
            self._remember_tail(batch, start)
        self.lineno = start + len(batch)

    def feed_block(self, block: str) -> None:
        """A run of complete lines joined by newlines (no trailing one). Quiet blocks are only
        counted - no per-line strings are made for them."""
        if not self._busy(self.lineno) and not self._interesting(block):
            n = block.count("\n") + 1
            tail = block.rsplit("\n", _LOOKBACK)[-_LOOKBACK:]
            self.lineno += n - len(tail)
            self._remember_tail(tail, self.lineno)
            self.lineno += len(tail)
            return
        self.feed_batch(block.split("\n"))

    def _busy(self, lineno: int) -> bool:
        busy = False
        for key, st in list(self.keys.items()):
            if st.region is not None:
                if lineno - st.last_hit > _REGION_GLOBAL_QUIET:
                    self._close(st, key)
                else:
                    busy = True
        return busy

    @staticmethod
    def _interesting(text: str) -> bool:
        return _has_keyword(text) or _Scanner._has_traceback(text)

    @staticmethod
    def _has_traceback(text: str) -> bool:
        return any(h in text for h in _TRACEBACK_HINTS)

    def _remember_tail(self, lines: list[str], start: int) -> None:
        # A keyword wrapped across the batch boundary needs the lines just before it.
        n = len(lines)
        for j in range(max(0, n - _LOOKBACK), n):
            self._line(lines[j], start + j + 1)

    def _line(self, raw: str, lineno: int, check: bool = True) -> None:
        if raw.endswith("\n"):
            raw = raw[:-1]
        if "\x1b" in raw:
            raw = _ANSI.sub("", raw)
        pieces = raw.split("\r") if "\r" in raw else (raw,)
        for piece in pieces:
            if "[rank" in piece or "[default" in piece:
                parts = [p for p in _RANK_SPLIT.split(piece) if p]
            else:
                parts = [piece]
            for part in parts:
                for k in range(0, max(1, len(part)), _MAX_LOGICAL):
                    self._logical(part[k:k + _MAX_LOGICAL], lineno, check)

    def _state(self, key: int | None) -> _KeyState:
        st = self.keys.get(key)
        if st is None:
            st = self.keys[key] = _KeyState()
            if len(self.keys) > _MAX_KEYS:
                old_key, old = self.keys.popitem(last=False)
                if old.region is not None:
                    self._close(old, old_key)
        else:
            self.keys.move_to_end(key)
        return st

    def _logical(self, text: str, lineno: int, check: bool = True) -> None:
        rank, body = _strip_prefixes(text)
        if rank is None and self.wrap_rank is not None and lineno == self.wrap_line + 1 \
                and body == text.lstrip() and not _STARTS_ANEW.match(body):
            rank = self.wrap_rank
        tail = body.rstrip()[-1:]
        self.wrap_rank = rank if rank is not None and (tail.isalnum() or tail in ",;(") else None
        self.wrap_line = lineno
        if rank is not None and len(self.ranks_seen) < _MAX_RANKS:
            self.ranks_seen.add(rank)
        st = self._state(rank)
        self._track_frames(st, body, lineno)
        hit = check and _has_keyword(body)
        if st.region is not None:
            st.region.append((lineno, body))
            st.region_chars += len(body)
            if hit:
                st.quiet = st.quiet_chars = 0
                st.last_hit = lineno
            else:
                st.quiet += 1
                st.quiet_chars += len(body) + 1
            if st.quiet > _REGION_TAIL and st.quiet_chars > _REGION_TAIL_CHARS or st.quiet > 4 * _REGION_TAIL:
                self._close(st, rank)
            elif len(st.region) >= _REGION_MAX_LINES or st.region_chars >= _REGION_MAX_CHARS:
                self._split(st, rank)
        elif hit:
            st.region = [(ln, b) for ln, b in st.recent if ln > st.last_region_end]
            st.region.append((lineno, body))
            st.region_chars = sum(len(b) for _, b in st.region)
            st.quiet = st.quiet_chars = 0
            st.last_hit = lineno
        st.recent.append((lineno, body))

    def _track_frames(self, st: _KeyState, body: str, lineno: int) -> None:
        b = body.strip()
        if _TB_HEADER in b and len(b) < 200:
            st.tb_id += 1
            st.tb_headers.append((st.tb_id, lineno))
            st.code_wanted = 0
            return
        frame_like = b.startswith(("File ", "Cell In")) or ".py:" in b or ".py in " in b
        open_tb = bool(st.tb_headers) and st.tb_id not in st.tb_closed_at \
            and lineno - st.tb_headers[-1][1] <= _TB_REACH
        if not open_tb and not frame_like:
            return
        for rx in (_FRAME_RES if frame_like else ()):
            m = rx.match(b)
            if m:
                if not open_tb:
                    # An excerpt that starts mid-traceback: its first frame opens one.
                    st.tb_id += 1
                    st.tb_headers.append((st.tb_id, lineno))
                func = (m.groupdict().get("func") or "<cell>").rsplit(".", 1)[-1]
                st.frames.append(_Frame(lineno, st.tb_id, func[:80], m.group("file")[:200]))
                st.code_wanted = 12 if b.startswith("Cell In") or not b.startswith('File "') else 1
                return
        if st.code_wanted and st.frames:
            marker = _CODE_MARKER.match(b)
            if marker:
                st.frames[-1].code = marker.group(1)[:200]
                st.code_wanted = 0
            elif st.code_wanted == 1:
                st.frames[-1].code = b[:200]
                st.code_wanted = 0
            else:
                st.code_wanted -= 1
            return
        if _EXC_LINE.match(b):
            st.tb_closed_at[st.tb_id] = lineno
            if len(st.tb_closed_at) > 32:
                st.tb_closed_at.pop(next(iter(st.tb_closed_at)))

    def _frames_for(self, st: _KeyState, line: int) -> list[_Frame]:
        """Frames of the traceback that ends at (or just before) `line`, innermost last."""
        for tb_id, header_line in reversed(st.tb_headers):
            if header_line <= line:
                if line - header_line <= _TB_REACH:
                    closed = st.tb_closed_at.get(tb_id)
                    if closed is None or closed >= line - 3:
                        frames = [f for f in st.frames if f.tb == tb_id and f.line < line]
                        if frames:
                            return frames[-_FRAMES_PER_FINDING:]
                break
        # VS Code ("Exception has occurred: ...") prints the message first and then the frames,
        # innermost first: a frame list that starts right after the message belongs to it.
        for tb_id, header_line in st.tb_headers:
            if line < header_line <= line + 3:
                frames = [f for f in st.frames if f.tb == tb_id]
                return frames[:_FRAMES_PER_FINDING][::-1]
        return []

    # regions
    def _close(self, st: _KeyState, key: int | None) -> None:
        lines, st.region = st.region or [], None
        st.region_chars = 0
        st.quiet = st.quiet_chars = 0
        if lines:
            st.last_region_end = lines[-1][0]
            self._process(st, key, lines, None)

    def _split(self, st: _KeyState, key: int | None) -> None:
        lines = st.region or []
        carry = lines[-_REGION_CARRY:]
        self._process(st, key, lines, carry[0][0] if carry else None)
        st.region = list(carry)
        st.region_chars = sum(len(b) for _, b in carry)

    def finish(self) -> None:
        open_regions = [(st.region[0][0], i, key, st) for i, (key, st) in enumerate(self.keys.items()) if st.region]
        for _, _, key, st in sorted(open_regions):
            self._close(st, key)

    def _process(self, st: _KeyState, key: int | None, lines: list[tuple[int, str]], stop_line: int | None) -> None:
        try:
            self._parse_region(st, key, lines, stop_line)
        except Exception:  # noqa: BLE001 - one unparsable region must not lose the others
            if _STRICT:
                raise
            self.skipped += 1

    def _parse_region(self, st: _KeyState, key: int | None, lines: list[tuple[int, str]],
                      stop_line: int | None) -> None:
        starts: list[int] = []
        parts: list[str] = []
        pos = 0
        for _, body in lines:
            sq = _WS.sub("", body)
            starts.append(pos)
            parts.append(sq)
            pos += len(sq)
        sq = "".join(parts)
        self._collect_facts(lines, sq, sq.lower())

        low = sq.lower()
        found: list[tuple[int, _AnchorSpec, re.Match]] = []
        for spec in _ANCHORS:
            if not any(t in low for t in spec.triggers):
                continue
            for m in spec.pattern.finditer(sq):
                found.append((m.start(), spec, m))
        found.sort(key=lambda t: t[0])
        whole = {spec.kind for _, spec, _ in found if not spec.fallback}
        kept: list[tuple[int, _AnchorSpec, re.Match]] = []
        for item in found:
            spec = item[1]
            if spec.fallback and (spec.kind in whole or any(k[1].kind is spec.kind for k in kept)):
                continue
            if not self._absorbed(item, kept):
                kept.append(item)

        for i, (start, spec, m) in enumerate(kept):
            idx = bisect.bisect_right(starts, start) - 1
            lineno, body = lines[idx]
            if stop_line is not None and lineno >= stop_line:
                continue
            end = kept[i + 1][0] if i + 1 < len(kept) else len(sq)
            span = sq[start:min(end, start + _ANCHOR_SPAN)]
            pre = sq[max(0, start - _PRE_SPAN):start]
            draft = _EXTRACT[spec.kind](span, pre, m)
            if draft.kind is Kind.DEVICE_ASSERT:
                for _, text in lines:
                    a = _ASSERT_TEXT.search(text)
                    if a:
                        draft.details["assertion"] = a.group(1)[:200]
                        break
            self._place(draft, st, key, lineno, body)

        # Messages recognised by a whole line; the last two only when no anchor of their kind is here.
        kinds = {spec.kind for _, spec, _ in kept}
        cut_async = "allocationondevice" in low and Kind.CUDA_ASYNC_OOM not in kinds
        bare_env = Kind.MISSING_LAUNCH_ENV not in kinds and "os.environ[" in low
        if "killed" not in low and "buserror" not in low and not cut_async and not bare_env:
            return
        for lineno, body in lines:
            if stop_line is not None and lineno >= stop_line:
                break
            b = body.strip().strip(_EMPHASIS).strip()
            if cut_async and _CUT_ASYNC_LINE.search(b):
                cut_async = False
                d = _Draft(Kind.CUDA_ASYNC_OOM)
                d.details["format"] = _CUT_AT_DEVICE
                d.sig = (None, None)
                self._place(d, st, key, lineno, body)
            elif bare_env and (bare := _BARE_ENV_LINE.match(b)):
                var = bare.group(1)
                if f"os.environ[\"{var.lower()}\"]" in low or f"os.environ['{var.lower()}']" in low:
                    bare_env = False
                    d = _Draft(Kind.MISSING_LAUNCH_ENV)
                    d.details["variable"] = var
                    d.sig = (var,)
                    self._place(d, st, key, lineno, body)
            elif _KILLED_LINE.match(b):
                d = _Draft(Kind.OOM_KILLER)
                d.details["source"] = "shell reported 'Killed'"
                d.sig = ("shell",)
                self._place(d, st, key, lineno, body)
            elif _BUS_ERROR_LINE.match(b):
                d = _Draft(Kind.SHARED_MEMORY)
                d.details["signal"] = "Bus error"
                d.sig = ()
                self._place(d, st, key, lineno, body)

    @staticmethod
    def _absorbed(item: tuple[int, _AnchorSpec, re.Match], kept: list) -> bool:
        start, spec, _ = item
        rule = _ABSORBED_BY.get(spec.kind)
        for k_start, k_spec, k_m in reversed(kept):
            distance = start - k_start
            if distance > 400:
                break
            if k_spec.kind == spec.kind and distance <= spec.absorb:
                return True
            if start < k_m.end():
                return True
            if rule and k_spec.kind in rule[0] and distance <= rule[1]:
                return True
        return False

    def _place(self, d: _Draft, st: _KeyState, key: int | None, lineno: int, body: str) -> None:
        d.line = lineno
        d.excerpt = body.strip()[:_EXCERPT]
        if key is not None and key not in d.ranks:
            d.ranks.append(key)
        if key is not None and d.collectives:
            # The "[Rank N]" inside a watchdog line was consumed as this stream's prefix.
            d.collectives = [c if c.rank is not None else replace(c, rank=key) for c in d.collectives]
        d.frames = self._frames_for(st, lineno)
        if d.kind is Kind.TF_OOM and self.tf_stats and 0 <= lineno - self.tf_stats[0] <= 5000:
            for k, v in self.tf_stats[1].items():
                d.numbers.setdefault(k, v)
        self._add(d)

    def _add(self, d: _Draft) -> None:
        same = self.by_kind.setdefault(d.kind, [])
        for b in same:
            if _compatible(b.sig, d.sig):
                _merge(b, d)
                return
        if sum(len(v) for v in self.by_kind.values()) >= _MAX_FINDINGS:
            self.dropped += 1
            return
        same.append(d)

    def _collect_facts(self, lines: list[tuple[int, str]], sq: str, low: str) -> None:
        facts = [(name, rx) for triggers, name, rx in _FACTS if any(t in low for t in triggers.split("|"))]
        for lineno, body in lines if facts else ():
            b = body.strip()
            for name, rx in facts:
                m = rx.search(b)
                if m:
                    value = _parse_count(m.group(1))
                    if value is not None and (name.endswith("params") or value < 1_000_000):
                        self.facts[name] = value
        if "Limit:" in sq and "InUse:" in sq:
            stats = {}
            for name, rx in (("limit", _F_TF_LIMIT), ("in_use", _F_TF_INUSE), ("max_in_use", _F_TF_MAXINUSE)):
                m = rx.search(sq)
                if m:
                    stats[name] = int(m.group(1))
            if stats:
                self.tf_stats = (lines[0][0], stats)


def _compatible(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    shared = False
    for x, y in zip(a, b):
        if x is not None and y is not None:
            if x != y:
                return False
            shared = True
    return shared or all(x is None for x in a + b)


def _merge(into: _Draft, other: _Draft) -> None:
    """Fold a repeat of the same error into `into`; the earliest occurrence's figures win
    (regions of different ranks are not necessarily parsed in line order)."""
    if (other.line, min(other.ranks, default=-1)) < (into.line, min(into.ranks, default=-1)):
        into.line, other.line = other.line, into.line
        into.excerpt, other.excerpt = other.excerpt, into.excerpt
        into.numbers, other.numbers = other.numbers, into.numbers
        into.details, other.details = other.details, into.details
        into.processes, other.processes = other.processes, into.processes
        into.frames, other.frames = other.frames, into.frames
    into.occurrences += 1
    for r in other.ranks:
        if r not in into.ranks and len(into.ranks) < _MAX_RANKS:
            into.ranks.append(r)
    for g in other.gpus:
        if g not in into.gpus and len(into.gpus) < 64:
            into.gpus.append(g)
    for k, v in other.numbers.items():
        into.numbers.setdefault(k, v)
    for k, v in other.details.items():
        into.details.setdefault(k, v)
    if into.details.get("format") in ("torch>=2.1", "unknown (truncated)") and \
            other.details.get("format") not in (None, "torch>=2.1", "unknown (truncated)"):
        into.details["format"] = other.details["format"]
    if not into.processes:
        into.processes = other.processes
    if not into.frames:
        into.frames = other.frames
    if len(into.collectives) < 64:
        into.collectives.extend(other.collectives[:64 - len(into.collectives)])
        into.collectives.sort(key=lambda c: (c.rank is None, c.rank or 0, _seq(c)))


# --- extractors: squashed message text -> draft ----------------------------------------------

def _x_torch(span: str, pre: str, m: re.Match) -> _Draft:
    head = m.group(0)[:3].upper()
    hip = head == "HIP" or "PYTORCH_HIP_ALLOC_CONF" in span.upper() or "HIPGraphs" in span
    d = _Draft(Kind.HIP_OOM if hip else Kind.CUDA_OOM)
    n = d.numbers
    sentence = _F_GPU_NEW.search(span) is not None or "isallocatedbyPyTorch" in span
    fields = [("requested", _F_REQUESTED), ("private_pools", _F_POOLS), ("this_process", _F_THIS)]
    if sentence:
        fields += [("capacity", _F_CAP_NEW), ("free", _F_FREE_NEW), ("allocated", _F_ALLOC_NEW),
                   ("reserved_unallocated", _F_UNALLOC), ("limit", _F_ALLOWED)]
    else:
        fields += [("capacity", _F_CAP_OLD), ("free", _F_FREE_OLD), ("allocated", _F_ALLOC_OLD),
                   ("reserved", _F_RESERVED), ("reserved_unallocated", _F_CACHED), ("limit", _F_ALLOWED)]
    for name, rx in fields:
        value = _size(rx, span)
        if value is not None:
            n[name] = value
    gpu = _F_GPU_NEW.search(span) or _F_GPU_OLD.search(span)
    if gpu:
        d.gpus.append(int(gpu.group(1)))
    for pm in _F_PROCESS.finditer(span):
        if len(d.processes) < 64:
            d.processes.append(ProcessUse(int(pm.group(1)), _to_bytes(pm.group(2), pm.group(3))))
    d.details["format"] = _torch_format(span, sentence)
    if not sentence and re.match(r"(?:CUDA|HIP)outofmemory\.Triedtoallocate" + _SZ + r"\.GPU(?!\d+has)",
                                 span, re.I):
        d.details["format"] = _CUT_AT_GPU
    hint = _F_HINT_ENV.search(span)
    if hint:
        d.details["alloc_conf_env"] = f"PYTORCH_{hint.group(1).upper()}_ALLOC_CONF"
    d.sig = (n.get("requested"), n.get("capacity"))
    return d


def _torch_format(span: str, sentence: bool) -> str:
    low = span.lower()
    if not sentence:
        if "cached" in low and "reservedintotal" not in low:
            return "torch<=1.4"
        if "reservedintotal" in low or "alreadyallocated" in low:
            return "torch 1.5-2.0"
        return "unknown (truncated)"
    if "capacty" in low or "max_split_size_mb" in low:
        return "torch 2.1"
    if "expandable_segments" in low:
        return "torch>=2.2"
    return "torch>=2.1"


def _x_async(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.CUDA_ASYNC_OOM)
    for name, rx in (("allocated", _F_ASYNC_ALLOC), ("requested", _F_ASYNC_REQ), ("capacity", _F_ASYNC_LIMIT),
                     ("free", _F_ASYNC_FREE), ("limit", _F_ASYNC_PTLIMIT)):
        value = _size(rx, span)
        if value is not None:
            d.numbers[name] = value
    dev = _F_ASYNC_DEV.search(span)
    if dev:
        d.gpus.append(int(dev.group(1)))
    d.sig = (d.numbers.get("requested"), d.numbers.get("capacity"))
    return d


def _x_mps(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.MPS_OOM)
    for name, rx in (("allocated", _F_MPS_ALLOC), ("other_allocations", _F_MPS_OTHER), ("limit", _F_MPS_MAX)):
        value = _size(rx, span)
        if value is not None:
            d.numbers[name] = value
    req = _F_MPS_REQ.search(span)
    if req:
        d.numbers["requested"] = _to_bytes(req.group(1), req.group(2))
        d.details["pool"] = req.group(3).lower()
    d.sig = (d.numbers.get("requested"), d.numbers.get("limit"))
    return d


def _x_cuda_error(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.CUDA_ERROR_OOM)
    text = m.group(0).upper()
    context = (pre + span[:200]).lower()
    driver = text in ("CUDA_ERROR_OUT_OF_MEMORY", "HIP_ERROR_OUTOFMEMORY") \
        or text.startswith("FROMDEVICE:HIPERROR_T")
    if driver and ("stream_executor" in context or "failedtoalloc" in context
                   or "tensorflow" in context or "xla" in context):
        # cuda_driver.cc / rocm_driver.cc in TensorFlow/XLA logs: "failed to alloc N bytes ...
        # result: CUDA_ERROR_OUT_OF_MEMORY" or "failed to allocate 10.76G (11553462016 bytes)
        # from device: ..."; the framework's own error usually follows.
        d.details["source"] = "driver (TensorFlow/XLA stream executor)"
        if "onhost" in context or "pinnedhostmemory" in context:
            d.details["source"] = "driver: pinned host memory (TensorFlow/XLA)"
        req = re.search(r"failedtoalloc(?:ate)?(?:[\d.]+[KMGTPE]?i?B?\()?(\d+)bytes", pre + span, re.I)
        if req:
            d.numbers["requested"] = int(req.group(1))
    elif "CUDA_ERROR_OUT_OF_MEMORY" in text:
        d.details["source"] = "CUDA driver API" + (" (context creation)" if "cuctxcreate" in context else "")
    elif "ERROR=2" in text or "RUNTIMEERROR(2)" in text:
        d.details["source"] = "old PyTorch THC (cuda runtime error 2)"
    else:
        d.details["source"] = "CUDA runtime/driver"
    if text.startswith("HIP") or "HIPERROR" in text:
        d.details["platform"] = "ROCm/HIP"
    d.sig = (d.details["source"],)
    return d


def _x_cublas(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.CUBLAS_ALLOC)
    d.details["status"] = m.group(0).upper()
    # TensorFlow logs "failed to create cublas handle: CUBLAS_STATUS_NOT_INITIALIZED" and then the
    # driver's "CUDA_ERROR_OUT_OF_MEMORY" (absorbed into this finding): the GPU was full.
    if re.search(r"CUDA_ERROR_OUT_OF_MEMORY|(?:CUDA|HIP)(?:error:?)?outofmemory", span[:1500], re.I):
        d.details["driver_oom_follows"] = "yes"
    # (the glog prefix naming tensorflow/stream_executor is stripped; the wording is TensorFlow's)
    if re.search(r"tensorflow|stream_executor|failedtocreatecublashandle", pre + span[:1500], re.I):
        d.details["framework"] = "TensorFlow"
    d.sig = (d.details["status"],)
    return d


def _x_cudnn(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.CUDNN_FAILURE)
    text = m.group(0)
    if text.upper().startswith("CUDNN_STATUS_"):
        d.details["status"] = text.upper()
    elif text.lower().startswith("unable"):
        d.details["status"] = "no valid cuDNN algorithm"
    else:
        d.details["status"] = "no cuDNN engine (cuDNN frontend)"
    d.sig = (d.details["status"],)
    return d


def _x_tf(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.TF_OOM)
    shape = _F_TF_SHAPE.search(span)
    dtype = _F_TF_DTYPE.search(span)
    if shape is not None:
        dims = [int(x) for x in shape.group(1).split(",") if x.isdigit()]
        d.details["shape"] = "[" + ",".join(str(x) for x in dims) + "]"
        if dtype is not None:
            d.details["dtype"] = dtype.group(1).lower()
            count = 1
            for x in dims:
                count *= x
            d.numbers["requested"] = count * _TF_DTYPE_BYTES[dtype.group(1).lower()]
    ran_out = _F_TF_RAN_OUT.search(span)
    if ran_out is not None:
        rounded = ran_out.group(3)   # "(rounded to N)": the exact bytes the BFC allocator wanted
        d.numbers.setdefault("requested", int(rounded) if rounded else _to_bytes(ran_out.group(1), ran_out.group(2)))
    dev = _F_TF_DEVICE.search(span)
    if dev is not None:
        d.details["device"] = f"{dev.group(1).upper()}:{dev.group(2)}"
        if dev.group(1).upper() == "GPU":
            d.gpus.append(int(dev.group(2)))
    if "thecallerindicatesthatthisisnotafailure" in span[:600].lower():
        d.details["severity"] = "warning (the caller indicates this is not a failure)"
    alloc = _F_TF_ALLOCATOR.search(span)
    if alloc is not None:
        d.details["allocator"] = alloc.group(1)
        gpu = re.match(r"GPU_(\d+)_bfc", alloc.group(1), re.I)
        if gpu and not d.gpus:
            d.gpus.append(int(gpu.group(1)))
    d.sig = (d.gpus[0] if d.gpus else d.details.get("device"),)
    return d


def _x_jax(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.JAX_OOM)
    req = _F_JAX_REQ.search(span)
    if req is not None:
        d.numbers["requested"] = int(req.group(3)) if req.group(3) else _to_bytes(req.group(1), req.group(2))
    for name, rx in (("total_allocation", _F_JAX_TOTAL), ("temp_allocation", _F_JAX_TEMP),
                     ("parameter_allocation", _F_JAX_PARAM)):
        value = _size(rx, span)
        if value is not None:
            d.numbers[name] = value
    if "TPU" in m.group(0).upper() or "memoryspace" in m.group(0).lower():
        d.details["where"] = "XLA compilation (TPU memory space)"
    d.sig = (d.numbers.get("requested"),)
    return d


def _x_cpu(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.CPU_OOM)
    text = m.group(0)
    raw = _F_CPU_BYTES.search(span)
    gb = _F_CPU_GB.search(span)
    npy = _F_NUMPY.search(span)
    if raw is not None:
        d.numbers["requested"] = int(raw.group(1))
        d.details["source"] = "PyTorch DefaultCPUAllocator"
    elif gb is not None:
        d.numbers["requested"] = int(gb.group(1)) * GiB
        d.details["source"] = "old PyTorch TH allocator"
    elif npy is not None:
        d.numbers["requested"] = _to_bytes(npy.group(1), npy.group(2))
        d.details["source"] = "NumPy"
        d.details["shape"] = "(" + npy.group(3) + ")"
        d.details["dtype"] = npy.group(4)
    elif "bad_alloc" in text:
        d.details["source"] = "C++ std::bad_alloc"
    elif "errno12" in text.lower():
        d.details["source"] = "OS refused memory (errno 12, e.g. fork of DataLoader workers)"
    else:
        d.details["source"] = "Python MemoryError"
    d.sig = (d.numbers.get("requested"), d.details["source"])
    return d


def _x_simple(kind: Kind, variant_key: str | None = None):
    def extract(span: str, pre: str, m: re.Match) -> _Draft:
        d = _Draft(kind)
        if variant_key:
            d.details[variant_key] = m.group(0)
        d.sig = ()
        return d
    return extract


def _x_oom_killer(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.OOM_KILLER)
    text = m.group(0).lower()
    if "exitcode" in text and "137" not in text or "signal9" in text or "sigkill" in text or "returncode" in text:
        d.details["source"] = "launcher reported SIGKILL (exit code -9)"
    elif "outofmemory:kill" in text:
        d.details["source"] = "kernel log (dmesg)"
    elif "oom" in text:
        d.details["source"] = "scheduler/container OOM kill (Slurm/Kubernetes)"
    else:
        d.details["source"] = "exit status 137 (128 + SIGKILL)"
    _add_torchrun_rank(d, span)
    d.sig = ()
    return d


def _add_torchrun_rank(d: _Draft, span: str) -> None:
    """The failing rank from torchrun's failure report ("rank : 2 (local_rank" or "local_rank: 2")."""
    rank = _F_RANK_TORCHRUN.search(span)
    if rank is not None:
        d.ranks.append(int(rank.group(1) or rank.group(2)))


def _x_shm(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.SHARED_MEMORY)
    if m.group(0).lower().startswith("exitcode"):
        d.details["signal"] = "SIGBUS (torchrun exitcode -7)"
        _add_torchrun_rank(d, span)
    # NCCL: "Call to shm_open failed : Permission denied", then "Error while creating shared
    # memory segment": /dev/shm is not writable, which is not the same as full.
    if re.search(r"shm_open(?:failed)?:?Permissiondenied|/dev/shm.{0,40}Permissiondenied",
                 pre + span[:400], re.I):
        d.details["reason"] = "permission denied"
    elif m.group(0).lower().startswith("unabletoopen"):
        d.details["reason"] = "cannot open"
    d.sig = ()
    return d


def _x_dataloader(span: str, pre: str, m: re.Match) -> _Draft:
    sig = _F_DL_SIGNAL.search(span[:200])
    signal = sig.group(1) if sig else None
    if signal and signal.lower() == "buserror":
        d = _Draft(Kind.SHARED_MEMORY)
        d.details["signal"] = "Bus error"
        d.sig = ()
    else:
        d = _Draft(Kind.DATALOADER_KILLED)
        d.details["signal"] = {"killed": "Killed", "segmentationfault": "Segmentation fault"}.get(
            (signal or "").lower(), signal or "exited unexpectedly")
        d.sig = (d.details["signal"],)
    pids = _F_DL_PIDS.search(span)
    if pids:
        d.details["worker_pids"] = pids.group(1)
    return d


def _x_missing_env(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.MISSING_LAUNCH_ENV)
    var = _F_ENV_VAR.search(m.group(0))
    d.details["variable"] = var.group(1) if var else "RANK"
    d.sig = (d.details["variable"],)
    return d


def _x_ordinal(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.INVALID_DEVICE_ORDINAL)
    des = _F_DESERIALIZE.search(m.group(0))
    if des:
        d.numbers["device"] = int(des.group(1))
        d.numbers["device_count"] = int(des.group(2))
        d.details["source"] = "torch.load of a checkpoint saved on another GPU"
    d.sig = (d.details.get("source"),)
    return d


def _x_nccl(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.NCCL_TIMEOUT)
    rank_m = list(_F_RANK_IN_TEXT.finditer(pre[-80:]))
    rank = int(rank_m[-1].group(1)) if rank_m else None
    w = _F_NCCL.search(span)
    if w:
        c = Collective(rank, int(w.group(1)) if w.group(1) else None, w.group(2).upper(),
                       int(w.group(3)) if w.group(3) else None, int(w.group(4)), int(w.group(5)))
        d.collectives.append(c)
        d.numbers["timeout_ms"] = c.timeout_ms
        d.numbers["elapsed_ms"] = c.elapsed_ms
    if rank is not None:
        d.ranks.append(rank)
    d.sig = ()
    return d


def _x_port(kind: Kind):
    def extract(span: str, pre: str, m: re.Match) -> _Draft:
        d = _Draft(kind)
        ports = _F_PORT.findall(pre[-120:] + span[:300])
        if ports:
            d.numbers["port"] = int(ports[0])
        d.sig = (d.numbers.get("port"),)
        return d
    return extract


def _x_p2p(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.P2P)
    d.details["message"] = m.group(0)
    d.sig = ()
    return d


def _x_assert(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.DEVICE_ASSERT)
    a = _F_ASSERT.search(pre + span)
    if a:
        d.details["assertion"] = a.group(1)
    d.sig = ()
    return d


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
    Kind.ILLEGAL_MEMORY_ACCESS: _x_simple(Kind.ILLEGAL_MEMORY_ACCESS),
    Kind.DEVICE_ASSERT: _x_assert,
    Kind.MISALIGNED_ADDRESS: _x_simple(Kind.MISALIGNED_ADDRESS),
}


# --- diagnosis -------------------------------------------------------------------------------

_F = format_bytes

# Costs order fixes that buy the same: 0 free, 1 a little slower or a code change,
# 2 real setup work or a quality risk, 3 much slower.
_SPEED_NONE = "none"
_QUALITY_NONE = "none"

# The CUDA context and loaded kernels live outside the allocator: "hundreds of MiB to ~1.3 GiB
# depending on GPU, driver, CUDA version and lazy loading" (docs/allocator.md; HF-0: 1343 MB on a
# V100). Memory outside the allocator beyond this margin is something else.
_CONTEXT_MARGIN = 1536 * MiB

# Bytes per trainable parameter for weights + gradients + AdamW state: 4+4+8 in fp32, 2+2+12 with
# bf16/fp16 mixed precision and fp32 master weights - 16 either way (ZeRO, Rajbhandari et al.
# 2020, arXiv:1910.02054, section 3.1). Frozen parameters: weights only, assumed 16-bit.
_STATE_BYTES_TRAINABLE = 16
_STATE_BYTES_FROZEN = 2
# AdamW keeps 8 B/param of state, 8-bit Adam 2 B/param (docs/ground-truth.md, "Analytic pieces").
_ADAM8BIT_SAVING = 6


@dataclass
class _Ctx:
    facts: dict[str, int]
    world: int | None
    kinds: set[Kind]
    memory_ranks: list[int]


class _Out:
    """Collects one finding's diagnosis, fixes, notes and derived numbers."""

    def __init__(self) -> None:
        self.diagnosis: list[Diagnosis] = []
        self.notes: list[str] = []
        self.derived: dict[str, int] = {}
        self.shortfall: int | None = None
        self._fixes: dict[str, tuple[Fix, int, bool, int]] = {}

    def diag(self, cause: str, text: str) -> None:
        if all(d.cause != cause for d in self.diagnosis):
            self.diagnosis.append(Diagnosis(cause, text))

    def fix(self, fid: str, title: str, effect: int | None, bound: str | None, speed: str, quality: str,
            detail: str, cost: int, primary: bool = False) -> None:
        if fid in self._fixes:
            return
        if effect is not None and effect <= 0:
            effect, bound = None, None
        self._fixes[fid] = (Fix(fid, title, effect, bound if effect is not None else None, speed, quality, detail),
                            cost, primary, len(self._fixes))

    def ranked(self) -> tuple[Fix, ...]:
        """Fixes for the diagnosed cause first (unless their known effect falls short of what is
        missing), then fixes that cover the shortfall, then the rest by what they are expected to
        buy; ties go to the cheaper fix."""
        need = self.shortfall if self.shortfall and self.shortfall > 0 else None

        def key(item: tuple[Fix, int, bool, int]) -> tuple:
            fix, cost, primary, order = item
            eff = fix.effect_bytes
            enough = eff is None or need is None or eff >= need
            if primary and enough:
                group = 0
            elif eff is not None and need is not None and eff >= need:
                group = 1
            elif eff is not None:
                group = 2
            else:
                group = 3
            if group == 3:
                return (group, cost, order)
            return (group, -_expected(fix), cost, order)

        return tuple(item[0] for item in sorted(self._fixes.values(), key=key))

    def ordered_diagnosis(self) -> tuple[Diagnosis, ...]:
        """The most explanatory cause first; phase remarks and side observations last."""
        return tuple(sorted(self.diagnosis, key=lambda d: _CAUSE_ORDER.get(d.cause, 50)))


# Causes in the order they explain an error: one that makes the others moot comes first.
_CAUSE_ORDER = {name: i for i, name in enumerate((
    "consequence_of_oom", "windows_shared_memory_spill", "request_absurd", "request_exceeds_capacity", "model_states_exceed_card",
    "memory_fraction_limit", "other_process", "evaluation_without_no_grad", "invisible_process",
    "outside_allocator", "non_pytorch_memory", "gpu_full_at_start", "all_ranks_on_one_gpu", "fragmentation",
    "free_but_unusable", "huge_single_allocation", "model_or_batch_too_big", "card_full",
    "container_pid_namespace",
))}


def _expected(fix: Fix) -> float:
    """What a fix is expected to buy, for ranking: an upper bound ("up to") is often not reached
    and a lower bound ("at least") is often exceeded, so they are weighted accordingly."""
    if fix.effect_bytes is None:
        return 0.0
    return fix.effect_bytes * {"up to": 0.5, "at least": 1.5}.get(fix.effect_bound or "", 1.0)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "?"


def _where(d: _Draft) -> str:
    return f"GPU {d.gpus[0]}" if d.gpus else "the GPU"


def _training_phase(phase: Phase | None) -> bool:
    return phase in (None, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER_STEP)


def _model_states(ctx: _Ctx) -> tuple[int | None, int | None]:
    trainable = ctx.facts.get("trainable_params")
    total = ctx.facts.get("total_params")
    if trainable is None:
        trainable = total
    if trainable is None:
        return None, None
    frozen = total - trainable if total is not None and total > trainable else 0
    return trainable, _STATE_BYTES_TRAINABLE * trainable + _STATE_BYTES_FROZEN * frozen


def _batch_title(ctx: _Ctx) -> str:
    b, g = ctx.facts.get("batch_size"), ctx.facts.get("grad_accum")
    if b and b >= 2:
        return (f"Halve the micro-batch ({b} -> {b // 2}) and double gradient accumulation "
                f"({g or 1} -> {2 * (g or 1)})")
    return "Halve the micro-batch and double gradient accumulation steps"


def _size_fixes(out: _Out, d: _Draft, ctx: _Ctx, phase: Phase | None, act: int | None,
                trainable: int | None, states: int | None, env: str, multi_gpu: bool = True) -> None:
    """The remedies for 'the model and batch do not fit', each with what it buys when known."""
    req = d.numbers.get("requested")
    if ctx.facts.get("batch_size") == 1:
        out.fix("shorter_inputs", "The micro-batch is already 1: shorten the inputs (max sequence length, image "
                "resolution, crop size) or pack shorter samples", None, None, "faster",
                "changes what the model sees; truncation may hurt long-context quality",
                "Activation memory scales with sequence length (attention without a fused kernel with its "
                "square).", cost=2)
        act_half = None
    else:
        act_half = True
    batchy = phase in (Phase.FORWARD, Phase.BACKWARD, Phase.EVALUATION)
    if act is not None:
        eff, bound = act // 2, "about"
        why = f"activations are about {_F(act)} here (allocated minus the model states) and scale with the batch"
    elif batchy and req is not None:
        eff, bound = req // 2, "at least"
        why = (f"the failing {_F(req)} tensor is an activation of this {phase.value if phase else 'step'} and "
               "halves with the batch, as do all the other activations")
    else:
        eff, bound, why = None, None, "activation memory scales with the micro-batch"
    if act_half:
        out.fix("halve_micro_batch", _batch_title(ctx), eff, bound,
                "slightly slower per sample (smaller kernels), same number of optimizer steps",
                "none: the effective batch is unchanged (BatchNorm sees half as many samples per step)",
                f"Frees about half of the activation memory: {why}. Keep micro_batch x accumulation_steps x "
                "GPUs constant and the learning rate needs no change. Halving the batch *without* accumulation "
                "also works but changes training (noisier gradients; retune the learning rate).", cost=1)
    amp_on = any("autocast" in f.code or "GradScaler" in f.code or ".half()" in f.code for f in d.frames)
    if amp_on:
        out.notes.append("The traceback shows autocast/half precision already in use, so mixed precision is "
                         "not offered as a fix.")
    else:
        out.fix("mixed_precision", "Train with mixed precision: torch.autocast(dtype=torch.bfloat16) "
                "(or float16 + torch.amp.GradScaler)", act // 2 if act is not None else None, "about",
                "faster on tensor-core GPUs (RTX 20xx/30xx/40xx, A100, H100)",
                "practically none (bf16 needs no loss scaling; fp16 needs GradScaler)",
                "Saved activations are stored in 16 bit instead of 32, roughly halving them, if the model runs "
                "in fp32 today. Weights, gradients and optimizer state stay fp32, so this does not shrink the "
                "model states.", cost=0)
    if phase is not Phase.EVALUATION:
        out.fix("activation_checkpointing", "Activation (gradient) checkpointing: torch.utils.checkpoint, "
                "or model.gradient_checkpointing_enable() in transformers", act, "up to",
                "about 20-30% slower (the forward is recomputed during backward)", _QUALITY_NONE,
                "Keeps only each checkpointed block's input and recomputes the rest in backward, so the saved "
                "activations shrink from all layers' to roughly one layer's worth.", cost=1)
    if _training_phase(phase):
        eff = _ADAM8BIT_SAVING * trainable if trainable else None
        out.fix("lighter_optimizer", "Lighter optimizer state: 8-bit AdamW (bitsandbytes) or Adafactor; "
                "and foreach=False on torch.optim", eff, "about", "about the same",
                "8-bit AdamW: near-identical in practice; Adafactor or plain SGD: retune the learning rate",
                "AdamW keeps 8 bytes of state per parameter, 8-bit AdamW 2. With foreach=True (the CUDA "
                "default) step() also holds about one parameter-sized set of temporaries; foreach=False avoids "
                "them at a small speed cost." + ("" if trainable else
                " The log does not print the parameter count, so the saving is not computed."),
                cost=1, primary=phase is Phase.OPTIMIZER_STEP)
        if not multi_gpu:
            return
        n = ctx.world if ctx.world and ctx.world >= 2 else 2
        eff = states - states // n if states else None
        cap = d.numbers.get("capacity")
        need = ""
        if states and cap and states // n > cap * 3 // 4:
            # Leave a quarter of each card for activations, the CUDA context and workspaces.
            n_min = -(-states // (cap * 3 // 4))
            need = (f" With {n} GPUs each still holds {_F(states // n)}: the states alone need at least {n_min} "
                    f"cards of {_F(cap)} with ZeRO-3/FSDP, or CPU offload.")
        out.fix("shard_model_states", "Shard weights, gradients and optimizer state across GPUs: FSDP "
                "(torch.distributed.fsdp) or DeepSpeed ZeRO-2/3", eff, "about",
                "slower: extra all-gather/reduce-scatter traffic every step (worse without NVLink)", _QUALITY_NONE,
                f"Each GPU keeps about 1/{n} of the model states instead of all of them"
                + (f" ({_F(states)} in total from the parameter count in this log)" if states else "")
                + (f"; {n} GPUs assumed" if not ctx.world else "")
                + "." + need + " DDP does not do this: it replicates the whole model on every GPU. CPU offload of "
                "the optimizer state (ZeRO-Offload) frees more, much more slowly.", cost=2,
                primary=bool(states and d.numbers.get("capacity") and states > d.numbers["capacity"] * 0.9))


def _empty_cache_note(out: _Out) -> None:
    out.notes.append(
        "torch.cuda.empty_cache() is not a fix: before raising this error the caching allocator already "
        "released its unused cached blocks and retried (c10/cuda/CUDACachingAllocator.cpp, the malloc retry "
        "path), so emptying the cache frees nothing the failed step could have used.")


def _phase_diag(out: _Out, phase: Phase | None, no_grad: bool, d: _Draft, act: int | None) -> None:
    if phase is Phase.FORWARD:
        out.diag("phase_forward", "It failed in the forward pass: the activations kept for backward grow with "
                 "batch size and sequence length/resolution, so the batch-shaped fixes below apply directly.")
    elif phase is Phase.BACKWARD:
        out.diag("phase_backward", "It failed in backward: the saved activations of the whole forward are alive "
                 "and gradients are being allocated on top. Checkpointing and mixed precision shrink the saved "
                 "activations; gradient accumulation with a smaller micro-batch does too.")
    elif phase is Phase.OPTIMIZER_STEP:
        out.diag("phase_optimizer_step", "It failed in optimizer.step(): Adam-type optimizers allocate their two "
                 "state tensors (8 bytes per parameter) lazily at the first step, and the foreach implementation "
                 "adds about one parameter-sized set of temporaries. The batch size barely matters here; the "
                 "optimizer state and the model size do.")
    elif phase is Phase.EVALUATION:
        if no_grad:
            out.diag("phase_evaluation", "It failed during evaluation/inference: activations of the evaluation "
                     "batch (or of generation with a long sequence) did not fit; a smaller evaluation batch helps.")
        else:
            out.diag("evaluation_without_no_grad", "It failed during evaluation/inference and no torch.no_grad() "
                     "or torch.inference_mode() is visible in the traceback: if autograd is on, every layer's "
                     "activations are kept for a backward pass that never comes. (If the call is wrapped outside "
                     "the traceback, this does not apply.)")
            out.fix("evaluation_no_grad", "Run evaluation under torch.inference_mode() (or torch.no_grad()) and "
                    "model.eval()", act if act is not None else d.numbers.get("allocated"), "up to", "faster",
                    _QUALITY_NONE,
                    "Without autograd no activation is kept after its layer, so evaluation needs only the "
                    "largest single layer's working memory.", cost=0, primary=True)
    elif phase is Phase.DATA_LOADING:
        out.diag("phase_data_loading", "It failed while loading data: a Dataset, collate_fn or the pin-memory "
                 "thread created CUDA tensors. Every DataLoader worker that touches CUDA creates its own CUDA "
                 "context and copies.")
        out.fix("data_on_cpu", "Keep Dataset/collate_fn on the CPU; move each batch with .to(device, "
                "non_blocking=True) in the training loop (pin_memory=True in the DataLoader)", None, None,
                _SPEED_NONE, _QUALITY_NONE, "CUDA work in worker processes costs a CUDA context per worker and "
                "duplicates tensors; the training loop is the one place batches should reach the GPU.",
                cost=0, primary=True)
    elif phase is Phase.MODEL_LOADING:
        out.diag("phase_model_loading", "It failed while loading or moving the model to the GPU: the weights "
                 "themselves (plus whatever else is on the card) do not fit - batch size is irrelevant here.")


def _load_fixes(out: _Out, ctx: _Ctx) -> None:
    total = ctx.facts.get("total_params")
    out.fix("half_precision_weights", "Load the weights in bf16/fp16 (torch_dtype=torch.bfloat16), or "
            "8/4-bit with bitsandbytes for inference/QLoRA", 2 * total if total else None, "about",
            "same or faster", "bf16: practically none; 8/4-bit: small, task dependent",
            "fp32 weights take 4 bytes per parameter, bf16 2, 4-bit about 0.5.", cost=1, primary=True)
    n = ctx.world or 2
    out.fix("split_model", "Split the model across GPUs: device_map=\"auto\" (accelerate) or pipeline/tensor "
            "parallelism", (4 * total - 4 * total // n) if total else None, "about",
            "slower than one big GPU (layers run one GPU after another)", _QUALITY_NONE,
            f"Each of {n} GPUs holds about 1/{n} of the layers. This is model parallelism - unlike DDP, which "
            "needs the whole model on every GPU.", cost=2, primary=True)


@dataclass
class _TorchNums:
    """The figures of one PyTorch allocator message, with the gaps each version leaves filled in."""

    req: int | None
    cap: int | None
    free: int | None
    alloc: int | None
    reserved: int | None
    unalloc: int | None
    this: int | None
    limit: int | None
    fmt: str
    env: str
    where: str

    @property
    def sentence(self) -> bool:
        return self.fmt.startswith("torch>=") or self.fmt == "torch 2.1"

    @property
    def spill(self) -> bool:
        return self.cap is not None and max(self.alloc or 0, self.reserved or 0) > self.cap * 1.02


def _torch_numbers(d: _Draft, out: _Out) -> _TorchNums:
    n = d.numbers
    alloc, pools, fmt = n.get("allocated"), n.get("private_pools", 0), d.details.get("format", "")
    reserved, unalloc = n.get("reserved"), n.get("reserved_unallocated")
    if reserved is None and alloc is not None and unalloc is not None:
        # <= 1.4: "cached" is held by the allocator but unused (docs/oom-formats.md);
        # >= 2.1: reserved = allocated + private pools + reserved-but-unallocated.
        reserved = alloc + unalloc + (0 if fmt == "torch<=1.4" else pools)
        out.derived["reserved"] = reserved
    if unalloc is None and reserved is not None and alloc is not None:
        unalloc = max(0, reserved - alloc - pools)
        out.derived["reserved_unallocated"] = unalloc
    env = d.details.get("alloc_conf_env") or \
        ("PYTORCH_HIP_ALLOC_CONF" if d.kind is Kind.HIP_OOM else "PYTORCH_CUDA_ALLOC_CONF")
    return _TorchNums(n.get("requested"), n.get("capacity"), n.get("free"), alloc, reserved, unalloc,
                      n.get("this_process"), n.get("limit"), fmt, env, _where(d))


def _diag_torch(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    """PyTorch caching-allocator OOM (CUDA or HIP), every message version."""
    t = _torch_numbers(d, out)
    trainable, states = _model_states(ctx) if _training_phase(phase) else (None, None)
    act = None
    if states is not None:
        out.derived["model_states"] = states
        if t.alloc is not None and phase in (Phase.FORWARD, Phase.BACKWARD) and t.alloc > states:
            act = t.alloc - states
            out.derived["activations"] = act
    if t.req is not None and t.free is not None:
        out.shortfall = max(0, t.req - t.free)
    _diag_spill(t, out)
    _diag_request_size(t, out)
    _diag_fraction(t, out)
    _diag_model_states(t, out, trainable, states)
    if not t.spill:
        _diag_other_memory(d, out, t.cap, t.free, t.reserved, t.this, t.req, t.where, t.sentence)
        _diag_free_but_unusable(t, out)
    _diag_fragmentation(t, out)
    _diag_capacity(t, out, cut_at_gpu=d.details.get("format") == _CUT_AT_GPU)
    if out.shortfall:
        out.derived["shortfall"] = out.shortfall
    _phase_diag(out, phase, no_grad, d, act)
    if phase is Phase.MODEL_LOADING:
        _load_fixes(out, ctx)
    else:
        _size_fixes(out, d, ctx, phase, act, trainable, states, t.env)
    if len(d.ranks) > 1 or (ctx.world or 1) > 1:
        out.notes.append("DDP replicates the whole model on every GPU: adding GPUs with DDP lowers the per-GPU "
                         "batch needed for a given global batch, never the per-GPU memory of the model itself.")
    _empty_cache_note(out)


def _diag_spill(t: _TorchNums, out: _Out) -> None:
    if not t.spill or t.cap is None:
        return
    held = max(t.alloc or 0, t.reserved or 0)
    out.shortfall = held + (t.req or 0) - t.cap
    out.diag("windows_shared_memory_spill",
             f"The message says PyTorch holds {_F(held)} on a {_F(t.cap)} card - more than the card has. The "
             "Windows (WDDM) driver spills GPU allocations into shared system memory, so these numbers do not "
             f"add up and the run was already crawling before it failed. Treat {_F(t.cap)} as the real limit: "
             f"about {_F(out.shortfall)} has to go.")


def _diag_request_size(t: _TorchNums, out: _Out) -> None:
    """A request larger than the card, or a large share of it: the tensor itself is the problem."""
    req, cap = t.req, t.cap
    if req is None or not cap:
        return
    if req > cap:
        if req >= 4 * cap:
            text = (f"The request alone is {_F(req)}, {req / cap:.0f}x the whole {_F(cap)} card. That is almost "
                    "always a shape mistake (an accidental broadcast, a wrong reshape, attention over a far "
                    "longer sequence than intended), not a memory shortage.")
        else:
            text = (f"A single {_F(req)} allocation is larger than the whole {_F(cap)} card: no allocator "
                    "setting, cache flush or other process can make it fit. The tensor itself must shrink.")
        out.diag("request_exceeds_capacity", text)
        out.fix("shrink_failing_tensor", "Make the failing tensor smaller: fewer samples per micro-batch, "
                "shorter sequences or smaller images, or compute that op in chunks (e.g. attention with "
                "F.scaled_dot_product_attention, sliced/tiled decoding)", req - cap + (t.free or 0), "at least",
                "chunking: slightly slower", "none when chunking; shorter inputs change the task",
                f"It must come down from {_F(req)} to well under {_F(cap)}.", cost=1, primary=True)
    elif req >= cap // 2:
        out.diag("huge_single_allocation",
                 f"A single allocation of {_F(req)} is {_pct(req, cap)} of the card: one huge activation "
                 "(typically attention scores batch x heads x seq x seq, or a large feature map). Chunking that "
                 "op or memory-efficient attention (F.scaled_dot_product_attention) helps most.")


def _diag_fraction(t: _TorchNums, out: _Out) -> None:
    limit, cap = t.limit, t.cap
    if limit is None or not cap or limit >= cap * 0.98 or t.req is None:
        return
    rounding = limit // 200 + 16 * MiB     # every figure in the message is rounded to 0.01 units
    if t.reserved is None or t.reserved + t.req > limit - rounding:
        out.diag("memory_fraction_limit",
                 f"This process is capped at {_F(limit)} ('allowed') by torch.cuda.set_per_process_memory_"
                 f"fraction, below the card's {_F(cap)}"
                 + (f"; the GPU still had {_F(t.free)} free" if t.free else "") + ".")
        out.fix("raise_memory_fraction", "Raise or remove torch.cuda.set_per_process_memory_fraction()",
                cap - limit, "up to", _SPEED_NONE, _QUALITY_NONE,
                "The cap is a software limit this process set on itself.", cost=0, primary=True)


def _diag_model_states(t: _TorchNums, out: _Out, trainable: int | None, states: int | None) -> None:
    if states is None or trainable is None or not t.cap or states <= t.cap * 0.9:
        return
    out.diag("model_states_exceed_card",
             f"The log reports {trainable:,} trainable parameters: weights, gradients and AdamW state alone take "
             f"about {_F(states)} (16 bytes per trainable parameter, fp32 or bf16 mixed precision; ZeRO paper "
             f"section 3.1), against a {_F(t.cap)} card. With activations on top, no batch size fits. DDP would "
             "not help - every DDP rank holds all of it. Shard it (FSDP / DeepSpeed ZeRO-3) or split the model.")
    # What must go is at least the states' excess plus this request, not just this request.
    out.shortfall = max(out.shortfall or 0, states + (t.req or 0) - t.cap)


def _near_full(t: _TorchNums) -> bool:
    """Free memory barely above the request: cudaMalloc needs headroom beyond the bytes asked
    for (2 MiB page granularity, driver bookkeeping), so the card is effectively full."""
    return (t.req is not None and t.free is not None and t.req <= t.free
            and t.free - t.req < max(128 * MiB, (t.cap or 0) // 100))


def _diag_free_but_unusable(t: _TorchNums, out: _Out) -> None:
    req, free = t.req, t.free
    if (req is not None and free is not None and free >= req and t.unalloc is not None and t.unalloc < req
            and "memory_fraction_limit" not in [x.cause for x in out.diagnosis]):
        if _near_full(t):
            out.diag("card_full",
                     f"Only {_F(free)} was free, {_F(free - req)} more than the {_F(req)} requested: "
                     "cudaMalloc needs headroom beyond the request (page granularity, driver "
                     "bookkeeping), so the GPU was effectively full.")
            return
        out.diag("free_but_unusable",
                 f"The driver reported {_F(free)} free, more than the {_F(req)} requested, yet cudaMalloc failed: "
                 "the free memory is not usable in one piece. On Windows (WDDM) the driver reserves part of it; "
                 "on shared or virtualised GPUs (MIG, vGPU) the limit is lower than the card.")


def _diag_fragmentation(t: _TorchNums, out: _Out) -> None:
    unalloc, req, free = t.unalloc, t.req, t.free
    if unalloc is None or unalloc < 64 * MiB or t.spill:
        return
    # After a failed cudaMalloc the allocator frees every unsplit cached block and retries
    # (docs/allocator.md, "Malloc order"), so what stays reserved-but-unallocated is pieces of
    # partly used segments: fragmentation, which is what these two settings address.
    fits = req is not None and free is not None and free < req <= unalloc + free
    share = unalloc / t.reserved if t.reserved else 0
    if fits or (share >= 0.2 and unalloc >= 512 * MiB):
        out.diag("fragmentation",
                 f"{_F(unalloc)} ({_pct(unalloc, t.reserved or 0)} of the {_F(t.reserved or 0)} PyTorch has "
                 "reserved) is reserved but unallocated: cached blocks too fragmented to serve the request"
                 + (f"; the {_F(req)} request would have fit if that memory were contiguous." if fits else "."))
    primary = "fragmentation" in [x.cause for x in out.diagnosis]
    if t.fmt in ("torch<=1.4", "torch 1.5-2.0"):
        out.fix("max_split_size_mb", f"Set {t.env}=max_split_size_mb:128 (or upgrade to torch >= 2.2 and use "
                "expandable_segments:True)", unalloc, "up to", "none to slight", _QUALITY_NONE,
                "Blocks of at least max_split_size_mb are never split, so large cached blocks stay whole for "
                "large requests (docs/allocator.md).", cost=0, primary=primary)
    else:
        out.fix("expandable_segments", f"Set {t.env}=expandable_segments:True before the process starts",
                unalloc, "up to", _SPEED_NONE, _QUALITY_NONE,
                "Segments grow in place instead of being carved into fixed blocks, so reserved-but-unallocated "
                "memory becomes usable for the next request. It does not help the cudaMallocAsync backend.",
                cost=0, primary=primary)


def _diag_capacity(t: _TorchNums, out: _Out, cut_at_gpu: bool = False) -> None:
    """The default: PyTorch's own tensors fill the card."""
    causes = {x.cause for x in out.diagnosis}
    req, free, alloc, cap = t.req, t.free, t.alloc, t.cap
    short = free is None or req is None or req > free or _near_full(t)
    if (alloc is not None and cap and not t.spill and short
            and not causes & {"request_exceeds_capacity", "memory_fraction_limit"}
            and (alloc >= cap * 0.5 or not causes)):
        extra = f" and the step needed {_F(req)} more" if req is not None else ""
        if req is not None and free is not None and req > free:
            extra += f" ({_F(req - free)} beyond what was free)"
        out.diag("model_or_batch_too_big",
                 f"PyTorch's own tensors occupy {_F(alloc)} of the {_F(cap)} card ({_pct(alloc, cap)}){extra}. "
                 "The model, its gradients and optimizer state and this batch's activations do not fit together; "
                 "the fixes below shrink one of them.")
    if not out.diagnosis:
        what = f"a {_F(req)} request" if req is not None else "an allocation"
        why = ("the message is truncated, so the numbers that would say why are missing. Paste the complete "
               "message for a full diagnosis." if cap is None else "the numbers point to no single cause.")
        if cap is None and cut_at_gpu:
            why = ("PyTorch itself cut the message after 'GPU': it streamed the device index as a raw byte, and "
                   "GPU 0 is a NUL that ends the text (pytorch/pytorch#123984, fixed in later releases). So it "
                   "is the first visible GPU, and the capacity, free and per-process figures were never printed; "
                   "torch.cuda.memory_summary() in an except handler shows them.")
        out.diag("out_of_memory", f"{t.where} could not serve {what}; {why}")


def _diag_other_memory(d: _Draft, out: _Out, cap: int | None, free: int | None, reserved: int | None,
                       this: int | None, req: int | None, where: str, sentence: bool) -> None:
    """Memory on the card that this process's allocator does not hold: other processes, the
    container PID-namespace look-alike, and non-PyTorch memory."""
    procs = list(d.processes)
    self_proc = None
    if this is None and procs and reserved is not None:
        # No "this process has" sentence: in a container NVML reports host PIDs, so this process
        # appears as "Process <pid>" - recognisable because it holds ~ its own reserved memory.
        candidates = [p for p in procs if reserved * 0.95 <= p.bytes <= reserved + _CONTEXT_MARGIN + GiB]
        if candidates:
            self_proc = min(candidates, key=lambda p: p.bytes - reserved)
            procs.remove(self_proc)
            out.diag("container_pid_namespace",
                     f"Process {self_proc.pid} ({_F(self_proc.bytes)}) matches this process's own reserved "
                     f"{_F(reserved)} plus the CUDA context, and the message has no 'this process has' sentence: "
                     "inside a container NVML reports host PIDs, so this is almost certainly this very process "
                     "seen through the PID namespace, not a competitor.")
    others = sum(p.bytes for p in procs)
    if others:
        out.derived["other_processes"] = others
    if others >= max(256 * MiB, (cap or 0) // 50):
        listing = ", ".join(f"PID {p.pid}: {_F(p.bytes)}" for p in procs[:6]) + (" ..." if len(procs) > 6 else "")
        would = ""
        if req is not None and free is not None:
            would = (f" Without them this process would have had {_F(free + others)} free - "
                     + ("enough" if free + others >= req else "still not enough") + f" for the {_F(req)} request.")
        if len(procs) == 1:
            who = f"Another process (PID {procs[0].pid}) holds {_F(others)} on {where}."
        else:
            who = f"{len(procs)} other processes hold {_F(others)} on {where} ({listing})."
        out.diag("other_process", f"{who} That is the 'two trainings on one GPU' situation: each job sees only "
                 f"what the other leaves.{would}")
        out.fix("one_job_per_gpu", "Give each job its own GPU (CUDA_VISIBLE_DEVICES=0 for one, =1 for the "
                "other) or stop the other process", others, "about", "faster (no contention for compute either)",
                _QUALITY_NONE, "nvidia-smi lists who holds memory on which GPU. Two jobs on the same GPUs both "
                "run out of memory or both crawl.", cost=0, primary=True)
    if cap is None or free is None:
        return
    used = max(0, cap - free)
    if sentence:
        own = this if this is not None else (self_proc.bytes if self_proc else reserved)
        if own is None:
            return
        unexplained = used - own - others
        if this is not None and reserved is not None and this - reserved > _CONTEXT_MARGIN + GiB:
            non_pt = this - reserved
            out.derived["non_pytorch_in_process"] = non_pt
            out.diag("non_pytorch_memory",
                     f"This process holds {_F(non_pt)} outside PyTorch's allocator - far more than a CUDA context "
                     "(~0.3-1.3 GiB): NCCL buffers, cuDNN/cuBLAS workspaces, or another GPU library in the same "
                     "process (TensorFlow and JAX preallocate most of the card by default; CuPy, TensorRT).")
            out.fix("stop_preallocation", "Stop the other GPU library in this process from preallocating "
                    "(TF: tf.config.experimental.set_memory_growth; JAX: XLA_PYTHON_CLIENT_PREALLOCATE=false)",
                    non_pt - _CONTEXT_MARGIN, "up to", _SPEED_NONE, _QUALITY_NONE,
                    "Or load only one framework onto the GPU per process.", cost=0, primary=True)
        # "this process has" already counts this process's CUDA context, so anything beyond it
        # (a few hundred MiB tolerance for rounding and driver reservations) belongs to others.
        if unexplained > max(256 * MiB, cap // 10) and not others:
            out.derived["outside_allocator"] = unexplained
            out.diag("invisible_process",
                     f"{_F(unexplained)} of {where} is in use by something this message does not list: usually "
                     "another process that NVML cannot see from inside a container, or a display/desktop session "
                     "on the same GPU.")
            out.fix("find_gpu_users", "Find and stop what else uses the GPU (nvidia-smi on the host)",
                    unexplained, "up to", _SPEED_NONE, _QUALITY_NONE,
                    "Run nvidia-smi outside the container; a notebook kernel that still holds a model is a common "
                    "culprit.", cost=0, primary=True)
    elif reserved is not None:
        outside = used - reserved
        if outside > max(_CONTEXT_MARGIN, cap // 10):
            out.derived["outside_allocator"] = outside
            out.diag("outside_allocator",
                     f"{_F(outside)} of {where} is in use but not reserved by this process's PyTorch allocator. "
                     "The CUDA context explains only ~0.3-1.3 GiB; the rest is another process (two trainings "
                     "on the same GPU, a notebook kernel still holding a model) or non-PyTorch memory in this "
                     "process (cuDNN/NCCL workspaces, TensorFlow, TensorRT).")
            out.fix("find_gpu_users", "Find and stop what else uses the GPU (nvidia-smi), or run each job on its "
                    "own GPU with CUDA_VISIBLE_DEVICES", outside - 512 * MiB, "up to", _SPEED_NONE, _QUALITY_NONE,
                    "This message format (torch <= 2.0) does not list processes; nvidia-smi does.",
                    cost=0, primary=True)


def _diag_async(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    n = d.numbers
    req, cap, free, alloc = n.get("requested"), n.get("capacity"), n.get("free"), n.get("allocated")
    if req is not None and free is not None:
        out.shortfall = max(0, req - free)
        if out.shortfall:
            out.derived["shortfall"] = out.shortfall
    if req is not None and cap and req > cap:
        out.diag("request_exceeds_capacity", f"A single {_F(req)} allocation is larger than the {_F(cap)} device "
                 "limit: the tensor itself must shrink.")
    if cap is not None and free is not None and alloc is not None:
        outside = cap - free - alloc
        if outside > max(_CONTEXT_MARGIN, cap // 10):
            out.derived["outside_allocator"] = outside
            out.diag("outside_allocator", f"{_F(outside)} of the card is used by something other than this "
                     "process's PyTorch tensors: another process (two trainings on one GPU), another library in "
                     "this process, or memory cudaMallocAsync keeps in its pool.")
            out.fix("find_gpu_users", "Find and stop what else uses the GPU (nvidia-smi), or give each job its "
                    "own GPU with CUDA_VISIBLE_DEVICES", outside - 512 * MiB, "up to", _SPEED_NONE, _QUALITY_NONE,
                    "", cost=0, primary=True)
        if alloc >= cap // 2:
            out.diag("model_or_batch_too_big", f"PyTorch's tensors occupy {_F(alloc)} of the {_F(cap)} card "
                     f"({_pct(alloc, cap)}); the model, its optimizer state and the batch's activations do not fit.")
    if not out.diagnosis:
        out.diag("out_of_memory", "The cudaMallocAsync allocator could not get memory for this request.")
    if d.details.get("format") == _CUT_AT_DEVICE:
        out.notes.append("The message stops after 'Allocation on device': PyTorch streams the device index as a "
                         "raw byte, and device 0 is a NUL that ends the text (pytorch/pytorch#168369), so the "
                         "GPU is the first visible one and the request and free-memory figures were lost. ComfyUI "
                         "runs this backend by default; its --disable-cuda-malloc flag switches to the caching "
                         "allocator, whose OOM report keeps its numbers.")
    out.notes.append("This process uses the cudaMallocAsync backend (PYTORCH_CUDA_ALLOC_CONF="
                     "backend:cudaMallocAsync): expandable_segments and max_split_size_mb do not apply to it.")
    _phase_diag(out, phase, no_grad, d, None)
    trainable, states = _model_states(ctx) if _training_phase(phase) else (None, None)
    _size_fixes(out, d, ctx, phase, None, trainable, states, "PYTORCH_CUDA_ALLOC_CONF")
    _empty_cache_note(out)


def _diag_mps(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    n = d.numbers
    req, alloc, other, limit = n.get("requested"), n.get("allocated"), n.get("other_allocations"), n.get("limit")
    if None not in (req, alloc, other, limit):
        out.shortfall = max(0, alloc + other + req - limit)
        out.derived["shortfall"] = out.shortfall
        out.diag("mps_high_watermark",
                 f"PyTorch's MPS tensors ({_F(alloc)}) plus other Metal allocations of this process ({_F(other)}) "
                 f"plus the {_F(req)} request exceed the {_F(limit)} the MPS allocator allows itself (its high "
                 "watermark, a fraction of the Mac's unified memory, shared with macOS and every other app).")
        if other > alloc:
            out.diag("mps_other_allocations", f"'other allocations' ({_F(other)}) exceed PyTorch's own tensors: "
                     "memory held by Metal outside the MPS allocator - typically another model or pipeline "
                     "loaded in the same process.")
    else:
        out.diag("out_of_memory", "The MPS allocator reached its memory limit.")
    out.fix("mps_watermark", "Raise PYTORCH_MPS_HIGH_WATERMARK_RATIO (e.g. 1.0 -> higher; 0.0 removes the limit)",
            None, None, "may swap heavily and slow down the whole Mac", _QUALITY_NONE,
            "The limit protects macOS; lifting it lets PyTorch use swap-backed memory and can freeze the system. "
            "Close other apps first: unified memory is shared with them.", cost=3)
    _phase_diag(out, phase, no_grad, d, None)
    trainable, states = _model_states(ctx) if _training_phase(phase) else (None, None)
    _size_fixes(out, d, ctx, phase, None, trainable, states, "", multi_gpu=False)


def _diag_cuda_error(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    funcs = {f.func for f in d.frames}
    source = d.details.get("source", "")
    req = d.numbers.get("requested")
    if req is not None and req > _NO_GPU_HAS:
        out.diag("request_absurd", f"The request is {_F(req)} in one piece, more than any GPU has: a size bug "
                 "(a garbage or negative size read as unsigned, a wrong shape), not a memory shortage.")
        out.fix("find_bad_size", "Find the operation that asks for it and check the shapes/sizes passed to it "
                "(CUDA_LAUNCH_BLOCKING=1 makes PyTorch report the failing call; TensorFlow/JAX name the op in "
                "the error that follows)", None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0, primary=True)
        return
    if source.startswith("driver: pinned host"):
        out.diag("pinned_host_memory", "The CUDA driver could not page-lock (pin) "
                 + (f"{_F(req)} of " if req is not None else "") + "host RAM for fast host-GPU copies: it is the "
                 "machine's RAM (or the locked-memory limit) that ran short, not the GPU.")
        out.fix("free_host_ram", "Free host RAM (free -g; fewer data-pipeline workers and smaller prefetch/shuffle "
                "buffers); in a container raise the locked-memory limit: docker run --ulimit memlock=-1", None, None,
                _SPEED_NONE, _QUALITY_NONE, "", cost=0, primary=True)
        return
    if source.startswith("driver"):
        out.diag("framework_driver_oom", "The TensorFlow/XLA runtime could not get memory from the CUDA driver. "
                 "Both frameworks preallocate most of the GPU per process, so a second process (or PyTorch in the "
                 "same process) leaves too little.")
        out.fix("stop_preallocation", "Turn off preallocation: TF_FORCE_GPU_ALLOW_GROWTH=true (TensorFlow), "
                "XLA_PYTHON_CLIENT_PREALLOCATE=false (JAX)", None, None, "slightly slower allocation",
                _QUALITY_NONE, "Each process then takes only what it uses.", cost=0, primary=True)
        return
    early = bool(funcs & {"_lazy_init", "set_device", "init_process_group", "_cuda_init", "cuda", "_apply"}) \
        or phase is Phase.MODEL_LOADING or "context creation" in source
    if early:
        out.diag("gpu_full_at_start", "CUDA ran out of memory while initialising or moving the model, before "
                 "training allocated anything: the GPU was already (almost) full - another process holds it, or "
                 "several processes share one GPU.")
    else:
        out.diag("out_of_memory_no_numbers", "CUDA itself refused an allocation (inside a library kernel, a "
                 "CUDA context, or with caching disabled), so there is no allocator report with numbers. It is "
                 "still an out-of-memory error: the GPU was full at that moment.")
    multi = len(d.ranks) > 1 or (ctx.world or 1) > 1
    if multi:
        out.diag("all_ranks_on_one_gpu", "Several ranks report it: if torch.cuda.set_device(local_rank) is not "
                 "called before the first CUDA call, every rank creates its context (and its tensors) on GPU 0.")
        out.fix("set_device", "Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before any CUDA work "
                "and use device=f'cuda:{local_rank}'", None, None, _SPEED_NONE, _QUALITY_NONE,
                "Then each rank uses its own GPU; nvidia-smi should show one process per GPU.", cost=0, primary=True)
    out.fix("find_gpu_users", "Check what already holds the GPU: nvidia-smi (stop stray processes, one job per "
            "GPU with CUDA_VISIBLE_DEVICES)", None, None, _SPEED_NONE, _QUALITY_NONE,
            "A crashed run or an idle notebook kernel often still holds gigabytes.", cost=0, primary=early)
    out.notes.append("CUDA errors are reported asynchronously: rerun with CUDA_LAUNCH_BLOCKING=1 to see the "
                     "call that really failed.")
    _phase_diag(out, phase, no_grad, d, None)
    if phase is Phase.MODEL_LOADING:
        _load_fixes(out, ctx)
    else:
        trainable, states = _model_states(ctx) if _training_phase(phase) else (None, None)
        _size_fixes(out, d, ctx, phase, None, trainable, states, "PYTORCH_CUDA_ALLOC_CONF")
    _empty_cache_note(out)


def _diag_cublas(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    status = d.details.get("status", "")
    if "ALLOC_FAILED" in status:
        out.diag("library_alloc_failed", "cuBLAS could not allocate its handle/workspace, which happens on the "
                 "first matrix multiply on a stream: the GPU was already full at that moment. It is an "
                 "out-of-memory error reported without numbers.")
    elif d.details.get("driver_oom_follows"):
        out.diag("library_not_initialized_oom", "cuBLAS could not initialise because the GPU had no memory left "
                 "for its handle: the same log shows the driver refusing an allocation (CUDA_ERROR_OUT_OF_MEMORY). "
                 "An out-of-memory error, not a broken installation.")
    else:
        out.diag("library_not_initialized", "cuBLAS could not initialise: most often the GPU was already full "
                 "when its handle was created (an OOM in disguise); otherwise a CUDA/driver/PyTorch build mismatch.")
    if d.details.get("framework") == "TensorFlow":
        out.fix("stop_preallocation", "Stop TensorFlow from taking the whole GPU up front: "
                "TF_FORCE_GPU_ALLOW_GROWTH=true (or tf.config.experimental.set_memory_growth)", None, None,
                "slightly slower allocation", _QUALITY_NONE, "A second TensorFlow process (or a notebook kernel "
                "still holding the GPU) otherwise leaves nothing for the next one.", cost=0, primary=True)
    out.fix("find_gpu_users", "Check what already holds the GPU (nvidia-smi) and free it", None, None, _SPEED_NONE,
            _QUALITY_NONE, "", cost=0, primary=True)
    _phase_diag(out, phase, no_grad, d, None)
    trainable, states = _model_states(ctx) if _training_phase(phase) else (None, None)
    _size_fixes(out, d, ctx, phase, None, trainable, states, "")
    out.notes.append("Rerun with CUDA_LAUNCH_BLOCKING=1 to see the failing call.")


def _diag_cudnn(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    status = d.details.get("status", "")
    if "ALLOC_FAILED" in status or "NOT_ENOUGH_WORKSPACE" in status or "no valid" in status or "engine" in status:
        out.diag("cudnn_workspace", "cuDNN could not get memory for a convolution's workspace (or found no "
                 "algorithm that fits in the memory left): an out-of-memory error in disguise.")
        out.fix("cudnn_benchmark_off", "torch.backends.cudnn.benchmark = False", None, None,
                "convolutions may be slightly slower", _QUALITY_NONE,
                "benchmark=True tries workspace-hungry algorithms; off, cuDNN picks ones that need less memory.",
                cost=1)
    elif "NOT_SUPPORTED" in status:
        out.diag("cudnn_not_supported", "cuDNN rejected the convolution: usually an input too large for it (more "
                 "than 2^31 elements in one tensor, e.g. a large batch of big 3D volumes) or too little memory.")
    else:
        out.diag("cudnn_init", "cuDNN failed to initialise or hit an internal error: most often the GPU was "
                 "already full (an OOM in disguise); otherwise a cuDNN/CUDA version mismatch.")
    _phase_diag(out, phase, no_grad, d, None)
    trainable, states = _model_states(ctx) if _training_phase(phase) else (None, None)
    _size_fixes(out, d, ctx, phase, None, trainable, states, "")
    out.notes.append("Rerun with CUDA_LAUNCH_BLOCKING=1 to see the failing call.")


def _diag_tf(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    n = d.numbers
    req, limit, in_use = n.get("requested"), n.get("limit"), n.get("in_use")
    device = d.details.get("device", "")
    if device.startswith("CPU"):
        out.diag("host_memory", "TensorFlow ran out of host RAM on the CPU device, not GPU memory.")
    if d.details.get("severity", "").startswith("warning"):
        out.diag("tf_warning_only", "Only a warning: the BFC allocator could not get "
                 + (f"{_F(req)}" if req is not None else "the memory") + " for an optional workspace, and the "
                 "caller goes on without it (a slower algorithm); training continues. Act on it only if the run "
                 "is slow or a real OOM error follows.")
        out.fix("stop_preallocation", "If another process shares this GPU: TF_FORCE_GPU_ALLOW_GROWTH=true in "
                "both (TensorFlow takes almost the whole GPU per process by default)", None, None, _SPEED_NONE,
                _QUALITY_NONE, "", cost=0)
        return
    what = f"a tensor of shape {d.details['shape']} ({d.details.get('dtype', '?')}, {_F(req)})" \
        if "shape" in d.details and req is not None else (f"{_F(req)}" if req is not None else "a tensor")
    detail = f"TensorFlow's BFC allocator could not allocate {what}"
    if limit is not None and in_use is not None:
        detail += f" with {_F(in_use)} of its {_F(limit)} limit in use"
        if req is not None:
            out.shortfall = max(0, in_use + req - limit)
    out.diag("tf_out_of_memory", detail + ". The first dimension is usually the batch.")
    if req is not None and limit is not None and req > limit:
        out.diag("request_exceeds_capacity", f"The tensor alone ({_F(req)}) exceeds TensorFlow's whole "
                 f"{_F(limit)} limit: it must shrink (batch, image size, sequence length).")
    out.fix("halve_micro_batch", "Halve the batch size (keep the effective batch with gradient accumulation)",
            req // 2 if req is not None else None, "at least", "slightly slower per sample",
            "none with accumulation; otherwise retune the learning rate", "The failing tensor's first dimension "
            "is usually the batch.", cost=1)
    out.fix("mixed_precision", "Mixed precision: tf.keras.mixed_precision.set_global_policy('mixed_float16')",
            req // 2 if req is not None and d.details.get("dtype") in ("float", "float32") else None, "about",
            "faster on tensor-core GPUs", "practically none", "Activations are stored in 16 bit.", cost=0)
    out.fix("stop_preallocation", "If other processes (or PyTorch) share this GPU: "
            "tf.config.experimental.set_memory_growth(gpu, True) or TF_FORCE_GPU_ALLOW_GROWTH=true", None, None,
            _SPEED_NONE, _QUALITY_NONE, "TensorFlow grabs almost all GPU memory per process by default.", cost=0)


def _diag_jax(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    n = d.numbers
    req, total = n.get("requested"), n.get("total_allocation")
    if d.details.get("where"):
        out.diag("xla_compile_memory", "XLA ran out of an on-chip memory space while compiling for TPU: the "
                 "fused computation is too large; smaller batch or sharding over more cores.")
    else:
        out.diag("xla_out_of_memory", "XLA could not allocate " + (f"{_F(req)}" if req is not None else "a buffer")
                 + (f"; the compiled program needs {_F(total)} in total" if total is not None else "")
                 + ". By default JAX preallocates 75% of the GPU per process, so two JAX processes (or JAX next "
                 "to PyTorch/TensorFlow) on one GPU starve each other.")
    out.fix("halve_micro_batch", "Halve the batch (or shard it over more devices)", req // 2 if req else None,
            "at least", "slightly slower per sample", "none with gradient accumulation", "", cost=1)
    out.fix("remat", "Rematerialise activations with jax.checkpoint (jax.remat)", None, None,
            "about 20-30% slower", _QUALITY_NONE, "", cost=1)
    out.fix("xla_mem_fraction", "XLA_PYTHON_CLIENT_MEM_FRACTION=.95 (more of the GPU) or "
            "XLA_PYTHON_CLIENT_PREALLOCATE=false (when sharing the GPU)", None, None,
            "preallocate=false: slightly slower allocation", _QUALITY_NONE, "", cost=0)


def _diag_cpu(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    req = d.numbers.get("requested")
    if req is not None and req >= 256 * GiB:
        out.diag("request_absurd", f"The process asked for {_F(req)} of host RAM in one piece: far beyond any "
                 "machine, so this is a shape mistake (an accidental broadcast or outer product, a wrong reshape, "
                 "reading a length field as data) rather than a memory shortage.")
    else:
        out.diag("host_memory", "Host RAM (not GPU memory) ran out" + (f" on a {_F(req)} allocation" if req else "")
                 + ". Typical causes: a whole dataset loaded into RAM, every DataLoader worker or every DDP rank "
                 "holding its own copy, or a checkpoint materialised in RAM before moving to the GPU.")
    out.fix("load_lazily", "Load data lazily or memory-mapped (np.load(mmap_mode='r'), torch.load(mmap=True), "
            "from_pretrained(low_cpu_mem_usage=True))", None, None, _SPEED_NONE, _QUALITY_NONE,
            "Keeps only what is used in RAM; with DDP each rank would otherwise hold a full copy.", cost=1,
            primary=True)
    out.fix("fewer_workers", "Fewer DataLoader workers (num_workers) and a smaller prefetch_factor", None, None,
            "slower if data loading is the bottleneck", _QUALITY_NONE,
            "Each worker is a process; Python objects in the Dataset are copied into each one as they are read.",
            cost=1)


def _diag_paging(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    out.diag("windows_commit_limit", "Windows ran out of commit charge (RAM + paging file). On Windows every "
             "DataLoader worker is a new process that imports torch and maps the CUDA DLLs, committing a few GB "
             "each, so num_workers > 0 multiplies it - this often fails at 'import torch' in a worker.")
    out.fix("grow_paging_file", "Enlarge the paging file (System > Advanced > Performance > Virtual memory: "
            "system managed, or a larger custom size) and reboot", None, None, _SPEED_NONE, _QUALITY_NONE, "",
            cost=0, primary=True)
    out.fix("fewer_workers", "Lower DataLoader num_workers (try 2, or 0 to confirm)", None, None,
            "slower if data loading is the bottleneck", _QUALITY_NONE, "", cost=1, primary=True)


def _diag_oom_killer(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    out.diag("host_oom_killer", "The process was killed with SIGKILL (" + d.details.get("source", "") + "), which "
             "without an error message almost always means the Linux OOM killer or the job scheduler's memory "
             "limit: host RAM, not GPU memory, ran out. Confirm with `dmesg -T | grep -i oom` or the scheduler's "
             "accounting (sacct MaxRSS).")
    multi = len(d.ranks) > 1 or (ctx.world or 1) > 1
    out.fix("load_once", "Load the checkpoint once, memory-mapped (torch.load(mmap=True), "
            "from_pretrained(low_cpu_mem_usage=True)) or on the meta device" + (" - not a full copy per rank"
                                                                                if multi else ""),
            None, None, _SPEED_NONE, _QUALITY_NONE, "Every torchrun rank that loads a full checkpoint into RAM "
            "needs its own copy: N ranks, N times the RAM.", cost=1, primary=True)
    out.fix("fewer_workers", "Fewer DataLoader workers; keep the Dataset's data in numpy arrays, not Python "
            "lists of objects", None, None, "slower if data loading is the bottleneck", _QUALITY_NONE,
            "Reading Python objects touches their reference counts, so forked workers gradually copy the "
            "whole dataset.", cost=1)
    out.fix("more_ram", "Request more memory (Slurm --mem) or add swap", None, None, "swap: much slower",
            _QUALITY_NONE, "", cost=2)


def _diag_dataloader(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    sig = d.details.get("signal", "")
    if sig == "Killed":
        out.diag("worker_oom_killed", "A DataLoader worker was killed by the OOM killer: host RAM ran out, "
                 "not GPU memory. Workers are separate processes and each holds its own copy of whatever the "
                 "Dataset reads.")
    elif sig == "Segmentation fault":
        out.diag("worker_crashed", "A DataLoader worker crashed in native code (segfault): not a memory "
                 "shortage as such. Rerun with num_workers=0 to see the real error in the main process.")
    else:
        out.diag("worker_died", "A DataLoader worker exited unexpectedly; the cause is printed earlier in the "
                 "log (often the OOM killer or a shared-memory error). num_workers=0 shows it in the main process.")
    out.fix("fewer_workers", "Fewer workers (num_workers), smaller prefetch_factor and batch", None, None,
            "slower if data loading is the bottleneck", _QUALITY_NONE, "", cost=1, primary=True)
    out.fix("numpy_dataset", "Keep Dataset contents in numpy arrays or memory-mapped files instead of Python "
            "lists/dicts", None, None, _SPEED_NONE, _QUALITY_NONE, "Forked workers copy Python objects as they "
            "touch them (reference counts); arrays stay shared.", cost=1)


def _diag_shm(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    if d.details.get("reason") == "permission denied":
        out.diag("shared_memory_permission", "/dev/shm is not writable for this user (shm_open: Permission "
                 "denied), so NCCL cannot create the shared-memory segments it uses between processes on one "
                 "machine. Nothing is full.")
        out.fix("fix_shm_permissions", "Make /dev/shm writable again: sudo chmod 1777 /dev/shm (the usual mode; "
                "check with ls -ld /dev/shm)", None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0, primary=True)
        out.fix("nccl_shm_disable", "Or let NCCL skip shared memory: NCCL_SHM_DISABLE=1", None, None,
                "slower GPU-to-GPU transfers inside the machine (falls back to sockets/P2P)", _QUALITY_NONE, "",
                cost=1)
        return
    if d.details.get("reason") == "cannot open":
        out.diag("shared_memory_open_failed", "A process could not open a shared-memory segment (/dev/shm) that "
                 "another process handed it a tensor through. With PyTorch's default file_descriptor sharing "
                 "strategy this is most often the open-file limit (ulimit -n) running out under many workers or "
                 "a deep prefetch; a full /dev/shm does it too.")
        out.fix("sharing_strategy", "torch.multiprocessing.set_sharing_strategy('file_system') at the top of the "
                "script, or raise the open-file limit (ulimit -n 65535)", None, None, _SPEED_NONE, _QUALITY_NONE,
                "", cost=0, primary=True)
        out.fix("grow_shm", "If /dev/shm is small (df -h /dev/shm): docker run --shm-size=16g (or --ipc=host)",
                None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0)
        return
    out.diag("shared_memory_exhausted", "Shared memory (/dev/shm) is full: DataLoader workers hand batches to "
             "the main process through it, and NCCL uses it between processes on one machine. Docker gives "
             "containers only 64 MB of /dev/shm by default. This is host memory, not the GPU.")
    out.fix("grow_shm", "Give the container more shared memory: docker run --shm-size=16g (or --ipc=host); on "
            "Kubernetes mount an emptyDir with medium: Memory at /dev/shm", None, None, _SPEED_NONE, _QUALITY_NONE,
            "", cost=0, primary=True)
    out.fix("fewer_workers", "Fewer workers / smaller batches, or "
            "torch.multiprocessing.set_sharing_strategy('file_system')", None, None,
            "slower if data loading is the bottleneck", _QUALITY_NONE, "", cost=1)


def _diag_missing_env(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    var = d.details.get("variable", "LOCAL_RANK")
    out.diag("not_launched_with_torchrun", f"The script reads {var} from the environment, which only a launcher "
             "sets: it was started with `python` instead of `torchrun`.")
    out.fix("use_torchrun", "Launch with torchrun: torchrun --standalone --nproc_per_node=<number of GPUs> "
            "train.py <args>", None, None, _SPEED_NONE, _QUALITY_NONE,
            "For a single-GPU run without a launcher, read it with a default: "
            f"int(os.environ.get('{var}', {'1' if 'SIZE' in var else '0'}))", cost=0, primary=True)


def _diag_ordinal(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    if d.details.get("source"):
        dev, count = d.numbers.get("device"), d.numbers.get("device_count")
        out.diag("checkpoint_device", f"The checkpoint was saved from cuda:{dev} and this process sees {count} "
                 "GPU(s).")
        out.fix("map_location", "torch.load(path, map_location='cpu') (or map_location=f'cuda:{local_rank}')",
                None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0, primary=True)
        return
    ranks = ", ".join(str(r) for r in sorted(d.ranks)) or "a rank"
    out.diag("more_ranks_than_gpus", f"Rank(s) {ranks} asked for a GPU index this process cannot see: "
             "--nproc_per_node is larger than the number of visible GPUs, or CUDA_VISIBLE_DEVICES was narrowed "
             "(in the shell, or by the script itself, e.g. os.environ['CUDA_VISIBLE_DEVICES']='0'), so local_rank "
             "1 finds only GPU 0.")
    out.fix("match_nproc", "Make --nproc_per_node equal the number of visible GPUs: "
            "CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node=2 train.py", None, None, _SPEED_NONE, _QUALITY_NONE,
            "Remove any CUDA_VISIBLE_DEVICES assignment inside the script; select the GPU with "
            "torch.cuda.set_device(local_rank).", cost=0, primary=True)


def _seq(c: Collective) -> int:
    return -1 if c.seq is None else c.seq


def _diag_nccl(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    first: dict[int | None, Collective] = {}
    for c in d.collectives:
        if c.rank not in first or _seq(c) < _seq(first[c.rank]):
            first[c.rank] = c
    distinct = {(c.seq, c.op) for c in first.values()}
    if len(distinct) > 1:
        shown = "; ".join(f"rank {r if r is not None else '?'}: {c.op}" + (f" #{c.seq}" if c.seq is not None else "")
                          for r, c in
                          sorted(first.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))[:8])
        out.diag("mismatched_collectives", f"The ranks are waiting in different collectives ({shown}). Their "
                 "code paths diverged: a collective that only some ranks call (rank-0-only evaluation, logging or "
                 "checkpointing that calls all_reduce/barrier), or a different number of batches per rank.")
        out.fix("debug_collectives", "Rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL to name the mismatching call; make "
                "every rank run the same collectives in the same order", None, None, "slower while debugging",
                _QUALITY_NONE, "Use DistributedSampler(drop_last=True) so every rank gets the same number of "
                "batches.", cost=0, primary=True)
    else:
        silent = []
        if ctx.world:
            silent = sorted(set(range(ctx.world)) - {r for r in first if r is not None})
        text = "All reporting ranks wait in the same collective, so some rank never joined it: it died (look for " \
               "its own error above), hangs, or is much slower (e.g. rank 0 evaluating or saving a checkpoint " \
               "while the others wait)."
        if silent:
            text += f" Ranks that did not report the timeout: {', '.join(map(str, silent[:16]))} - start there."
        out.diag("straggler_rank", text)
        out.fix("longer_timeout", "For legitimately long rank-0-only work, raise the timeout: "
                "init_process_group(timeout=timedelta(minutes=60)), or make the other ranks wait at a barrier "
                "after it", None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0)
    if ctx.memory_ranks or {Kind.CUDA_OOM, Kind.OOM_KILLER, Kind.DATALOADER_KILLED} & ctx.kinds:
        ranks = ", ".join(map(str, sorted(set(ctx.memory_ranks)))) or "one rank"
        out.diag("consequence_of_oom", f"This log also shows a memory error (rank(s) {ranks}): the timeout is "
                 "most likely its consequence - the failed rank stopped joining collectives. Fix that error first.")
        out.fix("fix_memory_error_first", "Fix the memory error reported above; the timeout goes with it", None,
                None, _SPEED_NONE, _QUALITY_NONE, "", cost=0, primary=True)
    out.notes.append("NCCL_DEBUG=INFO and TORCH_NCCL_ASYNC_ERROR_HANDLING=1 make the failing rank visible sooner.")


def _diag_port(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    port = d.numbers.get("port")
    p = str(port) if port else "the rendezvous port"
    if d.kind is Kind.PORT_PERMISSION:
        out.diag("privileged_port", f"Binding {p} was refused: ports below 1024 need root, or a policy blocks it.")
        out.fix("use_high_port", "Use a port above 1024: torchrun --master_port=29511 ...", None, None, _SPEED_NONE,
                _QUALITY_NONE, "", cost=0, primary=True)
        return
    out.diag("port_taken", f"Port {p} is already taken: another torchrun job on this machine uses the default "
             "29500 (two trainings at once), or a previous run's processes are still alive.")
    out.fix("other_port", "Give each job its own port: torchrun --master_port=29501 ... (or --rdzv-endpoint="
            "localhost:0 --standalone)", None, None, _SPEED_NONE, _QUALITY_NONE,
            f"Find the holder with `ss -ltnp | grep {port or 29500}` and stop leftover processes.", cost=0,
            primary=True)


def _diag_p2p(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    out.diag("p2p_unsupported", "The GPUs cannot access each other's memory directly (peer-to-peer). Many "
             "consumer boards (and some BIOS/IOMMU settings) do not support it; `nvidia-smi topo -p2p r` shows it.")
    out.fix("nccl_p2p_disable", "NCCL_P2P_DISABLE=1 (NCCL then copies through host memory)", None, None,
            "slower inter-GPU transfers", _QUALITY_NONE, "", cost=1, primary=True)
    out.fix("ddp_not_dp", "Use DistributedDataParallel (one process per GPU) instead of DataParallel", None, None,
            "faster", _QUALITY_NONE, "DataParallel copies through GPU 0 with peer access and hangs or crawls "
            "without it; DDP over NCCL does not need P2P.", cost=1)


_ASSERT_HINTS = (
    ("n_classes", "a target label is outside [0, num_classes): check the labels and the model's output size"),
    ("srcIndex<srcSelectDimSize", "an index (a token id, usually) is >= the embedding size: check vocab size vs "
                                  "tokenizer, and padding ids"),
    ("index out of bounds", "an index is out of range for the tensor it indexes"),
    ("input_val>=zero&&input_val<=one", "binary cross-entropy got values outside [0, 1]: apply a sigmoid or use "
                                        "BCEWithLogitsLoss"),
)


def _diag_lookalike(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    if d.kind is Kind.DEVICE_ASSERT:
        assertion = d.details.get("assertion", "")
        hint = next((h for key, h in _ASSERT_HINTS if key.lower() in assertion.replace(" ", "").lower()),
                    "usually an index or label out of range")
        out.diag("not_oom_device_assert", f"A CUDA kernel's assertion failed - not a memory problem: {hint}.")
    elif d.kind is Kind.ILLEGAL_MEMORY_ACCESS:
        out.diag("not_oom_illegal_access", "A kernel read or wrote outside its memory - not a shortage of memory: "
                 "an out-of-range index, a bug in a custom/compiled kernel, or a library/driver bug.")
    else:
        out.diag("not_oom_misaligned", "A kernel used a misaligned pointer - not a shortage of memory: usually a "
                 "custom or fused kernel given a non-contiguous or oddly offset tensor.")
    out.fix("launch_blocking", "Rerun with CUDA_LAUNCH_BLOCKING=1 to get the real failing line, or run one step "
            "on the CPU for a readable Python error", None, None, "slower while debugging", _QUALITY_NONE,
            "CUDA reports errors asynchronously; the traceback shown may point at a later, innocent call. After "
            "this error the CUDA context is unusable - restart the process.", cost=0, primary=True)


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
    Kind.ILLEGAL_MEMORY_ACCESS: _diag_lookalike,
    Kind.DEVICE_ASSERT: _diag_lookalike,
    Kind.MISALIGNED_ADDRESS: _diag_lookalike,
}


def _title(d: _Draft) -> str:
    base = _KIND_INFO[d.kind][1]
    if d.kind is Kind.CUDA_ERROR_OOM and d.details.get("platform") == "ROCm/HIP":
        # The same error from AMD's runtime (hipErrorOutOfMemory); the kind name stays stable.
        base = base.replace("CUDA", "HIP (ROCm)")
    if d.kind is Kind.SHARED_MEMORY and d.details.get("reason") == "permission denied":
        base = "Shared memory (/dev/shm) not writable"
    elif d.kind is Kind.SHARED_MEMORY and d.details.get("reason") == "cannot open":
        base = "Shared memory segment could not be opened"
    elif d.kind is Kind.TF_OOM and d.details.get("severity", "").startswith("warning"):
        base = "TensorFlow allocator warning: ran out of memory for an optional workspace (not a failure)"
    elif d.kind is Kind.CUDA_ERROR_OOM and d.details.get("source", "").startswith("driver: pinned host"):
        base = "CUDA error: out of memory pinning host RAM (not GPU memory)"
    fmt = d.details.get("format")
    if fmt and not fmt.startswith("unknown"):
        base += f" ({fmt} message)"
    for key in ("status", "variable", "signal"):
        if key in d.details and d.kind not in (Kind.SHARED_MEMORY,):
            base += f": {d.details[key]}"
            break
    return base


def _finalise(scanner: _Scanner) -> ExplainResult:
    drafts = sorted((d for ds in scanner.by_kind.values() for d in ds), key=lambda d: d.line)
    kinds = {d.kind for d in drafts}
    # A TensorFlow/XLA driver warning is explained by the framework error that follows it.
    if kinds & {Kind.TF_OOM, Kind.JAX_OOM}:
        drafts = [d for d in drafts if not (d.kind is Kind.CUDA_ERROR_OOM
                                            and d.details.get("source", "").startswith("driver"))]
    memory_ranks = [r for d in drafts if _KIND_INFO[d.kind][0] in (Category.GPU_MEMORY, Category.HOST_MEMORY)
                    for r in d.ranks]
    world = scanner.facts.get("world_size")
    if scanner.ranks_seen:
        world = max(world or 0, max(scanner.ranks_seen) + 1)
    ctx = _Ctx(scanner.facts, world, kinds, memory_ranks)
    findings = []
    for d in drafts:
        memory = _KIND_INFO[d.kind][0] in (Category.GPU_MEMORY, Category.HOST_MEMORY)
        phase, no_grad = _phase_of(d.frames) if d.frames and memory else (None, False)
        out = _Out()
        _DIAGNOSE[d.kind](d, ctx, phase, no_grad, out)
        findings.append(Finding(
            kind=d.kind, title=_title(d), line=d.line, occurrences=d.occurrences,
            ranks=tuple(sorted(d.ranks)), gpus=tuple(sorted(d.gpus)), phase=phase,
            numbers=dict(d.numbers), derived=dict(out.derived), processes=tuple(d.processes),
            collectives=tuple(d.collectives), details=dict(d.details), diagnosis=out.ordered_diagnosis(),
            fixes=out.ranked(), notes=tuple(out.notes), excerpt=d.excerpt))
    return ExplainResult(tuple(findings), scanner.lineno, dict(scanner.facts), scanner.dropped, scanner.skipped)


# --- public API ------------------------------------------------------------------------------

def explain_stream(lines: Iterable[str]) -> ExplainResult:
    """Find and explain every known error in `lines` (an open text file, a list, a generator).

    Lines may or may not end in a newline; bytes are decoded as UTF-8 with replacement. The input
    is consumed once, in bounded batches, so its size does not matter."""
    scanner = _Scanner()
    batch: list[str] = []
    append = batch.append
    size = 0
    for raw in lines:
        if type(raw) is not str:
            raw = bytes(raw).decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray, memoryview)) \
                else str(raw)
        n = len(raw)
        nl = raw.find("\n")
        # The common case - one line, with or without its newline - costs one find() and no copy;
        # batch entries keep their newline so a batch is checked with one "".join().
        if (nl == -1 or nl == n - 1) and n <= _MAX_LINE:
            append(raw)
            size += n
        else:
            for piece in _split_line(raw):
                append(piece)
                size += len(piece)
        if len(batch) >= _BATCH_LINES or size >= _BATCH_CHARS:
            scanner.feed_batch(batch)
            batch = []
            append = batch.append
            size = 0
    if batch:
        scanner.feed_batch(batch)
    scanner.finish()
    return _finalise(scanner)


def _split_line(raw: str) -> Iterator[str]:
    """Lines of `raw` (which may hold several, or one longer than _MAX_LINE) as batch entries."""
    parts = raw.split("\n")
    if parts[-1] == "":
        parts.pop()     # the newline that ends the last line does not start a new one
    for part in parts:
        for k in range(0, max(1, len(part)), _MAX_LINE):
            yield part[k:k + _MAX_LINE]


def explain_text(text: str) -> ExplainResult:
    """explain_stream for a string already in memory."""
    return explain_stream(text.split("\n"))


def explain_file(stream: IO[bytes], chunk_size: int = _READ_CHUNK) -> ExplainResult:
    """explain_stream for a binary file or stdin, read in `chunk_size` blocks.

    The fast path used by the CLI: each block of complete lines is checked as one string, and
    only blocks that contain a keyword are split into lines."""
    scanner = _Scanner()
    for block in _text_blocks(stream, chunk_size):
        scanner.feed_block(block)
    scanner.finish()
    return _finalise(scanner)


def read_lines(stream: IO[bytes], chunk_size: int = _READ_CHUNK) -> Iterator[str]:
    """Decode a binary stream into lines (without their newlines), `chunk_size` bytes at a time.

    UTF-8 (with or without BOM) by default; UTF-16 when the stream starts with a UTF-16 BOM
    (PowerShell 5 `>` redirection writes UTF-16LE). Invalid bytes become U+FFFD; physical lines
    longer than _MAX_LINE characters are cut, so memory stays bounded even without newlines."""
    for block in _text_blocks(stream, chunk_size):
        yield from block.split("\n")


def _text_blocks(stream: IO[bytes], chunk_size: int) -> Iterator[str]:
    """Decoded text in blocks of complete lines: newline-separated, without a trailing newline,
    no line longer than _MAX_LINE."""
    first = stream.read(chunk_size)
    if not first:
        return
    if first.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        decoder = codecs.getincrementaldecoder("utf-16")(errors="replace")
    else:
        decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
    pending = ""
    chunk = first
    while chunk:
        pending += decoder.decode(chunk)
        cut = pending.rfind("\n")
        if cut >= 0:
            block, pending = pending[:cut], pending[cut + 1:]
            yield from _bounded(block)
        while len(pending) > _MAX_LINE:      # a line with no end in sight: cut it
            yield pending[:_MAX_LINE]
            pending = pending[_MAX_LINE:]
        chunk = stream.read(chunk_size)
    pending += decoder.decode(b"", final=True)
    if pending:
        yield from _bounded(pending)


def _bounded(block: str) -> Iterator[str]:
    """`block`, with any line longer than _MAX_LINE cut into pieces (rare: only checked when the
    block itself is long enough to hold such a line)."""
    if len(block) <= _MAX_LINE or max(map(len, block.split("\n"))) <= _MAX_LINE:
        yield block
    else:
        yield "\n".join(piece for line in block.split("\n") for piece in _split_line(line))


# --- rendering -------------------------------------------------------------------------------

_LABELS = {
    "requested": "requested", "capacity": "total capacity", "free": "free on the GPU",
    "allocated": "allocated by PyTorch", "reserved": "reserved by PyTorch",
    "reserved_unallocated": "reserved but unallocated", "private_pools": "in private pools (CUDA Graphs)",
    "this_process": "this process, incl. non-PyTorch", "limit": "allowed (limit)",
    "other_allocations": "other allocations", "in_use": "in use", "max_in_use": "peak in use",
    "total_allocation": "program total", "temp_allocation": "temporaries", "parameter_allocation": "parameters",
    "other_processes": "other processes", "outside_allocator": "used outside this allocator",
    "non_pytorch_in_process": "non-PyTorch memory in process", "shortfall": "short by (at least)",
    "model_states": "model states (est.)", "activations": "activations (est.)",
    "timeout_ms": "timeout", "elapsed_ms": "ran for", "port": "port", "device": "device index",
    "device_count": "visible devices",
}


_DETAILED_FIXES = 3   # the text output explains the top fixes; --json has every detail


def _fmt_number(key: str, value: int) -> str:
    if key in BYTE_KEYS:
        return format_bytes(value)
    if key.endswith("_ms"):
        return f"{value:,} ms"
    return str(value)


def _wrap(text: str, indent: str, hang: int = 2, width: int = 100) -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent + " " * hang,
                         break_on_hyphens=False) or [indent]


def render_text(result: ExplainResult) -> str:
    """Terminal text: per finding a title line, the numbers (IEC units), the diagnosis, and the
    fixes ranked by what they buy with their speed and quality trade-offs. ASCII only."""
    if not result.findings:
        return f"No known error found in {result.lines_read:,} lines.\n"
    out = [f"Found {len(result.findings)} error(s) in {result.lines_read:,} lines."]
    for i, f in enumerate(result.findings, 1):
        out.append("")
        out.append(f"[{i}] {f.title}")
        where = [f"line {f.line}"]
        if f.gpus:
            where.append("GPU " + ", ".join(map(str, f.gpus)))
        if f.ranks:
            where.append(("rank " if len(f.ranks) == 1 else "ranks ") + _ranges(f.ranks))
        if f.occurrences > 1:
            where.append(f"seen {f.occurrences} times")
        if f.phase:
            where.append("during " + f.phase.value.replace("_", " "))
        if f.category is Category.NOT_OOM:
            where.append("NOT an out-of-memory error")
        out.append("    " + " | ".join(where))
        out.append("    > " + (f.excerpt if len(f.excerpt) <= 96 else f.excerpt[:93] + "..."))
        rows = [(_LABELS.get(k, k), _fmt_number(k, v)) for k, v in f.numbers.items()]
        rows += [(_LABELS.get(k, k) + " (derived)", _fmt_number(k, v)) for k, v in f.derived.items()]
        rows += [(f"process {p.pid}", format_bytes(p.bytes)) for p in f.processes]
        if rows:
            out.append("  Numbers")
            table = tabulate(rows, tablefmt="plain", colalign=("left", "right"))
            out.extend("    " + line for line in table.splitlines())
        for c in f.collectives[:8]:
            out.append(f"    rank {c.rank if c.rank is not None else '?'}: {c.op}"
                       + (f" SeqNum={c.seq}" if c.seq is not None else "")
                       + (f" numel={c.numel:,}" if c.numel is not None else "")
                       + f" ran {c.elapsed_ms:,} ms (timeout {c.timeout_ms:,} ms)")
        if f.diagnosis:
            out.append("  Diagnosis")
            for dg in f.diagnosis:
                out.extend(_wrap("- " + dg.text, "    "))
        if f.fixes:
            out.append("  Fixes, ranked by what they buy")
            for j, fx in enumerate(f.fixes, 1):
                out.extend(_wrap(f"{j}. {fx.title}", "    ", hang=len(f"{j}. ")))
                pad = " " * (4 + len(f"{j}. "))
                trade = f"speed: {fx.speed} | quality: {fx.quality}"
                if fx.effect_bytes is not None:
                    trade = f"frees: {fx.effect_bound} {format_bytes(fx.effect_bytes)} | {trade}"
                elif f.category is Category.GPU_MEMORY:
                    trade = f"frees: not computable from this log | {trade}"
                out.extend(_wrap(trade, pad))
                if fx.detail and j <= _DETAILED_FIXES:
                    out.extend(_wrap(fx.detail, pad, hang=0))
        for note in f.notes:
            out.extend(_wrap("Note: " + note, "  "))
    if result.dropped_findings:
        out.append("")
        out.append(f"({result.dropped_findings} further distinct errors not shown.)")
    if result.skipped_regions:
        out.append("")
        out.append(f"({result.skipped_regions} part(s) of the log could not be parsed; please report this.)")
    return "\n".join(out) + "\n"


def _ranges(values: tuple[int, ...]) -> str:
    parts: list[str] = []
    start = prev = None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = v
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ", ".join(parts)


def to_json(result: ExplainResult) -> dict:
    """JSON-ready dict: numbers in bytes (ints), diagnosis and fixes as structured data."""
    return {
        "lines_read": result.lines_read,
        "findings": [_finding_json(f) for f in result.findings],
        "context": dict(result.context),
        "dropped_findings": result.dropped_findings,
        "skipped_regions": result.skipped_regions,
    }


def _finding_json(f: Finding) -> dict:
    return {
        "kind": f.kind.value,
        "category": f.category.value,
        "title": f.title,
        "cause": f.cause,
        "line": f.line,
        "occurrences": f.occurrences,
        "ranks": list(f.ranks),
        "gpu": f.gpu,
        "gpus": list(f.gpus),
        "phase": f.phase.value if f.phase else None,
        "numbers": dict(f.numbers),
        "derived": dict(f.derived),
        "processes": [{"pid": p.pid, "bytes": p.bytes} for p in f.processes],
        "collectives": [{"rank": c.rank, "seq": c.seq, "op": c.op, "numel": c.numel,
                         "timeout_ms": c.timeout_ms, "elapsed_ms": c.elapsed_ms} for c in f.collectives],
        "details": dict(f.details),
        "diagnosis": [{"cause": d.cause, "text": d.text} for d in f.diagnosis],
        "fixes": [{"id": x.id, "title": x.title, "effect_bytes": x.effect_bytes, "effect_bound": x.effect_bound,
                   "speed": x.speed, "quality": x.quality, "detail": x.detail} for x in f.fixes],
        "notes": list(f.notes),
        "excerpt": f.excerpt,
    }
