"""Recommend a configuration: precision x checkpointing x strategy x micro-batch x accumulation.

    oomdoctor recommend sample_models/gpt2_small.py --gpu rtx3090 --num-gpus 2 --target-batch 256

For the effective batch the user wants (``micro-batch x accumulation x data-parallel ranks``),
every combination is checked against the card's budget with :mod:`oomdoctor.plans.parallel` (two traces
per precision x checkpointing, every storage extrapolated to any batch, the allocator replayed per
GPU), what does not fit is dropped, and the rest is ranked by estimated step time:

- compute: the step's FLOPs (``torch.utils.flop_counter`` on the fake forward + backward) over the
  card's datasheet throughput for the precision at :data:`COMPUTE_EFFICIENCY`, +1/3 with
  activation checkpointing (the forward runs twice);
- communication: gradient / parameter bytes over the GPU link (NVLink, PCIe with P2P, or PCIe
  without P2P where NCCL stages through host memory), overlapped with the backward where the
  strategy allows it;
- numerics: configurations that keep fp32 master weights (fp32, AMP) are preferred over pure bf16.

Before tracing, a lower bound - parameters + gradients + optimizer state per GPU - rules out what
cannot fit whatever the batch, so a 7B model on two 24 GiB cards costs no traces at all; the
report then says what would fit (more GPUs, a lighter optimizer, CPU offload, adapters).

Known limitations: times are for ranking, not promises (one efficiency for every kernel, no data
loading, no optimizer-step time); NCCL buffers and DeepSpeed's own buckets are not counted.

The package, in dependency order:

- :mod:`~oomdoctor.plans.recommend.machine`: the GPUs, their count and link (:class:`Hardware`);
- :mod:`~oomdoctor.plans.recommend.cost`: the step-time model;
- :mod:`~oomdoctor.plans.recommend.internode`: the step time across nodes (ring collectives);
- :mod:`~oomdoctor.plans.recommend.facts`: model facts for the lower bound, the bound itself;
- :mod:`~oomdoctor.plans.recommend.records`: candidates, floors, the launch, the recommendation;
- :mod:`~oomdoctor.plans.recommend.node_launch`: per-node torchrun lines and a SLURM script;
- :mod:`~oomdoctor.plans.recommend.launch`: the launch line, code snippet and quality notes;
- :mod:`~oomdoctor.plans.recommend.offload`: CPU offload plans (GPU, host RAM, rough slowdown);
- :mod:`~oomdoctor.plans.recommend.sharing`: N trainings on the same GPUs, three ways compared;
- :mod:`~oomdoctor.plans.recommend.render`: the text report;
- :mod:`~oomdoctor.plans.recommend.search`: the search and ranking (:func:`recommend`);
  :mod:`~oomdoctor.plans.recommend.config_search` one configuration's search;
  :mod:`~oomdoctor.plans.recommend.script` a training script's plan.
"""
from oomdoctor.plans.recommend.cost import (BACKWARD_SHARE, CHECKPOINT_RECOMPUTE, COMPUTE_EFFICIENCY,
                                      StepTime, step_time, throughput)
from oomdoctor.plans.recommend.facts import _Facts, floor_bytes, model_facts, tensor_parallel_bytes
from oomdoctor.plans.recommend.internode import (node_step_time, ring_allreduce_bytes,
                                           ring_allreduce_seconds)
from oomdoctor.plans.recommend.launch import _launch, quality_notes, snippet
from oomdoctor.plans.recommend.machine import (INTER_NODE_GBPS, LINKS, Hardware, default_link,
                                         detect_hardware, hardware, link_gbps)
from oomdoctor.plans.recommend.node_launch import sbatch_script, torchrun_lines
from oomdoctor.plans.recommend.offload import (local_host_ram, offload_plans, zero2_offload_bytes,
                                         zero3_offload_bytes)
from oomdoctor.plans.recommend.records import (Candidate, Floor, Launch, OffloadPlan, Recommendation,
                                         TensorParallelPlan)
from oomdoctor.plans.recommend.render import render_text
from oomdoctor.plans.recommend.config_search import NUMERICS, NUMERICS_PENALTY
from oomdoctor.plans.recommend.search import LAUNCH_ALLOCATOR, SIMPLICITY, Progress, recommend

__all__ = [
    "LAUNCH_ALLOCATOR",
    "LINKS", "INTER_NODE_GBPS", "Hardware", "default_link", "link_gbps", "hardware",
    "detect_hardware",
    "COMPUTE_EFFICIENCY", "CHECKPOINT_RECOMPUTE", "BACKWARD_SHARE", "StepTime", "throughput",
    "step_time", "node_step_time", "ring_allreduce_bytes", "ring_allreduce_seconds",
    "torchrun_lines", "sbatch_script",
    "offload_plans", "zero2_offload_bytes", "zero3_offload_bytes", "local_host_ram",
    "OffloadPlan", "TensorParallelPlan", "tensor_parallel_bytes",
    "model_facts", "floor_bytes",
    "Candidate", "Floor", "Launch", "Recommendation",
    "NUMERICS", "SIMPLICITY", "NUMERICS_PENALTY", "Progress", "recommend",
    "snippet", "quality_notes",
    "render_text",
    # used as rec.X by the tests
    "_Facts", "_launch",
]
