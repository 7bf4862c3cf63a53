"""The one NVML choke point, and `oomdoctor gpus`: cards, processes, P2P/NVLink, launch environment.

    oomdoctor gpus            # what nvidia-smi says, plus what it means for a training run
    oomdoctor gpus --json

Nothing here touches the driver at import time. `Nvml` imports `pynvml` and calls `nvmlInit`
on first use; every call that fails (no driver, a query the card does not support, a MIG
instance without utilisation counters) returns None instead of raising, in the manner of
gpustat/nvitop. Tests inject a fake `pynvml`-like object (`Nvml(lib=fake)`).

Known limitations: indices are NVML's (PCI bus order, as nvidia-smi shows); CUDA numbers the
GPUs fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, which only matters on mixed cards.
MIG instances are reported as a flag on their parent GPU, not one by one.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from oomdoctor.sim.gpus import PROFILES, GiB, MiB

# nvml.h constants, spelled out: pynvml 12.x defines NVML_P2P_CAPS_INDEX_READ as the tuple
# `(0,)` (a stray trailing comma), so its own name cannot be passed through safely.
P2P_CAPS_INDEX_READ = 0
P2P_CAPS_INDEX_NVLINK = 2
P2P_STATUS_OK = 0
TEMPERATURE_GPU = 0
DEFAULT_MASTER_PORT = 29500     # torchrun's default (torch/distributed/run.py, --master-port)

EXIT_NO_DRIVER = 4              # `oomdoctor gpus`: no NVIDIA driver or no GPU

NO_DRIVER_FIX = ("install the NVIDIA driver (check with `nvidia-smi`), or run on the machine "
                 "that has the GPUs; inside a container pass --gpus all / the NVIDIA runtime")


class Nvml:
    """Lazy NVML: initialised on first use, every failure degrades to None."""

    def __init__(self, lib: Any = None):
        self._lib = lib
        self._ready: bool | None = None
        self.error: str | None = None     # why NVML is unavailable, once known

    def available(self) -> bool:
        if self._ready is None:
            self._ready = self._init()
        return self._ready

    def _init(self) -> bool:
        try:
            if self._lib is None:
                import pynvml
                self._lib = pynvml
            self._lib.nvmlInit()
            return True
        except ImportError:
            self.error = ("the nvidia-ml-py package (pynvml) is not installed: "
                          "pip install nvidia-ml-py")
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.error = f"NVML could not start ({_errstr(e)}): no NVIDIA driver or no GPU here"
        return False

    def call(self, name: str, *args: Any) -> Any:
        """lib.<name>(*args), or None when NVML is unavailable or the call fails."""
        if not self.available():
            return None
        try:
            return getattr(self._lib, name)(*args)
        except Exception:   # NVMLError (NotSupported under MIG, ...) or a pynvml without it
            return None

    def shutdown(self) -> None:
        if self._ready:
            self.call("nvmlShutdown")
            self._ready = None

    # -- the handful of queries oomdoctor needs --------------------------------------------
    def device_count(self) -> int:
        return self.call("nvmlDeviceGetCount") or 0

    def handle(self, index: int) -> Any:
        return self.call("nvmlDeviceGetHandleByIndex", index)

    def memory(self, h: Any) -> tuple[int, int] | None:
        m = self.call("nvmlDeviceGetMemoryInfo", h)
        return (int(m.used), int(m.total)) if m is not None else None

    def utilization(self, h: Any) -> int | None:
        u = self.call("nvmlDeviceGetUtilizationRates", h)
        return int(u.gpu) if u is not None else None


def _errstr(e: BaseException) -> str:
    s = str(e)
    return s.decode() if isinstance(s, bytes) else (s or type(e).__name__)


def _text(x: Any) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int | None      # None: the driver does not say (e.g. Windows WDDM, MIG)


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str | None
    used_bytes: int | None
    total_bytes: int | None
    util_percent: int | None
    temperature_c: int | None
    compute_capability: tuple[int, int] | None
    bf16: bool | None
    profile: str | None         # the matching `--gpu` profile, if any
    mig_enabled: bool | None
    processes: tuple[GpuProcess, ...] = ()

    def memory_line(self) -> str:
        """The users' format: `GPU 0: 2340/24576 MiB (9.5%)`."""
        if self.used_bytes is None or not self.total_bytes:
            return f"GPU {self.index}: memory unknown"
        return (f"GPU {self.index}: {self.used_bytes // MiB}/{self.total_bytes // MiB} MiB "
                f"({100 * self.used_bytes / self.total_bytes:.1f}%)")


@dataclass(frozen=True)
class Link:
    a: int
    b: int
    p2p: bool | None            # None: NVML could not say
    nvlink: bool | None


@dataclass(frozen=True)
class LaunchEnv:
    cuda_visible_devices: str | None
    torch_sees: tuple[int, ...]             # NVML indices torch will number cuda:0, cuda:1, ...
    launch_vars: dict[str, str]             # LOCAL_RANK, RANK, WORLD_SIZE, ... that are set
    master_port: int
    master_port_free: bool | None           # None: not checked (not a number)
    cpu_cores: int
    processes: int                          # training processes on this machine
    omp_num_threads: str | None
    omp_recommended: int


@dataclass(frozen=True)
class GpusReport:
    available: bool
    error: str | None
    driver_version: str | None
    gpus: tuple[Gpu, ...]
    links: tuple[Link, ...]
    env: LaunchEnv
    warnings: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for g, src in zip(d["gpus"], self.gpus):
            g["memory_line"] = src.memory_line()
        return d


def _profile_for(name: str, total: int | None, cc: tuple[int, int] | None):
    """The PROFILES entry for this card: same compute capability, capacity within 1 GiB."""
    if total is None or cc is None:
        return None
    for p in PROFILES.values():
        if p.compute_capability == cc and abs(p.total_bytes - total) < GiB:
            return p
    return None


def read_gpu(nv: Nvml, index: int) -> Gpu:
    h = nv.handle(index)
    name = _text(nv.call("nvmlDeviceGetName", h) or "unknown GPU")
    uuid = nv.call("nvmlDeviceGetUUID", h)
    mem = nv.memory(h)
    cc = nv.call("nvmlDeviceGetCudaComputeCapability", h)
    cc = (int(cc[0]), int(cc[1])) if cc is not None else None
    prof = _profile_for(name, mem[1] if mem else None, cc)
    mig = nv.call("nvmlDeviceGetMigMode", h)
    procs = []
    for p in nv.call("nvmlDeviceGetComputeRunningProcesses", h) or []:
        used = getattr(p, "usedGpuMemory", None)
        pname = nv.call("nvmlSystemGetProcessName", p.pid)
        procs.append(GpuProcess(int(p.pid), _text(pname) if pname else "?",
                                int(used) if used is not None else None))
    return Gpu(index, name, _text(uuid) if uuid else None,
               mem[0] if mem else None, mem[1] if mem else None,
               nv.utilization(h), nv.call("nvmlDeviceGetTemperature", h, TEMPERATURE_GPU),
               cc, prof.bf16 if prof else (cc >= (8, 0) if cc else None),
               prof.name if prof else None,
               bool(mig[0]) if mig is not None else None, tuple(procs))


def read_links(nv: Nvml, n: int) -> tuple[Link, ...]:
    handles = [nv.handle(i) for i in range(n)]
    out = []
    for a in range(n):
        for b in range(a + 1, n):
            p2p = nv.call("nvmlDeviceGetP2PStatus", handles[a], handles[b], P2P_CAPS_INDEX_READ)
            nvl = nv.call("nvmlDeviceGetP2PStatus", handles[a], handles[b],
                          P2P_CAPS_INDEX_NVLINK)
            out.append(Link(a, b, None if p2p is None else p2p == P2P_STATUS_OK,
                            None if nvl is None else nvl == P2P_STATUS_OK))
    return tuple(out)


def visible_indices(value: str | None, gpus: tuple[Gpu, ...] | int) -> tuple[int, ...]:
    """The NVML indices CUDA exposes for CUDA_VISIBLE_DEVICES=value, in the order torch numbers
    them. CUDA stops at the first entry that is not a valid index or UUID prefix (CUDA C
    Programming Guide, "CUDA Environment Variables"): `0,7,1` with two GPUs exposes only 0."""
    n = gpus if isinstance(gpus, int) else len(gpus)
    uuids = [] if isinstance(gpus, int) else [g.uuid or "" for g in gpus]
    if value is None:
        return tuple(range(n))
    out: list[int] = []
    for tok in (t.strip() for t in value.split(",")):
        if tok.isdigit() and int(tok) < n:
            i = int(tok)
        else:
            hits = [i for i, u in enumerate(uuids) if tok and u.startswith(tok)]
            if len(hits) != 1:
                break
            i = hits[0]
        if i in out:      # a duplicate also ends the list for CUDA
            break
        out.append(i)
    return tuple(out)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when a socket can bind host:port now (what torchrun's rendezvous store needs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))    # what this process may use (taskset, cgroups)
    except AttributeError:
        return os.cpu_count() or 1


LAUNCH_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")


def launch_env(environ: Mapping[str, str], gpus: tuple[Gpu, ...], cores: int,
               is_port_free: Callable[[int], bool] = port_free) -> LaunchEnv:
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    sees = visible_indices(cvd, gpus)
    lv = {k: environ[k] for k in LAUNCH_VARS if k in environ}
    port_s = environ.get("MASTER_PORT", str(DEFAULT_MASTER_PORT))
    port = int(port_s) if port_s.isdigit() else DEFAULT_MASTER_PORT
    free = is_port_free(port) if port_s.isdigit() else None
    procs = environ.get("LOCAL_WORLD_SIZE") or ""
    nprocs = int(procs) if procs.isdigit() else max(1, len(sees))   # one process per GPU
    nprocs = max(1, nprocs)
    return LaunchEnv(cvd, sees, lv, port, free, cores, nprocs,
                     environ.get("OMP_NUM_THREADS"), max(1, cores // nprocs))


def _warnings(gpus: tuple[Gpu, ...], links: tuple[Link, ...], env: LaunchEnv) -> list[str]:
    w: list[str] = []
    for g in gpus:
        pids = sorted({p.pid for p in g.processes})
        held = sum(p.used_bytes or 0 for p in g.processes)
        who = ", ".join(f"{p.pid} {os.path.basename(p.name)}" for p in g.processes)
        if len(pids) >= 2:
            w.append(f"GPU {g.index} is shared by {len(pids)} processes ({who}): two trainings "
                     f"on the same GPU make the second one OOM or both crawl; give each job its "
                     f"own GPU (CUDA_VISIBLE_DEVICES=0 python a.py; CUDA_VISIBLE_DEVICES=1 "
                     f"python b.py)")
        elif pids:
            free = (g.total_bytes - g.used_bytes) if g.total_bytes and g.used_bytes is not None \
                else None
            w.append(f"GPU {g.index} is in use by {who} holding {held / GiB:.2f} GiB"
                     + (f"; a new job there gets at most {free / GiB:.2f} GiB" if free else "")
                     + ": wait for it, or pick another GPU with CUDA_VISIBLE_DEVICES")
        if g.mig_enabled:
            w.append(f"GPU {g.index} has MIG enabled: CUDA sees MIG instances, not the whole "
                     f"GPU, one instance per process, and utilisation is not reported; select "
                     f"one with CUDA_VISIBLE_DEVICES=MIG-<uuid> (`nvidia-smi -L`), or disable "
                     f"MIG (`sudo nvidia-smi -i {g.index} -mig 0`) to train on the whole card")
    visible = set(env.torch_sees)
    no_p2p = [ln for ln in links if ln.p2p is False and {ln.a, ln.b} <= visible]
    if no_p2p:
        pairs = ", ".join(f"{ln.a}-{ln.b}" for ln in no_p2p)
        w.append(f"P2P not supported between GPUs {pairs}: DataParallel will be slow or hang; "
                 f"use DDP (torchrun --nproc-per-node {len(visible)} train.py), which does not "
                 f"need P2P (NCCL goes through host memory)")
    names = {g.name for g in gpus if g.index in visible}
    if len(names) > 1:
        w.append("the visible GPUs differ: CUDA numbers them fastest-first, nvidia-smi by PCI "
                 "bus; set CUDA_DEVICE_ORDER=PCI_BUS_ID so both use the indices shown here")
    if env.cuda_visible_devices is not None and gpus and not env.torch_sees:
        w.append(f"CUDA_VISIBLE_DEVICES={env.cuda_visible_devices!r} hides every GPU: torch will "
                 f"run on the CPU; unset it or list indices 0..{len(gpus) - 1}")
    lr = env.launch_vars.get("LOCAL_RANK", "")
    if lr.isdigit() and int(lr) >= len(env.torch_sees) and gpus:
        w.append(f"LOCAL_RANK={lr} but torch sees {len(env.torch_sees)} GPU(s): "
                 f"torch.cuda.set_device({lr}) fails with 'invalid device ordinal'; do not pin "
                 f"CUDA_VISIBLE_DEVICES to one GPU inside a multi-GPU launch")
    if env.master_port_free is False and "RANK" not in env.launch_vars:
        w.append(f"port {env.master_port} is taken on localhost: torchrun fails with 'address "
                 f"already in use' (another run?); pass --master-port with a free port, e.g. "
                 f"{env.master_port + 1}")
    if env.omp_num_threads is None and env.processes > 1:
        w.append(f"OMP_NUM_THREADS is unset: torchrun sets it to 1, which starves a CPU-bound "
                 f"data pipeline; export OMP_NUM_THREADS={env.omp_recommended} "
                 f"({env.cpu_cores} cores / {env.processes} processes)")
    return w


def gpus_report(nv: Nvml, environ: Mapping[str, str] | None = None, cores: int | None = None,
                is_port_free: Callable[[int], bool] = port_free) -> GpusReport:
    """Everything `oomdoctor gpus` shows; `available` is False without a driver or GPU."""
    environ = os.environ if environ is None else environ
    cores = cores or cpu_cores()
    if not nv.available():
        env = launch_env(environ, (), cores, is_port_free)
        return GpusReport(False, f"{nv.error}; {NO_DRIVER_FIX}", None, (), (), env,
                          tuple(_warnings((), (), env)))
    n = nv.device_count()
    if n == 0:
        env = launch_env(environ, (), cores, is_port_free)
        return GpusReport(False, f"the NVIDIA driver sees no GPU; {NO_DRIVER_FIX}", None, (),
                          (), env, ())
    drv = nv.call("nvmlSystemGetDriverVersion")
    gpus = tuple(read_gpu(nv, i) for i in range(n))
    links = read_links(nv, n)
    env = launch_env(environ, gpus, cores, is_port_free)
    return GpusReport(True, None, _text(drv) if drv else None, gpus, links, env,
                      tuple(_warnings(gpus, links, env)))


def _yn(x: bool | None) -> str:
    return "?" if x is None else ("yes" if x else "no")


def render_text(r: GpusReport) -> str:
    from tabulate import tabulate
    lines: list[str] = []
    if not r.available:
        lines.append("no NVIDIA GPU or driver: see the error on stderr")
    else:
        lines.append(f"NVIDIA driver {r.driver_version or '?'}, {len(r.gpus)} GPU(s)")
        rows = []
        for g in r.gpus:
            cc = f"{g.compute_capability[0]}.{g.compute_capability[1]}" \
                if g.compute_capability else "?"
            rows.append([g.memory_line(), g.name,
                         "?" if g.util_percent is None else f"{g.util_percent}%",
                         "?" if g.temperature_c is None else f"{g.temperature_c}C", cc,
                         _yn(g.bf16), "on" if g.mig_enabled else "off",
                         len(g.processes)])
        lines.append(tabulate(rows, ["memory", "name", "util", "temp", "cc", "bf16", "MIG",
                                     "procs"]))
        procs = [[g.index, p.pid, p.name,
                  "?" if p.used_bytes is None else f"{p.used_bytes // MiB} MiB"]
                 for g in r.gpus for p in g.processes]
        if procs:
            lines += ["", tabulate(procs, ["GPU", "pid", "process", "memory"])]
        if r.links:
            n = len(r.gpus)
            head = [""] + [str(i) for i in range(n)]
            m = {(ln.a, ln.b): ln for ln in r.links}
            rows = []
            for a in range(n):
                row = [str(a)]
                for b in range(n):
                    ln = m.get((min(a, b), max(a, b)))
                    row.append("X" if a == b else
                               "NVLink" if ln.nvlink else
                               "OK" if ln.p2p else "?" if ln.p2p is None else "no")
                rows.append(row)
            lines += ["", "P2P (read) between GPUs:", tabulate(rows, head)]
    e = r.env
    cvd = e.cuda_visible_devices if e.cuda_visible_devices is not None else "(unset)"
    lines += ["", f"CUDA_VISIBLE_DEVICES={cvd}: torch sees {len(e.torch_sees)} GPU(s)"
              + (" = " + ", ".join(f"cuda:{k} -> GPU {i}" for k, i in enumerate(e.torch_sees))
                 if e.torch_sees else "")]
    lines.append("launch variables: " + (", ".join(f"{k}={v}" for k, v in e.launch_vars.items())
                                         or "none set (not under torchrun)"))
    if e.master_port_free is not None:
        state = "free" if e.master_port_free else "IN USE"
        lines.append(f"port {e.master_port} on localhost: {state}")
    lines.append(f"OMP_NUM_THREADS={e.omp_num_threads or '(unset)'}; recommended "
                 f"{e.omp_recommended} ({e.cpu_cores} cores / {e.processes} process(es))")
    if r.warnings:
        lines += [""] + [f"warning: {w}" for w in r.warnings]
    return "\n".join(lines)
