import torch
def make_batch(batch_size):
    return torch.randn(batch_size, 4)
