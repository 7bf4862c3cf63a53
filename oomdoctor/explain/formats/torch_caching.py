"""PyTorch's caching-allocator OOM on CUDA and ROCm/HIP, every message version: anchors, numbers, diagnosis."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..diagnosis import (_CONTEXT_MARGIN, _F, _QUALITY_NONE, _SPEED_NONE, _Ctx, _Out, _model_states, _pct,
                         _training_phase, _where)
from ..draft import _Draft
from ..fixes import _empty_cache_note, _load_fixes, _phase_diag, _size_fixes
from ..results import Kind, Phase, ProcessUse
from ..sizes import GiB, MiB, _to_bytes
from .patterns import _I, _SZ, _AnchorSpec, _rx, _size

# --- message anchors (squashed text) ---------------------------------------------------------

_ANCHORS: tuple[_AnchorSpec, ...] = (
    _AnchorSpec(Kind.CUDA_OOM, ("outofmemory",), re.compile(r"(CUDA|HIP)outofmemory", _I), absorb=60),
    # An excerpt that starts mid-message ("ut of memory. Tried to allocate ...").
    _AnchorSpec(Kind.CUDA_OOM, ("triedtoallocate",),
                re.compile(r"Triedtoallocate(?=" + _SZ + r"(?:\(GPU\d|\.GPU\d))", _I), absorb=60),
    # Fragments quoted without the first sentence: the bracket of torch 1.0-2.0 ("(GPU 0; 15.75 GiB
    # total capacity; ...)") or the sentences of torch>=2.2 ("Of the allocated memory ...").
    _AnchorSpec(Kind.CUDA_OOM, ("totalcapacity",), re.compile(
        r"\(GPU\d+;" + _SZ + r"totalcapacity;" + _SZ + r"alreadyallocated", _I), fallback=True),
    _AnchorSpec(Kind.CUDA_OOM, ("isallocatedbypytorch",), re.compile(
        r"(?:Includingnon-PyTorchmemory,thisprocesshas" + _SZ + r"memoryinuse\.)?"
        r"Oftheallocatedmemory" + _SZ + r"isallocatedbyPyTorch", _I), fallback=True),
)

# details["format"] of the message PyTorch itself cut at a NUL device byte, after "GPU" (see
# _diag_capacity; torch_async_mps.py has the cudaMallocAsync one).
_CUT_AT_GPU = "unknown (cut after 'GPU')"


# --- field patterns (squashed text) ----------------------------------------------------------

_F_REQUESTED = _rx(r"Triedtoallocate" + _SZ)
_F_GPU_OLD = _rx(r"\(GPU(\d+);")
_F_GPU_NEW = _rx(r"GPU(\d+)hasatotalcapac")
# The old format's fields follow a ';'. A message wrapped and pasted as a comment or a quote
# carries the marker into the joined line ("...allocated;\n # 0 bytes free;"), hence [#>*]*.
_SEP = r";[#>*]{0,3}"
_F_CAP_OLD = _rx(_SEP + _SZ + r"totalcapa(?:city|cit?$)")   # also cut mid-word at the end
_F_CAP_NEW = _rx(r"hasatotalcapac\w{0,4}?of" + _SZ)
_F_FREE_OLD = _rx(_SEP + _SZ + r"free")
_F_FREE_NEW = _rx(r"ofwhich" + _SZ + r"isfree")
_F_ALLOC_OLD = _rx(_SEP + _SZ + r"alreadyallocated")
_F_ALLOC_NEW = _rx(r"Oftheallocatedmemory" + _SZ + r"isallocatedbyPyTorch")
_F_CACHED = _rx(_SEP + _SZ + r"cached")
_F_RESERVED = _rx(_SEP + _SZ + r"reservedintotalbyPyTorch")
_F_ALLOWED = _rx(_SZ + r"allowed;")
_F_POOLS = _rx(r"with" + _SZ + r"allocatedinprivatepools")
_F_UNALLOC = _rx(r"and" + _SZ + r"isreservedbyPyTorchbutunallocated")
_F_THIS = _rx(r"thisprocesshas" + _SZ + r"memoryinuse")
_F_PROCESS = _rx(r"Process(\d+)has" + _SZ + r"memoryinuse")
_F_HINT_ENV = _rx(r"PYTORCH_(CUDA|HIP)_ALLOC_CONF=expandable_segments")


# --- extractor: squashed message text -> draft -----------------------------------------------

def _x_torch(span: str, pre: str, m: re.Match) -> _Draft:
    head = m.group(0)[:3].upper()
    hip = head == "HIP" or "PYTORCH_HIP_ALLOC_CONF" in span.upper() or "HIPGraphs" in span
    d = _Draft(Kind.HIP_OOM if hip else Kind.CUDA_OOM)
    n = d.numbers
    # "GPU  has a total capacity": the index byte was unprintable but the text went on
    sentence = (_F_GPU_NEW.search(span) is not None or "isallocatedbyPyTorch" in span
                or "hasatotalcapac" in span)
    fields = [("requested", _F_REQUESTED), ("private_pools", _F_POOLS), ("this_process", _F_THIS)]
    if sentence:
        fields += [("capacity", _F_CAP_NEW), ("free", _F_FREE_NEW), ("allocated", _F_ALLOC_NEW),
                   ("reserved_unallocated", _F_UNALLOC), ("limit", _F_ALLOWED)]
    else:
        fields += [("capacity", _F_CAP_OLD), ("free", _F_FREE_OLD), ("allocated", _F_ALLOC_OLD),
                   ("reserved", _F_RESERVED), ("reserved_unallocated", _F_CACHED), ("limit", _F_ALLOWED)]
    for name, rx in fields:
        value = _size(rx, span)
        if value is not None:
            n[name] = value
    gpu = _F_GPU_NEW.search(span) or _F_GPU_OLD.search(span)
    if gpu:
        d.gpus.append(int(gpu.group(1)))
    for pm in _F_PROCESS.finditer(span):
        if len(d.processes) < 64:
            d.processes.append(ProcessUse(int(pm.group(1)), _to_bytes(pm.group(2), pm.group(3))))
    d.details["format"] = _torch_format(span, sentence)
    if not sentence and re.match(r"(?:CUDA|HIP)outofmemory\.Triedtoallocate" + _SZ + r"\.GPU(?!\d*has)",
                                 span, re.I):
        d.details["format"] = _CUT_AT_GPU
    hint = _F_HINT_ENV.search(span)
    if hint:
        d.details["alloc_conf_env"] = f"PYTORCH_{hint.group(1).upper()}_ALLOC_CONF"
    d.sig = (n.get("requested"), n.get("capacity"))
    return d


def _torch_format(span: str, sentence: bool) -> str:
    low = span.lower()
    if not sentence:
        if "cached" in low and "reservedintotal" not in low:
            return "torch<=1.4"
        if "reservedintotal" in low or "alreadyallocated" in low:
            return "torch 1.5-2.0"
        return "unknown (truncated)"
    if "capacty" in low or "max_split_size_mb" in low:
        return "torch 2.1"
    if "expandable_segments" in low:
        return "torch>=2.2"
    return "torch>=2.1"


# --- diagnosis -------------------------------------------------------------------------------

@dataclass
class _TorchNums:
    """The figures of one PyTorch allocator message, with the gaps each version leaves filled in."""

    req: int | None
    cap: int | None
    free: int | None
    alloc: int | None
    reserved: int | None
    unalloc: int | None
    this: int | None
    limit: int | None
    fmt: str
    env: str
    where: str

    @property
    def sentence(self) -> bool:
        return self.fmt.startswith("torch>=") or self.fmt == "torch 2.1"

    @property
    def spill(self) -> bool:
        return self.cap is not None and max(self.alloc or 0, self.reserved or 0) > self.cap * 1.02


def _torch_numbers(d: _Draft, out: _Out) -> _TorchNums:
    n = d.numbers
    alloc, pools, fmt = n.get("allocated"), n.get("private_pools", 0), d.details.get("format", "")
    reserved, unalloc = n.get("reserved"), n.get("reserved_unallocated")
    if reserved is None and alloc is not None and unalloc is not None:
        # <= 1.4: "cached" is held by the allocator but unused (the torch <= 1.4 message built in
        # c10/cuda/CUDACachingAllocator.cpp's malloc);
        # >= 2.1: reserved = allocated + private pools + reserved-but-unallocated.
        reserved = alloc + unalloc + (0 if fmt == "torch<=1.4" else pools)
        out.derived["reserved"] = reserved
    if unalloc is None and reserved is not None and alloc is not None:
        unalloc = max(0, reserved - alloc - pools)
        out.derived["reserved_unallocated"] = unalloc
    env = d.details.get("alloc_conf_env") or \
        ("PYTORCH_HIP_ALLOC_CONF" if d.kind is Kind.HIP_OOM else "PYTORCH_CUDA_ALLOC_CONF")
    return _TorchNums(n.get("requested"), n.get("capacity"), n.get("free"), alloc, reserved, unalloc,
                      n.get("this_process"), n.get("limit"), fmt, env, _where(d))


def _diag_torch(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    """PyTorch caching-allocator OOM (CUDA or HIP), every message version."""
    t = _torch_numbers(d, out)
    trainable, states = _model_states(ctx) if _training_phase(phase) else (None, None)
    act = None
    if states is not None:
        out.derived["model_states"] = states
        if t.alloc is not None and phase in (Phase.FORWARD, Phase.BACKWARD) and t.alloc > states:
            act = t.alloc - states
            out.derived["activations"] = act
    if t.req is not None and t.free is not None:
        out.shortfall = max(0, t.req - t.free)
    _diag_spill(t, out)
    _diag_request_size(t, out)
    _diag_fraction(t, out)
    _diag_model_states(t, out, trainable, states)
    if not t.spill:
        _diag_other_memory(d, out, t.cap, t.free, t.reserved, t.this, t.req, t.where, t.sentence)
        _diag_free_but_unusable(t, out)
    _diag_fragmentation(t, out)
    _diag_capacity(t, out, cut_at_gpu=d.details.get("format") == _CUT_AT_GPU)
    if out.shortfall:
        out.derived["shortfall"] = out.shortfall
    _phase_diag(out, phase, no_grad, d, act)
    if phase is Phase.MODEL_LOADING:
        _load_fixes(out, ctx)
    else:
        _size_fixes(out, d, ctx, phase, act, trainable, states, t.env)
    if len(d.ranks) > 1 or (ctx.world or 1) > 1:
        out.notes.append("DDP replicates the whole model on every GPU: adding GPUs with DDP lowers the per-GPU "
                         "batch needed for a given global batch, never the per-GPU memory of the model itself.")
    _empty_cache_note(out)


def _diag_spill(t: _TorchNums, out: _Out) -> None:
    if not t.spill or t.cap is None:
        return
    held = max(t.alloc or 0, t.reserved or 0)
    out.shortfall = held + (t.req or 0) - t.cap
    out.diag("windows_shared_memory_spill",
             f"The message says PyTorch holds {_F(held)} on a {_F(t.cap)} card - more than the card has. The "
             "Windows (WDDM) driver spills GPU allocations into shared system memory, so these numbers do not "
             f"add up and the run was already crawling before it failed. Treat {_F(t.cap)} as the real limit: "
             f"about {_F(out.shortfall)} has to go.")


def _diag_request_size(t: _TorchNums, out: _Out) -> None:
    """A request larger than the card, or a large share of it: the tensor itself is the problem."""
    req, cap = t.req, t.cap
    if req is None or not cap:
        return
    if req > cap:
        if req >= 4 * cap:
            text = (f"The request alone is {_F(req)}, {req / cap:.0f}x the whole {_F(cap)} card. That is almost "
                    "always a shape mistake (an accidental broadcast, a wrong reshape, attention over a far "
                    "longer sequence than intended), not a memory shortage.")
        else:
            text = (f"A single {_F(req)} allocation is larger than the whole {_F(cap)} card: no allocator "
                    "setting, cache flush or other process can make it fit. The tensor itself must shrink.")
        out.diag("request_exceeds_capacity", text)
        out.fix("shrink_failing_tensor", "Make the failing tensor smaller: fewer samples per micro-batch, "
                "shorter sequences or smaller images, or compute that op in chunks (e.g. attention with "
                "F.scaled_dot_product_attention, sliced/tiled decoding)", req - cap + (t.free or 0), "at least",
                "chunking: slightly slower", "none when chunking; shorter inputs change the task",
                f"It must come down from {_F(req)} to well under {_F(cap)}.", cost=1, primary=True)
    elif req >= cap // 2:
        out.diag("huge_single_allocation",
                 f"A single allocation of {_F(req)} is {_pct(req, cap)} of the card: one huge activation "
                 "(typically attention scores batch x heads x seq x seq, or a large feature map). Chunking that "
                 "op or memory-efficient attention (F.scaled_dot_product_attention) helps most.")


def _diag_fraction(t: _TorchNums, out: _Out) -> None:
    limit, cap = t.limit, t.cap
    if limit is None or not cap or limit >= cap * 0.98 or t.req is None:
        return
    rounding = limit // 200 + 16 * MiB     # every figure in the message is rounded to 0.01 units
    if t.reserved is None or t.reserved + t.req > limit - rounding:
        out.diag("memory_fraction_limit",
                 f"This process is capped at {_F(limit)} ('allowed') by torch.cuda.set_per_process_memory_"
                 f"fraction, below the card's {_F(cap)}"
                 + (f"; the GPU still had {_F(t.free)} free" if t.free else "") + ".")
        out.fix("raise_memory_fraction", "Raise or remove torch.cuda.set_per_process_memory_fraction()",
                cap - limit, "up to", _SPEED_NONE, _QUALITY_NONE,
                "The cap is a software limit this process set on itself.", cost=0, primary=True)


def _diag_model_states(t: _TorchNums, out: _Out, trainable: int | None, states: int | None) -> None:
    if states is None or trainable is None or not t.cap or states <= t.cap * 0.9:
        return
    out.diag("model_states_exceed_card",
             f"The log reports {trainable:,} trainable parameters: weights, gradients and AdamW state alone take "
             f"about {_F(states)} (16 bytes per trainable parameter, fp32 or bf16 mixed precision; ZeRO paper "
             f"section 3.1), against a {_F(t.cap)} card. With activations on top, no batch size fits. DDP would "
             "not help - every DDP rank holds all of it. Shard it (FSDP / DeepSpeed ZeRO-3) or split the model.")
    # What must go is at least the states' excess plus this request, not just this request.
    out.shortfall = max(out.shortfall or 0, states + (t.req or 0) - t.cap)


def _near_full(t: _TorchNums) -> bool:
    """Free memory barely above the request: cudaMalloc needs headroom beyond the bytes asked
    for (2 MiB page granularity, driver bookkeeping), so the card is effectively full."""
    return (t.req is not None and t.free is not None and t.req <= t.free
            and t.free - t.req < max(128 * MiB, (t.cap or 0) // 100))


def _diag_free_but_unusable(t: _TorchNums, out: _Out) -> None:
    req, free = t.req, t.free
    if (req is not None and free is not None and free >= req and t.unalloc is not None and t.unalloc < req
            and "memory_fraction_limit" not in [x.cause for x in out.diagnosis]):
        if _near_full(t):
            out.diag("card_full",
                     f"Only {_F(free)} was free, {_F(free - req)} more than the {_F(req)} requested: "
                     "cudaMalloc needs headroom beyond the request (page granularity, driver "
                     "bookkeeping), so the GPU was effectively full.")
            return
        out.diag("free_but_unusable",
                 f"The driver reported {_F(free)} free, more than the {_F(req)} requested, yet cudaMalloc failed: "
                 "the free memory is not usable in one piece. On Windows (WDDM) the driver reserves part of it; "
                 "on shared or virtualised GPUs (MIG, vGPU) the limit is lower than the card.")


def _diag_fragmentation(t: _TorchNums, out: _Out) -> None:
    unalloc, req, free = t.unalloc, t.req, t.free
    if unalloc is None or unalloc < 64 * MiB or t.spill:
        return
    # After a failed cudaMalloc the allocator frees every unsplit cached block and retries
    # (c10/cuda/CUDACachingAllocator.cpp, malloc(): release_available_cached_blocks, then
    # release_cached_blocks, then alloc_block again), so what stays reserved-but-unallocated is pieces of
    # partly used segments: fragmentation, which is what these two settings address.
    fits = req is not None and free is not None and free < req <= unalloc + free
    share = unalloc / t.reserved if t.reserved else 0
    if fits or (share >= 0.2 and unalloc >= 512 * MiB):
        out.diag("fragmentation",
                 f"{_F(unalloc)} ({_pct(unalloc, t.reserved or 0)} of the {_F(t.reserved or 0)} PyTorch has "
                 "reserved) is reserved but unallocated: cached blocks too fragmented to serve the request"
                 + (f"; the {_F(req)} request would have fit if that memory were contiguous." if fits else "."))
    primary = "fragmentation" in [x.cause for x in out.diagnosis]
    if t.fmt in ("torch<=1.4", "torch 1.5-2.0"):
        out.fix("max_split_size_mb", f"Set {t.env}=max_split_size_mb:128 (or upgrade to torch >= 2.2 and use "
                "expandable_segments:True)", unalloc, "up to", "none to slight", _QUALITY_NONE,
                "Blocks of at least max_split_size_mb are never split, so large cached blocks stay whole for "
                "large requests.", cost=0, primary=primary)
    else:
        out.fix("expandable_segments", f"Set {t.env}=expandable_segments:True before the process starts",
                unalloc, "up to", _SPEED_NONE, _QUALITY_NONE,
                "Segments grow in place instead of being carved into fixed blocks, so reserved-but-unallocated "
                "memory becomes usable for the next request. It does not help the cudaMallocAsync backend.",
                cost=0, primary=primary)


def _diag_capacity(t: _TorchNums, out: _Out, cut_at_gpu: bool = False) -> None:
    """The default: PyTorch's own tensors fill the card."""
    causes = {x.cause for x in out.diagnosis}
    req, free, alloc, cap = t.req, t.free, t.alloc, t.cap
    short = free is None or req is None or req > free or _near_full(t)
    if (alloc is not None and cap and not t.spill and short
            and not causes & {"request_exceeds_capacity", "memory_fraction_limit"}
            and (alloc >= cap * 0.5 or not causes)):
        extra = f" and the step needed {_F(req)} more" if req is not None else ""
        if req is not None and free is not None and req > free:
            extra += f" ({_F(req - free)} beyond what was free)"
        out.diag("model_or_batch_too_big",
                 f"PyTorch's own tensors occupy {_F(alloc)} of the {_F(cap)} card ({_pct(alloc, cap)}){extra}. "
                 "The model, its gradients and optimizer state and this batch's activations do not fit together; "
                 "the fixes below shrink one of them.")
    if not out.diagnosis:
        what = f"a {_F(req)} request" if req is not None else "an allocation"
        why = ("the message is truncated, so the numbers that would say why are missing. Paste the complete "
               "message for a full diagnosis." if cap is None else "the numbers point to no single cause.")
        if cap is None and cut_at_gpu:
            why = ("PyTorch itself cut the message after 'GPU': it streamed the device index as a raw byte, and "
                   "GPU 0 is a NUL that ends the text (pytorch/pytorch#123984, fixed in later releases). So it "
                   "is the first visible GPU, and the capacity, free and per-process figures were never printed; "
                   "torch.cuda.memory_summary() in an except handler shows them.")
        out.diag("out_of_memory", f"{t.where} could not serve {what}; {why}")


def _diag_other_memory(d: _Draft, out: _Out, cap: int | None, free: int | None, reserved: int | None,
                       this: int | None, req: int | None, where: str, sentence: bool) -> None:
    """Memory on the card that this process's allocator does not hold: other processes, the
    container PID-namespace look-alike, and non-PyTorch memory."""
    procs = list(d.processes)
    self_proc = _container_self(procs, this, reserved, out)
    if self_proc is not None:
        procs.remove(self_proc)
    others = sum(p.bytes for p in procs)
    if others:
        out.derived["other_processes"] = others
    if others >= max(256 * MiB, (cap or 0) // 50):
        _diag_other_processes(out, procs, others, free, req, where)
    if cap is None or free is None:
        return
    used = max(0, cap - free)
    if sentence:
        own = this if this is not None else (self_proc.bytes if self_proc else reserved)
        if own is None:
            return
        _diag_non_pytorch(out, this, reserved)
        _diag_invisible_process(out, used - own - others, cap, others, where)
    elif reserved is not None:
        _diag_outside_allocator(out, used - reserved, cap, where)


def _container_self(procs: list[ProcessUse], this: int | None, reserved: int | None,
                    out: _Out) -> ProcessUse | None:
    """The listed process that is this very process seen through a container's PID namespace, if any."""
    if this is None and procs and reserved is not None:
        # No "this process has" sentence: in a container NVML reports host PIDs, so this process
        # appears as "Process <pid>" - recognisable because it holds ~ its own reserved memory.
        candidates = [p for p in procs if reserved * 0.95 <= p.bytes <= reserved + _CONTEXT_MARGIN + GiB]
        if candidates:
            self_proc = min(candidates, key=lambda p: p.bytes - reserved)
            out.diag("container_pid_namespace",
                     f"Process {self_proc.pid} ({_F(self_proc.bytes)}) matches this process's own reserved "
                     f"{_F(reserved)} plus the CUDA context, and the message has no 'this process has' sentence: "
                     "inside a container NVML reports host PIDs, so this is almost certainly this very process "
                     "seen through the PID namespace, not a competitor.")
            return self_proc
    return None


def _diag_other_processes(out: _Out, procs: list[ProcessUse], others: int, free: int | None, req: int | None,
                          where: str) -> None:
    """Other processes on the card hold enough to matter: two jobs on one GPU."""
    listing = ", ".join(f"PID {p.pid}: {_F(p.bytes)}" for p in procs[:6]) + (" ..." if len(procs) > 6 else "")
    would = ""
    if req is not None and free is not None:
        would = (f" Without them this process would have had {_F(free + others)} free - "
                 + ("enough" if free + others >= req else "still not enough") + f" for the {_F(req)} request.")
    if len(procs) == 1:
        who = f"Another process (PID {procs[0].pid}) holds {_F(others)} on {where}."
    else:
        who = f"{len(procs)} other processes hold {_F(others)} on {where} ({listing})."
    out.diag("other_process", f"{who} That is the 'two trainings on one GPU' situation: each job sees only "
             f"what the other leaves.{would}")
    out.fix("one_job_per_gpu", "Give each job its own GPU (CUDA_VISIBLE_DEVICES=0 for one, =1 for the "
            "other) or stop the other process", others, "about", "faster (no contention for compute either)",
            _QUALITY_NONE, "nvidia-smi lists who holds memory on which GPU. Two jobs on the same GPUs both "
            "run out of memory or both crawl.", cost=0, primary=True)


def _diag_non_pytorch(out: _Out, this: int | None, reserved: int | None) -> None:
    """torch >= 2.1: this process holds far more than its allocator's reserve plus a CUDA context."""
    if this is not None and reserved is not None and this - reserved > _CONTEXT_MARGIN + GiB:
        non_pt = this - reserved
        out.derived["non_pytorch_in_process"] = non_pt
        out.diag("non_pytorch_memory",
                 f"This process holds {_F(non_pt)} outside PyTorch's allocator - far more than a CUDA context "
                 "(~0.3-1.3 GiB): NCCL buffers, cuDNN/cuBLAS workspaces, or another GPU library in the same "
                 "process (TensorFlow and JAX preallocate most of the card by default; CuPy, TensorRT).")
        out.fix("stop_preallocation", "Stop the other GPU library in this process from preallocating "
                "(TF: tf.config.experimental.set_memory_growth; JAX: XLA_PYTHON_CLIENT_PREALLOCATE=false)",
                non_pt - _CONTEXT_MARGIN, "up to", _SPEED_NONE, _QUALITY_NONE,
                "Or load only one framework onto the GPU per process.", cost=0, primary=True)


def _diag_invisible_process(out: _Out, unexplained: int, cap: int, others: int, where: str) -> None:
    """torch >= 2.1: memory in use that neither this process nor a listed process accounts for."""
    # "this process has" already counts this process's CUDA context, so anything beyond it
    # (a few hundred MiB tolerance for rounding and driver reservations) belongs to others.
    if unexplained > max(256 * MiB, cap // 10) and not others:
        out.derived["outside_allocator"] = unexplained
        out.diag("invisible_process",
                 f"{_F(unexplained)} of {where} is in use by something this message does not list: usually "
                 "another process that NVML cannot see from inside a container, or a display/desktop session "
                 "on the same GPU.")
        out.fix("find_gpu_users", "Find and stop what else uses the GPU (nvidia-smi on the host)",
                unexplained, "up to", _SPEED_NONE, _QUALITY_NONE,
                "Run nvidia-smi outside the container; a notebook kernel that still holds a model is a common "
                "culprit.", cost=0, primary=True)


def _diag_outside_allocator(out: _Out, outside: int, cap: int, where: str) -> None:
    """torch <= 2.0 (no process list): memory in use beyond what the allocator reserved."""
    if outside > max(_CONTEXT_MARGIN, cap // 10):
        out.derived["outside_allocator"] = outside
        out.diag("outside_allocator",
                 f"{_F(outside)} of {where} is in use but not reserved by this process's PyTorch allocator. "
                 "The CUDA context explains only ~0.3-1.3 GiB; the rest is another process (two trainings "
                 "on the same GPU, a notebook kernel still holding a model) or non-PyTorch memory in this "
                 "process (cuDNN/NCCL workspaces, TensorFlow, TensorRT).")
        out.fix("find_gpu_users", "Find and stop what else uses the GPU (nvidia-smi), or run each job on its "
                "own GPU with CUDA_VISIBLE_DEVICES", outside - 512 * MiB, "up to", _SPEED_NONE, _QUALITY_NONE,
                "This message format (torch <= 2.0) does not list processes; nvidia-smi does.",
                cost=0, primary=True)
