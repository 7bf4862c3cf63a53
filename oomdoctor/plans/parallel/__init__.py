"""Per-GPU memory of multi-GPU training: DDP, DataParallel, ZeRO-1/2/3 (FSDP), a naive 2-GPU split.

    oomdoctor parallel sample_models/gpt2_small.py --gpus 2 --gpu rtx3090 -b 8 --precision bf16
    oomdoctor split sample_models/llama7b.py --gpus 2 --gpu rtx3090 --precision bf16-pure

Every strategy starts from the single-GPU trace of one rank's micro-batch (:mod:`oomdoctor.sim.trace`)
and rewrites its storage list into the event list each GPU's caching allocator would see, which is
then replayed by :mod:`oomdoctor.sim.allocator`, exactly as :mod:`oomdoctor.plans.estimate` does for one GPU:

- **DDP**: the single-GPU list plus the reducer's gradient buckets (one more copy of the gradients
  unless ``gradient_as_bucket_view=True``), its 250 MiB-chunked parameter broadcast at start-up and
  the buffer broadcast before each forward. DDP never lowers per-GPU memory; it multiplies
  throughput.
- **DataParallel**: GPU 0 holds the optimizer, the whole batch, the gathered outputs and the loss
  over the whole batch; the other GPUs get fresh parameter replicas every forward.
- **ZeRO-1** (PyTorch: DDP + ``ZeroRedundancyOptimizer``): optimizer state and the optimizer's
  temporaries only for the parameters a rank owns (whole parameters, greedy by size, as
  ``ZeroRedundancyOptimizer._partition_parameters`` does). **ZeRO-2**: also the gradients, full
  size while their block's backward runs, then a 1/N shard. **ZeRO-3 / FSDP FULL_SHARD**: also the
  parameters, a 1/N shard at rest, each block all-gathered for its forward and its backward (and
  the next block prefetched). Model states are cross-checked against DeepSpeed's estimators.
- **pipeline2**: the model's blocks, in execution order, split into two contiguous stages on
  cuda:0 and cuda:1 (accelerate's ``dispatch_model``); every storage goes to the stage of the
  block that made it, tensors crossing the cut are copied to the consumer's device, and the cut
  is the one whose larger stage peak is smallest. No micro-batch pipelining: one GPU idles while
  the other computes.

Blocks, parameter ownership, the tensors each block receives and FLOPs per block come from one
extra fake forward + backward (:func:`model_layout`). Backward storages are attributed to blocks
by *windows*: a block's backward is over when its parameters' last gradient is made.

Known limitations:
- NCCL/gloo buffers live outside the caching allocator and are not counted (a few hundred MiB
  per GPU with NCCL); neither are DeepSpeed's own bucket sizes (``reduce_bucket_size``).
- ZeRO-2 keeps the parameters replicated (DeepSpeed's stage 2); PyTorch FSDP's SHARD_GRAD_OP
  additionally keeps a 1/N parameter shard.
- The split assumes the blocks run in one sequence; models that re-enter an earlier block (weight
  sharing across stages) keep the tied blocks on one GPU and pay an extra crossing.

The package, in dependency order:

- :mod:`~oomdoctor.plans.parallel.strategy`: strategy names, aliases, :class:`Strategy`;
- :mod:`~oomdoctor.plans.parallel.passes`: the layout's fake passes with hooks on the blocks;
- :mod:`~oomdoctor.plans.parallel.stack`: a deep stack's passes from the stack cut to 3 and 4;
- :mod:`~oomdoctor.plans.parallel.layout`: the model's blocks, ownership, block inputs, FLOPs;
- :mod:`~oomdoctor.plans.parallel.timeline`: storage sizes at any batch, each block's place in time;
- :mod:`~oomdoctor.plans.parallel.results`: breakdown keys and the records an estimate returns;
- :mod:`~oomdoctor.plans.parallel.events`: per-GPU event lists and the builders' shared context;
- :mod:`~oomdoctor.plans.parallel.data_parallel`: DDP, DataParallel, ZeRO-1/2/3 (FSDP);
- :mod:`~oomdoctor.plans.parallel.deepspeed`: DeepSpeed's ZeRO stages 0-3 and fp16/bf16 mode;
- :mod:`~oomdoctor.plans.parallel.pipeline`: the naive two-GPU split;
- :mod:`~oomdoctor.plans.parallel.model_states`: closed-form model states, DeepSpeed's estimators;
- :mod:`~oomdoctor.plans.parallel.estimator`: one strategy's per-GPU estimate (allocator replay);
- :mod:`~oomdoctor.plans.parallel.report`: the `parallel` and `split` commands' entry points;
- :mod:`~oomdoctor.plans.parallel.scripts`: the same for a training script, and FSDP inside one;
- :mod:`~oomdoctor.plans.parallel.render`: their text output.
"""
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.plans.parallel.data_parallel import (DDP_BROADCAST_BUCKET_BYTES, DDP_BUCKET_BYTES,
                                              DDP_FIRST_BUCKET_BYTES, DP_COALESCE_BYTES,
                                              ddp_buckets, zero_partition)
from oomdoctor.plans.parallel.estimator import (_measure, estimate_strategy, live_peak,
                                          strategy_events)
from oomdoctor.plans.parallel.events import _Context
from oomdoctor.plans.parallel.layout import MAIN, BlockInput, Layout, execution_blocks, model_layout
from oomdoctor.plans.parallel.model_states import (deepspeed_zero2_gpu_bytes,
                                             deepspeed_zero3_gpu_bytes, model_state_floor)
from oomdoctor.plans.parallel.pipeline import _Pipeline
from oomdoctor.plans.parallel.render import render_report, render_split
from oomdoctor.plans.parallel.report import (ParallelReport, Progress, SplitPlan,
                                             estimate_strategies, plan_split)
from oomdoctor.plans.parallel.scripts import (estimate_script_strategies,
                                              estimate_sharded_script, estimate_spread_script,
                                              plan_script_split,
                                              sharded_strategy)
from oomdoctor.plans.parallel.results import BREAKDOWN_KEYS, GpuMemory, Partition, StrategyEstimate
from oomdoctor.plans.parallel.strategy import (ALIASES, DEEPSPEED_STRATEGIES, DESCRIPTIONS,
                                              NODE_STRATEGIES, STRATEGIES, DeepSpeedConfig,
                                              DeepSpeedRun, Strategy, default_policy,
                                              parse_strategy, policy_applies,
                                              read_deepspeed_config, trace_config,
                                              trace_precision)
from oomdoctor.plans.parallel.timeline import Sizes

__all__ = [
    "STRATEGIES", "NODE_STRATEGIES", "ALIASES", "DESCRIPTIONS", "parse_strategy", "Strategy",
    "trace_precision", "trace_config", "default_policy", "policy_applies",
    "DEEPSPEED_STRATEGIES", "DeepSpeedConfig", "DeepSpeedRun", "read_deepspeed_config",
    "MAIN", "BlockInput", "Layout", "execution_blocks", "model_layout",
    "Sizes",
    "BREAKDOWN_KEYS", "GpuMemory", "Partition", "StrategyEstimate",
    "DDP_FIRST_BUCKET_BYTES", "DDP_BUCKET_BYTES", "DDP_BROADCAST_BUCKET_BYTES",
    "DP_COALESCE_BYTES", "ddp_buckets", "zero_partition",
    "deepspeed_zero2_gpu_bytes", "deepspeed_zero3_gpu_bytes", "model_state_floor",
    "strategy_events", "live_peak", "estimate_strategy",
    "Progress", "ParallelReport", "estimate_strategies", "estimate_script_strategies",
    "SplitPlan", "plan_split", "plan_script_split", "estimate_sharded_script",
    "estimate_spread_script",
    "sharded_strategy",
    "render_report", "render_split",
    # used as par.X by the tests
    "AllocatorConfig", "_Context", "_Pipeline", "_measure",
]
