"""The GPUs to plan for: the card, how many, the link between them (detected or defaulted)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from oomdoctor.sim.gpus import GpuProfile


# Per-direction GB/s between two GPUs. PCIe 4.0 x16 moves ~25 GB/s; without peer-to-peer access
# (GeForce cards, many consumer boards: `nvidia-smi topo -p2p r` says "NS") NCCL stages through
# pinned host memory, i.e. two PCIe hops - about half. The RTX 3090 / A6000 NVLink bridge is
# 112.5 GB/s both directions (NVIDIA datasheets); data-centre NVLink comes from the profile.
LINKS = ("pcie-no-p2p", "pcie", "nvlink")
_BRIDGE_NVLINK_GBPS = {"rtx3090": 56.25, "a6000": 56.25}
# Between nodes, per direction, one port per node, GB/s at line rate: InfiniBand HDR is
# 200 Gb/s = 25 GB/s per port (NVIDIA ConnectX-6 VPI datasheet, "HDR 200Gb/s"); Ethernet is
# what the NIC says - 10 GbE = 1.25 GB/s is the small-server default here, 25/100 GbE are
# 3.125/12.5 GB/s (pass --inter-node-bandwidth). NCCL over TCP sockets usually reaches less
# than line rate; over RDMA (IB, RoCE) close to it.
INTER_NODE_GBPS = {"ib": 25.0, "ethernet": 1.25}


@dataclass(frozen=True)
class Hardware:
    """The GPUs to plan for."""

    gpu: GpuProfile
    num_gpus: int
    link: str                   # pcie-no-p2p | pcie | nvlink
    link_gbps: float            # per direction, GB/s (10^9)
    cores: int                  # CPU cores for OMP_NUM_THREADS
    detected: bool = False
    nodes: int = 1              # machines, each with num_gpus GPUs
    inter_node: str = ""        # ib | ethernet (nodes > 1)
    inter_node_gbps: float = 0.0  # per direction, GB/s (10^9), one port per node


def _has_nvlink(gpu: GpuProfile) -> bool:
    return "NVLink" in gpu.interconnect and "no NVLink" not in gpu.interconnect


def default_link(gpu: GpuProfile) -> str:
    """GeForce cards have no PCIe P2P; data-centre cards with NVLink use it; the rest P2P PCIe.
    An optional bridge (RTX 3090, A6000) is not assumed: pass --link nvlink if it is fitted."""
    if _has_nvlink(gpu) and "optional" not in gpu.interconnect:
        return "nvlink"
    if gpu.name.startswith("rtx") or "no P2P" in gpu.interconnect:
        return "pcie-no-p2p"
    return "pcie"


def link_gbps(gpu: GpuProfile, link: str) -> float:
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; choose one of {', '.join(LINKS)}")
    pcie = 12.0 if "PCIe 3.0" in gpu.interconnect else 25.0
    if link == "nvlink":
        if gpu.name in _BRIDGE_NVLINK_GBPS:
            return _BRIDGE_NVLINK_GBPS[gpu.name]
        if _has_nvlink(gpu):
            return gpu.link_gbps
        raise ValueError(f"{gpu.name} has no NVLink; use --link pcie or pcie-no-p2p")
    return pcie if link == "pcie" else pcie / 2


def hardware(gpu: GpuProfile, num_gpus: int, link: str | None = None,
             detected: bool = False, nodes: int = 1, inter_node: str | None = None,
             inter_node_gbps: float | None = None) -> Hardware:
    """``num_gpus`` GPUs on each of ``nodes`` machines; between machines ``inter_node`` at
    ``inter_node_gbps`` (default: the link's line rate, :data:`INTER_NODE_GBPS`)."""
    link = link or default_link(gpu)
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    if nodes == 1:
        return Hardware(gpu, num_gpus, link, link_gbps(gpu, link), os.cpu_count() or 1,
                        detected)
    inter = inter_node or "ethernet"
    if inter not in INTER_NODE_GBPS:
        raise ValueError(f"unknown inter-node link {inter!r}; choose one of "
                         f"{', '.join(INTER_NODE_GBPS)}")
    gbps = INTER_NODE_GBPS[inter] if inter_node_gbps is None else inter_node_gbps
    if gbps <= 0:
        raise ValueError(f"--inter-node-bandwidth must be > 0 GB/s, got {gbps:g}")
    return Hardware(gpu, num_gpus, link, link_gbps(gpu, link), os.cpu_count() or 1, detected,
                    nodes, inter, gbps)


def detect_hardware() -> tuple[GpuProfile, int, str | None] | None:
    """The local CUDA GPUs (profile, count, link), or None without CUDA. Touches CUDA only when
    called, never at import."""
    import torch
    if not torch.cuda.is_available():
        return None
    from oomdoctor.sim.gpus import PROFILES, custom_profile
    props = torch.cuda.get_device_properties(0)
    profile = next((p for p in PROFILES.values()
                    if abs(p.total_bytes - props.total_memory) < 2**30
                    and p.compute_capability == (props.major, props.minor)), None)
    profile = profile or custom_profile(props.total_memory, props.major >= 8,
                                        (props.major, props.minor))
    n = torch.cuda.device_count()
    link = None
    if n > 1:
        link = "pcie" if torch.cuda.can_device_access_peer(0, 1) else "pcie-no-p2p"
    return profile, n, link
