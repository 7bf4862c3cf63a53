"""A DistributedDataParallel training loop around one of oomdoctor's sample models, launched the
usual way:

    torchrun --nproc_per_node 2 tests/scripts/ddp_loop.py --model sample_models/gpt2_small.py

Each rank: its GPU from LOCAL_RANK, the NCCL process group, the model wrapped in DDP, AMP, and
the loop of tests/scripts/loop.py.
"""
import argparse
import importlib.util
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def load(path):
    spec = importlib.util.spec_from_file_location("user_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none")
    parser.add_argument("--bucket-view", action="store_true")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    m = load(args.model)
    model = DDP(m.build_model().cuda(), device_ids=[local_rank],
                gradient_as_bucket_view=args.bucket_view)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    for step in range(100):
        batch = m.make_batch(args.batch_size)
        batch = {k: v.cuda() for k, v in batch.items()} if isinstance(batch, dict) else \
            tuple(t.cuda() for t in batch)
        with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
            if hasattr(m, "loss_fn"):
                loss = m.loss_fn(model, batch)
            else:
                out = model(**batch) if isinstance(batch, dict) else model(*batch)
                loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        del batch, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
