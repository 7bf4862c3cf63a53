"""tiny_mlp's shape trained with ``torch.optim.AdamW(fused=True)``, the fastest AdamW on CUDA.

The fused kernel updates parameters and both moments in place and allocates nothing
(``_fused_adamw_``); its ``step`` counters live on the device. ``OPTIMIZER`` lets the tests
build the same model with another AdamW implementation.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

OPTIMIZER = {"fused": True}


def build_model():
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def make_batch(batch_size):
    return torch.randn(batch_size, 256), torch.randint(0, 10, (batch_size,))


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, **OPTIMIZER)
