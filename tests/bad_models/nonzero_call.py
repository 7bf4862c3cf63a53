# Boolean-mask indexing: the output shape depends on the data.
import torch
import torch.nn as nn

def build_model():
    return nn.Linear(4, 4)

def make_batch(batch_size):
    return torch.randn(batch_size, 4)

def loss_fn(model, x):
    y = model(x)
    return y[y > 0].sum()
