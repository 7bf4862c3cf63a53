"""What to change in a user's script for a plan, in the terms of the framework it is written in.

The script is the user's, so `recommend -- python train.py` says what to change rather than
printing code it cannot run for them - and a change that fits the script: an `Accelerator`
script is launched by `accelerate launch`, which wraps DDP or FSDP from its config; the HF
Trainer and Lightning take the strategy as an argument; a script with its own DDP path
(nanoGPT's, DeepSpeedExamples') only needs torchrun. Found by running public example scripts
(pytorch/examples, nanoGPT, accelerate's examples) through `recommend`, which told every one of
them to wrap the model in DistributedDataParallel.
"""
from __future__ import annotations

import re

# The frameworks, by what their scripts say: the first match wins (a Trainer script imports
# accelerate indirectly, not in its text; Lightning's Trainer before the HF one's)
_SIGNS = (
    ("lightning", re.compile(r"\b(import lightning|from lightning|pytorch_lightning|"
                             r"lightning\.pytorch)\b")),
    ("accelerate", re.compile(r"\bAccelerator\s*\(")),
    ("hf_trainer", re.compile(r"\b(Trainer|SFTTrainer|Seq2SeqTrainer)\s*\(")),
    ("own_ddp", re.compile(r"\bDistributedDataParallel\b|\bDDP\s*\(")),
)


def framework(source: str) -> str:
    """'lightning', 'accelerate', 'hf_trainer', 'own_ddp' (the script wraps DDP itself under
    a launcher) or 'plain', from the script's text."""
    return next((name for name, sign in _SIGNS if sign.search(source)), "plain")


_PLAIN = {
    "single": "nothing but the batch: run it as it is",
    "ddp": "launch with torchrun and wrap the model in DistributedDataParallel after moving it "
           "to its GPU (torch.distributed.init_process_group('nccl'), a DistributedSampler)",
    "zero1": "DDP as above, with torch.distributed.optim.ZeroRedundancyOptimizer around the "
             "optimizer",
    "zero2": "launch with torchrun and shard gradients and optimizer state (DeepSpeed ZeRO-2, "
             "or FSDP's SHARD_GRAD_OP)",
    "zero3": "launch with torchrun and shard with FSDP2: fully_shard(block) for every "
             "repeated block, then fully_shard(model), before building the optimizer",
    "pipeline2": "split the model over the two GPUs (the cut is in `oomdoctor split -- "
                 "<this command>`), moving activations between them in forward",
}
_FRAMEWORK = {
    "accelerate": {
        "ddp": "launch with `accelerate launch --multi_gpu --num_processes {n} {script} ...`: "
               "its Accelerator wraps the model in DDP and shards the DataLoader",
        "zero2": "launch with `accelerate launch` and an FSDP config (SHARD_GRAD_OP) or a "
                 "DeepSpeed ZeRO-2 one, --num_processes {n}",
        "zero3": "launch with `accelerate launch` and an FSDP config (FULL_SHARD, transformer-"
                 "based wrap on the repeated block class), --num_processes {n}",
    },
    "hf_trainer": {
        "ddp": "launch with `torchrun --nproc_per_node {n} {script} ...`: the Trainer wraps "
               "DDP itself; per_device_train_batch_size is the micro-batch",
        "zero2": "as DDP, with `--deepspeed` and a ZeRO-2 config (or --fsdp shard_grad_op)",
        "zero3": "as DDP, with `--fsdp \"full_shard auto_wrap\"` (or --deepspeed with a ZeRO-3 "
                 "config)",
    },
    "lightning": {
        "ddp": "Trainer(accelerator='gpu', devices={n}, strategy='ddp')",
        "zero2": "Trainer(devices={n}, strategy='deepspeed_stage_2')",
        "zero3": "Trainer(devices={n}, strategy=FSDPStrategy(auto_wrap_policy={{<the repeated "
                 "block class>}})) - the default wraps only the root, gathering every parameter "
                 "at once",
    },
    "own_ddp": {
        "ddp": "launch with `torchrun --standalone --nproc_per_node {n} {script} ...`: it wraps "
               "DistributedDataParallel itself (check how it counts accumulation per process)",
    },
}


def change(strategy: str, kind: str, num_gpus: int, script: str) -> str:
    """The change for ``strategy`` in a ``kind`` script (:func:`framework`)."""
    text = _FRAMEWORK.get(kind, {}).get(strategy) or _PLAIN.get(strategy, strategy)
    return text.format(n=num_gpus, script=script)
