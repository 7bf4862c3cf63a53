"""Independent reference for FSDP2: rank 0 of a real ``fully_shard`` run on the CPU, measured by
torch.profiler (tests/test_fsdp.py).

The process group is torch's fake backend (``torch.testing._internal.distributed.fake_pg``):
collectives return at once and move no data, so every allocation is FSDP2's own, made on the
calling thread in program order, as NCCL does them in place on a GPU. (Over gloo, gloo's worker
threads copy full-size buffers at times that vary from run to run: tests/test_parallel.py.)
Run as ``python fsdp_reference.py MODEL_FILE fp32|policy BATCH``; prints the peak as JSON.
"""
from __future__ import annotations

import json
import sys

import torch

from reference import allocator_peak, load

WORLD = 2
# The CPU's bf16 addmm/mm allocate packing scratch inside the call that CUDA's cuBLAS does not:
# its inputs and outputs are what the trace sees (reference.allocator_peak's ``opaque``).
BF16_SCRATCH = ("aten::addmm", "aten::mm")


def _units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """What ``fully_shard`` wraps before the root, as torchtitan and oomdoctor's plan code do:
    each of the model's repeated blocks (the rest - embedding, head - is the root's)."""
    return list(model.blocks) if hasattr(model, "blocks") else list(model.children())


def peak(path: str, mode: str, batch_size: int) -> dict:
    """Rank 0's peak bytes over two AdamW steps, sharded parameters included. ``policy``:
    MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), the frozen parameters
    loaded in bf16 (as a LoRA base is) and the trainable ones fp32."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    mod = load(path)
    torch.manual_seed(0)
    model = mod.build_model().train()
    policy = mode == "policy"
    if policy:
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if policy else MixedPrecisionPolicy()
    mesh = init_device_mesh("cpu", (WORLD,))
    for unit in _units(model):
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    sharded = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())

    scratch = BF16_SCRATCH if policy else ()
    return {"peak": sharded + allocator_peak(two_steps(model, mod, batch_size), scratch),
            "sharded": sharded}


def two_steps(model: torch.nn.Module, mod, batch_size: int):
    """The measured run: two AdamW steps over the trainable parameters, as the model file's loop
    (tests/fsdp1_reference.py runs the same)."""
    def run() -> None:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        for step in range(2):
            torch.manual_seed(step)
            batch = mod.make_batch(batch_size)
            loss = mod.loss_fn(model, batch)
            loss.backward()
            del loss, batch
            opt.step()
            opt.zero_grad(set_to_none=True)
    return run


if __name__ == "__main__":
    print(json.dumps(peak(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
