"""CUDA redirected to the CPU: what a training script runs under in `oomdoctor smoke -- python
train.py` on a machine without a GPU.

    oomdoctor smoke --steps 3 -- python tests/scripts/mlp_loop.py --samples 256

Most scripts hard-code CUDA (``.cuda()``, ``.to("cuda")``, ``device="cuda"``,
``torch.autocast("cuda")``, a ``GradScaler``). In the smoke's child process
(:mod:`oomdoctor.runs.script_child`), while the script runs:

- ``torch.cuda`` answers as one GPU would (``is_available()``, ``device_count()`` 1,
  ``is_bf16_supported()``), so the script takes the path it takes on a GPU; its memory queries
  answer 0: nothing is measured.
- A tensor put on "cuda" (``.cuda()``, ``.to("cuda")``, ``device="cuda"``, a device index)
  stays a real CPU tensor: a TorchFunctionMode, as :class:`oomdoctor.sim.fakecuda.DeviceMode`
  sends it to the meta device, with the data kept.
- ``torch.autocast("cuda", float16 | bfloat16)`` (and ``torch.cuda.amp.autocast``) is CPU
  autocast in bfloat16, as a model file's CPU smoke runs fp16 (oomdoctor.runs.smoke); with
  ``dtype=None`` given it is off, for a CPU without fast bf16 (a bf16 matmul emulated there
  runs many times slower than fp32).
- ``GradScaler`` is disabled: ``scale()`` returns the loss, ``step()`` steps, ``update()`` does
  nothing - there is no fp16 gradient to protect.
- ``pin_memory()`` is the tensor itself; ``torch.load(map_location="cuda")`` loads to the CPU;
  ``torch.cuda.Event`` times on the host clock.

Known limitations: ``torch.accelerator`` is not redirected (it says there is no accelerator, so
a DataLoader's ``pin_memory`` is off); CUDA streams, CUDA graphs, NCCL and libraries that call
their own CUDA kernels (bitsandbytes, flash-attn) fail as they would on a CPU, with their own
error; ``tensor.is_cuda`` is False.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from oomdoctor.sim.fakecuda import patched

# torch.cuda.get_device_name() in the redirected run: a script that logs it says where it ran.
DEVICE_NAME = "CPU (CUDA redirected by oomdoctor smoke)"


@dataclass
class Seen:
    """What the script asked of CUDA that the CPU ran differently: for the smoke's notes."""

    autocast: list[str] = field(default_factory=list)    # dtypes of its CUDA autocasts
    grad_scaler: bool = False                             # it made an enabled GradScaler


def _is_cuda(device: Any) -> bool:
    """Whether a device argument names CUDA: "cuda", "cuda:1", a torch.device, an index."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu(device: Any) -> Any:
    return torch.device("cpu") if _is_cuda(device) else device


class CpuMode(TorchFunctionMode):
    """Keeps what the script puts on "cuda" on the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            fmt = kwargs.get("memory_format", torch.preserve_format)
            return args[0] if fmt is torch.preserve_format else \
                args[0].contiguous(memory_format=fmt)
        if func is torch.Tensor.pin_memory:      # no pinned memory without a GPU
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _cpu(args[1]), *args[2:])
        if func is torch.device and len(args) == 1 and _is_cuda(args[0]) \
                and isinstance(args[0], int):
            return torch.device("cuda", args[0])    # a CPU-only torch refuses torch.device(0)
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_cpu(kwargs["device"]))
        return func(*args, **kwargs)


def _autocast_classes(seen: Seen, cpu_dtype: torch.dtype | None) -> tuple[type, type]:
    """``torch.autocast`` and ``torch.cuda.amp.autocast`` where CUDA's is CPU autocast in
    ``cpu_dtype`` (None: off). Subclasses, so that ``isinstance(x, torch.autocast)`` still
    holds and both still decorate a function."""
    real = torch.amp.autocast_mode.autocast

    class CudaOnCpuAutocast(real):
        def __init__(self, device_type: str = "cuda", dtype: torch.dtype | None = None,
                     enabled: bool = True, cache_enabled: bool | None = None):
            if device_type == "cuda":
                asked = dtype or torch.float16
                half = asked in (torch.float16, torch.bfloat16)
                name = str(asked).removeprefix("torch.")
                if enabled and half and name not in seen.autocast:
                    seen.autocast.append(name)
                device_type, dtype = "cpu", cpu_dtype
                enabled = enabled and half and cpu_dtype is not None
            super().__init__(device_type, dtype, enabled, cache_enabled)

    class CudaAmpAutocast(CudaOnCpuAutocast):        # torch.cuda.amp.autocast's signature
        def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                     cache_enabled: bool = True):
            super().__init__("cuda", dtype, enabled, cache_enabled)
    return CudaOnCpuAutocast, CudaAmpAutocast


def _scaler_class(seen: Seen) -> type:
    """``GradScaler`` made disabled, whether built as ``torch.amp.GradScaler("cuda", ...)`` or
    ``torch.cuda.amp.GradScaler(init_scale, ...)``."""
    real = torch.amp.grad_scaler.GradScaler

    class DisabledGradScaler(real):
        def __init__(self, device: Any = "cuda", *args: Any, **kwargs: Any):
            if not isinstance(device, str):       # torch.cuda.amp.GradScaler(init_scale, ...)
                args, device = (device, *args), "cuda"
            # (init_scale, growth_factor, backoff_factor, growth_interval, enabled)
            enabled = kwargs.pop("enabled", args[4] if len(args) > 4 else True)
            seen.grad_scaler = seen.grad_scaler or bool(enabled)
            super().__init__("cpu", *args[:4], enabled=False, **kwargs)
    return DisabledGradScaler


class _Properties:
    """``torch.cuda.get_device_properties()`` of the redirected device: the host's RAM."""

    def __init__(self) -> None:
        self.name = DEVICE_NAME
        self.total_memory = _host_bytes()
        self.major, self.minor = 8, 0           # bf16 capable, as the CPU's autocast is
        self.multi_processor_count = os.cpu_count() or 1
        self.is_integrated = False

    def __repr__(self) -> str:
        return f"_CudaDeviceProperties(name='{self.name}', total_memory=" \
               f"{self.total_memory // 2**20}MB)"


def _host_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


class _Event:
    """``torch.cuda.Event`` on the host clock (the CPU runs each op before returning)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: "_Event") -> float:
        return 1000.0 * ((end.at or 0.0) - (self.at or 0.0))

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, _other: Any) -> None:
        pass

    def is_capturing(self) -> bool:
        return False


def _returning(value: Any) -> Any:
    """A function returning ``value``: one object per name (torch._dynamo, imported by the
    optimizers, refuses one function object under two torch.cuda names)."""
    return lambda *args, **kwargs: value


def _cuda_answers() -> dict[str, Any]:
    """``torch.cuda`` as one GPU answers it, nothing measured."""
    props = _Properties()
    answers = {name: _returning(None) for name in (
        "set_device", "synchronize", "empty_cache", "init", "reset_peak_memory_stats",
        "reset_max_memory_allocated", "manual_seed", "manual_seed_all", "seed", "seed_all")}
    answers.update({name: _returning(0) for name in (   # memory: not measured
        "current_device", "memory_allocated", "max_memory_allocated", "memory_reserved",
        "max_memory_reserved")})
    answers.update({name: _returning(True) for name in (
        "is_available", "is_initialized", "is_bf16_supported")})
    answers.update({
        "device_count": _returning(1), "get_device_name": _returning(DEVICE_NAME),
        "get_device_capability": _returning((props.major, props.minor)),
        "get_device_properties": _returning(props),
        "mem_get_info": _returning((props.total_memory, props.total_memory)),
        "memory_summary": _returning("(oomdoctor smoke on the CPU: GPU memory not measured)"),
        "device": lambda *args, **kwargs: contextlib.nullcontext(),
        "current_stream": lambda *args, **kwargs: _Stream(),
        "default_stream": lambda *args, **kwargs: _Stream(),
        "is_current_stream_capturing": _returning(False), "Event": _Event})
    return answers


def _load(real: Any) -> Any:
    """``torch.load`` with a CUDA ``map_location`` loads to the CPU."""
    def load(f, map_location=None, *args, **kwargs):
        if _is_cuda(map_location):
            map_location = "cpu"
        return real(f, map_location, *args, **kwargs)
    return load


@contextlib.contextmanager
def cuda_on_cpu(seen: Seen, autocast_dtype: torch.dtype | None = torch.bfloat16
                ) -> Iterator[None]:
    """Everything the script sees of the redirected CUDA device (see the module docstring);
    ``autocast_dtype``: what CUDA autocast runs as (None: off, fp32)."""
    autocast, cuda_autocast = _autocast_classes(seen, autocast_dtype)
    scaler = _scaler_class(seen)
    from torch.utils.data._utils import pin_memory as pinning
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(torch.cuda, _cuda_answers()))
        stack.enter_context(patched(torch, {"autocast": autocast, "load": _load(torch.load)}))
        stack.enter_context(patched(torch.amp, {"autocast": autocast, "GradScaler": scaler}))
        stack.enter_context(patched(torch.cuda.amp, {"autocast": cuda_autocast,
                                                     "GradScaler": scaler}))
        # a DataLoader's pinning thread (older torch asks torch.cuda whether to pin) runs
        # outside the function mode, which is per thread
        stack.enter_context(patched(pinning, {"pin_memory": lambda data, device=None: data}))
        stack.enter_context(CpuMode())
        yield
