"""A training loop that shards its model with FSDP itself, as torchtitan-style scripts do: every
block of the model file's stack, then the model, with fully_shard (FSDP2), or the model in
FullyShardedDataParallel with a per-block wrap policy (FSDP1); optional bf16 policy, no
resharding after forward, a 2-D mesh (HSDP) and CPU offload.

    torchrun --nproc_per_node 2 tests/scripts/fsdp_loop.py --model tests/models/plan_lm.py
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from loop import load             # the sibling loop's model-file loader (this folder)


def shard(model, args):
    if args.fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if args.policy else None
        block = type(model.layers[0])
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({block}),
                                        mixed_precision=mp, use_orig_params=True,
                                        device_id=torch.cuda.current_device())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    kw = {"reshard_after_forward": not args.no_reshard}
    if args.policy:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if args.mesh:
        kw["mesh"] = init_device_mesh("cuda", tuple(map(int, args.mesh.split(","))),
                                      mesh_dim_names=("replicate", "shard"))
    if args.offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--fsdp", type=int, choices=[1, 2], default=2)
    parser.add_argument("--policy", action="store_true")
    parser.add_argument("--no-reshard", action="store_true")
    parser.add_argument("--mesh", default="")
    parser.add_argument("--offload", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    m = load(args.model)
    model = shard(m.build_model(), args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = TensorDataset(*m.make_batch(8 * args.batch_size))
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(data))
    for batch in loader:
        loss = m.loss_fn(model, [t.cuda() for t in batch])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
