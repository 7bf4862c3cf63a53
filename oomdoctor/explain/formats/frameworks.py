"""TensorFlow and JAX/XLA out-of-memory messages: anchors, numbers (BFC allocator stats), diagnosis."""
from __future__ import annotations

import re

from ..diagnosis import _F, _QUALITY_NONE, _SPEED_NONE, _Ctx, _Out
from ..draft import _Draft
from ..results import Kind, Phase
from ..sizes import _to_bytes
from .patterns import _I, _SZ, _SZX, _AnchorSpec, _rx, _size, _size_x

# --- message anchors (squashed text) ---------------------------------------------------------

_ANCHORS: tuple[_AnchorSpec, ...] = (
    _AnchorSpec(Kind.TF_OOM, ("oomwhenallocating", "ranoutofmemory", "failedtoallocatememory"), re.compile(
        r"OOMwhenallocatingtensor|Allocator\(\w+\)ranoutofmemorytryingtoallocate"
        r"|ResourceExhaustedError:failedtoallocatememory", _I)),
    _AnchorSpec(Kind.JAX_OOM, ("resource_exhausted", "resourceexhausted", "memoryspace", "xlaruntimeerror",
                               "attemptingto"), re.compile(
        r"RESOURCE_?EXHAUSTED:(?:Outofmemory|XLA:TPUcompile|Failedtoallocate)|Ranoutofmemoryinmemoryspace"
        # the same shortage under another status: "INTERNAL: Failed to allocate N bytes for new constant"
        r"|XlaRuntimeError:INTERNAL:Failedtoallocate(?=\d+bytes)"
        # the TPU runtime (PyTorch/XLA, JAX, TF on TPU): "Attempting to reserve 10.51G at the bottom of
        # memory. That was not possible. There are 8.97G free, ...", and for a device buffer "Attempting
        # to allocate 129.50M. That was not possible. There are 78.17M free."
        r"|Attemptingto(?:reserve|allocate)[\d.]+[KMGTP]?(?:i?B)?(?:atthebottomofmemory)?\.?Thatwasnotpossible",
        _I)),
)


# --- field patterns (squashed text) ----------------------------------------------------------

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
# "Failed to allocate request for 2.99GiB (3206250496B) on device ordinal 0"; the TPU runtime's
# "Attempting to reserve 10.51G" and its HBM report's "Program requirement: 3.95G (4,237,689,856 bytes)"
# (the exact figure, read first).
_F_JAX_REQ = _rx(r"(?:Outofmemory(?:whiletryingto)?allocat(?:e|ing)|Failedtoallocaterequestfor|Failedtoallocate"
                 r"|Attemptingto(?:reserve|allocate))" + _SZX)
_F_XLA_PROGRAM = _rx(r"Programrequirement:" + _SZX)
# The TPU runtime's figures: "Used 9.08G of 7.48G hbm. Exceeded hbm capacity by 1.60G.", "There are
# 8.97G free", "HBM capacity 8.00G:", "Currently allocated: 6.08G (6,532,939,776 bytes)", "Top-of-Memory
# reserved: 529.00M (554,696,704 bytes)".
_F_XLA_USED = _rx(r"Used" + _SZX + r"of" + _SZX + r"(?:hbm|vmem|smem)")
_F_XLA_EXCEEDED = _rx(r"Exceeded(?:hbm|vmem|smem)?capacityby" + _SZX)
_F_XLA_FREE = _rx(r"Thereare" + _SZX + r"free")
_F_XLA_RESERVABLE = _rx(r"reserved,and" + _SZX + r"reservable")
_F_XLA_CAPACITY = _rx(r"HBMcapacity" + _SZX)
_F_XLA_ALLOCATED = _rx(r"Currentlyallocated:" + _SZX)
_F_XLA_RESERVED = _rx(r"Top-of-Memoryreserved:" + _SZX)
_TPU = re.compile(r"hbm|tpu|bottomofmemory", re.I)
_F_JAX_TOTAL = _rx(r"totalallocation:" + _SZ)
_F_JAX_TEMP = _rx(r"preallocatedtempallocation:" + _SZ)
_F_JAX_PARAM = _rx(r"parameterallocation:" + _SZ)

_TF_DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float64": 8, "double": 8,
    "complex64": 8, "complex128": 16, "uint8": 1, "int8": 1, "qint8": 1, "quint8": 1, "uint16": 2,
    "int16": 2, "uint32": 4, "int32": 4, "qint32": 4, "uint64": 8, "int64": 8, "bool": 1,
}


# --- extractors: squashed message text -> draft ----------------------------------------------

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
    head = span[:3000]
    req = _size_x(_F_XLA_PROGRAM, head)
    req = req if req is not None else _size_x(_F_JAX_REQ, head)
    if req is not None:
        d.numbers["requested"] = req
    for name, rx in (("total_allocation", _F_JAX_TOTAL), ("temp_allocation", _F_JAX_TEMP),
                     ("parameter_allocation", _F_JAX_PARAM)):
        value = _size(rx, span)
        if value is not None:
            d.numbers[name] = value
    used = _F_XLA_USED.search(head)
    if used is not None:
        d.numbers["total_allocation"] = _size_x(_F_XLA_USED, head)
        d.numbers["hbm_capacity"] = _size_x(_F_XLA_USED, head, 4)
    for name, rx in (("shortfall", _F_XLA_EXCEEDED), ("hbm_free", _F_XLA_FREE), ("hbm_reservable", _F_XLA_RESERVABLE),
                     ("hbm_capacity", _F_XLA_CAPACITY),
                     ("hbm_allocated", _F_XLA_ALLOCATED), ("hbm_reserved", _F_XLA_RESERVED)):
        value = _size_x(rx, head)
        if value is not None:
            d.numbers.setdefault(name, value)
    if "TPU" in m.group(0).upper() or "memoryspace" in m.group(0).lower():
        d.details["where"] = "XLA compilation (TPU memory space)"
    if _TPU.search(pre[-80:] + head[:1500]):
        d.details["device"] = "TPU"
        d.details["request"] = "a device buffer" if "devicebuffer" in head[:300].lower() else "the program"
    d.sig = (d.numbers.get("requested"),)
    return d


# --- diagnosis -------------------------------------------------------------------------------

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
    if d.details.get("device") == "TPU":
        _diag_tpu(d, out)
        return
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


def _diag_tpu(d: _Draft, out: _Out) -> None:
    """XLA on a TPU core: its HBM is fixed per core and nothing else shares it, so the program's
    need against the core's capacity is the whole story."""
    n = d.numbers
    need, cap, req, free = n.get("total_allocation"), n.get("hbm_capacity"), n.get("requested"), n.get("hbm_free")
    if need is not None and cap is not None:
        over = n.get("shortfall", need - cap)
        out.shortfall = over
        text = (f"The compiled program needs {_F(need)} of HBM and a core of this TPU has {_F(cap)}: "
                f"{_F(over)} over.")
    elif req is not None and free is not None and free >= req and n.get("hbm_reservable", req) < req:
        # The runtime reserves a program's memory in one piece at the bottom of HBM: free space elsewhere
        # (between live buffers) does not count.
        reservable = n["hbm_reservable"]
        out.shortfall = req - reservable
        text = (f"XLA could not reserve {_F(req)} of HBM for the program although {_F(free)} was free: only "
                f"{_F(reservable)} of it was reservable in one piece at the bottom of memory, the rest lies between "
                "live buffers (fragmentation, often from buffers kept alive across steps).")
    elif req is not None and free is not None:
        out.shortfall = req - free
        held = n.get("hbm_allocated")
        text = (f"XLA could not get {_F(req)} of HBM for {d.details.get('request', 'the program')}: {_F(free)} was free"
                + (f" of the core's {_F(cap)}" if cap is not None else "")
                + (f", {_F(held)} being held by live buffers (weights, optimizer state, data)" if held else "")
                + f", {_F(req - free)} short.")
    else:
        text = "XLA ran out of the TPU core's HBM" + (f" allocating {_F(req)}" if req is not None else "") + "."
    out.diag("tpu_hbm_exhausted", text + " A TPU core's HBM is fixed (8 GiB a v2 core, 16 GiB v3, 16 GiB v5e) "
             "and holds the weights, optimizer state and the step's activations of that core's shard; the "
             "program must shrink or be split over more cores.")
    out.fix("halve_micro_batch", "Halve the per-core batch (keep the effective batch with gradient accumulation)",
            None, None, "slightly slower per sample", "none with gradient accumulation",
            "The step's activations scale with the per-core batch.", cost=1, primary=True)
    out.fix("remat", "Rematerialise activations: jax.checkpoint (jax.remat), or gradient checkpointing in "
            "PyTorch/XLA (torch_xla.utils.checkpoint)", None, None, "about 20-30% slower", _QUALITY_NONE, "",
            cost=1)
    out.fix("shard_over_cores", "Shard weights and optimizer state over the cores: FSDP (torch_xla "
            "XlaFullyShardedDataParallel / SPMD) or jax.sharding", None, None, "slower: collectives every step",
            _QUALITY_NONE, "", cost=2)
    out.fix("bf16_on_tpu", "Keep weights and activations in bfloat16 (XLA_USE_BF16=1 in PyTorch/XLA, "
            "jnp.bfloat16 params in JAX)", None, None, "faster on TPU", "practically none", "", cost=1)
