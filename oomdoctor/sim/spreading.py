"""One process over several GPUs inside a training script: ``torch.nn.DataParallel`` and
accelerate's ``dispatch_model`` (the naive split), recorded for the planners.

    CUDA_VISIBLE_DEVICES=0,1 oomdoctor estimate --gpu rtx3090 -- python train.py

As FSDP's wrappers are (:mod:`oomdoctor.sim.sharding`), both are stand-ins in a script's run: the
model runs whole on the one fake GPU, and :mod:`oomdoctor.plans.parallel` replays the run as
what the stand-in recorded - DataParallel over its ``device_ids``, or the two stages of the
device map - with the same replay that is checked for a model file (tests/test_parallel.py).

What the real ones do, from their sources:

- ``DataParallel`` (torch/nn/parallel/data_parallel.py) defaults ``device_ids`` to every
  visible GPU and, with one, calls the module as it is. With several it scatters each input
  over them in dim-0 chunks (GPU 0 takes the first, largest), replicates the module, runs the
  replicas and gathers their outputs on ``output_device`` (``device_ids[0]``).
- ``dispatch_model`` (accelerate/big_modeling.py) puts each module of the map on its device and
  hooks it to move its inputs there; ``main_device`` defaults to the lowest GPU index. A map
  that sends modules to "cpu" or "disk" offloads them, which a script's run does not follow.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from oomdoctor.sim.fakecuda import patched
from oomdoctor.sim.sharding import UnsupportedParallel


@dataclass
class Spread:
    """How one process spreads its model: ``kind`` "dp" (DataParallel over ``devices``) or
    "pipeline2" (dispatch_model: ``device_map`` module name -> stage 0 or 1, in the order of
    the map's GPUs; ``main_stage`` takes the inputs and outputs)."""

    kind: str
    devices: tuple[int, ...] = ()
    device_map: dict[str, int] = field(default_factory=dict)
    main_stage: int = 0


def _index(device: Any) -> int | str:
    """A device-map or device_ids entry as a GPU index, or the offload target's name."""
    if isinstance(device, torch.device):
        return device.index or 0 if device.type == "cuda" else device.type
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    text = str(device)
    if text.startswith("cuda"):
        return int(text.partition(":")[2] or 0)
    return text


class Recorder:
    """The stand-ins of one run and what they recorded (``spread``; None: one GPU)."""

    def __init__(self) -> None:
        self.spread: Spread | None = None

    def _record(self, spread: Spread) -> None:
        if self.spread is not None and self.spread != spread:
            raise UnsupportedParallel(f"two ways of spreading one process over GPUs "
                                      f"({self.spread.kind} and {spread.kind})")
        self.spread = spread

    def data_parallel(self) -> type:
        recorder = self

        class ScriptDataParallel(torch.nn.Module):
            """``DataParallel`` in a script's run: the module itself on the fake GPU, over
            the whole batch; the replicas, scatter and gather are the replay's."""

            def __init__(self, module: torch.nn.Module, device_ids: Any = None,
                         output_device: Any = None, dim: int = 0) -> None:
                super().__init__()
                self.module = module
                count = torch.cuda.device_count()
                ids = tuple(range(count)) if device_ids is None else tuple(
                    _index(d) for d in device_ids)
                if not ids or not all(isinstance(i, int) for i in ids):
                    raise UnsupportedParallel(f"DataParallel(device_ids={device_ids!r}): "
                                              "oomdoctor replays it over GPU indices only")
                self.device_ids, self.dim = list(ids), dim
                self.output_device = ids[0] if output_device is None else _index(output_device)
                if dim != 0:
                    raise UnsupportedParallel(f"DataParallel(dim={dim}): oomdoctor replays "
                                              "the batch scattered over dim 0")
                if len(ids) > 1:
                    recorder._record(Spread("dp", ids))

            def forward(self, *inputs: Any, **kwargs: Any) -> Any:
                return self.module(*inputs, **kwargs)
        return ScriptDataParallel

    def dispatch_model(self, model: torch.nn.Module, device_map: dict[str, Any],
                       main_device: Any = None, **_kwargs: Any) -> torch.nn.Module:
        """accelerate's ``dispatch_model``: the map recorded as two stages, the model on the
        fake GPU whole."""
        where = {name: _index(d) for name, d in device_map.items()}
        offloaded = sorted({d for d in where.values() if isinstance(d, str)})
        if offloaded:
            raise UnsupportedParallel(f"dispatch_model with modules on {' and '.join(offloaded)}"
                                      " (offload) is not simulated inside a script")
        gpus = sorted(set(where.values()))
        if len(gpus) > 2:
            raise UnsupportedParallel(f"a device map over {len(gpus)} GPUs: oomdoctor replays "
                                      "the two-GPU split only")
        if len(gpus) == 2:
            # accelerate's default: list(set(device_map.values()))[0], the lowest index
            main = gpus[0] if main_device is None else _index(main_device)
            self._record(Spread("pipeline2", tuple(gpus),
                                {n: gpus.index(d) for n, d in where.items()},
                                gpus.index(main) if main in gpus else 0))
        model.to(torch.device("cuda", gpus[0] if gpus else 0))
        model.hf_device_map = dict(device_map)      # as accelerate sets it
        return model


@contextlib.contextmanager
def stand_ins() -> Iterator[Recorder]:
    """``DataParallel`` and accelerate's ``dispatch_model`` replaced by :class:`Recorder`'s
    for the block, wherever a script imports them from."""
    rec = Recorder()
    dp = rec.data_parallel()
    with contextlib.ExitStack() as stack:
        import torch.nn.parallel as parallel
        import torch.nn.parallel.data_parallel as data_parallel
        stack.enter_context(patched(torch.nn, {"DataParallel": dp}))
        stack.enter_context(patched(parallel, {"DataParallel": dp}))
        stack.enter_context(patched(data_parallel, {"DataParallel": dp}))
        try:
            import accelerate
            import accelerate.big_modeling as big_modeling
        except ImportError:            # accelerate is a dependency, but a script may not use it
            pass
        else:
            stack.enter_context(patched(accelerate, {"dispatch_model": rec.dispatch_model}))
            stack.enter_context(patched(big_modeling, {"dispatch_model": rec.dispatch_model}))
        yield rec
