import torch
def build_model():
    return torch.nn.Linear(4, 1)
def make_batch(batch_size):
    return [1, 2, 3]
