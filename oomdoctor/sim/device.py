"""The device a model is built and run on outside a full trace: the meta device, as the trace
runs it under the CUDA emulation, with the same patches and with real values for the batch.

The planners (the multi-GPU layout, the recommend lower bound, the smoke test's prediction)
build the model apart from the trace. Built any other way - FakeTensorMode on the CPU - the
same model fails where the trace succeeds: ``Module.to``/``_apply`` swaps a FakeTensor's
parameters and torch refuses to swap one that has weak references (a user's
``.to(memory_format=torch.channels_last)``, peft moving its adapters), and bitsandbytes' 4-bit
weights cannot wrap a FakeTensor at all. On the meta device both work, as in the trace.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from oomdoctor.sim import cudaoptim, eager, emulate, values


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build (and run) under what the CUDA-emulating trace builds under: the meta device, the
    model's torch.compile as eager, initialisation without data, fused optimizers allowed."""
    with torch.device("meta"), eager.fake_trace([], contextlib.nullcontext), \
            cudaoptim.fused_optimizers_on_meta(), emulate.autocast_on_meta():
        yield


def mirrored_batch(make: Callable[[], Any], shadows: values.Shadows) -> Any:
    """``make()`` on the current (meta) device, with its real CPU values attached to
    ``shadows``, so a library's question about the batch (is there padding?) gets the real
    batch's answer - what the trace does (oomdoctor.sim.values)."""
    batch = make()
    shadows.attach(batch, values.real_batch(make))
    return batch


def dispatch_with_values(shadows: values.Shadows, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run one ATen op inside a dispatch mode; a scalar question the meta tensor cannot answer
    gets the batch's real answer (or raises as before), and the op's real values follow."""
    try:
        out = func(*args, **kwargs)
    except Exception:
        answered, value = shadows.answer(func, args, kwargs)
        if not answered:
            raise
        return value
    shadows.mirror(func, args, kwargs, out)
    return out
