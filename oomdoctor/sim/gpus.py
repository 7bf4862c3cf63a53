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

AMD cards (``arch`` set, e.g. gfx90a) run PyTorch's ROCm build: capacity as HIP reports it, and
the BLAS workspace and attention kernels of :mod:`oomdoctor.sim.rocm`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from oomdoctor.sim import rocm

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
    arch: str = ""                  # AMD target (gfx90a, gfx942): a ROCm card; "" for CUDA

    @property
    def is_rocm(self) -> bool:
        return bool(self.arch)

    @property
    def cublas_workspace_bytes(self) -> int:
        """The BLAS workspace each thread's handle takes from the caching allocator on its first
        matmul (forward and autograd's backward thread have their own handles)."""
        if self.is_rocm:
            return rocm.blas_workspace_bytes(self.arch)
        # aten/src/ATen/cuda/CublasHandlePool.cpp: default CUBLAS_WORKSPACE_CONFIG ":4096:2:16:8"
        # = 2 x 4096 KiB + 8 x 16 KiB per handle/stream; 32 MiB on Hopper and Blackwell (major
        # 9, 10, 11, 12 in current torch; cuBLASLt shares this workspace on CUDA).
        return 32 * MiB if self.compute_capability >= (9, 0) else 2 * 4096 * KiB + 8 * 16 * KiB

    @property
    def multiprocessors(self) -> tuple[int, int]:
        """(multiProcessorCount, maxThreadsPerMultiProcessor): what bounds a CUDA reduction's
        grid, and so its scratch buffer (oomdoctor.sim.reductions)."""
        return (MULTIPROCESSORS.get(self.name, _DEFAULT_MULTIPROCESSORS),
                _THREADS_PER_MP.get(self.compute_capability, 2048))

    @property
    def memory_bytes_per_second(self) -> float:
        """Datasheet memory bandwidth (MEMORY_GBPS), what a memory-bound kernel is held to."""
        return MEMORY_GBPS.get(self.name, _DEFAULT_MEMORY_GBPS) * 1e9

    @property
    def arch_name(self) -> str:
        """'gfx90a' for an AMD card, 'sm86' for a CUDA one (what notes and errors print)."""
        return self.arch or f"sm{self.compute_capability[0]}{self.compute_capability[1]}"


# Datasheet memory bandwidth, GB/s (NVIDIA's and AMD's product pages and whitepapers: GDDR6X
# 936 on the 3090, 1008 on the 4090, 1792 GDDR7 on the 5090; HBM2e 1555 (A100 40 GB) and 2039
# (A100 80 GB SXM4), HBM3 3350 (H100 SXM5), HBM3e 4800 (H200) and 8000 (B200); MI250 3277,
# MI300X 5300).
MEMORY_GBPS = {"rtx3060-12": 360, "rtx3090": 936, "rtx4090": 1008, "a10": 600, "l4": 300,
               "t4": 320, "v100-16": 900, "v100-32": 900, "a100-40": 1555, "a100-80": 2039,
               "h100-80": 3350, "l40s": 864, "rtx5090": 1792, "a6000": 768,
               "rtx4060ti-16": 288, "rtx4070ti-super": 672, "rtx4080": 717, "h200": 4800,
               "b200": 8000, "mi250": 3277, "mi300x": 5300}
_DEFAULT_MEMORY_GBPS = 900       # a card given by --memory only: a 3090-class board

# Streaming multiprocessors (cudaDeviceProp.multiProcessorCount), from NVIDIA's datasheets and
# architecture whitepapers (GA102: 82 on the 3090, 84 on the A6000, 72 on the A10, 28 on the
# 3060; AD102/103/104/106: 128, 142 (L40S), 76, 66, 58 (L4), 34; TU104 T4 40; GV100 80;
# GA100 108; GH100 SXM5 132 (H100 and H200); GB202 170; B200 148). CUDA cards only.
MULTIPROCESSORS = {"rtx3060-12": 28, "rtx3090": 82, "rtx4090": 128, "a10": 72, "l4": 58,
                   "t4": 40, "v100-16": 80, "v100-32": 80, "a100-40": 108, "a100-80": 108,
                   "h100-80": 132, "l40s": 142, "rtx5090": 170, "a6000": 84,
                   "rtx4060ti-16": 34, "rtx4070ti-super": 66, "rtx4080": 76, "h200": 132,
                   "b200": 148}
_DEFAULT_MULTIPROCESSORS = 108    # a card given by --memory only: an A100's
# maxThreadsPerMultiProcessor by compute capability (CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability"); 2048 elsewhere.
_THREADS_PER_MP = {(7, 5): 1024, (8, 6): 1536, (8, 9): 1536, (12, 0): 1536}


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
    # Ada GeForce 16 GB cards. On the cards NVIDIA's Ada whitepaper lists (RTX 4090: FP32 82.6,
    # FP16 tensor with FP32 accumulate 165.2; RTX 4080: 48.7 / 97.5 TFLOPS dense,
    # images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf, Appendix
    # A) fp32 = 2 x CUDA cores x boost clock and the fp32-accumulate tensor rate is twice that;
    # the 4060 Ti and 4070 Ti SUPER rates below use the same formula with the core counts and
    # boost clocks of NVIDIA's spec pages (nvidia.com/en-us/geforce/graphics-cards/40-series/).
    # TF32 tensor = the fp32 rate on GeForce Ada. No NVLink, no P2P on any of them.
    # Capacity: "GPU 0 has a total capacity of 15.55 GiB" on a 4060 Ti 16 GB
    # (github.com/boson-ai/higgs-audio/issues/48). 4352 cores x 2.535 GHz x 2 = 22.1 TFLOPS.
    GpuProfile("rtx4060ti-16", "GeForce RTX 4060 Ti 16 GB", _gib(15.55), (8, 9), True,
               22.1, 22.1, 44.1, "PCIe 4.0 x8, no P2P, no NVLink", 12.0, 450 * MiB),
    # No published OOM message for a 4070 Ti SUPER was found. A public fine-tuning report (found
    # through code search; the index gave no address) prints "NVIDIA RTX 4070 Ti SUPER (15.56 GB
    # total)": total_memory / 2**30 by its size (in 10^9 bytes a 16 GiB card has 17.2), the same
    # as the 4060 Ti 16 GB's 15.55 GiB to 10 MiB. 8448 cores x 2.61 GHz x 2 = 44.1 TFLOPS.
    GpuProfile("rtx4070ti-super", "GeForce RTX 4070 Ti SUPER 16 GB", _gib(15.56), (8, 9), True,
               44.1, 44.1, 88.2, "PCIe 4.0 x16, no P2P, no NVLink", 25.0, 450 * MiB),
    # Capacity: "(GPU 0; 15.99 GiB total capacity; ...)" on an RTX 4080
    # (github.com/aigc-apps/sd-webui-EasyPhoto/issues/281, a WebUI user: most likely Windows,
    # whose WDDM driver reports 16 GiB - 10 MiB; Linux reports less). Rates: Ada whitepaper.
    GpuProfile("rtx4080", "GeForce RTX 4080 16 GB", _gib(15.99), (8, 9), True,
               48.7, 48.7, 97.5, "PCIe 4.0 x16, no P2P, no NVLink", 25.0, 450 * MiB),
    # Capacity: "GPU 5 has a total capacity of 139.80 GiB" on 8 x H200, in several public
    # training logs (a benchmark summary of Qwen3 / INTELLECT-3 runs on 8xH200 and 8xB200, found
    # through code search; the index gave no address); NVML reports 143,771 MiB
    # (thundergolfer.com/blog/nvidia-gpu-memory-capacity). Rates: the H100 SXM's (same GH100
    # die and clocks; NVIDIA H200 datasheet, nvidia.com/en-us/data-center/h200/: FP32 67, TF32
    # 989 and BF16 1,979 TFLOPS with sparsity, so 494 and 989 dense). NVLink 4.0, 900 GB/s total.
    # Context: 771 MiB once the training step's kernels have loaded (lazy loading: 619 MiB at
    # CUDA's first allocation), measured with torch 2.11 / CUDA 13.0 / driver 580
    # (benchmarks/results/nvidia-h200-2.11.0-search.json, context_after_bytes): the budget at
    # the peak is the grown one.
    GpuProfile("h200", "NVIDIA H200 141 GB (SXM5)", _gib(139.80), (9, 0), True,
               67.0, 494.0, 989.0, "NVLink 4.0 (900 GB/s total)", 450.0, 808_255_488),
    # Capacity: "GPU 0 has a total capacity of 178.35 GiB" on B200s, in several public logs
    # (found through code search, e.g. a Marlin-repacking OOM "B200 got significantly further
    # than H200"); 178.36 GiB also appears (driver versions differ by 10 MiB). Rates: NVIDIA
    # HGX B200 (nvidia.com/en-us/data-center/hgx/: 8 GPUs, FP16/BF16 36 PFLOPS and TF32 18
    # PFLOPS with sparsity, FP32 600 TFLOPS), per GPU and dense: 2,250 / 1,125 / 75. NVLink 5,
    # 1.8 TB/s total per GPU. Context: no reading found; the H100's.
    GpuProfile("b200", "NVIDIA B200 180 GB (HGX)", _gib(178.35), (10, 0), True,
               75.0, 1125.0, 2250.0, "NVLink 5 (1.8 TB/s total)", 900.0, 550 * MiB),
    # AMD Instinct, PyTorch's ROCm build. HIP reports the whole HBM less 20 MiB: "total capacity
    # of 191.98 GiB" on one MI300X (192 GiB; ROCm blog "Shrink LLMs, Boost Inference: INT4
    # Quantization on AMD GPUs with GPTQModel", rocm.blogs.amd.com/artificial-intelligence/gptq/
    # README.html), 23.98 GiB on a 24 GiB RX 7900 XTX (github.com/Tongyi-MAI/Z-Image/issues/103).
    # One MI250 GCD has 64 GiB: "total capacity of 63.98 GiB" (github.com/RooCodeInc/Roo-Code/
    # issues/6541, a 64 GiB gfx90a device the issue does not name; an MI210 reports the same).
    # torch reports gfx90a as compute capability 9.0, gfx942 as 9.4 (oomdoctor.sim.rocm).
    # Rates per GCD: AMD MI250 datasheet (amd.com/en/products/accelerators/instinct/mi200/
    # mi250.html, two GCDs): FP32 vector 45.3, FP16/BF16 matrix 362.1 TFLOPS, halved. CDNA2 has no
    # TF32 (its fp32 matrix rate, 45.3 per GCD, is not what tflops_tf32 means). The two GCDs of
    # one MI250 talk over 4 Infinity Fabric links, 200 GB/s per direction (AMD CDNA2 whitepaper).
    # Context: no published HIP context reading was found; 512 MiB is a placeholder
    # (--overhead overrides it).
    GpuProfile("mi250", "AMD Instinct MI250 (one GCD, 64 GB)", _gib(63.98), (9, 0), True,
               22.6, 0.0, 181.0, "Infinity Fabric (GCD pair in one MI250: 200 GB/s)", 200.0,
               512 * MiB, arch="gfx90a"),
    # MI300X datasheet (amd.com/en/products/accelerators/instinct/mi300/mi300x.html): FP32 vector
    # 163.4, TF32 matrix 653.7, FP16/BF16 matrix 1,307.4 TFLOPS dense. 7 Infinity Fabric links of
    # 64 GB/s per direction, one to each other GPU of an 8-GPU platform.
    GpuProfile("mi300x", "AMD Instinct MI300X 192 GB", _gib(191.98), (9, 4), True,
               163.4, 653.7, 1307.4, "Infinity Fabric (64 GB/s per GPU pair)", 64.0,
               512 * MiB, arch="gfx942"),
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
               "v100": "v100-16", "a100": "a100-80", "h100": "h100-80", "4080": "rtx4080",
               "rtx4060ti": "rtx4060ti-16", "4070tisuper": "rtx4070ti-super",
               "rtx4070tisuper": "rtx4070ti-super", "mi250x": "mi250"}
    key = aliases.get(key, key)
    if key not in PROFILES:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(PROFILES)} (or give "
                         "--memory 24GiB for any card)")
    return PROFILES[key]


def custom_profile(total_bytes: int, bf16: bool = True,
                   compute_capability: tuple[int, int] = (8, 0), arch: str = "") -> GpuProfile:
    """A card known only by its memory (``--memory``): Ampere-like, bf16 assumed unless told;
    ``arch`` (gfx90a, ...) makes it a ROCm card."""
    return GpuProfile("custom", f"custom GPU with {total_bytes / GiB:.2f} GiB",
                      total_bytes, compute_capability, bf16, 0.0, 0.0, 0.0, "unknown", 0.0,
                      arch=arch)


def card_for_arch(total_bytes: int, arch: str | None) -> GpuProfile:
    """``--memory SIZE [--arch sm89|gfx90a]``: a custom card of that architecture (sm80 when
    none is given). An AMD target makes it a ROCm card (BLAS workspace, attention kernels and
    reported compute capability from :mod:`oomdoctor.sim.rocm`)."""
    if arch and arch.strip().lower().startswith("gfx"):
        gfx = rocm.parse_gfx(arch)
        return custom_profile(total_bytes, rocm.has_bf16(gfx), rocm.reported_capability(gfx), gfx)
    cc = parse_arch(arch) if arch else (8, 0)
    return custom_profile(total_bytes, cc >= (8, 0), cc)


def parse_arch(text: str) -> tuple[int, int]:
    """'sm89', 'sm_90', '8.6' -> a CUDA compute capability (``--arch``). It picks what memory
    depends on: bf16 (sm80+), the attention kernel (flash from sm80) and the cuBLAS workspace
    (Hopper's is larger). AMD targets (gfx90a) go through :func:`card_for_arch`."""
    t = text.strip().lower().replace("_", "")
    if t.startswith("gfx"):
        raise ValueError(f"--arch {text} is an AMD target, not a CUDA compute capability; "
                         "build the card with card_for_arch")
    m = re.fullmatch(r"(?:sm)?(\d{2,3})|(\d+)\.(\d)", t)
    if not m:
        raise ValueError(f"cannot read --arch {text!r}; write it like sm89 (an RTX 4090, L4, "
                         "L40S), sm86 (RTX 3090, A10), sm80 (A100), sm90 (H100) or, for AMD, "
                         "gfx90a (MI250) or gfx942 (MI300X)")
    major, minor = ((int(m.group(1)) // 10, int(m.group(1)) % 10) if m.group(1)
                    else (int(m.group(2)), int(m.group(3))))
    if major < 5:
        raise ValueError(f"--arch {text}: compute capability {major}.{minor} is older than any "
                         "GPU PyTorch supports")
    return major, minor
