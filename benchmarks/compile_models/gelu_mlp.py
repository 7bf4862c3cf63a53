"""A residual MLP for benchmarks/bench_compile.py: 4 pre-LayerNorm blocks of
Linear(512, 2048) -> GELU -> Linear(2048, 512) on 512-wide vectors, then a 10-way classifier.
Elementwise-heavy on purpose: LayerNorm, GELU and the residual adds are what Inductor fuses.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

D, HIDDEN, DEPTH, CLASSES = 512, 2048, 4, 10


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(DEPTH)])
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x):
        return self.head(self.blocks(x))


def build_model():
    return Net()


def make_batch(batch_size):
    return torch.randn(batch_size, D), torch.randint(0, CLASSES, (batch_size,))


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
