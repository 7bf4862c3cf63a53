"""Launch and multi-GPU errors: launch variables (LOCAL_RANK, ...), device ordinal, NCCL timeouts and buffer
allocation failures, ports (also Windows' WSAEADDRINUSE), P2P (NCCL errors, `nvidia-smi topo -p2p r` tables,
DataParallel hangs, accelerate's RTX 4000 refusal)."""
from __future__ import annotations

import re

from ..diagnosis import _F, _QUALITY_NONE, _SPEED_NONE, _Ctx, _Out
from ..draft import _Draft, _seq
from ..results import Collective, Kind, Phase
from .nccl_debug import HANG, NO_P2P, _diag_nccl_p2p
from .patterns import _I, _AnchorSpec, _rx

# --- message anchors (squashed text) ---------------------------------------------------------

_ANCHORS: tuple[_AnchorSpec, ...] = (
    _AnchorSpec(Kind.MISSING_LAUNCH_ENV, ("keyerror", "butnotset"), re.compile(
        r"KeyError:['\"](?:LOCAL_RANK|RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT)['\"]"
        r"|environmentvariable(?:LOCAL_RANK|RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT)expected,?butnotset")),
    _AnchorSpec(Kind.INVALID_DEVICE_ORDINAL, ("ordinal", "invaliddevice", "deserialize"), re.compile(
        r"invaliddeviceordinal|cudaErrorInvalidDevice|hipErrorInvalidDevice"
        r"|AttemptingtodeserializeobjectonCUDAdevice\d+buttorch\.cuda\.device_count\(\)is\d+", _I), absorb=200),
    _AnchorSpec(Kind.NCCL_TIMEOUT, ("watchdog",),
                re.compile(r"Watchdogcaughtcollectiveoperationtimeout", _I), absorb=0),
    # ProcessGroupNCCL's heartbeat monitor (torch >= 2.2): the watchdog thread itself stalled, "[PG 0 Rank 1]
    # Heartbeat monitor timed out!" and "ProcessGroupNCCL's watchdog got stuck for 480 seconds without making
    # progress in monitoring enqueued collectives ... (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC)".
    _AnchorSpec(Kind.NCCL_TIMEOUT, ("watchdoggotstuck", "heartbeatmonitortimedout"), re.compile(
        r"watchdoggotstuckfor\d+seconds|Heartbeatmonitortimedout", _I), absorb=1500),
    _AnchorSpec(Kind.PORT_IN_USE, ("alreadyinuse", "eaddrinuse", "errno:98", "10048"), re.compile(
        r"(?:errno:98-?)?Addressalreadyinuse|EADDRINUSE|errno:98(?!\d)"
        # Windows: WSAEADDRINUSE is error 10048, its text localised ("Only one usage of each socket
        # address ... is normally permitted" in English), so the code is what is matched.
        r"|(?:WinError|systemerror:?|Errno|error:?|error=)10048(?!\d)", _I), absorb=300),
    _AnchorSpec(Kind.PORT_PERMISSION, ("errno:13", "eacces"),
                re.compile(r"errno:13-?Permissiondenied|EACCES", _I), absorb=300),
    _AnchorSpec(Kind.P2P, ("peeraccess", "peermapping", "p2p"), re.compile(
        r"peeraccessisnotsupport(?:ed)?betweenthesetwodevices|cudaErrorPeerAccessUnsupported"
        r"|peermappingresourcesexhausted|P2P(?:access)?(?:is)?notsupported"
        # accelerate refuses RTX 4000-series cards unless P2P and IB are disabled
        # (accelerate/state.py, with accelerate/utils/environment.py check_cuda_p2p_ib_support).
        r"|RTX4000series(?:doesn.?t|doesnot)supportfastercommunication", _I), absorb=300),
    # A Ctrl-C'd DataParallel hang: kept only when its traceback is inside DataParallel's weight
    # broadcast (scanner: _dp_hang_frames).
    _AnchorSpec(Kind.P2P, ("keyboardinterrupt",), re.compile(r"(?<![A-Za-z_.])KeyboardInterrupt(?![A-Za-z_])"),
                absorb=300),
    # NCCL allocating its own buffers with cudaMalloc outside PyTorch's allocator (NCCL
    # src/include/alloc.h, ncclCudaCalloc: "Failed to CUDA calloc %ld bytes"; CUDACHECK's
    # "Cuda failure '%s'" warning). It starts at "NCCL WARN" so it takes precedence over the
    # generic "CUDA failure ... out of memory" anchor of cuda.py, which begins inside it.
    _AnchorSpec(Kind.NCCL_CUDA_OOM, ("calloc", "ncclwarncudafailure"), re.compile(
        r"FailedtoCUDAcalloc(?:async)?\d+bytes|NCCLWARNCudafailure['\"]?outofmemory", _I), absorb=600),
)

_DP_HANG = "DataParallel hang interrupted with Ctrl-C (KeyboardInterrupt in its weight broadcast)"
_TOPO = "nvidia-smi topo -p2p r"
_RTX4000 = "accelerate refuses P2P/IB on RTX 4000-series cards"
# torch/nn/parallel/replicate.py copies the module to every GPU at each forward through
# comm.broadcast_coalesced (torch/nn/parallel/comm.py) - peer copies, which hang without P2P.
_DP_FUNCS = frozenset({"broadcast_coalesced", "_broadcast_coalesced_reshape", "replicate"})
_DP_FILES = ("nn/parallel/comm.py", "nn/parallel/replicate.py")

# `nvidia-smi topo -p2p r` (read; also w/n/a/p): a header of GPU columns, a row per GPU with
# X (self), OK, or a "not supported" status (NS, CNS chipset, GNS GPU, TNS topology), U unknown.
_TOPO_HEADER = re.compile(r"^\s*((?:GPU\d+\s+)*GPU\d+)\s*$")
_TOPO_ROW = re.compile(r"^\s*GPU(\d+)((?:\s+(?:X|OK|NS|CNS|GNS|TNS|U))+)\s*$")
_TOPO_BAD = frozenset({"NS", "CNS", "GNS", "TNS"})

# Matched per (unsquashed) line by the scanner: a message whose meaning depends on being alone.
# A KeyError printed by str() (an IDE, a logger): a line that is only the quoted variable.
_BARE_ENV_LINE = re.compile(r"^(?:KeyError:\s*)?['\"](LOCAL_RANK|RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR"
                            r"|MASTER_PORT)['\"]$")


# --- field patterns (squashed text) ----------------------------------------------------------

_F_ENV_VAR = re.compile(r"(LOCAL_WORLD_SIZE|LOCAL_RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT|RANK)")
_F_DESERIALIZE = _rx(r"AttemptingtodeserializeobjectonCUDAdevice(\d+)buttorch\.cuda\.device_count\(\)is(\d+)")
# (PyTorch <= 1.10 prints no SeqNum)
_F_NCCL = _rx(r"WorkNCCL\((?:SeqNum=(\d+),)?OpType=(\w+?)(?:,NumelIn=(\d+))?(?:,NumelOut=\d+)?,Timeout\(ms\)=(\d+)\)"
              r"ranfor(\d+)milliseconds")
_F_RANK_IN_TEXT = _rx(r"\[(?:PG[^\]]*)?Rank(\d+)\]")
_F_CALLOC = _rx(r"FailedtoCUDAcalloc(?:async)?(\d+)bytes")
_F_PORT = _rx(r"(?:port[:=]|\]:|0\.0\.0\.0:|localhost:|127\.0\.0\.1:|MASTER_PORT=)(\d{2,5})")


# --- extractors: squashed message text -> draft ----------------------------------------------

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


_F_HEARTBEAT = _rx(r"watchdoggotstuckfor(\d+)seconds")


def _x_nccl(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.NCCL_TIMEOUT)
    rank_m = list(_F_RANK_IN_TEXT.finditer(pre[-80:]))
    rank = int(rank_m[-1].group(1)) if rank_m else None
    if not m.group(0).lower().startswith("watchdogcaught"):
        d.details["heartbeat"] = "the watchdog thread stalled (heartbeat monitor)"
        stuck = _F_HEARTBEAT.search(span[:2000])
        if stuck:
            d.numbers["heartbeat_timeout_s"] = int(stuck.group(1))
        if rank is not None:
            d.ranks.append(rank)
        d.sig = ()
        return d
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
        if "10048" in m.group(0):
            d.details["platform"] = "Windows (WSAEADDRINUSE, error 10048)"
        d.sig = (d.numbers.get("port"),)
        return d
    return extract


def _x_p2p(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.P2P)
    text = m.group(0)
    if text == "KeyboardInterrupt":
        d.details["source"] = _DP_HANG
    elif text.lower().startswith("rtx4000"):
        d.details["source"] = _RTX4000
    else:
        d.details["message"] = text
    d.sig = ()
    return d


def _dp_hang_frames(frames: list) -> bool:
    """Whether a KeyboardInterrupt's traceback is inside DataParallel's weight broadcast."""
    return any(f.func in _DP_FUNCS or f.file.replace("\\", "/").endswith(_DP_FILES) for f in frames)


def _p2p_table(lines: list[tuple[int, str]]) -> tuple[int, str, _Draft] | None:
    """A pasted `nvidia-smi topo -p2p r` table with a 'not supported' pair -> a P2P draft."""
    columns: list[int] = []
    bad: list[str] = []
    first = None
    for lineno, body in lines:
        head = _TOPO_HEADER.match(body)
        if head:
            columns = [int(c) for c in re.findall(r"GPU(\d+)", head.group(1))]
            continue
        row = _TOPO_ROW.match(body)
        if not row or not columns:
            continue
        gpu, cells = int(row.group(1)), row.group(2).split()
        for col, cell in zip(columns, cells):
            if cell in _TOPO_BAD and gpu < col:
                bad.append(f"GPU{gpu}-GPU{col} ({cell})")
                if first is None:
                    first = (lineno, body)
    if first is None:
        return None
    d = _Draft(Kind.P2P)
    d.details["source"] = _TOPO
    d.details["unsupported_pairs"] = ", ".join(bad[:16])
    d.numbers["device_count"] = len(columns)
    d.sig = ()
    return first[0], first[1], d


def _x_nccl_oom(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.NCCL_CUDA_OOM)
    size = _F_CALLOC.search(span[:400]) or _F_CALLOC.search(pre)
    if size:
        d.numbers["requested"] = int(size.group(1))
    d.sig = ()
    return d


# --- diagnosis -------------------------------------------------------------------------------

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
    procs = ctx.facts.get("nproc_per_node")
    if procs:
        d.numbers["nproc_per_node"] = procs
    visible = _visible_gpus(sorted(set(d.ranks)), procs)
    out.diag("more_ranks_than_gpus", _ordinal_text(sorted(set(d.ranks)), procs, visible))
    match = (f"--nproc_per_node={visible}" if visible else "--nproc_per_node=<visible GPUs>")
    devices = ",".join(map(str, range(visible))) if visible else "0,1"
    out.fix("match_nproc", f"Make the processes per node equal the GPUs this process sees: {match}"
            + (f" (it was {procs})" if procs else "") + f", or show it more GPUs: CUDA_VISIBLE_DEVICES={devices}"
            + ("" if visible else ",..."), None, None, _SPEED_NONE, _QUALITY_NONE,
            "Check what it sees with nvidia-smi -L and python -c 'import torch; print(torch.cuda.device_count())' "
            "in the same shell; remove any CUDA_VISIBLE_DEVICES assignment inside the script and select the GPU "
            "with torch.cuda.set_device(local_rank).", cost=0, primary=True)


def _visible_gpus(ranks: list[int], procs: int | None) -> int | None:
    """How many GPUs the processes saw, when the failed local ranks say it: the ranks below the first
    failed one got a GPU each (with every rank from it up to the last process failing)."""
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and (procs is None or ranks[-1] == procs - 1):
        return ranks[0]
    if procs == 2 and not ranks:
        return 1          # of two processes only local rank 1 can miss its GPU, unless none is visible
    return None


def _ordinal_text(ranks: list[int], procs: int | None, visible: int | None) -> str:
    launched = (f"The launcher started {procs} processes per node (--nproc_per_node={procs})" if procs else
                f"The launcher started at least {ranks[-1] + 1} processes per node" if ranks else "")
    failed = (f"local rank{'s' if len(ranks) > 1 else ''} {_and(ranks)} failed" if ranks else
              "a rank failed")
    if visible == 0:
        return (f"{launched + ', and ' if launched else ''}{failed} asking for GPU 0: this process sees no GPU at "
                "all - CUDA_VISIBLE_DEVICES is empty or names GPUs that do not exist.")
    if visible is not None:
        sees = "only GPU 0" if visible == 1 else f"only GPUs 0-{visible - 1}"
        first = ranks[0] if ranks else visible
        return (f"{launched + ', and ' if launched else ''}{failed} with 'invalid device ordinal': each rank "
                f"selects the GPU with its local rank's index, and this process sees {visible} GPU"
                f"{'s' if visible > 1 else ''}, so local rank {first}"
                + (" and above find" if ranks and len(ranks) > 1 else " finds") + f" {sees}. --nproc_per_node is "
                "larger than the number of visible GPUs, or CUDA_VISIBLE_DEVICES was narrowed (in the shell, or by "
                "the script itself, e.g. os.environ['CUDA_VISIBLE_DEVICES']='0').")
    return (f"{launched + ', and ' if launched else ''}{failed} with 'invalid device ordinal': a rank asked for "
            "a GPU index this process cannot see. --nproc_per_node is larger than the number of visible GPUs, or "
            "CUDA_VISIBLE_DEVICES was narrowed (in the shell, or by the script itself, e.g. "
            "os.environ['CUDA_VISIBLE_DEVICES']='0').")


def _and(items: list[int]) -> str:
    words = [str(x) for x in items[:16]]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _diag_nccl(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    if d.details.get("heartbeat"):
        _diag_heartbeat(d, out)
        if not d.collectives:
            _diag_consequence(ctx, out)
            return
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
            # (a rank that reported the heartbeat abort instead is not silent either)
            silent = sorted(set(range(ctx.world)) - {r for r in first if r is not None} - set(d.ranks))
        text = "All reporting ranks wait in the same collective, so some rank never joined it: it died (look for " \
               "its own error above), hangs, or is much slower (e.g. rank 0 evaluating or saving a checkpoint " \
               "while the others wait)."
        if silent:
            text += f" Ranks that did not report the timeout: {', '.join(map(str, silent[:16]))} - start there."
        out.diag("straggler_rank", text)
        out.fix("longer_timeout", "For legitimately long rank-0-only work, raise the timeout: "
                "init_process_group(timeout=timedelta(minutes=60)), or make the other ranks wait at a barrier "
                "after it", None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0)
    _diag_consequence(ctx, out)


def _diag_heartbeat(d: _Draft, out: _Out) -> None:
    secs = d.numbers.get("heartbeat_timeout_s")
    out.diag("nccl_watchdog_stuck", "ProcessGroupNCCL's heartbeat monitor aborted the process: the watchdog "
             "thread, which polls the enqueued collectives, made no progress for "
             + (f"{secs} s" if secs else "its timeout") + " (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC). The watchdog "
             "itself was blocked inside a NCCL or CUDA call (e.g. cudaEventDestroy): the GPU or NCCL was hung - "
             "usually a collective that another rank never joined (it died, or its code took another path), or "
             "another thread holding the GIL inside a CUDA call. A longer timeout only helps when the stall is "
             "legitimate.")
    out.fix("find_hung_rank", "Find the rank that did not arrive: py-spy dump --pid <pid> on each rank while it "
            "hangs, or the flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1) to "
            "dump each rank's last collectives; NCCL_DEBUG=INFO", None, None, "slower while debugging",
            _QUALITY_NONE, "", cost=0, primary=True)
    out.fix("heartbeat_timeout", "Only for a legitimate long stall (a slow checkpoint save on one rank): "
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=1800, or TORCH_NCCL_ENABLE_MONITORING=0", None, None, _SPEED_NONE,
            _QUALITY_NONE, "", cost=1)


def _diag_consequence(ctx: _Ctx, out: _Out) -> None:
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
    windows = "10048" in d.details.get("platform", "")
    out.diag("port_taken", f"Port {p} is already taken"
             + (" (Windows error 10048, WSAEADDRINUSE, whatever language its text is in)" if windows else "")
             + ": another torchrun job on this machine uses the default 29500 (two trainings at once), or a "
             "previous run's processes are still alive.")
    find = (f"`netstat -ano | findstr :{port or 29500}` shows the PID holding it; stop it with "
            "`taskkill /PID <pid> /F` (or close the old run)." if windows else
            f"Find the holder with `ss -ltnp | grep {port or 29500}` and stop leftover processes.")
    out.fix("other_port", "Give each job its own port: torchrun --master_port=29501 ... (or --rdzv-endpoint="
            "localhost:0 --standalone)", None, None, _SPEED_NONE, _QUALITY_NONE,
            ("Without torchrun set MASTER_PORT=29501 in the environment. " if windows else "") + find, cost=0,
            primary=True)


def _diag_p2p(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    source = d.details.get("source")
    if source in (NO_P2P, HANG):
        _diag_nccl_p2p(d, ctx, out)
        return
    if source == _RTX4000:
        out.diag("accelerate_rtx4000_p2p", "accelerate refused to start: RTX 4000-series (Ada GeForce) cards "
                 "do not support GPU peer-to-peer transfers, and NCCL would try P2P (and InfiniBand) and hang or "
                 "fail, so accelerate requires both to be disabled explicitly.")
        out.fix("nccl_p2p_ib_disable", "Set NCCL_P2P_DISABLE=\"1\" and NCCL_IB_DISABLE=\"1\" before the process "
                "starts, or launch with `accelerate launch` (which sets them for these cards)", None, None,
                "GPU-to-GPU traffic goes through host memory (slower than P2P would be)", _QUALITY_NONE,
                "export NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1 (or os.environ[...] at the very top of the script, "
                "before accelerate or torch.distributed is initialised).", cost=0, primary=True)
        return
    if source in (_TOPO, _DP_HANG):
        n = d.numbers.get("device_count") or ctx.world
        pairs = d.details.get("unsupported_pairs")
        what = (f"`nvidia-smi topo -p2p r` reports P2P not supported between {pairs}"
                if pairs else "The run hung in DataParallel's weight broadcast (torch/nn/parallel/comm.py "
                "broadcast_coalesced, called from replicate.py) and was interrupted with Ctrl-C")
        out.diag("dataparallel_p2p", f"{what}. DataParallel copies the weights from GPU 0 to every other GPU at "
                 "every forward, GPU to GPU; where the GPUs cannot reach each other peer-to-peer (common on "
                 "consumer boards and with some BIOS/IOMMU settings) it hangs or is very slow. "
                 "DistributedDataParallel does not need P2P: one process per GPU, gradients all-reduced by NCCL.")
        out.fix("ddp_not_dp", f"Use DistributedDataParallel instead of DataParallel: torchrun --standalone "
                f"--nproc_per_node={n or '<number of GPUs>'} train.py", None, None,
                "faster than DataParallel (no per-step weight copies, no GIL contention)", _QUALITY_NONE,
                "Wrap the model with DDP(model, device_ids=[local_rank]) after torch.cuda.set_device(local_rank) "
                "and use a DistributedSampler; the effective batch is the per-GPU batch x GPUs.", cost=1,
                primary=True)
        out.fix("nccl_p2p_disable", "If NCCL itself then hangs: NCCL_P2P_DISABLE=1 (NCCL copies through host "
                "memory)", None, None, "slower inter-GPU transfers", _QUALITY_NONE, "", cost=1)
        return
    out.diag("p2p_unsupported", "The GPUs cannot access each other's memory directly (peer-to-peer). Many "
             "consumer boards (and some BIOS/IOMMU settings) do not support it; `nvidia-smi topo -p2p r` shows it.")
    out.fix("nccl_p2p_disable", "NCCL_P2P_DISABLE=1 (NCCL then copies through host memory)", None, None,
            "slower inter-GPU transfers", _QUALITY_NONE, "", cost=1, primary=True)
    out.fix("ddp_not_dp", "Use DistributedDataParallel (one process per GPU) instead of DataParallel", None, None,
            "faster", _QUALITY_NONE, "DataParallel copies through GPU 0 with peer access and hangs or crawls "
            "without it; DDP over NCCL does not need P2P.", cost=1)


def _diag_nccl_oom(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    req = d.numbers.get("requested")
    size = f" {_F(req)}" if req is not None else ""
    out.diag("nccl_buffers_oom", f"NCCL could not allocate{size} of GPU memory for its own communication "
             "buffers: it allocates them with cudaMalloc itself, outside PyTorch's caching allocator, when a "
             "communicator is created or first used. The GPU was already full - PyTorch's cached (reserved) "
             "memory, this step's tensors or another process - so nothing was left for NCCL. This is an "
             "out-of-memory error, not a network or driver fault.")
    out.fix("free_memory_for_nccl", "Leave GPU memory for NCCL: a smaller micro-batch (with gradient "
            "accumulation), and PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so PyTorch's cache does not "
            "hoard freed memory", None, None, "slightly slower per sample", _QUALITY_NONE,
            "Initialising the process group and running one small all_reduce before building the model also "
            "lets NCCL take its buffers while the GPU is still empty.", cost=1, primary=True)
    out.fix("nccl_buffsize", "Smaller NCCL buffers: NCCL_BUFFSIZE=1048576 (the default is 4 MiB per channel "
            "and peer)", None, None, "slightly slower collectives", _QUALITY_NONE, "", cost=1)
    out.fix("check_other_processes", "Check what else is on the GPU: nvidia-smi (a leftover run, a second job, "
            "or several ranks on GPU 0 because torch.cuda.set_device(local_rank) is missing)", None, None,
            _SPEED_NONE, _QUALITY_NONE, "", cost=0)
