"""DeepSpeed's engine inside a training script: ``deepspeed.initialize`` recorded for the
planners, as FSDP's wrappers are (:mod:`oomdoctor.sim.sharding`).

    oomdoctor estimate --gpu rtx3090 -- deepspeed --num_gpus 2 train.py --deepspeed_config ds.json

In a script's run ``deepspeed.initialize`` is a stand-in. It records the config (the ZeRO stage,
the fp16/bf16 mode, the buckets) and does what the engine does to the model before the first
step: its 16-bit mode casts every parameter, keeping fp32 buffers (``engine.py``,
``_configure_distributed_model``, 0.19), and the module goes to the GPU. The engine it returns
runs the module's own forward, ``backward(loss)`` and ``step()`` (the optimizer only at the
accumulation boundary, ``gradient_accumulation_steps``), so the run is one GPU's step of the
model as DeepSpeed computes it: :mod:`oomdoctor.plans.parallel.deepspeed` replays it as the ZeRO
stage it recorded (fp32 master weights, flat buffers, buckets), the replay checked against real
DeepSpeed runs (tests/test_deepspeed_gpu.py).

The HF Trainer's ``--deepspeed`` reaches the same stand-in through accelerate (which needs
DeepSpeed installed: it checks the release and imports ``deepspeed.comm``); ``zero.Init``, in
which transformers builds models under ZeRO-3, builds them whole, as the replay shards them.
CPU offload runs as any config: the module computes on the GPU and its optimizer steps in the
run, and the replay puts what the config offloads on the host. Not followed: pipeline
parallelism (``PipelineModule``).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from typing import Any, Iterator

import torch

from oomdoctor.sim import zero3
from oomdoctor.sim.fakecuda import patched
from oomdoctor.sim.sharding import UnsupportedParallel

# What a script's run does not follow, and where DeepSpeed is planned instead.
NOT_FOLLOWED = ("plan its model with `oomdoctor parallel MODEL --ds-config ds.json` "
                "(DeepSpeed's ZeRO stages as DeepSpeed runs them)")
DEEPSPEED = f"this use of DeepSpeed inside a script is not simulated: {NOT_FOLLOWED}"


def _config(config: Any, args: Any) -> dict:
    """The config as ``deepspeed.initialize`` takes it: a dict, a JSON file's path, or
    ``args.deepspeed_config``."""
    config = config if config is not None else getattr(args, "deepspeed_config", None)
    if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        with open(config, encoding="utf-8") as f:
            return json.load(f)
    if not isinstance(config, dict):
        raise UnsupportedParallel(f"deepspeed.initialize without a config dict or file "
                                  f"({type(config).__name__}): {NOT_FOLLOWED}")
    return config


class ScriptEngine(torch.nn.Module):
    """The engine ``deepspeed.initialize`` returns, on the fake GPU: the module's forward,
    ``backward`` and ``step`` as the script calls them."""

    def __init__(self, module: torch.nn.Module, optimizer: Any, config: dict,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self._config, self._dtype = config, dtype
        self._accumulation = config["gradient_accumulation_steps"]
        self._micro = config["train_micro_batch_size_per_gpu"]
        self._micro_steps = 0       # engine.step() calls so far, as DeepSpeed counts them
        self._boundary: bool | None = None      # set_gradient_accumulation_boundary's
        self.global_steps = 0

    def __getattr__(self, name: str) -> Any:
        """As DeepSpeed's engine: what it does not have, its module's (engine.py __getattr__)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def fp16_enabled(self) -> bool:
        return self._dtype is torch.float16

    def bfloat16_enabled(self) -> bool:
        return self._dtype is torch.bfloat16

    def zero_optimization_stage(self) -> int:
        return int((self._config.get("zero_optimization") or {}).get("stage", 0))

    def train_batch_size(self) -> int:
        return self._micro * self._accumulation * _world_size()

    def load_checkpoint(self, *_args: Any, **_kwargs: Any) -> tuple:
        return None, {}                 # nothing to load on the fake GPU

    def backward(self, loss: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
        loss.backward()
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """engine.py: the step about to be taken ends an accumulation round (or what the caller
        set: accelerate sets it from its own accumulation, as the HF Trainer runs it)."""
        if self._boundary is not None:
            return self._boundary
        return (self._micro_steps + 1) % self._accumulation == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary = bool(is_boundary)

    def get_global_grad_norm(self) -> None:
        return None                   # a value the weights decide: none on the fake GPU

    def was_step_applied(self) -> bool:
        return True

    def step(self, *_args: Any, **_kwargs: Any) -> None:
        """Every micro-batch calls it; the optimizer runs at the accumulation boundary, then
        the gradients are dropped (DeepSpeed frees them after the step)."""
        if self.optimizer is not None and self.is_gradient_accumulation_boundary():
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_steps += 1
        self._micro_steps += 1

    def zero_grad(self, *_args: Any, **_kwargs: Any) -> None:
        self.module.zero_grad(set_to_none=True)

    def gradient_accumulation_steps(self) -> int:
        return self._accumulation

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    @property
    def local_rank(self) -> int:
        return 0

    def save_checkpoint(self, *_args: Any, **_kwargs: Any) -> bool:
        return True                     # a checkpoint of the fake GPU has no data to write


class Recorder:
    """The stand-in of one run and what it recorded (``config``; None: no DeepSpeed)."""

    def __init__(self, traced: Any = None) -> None:
        self.config: dict | None = None
        self.stack: contextlib.ExitStack | None = None    # what the run's end undoes
        self.traced = traced             # the script's recorder (zero3 marks saved views)

    def initialize(self, args: Any = None, model: torch.nn.Module | None = None,
                   optimizer: Any = None, model_parameters: Any = None,
                   training_data: Any = None, lr_scheduler: Any = None, config: Any = None,
                   config_params: Any = None, collate_fn: Any = None, **_kwargs: Any) -> tuple:
        """``deepspeed.initialize``: (engine, optimizer, training dataloader, lr scheduler)."""
        if model is None:
            raise UnsupportedParallel(f"deepspeed.initialize without a model: {NOT_FOLLOWED}")
        cfg = _config(config if config is not None else config_params, args)
        if self.config is not None:
            raise UnsupportedParallel(f"deepspeed.initialize called twice: {NOT_FOLLOWED}")
        cfg = self.config = dict(cfg, **_batch_settings(cfg, _world_size()))
        dtype = _precision(cfg)
        if dtype is not None:
            # 0.19's engine casts the parameters only, keeping fp32 buffers (engine.py,
            # _configure_distributed_model: "Cast params only; preserve fp32 buffers")
            for p in model.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
        model.to(torch.device("cuda", torch.cuda.current_device()))
        if int((cfg.get("zero_optimization") or {}).get("stage", 0)) == 3:
            zero3.input_hooks(model)        # stage 3's hooks and F.linear (oomdoctor.sim.zero3)
            if self.stack is not None:
                self.stack.enter_context(zero3.linear_patched(self.traced))
        params = list(model_parameters) if model_parameters is not None else \
            list(model.parameters())
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(params)              # DeepSpeedOptimizerCallable
        elif optimizer is None and cfg.get("optimizer"):
            optimizer = _basic_optimizer(cfg["optimizer"], params)
        if lr_scheduler is None and cfg.get("scheduler") and optimizer is not None:
            # the config's schedule changes the rate, not memory: a constant one to call .step()
            lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
        loader = None if training_data is None else torch.utils.data.DataLoader(
            training_data, batch_size=cfg["train_micro_batch_size_per_gpu"],
            collate_fn=collate_fn)
        return ScriptEngine(model, optimizer, cfg, dtype), optimizer, loader, lr_scheduler


def _world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_initialized() else int(
        os.environ.get("WORLD_SIZE", "1"))


def _precision(cfg: dict) -> torch.dtype | None:
    """The 16-bit mode the config enables ("bfloat16" is the old key of "bf16")."""
    def on(key: str) -> bool:
        return (cfg.get(key) or {}).get("enabled") in (True, "auto")
    return torch.bfloat16 if on("bf16") or on("bfloat16") else torch.float16 if on("fp16") \
        else None


def _batch_settings(cfg: dict, world: int) -> dict:
    """The micro-batch and accumulation DeepSpeed derives from whichever of train_batch_size,
    train_micro_batch_size_per_gpu and gradient_accumulation_steps the config gives
    (runtime/config.py, _set_batch_related_parameters; "auto" counts as missing)."""
    def given(key: str) -> int | None:
        v = cfg.get(key)
        return None if v in (None, "auto") else int(v)
    batch, micro, gas = (given("train_batch_size"), given("train_micro_batch_size_per_gpu"),
                         given("gradient_accumulation_steps"))
    if micro is None:
        micro = max(batch // world // (gas or 1), 1) if batch else 1
    if gas is None:
        gas = max(batch // micro // world, 1) if batch else 1
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}


# DeepSpeed's optimizers by the state they hold per parameter (engine.py,
# _configure_basic_optimizer): FusedAdam/Lamb and the 1-bit Adams two moments, traced as torch's
# fused AdamW (no temporaries, as FusedAdam); Adagrad one sum; Lion one momentum, traced as
# SGD with momentum; any other name is torch.optim's own.
_TWO_STATES = ("adam", "adamw", "lamb", "onebitadam", "zerooneadam", "onebitlamb")


def _basic_optimizer(section: dict, parameters: list) -> torch.optim.Optimizer:
    """The config's optimizer as DeepSpeed builds it (with ``torch_adam``, torch's own Adam
    with the config's ``fused``/``foreach``). ``parameters``: tensors or parameter groups."""
    params = dict(section.get("params") or {})
    kind = str(section.get("type", "adamw")).lower()
    torch_adam = params.pop("torch_adam", False)
    groups = [p for p in parameters if isinstance(p, dict) or p.requires_grad]
    lr = float(params.get("lr", 1e-3))
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr)
    if kind == "lion":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    if kind not in _TWO_STATES:
        maker = getattr(torch.optim, str(section.get("type")), None)
        if maker is not None:
            return maker(groups, lr=lr)
    kwargs = {"lr": lr,
              "weight_decay": float(params.get("weight_decay", 0.01 if kind == "adamw" else 0))}
    if torch_adam and kind in ("adam", "adamw"):
        kwargs.update({k: params[k] for k in ("fused", "foreach") if k in params})
    else:
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, **kwargs)


def _init_distributed(*_args: Any, **_kwargs: Any) -> None:
    """``deepspeed.init_distributed``: the process group (oomdoctor.sim.ddp's stand-in)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl")


def _uses_deepspeed(source: str, words: tuple[str, ...]) -> bool:
    """Whether a script may reach DeepSpeed: it names it, or its command line does (the
    deepspeed launcher, a --deepspeed option). DeepSpeed is imported only then: its import
    takes seconds, and a script's run is repeated by the planners."""
    return "deepspeed" in source or any("deepspeed" in w for w in words)


@contextlib.contextmanager
def stand_ins(source: str, words: tuple[str, ...], traced: Any = None) -> Iterator[Recorder]:
    """``deepspeed.initialize`` and ``init_distributed`` replaced by :class:`Recorder`'s for the
    block, where DeepSpeed is installed and the script may use it (``traced``: the script's
    recorder)."""
    rec = Recorder(traced)
    with contextlib.ExitStack() as stack:
        rec.stack = stack
        if _uses_deepspeed(source, words) and importlib.util.find_spec("deepspeed") is not None:
            import deepspeed
            stack.enter_context(patched(deepspeed, {"initialize": rec.initialize,
                                                    "init_distributed": _init_distributed}))
            if hasattr(deepspeed, "zero"):
                # ZeRO-3's construction-time partitioning (transformers builds models inside
                # it under ZeRO-3): the stage-3 replay shards the parameters; the module is
                # built whole on the host, as without it
                stack.enter_context(patched(deepspeed.zero, {
                    "Init": _Unpartitioned, "GatheredParameters": _Unpartitioned}))
            stack.callback(_forget_process_state)
        yield rec


class _Unpartitioned(contextlib.nullcontext):
    """``deepspeed.zero.Init(...)`` / ``GatheredParameters(...)`` as a context that does
    nothing (any arguments)."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        super().__init__()


def _forget_process_state() -> None:
    """What the HF Trainer's DeepSpeed integration leaves set for the whole process, dropped
    after the run: transformers' DeepSpeed config (while set, every model transformers builds
    next - a planner's trace - goes through ``deepspeed.zero.Init``) and accelerate's shared
    state with its DeepSpeed plugin."""
    hf = sys.modules.get("transformers.integrations.deepspeed")
    if hf is not None and hasattr(hf, "unset_hf_deepspeed_config"):
        hf.unset_hf_deepspeed_config()
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
