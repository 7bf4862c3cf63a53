"""Host-memory failures: CPU allocator and NumPy, Windows paging file, OOM killer, DataLoader workers, /dev/shm."""
from __future__ import annotations

import re

from ..diagnosis import _F, _QUALITY_NONE, _SPEED_NONE, _Ctx, _Out
from ..draft import _Draft
from ..evidence import _host_memory_diag
from ..results import Kind, Phase
from ..sizes import GiB, _to_bytes
from .patterns import _I, _SZ, _AnchorSpec, _rx

# --- message anchors (squashed text) ---------------------------------------------------------

_ANCHORS: tuple[_AnchorSpec, ...] = (
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
    _AnchorSpec(Kind.SHARED_MEMORY, ("sharedmemory", "</torch_", "buserror", "sharedmemorysegment", "-7", "135",
                                     "semlock"), re.compile(
        r"insufficientsharedmemory|outofsharedmemory|raiseyoursharedmemorylimit"
        r"|unabletowritetofile</torch_|Unexpectedbuserrorencounteredinworker"
        r"|unabletoopensharedmemoryobject</torch_"
        # a DataLoader's semaphores live in /dev/shm too: "SemLock(...) OSError: [Errno 28] No space
        # left on device" is a full /dev/shm, not a full disk
        r"|_multiprocessing\.SemLock\(.{0,400}?\[Errno28\]Nospaceleftondevice"
        r"|Errorwhilecreatingsharedmemorysegment"
        # torchrun reports a child killed by SIGBUS as exitcode -7: a full /dev/shm, almost always.
        r"|exitcode:?-7(?!\d)"
        # other launchers name the signal or give the shell's 128 + 7: MPICH/Intel MPI "APPLICATION TERMINATED
        # WITH THE EXIT STRING: Bus error (signal 7)", "EXIT CODE: 135", DeepSpeed "exits with return code = -7"
        r"|Buserror\(signal7\)|(?:exitcode|exitstatus|exitedwithcode):?135(?!\d)|exitswithreturncode=?-7(?!\d)",
        _I), absorb=400),
)

# Matched per (unsquashed) line: a message whose meaning depends on being alone (shells' 'Killed': kills.py).
_BUS_ERROR_LINE = re.compile(r"^(?:.*\s)?Bus error(?: \(core dumped\))?\.?$")


# --- field patterns (squashed text) ----------------------------------------------------------

_F_CPU_BYTES = _rx(r"youtriedtoallocate(\d+)bytes")
_F_CPU_GB = _rx(r"youtriedtoallocate(\d+)GB")
_F_NUMPY = _rx(r"Unabletoallocate" + _SZ + r"foranarraywithshape\(([\d,]*)\)anddatatype(\w+)")

_F_DL_PIDS = _rx(r"DataLoaderworker\(pid(?:\(s\))?([\d,]+)\)")
_F_DL_SIGNAL = _rx(r"iskilledbysignal:(Killed|Buserror|Segmentationfault|Aborted|Terminated|\w{1,20}?)(?:\.|It|$)")
# The kernel's own report (mm/oom_kill.c, __oom_kill_process): "Out of memory: Killed process <pid>
# (<comm>) total-vm:<n>kB, anon-rss:<n>kB, file-rss:<n>kB, shmem-rss:<n>kB, ..." (older kernels:
# "Kill process <pid> (<comm>) score <n> or sacrifice child" then "Killed process ...").
# RHEL/CentOS 6 print "Killed process <pid>, UID <uid>, (<comm>) total-vm:..."; kB figures can arrive
# grouped by commas ("total-vm:26,184,840kB").
_F_DMESG_KILL = _rx(r"Killedprocess(\d+),?(?:UID:?\d+,?)?\(([^)]{0,64})\),?(?:UID:?\d+,?)?total-vm:([\d,]+)kB,"
                    r"anon-rss:([\d,]+)kB(?:,file-rss:([\d,]+)kB)?(?:,shmem-rss:([\d,]+)kB)?")
_F_RANK_TORCHRUN = _rx(r"(?:^|\W)rank:(\d+)\(local_rank|local_rank:(\d+)")


# --- extractors: squashed message text -> draft ----------------------------------------------

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


def _x_oom_killer(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.OOM_KILLER)
    text = m.group(0).lower()
    if text.startswith("killed:9") or text.startswith("terminatedbysignal"):
        d.details["source"] = "shell reported the kill (SIGKILL)"
    elif "exitcode" in text and "137" not in text or "signal9" in text or "sigkill" in text or "returncode" in text:
        d.details["source"] = "launcher reported SIGKILL (exit code -9)"
    elif ("outofmemory:kill" in text or text.startswith("killedprocess") or span.lower().startswith(
            "oom-kill:constraint") or pre.lower().endswith("invoked")):
        d.details["source"] = "kernel log (dmesg)"
    elif text.startswith("killed:9") or text.startswith("terminatedbysignal"):
        d.details["source"] = "shell reported the kill (SIGKILL)"
    elif "oom" in text or "outofmemory" in text or "out_of_memory" in text:
        d.details["source"] = "scheduler/container OOM kill (Slurm/Kubernetes)"
    else:
        d.details["source"] = "exit status 137 (128 + SIGKILL)"
    kill = _F_DMESG_KILL.search(span[:400])
    if kill:
        d.numbers["pid"] = int(kill.group(1))
        d.details["process"] = kill.group(2)
        for key, group in (("total_vm", 3), ("anon_rss", 4), ("file_rss", 5), ("shmem_rss", 6)):
            if kill.group(group) is not None:
                d.numbers[key] = int(kill.group(group).replace(",", "")) * 1024
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
    low = m.group(0).lower()
    if low.startswith("exitcode") and low.endswith("-7"):
        d.details["signal"] = "SIGBUS (torchrun exitcode -7)"
        _add_torchrun_rank(d, span)
    elif low.endswith(("135", "-7", "signal7)")):
        d.details["signal"] = "SIGBUS (the launcher's exit code or exit string)"
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


# --- diagnosis -------------------------------------------------------------------------------

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
    rss = d.numbers.get("anon_rss")
    if rss is not None:
        pid, name = d.numbers.get("pid"), d.details.get("process", "?")
        out.diag("host_oom_killer", f"The Linux kernel's OOM killer killed process {pid} ({name}), which held "
                 f"{_F(rss)} of host RAM of its own (anon-rss: heap, Python objects, tensors on the CPU"
                 + (f"; {_F(d.numbers['shmem_rss'])} more in shared memory" if d.numbers.get("shmem_rss") else "")
                 + "). Host RAM ran out, not GPU memory: the machine (or its cgroup/container limit) had no more "
                 "to give. Everything else running at the time - other ranks, DataLoader workers - counts too.")
    out.diag("host_oom_killer", "The process was killed with SIGKILL (" + d.details.get("source", "") + "), which "
             "without an error message almost always means the Linux OOM killer or the job scheduler's memory "
             "limit: host RAM, not GPU memory, ran out. Confirm with `dmesg -T | grep -i oom` or the scheduler's "
             "accounting (sacct MaxRSS).")
    if rss is None:
        _host_memory_diag(d, ctx, out)
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
    if d.details.get("caught"):
        _diag_caught_sigbus(d, out)
        return
    sigbus = d.details.get("signal", "")
    lead = (f"The process died of SIGBUS ({sigbus.split('(', 1)[1].rstrip(')')}), which in a training job almost "
            "always means a full /dev/shm. " if sigbus.startswith("SIGBUS (") else "")
    out.diag("shared_memory_exhausted", lead + "Shared memory (/dev/shm) is full: DataLoader workers hand batches to "
             "the main process through it, and NCCL uses it between processes on one machine. Docker gives "
             "containers only 64 MB of /dev/shm by default. This is host memory, not the GPU.")
    out.fix("grow_shm", "Give the container more shared memory: docker run --shm-size=16g (or --ipc=host); on "
            "Kubernetes mount an emptyDir with medium: Memory at /dev/shm", None, None, _SPEED_NONE, _QUALITY_NONE,
            "", cost=0, primary=True)
    out.fix("fewer_workers", "Fewer workers / smaller batches, or "
            "torch.multiprocessing.set_sharing_strategy('file_system')", None, None,
            "slower if data loading is the bottleneck", _QUALITY_NONE, "", cost=1)


def _diag_caught_sigbus(d: _Draft, out: _Out) -> None:
    """Signal 7 caught in native code (formats/signals.py): a page of a memory-mapped file that cannot be
    backed. Among NCCL's output that file is NCCL's shared-memory segment in /dev/shm."""
    lib = d.details.get("library", "")
    nccl = "NCCL" in lib or d.details.get("nccl_debug_output") == "yes"
    host = d.details.get("container_host")
    where = (f" inside NCCL ({lib.split(', in ', 1)[1]})" if ", in " in lib and "NCCL" in lib
             else " inside NCCL" if nccl else f" inside {lib}" if lib else "")
    out.diag("shared_memory_sigbus", f"Signal 7 (SIGBUS, bus error) was caught{where}. A bus error means a "
             "process touched a page of a memory-mapped file that cannot be backed: "
             + ("NCCL's processes on one machine exchange data through shared-memory segments in /dev/shm, and "
                "when /dev/shm is smaller than what NCCL maps the first access past it raises SIGBUS"
                if nccl else "a file in /dev/shm (DataLoader batches, NCCL's segments) on a full /dev/shm")
             + ". In a container that is the container's /dev/shm size: Docker gives 64 MB unless told otherwise."
             + (f" The host name {host} in the log's prefixes is a Docker container id: this ran in a container."
                if host else ""))
    out.fix("grow_shm", "Give the container more shared memory: docker run --shm-size=16g (or --ipc=host); on "
            "Kubernetes mount an emptyDir with medium: Memory at /dev/shm; check the size with df -h /dev/shm",
            None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0, primary=True)
    if nccl:
        out.fix("nccl_shm_disable", "To confirm, rerun with NCCL_SHM_DISABLE=1: NCCL then skips /dev/shm (and "
                "the bus error goes away if it was the cause)", None, None,
                "slower GPU-to-GPU transfers inside the machine (falls back to sockets/P2P)", _QUALITY_NONE, "",
                cost=1)
