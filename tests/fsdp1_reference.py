"""Independent reference for FSDP1: rank 0 of a real ``FullyShardedDataParallel`` run on the CPU
over torch's fake process group (as tests/fsdp_reference.py does for FSDP2), measured by
torch.profiler (tests/test_fsdp1.py). The wrapping is fms-acceleration's (accelerate's FSDP
plugin with peft's ``fsdp_auto_wrap_policy``): each block one unit, each trainable leaf module
(the adapters) its own unit, the rest the root's; FULL_SHARD, use_orig_params=True,
BACKWARD_PRE, limit_all_gathers; blocks checkpointed reentrantly around the FSDP units.
Run as ``python fsdp1_reference.py MODEL_FILE BATCH``; prints the peak as JSON."""
from __future__ import annotations

import functools
import json
import sys

import torch

from fsdp_reference import two_steps
from reference import allocator_peak, load

WORLD = 2


def peak(path: str, batch_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    mod = load(path)
    mod.REENTRANT = True
    torch.manual_seed(0)
    model = mod.build_model().train()

    def trainable_leaf(m):        # peft.utils.other.fsdp_auto_wrap_policy's lambda_policy_fn
        return (not list(m.named_children()) and getattr(m, "weight", None) is not None
                and m.weight.requires_grad)
    policy = functools.partial(_or_policy, policies=[
        functools.partial(lambda_auto_wrap_policy, lambda_fn=trainable_leaf),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={mod.Block})])
    model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE, use_orig_params=True,
                 device_id=torch.device("cpu"), limit_all_gathers=True)
    # use_orig_params: the parameters are views into their unit's sharded flat parameter
    sharded = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                   for p in model.parameters()}.values())

    return {"peak": sharded + allocator_peak(two_steps(model, mod, batch_size), ()),
            "sharded": sharded}


if __name__ == "__main__":
    print(json.dumps(peak(sys.argv[1], int(sys.argv[2]))))
