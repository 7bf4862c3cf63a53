"""FSDP inside a training script: what its rank 0 shards, and how, recorded for the planners.

    oomdoctor estimate --gpu rtx3090 -- torchrun --nproc_per_node 2 train_fsdp.py

In a script's run (:mod:`oomdoctor.sim.script`) ``fully_shard`` (FSDP2) and
``FullyShardedDataParallel`` (FSDP1) are stand-ins. They record which modules the script wraps,
its mixed-precision policy and ``reshard_after_forward``, and leave the module whole on the fake
GPU, its parameters in the dtype FSDP computes them in (``param_dtype``), with floating forward
inputs cast to it as FSDP does. The run is then one GPU's step of the model as FSDP computes
it; :mod:`oomdoctor.plans.parallel` replays that step as the recorded FSDP on each of the
launcher's GPUs - the replay that is checked against real ``fully_shard`` and FSDP1 runs.

What FSDP does here, from its sources (torch 2.13):

- ``fully_shard`` moves the module to the mesh's device (``_fully_shard.py``: ``_move_states_to_
  device``) and its sharded parameters keep their own dtype; the all-gathered ones are
  ``param_dtype`` (``_fsdp_param.py``), so the step computes in ``param_dtype``.
- ``cast_forward_inputs`` (default True) casts each wrapped module's floating inputs to
  ``param_dtype`` (``_fsdp_state.py``, ``_pre_forward``); ``output_dtype`` casts its outputs.
- FSDP1 flattens and shards on the module's device and then moves it to the compute device
  (``_init_utils.py``); ``MixedPrecision(param_dtype=...)`` computes in that dtype and casts the
  root's forward inputs (``cast_root_forward_inputs``).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_map

from oomdoctor.sim.fakecuda import patched


class UnsupportedParallel(Exception):
    """A parallel wrapper the script's run does not simulate."""


@dataclass
class Sharding:
    """How the script shards its model: FSDP ``version`` 2 (``fully_shard``) or 1, the modules
    it wrapped in order (the root last), the policy's dtypes and the shard group's shape."""

    version: int = 2
    units: list[torch.nn.Module] = field(default_factory=list)
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True
    mesh_shape: tuple[int, ...] = ()        # () is every rank in one shard group
    cpu_offload: bool = False               # offload_policy=CPUOffloadPolicy()


class _Mesh:
    """``init_device_mesh``'s mesh as the script sees it: its shape, names and sub-meshes."""

    def __init__(self, device_type: str, shape: tuple[int, ...],
                 names: tuple[str, ...] | None = None) -> None:
        self.device_type, self.shape = device_type, tuple(shape)
        self.mesh_dim_names = names
        self.ndim = len(self.shape)

    def size(self, mesh_dim: int | None = None) -> int:
        if mesh_dim is None:
            return math.prod(self.shape)
        return self.shape[mesh_dim]

    def __getitem__(self, names: str | tuple[str, ...]) -> "_Mesh":
        names = (names,) if isinstance(names, str) else tuple(names)
        dims = [list(self.mesh_dim_names or ()).index(n) for n in names]
        return _Mesh(self.device_type, tuple(self.shape[d] for d in dims), names)

    def get_group(self, *_args: Any) -> None:
        return None

    def get_local_rank(self, *_args: Any) -> int:
        return 0


def _init_device_mesh(device_type: str, mesh_shape: tuple[int, ...], *,
                      mesh_dim_names: tuple[str, ...] | None = None, **_kwargs: Any) -> _Mesh:
    return _Mesh(device_type, tuple(mesh_shape), mesh_dim_names)


def _cast_floats(dtype: torch.dtype, tree: Any) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                    and t.is_floating_point() and t.dtype != dtype else t, tree)


class _ShardedModule:
    """What ``fully_shard`` makes a module (FSDP2's ``FSDPModule``): its switches (``set_*``,
    ``unshard``, ``reshard``) change no memory in the recorded run."""

    def unshard(self, async_op: bool = False) -> None:
        return None

    def reshard(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("set_"):
            return lambda *_args, **_kwargs: None
        return super().__getattr__(name)


_SHARDED_CLASSES: dict[type, type] = {}


def _as_sharded(module: torch.nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, _ShardedModule):
        return
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"FSDP{cls.__name__}", (_ShardedModule, cls), {})
    module.__class__ = _SHARDED_CLASSES[cls]


class Recorder:
    """The stand-ins of one run, and what they recorded (``sharding``; None: no FSDP)."""

    def __init__(self) -> None:
        self.sharding: Sharding | None = None
        self._placed: set[int] = set()        # parameters already put on the GPU, by id

    def _record(self, version: int, module: torch.nn.Module, dtype: torch.dtype | None,
                reduce: torch.dtype | None, reshard: bool, mesh: Any) -> Sharding:
        s = self.sharding
        if s is None:
            s = self.sharding = Sharding(version, param_dtype=dtype, reduce_dtype=reduce,
                                         reshard_after_forward=reshard)
        elif s.version != version:
            raise UnsupportedParallel("FSDP1 and fully_shard mixed in one model")
        if dtype != s.param_dtype:
            raise UnsupportedParallel(
                f"mixed-precision policies differ between wrapped modules ({s.param_dtype} and "
                f"{dtype}); give every fully_shard call the same mp_policy")
        if mesh is not None:
            s.mesh_shape = tuple(mesh.shape) if hasattr(mesh, "shape") else (int(mesh.size()),)
        s.units.append(module)
        return s

    def _place(self, module: torch.nn.Module, dtype: torch.dtype | None) -> None:
        """The unit's own parameters (those no inner unit took) in ``dtype``, then the module
        on the GPU: cast first, so the GPU never holds a copy in the old dtype."""
        for p in module.parameters():
            if id(p) in self._placed:
                continue
            self._placed.add(id(p))
            if dtype is not None and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        module.to(torch.device("cuda", torch.cuda.current_device()))

    def fully_shard(self, module: Any, *, mesh: Any = None, reshard_after_forward: Any = None,
                    mp_policy: Any = None, offload_policy: Any = None, **_kwargs: Any) -> Any:
        """FSDP2's ``fully_shard``: record, place, cast inputs (and outputs) as it does. Under
        ``CPUOffloadPolicy`` the module still computes on the GPU: the replay keeps its states
        on the host."""
        dtype = getattr(mp_policy, "param_dtype", None)
        reduce = getattr(mp_policy, "reduce_dtype", None)
        offload = type(offload_policy).__name__ == "CPUOffloadPolicy"
        for m in (module if isinstance(module, (list, tuple)) else [module]):
            s = self._record(2, m, dtype, reduce, reshard_after_forward is not False, mesh)
            if len(s.units) > 1 and s.cpu_offload != offload:
                raise UnsupportedParallel("CPUOffloadPolicy on some fully_shard calls and not "
                                          "others; give every call the same offload_policy")
            s.cpu_offload = offload
            self._place(m, dtype)
            if dtype is not None and getattr(mp_policy, "cast_forward_inputs", True):
                m.register_forward_pre_hook(
                    lambda _m, args, kwargs, d=dtype: (_cast_floats(d, args),
                                                       _cast_floats(d, kwargs)),
                    with_kwargs=True)
            out = getattr(mp_policy, "output_dtype", None)
            if out is not None:
                m.register_forward_hook(lambda _m, _a, o, d=out: _cast_floats(d, o))
            _as_sharded(m)
        return module

    def fsdp1(self) -> type:
        """FSDP1's ``FullyShardedDataParallel``, bound to this recorder."""
        return type("FullyShardedDataParallel", (ScriptFSDP1,), {"_recorder": self})


class ScriptFSDP1(torch.nn.Module):
    """``FullyShardedDataParallel`` (FSDP1) on rank 0 of the script's run: the wrapped module
    whole on the fake GPU in ``mixed_precision.param_dtype``, FULL_SHARD recorded."""

    _recorder: Recorder

    def __init__(self, module: torch.nn.Module, process_group: Any = None,
                 sharding_strategy: Any = None, cpu_offload: Any = None,
                 auto_wrap_policy: Any = None, backward_prefetch: Any = None,
                 mixed_precision: Any = None, *_args: Any, **_kwargs: Any) -> None:
        super().__init__()
        strategy = getattr(sharding_strategy, "name", "FULL_SHARD")
        if strategy != "FULL_SHARD":
            raise UnsupportedParallel(
                f"FullyShardedDataParallel(sharding_strategy={strategy}) inside a script is not "
                "simulated (FULL_SHARD is); plan it with `oomdoctor parallel MODEL`")
        if getattr(cpu_offload, "offload_params", False):
            raise UnsupportedParallel("FullyShardedDataParallel(cpu_offload=CPUOffload(True)): "
                                      "CPU offload inside a script is not simulated")
        dtype = getattr(mixed_precision, "param_dtype", None)
        self.module = module
        self._recorder._record(1, self, dtype, getattr(mixed_precision, "reduce_dtype", None),
                               True, None)
        self._recorder._place(module, dtype)
        self._dtype = dtype if getattr(mixed_precision, "cast_root_forward_inputs",
                                       True) else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._dtype is not None:
            args, kwargs = _cast_floats(self._dtype, args), _cast_floats(self._dtype, kwargs)
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)      # as FSDP1 does: the wrapped module's

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type)

    @staticmethod
    def state_dict_type(*_args: Any, **_kwargs: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def summon_full_params(*_args: Any, **_kwargs: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@contextlib.contextmanager
def stand_ins() -> Iterator[Recorder]:
    """FSDP2's ``fully_shard`` and ``init_device_mesh`` and FSDP1's class replaced by
    :class:`Recorder`'s for the block, wherever a script or library imports them from."""
    rec = Recorder()
    fsdp1 = rec.fsdp1()
    with contextlib.ExitStack() as stack:
        import torch.distributed as dist
        import torch.distributed.device_mesh as device_mesh
        import torch.distributed.fsdp as fsdp
        import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp1_module
        stack.enter_context(patched(fsdp, {"fully_shard": rec.fully_shard,
                                           "FullyShardedDataParallel": fsdp1,
                                           "FSDPModule": _ShardedModule}))
        stack.enter_context(patched(fsdp1_module, {"FullyShardedDataParallel": fsdp1}))
        stack.enter_context(patched(device_mesh, {"init_device_mesh": _init_device_mesh}))
        stack.enter_context(patched(dist, {"init_device_mesh": _init_device_mesh}))
        yield rec
