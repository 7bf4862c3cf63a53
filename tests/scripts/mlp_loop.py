"""A plain PyTorch training loop, written as users write them: the tiny_mlp sample model's
network, data from a TensorDataset, cross-entropy, AdamW. oomdoctor runs it as it is:

    oomdoctor estimate -- python tests/scripts/mlp_loop.py --batch-size 64
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 512)
        self.fc2 = nn.Linear(512, 512)
        self.fc3 = nn.Linear(512, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none")
    parser.add_argument("--samples", type=int, default=1024)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = TensorDataset(torch.randn(args.samples, 256), torch.randint(0, 10, (args.samples,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model = MLP().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp == "fp16")
    for epoch in range(args.epochs):
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if step % 10 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
