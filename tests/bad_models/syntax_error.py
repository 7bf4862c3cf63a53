import torch
def build_model(:
    return torch.nn.Linear(4, 4)
