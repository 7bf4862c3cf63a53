"""Run a few real training steps of a configuration; compare the measured peaks with the prediction.

    oomdoctor smoke sample_models/tiny_mlp.py --strategy ddp --num-gpus 2 -b 16 --steps 3

With CUDA the configuration runs on the GPU(s) as the user would run it - DDP/ZeRO as one process
per GPU over NCCL, DataParallel in one process, the split with accelerate's ``dispatch_model`` on
cuda:0/cuda:1 - and ``torch.cuda.max_memory_allocated/reserved`` of every GPU is set next to the
prediction: an OOM, or a peak more than :data:`TOLERANCE` off, fails the smoke.

Without CUDA the same code path runs on the CPU at a micro-batch the CPU can handle: bf16
autocast, checkpointing, accumulation, DDP/ZeRO as real processes over gloo, FSDP2 on a CPU mesh,
the split through accelerate's hooks with both stages on the CPU. That proves the configuration
runs and the loss is finite and moves on a repeated batch; memory is not compared (the CPU is not
the card), and the result says so.

Every rank sees its own fixed batches (seeded by rank and micro-batch), the same at every step, so
a working configuration shows the loss falling.
"""
from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from oomdoctor.configs import param_width
from oomdoctor.models.loader import for_process, in_process
from oomdoctor.models.spec import ModelSpec
from oomdoctor.models.training import build_checked_model, compute_loss
from oomdoctor.runs.ranks import collect_ranks
# TOLERANCE, MemoryCheck and render_text are this module's too (smoke.X: the CLI, the tests).
from oomdoctor.runs.smoke_result import TOLERANCE, MemoryCheck, SmokeResult, judge, render_text
from oomdoctor.plans.parallel import (NODE_STRATEGIES, STRATEGIES, StrategyEstimate,
                                      execution_blocks, policy_applies)

DISTRIBUTED = ("ddp", "zero1", "zero2", "zero3", "hsdp")
Progress = Callable[[str], None]


class SmokeError(Exception):
    """The smoke run cannot start (what, why, fix in the message)."""


class NoDeviceError(SmokeError):
    """--device cuda, and not enough CUDA GPUs are visible (the CLI's no-device exit code)."""


@dataclass(frozen=True)
class SmokeConfig:
    """What to run."""

    strategy: str = "single"
    num_gpus: int = 1
    precision: str = "fp32"
    checkpointing: bool = False
    checkpoint_class: str | None = None
    micro_batch: int = 1              # per GPU (per data-parallel rank)
    grad_accum: int = 1
    steps: int = 3
    optimizer: str | None = None      # override the model file's optimizer
    device: str = "auto"              # auto | cuda | cpu
    cpu_batch: int = 2                # the largest micro-batch run on the CPU
    device_map: dict[str, int] | None = None     # pipeline2: module -> stage
    main_device: int = 0              # pipeline2: where inputs and the loss live
    timeout_s: float = 600.0
    cpu_fp32_fallback: bool = True    # bf16 on a CPU without fast bf16 runs in fp32
    nodes: int = 1                    # hsdp: replicas (num_gpus counts every rank)
    checkpoint_every: int = 1         # with checkpointing: every N-th block, whole or per op
    checkpoint_policy: str = "full"   # (oomdoctor.models.checkpointing)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES + NODE_STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of "
                             f"{', '.join(STRATEGIES)}")
        if self.steps < 1 or self.micro_batch < 1 or self.grad_accum < 1:
            raise ValueError("--steps, --batch-size and --grad-accum must be >= 1")
        if self.strategy == "pipeline2" and self.num_gpus != 2:
            raise ValueError("pipeline2 runs on exactly 2 GPUs")


# ---------------------------------------------------------------------------------------------
# One process's training loop
# ---------------------------------------------------------------------------------------------

def batch_seed(rank: int, micro: int) -> int:
    """The seed of rank ``rank``'s micro-batch ``micro`` (the same at every step)."""
    return 1000 + 97 * rank + micro


def _opt_kwargs(cls: type, defaults: dict) -> dict:
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in defaults.items() if k in accepted and k != "params"}


class _MeanLoss(torch.nn.Module):
    """DataParallel gathers each replica's scalar loss into a vector: average it."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dim() == 1:
            return out.mean()
        if hasattr(out, "loss") and isinstance(out.loss, torch.Tensor) and out.loss.dim() == 1:
            out.loss = out.loss.mean()
        return out


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(t.to(device) for t in batch)
    return batch.to(device)


def train_process(spec: ModelSpec, cfg: SmokeConfig, cuda: bool, rank: int = 0, world: int = 1,
                  want_state: bool = False,
                  on_step: Callable[[int, float], None] | None = None,
                  inspect_last: Callable[[Any, Any], Any] | None = None) -> dict[str, Any]:
    """Build, wrap and train ``cfg.steps`` steps in this process; return losses, step times,
    per-GPU peaks (CUDA) and, if asked, the model's final state (rank 0's full parameters).
    ``on_step(step, seconds)`` is told as each step completes."""
    b = cfg.micro_batch if cuda else min(cfg.micro_batch, cfg.cpu_batch)
    device = _process_device(cfg, cuda, rank)
    model = _build(spec, cfg, device)
    model, wrapped, input_device = _wrap(model, spec, cfg, cuda, device, world)
    opt = _optimizer(spec, cfg, model)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.precision)
    if amp is not None and not cuda:
        amp = torch.bfloat16          # CPU autocast runs bf16
    if _policy(cfg):
        amp = None                    # FSDP2's MixedPrecisionPolicy computes in bf16 itself
    scaler = torch.amp.GradScaler("cuda") if cuda and cfg.precision == "fp16" else None
    batches = _fixed_batches(spec, cfg, cuda, rank, b, input_device)
    devices = _devices(cfg, cuda, device)
    if cuda:
        for d in devices:
            torch.cuda.synchronize(d)
        torch.cuda.empty_cache()
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)
    losses, times, inspected, error = _train_steps(
        spec, cfg, model, wrapped, opt, amp, scaler, batches, input_device, devices, on_step,
        inspect_last)
    memory = []
    if cuda:
        for d in devices:
            memory.append((str(d), torch.cuda.max_memory_allocated(d),
                           torch.cuda.max_memory_reserved(d)))
    out: dict[str, Any] = {"rank": rank, "losses": losses, "times": times, "memory": memory,
                           "batch": b, "oom": error, **inspected}
    if want_state:
        out["state"] = _full_state(model)
    return out


def _process_device(cfg: SmokeConfig, cuda: bool, rank: int) -> torch.device:
    """This process's device: its rank's GPU for a distributed strategy, else cuda:0 (made the
    current device), or the CPU."""
    if cuda:
        device = torch.device("cuda", rank if cfg.strategy in DISTRIBUTED else 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return device


def _build(spec: ModelSpec, cfg: SmokeConfig, device: torch.device) -> torch.nn.Module:
    """The model as the user trains it (precision, checkpointing), seeded; a split model is
    built on the CPU and placed stage by stage later."""
    from oomdoctor.models.training import build_for_training

    torch.manual_seed(0)
    build_on = torch.device("cpu") if cfg.strategy == "pipeline2" else device
    with build_on:
        model, _ = build_for_training(spec, cfg.precision, cfg.checkpointing, cfg.checkpoint_class,
                                      checkpoint_every=cfg.checkpoint_every,
                                      checkpoint_policy=cfg.checkpoint_policy)
    return model


def _wrap(model: torch.nn.Module, spec: ModelSpec, cfg: SmokeConfig, cuda: bool,
          device: torch.device, world: int
          ) -> tuple[torch.nn.Module, torch.nn.Module, torch.device]:
    """The strategy applied: the model (FSDP2-sharded or dispatched in place), the module the
    loss is computed through, and the device the inputs go to."""
    strategy = cfg.strategy
    input_device = device
    wrapped: torch.nn.Module = model
    if strategy in ("ddp", "zero1"):
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if cuda else None)
    elif strategy in ("zero2", "zero3", "hsdp"):
        _fully_shard(model, cfg, cuda, world)
    elif strategy == "dp" and cuda:
        wrapped = torch.nn.DataParallel(model, device_ids=list(range(cfg.num_gpus)))
        if spec.loss_fn is None:
            wrapped = _MeanLoss(wrapped)
    elif strategy == "pipeline2":
        model, input_device = dispatch_split(model, cfg.device_map or {}, cfg.main_device, cuda)
        wrapped = model
    return model, wrapped, input_device


def _fully_shard(model: torch.nn.Module, cfg: SmokeConfig, cuda: bool, world: int) -> None:
    """ZeRO-2/3 and HSDP with FSDP2: every execution block sharded, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard        # FSDP2, torch >= 2.6
    except ImportError:                                         # torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import fully_shard
    strategy = cfg.strategy
    # hsdp: a 2-D mesh, replicas across nodes and shards within one (FSDP2's HSDP).
    hsdp = strategy == "hsdp"
    mesh = init_device_mesh("cuda" if cuda else "cpu", (cfg.nodes, world // cfg.nodes)
                            if hsdp else (world,),
                            mesh_dim_names=("replicate", "shard") if hsdp else None)
    reshard = strategy != "zero2"
    extra = {}
    if _policy(cfg):              # the plan's bf16 (oomdoctor.plans.parallel.policy_applies)
        from torch.distributed.fsdp import MixedPrecisionPolicy
        extra["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                  reduce_dtype=torch.float32)
    for name in execution_blocks(model):
        if name:
            fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=reshard,
                        **extra)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **extra)


def _policy(cfg: SmokeConfig) -> bool:
    """bf16 under FSDP (zero3, hsdp) runs as FSDP2's MixedPrecisionPolicy, as its plan does."""
    return policy_applies(cfg.strategy, cfg.precision)


def _optimizer(spec: ModelSpec, cfg: SmokeConfig, model: torch.nn.Module) -> Any:
    """The model file's optimizer (or ``cfg.optimizer``); zero1 partitions its state."""
    from oomdoctor.models.training import make_configured_optimizer

    opt = make_configured_optimizer(spec, model, cfg.optimizer)
    if cfg.strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer([p for p in model.parameters() if p.requires_grad],
                                      optimizer_class=type(opt),
                                      **_opt_kwargs(type(opt), opt.defaults))
    return opt


def _fixed_batches(spec: ModelSpec, cfg: SmokeConfig, cuda: bool, rank: int, b: int,
                   input_device: torch.device) -> list[Any]:
    """One batch per micro-batch, on the input device; DataParallel's covers every GPU."""
    from oomdoctor.models.training import make_configured_batch

    # The data, fixed per rank and micro-batch so the loss falls if training works.
    dp_batch = b * cfg.num_gpus if cfg.strategy == "dp" and cuda else b
    batches = []
    for micro in range(cfg.grad_accum):
        torch.manual_seed(batch_seed(rank, micro))
        with torch.device("cpu"):
            batch = make_configured_batch(spec, dp_batch, cfg.precision)
        batches.append(_to(batch, input_device))
    return batches


def _train_steps(spec: ModelSpec, cfg: SmokeConfig, model: torch.nn.Module,
                 wrapped: torch.nn.Module, opt: Any, amp: torch.dtype | None, scaler: Any,
                 batches: list[Any], input_device: torch.device, devices: list[torch.device],
                 on_step: Callable[[int, float], None] | None,
                 inspect_last: Callable[[Any, Any], Any] | None
                 ) -> tuple[list[float], list[float], dict[str, Any], str | None]:
    """``cfg.steps`` optimizer steps: the losses, the step times, ``inspect_last``'s answer at
    the last step, and the OOM message when the caching allocator ran out (else None)."""
    losses: list[float] = []
    inspected: dict[str, Any] = {}       # inspect_last's answer at the last step
    times: list[float] = []
    error = None
    try:
        for _ in range(cfg.steps):
            t0 = time.perf_counter()
            total = _accumulate(spec, cfg, wrapped, amp, scaler, batches, input_device)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if inspect_last is not None and len(losses) == cfg.steps - 1:
                inspected["inspect"] = inspect_last(model, opt)   # grads and state alive
            opt.zero_grad(set_to_none=True)
            for d in devices:                # none without CUDA
                torch.cuda.synchronize(d)
            times.append(time.perf_counter() - t0)
            losses.append(total)
            if on_step is not None:
                on_step(len(times), times[-1])
    except torch.cuda.OutOfMemoryError as e:    # the caching allocator's OOM (torch >= 1.13)
        error = f"CUDA out of memory at step {len(losses) + 1}: {str(e).splitlines()[0]}"
    return losses, times, inspected, error


def _accumulate(spec: ModelSpec, cfg: SmokeConfig, wrapped: torch.nn.Module,
                amp: torch.dtype | None, scaler: Any, batches: list[Any],
                input_device: torch.device) -> float:
    """Forward and backward of every micro-batch (DDP syncs gradients on the last only); the
    step's loss."""
    total = 0.0
    for micro, batch in enumerate(batches):
        quiet = (cfg.strategy in ("ddp", "zero1") and micro < cfg.grad_accum - 1)
        with (wrapped.no_sync() if quiet else contextlib.nullcontext()):
            with (torch.autocast(device_type=input_device.type, dtype=amp)
                  if amp is not None else contextlib.nullcontext()):
                loss = compute_loss(spec, wrapped, batch)
            loss = loss / cfg.grad_accum
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += float(loss.detach().float())
    return total


def _devices(cfg: SmokeConfig, cuda: bool, device: torch.device) -> list[torch.device]:
    if not cuda:
        return []
    if cfg.strategy in ("dp", "pipeline2"):
        return [torch.device("cuda", i) for i in range(cfg.num_gpus)]
    return [device]


def _full_state(model: torch.nn.Module) -> dict[str, Any]:
    """Full fp32 parameters as numpy arrays: they cross the process boundary by value (a tensor
    on a multiprocessing queue is shared through the sender, which may have exited)."""
    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, "full_tensor"):        # FSDP2 DTensor
            p = p.full_tensor()
        out[name] = p.detach().float().cpu().numpy().copy()
    return out


def dispatch_split(model: torch.nn.Module, device_map: dict[str, int], main_device: int,
                   cuda: bool) -> tuple[torch.nn.Module, torch.device]:
    """Place the model's stages with accelerate's ``dispatch_model``: hooks move each block's
    inputs to its device. Without CUDA both stages go to the CPU with the hooks still attached
    (``force_hooks``), so the same code path runs. Returns the model and the input device."""
    from accelerate import dispatch_model

    def dev(k: int) -> Any:
        return k if cuda else "cpu"
    if not device_map:
        raise SmokeError("pipeline2 needs a device map: run `oomdoctor split model.py --gpus 2 "
                         "--device-map map.json` and pass --device-map map.json")
    from oomdoctor.models.adapters import wrapped_model_names
    dmap = {name: dev(k) for name, k in wrapped_model_names(model, device_map).items()}
    main = dev(main_device)
    # With both stages on the CPU accelerate logs that parameters were "offloaded to the cpu";
    # nothing is offloaded (the main device is the CPU too), so keep that line out of the output.
    import logging
    log = logging.getLogger("accelerate.big_modeling")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        model = dispatch_model(model, device_map=dmap, main_device=main, force_hooks=True)
    finally:
        log.setLevel(level)
    return model, torch.device("cuda", main_device) if cuda else torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------

def _rank_main(source: ModelSpec | tuple, cfg: SmokeConfig, cuda: bool, rank: int, world: int,
               init: str, results: Any, want_state: bool) -> None:
    import torch.distributed as dist
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank,
                                world_size=world)
        try:
            spec = in_process(source)

            def on_step(step: int, seconds: float) -> None:
                results.put({"rank": rank, "step": step, "seconds": seconds})
            out = train_process(spec, cfg, cuda, rank, world, want_state and rank == 0,
                                on_step if rank == 0 else None)
            if out["losses"]:
                t = torch.tensor(out["losses"], dtype=torch.float64,
                                 device="cuda" if cuda else "cpu")
                dist.all_reduce(t)
                out["losses"] = (t / world).tolist()
            results.put(out)
        finally:
            dist.destroy_process_group()
    except BaseException as e:         # report any failure to the parent, never hang it
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc()})


def _step_line(cfg: SmokeConfig, step: int, seconds: float) -> str:
    return f"step {step}/{cfg.steps}: {seconds:.1f} s"


def run_training(spec: ModelSpec, cfg: SmokeConfig, cuda: bool, want_state: bool = False,
                 progress: Progress = lambda _: None) -> list[dict[str, Any]]:
    """Every process's result, rank order. Distributed strategies start one process per rank
    (spawn with CUDA, fork on the CPU where available) and rendezvous through a file store.
    ``progress`` is told of each of rank 0's steps as it completes."""
    if cfg.strategy not in DISTRIBUTED:
        out = train_process(spec, cfg, cuda, 0, 1, want_state,
                            lambda i, t: progress(_step_line(cfg, i, t)))
        if "state" in out:
            out["state"] = {k: torch.from_numpy(v) for k, v in out["state"].items()}
        return [out]
    world = cfg.num_gpus
    method = "spawn" if cuda or "fork" not in multiprocessing.get_all_start_methods() else "fork"
    ctx = multiprocessing.get_context(method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        source = for_process(spec, method)
        procs = [ctx.Process(target=_rank_main, args=(source, cfg, cuda, r, world, init,
                                                      results, want_state), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        steps: list[float] = []         # rank 0's completed steps, seconds each

        def on_step(msg: dict[str, Any]) -> None:
            steps.append(msg["seconds"])
            progress(_step_line(cfg, msg["step"], msg["seconds"]))
        out = collect_ranks(procs, results, world, cfg.timeout_s, on_step,
                            lambda done: _timeout_message(cfg, done, steps), SmokeError)
    for o in out:
        if "state" in o:
            o["state"] = {k: torch.from_numpy(v) for k, v in o["state"].items()}
    return out



def _timeout_message(cfg: SmokeConfig, done: int, steps: list[float]) -> str:
    """Slow, not stuck, when steps were completing; stuck when none did."""
    head = (f"{cfg.strategy} smoke timed out after {cfg.timeout_s:.0f} s with {done} of "
            f"{cfg.num_gpus} ranks done")
    if steps:
        return (f"{head}; it is slow, not stuck: {len(steps)} of {cfg.steps} steps completed "
                f"(last {steps[-1]:.1f} s); run fewer --steps or a smaller configuration")
    return (f"{head} and no step completed; a rank is stuck (NCCL/gloo rendezvous, or a hang "
            "in the model)")


def cpu_has_fast_bf16() -> bool:
    """True when this CPU computes bf16 natively (AVX512_BF16 or AMX); elsewhere a bf16 matmul
    is emulated and runs many times slower than fp32."""
    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        f = getattr(cpu, probe, None)
        if f is not None and f():
            return True
    return any(k in torch.backends.cpu.get_cpu_capability() for k in ("AVX512_BF16", "AMX"))


def host_bytes_needed(spec: ModelSpec, cfg: SmokeConfig) -> int:
    """Host memory a CPU smoke needs, roughly: every process holds the full model while it is
    built (params), plus gradients and optimizer state (AdamW: 2 slots) of its share."""
    from oomdoctor.sim.device import on_meta   # builds as the trace does
    with on_meta():
        model = build_checked_model(spec)
        seen = {p.untyped_storage()._cdata: p.numel() for p in model.parameters()}
    n = sum(seen.values())
    width = param_width(cfg.precision)
    procs = cfg.num_gpus if cfg.strategy in DISTRIBUTED else 1
    if spec.adapters is not None:
        # a frozen base: its weights only (4-bit: half a byte each, int8: one); the adapters'
        # gradients and optimizer state are a fraction of a percent of it
        per = {"nf4": 0.5, "fp4": 0.5, "int8": 1}.get(spec.adapters.quantize or "", width)
        return procs * int(n * per)
    return procs * n * width * 4


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def run_smoke(spec: ModelSpec, cfg: SmokeConfig, prediction: StrategyEstimate | None = None,
              progress: Progress = lambda _: None) -> SmokeResult:
    """Run the configuration and judge it: finite, moving loss; with CUDA, no OOM and peaks
    within :data:`TOLERANCE` of ``prediction``."""
    asked = cfg.precision
    cuda = _use_cuda(cfg)
    notes: list[str] = []
    ran_precision = cfg.precision if cuda or cfg.precision != "fp16" else "bf16"
    if not cuda and ran_precision.startswith("bf16") and cfg.cpu_fp32_fallback \
            and not cpu_has_fast_bf16():
        note = (f"this CPU has no fast bf16 (no AVX512_BF16/AMX): {cfg.precision} ran in fp32 "
                "instead, many times faster here; the smoke checks that the training loop runs, "
                "not bf16 numerics")
        progress(note)
        notes.append(note)
        ran_precision = "fp32"
        cfg = replace(cfg, precision="fp32")
    if not cuda:
        _check_host_memory(spec, cfg)
        notes += _cpu_notes(cfg)
    progress(f"smoke: {cfg.steps} steps of {cfg.strategy} on "
             f"{'CUDA' if cuda else 'the CPU'}")
    outs = run_training(spec, cfg, cuda, progress=progress)
    rank0 = outs[0]
    memory, problems, judged = judge(outs, cuda, cfg.strategy, prediction, asked)
    notes += judged
    return SmokeResult(
        model=spec.name, strategy=cfg.strategy, num_gpus=cfg.num_gpus, precision=asked,
        ran_precision=ran_precision, checkpointing=cfg.checkpointing, micro_batch=cfg.micro_batch,
        ran_micro_batch=rank0["batch"], grad_accum=cfg.grad_accum, steps=cfg.steps,
        device="cuda" if cuda else "cpu", cuda_exercised=cuda, processes=len(outs),
        losses=tuple(rank0["losses"]), step_seconds=tuple(rank0["times"]), memory=tuple(memory),
        ok=not problems, problems=tuple(problems), notes=tuple(notes))


def _use_cuda(cfg: SmokeConfig) -> bool:
    """Whether the smoke runs on CUDA: enough GPUs are visible and --device allows it;
    --device cuda without them is a :class:`NoDeviceError`."""
    want_cuda = cfg.device in ("auto", "cuda")
    have = torch.cuda.is_available() and torch.cuda.device_count() >= cfg.num_gpus
    if cfg.device == "cuda" and not have:
        raise NoDeviceError(f"--device cuda asked for {cfg.num_gpus} CUDA GPU(s) but "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} are "
                         "visible; check CUDA_VISIBLE_DEVICES, or drop --device cuda to run on "
                         "the CPU")
    return want_cuda and have


def _check_host_memory(spec: ModelSpec, cfg: SmokeConfig) -> None:
    """A CPU smoke that would not fit in host memory is refused before it starts."""
    need = host_bytes_needed(spec, cfg)
    avail = _available_host_bytes()
    if need > 0.8 * avail:
        raise SmokeError(f"a CPU smoke of {spec.name} needs about {need / 2**30:.1f} GiB of "
                         f"host memory (weights, gradients, optimizer state per process) and "
                         f"{avail / 2**30:.1f} GiB are available; run it on the GPUs, or "
                         "smoke a smaller configuration of the model")


def _cpu_notes(cfg: SmokeConfig) -> list[str]:
    """What a CPU smoke did not check, and what it ran instead of what was asked."""
    notes = ["no CUDA device here: ran on the CPU; GPU memory was NOT measured and the "
             "CUDA code path (NCCL, cuda:0/cuda:1, GradScaler) was not exercised"]
    ran_b = min(cfg.micro_batch, cfg.cpu_batch)
    if ran_b != cfg.micro_batch:
        notes.append(f"micro-batch {ran_b} on the CPU (asked {cfg.micro_batch}; "
                     "--cpu-batch sets the cap)")
    if cfg.precision == "fp16":
        notes.append("fp16 AMP runs as bf16 autocast on the CPU (no GradScaler)")
    if cfg.strategy == "dp":
        notes.append("DataParallel needs CUDA: on the CPU the module ran as one process")
    if cfg.strategy in DISTRIBUTED:
        notes.append(f"{cfg.num_gpus} processes over gloo on the CPU")
    if cfg.strategy == "pipeline2":
        notes.append("split via accelerate's dispatch_model hooks with both stages on the CPU")
    return notes
