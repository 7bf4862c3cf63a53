"""Model states per GPU in closed form: each strategy's lower bound, DeepSpeed's ZeRO estimators."""
from __future__ import annotations

from oomdoctor.plans.parallel.strategy import MASTER_SCALE, Strategy


def deepspeed_zero2_gpu_bytes(total_params: int, num_gpus: int,
                              offload_optimizer: bool = False) -> int:
    """DeepSpeed's ZeRO-2 model-state estimate per GPU (deepspeed/runtime/zero/stage_1_and_2.py,
    estimate_zero2_model_states_mem_needs): 2P + 18P/N - 2 B of 16-bit parameters replicated;
    16-bit and 32-bit gradients, 32-bit master weights and Adam's two moments sharded. With the
    optimizer offloaded to the CPU: 2P."""
    if offload_optimizer:
        return 2 * total_params
    return 2 * total_params + int(18 * total_params / num_gpus)


def deepspeed_zero3_gpu_bytes(total_params: int, largest_layer_params: int, num_gpus: int,
                              offload_optimizer: bool = False, offload_params: bool = False
                              ) -> int:
    """DeepSpeed's ZeRO-3 estimate per GPU (deepspeed/runtime/zero/stage3.py,
    estimate_zero3_model_states_mem_needs): 4L + 18P/N, L the largest layer's parameters
    (16-bit parameters + gradients of the layer being computed); 4L + 2P/N with the optimizer
    offloaded; 4L with parameters offloaded too."""
    layer = 4 * largest_layer_params
    if offload_optimizer and offload_params:
        return layer
    if offload_optimizer:
        return layer + int(2 * total_params / num_gpus)
    return layer + int(18 * total_params / num_gpus)


def model_state_floor(param_bytes: int, grad_bytes: int, optim_bytes: int, strategy: Strategy
                      ) -> int:
    """Parameters + gradients + optimizer state one GPU must hold under ``strategy`` - a lower
    bound of its peak (activations, temporaries and buffers come on top)."""
    n = strategy.shard_group
    if strategy.name in ("single", "ddp", "dp"):
        return param_bytes + grad_bytes + optim_bytes
    if strategy.name == "zero1":
        return param_bytes + grad_bytes + optim_bytes // n
    if strategy.name == "zero2":
        return param_bytes + (grad_bytes + optim_bytes) // n
    if strategy.name in ("zero3", "hsdp"):         # hsdp: ZeRO-3 over one node's GPUs
        return (param_bytes + grad_bytes + optim_bytes) // n
    return (param_bytes + grad_bytes + optim_bytes) // 2      # pipeline2: at best half each


def deepspeed_state_floor(param_bytes: int, grad_bytes: int, optim_bytes: int, strategy: Strategy
                      ) -> int:
    """Parameters, gradients and optimizer state (with fp32 master weights in DeepSpeed's
    fp16/bf16 mode) one GPU holds at least, from the traced 16-bit figures."""
    n, stage = strategy.num_gpus, strategy.zero_stage
    ds = strategy.deepspeed
    if strategy.mixed_precision:          # fp32 master weights + the optimizer state in fp32
        optim_bytes = optim_bytes * MASTER_SCALE + param_bytes * MASTER_SCALE
    params = param_bytes // n if stage == 3 else param_bytes
    grads = grad_bytes // n if stage >= 2 else grad_bytes
    optim = optim_bytes // n if stage >= 1 else optim_bytes
    if ds is not None and ds.offload_optimizer:   # master, state and gradient partition: host
        grads, optim = 0, 0
    if ds is not None and ds.offload_param and stage == 3:
        params = 0
    return params + grads + optim
