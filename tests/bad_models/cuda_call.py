"""A model file written for a GPU machine: it moves the model to CUDA itself."""
import torch


def build_model():
    return torch.nn.Linear(8, 1).cuda()


def make_batch(batch_size):
    return torch.randn(batch_size, 8)


def loss_fn(model, x):
    return model(x).sum()
