"""PyTorch's cudaMallocAsync-backend and Apple MPS out-of-memory messages: anchors, numbers, diagnosis."""
from __future__ import annotations

import re

from ..diagnosis import (_CONTEXT_MARGIN, _F, _QUALITY_NONE, _SPEED_NONE, _Ctx, _Out, _model_states, _pct,
                         _training_phase)
from ..draft import _Draft
from ..fixes import _empty_cache_note, _phase_diag, _size_fixes
from ..results import Kind, Phase
from ..sizes import MiB, _to_bytes
from .patterns import _I, _SZ, _AnchorSpec, _rx, _size

# --- message anchors (squashed text) ---------------------------------------------------------

_ANCHORS: tuple[_AnchorSpec, ...] = (
    _AnchorSpec(Kind.CUDA_ASYNC_OOM, ("wouldexceedallowedmemory",),
                re.compile(r"Allocationondevice-?\d+wouldexceedallowedmemory", _I)),
    _AnchorSpec(Kind.MPS_OOM, ("mpsbackendoutofmemory",), re.compile(r"MPSbackendoutofmemory", _I)),
)

# Matched per (unsquashed) line by the scanner: a message whose meaning depends on being alone.
# cudaMallocAsync's OOM cut right after "device": the device index is an int8 streamed as a char,
# so device 0 writes a NUL that ends the C string (pytorch/pytorch#168369). ComfyUI, which runs
# cudaMallocAsync by default, shows only "torch.OutOfMemoryError: Allocation on device ".
_CUT_ASYNC_LINE = re.compile(r"(?:^|[\s:*])Allocation on device\s*\x00?$")
# details["format"] of the message PyTorch itself cut at a NUL device byte (see above).
_CUT_AT_DEVICE = "unknown (cut after 'Allocation on device')"


# --- field patterns (squashed text) ----------------------------------------------------------

_F_ASYNC_ALLOC = _rx(r"Currentlyallocated:?" + _SZ)
_F_ASYNC_REQ = _rx(r"Requested:?" + _SZ)
_F_ASYNC_LIMIT = _rx(r"Devicelimit:?" + _SZ)
_F_ASYNC_FREE = _rx(r"Free\(accordingtoCUDA\):?" + _SZ)
_F_ASYNC_PTLIMIT = _rx(r"PyTorchlimit\(setbyuser-suppliedmemoryfraction\):?" + _SZ)
_F_ASYNC_DEV = _rx(r"Allocationondevice-?(\d+)wouldexceed")

_F_MPS_ALLOC = _rx(r"MPSallocated:?" + _SZ)
_F_MPS_OTHER = _rx(r"otherallocations:?" + _SZ)
_F_MPS_MAX = _rx(r"maxallowed:?" + _SZ)
_F_MPS_REQ = _rx(r"Triedtoallocate" + _SZ + r"on(private|shared)pool")


# --- extractors: squashed message text -> draft ----------------------------------------------

def _x_async(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.CUDA_ASYNC_OOM)
    for name, rx in (("allocated", _F_ASYNC_ALLOC), ("requested", _F_ASYNC_REQ), ("capacity", _F_ASYNC_LIMIT),
                     ("free", _F_ASYNC_FREE), ("limit", _F_ASYNC_PTLIMIT)):
        value = _size(rx, span)
        if value is not None:
            d.numbers[name] = value
    dev = _F_ASYNC_DEV.search(span)
    if dev:
        d.gpus.append(int(dev.group(1)))
    d.sig = (d.numbers.get("requested"), d.numbers.get("capacity"))
    return d


def _x_mps(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.MPS_OOM)
    for name, rx in (("allocated", _F_MPS_ALLOC), ("other_allocations", _F_MPS_OTHER), ("limit", _F_MPS_MAX)):
        value = _size(rx, span)
        if value is not None:
            d.numbers[name] = value
    req = _F_MPS_REQ.search(span)
    if req:
        d.numbers["requested"] = _to_bytes(req.group(1), req.group(2))
        d.details["pool"] = req.group(3).lower()
    d.sig = (d.numbers.get("requested"), d.numbers.get("limit"))
    return d


# --- diagnosis -------------------------------------------------------------------------------

def _diag_async(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    n = d.numbers
    req, cap, free, alloc = n.get("requested"), n.get("capacity"), n.get("free"), n.get("allocated")
    if req is not None and free is not None:
        out.shortfall = max(0, req - free)
        if out.shortfall:
            out.derived["shortfall"] = out.shortfall
    if req is not None and cap and req > cap:
        out.diag("request_exceeds_capacity", f"A single {_F(req)} allocation is larger than the {_F(cap)} device "
                 "limit: the tensor itself must shrink.")
    if cap is not None and free is not None and alloc is not None:
        outside = cap - free - alloc
        if outside > max(_CONTEXT_MARGIN, cap // 10):
            out.derived["outside_allocator"] = outside
            out.diag("outside_allocator", f"{_F(outside)} of the card is used by something other than this "
                     "process's PyTorch tensors: another process (two trainings on one GPU), another library in "
                     "this process, or memory cudaMallocAsync keeps in its pool.")
            out.fix("find_gpu_users", "Find and stop what else uses the GPU (nvidia-smi), or give each job its "
                    "own GPU with CUDA_VISIBLE_DEVICES", outside - 512 * MiB, "up to", _SPEED_NONE, _QUALITY_NONE,
                    "", cost=0, primary=True)
        if alloc >= cap // 2:
            out.diag("model_or_batch_too_big", f"PyTorch's tensors occupy {_F(alloc)} of the {_F(cap)} card "
                     f"({_pct(alloc, cap)}); the model, its optimizer state and the batch's activations do not fit.")
    if not out.diagnosis:
        out.diag("out_of_memory", "The cudaMallocAsync allocator could not get memory for this request.")
    if d.details.get("format") == _CUT_AT_DEVICE:
        out.notes.append("The message stops after 'Allocation on device': PyTorch streams the device index as a "
                         "raw byte, and device 0 is a NUL that ends the text (pytorch/pytorch#168369), so the "
                         "GPU is the first visible one and the request and free-memory figures were lost. ComfyUI "
                         "runs this backend by default; its --disable-cuda-malloc flag switches to the caching "
                         "allocator, whose OOM report keeps its numbers.")
    out.notes.append("This process uses the cudaMallocAsync backend (PYTORCH_CUDA_ALLOC_CONF="
                     "backend:cudaMallocAsync): expandable_segments and max_split_size_mb do not apply to it.")
    _phase_diag(out, phase, no_grad, d, None)
    trainable, states = _model_states(ctx) if _training_phase(phase) else (None, None)
    _size_fixes(out, d, ctx, phase, None, trainable, states, "PYTORCH_CUDA_ALLOC_CONF")
    _empty_cache_note(out)


def _diag_mps(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    n = d.numbers
    req, alloc, other, limit = n.get("requested"), n.get("allocated"), n.get("other_allocations"), n.get("limit")
    if None not in (req, alloc, other, limit):
        out.shortfall = max(0, alloc + other + req - limit)
        out.derived["shortfall"] = out.shortfall
        out.diag("mps_high_watermark",
                 f"PyTorch's MPS tensors ({_F(alloc)}) plus other Metal allocations of this process ({_F(other)}) "
                 f"plus the {_F(req)} request exceed the {_F(limit)} the MPS allocator allows itself (its high "
                 "watermark, a fraction of the Mac's unified memory, shared with macOS and every other app).")
        if other > alloc:
            out.diag("mps_other_allocations", f"'other allocations' ({_F(other)}) exceed PyTorch's own tensors: "
                     "memory held by Metal outside the MPS allocator - typically another model or pipeline "
                     "loaded in the same process.")
    else:
        out.diag("out_of_memory", "The MPS allocator reached its memory limit.")
    out.fix("mps_watermark", "Raise PYTORCH_MPS_HIGH_WATERMARK_RATIO (e.g. 1.0 -> higher; 0.0 removes the limit)",
            None, None, "may swap heavily and slow down the whole Mac", _QUALITY_NONE,
            "The limit protects macOS; lifting it lets PyTorch use swap-backed memory and can freeze the system. "
            "Close other apps first: unified memory is shared with them.", cost=3)
    _phase_diag(out, phase, no_grad, d, None)
    trainable, states = _model_states(ctx) if _training_phase(phase) else (None, None)
    _size_fixes(out, d, ctx, phase, None, trainable, states, "", multi_gpu=False)
