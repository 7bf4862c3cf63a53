"""PyTorch DDP's own memory, and a ``torch.distributed`` that a script's rank 0 runs against.

    oomdoctor estimate --gpu rtx3090 -- torchrun --nproc_per_node 2 train.py

The constants and bucket sizes are DDP's (torch/nn/parallel/distributed.py and reducer.cpp,
torch 2.x); the multi-GPU planners (oomdoctor.plans.parallel.data_parallel) place them on each
GPU's event list. A training script launched with ``torchrun`` is run as its rank 0
(oomdoctor.sim.script): :func:`rank_zero` gives it a process group of the launcher's size whose
collectives move nothing, and :class:`ScriptDDP` stands in for ``DistributedDataParallel``,
allocating DDP's buffers on the fake GPU when DDP would; FSDP's wrappers are recorded
(:mod:`oomdoctor.sim.sharding`) for the planners to replay.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable, Iterator

import torch

from oomdoctor.sim import sharding
from oomdoctor.sim.fakecuda import patched

MiB = 2**20
# DDP constants (torch/nn/parallel/distributed.py, torch 2.x): buckets of 25 MiB
# (_DEFAULT_BUCKET_CAP_MB), the first one 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) once buckets are
# rebuilt in gradient-ready order after the first iteration; before that a single bucket holds
# every gradient (compute_bucket_size_limits: [sys.maxsize] unless find_unused_parameters).
# Reducer::initialize_buckets clears the old buckets before allocating the new ones.
DDP_FIRST_BUCKET_BYTES = 1 * MiB
DDP_BUCKET_BYTES = 25 * MiB
# DistributedDataParallel.__init__: self.broadcast_bucket_size = 250 * 1024 * 1024, used by
# _sync_module_states at start-up and by the buffer broadcast before every forward.
DDP_BROADCAST_BUCKET_BYTES = 250 * MiB


def chunks(sizes: Iterable[int], cap: int) -> list[int]:
    """Greedy coalescing chunks (comm.cpp take_tensors): a chunk closes once it reaches cap."""
    out, cur = [], 0
    for n in sizes:
        if cur and cur + n > cap:
            out.append(cur)
            cur = 0
        cur += n
    if cur:
        out.append(cur)
    return out


def ddp_buckets(grad_sizes: list[int], first: int = DDP_FIRST_BUCKET_BYTES,
                cap: int = DDP_BUCKET_BYTES) -> list[int]:
    """Rebuilt DDP buckets (reducer.cpp compute_bucket_assignment_by_size): gradients in the order
    they become ready, a bucket closes when it reaches its limit - 1 MiB for the first, then
    25 MiB."""
    out, cur = [], 0
    for n in grad_sizes:
        cur += n
        if cur >= (first if not out else cap):
            out.append(cur)
            cur = 0
    if cur:
        out.append(cur)
    return out


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="meta")


class ScriptDDP(torch.nn.Module):
    """``DistributedDataParallel`` on rank 0 of the script's run: the module's own step, plus
    what DDP allocates on each GPU - the start-up broadcast of parameters and buffers in
    250 MiB chunks, one bucket holding every gradient until the buckets are rebuilt in
    gradient-ready order before the second forward (1 MiB, then ``bucket_cap_mb``). With
    ``gradient_as_bucket_view=True`` the gradients are views into the buckets (set before each
    forward, so backward accumulates into them) instead of a second copy."""

    def __init__(self, module: torch.nn.Module, *args: Any, bucket_cap_mb: float | None = None,
                 gradient_as_bucket_view: bool = False, **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        states = [_bytes(t) for t in (*module.parameters(), *module.buffers())]
        for n in chunks(states, DDP_BROADCAST_BUCKET_BYTES):
            _buffer(n)                        # freed at once: a transient of the broadcast
        # gradients become ready roughly in reverse registration order (backward)
        self._ready = [p for p in module.parameters() if p.requires_grad][::-1]
        self._cap = int(bucket_cap_mb * MiB) if bucket_cap_mb else DDP_BUCKET_BYTES
        self._view = gradient_as_bucket_view
        self._forwards = 0
        sizes = [_bytes(p) for p in self._ready]
        self._buckets = [_buffer(sum(sizes))] if sizes else []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._forwards += 1
        if self._forwards == 2 and self._buckets:
            self._buckets = []                # initialize_buckets clears the old ones first
            sizes = [_bytes(p) for p in self._ready]
            self._buckets = [_buffer(n) for n in ddp_buckets(sizes, cap=self._cap)]
        if self._view:
            self._gradients_in_buckets()
        return self.module(*args, **kwargs)

    def _gradients_in_buckets(self) -> None:
        """Each missing ``.grad`` as its slice of the buckets (in ready order)."""
        bucket, offset = 0, 0
        for p in self._ready:
            n = _bytes(p)
            if offset + n > self._buckets[bucket].numel():
                bucket, offset = bucket + 1, 0
            if p.grad is None:
                flat = self._buckets[bucket][offset:offset + n]
                p.grad = flat.view(p.dtype).view(p.shape)
            offset += n

    def no_sync(self):
        return contextlib.nullcontext()


class _Work:
    """What an ``async_op=True`` collective returns."""

    def wait(self, *_args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _collective(*_args: Any, async_op: bool = False, **_kwargs: Any) -> _Work | None:
    """A collective among ranks that all hold the same values: nothing moves."""
    return _Work() if async_op else None


def _distributed_answers(world: int, state: dict) -> dict[str, Any]:
    return {
        "is_available": lambda: True,
        "is_initialized": lambda: state["initialized"],
        "init_process_group": lambda *a, **k: state.update(initialized=True),
        "destroy_process_group": lambda *a, **k: state.update(initialized=False),
        "get_rank": lambda group=None: 0,
        "get_world_size": lambda group=None: world,
        "get_backend": lambda group=None: "nccl",
        "new_group": lambda *a, **k: None,
        "barrier": _collective, "all_reduce": _collective, "broadcast": _collective,
        "reduce": _collective, "all_gather": _collective, "all_gather_object": _collective,
        "broadcast_object_list": _collective, "all_gather_into_tensor": _collective,
        "reduce_scatter_tensor": _collective, "monitored_barrier": _collective,
    }


@contextlib.contextmanager
def rank_zero(world: int, env: dict[str, str]) -> Iterator[sharding.Recorder]:
    """The script runs as rank 0 of ``world`` processes: ``env`` (the variables its launcher
    sets; none under plain python), a process group whose collectives move nothing, DDP as
    :class:`ScriptDDP`, FSDP's wrappers recorded (yielded: what the script sharded)."""
    import torch.distributed as dist
    import torch.nn.parallel as parallel
    import torch.nn.parallel.distributed as distributed
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    state = {"initialized": False}
    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(dist, _distributed_answers(world, state)))
        stack.enter_context(patched(parallel, {"DistributedDataParallel": ScriptDDP}))
        stack.enter_context(patched(distributed, {"DistributedDataParallel": ScriptDDP}))
        recorded = stack.enter_context(sharding.stand_ins())
        try:
            yield recorded
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
