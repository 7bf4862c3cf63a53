"""NCCL's generic failures (unhandled cuda/system error, internal error, invalid argument/usage, remote
error) in every spelling NCCL, PyTorch, Horovod and CuPy print, and the diagnosis ladder from what the log
shows: the relayed CUDA or system error, the GPU model, P2P, containers, the driver."""
from __future__ import annotations

import re

from ..diagnosis import _QUALITY_NONE, _SPEED_NONE, _Ctx, _Out
from ..draft import _Draft
from ..results import Kind, Phase
from .patterns import _I, _AnchorSpec

# ncclResult_t (nccl.h): the number, the enum name, the words ncclGetErrorString() prints (src/misc/
# argcheck.cc / init.cc: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)", ...), and
# CuPy's NCCL_ERROR_* spelling. ncclInProgress (7) is not an error.
_CODES: tuple[tuple[int, str, str, str], ...] = (
    (1, "ncclUnhandledCudaError", "unhandledcudaerror", "UNHANDLED_CUDA_ERROR"),
    (2, "ncclSystemError", "unhandledsystemerror", "SYSTEM_ERROR"),
    (3, "ncclInternalError", "internalerror", "INTERNAL_ERROR"),
    (4, "ncclInvalidArgument", "invalidargument", "INVALID_ARGUMENT"),
    (5, "ncclInvalidUsage", "invalidusage", "INVALID_USAGE"),
    (6, "ncclRemoteError", "remoteprocessexitedortherewasanetworkerror", "REMOTE_ERROR"),
)
_BY_TEXT = {text: (n, name) for n, name, text, _ in _CODES}
_BY_NAME = {name.lower(): (n, name) for n, name, _, _ in _CODES}
_BY_CAPS = {caps.lower(): (n, name) for n, name, _, caps in _CODES}
_TEXTS = "|".join(text for _, _, text, _ in _CODES)

_ANCHORS: tuple[_AnchorSpec, ...] = (
    _AnchorSpec(Kind.NCCL_ERROR, ("nccl",), re.compile(
        # torch's ncclResult_t names (ProcessGroupNCCL/NCCLUtils: "ncclUnhandledCudaError: Call to
        # CUDA function failed.") and CuPy's NcclError ("NCCL_ERROR_UNHANDLED_CUDA_ERROR")
        r"nccl(?P<name>UnhandledCudaError|SystemError|InternalError|InvalidArgument|InvalidUsage|RemoteError)"
        r"(?![a-z])|NCCL_ERROR_(?P<caps>UNHANDLED_CUDA_ERROR|SYSTEM_ERROR|INTERNAL_ERROR|INVALID_ARGUMENT"
        r"|INVALID_USAGE|REMOTE_ERROR)"
        # "NCCL error in: <file>:<line>, unhandled cuda error", torch <= 1.x "NCCL Error 1: unhandled
        # cuda error", nccl-tests "NCCL failure common.cu:958 'unhandled cuda error'", Horovod
        # "ncclCommInitRank failed: unhandled cuda error"
        rf"|NCCL(?:Error\d:|errorin:[^,]{{0,200}},|failure[^']{{0,80}}'|error:?|\w{{2,40}}failed[:,]?)"
        rf"(?P<text>{_TEXTS}|remoteprocessexited)", _I), absorb=300),
)

# --- evidence in the region's lines (unsquashed) ---------------------------------------------

_WARN = re.compile(r"NCCL WARN\s+(.{1,200})")
_CUDA_FAILURE = re.compile(r"Cuda failure (?:\d+ )?'([^']{1,120})'", re.I)
_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)")
_CALL = re.compile(r"\b(nccl[A-Z]\w{2,40}) failed")
# A GPU model as nvidia-smi, torch.cuda.get_device_name() and NCCL's topology dump print it.
# (also as people write it: "4x RTX 4090", "2xRTX3090")
_GPU_MODEL = re.compile(r"((?:NVIDIA )?GeForce (?:RTX|GTX) ?\d{3,4}(?: ?Ti| SUPER)*|(?:NVIDIA )?RTX A\d{4}"
                        r"|(?:NVIDIA )?RTX \d{4} Ada|(?:NVIDIA |Tesla )?(?:A100|H100|H200|A10G?|L40S?|V100|T4)\b"
                        r"|(?:(?<=\d[xX])|(?<![A-Za-z]))RTX ?[2345]0[5-9]0(?: ?Ti| SUPER)*)")
_CONSUMER = re.compile(r"GeForce|TITAN|RTX ?[2345]0[5-9]0", re.I)
_NO_P2P_CARD = re.compile(r"(?:GeForce )?RTX ?[45]0[5-9]0", re.I)
_DRIVER = re.compile(r"driver version is insufficient|unsupported display driver|cudaErrorInsufficientDriver"
                     r"|forward compatibility was attempted|CUDA driver version", re.I)
_CONTAINER = re.compile(r"docker|kubepods|--shm-size|container", re.I)
_P2P_SEEN = re.compile(r"via P2P|P2P/(?:IPC|CUMEM|direct)|peer access|p2p", re.I)
_MEMORY = re.compile(r"out of memory|calloc|cudaMalloc", re.I)


def _x_nccl_error(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.NCCL_ERROR)
    if m.group("name"):
        code, name = _BY_NAME["nccl" + m.group("name").lower()]
    elif m.group("caps"):
        code, name = _BY_CAPS[m.group("caps").lower()]
    else:
        text = m.group("text").lower()
        code, name = _BY_TEXT.get(text, (6, "ncclRemoteError"))
    d.numbers["nccl_result"] = code
    d.details["status"] = name
    d.sig = (code,)
    return d


def _add_nccl_evidence(d: _Draft, lines: list[tuple[int, str]]) -> None:
    """What the region's own lines say about the failure: NCCL's WARN line (the relayed call), the
    CUDA error text, NCCL's version, the failing NCCL call, P2P, containers, the driver."""
    after_last = False
    for _, body in lines:
        b = body.strip()
        if after_last and b and "last_error" not in d.details:
            d.details["last_error"] = b[:200]   # torch >= 2.2 prints NCCL's last WARN text on the next line
        after_last = b == "Last error:"
        warn = _WARN.search(b)
        if warn and "nccl_warn" not in d.details:
            d.details["nccl_warn"] = warn.group(1).strip()
        for key, rx in (("cuda_failure", _CUDA_FAILURE), ("nccl_version", _VERSION), ("call", _CALL),
                        ("gpu_model", _GPU_MODEL)):
            if key not in d.details and (found := rx.search(b)):
                d.details[key] = found.group(1)
        for key, rx in (("driver", _DRIVER), ("container", _CONTAINER), ("p2p", _P2P_SEEN)):
            if key not in d.details and (found := rx.search(b)):
                d.details[key] = found.group(0)


# --- diagnosis -------------------------------------------------------------------------------

_MEANING = {
    1: "a CUDA call NCCL made failed (cudaMalloc of its buffers, peer access between GPUs, a kernel launch, "
       "cudaSetDevice)",
    2: "a system call or library NCCL uses failed (a socket connect/bind, shared memory in /dev/shm, "
       "InfiniBand verbs, a thread or file limit)",
    3: "one of NCCL's internal checks failed: usually ranks running different NCCL versions or a topology "
       "it cannot handle",
    4: "NCCL was given an invalid argument: a tensor on another device or on the CPU, or ranks passing "
       "different counts or dtypes",
    5: "NCCL was used in a way it forbids: most often two ranks on one GPU (torch.cuda.set_device(local_rank) "
       "missing), or a communicator used after an earlier error",
    6: "a peer rank exited or the network to it failed: this rank only saw its peer disappear",
}


def _diag_nccl_error(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    code = d.numbers.get("nccl_result", 1)
    name = d.details.get("status", "ncclUnhandledCudaError")
    relayed = d.details.get("cuda_failure") or d.details.get("last_error") or d.details.get("nccl_warn")
    said = (f" NCCL's own report in this log: \"{relayed}\"." if relayed else
            " The log does not show NCCL's own WARN line, which names the failed call.")
    out.diag("nccl_relays_error", f"{name} (NCCL result {code}) means {_MEANING[code]}. NCCL only relays it: "
             "the error is the underlying call's, not NCCL's." + said)
    if not relayed:
        out.fix("nccl_debug_info", "Rerun with NCCL_DEBUG=INFO (add NCCL_DEBUG_SUBSYS=INIT,P2P,SHM,NET) and read "
                "the first 'NCCL WARN' line: it names the call that failed, e.g. \"Cuda failure 'peer access is "
                "not supported between these two devices'\" or \"Call to posix_fallocate failed : No space left "
                "on device\"", None, None, "slower start-up while debugging", _QUALITY_NONE,
                "Each cause below has its own WARN line; that line decides between them.", cost=0, primary=True)
    gpu = d.details.get("gpu_model") or ctx.gpu_model
    if code in (1, 2):
        for cause in _ranked_causes(code, d, gpu):
            cause(d, gpu, out)
    elif code == 5:
        _cause_same_gpu(out)
    elif code == 6:
        _cause_remote(out)
    else:
        _cause_versions(code, out)


def _ranked_causes(code: int, d: _Draft, gpu: str | None) -> list:
    """The usual causes, most likely first: the relayed error and the log's evidence (GPU model, P2P,
    containers, driver) move a cause up; otherwise P2P, memory, driver, shared memory for CUDA errors
    and shared memory, network, driver for system errors."""
    text = " ".join(d.details.get(k, "") for k in ("cuda_failure", "last_error", "nccl_warn"))
    score = {
        _cause_p2p: 2 * bool(_P2P_SEEN.search(text)) + bool(gpu and _CONSUMER.search(gpu)) + bool(d.details.get("p2p")),
        _cause_memory: 2 * bool(_MEMORY.search(text)),
        _cause_driver: 2 * bool(_DRIVER.search(text) or d.details.get("driver")),
        _cause_shm: 2 * bool(re.search(r"shm|shared memory|posix_fallocate", text, re.I))
        + bool(d.details.get("container")),
        _cause_network: 2 * bool(re.search(r"socket|connect|ibv_|NET/|bootstrap", text, re.I)),
    }
    default = ([_cause_p2p, _cause_memory, _cause_driver, _cause_shm] if code == 1 else
               [_cause_shm, _cause_network, _cause_driver])
    return sorted(default, key=lambda c: -score[c])


def _cause_p2p(d: _Draft, gpu: str | None, out: _Out) -> None:
    card = f" This log shows a {gpu}." if gpu else ""
    none = " GeForce RTX 40xx/50xx cards have no peer-to-peer support at all." if gpu and _NO_P2P_CARD.search(gpu) \
        else ""
    out.diag("nccl_p2p", "Peer-to-peer transfers between consumer cards: GeForce RTX 40xx have none, and 30xx only "
             "over an NVLink bridge, yet NCCL may still pick P2P (some drivers report it available), so its "
             "cudaIpc/peer-access call fails." + card + none)
    out.fix("nccl_p2p_disable", "NCCL_P2P_DISABLE=1 (NCCL then copies through host memory); check the links "
            "with `nvidia-smi topo -m` (and `nvidia-smi topo -p2p r`)", None, None, "slower inter-GPU transfers",
            _QUALITY_NONE, "If that fixes it, P2P was the cause; a driver update may restore it on cards that "
                           "support it.", cost=0)


def _cause_memory(d: _Draft, gpu: str | None, out: _Out) -> None:
    out.diag("nccl_gpu_memory", "GPU memory full, NCCL's own buffers included: NCCL allocates them with "
             "cudaMalloc outside PyTorch's cache, at the first collective, so a card already full of the "
             "model, the batch or another process leaves nothing for them.")
    out.fix("free_memory_for_nccl", "Leave memory for NCCL: check `nvidia-smi` for other processes (or every "
            "rank on GPU 0 because torch.cuda.set_device(local_rank) is missing), a smaller micro-batch, "
            "NCCL_BUFFSIZE=1048576", None, None, "slightly slower collectives", _QUALITY_NONE, "", cost=0)


def _cause_driver(d: _Draft, gpu: str | None, out: _Out) -> None:
    out.diag("nccl_driver_mismatch", "A driver/CUDA mismatch: the NCCL bundled with PyTorch needs a newer "
             "driver than the one installed (or a container's CUDA is newer than the host driver).")
    out.fix("match_driver", "Compare `nvidia-smi` (the driver's CUDA version, top right) with "
            "python -c 'import torch; print(torch.version.cuda, torch.cuda.nccl.version())'; update the driver "
            "or install the PyTorch wheel built for the driver's CUDA", None, None, _SPEED_NONE, _QUALITY_NONE,
            "", cost=0)


def _cause_shm(d: _Draft, gpu: str | None, out: _Out) -> None:
    seen = " The log mentions a container or /dev/shm." if d.details.get("container") else ""
    out.diag("nccl_shared_memory", "Shared memory in a container: NCCL's shared-memory transport needs several "
             "MiB per peer in /dev/shm, and Docker gives containers 64 MiB by default." + seen)
    out.fix("grow_shm", "docker run --shm-size=16g (or --ipc=host); on Kubernetes mount an emptyDir with "
            "medium: Memory at /dev/shm; `df -h /dev/shm` shows its size", None, None, _SPEED_NONE,
            _QUALITY_NONE, "NCCL_SHM_DISABLE=1 avoids it at some speed cost.", cost=0)


def _cause_network(d: _Draft, gpu: str | None, out: _Out) -> None:
    out.diag("nccl_network", "The network between ranks: a socket NCCL opened could not connect (firewall, "
             "the wrong interface chosen, InfiniBand not usable).")
    out.fix("nccl_socket_ifname", "Name the interface: NCCL_SOCKET_IFNAME=eth0 (the one the nodes reach each "
            "other on); without working InfiniBand NCCL_IB_DISABLE=1", None, None, _SPEED_NONE, _QUALITY_NONE,
            "", cost=0)


def _cause_same_gpu(out: _Out) -> None:
    out.diag("nccl_same_gpu", "Two ranks on one GPU: without torch.cuda.set_device(local_rank) (or "
             "device_ids=[local_rank]) every rank uses GPU 0, which NCCL refuses.")
    out.fix("set_device_nccl", "Call torch.cuda.set_device(local_rank) before init_process_group and pass "
            "device_ids=[local_rank] to DDP", None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0)


def _cause_remote(out: _Out) -> None:
    out.diag("nccl_peer_gone", "The real error is on another rank (or node): it crashed or was killed first. "
             "Look for that rank's traceback or a kill above, or in its own log.")
    out.fix("find_first_failure", "Find the first rank that failed: torchrun --redirects 3 --log-dir logs "
            "keeps each rank's output; TORCH_NCCL_ASYNC_ERROR_HANDLING=1 stops the others promptly", None, None,
            _SPEED_NONE, _QUALITY_NONE, "", cost=0)


def _cause_versions(code: int, out: _Out) -> None:
    out.diag("nccl_versions", "Check that every rank runs the same PyTorch and NCCL (python -c 'import torch; "
             "print(torch.cuda.nccl.version())' on each node) and that the tensors passed are on the rank's own "
             "GPU with the same shape and dtype everywhere.")
    out.fix("same_versions", "Same environment on every node; tensors on torch.cuda.current_device() before "
            "the collective", None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0)
