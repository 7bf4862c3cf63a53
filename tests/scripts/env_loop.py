"""A training script written the way nanoGPT's train.py and many public scripts are: it runs
DDP when a launcher set RANK (``ddp = int(os.environ.get("RANK", -1)) != -1``) and plain
single-GPU training otherwise, accumulates gradients over micro-batches, and draws its batches
from a DataLoader over a fixed-size dataset with ``drop_last=True``.

    python tests/scripts/env_loop.py --accum 4 --batch-size 8
    torchrun --nproc_per_node 2 tests/scripts/env_loop.py --accum 4 --batch-size 8
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none")
    parser.add_argument("--local_rank", type=int, default=-1)   # DeepSpeed's launcher passes it
    args = parser.parse_args()

    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        dist.init_process_group("nccl")
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    w = args.width
    model = nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, 4 * w), nn.GELU(),
                          nn.Linear(4 * w, 10)).to(device)
    if ddp:
        model = DDP(model, device_ids=[int(os.environ["LOCAL_RANK"])])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(args.samples, w), torch.randint(0, 10, (args.samples,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    for epoch in range(2):
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
                loss = F.cross_entropy(model(x), y) / args.accum
            loss.backward()
            if (i + 1) % args.accum == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
