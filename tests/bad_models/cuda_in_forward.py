"""A model that makes a tensor on the GPU inside forward, as scripts written for one GPU do."""
import torch


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        scale = torch.ones(8).cuda()
        return self.fc(x) * scale


def build_model():
    return Scaled()


def make_batch(batch_size):
    return torch.randn(batch_size, 8)


def loss_fn(model, batch):
    return model(batch).pow(2).mean()
