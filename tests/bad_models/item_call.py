# A model whose forward branches on a tensor's value: a fake-tensor trace cannot follow it.
import torch
import torch.nn as nn

class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:      # data-dependent
            y = y * 2
        return y.pow(2).mean()

def build_model():
    return Gate()

def make_batch(batch_size):
    return torch.randn(batch_size, 4)
