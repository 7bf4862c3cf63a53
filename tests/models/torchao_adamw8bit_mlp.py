import torch, torch.nn as nn, torch.nn.functional as F
from torchao.optim import AdamW8bit
def build_model():
    return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.GELU(), nn.Linear(512, 10))
def make_batch(b):
    return torch.randn(b, 512), torch.randint(0, 10, (b,))
def loss_fn(m, batch):
    x, y = batch
    return F.cross_entropy(m(x), y)
def make_optimizer(params):
    return AdamW8bit(params, lr=1e-3)
