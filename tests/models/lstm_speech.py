"""A speech-style acoustic model: 3-layer LSTM(80 -> 512) over 400 frames of 80 filterbanks,
a per-frame classifier over 30 symbols (issue #10's slow case: benchmarks/bench_rnn.py)."""
import torch
import torch.nn as nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(80, 512, num_layers=3, batch_first=True)
        self.fc = nn.Linear(512, 30)

    def forward(self, x):
        return self.fc(self.rnn(x)[0])


def build_model():
    return M()


def make_batch(b):
    return torch.randn(b, 400, 80), torch.randint(0, 30, (b, 400))


def loss_fn(m, batch):
    x, y = batch
    out = m(x)
    return nn.functional.cross_entropy(out.reshape(-1, 30), y.reshape(-1))
