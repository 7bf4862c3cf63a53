"""A small token-wise MLP for LoRA/QLoRA checks: 640 tokens per batch of 20 (past the 512 rows
where bitsandbytes' CUDA build dequantizes a 4-bit weight for the matmul)."""
import torch
from torch import nn


class TokenMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.mid = nn.Linear(256, 256)
        self.norm = nn.LayerNorm(256)
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(x))
        return self.head(self.norm(torch.nn.functional.gelu(self.mid(h))))


def build_model():
    return TokenMLP()


def make_batch(batch_size):
    return torch.randn(batch_size, 32, 64), torch.randint(0, 10, (batch_size, 32))


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-4, foreach=False)
