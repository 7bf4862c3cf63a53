"""GPU profiles: what each card gives a training process, and what it costs before PyTorch starts.

    oomdoctor probe sample_models/gpt2_small.py --gpu rtx3090

``total_bytes`` is the capacity CUDA reports (``torch.cuda.get_device_properties().total_memory``,
the "total capacity" in OOM messages), not the marketing size: a "24 GB" RTX 3090 reports
23.69 GiB. ``context_bytes`` is memory on the card outside PyTorch's allocator - the CUDA context
and loaded kernels - which never shows in ``max_memory_reserved()``. It depends on GPU, driver,
CUDA version and lazy loading (the default since CUDA 11.7); the defaults below are typical
readings with lazy loading and are overridable with ``--overhead``. One published reading
without lazy loading: 1343 MB on a V100 (transformers docs, "Efficient Training on a Single GPU",
the CUDA-context reading; rebuilt in tests/test_ground_truth.py as HF-0).

TFLOP/s are dense peak numbers from the vendors' datasheets, with fp32 accumulation for the
16-bit tensor-core rates (what PyTorch's matmuls use; GeForce cards run that at half the fp16-
accumulate rate). They feed step-time ranking, never memory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

KiB, MiB, GiB = 1024, 1024**2, 1024**3


@dataclass(frozen=True)
class GpuProfile:
    name: str
    description: str
    total_bytes: int                # capacity as CUDA reports it
    compute_capability: tuple[int, int]
    bf16: bool                      # bf16 tensor cores (sm80+)
    tflops_fp32: float              # non-tensor fp32
    tflops_tf32: float              # tf32 tensor cores (0: none)
    tflops_16: float                # fp16/bf16 tensor cores, fp32 accumulate
    interconnect: str               # GPU-to-GPU link
    link_gbps: float                # GB/s per direction between two GPUs
    context_bytes: int = 400 * MiB  # CUDA context + kernels, outside the allocator

    @property
    def cublas_workspace_bytes(self) -> int:
        # torch/csrc/cuda/CUDABlas: default CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8" =
        # 2 x 4096 KiB + 8 x 16 KiB per handle/stream; Hopper gets 32 MiB. Allocated through the
        # caching allocator on the first matmul of each thread (forward and autograd's backward
        # thread have their own handles).
        return 32 * MiB if self.compute_capability >= (9, 0) else 2 * 4096 * KiB + 8 * 16 * KiB


def _gib(x: float) -> int:
    # Capacities as OOM messages print them ("23.69 GiB total capacity"), to the MiB.
    return int(round(x * 1024)) * MiB


PROFILES: dict[str, GpuProfile] = {p.name: p for p in [
    GpuProfile("rtx3060-12", "GeForce RTX 3060 12 GB", _gib(11.76), (8, 6), True,
               12.7, 12.7, 25.4, "PCIe 4.0 x16, no P2P", 25.0, 350 * MiB),
    GpuProfile("rtx3090", "GeForce RTX 3090 24 GB", _gib(23.69), (8, 6), True,
               35.6, 35.6, 71.0, "PCIe 4.0 x16 (optional 2-way NVLink bridge, 56 GB/s)",
               25.0, 400 * MiB),
    GpuProfile("rtx4090", "GeForce RTX 4090 24 GB", _gib(23.65), (8, 9), True,
               82.6, 82.6, 165.2, "PCIe 4.0 x16, no P2P, no NVLink", 25.0, 450 * MiB),
    GpuProfile("a10", "NVIDIA A10 24 GB", _gib(22.20), (8, 6), True,
               31.2, 62.5, 125.0, "PCIe 4.0 x16", 25.0, 400 * MiB),
    GpuProfile("l4", "NVIDIA L4 24 GB", _gib(22.03), (8, 9), True,
               30.3, 60.0, 121.0, "PCIe 4.0 x16", 25.0, 450 * MiB),
    GpuProfile("t4", "Tesla T4 16 GB", _gib(14.75), (7, 5), False,
               8.1, 0.0, 65.0, "PCIe 3.0 x16", 12.0, 350 * MiB),
    GpuProfile("v100-16", "Tesla V100 16 GB (SXM2)", _gib(15.78), (7, 0), False,
               15.7, 0.0, 125.0, "NVLink 2.0 (300 GB/s total)", 150.0, 450 * MiB),
    GpuProfile("v100-32", "Tesla V100 32 GB (SXM2)", _gib(31.75), (7, 0), False,
               15.7, 0.0, 125.0, "NVLink 2.0 (300 GB/s total)", 150.0, 450 * MiB),
    GpuProfile("a100-40", "NVIDIA A100 40 GB (SXM4)", _gib(39.39), (8, 0), True,
               19.5, 156.0, 312.0, "NVLink 3.0 (600 GB/s total)", 300.0, 500 * MiB),
    GpuProfile("a100-80", "NVIDIA A100 80 GB (SXM4)", _gib(79.15), (8, 0), True,
               19.5, 156.0, 312.0, "NVLink 3.0 (600 GB/s total)", 300.0, 500 * MiB),
    GpuProfile("h100-80", "NVIDIA H100 80 GB (SXM5)", _gib(79.11), (9, 0), True,
               67.0, 494.0, 989.0, "NVLink 4.0 (900 GB/s total)", 450.0, 550 * MiB),
    # Capacity from a published OOM message ("GPU has a total capacity of 44.42 GiB" on an
    # 8 x L40S server, github.com/stepfun-ai/Step-Video-T2V/issues/8); rates from NVIDIA's L40S
    # datasheet (FP32 91.6, TF32 183, BF16/FP16 362 TFLOPS dense); PCIe 4.0 x16, no NVLink.
    GpuProfile("l40s", "NVIDIA L40S 48 GB", _gib(44.42), (8, 9), True,
               91.6, 183.0, 362.0, "PCIe 4.0 x16, no NVLink", 25.0, 450 * MiB),
    # Capacity from a published OOM message ("total capacity of 31.37 GiB" on a 5090,
    # github.com/Wan-Video/Wan2.1/issues/465); rates from NVIDIA's Blackwell GeForce
    # whitepaper (FP32 104.8, TF32 104.8, FP16 with FP32 accumulate 209.5 TFLOPS dense);
    # GeForce: no NVLink, no P2P (the link is assumed as the 4090's).
    GpuProfile("rtx5090", "GeForce RTX 5090 32 GB", _gib(31.37), (12, 0), True,
               104.8, 104.8, 209.5, "PCIe 5.0 x16, no P2P, no NVLink", 25.0, 450 * MiB),
    GpuProfile("a6000", "NVIDIA RTX A6000 48 GB", _gib(47.54), (8, 6), True,
               38.7, 77.4, 154.8, "PCIe 4.0 x16 (optional 2-way NVLink bridge, 56 GB/s)",
               25.0, 400 * MiB),
]}

_UNITS = {"B": 1, "KIB": KiB, "MIB": MiB, "GIB": GiB, "TIB": 1024 * GiB}


def parse_size(text: str) -> int:
    """'24GiB', '23.69 GiB', '512MiB', '1000000' -> bytes. Decimal units are refused on purpose:
    '24GB' is ambiguous (GPU vendors mean 10^9, tools often mean 2^30)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; write it like 24GiB or 512MiB")
    unit = m.group(2).upper() or "B"
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {m.group(2)!r} in {text!r}; use IEC units (KiB, MiB, "
                         "GiB): '24GB' is ambiguous, a 24 GB card reports about 23.69GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def get_profile(name: str) -> GpuProfile:
    key = name.lower().replace("_", "-").replace(" ", "")
    aliases = {"3090": "rtx3090", "4090": "rtx4090", "5090": "rtx5090", "3060": "rtx3060-12", "rtx3060": "rtx3060-12",
               "v100": "v100-16", "a100": "a100-80", "h100": "h100-80"}
    key = aliases.get(key, key)
    if key not in PROFILES:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(PROFILES)} (or give "
                         "--memory 24GiB for any card)")
    return PROFILES[key]


def custom_profile(total_bytes: int, bf16: bool = True,
                   compute_capability: tuple[int, int] = (8, 0)) -> GpuProfile:
    """A card known only by its memory (``--memory``): Ampere-like, bf16 assumed unless told."""
    return GpuProfile("custom", f"custom GPU with {total_bytes / GiB:.2f} GiB",
                      total_bytes, compute_capability, bf16, 0.0, 0.0, 0.0, "unknown", 0.0)


def parse_arch(text: str) -> tuple[int, int]:
    """'sm89', 'sm_90', '8.6' -> a CUDA compute capability (``--arch``). It picks what memory
    depends on: bf16 (sm80+), the attention kernel (flash from sm80) and the cuBLAS workspace
    (Hopper's is larger). AMD's gfx targets are refused: HIP's BLAS workspaces and attention
    kernels are not modelled yet."""
    t = text.strip().lower().replace("_", "")
    if t.startswith("gfx"):
        raise ValueError(f"--arch {text}: ROCm GPUs are not modelled yet (hipBLASLt workspaces "
                         "and HIP attention kernels differ from CUDA's); plan with a CUDA "
                         "architecture of the same memory, e.g. --arch sm80, as an estimate")
    m = re.fullmatch(r"(?:sm)?(\d{2,3})|(\d+)\.(\d)", t)
    if not m:
        raise ValueError(f"cannot read --arch {text!r}; write it like sm89 (an RTX 4090, L4, "
                         "L40S), sm86 (RTX 3090, A10), sm80 (A100) or sm90 (H100)")
    major, minor = ((int(m.group(1)) // 10, int(m.group(1)) % 10) if m.group(1)
                    else (int(m.group(2)), int(m.group(3))))
    if major < 5:
        raise ValueError(f"--arch {text}: compute capability {major}.{minor} is older than any "
                         "GPU PyTorch supports")
    return major, minor
