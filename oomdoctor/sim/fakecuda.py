"""A CUDA device that is not there: what a training script sees when oomdoctor runs it.

    oomdoctor estimate -- python train.py --lr 3e-4

A training script (:mod:`oomdoctor.sim.script`) runs unmodified in oomdoctor's process. While it
runs:

- ``torch.cuda`` answers as the chosen card would: ``is_available()`` is true,
  ``device_count()`` is ``--num-gpus``, ``get_device_properties``/``mem_get_info`` give its
  capacity, ``memory_allocated``/``max_memory_allocated`` the simulation's live bytes.
- A tensor put on ``"cuda"`` (``.cuda()``, ``.to("cuda")``, ``device="cuda"``, a
  ``torch.device("cuda")`` block) lives on the meta device, where the trace's tensors live: a
  shape and a dtype, no data. A CPU tensor keeps its real values beside its meta copy
  (:mod:`oomdoctor.sim.values`), so a mask's ``.any()`` or a label count's ``.item()`` get the
  real answer; a read of a value computed from the weights (``loss.item()``) gets a stand-in.
- Modules build their parameters and buffers on the meta device (as accelerate's
  ``init_empty_weights`` does), held as host tensors until the script moves them to the GPU:
  a 7B model costs no RAM, and ``model.to(torch.bfloat16).cuda()`` puts only bf16 weights on
  the card, as on a real one.
- ``torch.autocast("cuda")`` is CUDA's autocast (:class:`oomdoctor.sim.emulate.CudaAutocast`),
  and ``GradScaler`` scales and unscales as CUDA's does but always steps (its inf check reads a
  value the weights decide).

Everything the module patches is restored when :func:`fake_cuda` ends.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from oomdoctor.sim import emulate, values


@dataclass
class FakeGpu:
    """The card the script sees."""

    name: str
    total_bytes: int
    capability: tuple[int, int]
    count: int = 1
    # (allocated now, peak allocated) in bytes, from the run's recorder
    usage: Callable[[], tuple[int, int]] = lambda: (0, 0)


@dataclass
class Reads:
    """Values the script read that the fake device has no data for, answered with stand-ins."""

    scalars: int = 0          # .item() / bool() of a value the weights decide (loss.item())
    copies: int = 0           # .cpu() / .numpy() of such a tensor, answered with zeros
    saves: int = 0            # torch.save calls of GPU tensors, skipped (no data to write)
    where: list[str] = field(default_factory=list)


class HostTensors:
    """Meta storages that stand for CPU tensors: a module's weights before ``.cuda()``."""

    def __init__(self) -> None:
        self._keys: set[int] = set()

    def add(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key not in self._keys:
            self._keys.add(key)
            weakref.finalize(st, self._keys.discard, key)

    def __contains__(self, t: torch.Tensor) -> bool:
        return t.device.type == "meta" and t.untyped_storage()._cdata in self._keys


def _is_index(device: Any) -> bool:
    return isinstance(device, int) and not isinstance(device, bool)


def _cuda_index(device: Any) -> Any:
    """An int device is the accelerator's index: CUDA's here (a CPU-only torch refuses
    ``torch.device(0)`` and ``t.to(0)``: "Cannot access accelerator device")."""
    return torch.device("cuda", device) if _is_index(device) else device


def is_gpu(device: Any) -> bool:
    """Whether a device argument names the GPU: "cuda", "cuda:1", an int, or "meta" (where the
    fake GPU's tensors are, so ``x.to(model.device)`` is a move to the GPU)."""
    if _is_index(device):
        return True
    if isinstance(device, str):
        return device.split(":")[0] in ("cuda", "meta")
    return isinstance(device, torch.device) and device.type in ("cuda", "meta")


class Device:
    """The run's device state, shared by the function mode and the patches."""

    def __init__(self, gpu: FakeGpu, shadows: values.Shadows, reads: Reads) -> None:
        self.gpu = gpu
        self.shadows = shadows
        self.reads = reads
        self.host = HostTensors()
        self.quiet = 0            # > 0: a patch is moving a module's weights; not the script
        self.uploads = 0          # > 0: an upload is copying a host tensor to the GPU
        self.autocast: set[torch.dtype] = set()    # the dtypes the script autocast to

    @contextlib.contextmanager
    def quietly(self) -> Iterator[None]:
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    def upload(self, t: torch.Tensor, dtype: torch.dtype | None,
               memory_format: torch.memory_format | None) -> torch.Tensor:
        """``t`` on the GPU: itself when it is there already, else a fresh copy (device
        memory), with the CPU tensor's values beside it."""
        fmt = {} if memory_format is None else {"memory_format": memory_format}
        if t.device.type == "meta" and t not in self.host:
            return t if dtype is None and not fmt else t.to(dtype=dtype, **fmt)
        self.uploads += 1
        try:
            out = t.to("meta", dtype=dtype, copy=True, **fmt)
        finally:
            self.uploads -= 1
        if t.device.type == "cpu" and t.numel() <= values.MAX_NUMEL:
            self.shadows.values[out] = t if dtype is None else t.to(dtype)
        return out

    def download(self, t: torch.Tensor) -> torch.Tensor:
        """``t.cpu()``: its real values where the run has them, else zeros (counted)."""
        real = values.real_value(t)
        if real is not None:
            return real
        self.reads.copies += 1
        with torch.device("cpu"):
            return torch.zeros(t.shape, dtype=t.dtype)


class DeviceMode(TorchFunctionMode):
    """Sends what the script puts on "cuda" to the meta device (see the module docstring)."""

    def __init__(self, device: Device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = self.device
        if dev.quiet:
            return func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return dev.upload(args[0], None, kwargs.get("memory_format"))
        if func is torch.Tensor.to:
            return self._to(func, args, kwargs)
        if func in (torch.Tensor.cpu, torch.Tensor.numpy) and _on_gpu(args[0], dev):
            out = dev.download(args[0])
            return out.numpy() if func is torch.Tensor.numpy else out
        if func is torch.Tensor.pin_memory:          # pinned host memory: nothing on the GPU
            return args[0]
        if func is torch.Tensor.__format__ and _on_gpu(args[0], dev) and args[0].dim() == 0:
            return args[0].item().__format__(*args[1:])   # f"{loss:.4f}": a stand-in, as .item()
        if func is torch.device and len(args) == 1 and _is_index(args[0]) and not kwargs:
            return _cuda_index(args[0])
        if "device" in kwargs and is_gpu(kwargs["device"]):
            kwargs = dict(kwargs, device=torch.device("meta"))
        return func(*args, **kwargs)

    def _to(self, func, args, kwargs):
        t = args[0]
        other = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        if other is not None:             # t.to(other): other's device and dtype
            args, kwargs = (t, other.device, other.dtype) + tuple(args[2:]), kwargs
        if "device" in kwargs:            # transformers' loader moves to device=0
            kwargs = dict(kwargs, device=_cuda_index(kwargs["device"]))
        if len(args) > 1:
            args = (t, _cuda_index(args[1])) + tuple(args[2:])
        parse = {k: v for k, v in kwargs.items() if k != "copy"}
        device, dtype, _nb, fmt = torch._C._nn._parse_to(*args[1:], **parse)
        if device is not None and is_gpu(device):
            return self.device.upload(t, dtype, fmt)
        if device is not None and device.type == "cpu" and _on_gpu(t, self.device):
            out = self.device.download(t)
            return out if dtype is None else out.to(dtype)
        return func(*args, **kwargs)


def _on_gpu(t: Any, device: Device) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta" and t not in device.host


@contextlib.contextmanager
def modules_on_meta(device: Device) -> Iterator[None]:
    """Parameters and buffers a module registers on the CPU are kept as meta host tensors (no
    RAM, no initialisation work); ``.cuda()`` copies them to the GPU (:meth:`Device.upload`)."""
    module = torch.nn.Module
    real_param, real_buffer = module.register_parameter, module.register_buffer

    def to_host(t: torch.Tensor) -> torch.Tensor:
        with device.quietly():
            meta = t.to("meta")
        device.host.add(meta)
        return meta

    def register_parameter(self, name, param):
        if param is not None and param.device.type == "cpu" and type(param) is torch.nn.Parameter:
            param = torch.nn.Parameter(to_host(param), requires_grad=param.requires_grad)
        real_param(self, name, param)

    def register_buffer(self, name, tensor, persistent=True):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            tensor = to_host(tensor)
        real_buffer(self, name, tensor, persistent)
    module.register_parameter, module.register_buffer = register_parameter, register_buffer
    try:
        yield
    finally:
        module.register_parameter, module.register_buffer = real_param, real_buffer


class _Properties:
    """What ``torch.cuda.get_device_properties`` returns, for the fake card."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.name = gpu.name
        self.total_memory = gpu.total_bytes
        self.major, self.minor = gpu.capability
        self.multi_processor_count = 108
        self.is_integrated = False
        self.gcnArchName = ""

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
                f"minor={self.minor}, total_memory={self.total_memory // 2**20}MB)")


# Libraries that pick CUDA kernels by asking torch.cuda.is_available() and then call into them:
# they are told the truth, no GPU, and keep their CPU kernels, which oomdoctor's emulation
# stands in for as it does in a model file's trace (bitsandbytes/__init__.py loads its CUDA
# backend, whose ops call torch._C._cuda_getCurrentRawStream, absent from a CPU build).
_KEEP_CPU_KERNELS = ("bitsandbytes",)


def _is_available() -> bool:
    caller = sys._getframe(1).f_globals.get("__name__", "")
    return caller.split(".")[0] not in _KEEP_CPU_KERNELS


def _cuda_answers(gpu: FakeGpu) -> dict[str, Any]:
    """``torch.cuda`` functions as the fake card answers them."""
    props = _Properties(gpu)
    return {
        "is_available": _is_available,
        "device_count": lambda: gpu.count,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "get_device_name": lambda device=None: gpu.name,
        "get_device_capability": lambda device=None: gpu.capability,
        "get_device_properties": lambda device=None: props,
        "is_bf16_supported": lambda including_emulation=True: gpu.capability >= (8, 0),
        "mem_get_info": lambda device=None: (gpu.total_bytes - gpu.usage()[0], gpu.total_bytes),
        "memory_allocated": lambda device=None: gpu.usage()[0],
        "max_memory_allocated": lambda device=None: gpu.usage()[1],
        "memory_reserved": lambda device=None: gpu.usage()[0],
        "max_memory_reserved": lambda device=None: gpu.usage()[1],
        "reset_peak_memory_stats": lambda device=None: None,
        "reset_max_memory_allocated": lambda device=None: None,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "device": lambda device: contextlib.nullcontext(),
        "is_initialized": lambda: True,
        "is_current_stream_capturing": lambda: False,
        "current_stream": lambda device=None: _Stream(),
        "default_stream": lambda device=None: _Stream(),
    }


class _Stream:
    """The one stream the fake device has: never capturing a CUDA graph, nothing to wait on."""

    def is_capturing(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass

    def wait_stream(self, _other: Any) -> None:
        pass


def _accelerator_answers(gpu: FakeGpu) -> dict[str, Any]:
    """``torch.accelerator`` (torch >= 2.6) as the fake card answers it."""
    return {
        "is_available": lambda: True,
        "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "device_count": lambda: gpu.count,
        "current_device_index": lambda: 0,
        "set_device_index": lambda device: None,
        "synchronize": lambda device=None: None,
        "current_stream": lambda device=None: _Stream(),
    }


class ScriptGradScaler(torch.amp.GradScaler):
    """``GradScaler`` on the fake GPU: scale, unscale and their tensors as CUDA's, but the step
    is always taken and the scale kept (both would read the inf flag, a value the weights
    decide; the step that allocates the optimizer's state is the one that matters)."""

    def __init__(self, device: str = "cuda", *args: Any, **kwargs: Any) -> None:
        if not isinstance(device, str):                  # GradScaler(init_scale) of torch.cuda.amp
            args, device = (device, *args), "cuda"
        super().__init__("cuda", *args, **kwargs)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        if self._enabled:
            from torch.amp.grad_scaler import _refresh_per_optimizer_state
            from collections import defaultdict
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


class _Autocast:
    """One ``torch.autocast(...)`` object: a context manager, or a decorator
    (accelerate wraps ``model.forward`` in ``torch.autocast(...)(forward)``); each use enters a
    fresh emulated autocast."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.open: list[Any] = []

    def __enter__(self):
        self.open.append(self.make())
        return self.open[-1].__enter__()

    def __exit__(self, *exc):
        return self.open.pop().__exit__(*exc)

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def autocast_forward(*args, **kwargs):
            with self.make():
                return fn(*args, **kwargs)
        return autocast_forward


def _autocast(real: Callable, device: Device) -> Callable:
    """``torch.autocast`` where "cuda" (and "meta", the fake GPU's tensors' device) is CUDA's
    autocast as oomdoctor emulates it."""
    def autocast(device_type: str = "cuda", dtype: torch.dtype | None = None,
                 enabled: bool = True, cache_enabled: bool | None = None):
        if device_type not in ("cuda", "meta"):
            return real(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        if not enabled:
            return _Autocast(emulate._Off)
        device.autocast.add(dtype or torch.float16)
        return _Autocast(lambda: emulate.CudaAutocast(dtype or torch.float16))
    return autocast


@contextlib.contextmanager
def patched(target: Any, answers: dict[str, Any]) -> Iterator[None]:
    """Set ``answers`` as attributes of ``target`` (a module) for the block; put back (or
    remove) what was there after."""
    saved = {name: target.__dict__.get(name) for name in answers}
    for name, fn in answers.items():
        setattr(target, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            if fn is None:
                delattr(target, name)
            else:
                setattr(target, name, fn)


def _holds_gpu_tensors(obj: Any, depth: int = 0) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "meta"
    if depth > 4:
        return False
    if isinstance(obj, dict):
        return any(_holds_gpu_tensors(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_gpu_tensors(v, depth + 1) for v in obj)
    return False


def _save(real: Callable, reads: Reads) -> Callable:
    """``torch.save``: a checkpoint of the fake GPU's tensors has no data to write; skipped
    (counted for the notes), while saving real CPU objects goes on."""
    def save(obj, f, *args, **kwargs):
        if _holds_gpu_tensors(obj):
            reads.saves += 1
            return None
        return real(obj, f, *args, **kwargs)
    return save


def _data_parallel_forward(real: Callable) -> Callable:
    """``nn.DataParallel`` over one GPU (the fake card, or ``device_ids=[0]``) runs its module
    on the batch moved to that GPU, as torch's own forward does for one device; its check that
    the weights sit on ``cuda:0`` would see the fake GPU's meta tensors and refuse."""
    def forward(self, *inputs, **kwargs):
        if len(self.device_ids) > 1:
            return real(self, *inputs, **kwargs)
        from torch.utils._pytree import tree_map
        move = lambda t: t.to("cuda") if isinstance(t, torch.Tensor) else t
        return self.module(*tree_map(move, inputs), **tree_map(move, kwargs))
    return forward


@contextlib.contextmanager
def fake_cuda(device: Device) -> Iterator[None]:
    """Everything the script sees of the fake GPU (see the module docstring)."""
    gpu = device.gpu
    amp = {"autocast": _autocast(torch.autocast, device)}
    cuda_autocast = {"autocast": lambda dtype=torch.float16, enabled=True, cache_enabled=True:
                     amp["autocast"]("cuda", dtype, enabled, cache_enabled)}
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(torch.cuda, _cuda_answers(gpu)))
        if hasattr(torch, "accelerator"):
            stack.enter_context(patched(torch.accelerator, _accelerator_answers(gpu)))
        stack.enter_context(patched(torch, dict(amp, save=_save(torch.save, device.reads))))
        stack.enter_context(patched(torch.amp, amp))
        stack.enter_context(patched(torch.cuda.amp, dict(cuda_autocast,
                                                          GradScaler=ScriptGradScaler)))
        stack.enter_context(patched(torch.amp, {"GradScaler": ScriptGradScaler}))
        dp = torch.nn.parallel.DataParallel
        stack.enter_context(patched(dp, {"forward": _data_parallel_forward(dp.forward)}))
        stack.enter_context(modules_on_meta(device))
        stack.enter_context(emulate.autocast_queries())
        stack.enter_context(DeviceMode(device))
        yield
