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
  node 18P/N x 1.5.

The time it costs is a rough estimate, stated as such: every step each GPU sends its 16-bit
gradient shard to the host and receives its updated 16-bit parameters (2 x 2P/W bytes over its
PCIe link; with the parameters offloaded, 2 x 2P/W more per micro-batch for the forward and the
backward gather), and the node's CPUs run Adam over P/N parameters, which is memory-bound:
:data:`CPU_ADAM_BYTES_PER_PARAM` bytes moved per parameter at :data:`CPU_MEMORY_GBPS`.
"""
from __future__ import annotations

import os

from oomdoctor.plans.estimate import Budget
from oomdoctor.plans.recommend.facts import _Facts
from oomdoctor.plans.recommend.machine import Hardware, link_gbps
from oomdoctor.plans.recommend.records import OffloadPlan


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


def _ds_config(stage: int, params_too: bool, micro_batch: int, accumulation: int) -> str:
    """The DeepSpeed JSON of one offload plan: CPU Adam needs the optimizer named in the
    config (DeepSpeed builds DeepSpeedCPUAdam for "AdamW" with offload_optimizer)."""
    zero = ('{"stage": %d, "offload_optimizer": {"device": "cpu", "pin_memory": true}%s}'
            % (stage, ', "offload_param": {"device": "cpu", "pin_memory": true}'
               if params_too else ""))
    return ('{"train_micro_batch_size_per_gpu": %d, "gradient_accumulation_steps": %d, '
            '"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": true}, '
            '"zero_optimization": %s}' % (micro_batch, accumulation, zero))


# The training loop under DeepSpeed's engine, which owns backward, accumulation and the step.
_DS_SKETCH = """import deepspeed
model = build_model()
engine, _, loader, _ = deepspeed.initialize(
    model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
    training_data=dataset, config="ds_config.json")   # the JSON above
for batch in loader:
    loss = loss_fn(engine, batch)
    engine.backward(loss)
    engine.step()             # steps the optimizer every gradient_accumulation_steps"""
# FSDP2's CPU offload: parameters, gradients and optimizer state on the host, each block
# moved to the GPU when it runs (torch/distributed/fsdp/_fully_shard/_fsdp_api.py).
_FSDP_SKETCH = """from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard   # FSDP2, torch >= 2.6
model = build_model()
for block in model.layers:    # each repeated block, then the root
    fully_shard(block, offload_policy=CPUOffloadPolicy())
fully_shard(model, offload_policy=CPUOffloadPolicy())
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)   # steps on the CPU"""


_DESCRIPTIONS = {
    "zero2-offload": "ZeRO-Offload: ZeRO-2, optimizer state + fp32 weights and gradients on "
                     "the CPU, 16-bit weights on every GPU",
    "zero3-offload": "ZeRO-3 with the optimizer on the CPU: 16-bit weights sharded over the "
                     "GPUs",
    "zero3-offload-all": "ZeRO-3 with optimizer and parameters on the CPU (FSDP CPU offload): "
                         "each layer fetched when it runs",
}


def offload_plans(facts: _Facts, hw: Hardware, budget: Budget, other_bytes: int | None,
                  host_ram: int | None, compute_seconds: float | None = None,
                  target_batch: int = 1) -> tuple[OffloadPlan, ...]:
    """The three offload plans for ``hw`` (G GPUs on each of N nodes). ``other_bytes``:
    activations and temporaries per GPU from a trace (None: not traced); ``compute_seconds``:
    the GPUs' compute per optimizer step (None: unknown, no slowdown ratio); each plan runs
    micro-batch 1 with accumulation to ``target_batch``."""
    p, g, n = facts.num_parameters, hw.num_gpus, hw.nodes
    world = g * n
    pcie = link_gbps(hw.gpu, "pcie") * 1e9       # host <-> one GPU, per direction
    adam = CPU_ADAM_BYTES_PER_PARAM * p / n / (CPU_MEMORY_GBPS * 1e9)
    shard_16bit = 2 * p / world
    plans = []
    for name in ("zero2-offload", "zero3-offload", "zero3-offload-all"):
        if name == "zero2-offload":
            gpu, host = zero2_offload_bytes(p, g, n)
        else:
            gpu, host = zero3_offload_bytes(p, facts.largest_leaf_params, g, n,
                                            params_too=name.endswith("all"))
        moved = 2 * shard_16bit + (2 * shard_16bit if name.endswith("all") else 0)
        t_pcie = moved / pcie
        total = gpu + (other_bytes or 0)
        slowdown = ((compute_seconds + t_pcie + adam) / compute_seconds
                    if compute_seconds else None)
        plans.append(OffloadPlan(
            name, _DESCRIPTIONS[name], gpu, other_bytes, total <= budget.limit_bytes, host,
            None if host_ram is None else host <= host_ram, t_pcie, adam, slowdown,
            *_how_to_run(name, hw, max(1, target_batch // world))))
    return tuple(plans)


def _how_to_run(name: str, hw: Hardware, accumulation: int) -> tuple[str, str, str]:
    """(config, launch line, code sketch) of an offload plan, at micro-batch 1 with
    ``accumulation`` steps (the reference point the plan was sized at). The all-offload plan
    is FSDP2's CPUOffloadPolicy as well; its config line says both."""
    stage = 2 if name == "zero2-offload" else 3
    config = _ds_config(stage, name.endswith("all"), 1, accumulation)
    nodes = f" --num_nodes {hw.nodes} --hostfile hostfile" if hw.nodes > 1 else ""
    launch = f"deepspeed{nodes} --num_gpus {hw.num_gpus} train.py   # with ds_config.json"
    if name.endswith("all"):
        return (config + "; or FSDP2: fully_shard(block, offload_policy=CPUOffloadPolicy()) "
                "per block", launch + f"; FSDP2: torchrun --standalone --nproc_per_node="
                f"{hw.num_gpus} train.py", _DS_SKETCH + "\n# or, with FSDP2 instead of "
                "DeepSpeed:\n" + _FSDP_SKETCH)
    return config, launch, _DS_SKETCH
