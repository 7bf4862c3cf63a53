"""Step-time model: the step's FLOPs over the card's throughput, plus communication not hidden."""
from __future__ import annotations

from dataclasses import dataclass

from oomdoctor.sim.gpus import GpuProfile
from oomdoctor.plans.parallel import Layout, Strategy
from oomdoctor.plans.recommend.machine import Hardware
from oomdoctor.sim.trace import Trace


# Share of the datasheet peak that eager PyTorch training reaches on matmul-heavy models (model
# FLOPs utilisation is typically 30-50% without fused kernels); one number for every kernel, so
# the ranking of compute against communication is only indicative.
COMPUTE_EFFICIENCY = 0.4
CHECKPOINT_RECOMPUTE = 1 / 3      # the forward is about a third of forward + backward
# A 4-bit matmul over many tokens first dequantizes the whole weight (bitsandbytes: read half a
# byte per parameter, write the 16-bit copy the dense matmul then reads as a LoRA base's would):
# 2.5 bytes per parameter more, once in the forward, once for the input gradient, and once more
# when checkpointing recomputes the forward. Memory-bound, at this share of the datasheet
# bandwidth (elementwise kernels reach 60-80% of it).
DEQUANT_BYTES_PER_PARAM = 2.5
MEMORY_EFFICIENCY = 0.7
BACKWARD_SHARE = 2 / 3            # what an all-reduce can hide behind


@dataclass(frozen=True)
class StepTime:
    seconds: float
    compute_seconds: float
    communication_seconds: float      # not hidden behind compute
    # Bytes each GPU sends per optimizer step, hidden or not: the tie-break when compute hides
    # every strategy's communication (ZeRO-3 then moves 1.5x DDP's volume per micro-batch for
    # the same step time - more link contention, more NCCL buffers, for nothing).
    traffic_bytes: int = 0


def throughput(gpu: GpuProfile, precision: str) -> float:
    """FLOP/s one GPU sustains: fp32 matmuls run without TF32 by default in PyTorch
    (torch.backends.cuda.matmul.allow_tf32 is False since 1.12), 16-bit ones on tensor cores."""
    peak = gpu.tflops_fp32 if precision == "fp32" else gpu.tflops_16
    return max(peak, 1e-3) * 1e12 * COMPUTE_EFFICIENCY


def compute_seconds(flops: float, gpu: GpuProfile, precision: str) -> float:
    """Seconds of GPU compute for ``flops`` at the step-time model's sustained rate: the one
    figure recommend ranks plans by and a script's input-pipeline check compares its data
    loading with (oomdoctor.runs.input_pipeline)."""
    return flops / throughput(gpu, precision)


def dequant_seconds(layout: Layout, gpu: GpuProfile, checkpointing: bool) -> float:
    """Seconds per micro-batch spent dequantizing 4-bit weights (none without them)."""
    passes = 3 if checkpointing else 2
    return (layout.dequantized_params * DEQUANT_BYTES_PER_PARAM * passes
            / (gpu.memory_bytes_per_second * MEMORY_EFFICIENCY))


def step_time(layout: Layout, trace: Trace, strategy: Strategy, hw: Hardware, precision: str,
              checkpointing: bool, micro_batch: int, grad_accum: int,
              boundary_bytes: int = 0) -> StepTime:
    """Seconds per optimizer step (``micro_batch x grad_accum x data-parallel ranks`` samples)."""
    flops = layout.flops_per_sample * micro_batch * (1 + CHECKPOINT_RECOMPUTE * checkpointing)
    t_micro = compute_seconds(flops, hw.gpu, precision) \
        + dequant_seconds(layout, hw.gpu, checkpointing)
    bw = hw.link_gbps * 1e9
    n = strategy.num_gpus
    grads = trace.gradient_bytes
    params = trace.parameter_bytes
    ring = (n - 1) / n if n > 1 else 0.0
    compute = grad_accum * t_micro
    comm = 0.0
    traffic = 0.0
    name = strategy.name
    if name == "ddp":
        # Bucketed all-reduce (2(n-1)/n of the gradients per GPU) overlaps the last backward;
        # earlier micro-batches run under no_sync.
        traffic = 2 * ring * grads
        comm = max(0.0, traffic / bw - BACKWARD_SHARE * t_micro)
    elif name == "zero1":
        traffic = 2 * ring * grads + ring * params
        comm = max(0.0, 2 * ring * grads / bw - BACKWARD_SHARE * t_micro) + ring * params / bw
    elif name == "zero2":
        # Gradients reduce-scattered every micro-batch (sharded gradients cannot wait), updated
        # parameters all-gathered once per step.
        traffic = grad_accum * ring * grads + ring * params
        comm = grad_accum * max(0.0, ring * grads / bw - BACKWARD_SHARE * t_micro) \
            + ring * params / bw
    elif name == "zero3":
        # Parameters all-gathered for forward and backward, gradients reduce-scattered: 3x the
        # parameter volume per micro-batch (ZeRO paper, 1.5x DDP), prefetched behind compute.
        traffic = grad_accum * 3 * ring * params
        comm = grad_accum * max(0.0, 3 * ring * params / bw - t_micro)
    elif name == "dp":
        # Replicas broadcast from GPU 0 and gradients reduced onto it every micro-batch, from one
        # Python thread per GPU; nothing overlaps.
        traffic = grad_accum * (n - 1) * (params + grads)
        comm = traffic / bw
    elif name == "pipeline2":
        # Activations forward and their gradients back across the cut, each micro-batch.
        traffic = grad_accum * 2 * boundary_bytes
        comm = traffic / bw
    return StepTime(compute + comm, compute, comm, round(traffic))
