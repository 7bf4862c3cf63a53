"""What NCCL_DEBUG=INFO output says about peer-to-peer: the pairs of GPUs NCCL could not enable P2P between,
and a log that stops inside NCCL's initialisation on consumer cards (a P2P hang) - the diagnosis that
`nvidia-smi topo -p2p r` gives (formats/launch.py), from NCCL's own lines."""
from __future__ import annotations

import re

from ..diagnosis import _QUALITY_NONE, _Ctx, _Out
from ..draft import _Draft
from ..results import Kind
from .nccl import _NO_P2P_CARD
from .patterns import _I, _AnchorSpec

NO_P2P = "NCCL_DEBUG output: NCCL could not enable P2P between GPUs"
HANG = "NCCL_DEBUG output ends in NCCL's initialisation on consumer GPUs (a P2P hang)"

# NCCL src/transport/p2p.cc (p2pCanConnect): "Could not enable P2P between dev 1(=1b000) and dev 0(=1a000)".
_PAIR = re.compile(r"CouldnotenableP2Pbetweendev(\d+)\(=\w+\)anddev(\d+)", _I)
# A line of NCCL_DEBUG output: "host:pid:tid [dev] NCCL INFO ..." and, with NCCL_DEBUG_SUBSYS=CALL or
# NCCL_DEBUG=TRACE, "host:pid:tid NCCL CALL ncclGetUniqueId(...)".
NCCL_DEBUG_LINE = re.compile(r"\bNCCL (?:INFO|CALL|TRACE)\b")


def _x_nccl_p2p(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.P2P)
    d.details["source"] = NO_P2P
    pairs = sorted({tuple(sorted((int(a), int(b)))) for a, b in _PAIR.findall(span[:4000])})
    d.details["unsupported_pairs"] = ", ".join(f"GPU{a}-GPU{b}" for a, b in pairs[:16])
    d.sig = ()
    return d


_ANCHORS: tuple[_AnchorSpec, ...] = (
    _AnchorSpec(Kind.P2P, ("couldnotenablep2p",), _PAIR, absorb=3000, extract=_x_nccl_p2p),
)


def _hang_draft(gpu_model: str) -> _Draft:
    """The finding of a log that ends in NCCL's debug output on consumer cards (scanner.finish)."""
    d = _Draft(Kind.P2P)
    d.details["source"] = HANG
    d.details["gpu_model"] = gpu_model
    d.sig = ()
    return d


def _diag_nccl_p2p(d: _Draft, ctx: _Ctx, out: _Out) -> None:
    pairs = d.details.get("unsupported_pairs")
    gpu = d.details.get("gpu_model") or ctx.gpu_model
    if d.details.get("source") == NO_P2P:
        between = "; ".join(p.replace("GPU", "GPU ").replace("-", " and ") for p in (pairs or "").split(", "))
        seen = (f"NCCL's debug output says it could not enable P2P between {between}: there is no peer-to-peer "
                "path between them (a consumer board, a PCIe switch, or IOMMU/ACS in the way), so NCCL routes "
                "through shared memory or the host instead; when the run hangs after such lines, that P2P path "
                "is the first suspect")
    else:
        seen = (f"The log stops inside NCCL's initialisation (its last lines are NCCL_DEBUG output) on {gpu} "
                "cards, with no error after it: the first collective never completed")
        if _NO_P2P_CARD.search(gpu or ""):
            seen += f". {gpu} cards have no peer-to-peer support, yet NCCL can still choose P2P"
    out.diag("nccl_p2p_hang", f"{seen}. That is the situation `nvidia-smi topo -p2p r` shows as NS/CNS between "
             "GPUs: where P2P is unsupported or broken, NCCL's transfers between the cards hang (GPUs at 100% "
             "doing nothing) instead of failing, and DataParallel's weight copies hang the same way.")
    out.fix("nccl_p2p_disable", "Rerun with NCCL_P2P_DISABLE=1 (NCCL copies through host memory): if the hang goes "
            "away, P2P was the cause; `nvidia-smi topo -p2p r` shows which pairs lack it", None, None,
            "slower inter-GPU transfers", _QUALITY_NONE, "On AMD boards IOMMU/ACS settings (amd_iommu=off or "
            "iommu=pt) can make P2P that the cards support work again.", cost=0, primary=True)
    out.fix("ddp_not_dp", "If this is DataParallel, use DistributedDataParallel (torchrun --nproc_per_node=<GPUs>)",
            None, None, "faster than DataParallel", _QUALITY_NONE, "DataParallel copies the weights GPU to GPU at "
            "every forward; DDP over NCCL with P2P disabled does not need peer access.", cost=1)
    out.notes.append("NCCL_DEBUG=INFO shows the transport NCCL picked per channel ('via P2P/IPC', 'via SHM').")
