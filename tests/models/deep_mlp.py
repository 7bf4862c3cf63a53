"""Seven Linear layers in an nn.Sequential: the FSDP reference model (tests/test_fsdp.py)."""
import torch, torch.nn as nn, torch.nn.functional as F
WIDTH = 256
def build_model():
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(6)], nn.Linear(WIDTH, 10))
def make_batch(batch_size):
    return torch.randn(batch_size, WIDTH), torch.randint(0, 10, (batch_size,))
def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
