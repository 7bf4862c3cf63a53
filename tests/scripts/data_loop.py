"""A training loop whose data comes through a DataLoader, fast or slow on purpose.

    python tests/scripts/data_loop.py --delay-ms 1.5     # each sample takes 1.5 ms to "decode"
    python tests/scripts/data_loop.py --in-memory        # a TensorDataset: no work per sample

The slow dataset sleeps in ``__getitem__`` the way a dataset that reads and decodes files from
disk waits on I/O; ``--workers`` is the DataLoader's num_workers.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset


class SlowDataset(Dataset):
    def __init__(self, samples, width, delay):
        self.samples, self.width, self.delay = samples, width, delay

    def __len__(self):
        return self.samples

    def __getitem__(self, i):
        time.sleep(self.delay)
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.width, generator=g), i % 10


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4)           # hidden width / width
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--delay-ms", type=float, default=1.5)
    parser.add_argument("--in-memory", action="store_true")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--log-every-step", action="store_true")     # loss.item() each step
    args = parser.parse_args()

    if args.in_memory:
        data = TensorDataset(torch.randn(args.samples, args.width),
                             torch.randint(0, 10, (args.samples,)))
    else:
        data = SlowDataset(args.samples, args.width, args.delay_ms / 1e3)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.workers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w = args.width
    h = args.hidden * w
    model = nn.Sequential(nn.Linear(w, h), nn.GELU(), nn.Linear(h, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.log_every_step:
            print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
