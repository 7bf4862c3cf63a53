"""An MLP whose Adam steps inside backward, one optimizer per parameter stepped from
``register_post_accumulate_grad_hook`` (pytorch/tutorials optimizer_step_in_backward_tutorial)."""
import torch
from torch import nn


def build_model():
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
    opts = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    return model


def make_batch(batch_size):
    return torch.randn(batch_size, 512)


def loss_fn(model, batch):
    return model(batch).sum()


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.0)   # the real steps run in the hooks
