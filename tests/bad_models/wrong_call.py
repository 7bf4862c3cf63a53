"""forward takes three inputs, make_batch returns two tensors and there is no loss_fn."""
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, x, y, weight):
        return ((self.fc(x) - y) ** 2 * weight).mean()


def build_model():
    return Net()


def make_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 1)
