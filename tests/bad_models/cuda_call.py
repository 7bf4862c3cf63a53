"""A model file written for a GPU machine that makes a tensor on the GPU by hand: the module's
own .cuda() is left to oomdoctor, a tensor's is not."""
import torch


def build_model():
    model = torch.nn.Linear(8, 1).cuda()
    model.register_buffer("scale", torch.ones(8).cuda())
    return model


def make_batch(batch_size):
    return torch.randn(batch_size, 8)


def loss_fn(model, x):
    return (model(x * model.scale)).sum()
