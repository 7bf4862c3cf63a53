"""CPU offload plans: ZeRO-Offload / ZeRO-3 offload / FSDP CPU offload, per GPU and per node.

    oomdoctor recommend sample_models/llama7b.py --gpu rtx3090 --num-gpus 2 --host-ram 128GiB

ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training",
arXiv:2101.06840) keeps the fp32 master weights, both Adam moments and the fp32 gradients on the
host - 16 bytes per parameter - and runs Adam there; the GPUs keep the 16-bit parameters (ZeRO-2)
or a 1/N shard of them (ZeRO-3), plus activations. The numbers per GPU and per node are
DeepSpeed's own estimators (deepspeed/runtime/zero/stage_1_and_2.py
estimate_zero2_model_states_mem_needs, stage3.py estimate_zero3_model_states_mem_needs), with P
parameters, L those of the largest layer, W GPUs in all, G per node, N nodes:

- ZeRO-2 + offload_optimizer: GPU 2P; host per node max(4P x G, 16P x G/W) x 1.5 - every
  process first loads the fp32 model (4P each), then the node holds its share of the 16 B/param
  states; 1.5 is DeepSpeed's ``additional_buffer_factor`` (pinned buffers);
- ZeRO-3 + offload_optimizer: GPU 4L + 2P/W; host per node 16P/N x 1.5;
- ZeRO-3 + offload_optimizer + offload_param (FSDP2's CPUOffloadPolicy alike): GPU 4L; host per
  node 18P/N x 1.5;
- FSDP2 with CPUOffloadPolicy (its own plan): host per node max(4P x G, 16P x G/W), no buffer
  factor (FSDP pins exactly its shards, their gradients and AdamW's state).

Those estimators count model states only. Each plan's per-GPU figure is its step replayed
(:func:`replay_offload`): traced at micro-batch 1 as its printed code runs it, and replayed as
the strategy - DeepSpeed's stage with the very config the plan prints, read as `parallel
--ds-config` reads it, or FSDP2 under the policy (oomdoctor.plans.parallel.deepspeed, fsdp).

The time it costs is a rough estimate, stated as such: every micro-batch each GPU sends its
gradient shard to the host, and receives its updated 16-bit parameters once per step - or, with
the parameters offloaded, its shard for every gather, forward and backward (:func:`host_traffic`,
over its PCIe link); and the node's CPUs run Adam over P/N parameters, which is memory-bound:
:data:`CPU_ADAM_BYTES_PER_PARAM` bytes moved per parameter at :data:`CPU_MEMORY_GBPS`.
"""
from __future__ import annotations

import os
from dataclasses import replace

from oomdoctor.models.spec import ModelSpec
from oomdoctor.plans.estimate import Budget, trace_for
from oomdoctor.plans.parallel import (Strategy, default_policy, estimate_strategy, model_layout,
                                      read_deepspeed_config, trace_config)
from oomdoctor.plans.recommend.facts import _Facts
from oomdoctor.plans.recommend.machine import Hardware, link_gbps
from oomdoctor.plans.recommend.offload_code import OffloadSetting, ds_config, how_to_run
from oomdoctor.plans.recommend.records import OffloadPlan
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.sim.trace import TraceConfig


BUFFER_FACTOR = 1.5            # DeepSpeed's additional_buffer_factor in both estimators
# CPU Adam reads the fp32 parameter, gradient and both moments (16 B) and writes the parameter
# and moments (12 B) and the 16-bit copy sent back to the GPU (2 B): 30 B per parameter, and
# it is memory-bound. Assumption: 20 GB/s of host memory bandwidth for it - about what a
# desktop or small server with dual-channel DDR4 sustains in STREAM-like loops (its peak is
# 51.2 GB/s at DDR4-3200); many-channel servers do several times better.
CPU_ADAM_BYTES_PER_PARAM = 30
CPU_MEMORY_GBPS = 20.0


def zero2_offload_bytes(p: int, per_node: int, nodes: int) -> tuple[int, int]:
    """(GPU, host per node) bytes of ZeRO-2 with the optimizer on the CPU."""
    world = per_node * nodes
    host = max(4 * p * per_node, 16 * p * per_node / world) * BUFFER_FACTOR
    return 2 * p, int(host)


def zero3_offload_bytes(p: int, largest_layer: int, per_node: int, nodes: int,
                        params_too: bool = False) -> tuple[int, int]:
    """(GPU, host per node) bytes of ZeRO-3 with the optimizer (and parameters) on the CPU."""
    world = per_node * nodes
    if params_too:
        return 4 * largest_layer, int(p * 18 / nodes * BUFFER_FACTOR)
    return 4 * largest_layer + int(2 * p / world), int(p * 16 / nodes * BUFFER_FACTOR)


def local_host_ram() -> int | None:
    """This machine's RAM (MemTotal), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


_DESCRIPTIONS = {
    "zero2-offload": "ZeRO-Offload: ZeRO-2, optimizer state + fp32 weights and gradients on "
                     "the CPU, 16-bit weights on every GPU",
    "zero3-offload": "ZeRO-3 with the optimizer on the CPU: 16-bit weights sharded over the "
                     "GPUs",
    "zero3-offload-all": "ZeRO-3 with optimizer and parameters on the CPU: each layer fetched "
                         "when it runs",
    "fsdp-offload": "FSDP2 with CPUOffloadPolicy: parameters, gradients and optimizer on the "
                    "CPU, each block fetched when it runs (PyTorch alone, no DeepSpeed)",
}
OFFLOAD_NAMES = tuple(_DESCRIPTIONS)


def offload_strategy(name: str, hw: Hardware, s: OffloadSetting) -> tuple[Strategy, str]:
    """The strategy an offload plan's code runs, as the replay models it, and its precision."""
    world = hw.num_gpus * hw.nodes
    if name == "fsdp-offload":
        return Strategy("zero3", world, nodes=hw.nodes, cpu_offload=True,
                        mixed_precision=s.fsdp_precision == "bf16"), s.fsdp_precision
    # the config the plan prints, read as `parallel --ds-config` reads it
    run = read_deepspeed_config(ds_config(2 if name == "zero2-offload" else 3,
                                          name.endswith("all"), s))
    precision = run.precision or "fp32"
    st = Strategy(run.strategy, world, nodes=hw.nodes, deepspeed=run.config)
    return default_policy(st, precision), precision


def replay_offload(spec: ModelSpec, cfg: TraceConfig, hw: Hardware, budget: Budget,
                   alloc: AllocatorConfig, s: OffloadSetting) -> dict[str, tuple[int, bool]]:
    """Each offload plan's per-GPU peak (reserved + CUDA context) and whether every GPU fits,
    its step traced at micro-batch 1 as its code runs it and replayed as its strategy: name ->
    (bytes, fits); a plan the replay refuses is left out."""
    out = {}
    for name in OFFLOAD_NAMES:
        st, p = offload_strategy(name, hw, s)
        traced = trace_config(st, replace(cfg, batch_size=1, checkpointing=s.checkpointing,
                                          grad_accum=min(2, s.accumulation)), p)
        try:
            trace = trace_for(spec, traced, budget.gpu)
            e = estimate_strategy(trace, model_layout(spec, traced.precision), st, budget, alloc,
                                  grad_accum=traced.grad_accum)
        except ValueError:
            continue
        out[name] = max(g.device_peak_bytes for g in e.gpus), e.fits
    return out


def offload_plans(facts: _Facts, hw: Hardware, budget: Budget, setting: OffloadSetting,
                  host_ram: int | None, replayed: dict[str, tuple[int, bool]] | None = None,
                  compute_seconds: float | None = None) -> tuple[OffloadPlan, ...]:
    """The offload plans for ``hw`` (G GPUs on each of N nodes), each run at micro-batch 1 with
    ``setting``'s accumulation. ``replayed``: each plan's per-GPU peak and verdict from
    :func:`replay_offload` (None, or a plan missing: DeepSpeed's estimator of the model states
    alone, against the allocator's budget); ``compute_seconds``: the GPUs' compute per optimizer step (None: unknown, no
    slowdown ratio)."""
    p, g, n = facts.num_parameters, hw.num_gpus, hw.nodes
    world = g * n
    pcie = link_gbps(hw.gpu, "pcie") * 1e9       # host <-> one GPU, per direction
    adam = CPU_ADAM_BYTES_PER_PARAM * p / n / (CPU_MEMORY_GBPS * 1e9)
    plans = []
    for name in OFFLOAD_NAMES:
        if name == "zero2-offload":
            gpu, host = zero2_offload_bytes(p, g, n)
        else:
            gpu, host = zero3_offload_bytes(p, facts.largest_leaf_params, g, n,
                                            params_too=name != "zero3-offload")
        if name == "fsdp-offload":                 # every process builds the fp32 model first,
            host = max(4 * p * g, 16 * p * g // world)   # then the node holds its 16 B/param
        t_pcie = host_traffic(name, p / world, setting) / pcie
        # the replay's own verdict (reserved against the budget); its peak has the context too
        total, fits = (replayed or {}).get(name, (None, gpu <= budget.limit_bytes))
        slowdown = ((compute_seconds + t_pcie + adam) / compute_seconds
                    if compute_seconds else None)
        plans.append(OffloadPlan(
            name, _DESCRIPTIONS[name], gpu, total, fits, host,
            None if host_ram is None else host <= host_ram,
            t_pcie, adam, slowdown, *how_to_run(name, hw, setting)))
    return tuple(plans)


def host_traffic(name: str, shard: float, s: OffloadSetting) -> float:
    """Bytes one GPU moves over its host link per optimizer step (``shard``: its parameters,
    P/W). Every micro-batch's gradients go to the host (DeepSpeed accumulates them there:
    ``async_accumulate_grad_in_cpu_via_gpu``; FSDP2 copies each reduced shard, in fp32 under
    its policy); offloaded parameters come in for every gather, the forward's and the
    backward's (FSDP2's fp32 shards are cast on the GPU); a GPU-resident 16-bit partition takes
    the updated weights once per step."""
    k = s.accumulation
    if name == "fsdp-offload":
        return k * 4 * shard + k * 2 * 4 * shard
    weights = k * 2 * 2 * shard if name == "zero3-offload-all" else 2 * shard
    return k * 2 * shard + weights


def offload_summary(plans: tuple[OffloadPlan, ...]) -> str:
    """The offload plans in "what would fit": the one that holds least on each GPU, with the
    host RAM it needs - the figures of the table above, not another estimate."""
    best = min(plans, key=lambda o: o.gpu_bytes)
    figure = (f"needs {best.gpu_bytes / 2**30:.1f} GiB per GPU" if best.gpu_replayed_bytes
              is not None else f"keeps {best.gpu_bytes / 2**30:.1f} GiB of model states per GPU "
              "(DeepSpeed's estimator; not traced)")
    return (f"CPU offload (the plans above): {best.name} {figure} and about "
            f"{best.host_bytes_per_node / 2**30:.0f} GiB of host RAM per node; the optimizer "
            "steps on the CPU (slower per step)")
