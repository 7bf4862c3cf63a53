"""CUDA/HIP runtime and driver out-of-memory errors (PyTorch, Caffe, TF/XLA's driver), cuBLAS and cuDNN failures."""
from __future__ import annotations

import re

from ..diagnosis import _F, _QUALITY_NONE, _SPEED_NONE, _Ctx, _Out, _model_states, _training_phase
from ..draft import _Draft
from ..fixes import _empty_cache_note, _load_fixes, _phase_diag, _size_fixes
from ..results import Kind, Phase
from ..sizes import _NO_GPU_HAS
from .patterns import _I, _AnchorSpec

# --- message anchors (squashed text) ---------------------------------------------------------

_ANCHORS: tuple[_AnchorSpec, ...] = (
    _AnchorSpec(Kind.CUDA_ERROR_OOM, ("outofmemory", "out_of_memory", "memoryallocation",
                                      "hiperror_t(1002)"), re.compile(
        r"(?:CUDA|HIP)(?:runtime)?(?:error|failure|failedwitherror)\W{0,3}\d{0,3}\W{0,3}outofmemory"
        r"|error=2:outofmemory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|hipErrorOutOfMemory"
        # Caffe and other glog CHECKs: "Check failed: error == cudaSuccess (2 vs. 0)  out of memory".
        r"|cudaSuccess\(2vs\.0\)outofmemory"
        # TensorFlow's ROCm driver (rocm_driver.cc): "failed to allocate 890.06M (933298432
        # bytes) from device: HIP_ERROR_OutOfMemory", older builds print the raw hipError_t 1002.
        r"|HIP_ERROR_OutOfMemory|fromdevice:hipError_t\(1002\)"
        # thrust's system_error (PyTorch's sort, unique, index ops; CUDA extensions): "after cudaLaunch in
        # triple_chevron_launcher::launch(): out of memory", "parallel_for failed: out of memory"
        r"|aftercudaLaunchin[\w:]{0,80}\(\):outofmemory|parallel_forfailed:outofmemory"
        r"|failedtosynchronize:outofmemory", _I)),
    _AnchorSpec(Kind.CUBLAS_ALLOC, ("cublas_status",),
                re.compile(r"CUBLAS_STATUS_(?:ALLOC_FAILED|NOT_INITIALIZED)", _I)),
    _AnchorSpec(Kind.CUDNN_FAILURE, ("cudnn_status", "cudnnalgorithm", "unabletofindanengine",
                                     "convolutionalgorithms"), re.compile(
        r"CUDNN_STATUS_(?:ALLOC_FAILED|NOT_SUPPORTED|NOT_ENOUGH_WORKSPACE|NOT_INITIALIZED|INTERNAL_ERROR"
        r"|MAPPING_ERROR)"
        r"|Unabletofindavalidcudnnalgorithm|(?:GET|FIND)wasunabletofindanengine"
        # torch 1.x: "no valid convolution algorithms available in CuDNN"
        r"|novalidconvolutionalgorithmsavailableinCuDNN", _I), absorb=300),
)


# --- extractors: squashed message text -> draft ----------------------------------------------

def _x_cuda_error(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.CUDA_ERROR_OOM)
    text = m.group(0).upper()
    context = (pre + span[:200]).lower()
    driver = text in ("CUDA_ERROR_OUT_OF_MEMORY", "HIP_ERROR_OUTOFMEMORY") \
        or text.startswith("FROMDEVICE:HIPERROR_T")
    if driver and ("stream_executor" in context or "failedtoalloc" in context
                   or "tensorflow" in context or "xla" in context):
        # cuda_driver.cc / rocm_driver.cc in TensorFlow/XLA logs: "failed to alloc N bytes ...
        # result: CUDA_ERROR_OUT_OF_MEMORY" or "failed to allocate 10.76G (11553462016 bytes)
        # from device: ..."; the framework's own error usually follows.
        d.details["source"] = "driver (TensorFlow/XLA stream executor)"
        if "onhost" in context or "pinnedhostmemory" in context:
            d.details["source"] = "driver: pinned host memory (TensorFlow/XLA)"
        req = re.search(r"failedtoalloc(?:ate)?(?:[\d.]+[KMGTPE]?i?B?\()?(\d+)bytes", pre + span, re.I)
        if req:
            d.numbers["requested"] = int(req.group(1))
    elif "CUDA_ERROR_OUT_OF_MEMORY" in text:
        d.details["source"] = "CUDA driver API" + (" (context creation)" if "cuctxcreate" in context else "")
    elif "ERROR=2" in text or "RUNTIMEERROR(2)" in text:
        d.details["source"] = "old PyTorch THC (cuda runtime error 2)"
    elif text.startswith(("AFTERCUDALAUNCH", "PARALLEL_FOR", "FAILEDTOSYNCHRONIZE")):
        d.details["source"] = "thrust (a CUDA library's kernel launch or allocation)"
    else:
        d.details["source"] = "CUDA runtime/driver"
    if text.startswith("HIP") or "HIPERROR" in text:
        d.details["platform"] = "ROCm/HIP"
    d.sig = (d.details["source"],)
    return d


def _x_cublas(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.CUBLAS_ALLOC)
    d.details["status"] = m.group(0).upper()
    # TensorFlow logs "failed to create cublas handle: CUBLAS_STATUS_NOT_INITIALIZED" and then the
    # driver's "CUDA_ERROR_OUT_OF_MEMORY" (absorbed into this finding): the GPU was full.
    if re.search(r"CUDA_ERROR_OUT_OF_MEMORY|(?:CUDA|HIP)(?:error:?)?outofmemory", span[:1500], re.I):
        d.details["driver_oom_follows"] = "yes"
    # (the glog prefix naming tensorflow/stream_executor is stripped; the wording is TensorFlow's)
    if re.search(r"tensorflow|stream_executor|failedtocreatecublashandle", pre + span[:1500], re.I):
        d.details["framework"] = "TensorFlow"
    d.sig = (d.details["status"],)
    return d


def _x_cudnn(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.CUDNN_FAILURE)
    text = m.group(0)
    if text.upper().startswith("CUDNN_STATUS_"):
        d.details["status"] = text.upper()
    elif text.lower().startswith("unable"):
        d.details["status"] = "no valid cuDNN algorithm"
    else:
        d.details["status"] = "no cuDNN engine (cuDNN frontend)"
    d.sig = (d.details["status"],)
    return d


# --- diagnosis -------------------------------------------------------------------------------

def _diag_cuda_error(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    funcs = {f.func for f in d.frames}
    source = d.details.get("source", "")
    req = d.numbers.get("requested")
    if req is not None and req > _NO_GPU_HAS:
        out.diag("request_absurd", f"The request is {_F(req)} in one piece, more than any GPU has: a size bug "
                 "(a garbage or negative size read as unsigned, a wrong shape), not a memory shortage.")
        out.fix("find_bad_size", "Find the operation that asks for it and check the shapes/sizes passed to it "
                "(CUDA_LAUNCH_BLOCKING=1 makes PyTorch report the failing call; TensorFlow/JAX name the op in "
                "the error that follows)", None, None, _SPEED_NONE, _QUALITY_NONE, "", cost=0, primary=True)
        return
    if source.startswith("driver: pinned host"):
        out.diag("pinned_host_memory", "The CUDA driver could not page-lock (pin) "
                 + (f"{_F(req)} of " if req is not None else "") + "host RAM for fast host-GPU copies: it is the "
                 "machine's RAM (or the locked-memory limit) that ran short, not the GPU.")
        out.fix("free_host_ram", "Free host RAM (free -g; fewer data-pipeline workers and smaller prefetch/shuffle "
                "buffers); in a container raise the locked-memory limit: docker run --ulimit memlock=-1", None, None,
                _SPEED_NONE, _QUALITY_NONE, "", cost=0, primary=True)
        return
    if source.startswith("driver"):
        out.diag("framework_driver_oom", "The TensorFlow/XLA runtime could not get memory from the CUDA driver. "
                 "Both frameworks preallocate most of the GPU per process, so a second process (or PyTorch in the "
                 "same process) leaves too little.")
        out.fix("stop_preallocation", "Turn off preallocation: TF_FORCE_GPU_ALLOW_GROWTH=true (TensorFlow), "
                "XLA_PYTHON_CLIENT_PREALLOCATE=false (JAX)", None, None, "slightly slower allocation",
                _QUALITY_NONE, "Each process then takes only what it uses.", cost=0, primary=True)
        return
    early = bool(funcs & {"_lazy_init", "set_device", "init_process_group", "_cuda_init", "cuda", "_apply"}) \
        or phase is Phase.MODEL_LOADING or "context creation" in source
    if early:
        out.diag("gpu_full_at_start", "CUDA ran out of memory while initialising or moving the model, before "
                 "training allocated anything: the GPU was already (almost) full - another process holds it, or "
                 "several processes share one GPU.")
    else:
        out.diag("out_of_memory_no_numbers", "CUDA itself refused an allocation (inside a library kernel, a "
                 "CUDA context, or with caching disabled), so there is no allocator report with numbers. It is "
                 "still an out-of-memory error: the GPU was full at that moment.")
    multi = len(d.ranks) > 1 or (ctx.world or 1) > 1
    if multi:
        out.diag("all_ranks_on_one_gpu", "Several ranks report it: if torch.cuda.set_device(local_rank) is not "
                 "called before the first CUDA call, every rank creates its context (and its tensors) on GPU 0.")
        out.fix("set_device", "Call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before any CUDA work "
                "and use device=f'cuda:{local_rank}'", None, None, _SPEED_NONE, _QUALITY_NONE,
                "Then each rank uses its own GPU; nvidia-smi should show one process per GPU.", cost=0, primary=True)
    out.fix("find_gpu_users", "Check what already holds the GPU: nvidia-smi (stop stray processes, one job per "
            "GPU with CUDA_VISIBLE_DEVICES)", None, None, _SPEED_NONE, _QUALITY_NONE,
            "A crashed run or an idle notebook kernel often still holds gigabytes.", cost=0, primary=early)
    out.notes.append("CUDA errors are reported asynchronously: rerun with CUDA_LAUNCH_BLOCKING=1 to see the "
                     "call that really failed.")
    _phase_diag(out, phase, no_grad, d, None)
    if phase is Phase.MODEL_LOADING:
        _load_fixes(out, ctx)
    else:
        trainable, states = _model_states(ctx) if _training_phase(phase) else (None, None)
        _size_fixes(out, d, ctx, phase, None, trainable, states, "PYTORCH_CUDA_ALLOC_CONF")
    _empty_cache_note(out)


def _diag_cublas(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    status = d.details.get("status", "")
    if "ALLOC_FAILED" in status:
        out.diag("library_alloc_failed", "cuBLAS could not allocate its handle/workspace, which happens on the "
                 "first matrix multiply on a stream: the GPU was already full at that moment. It is an "
                 "out-of-memory error reported without numbers.")
    elif d.details.get("driver_oom_follows"):
        out.diag("library_not_initialized_oom", "cuBLAS could not initialise because the GPU had no memory left "
                 "for its handle: the same log shows the driver refusing an allocation (CUDA_ERROR_OUT_OF_MEMORY). "
                 "An out-of-memory error, not a broken installation.")
    else:
        out.diag("library_not_initialized", "cuBLAS could not initialise: most often the GPU was already full "
                 "when its handle was created (an OOM in disguise); otherwise a CUDA/driver/PyTorch build mismatch.")
    if d.details.get("framework") == "TensorFlow":
        out.fix("stop_preallocation", "Stop TensorFlow from taking the whole GPU up front: "
                "TF_FORCE_GPU_ALLOW_GROWTH=true (or tf.config.experimental.set_memory_growth)", None, None,
                "slightly slower allocation", _QUALITY_NONE, "A second TensorFlow process (or a notebook kernel "
                "still holding the GPU) otherwise leaves nothing for the next one.", cost=0, primary=True)
    out.fix("find_gpu_users", "Check what already holds the GPU (nvidia-smi) and free it", None, None, _SPEED_NONE,
            _QUALITY_NONE, "", cost=0, primary=True)
    _phase_diag(out, phase, no_grad, d, None)
    trainable, states = _model_states(ctx) if _training_phase(phase) else (None, None)
    _size_fixes(out, d, ctx, phase, None, trainable, states, "")
    out.notes.append("Rerun with CUDA_LAUNCH_BLOCKING=1 to see the failing call.")


def _diag_cudnn(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    status = d.details.get("status", "")
    if "ALLOC_FAILED" in status or "NOT_ENOUGH_WORKSPACE" in status or "no valid" in status or "engine" in status:
        out.diag("cudnn_workspace", "cuDNN could not get memory for a convolution's workspace (or found no "
                 "algorithm that fits in the memory left): an out-of-memory error in disguise.")
        out.fix("cudnn_benchmark_off", "torch.backends.cudnn.benchmark = False", None, None,
                "convolutions may be slightly slower", _QUALITY_NONE,
                "benchmark=True tries workspace-hungry algorithms; off, cuDNN picks ones that need less memory.",
                cost=1)
    elif "NOT_SUPPORTED" in status:
        out.diag("cudnn_not_supported", "cuDNN rejected the convolution: usually an input too large for it (more "
                 "than 2^31 elements in one tensor, e.g. a large batch of big 3D volumes) or too little memory.")
    else:
        out.diag("cudnn_init", "cuDNN failed to initialise or hit an internal error: most often the GPU was "
                 "already full (an OOM in disguise); otherwise a cuDNN/CUDA version mismatch.")
    _phase_diag(out, phase, no_grad, d, None)
    trainable, states = _model_states(ctx) if _training_phase(phase) else (None, None)
    _size_fixes(out, d, ctx, phase, None, trainable, states, "")
    out.notes.append("Rerun with CUDA_LAUNCH_BLOCKING=1 to see the failing call.")
