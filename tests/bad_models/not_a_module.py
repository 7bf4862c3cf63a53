import torch
def build_model():
    return "a string, not a model"
def make_batch(batch_size):
    return torch.randn(batch_size, 4)
