"""`oomdoctor gpus` and the NVML wrapper, against scenario fakes of pynvml (no driver needed)."""
import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from oomdoctor.runs import nvml
from oomdoctor.cli import cli
from oomdoctor.sim.gpus import PROFILES, MiB

RTX3090_TOTAL = 24576 * MiB    # what NVML reports for a 3090 (nvidia-smi: 24576MiB)


class NVMLError(Exception):
    pass


class FakeNvml:
    """A pynvml-like module: `gpus` is a list of dicts, `p2p`/`nvlink` sets of index pairs."""

    def __init__(self, gpus=(), p2p=(), nvlink=(), init_error=None, names=None):
        self.NVMLError = NVMLError
        self.gpus = list(gpus)
        self.p2p, self.nvlink = set(p2p), set(nvlink)
        self.init_error = init_error
        self.names = names or {}
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1
        if self.init_error:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return "550.54.14"

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.gpus[h]["name"].encode()   # old pynvml returned bytes

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:08x}-aaaa"

    def nvmlDeviceGetMemoryInfo(self, h):
        g = self.gpus[h]
        return SimpleNamespace(used=g["used"], total=g["total"], free=g["total"] - g["used"])

    def nvmlDeviceGetUtilizationRates(self, h):
        if self.gpus[h].get("mig"):
            raise NVMLError("Not Supported")   # what NVML answers for a MIG-enabled GPU
        return SimpleNamespace(gpu=self.gpus[h].get("util", 0), memory=0)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 45

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self.gpus[h]["cc"]

    def nvmlDeviceGetMigMode(self, h):
        m = int(self.gpus[h].get("mig", False))
        return [m, m]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used)
                for pid, used in self.gpus[h].get("procs", [])]

    def nvmlSystemGetProcessName(self, pid):
        return self.names.get(pid, "python")

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        pairs = self.nvlink if index == nvml.P2P_CAPS_INDEX_NVLINK else self.p2p | self.nvlink
        return 0 if (a, b) in pairs or (b, a) in pairs else 2   # 2: CHIPSET_NOT_SUPPORTED


def rtx3090(used=300 * MiB, util=0, procs=()):
    return {"name": "NVIDIA GeForce RTX 3090", "used": used, "total": RTX3090_TOTAL,
            "cc": (8, 6), "util": util, "procs": list(procs)}


def report(fake, environ=None, cores=16, port_free=True):
    return nvml.gpus_report(nvml.Nvml(fake), environ or {}, cores, lambda p: port_free)


# -- the wrapper ------------------------------------------------------------------------------

def test_no_driver_degrades_to_none():
    nv = nvml.Nvml(FakeNvml(init_error="Driver Not Loaded"))
    assert nv.available() is False
    assert "Driver Not Loaded" in nv.error and "no NVIDIA driver" in nv.error
    assert nv.call("nvmlDeviceGetCount") is None and nv.device_count() == 0


def test_init_is_lazy_and_once():
    fake = FakeNvml([rtx3090()])
    nv = nvml.Nvml(fake)
    assert fake.inits == 0              # constructing the wrapper touches nothing
    nv.device_count(), nv.device_count()
    assert fake.inits == 1


def test_a_failing_query_is_none_not_an_exception():
    nv = nvml.Nvml(FakeNvml([rtx3090()]))
    assert nv.call("nvmlDeviceGetNoSuchThing", 0) is None
    assert nv.call("nvmlDeviceGetMemoryInfo", 5) is None   # IndexError inside the fake


# -- scenarios --------------------------------------------------------------------------------

def test_no_driver_report():
    r = report(FakeNvml(init_error="NVML Shared Library Not Found"))
    assert not r.available and r.gpus == () and "nvidia-smi" in r.error
    json.dumps(r.to_json())


def test_two_3090_without_p2p():
    r = report(FakeNvml([rtx3090(), rtx3090()]))
    assert r.available and len(r.gpus) == 2
    g = r.gpus[0]
    assert g.memory_line() == "GPU 0: 300/24576 MiB (1.2%)"
    assert g.name == "NVIDIA GeForce RTX 3090" and g.compute_capability == (8, 6)
    assert g.bf16 is True and g.profile == "rtx3090" and g.mig_enabled is False
    assert r.links == (nvml.Link(0, 1, False, False),)
    p2p = [w for w in r.warnings if w.startswith("P2P not supported")]
    assert len(p2p) == 1 and "DataParallel will be slow or hang; use DDP" in p2p[0]
    # two processes on 16 cores: 8 threads each
    assert r.env.torch_sees == (0, 1) and r.env.processes == 2 and r.env.omp_recommended == 8
    assert any("OMP_NUM_THREADS=8" in w for w in r.warnings)


def test_nvlink_pair_has_no_p2p_warning():
    r = report(FakeNvml([rtx3090(), rtx3090()], nvlink={(0, 1)}))
    assert r.links == (nvml.Link(0, 1, True, True),)
    assert not any("P2P" in w for w in r.warnings)
    assert "NVLink" in nvml.render_text(r)


def test_another_process_holding_memory():
    fake = FakeNvml([rtx3090(used=10 * 1024 * MiB, procs=[(4242, 10000 * MiB)]), rtx3090()],
                    names={4242: "/usr/bin/python3"})
    r = report(fake)
    assert r.gpus[0].processes == (nvml.GpuProcess(4242, "/usr/bin/python3", 10000 * MiB),)
    w = [w for w in r.warnings if w.startswith("GPU 0 is in use")]
    assert len(w) == 1 and "4242 python3" in w[0] and "14.00 GiB" in w[0]
    text = nvml.render_text(r)
    assert "GPU 0: 10240/24576 MiB (41.7%)" in text and "10000 MiB" in text


def test_two_jobs_sharing_a_gpu_are_flagged():
    r = report(FakeNvml([rtx3090(procs=[(100, 5 * 2**30), (200, 6 * 2**30)]), rtx3090()]))
    w = [w for w in r.warnings if "shared by 2 processes" in w]
    assert len(w) == 1 and "CUDA_VISIBLE_DEVICES=0" in w[0]


def test_mig_enabled():
    a100 = {"name": "NVIDIA A100-SXM4-80GB", "used": 0, "total": PROFILES["a100-80"].total_bytes,
            "cc": (8, 0), "mig": True}
    r = report(FakeNvml([a100]))
    g = r.gpus[0]
    assert g.mig_enabled is True and g.util_percent is None and g.profile == "a100-80"
    assert any("MIG enabled" in w and "MIG-<uuid>" in w for w in r.warnings)
    assert "?" in nvml.render_text(r)    # util unknown, shown as '?'


def test_cuda_visible_devices_and_local_rank():
    fake = FakeNvml([rtx3090(), rtx3090()])
    r = report(fake, {"CUDA_VISIBLE_DEVICES": "1", "LOCAL_RANK": "1", "RANK": "1",
                      "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29501"})
    assert r.env.torch_sees == (1,) and r.env.master_port == 29501
    assert r.env.launch_vars["WORLD_SIZE"] == "2"
    assert any("invalid device ordinal" in w for w in r.warnings)
    assert not any(w.startswith("P2P") for w in r.warnings)   # only one GPU visible
    assert "cuda:0 -> GPU 1" in nvml.render_text(r)


@pytest.mark.parametrize("value, expected", [
    (None, (0, 1)), ("", ()), ("-1", ()), ("1,0", (1, 0)), ("0,7,1", (0,)), ("0,0", (0,)),
    ("GPU-00000001", (1,)), (" 1 ", (1,)),
])
def test_visible_indices(value, expected):
    gpus = report(FakeNvml([rtx3090(), rtx3090()])).gpus
    assert nvml.visible_indices(value, gpus) == expected


def test_port_in_use_is_reported():
    r = report(FakeNvml([rtx3090()]), {"MASTER_PORT": "29500"}, port_free=False)
    assert r.env.master_port_free is False
    assert any("port 29500 is taken" in w for w in r.warnings)


def test_port_free_really_binds():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert nvml.port_free(s.getsockname()[1]) is False


# -- the command ------------------------------------------------------------------------------

def _cli(monkeypatch, fake, *args):
    monkeypatch.setattr(nvml.Nvml, "__init__", lambda self, lib=None: (
        setattr(self, "_lib", fake), setattr(self, "_ready", None),
        setattr(self, "error", None))[0])
    for k in ("CUDA_VISIBLE_DEVICES",) + nvml.LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    return CliRunner().invoke(cli, ["gpus", *args])


def test_cli_no_driver_exit_4_valid_json(monkeypatch):
    res = _cli(monkeypatch, FakeNvml(init_error="Driver Not Loaded"), "--json")
    assert res.exit_code == nvml.EXIT_NO_DRIVER == 4
    d = json.loads(res.stdout)
    assert d["available"] is False and d["gpus"] == [] and "Driver Not Loaded" in d["error"]
    assert "error:" in res.stderr and "nvidia-smi" in res.stderr


def test_cli_text_and_json(monkeypatch):
    fake = FakeNvml([rtx3090(used=2340 * MiB, util=97), rtx3090()])
    res = _cli(monkeypatch, fake)
    assert res.exit_code == 0 and res.stderr == ""
    assert "GPU 0: 2340/24576 MiB (9.5%)" in res.stdout and "97%" in res.stdout
    assert "P2P not supported" in res.stdout
    d = json.loads(_cli(monkeypatch, fake, "--json").stdout)
    assert d["gpus"][0]["used_bytes"] == 2340 * MiB and d["gpus"][0]["total_bytes"] == RTX3090_TOTAL
    assert d["links"] == [{"a": 0, "b": 1, "p2p": False, "nvlink": False}]


def test_help_imports_neither_torch_nor_nvml():
    import subprocess
    import sys
    code = ("import sys; from click.testing import CliRunner; from oomdoctor.cli import cli; "
            "r = CliRunner().invoke(cli, ['--help']); assert r.exit_code == 0; "
            "assert 'gpus' in r.output and 'watch' in r.output; "
            "print('torch' in sys.modules, 'pynvml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False"   # pynvml never imported by --help
