"""A bidirectional 2-layer GRU over variable-length sequences (PackedSequence with unsorted
lengths, padded back for a per-frame classifier): tests/test_rnn.py's packed case."""
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(16, 32, num_layers=2, bidirectional=True)
        self.fc = nn.Linear(64, 10)

    def forward(self, x, lengths):
        out, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        out, _ = pad_packed_sequence(out, total_length=x.shape[0])
        return self.fc(out)


def build_model():
    return M()


def make_batch(b):
    # lengths 20, 19, 18, ...: sum over the batch is what cuDNN works on
    return torch.randn(20, b, 16), 20 - torch.arange(b) % 10, torch.randint(0, 10, (20, b))


def loss_fn(m, batch):
    x, lengths, y = batch
    return nn.functional.cross_entropy(m(x, lengths).reshape(-1, 10), y.reshape(-1))
