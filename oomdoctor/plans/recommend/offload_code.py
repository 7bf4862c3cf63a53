"""The code and launch line of each CPU offload plan, complete enough to run as printed.

DeepSpeed's plans are a ``deepspeed.initialize`` loop with the config inline (and as
``ds_config.json``); FSDP2's is the recommended plans' FSDP loop with ``CPUOffloadPolicy`` on
every ``fully_shard``. Each leaves to the user what every printed plan does: ``build_model``,
``dataset``, ``loss_fn(model, batch)``, ``epochs`` (tests/test_plan_scripts.py runs them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from oomdoctor.plans.recommend.launch import checkpointing_lines, snippet
from oomdoctor.plans.recommend.machine import Hardware
from oomdoctor.plans.recommend.records import Candidate

# DeepSpeed's 16-bit modes; anything else trains in fp32 (no master copy)
_DS_MODES = {"bf16": "bf16", "bf16-pure": "bf16", "fp16": "fp16", "fp16-pure": "fp16"}
_DS_BUCKET = 500_000_000            # zero_optimization.reduce_bucket_size's default
_TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


@dataclass(frozen=True)
class OffloadSetting:
    """What every offload plan runs: micro-batch 1, ``accumulation`` micro-batches per step,
    ``precision`` (the leanest the search allowed), checkpointing as the reference point."""

    precision: str
    checkpointing: bool
    accumulation: int
    blocks: str = ""                   # the repeated blocks' attribute path (model.layers)
    allocator: str = ""                # PYTORCH_CUDA_ALLOC_CONF the figures assume
    parameters: int = 0                # the model's, to size DeepSpeed's reduce bucket

    @property
    def deepspeed_mode(self) -> str | None:
        return _DS_MODES.get(self.precision)

    @property
    def fsdp_precision(self) -> str:
        """FSDP2's bf16 MixedPrecisionPolicy where the precision is bf16, else fp32."""
        return "bf16" if self.precision.startswith("bf16") else "fp32"


def ds_config(stage: int, params_too: bool, s: OffloadSetting) -> dict:
    """The DeepSpeed config of one offload plan: CPU Adam needs the optimizer named in it
    (DeepSpeed builds DeepSpeedCPUAdam for "AdamW" with offload_optimizer)."""
    zero: dict = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if 0 < s.parameters < _DS_BUCKET:
        # DeepSpeed's 5e8-element bucket is made whatever the model's size (1 GB in 16 bits):
        # no larger than the model, a small one's plan need not hold it
        zero["reduce_bucket_size"] = s.parameters
    if params_too:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    doc: dict = {"train_micro_batch_size_per_gpu": 1,
                 "gradient_accumulation_steps": s.accumulation,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if s.deepspeed_mode:
        doc[s.deepspeed_mode] = {"enabled": True}
    doc["zero_optimization"] = zero
    return doc


def deepspeed_code(config: dict, s: OffloadSetting) -> str:
    """The training loop under DeepSpeed's engine, which owns the 16-bit cast, backward,
    accumulation and the step."""
    where = f"model.{s.blocks}" if s.blocks else "model.layers"
    lines = ["import torch, deepspeed", "model = build_model()",
             *checkpointing_lines(s.checkpointing, where),
             f"ds_config = {config!r}   # or the JSON in ds_config.json",
             "engine, _, loader, _ = deepspeed.initialize(",
             "    model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],",
             "    training_data=dataset, config=ds_config)",
             "for epoch in range(epochs):",
             "    for batch in loader:",
             "        batch = [t.to(engine.device) for t in batch]"]
    if s.deepspeed_mode:               # the engine casts the model, not its inputs
        dtype = _TORCH_DTYPE[s.deepspeed_mode]
        lines.append(f"        batch = [t.to({dtype}) if t.is_floating_point() else t "
                     "for t in batch]")
    return "\n".join(lines + [
        "        loss = loss_fn(engine, batch)",
        "        engine.backward(loss)",
        "        engine.step()         # steps the optimizer every gradient_accumulation_steps"])


def fsdp_code(hw: Hardware, s: OffloadSetting) -> str:
    """FSDP2 with CPUOffloadPolicy: the recommended plans' FSDP loop (its bf16 policy where the
    precision is bf16) with the shards on the host."""
    c = Candidate(strategy="zero3", num_gpus=hw.num_gpus * hw.nodes,
                  precision=s.fsdp_precision,
                  checkpointing=s.checkpointing, micro_batch=1, grad_accum=s.accumulation,
                  effective_batch=s.accumulation * hw.num_gpus * hw.nodes, peak_device_bytes=0,
                  per_gpu_bytes=(), step_seconds=0.0, compute_seconds=0.0,
                  communication_seconds=0.0, samples_per_second=0.0, numerics="", score=0.0)
    return snippet(c, s.blocks, cpu_offload=True)


def launch_line(name: str, hw: Hardware) -> str:
    """DeepSpeed's launcher (its hostfile across nodes), or torchrun for FSDP2."""
    if name == "fsdp-offload":
        if hw.nodes > 1:
            return (f"torchrun --nnodes {hw.nodes} --nproc_per_node={hw.num_gpus} "
                    "--rdzv_backend c10d --rdzv_endpoint HOST0:29500 train.py   # each node")
        return f"torchrun --standalone --nproc_per_node={hw.num_gpus} train.py"
    nodes = f" --num_nodes {hw.nodes} --hostfile hostfile" if hw.nodes > 1 else ""
    return f"deepspeed{nodes} --num_gpus {hw.num_gpus} train.py"


def how_to_run(name: str, hw: Hardware, s: OffloadSetting) -> tuple[str, str, dict, str]:
    """(config, launch line, environment, code) of one offload plan."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": s.allocator} if s.allocator else {}
    if name == "fsdp-offload":
        return ("fully_shard(block, offload_policy=CPUOffloadPolicy()) on every block, then "
                "the model", launch_line(name, hw), env, fsdp_code(hw, s))
    config = ds_config(2 if name == "zero2-offload" else 3, name.endswith("all"), s)
    return json.dumps(config), launch_line(name, hw), env, deepspeed_code(config, s)
