"""A tiny pre-norm transformer (2 blocks of width 64, sequence 32): a model with named,
repeated blocks whose activations are live at the peak, small enough for a snapshot test to
trace in about a second (tests/test_snapshot.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 512   # token ids
SEQ = 32      # tokens per sequence
WIDTH = 64    # model width
LAYERS = 2    # repeated blocks


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):  # x: (B, SEQ, WIDTH)
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):  # ids: (B, SEQ) int64
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)  # (B, SEQ, VOCAB) logits


def build_model():
    return TinyLM()


def make_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ))
    return ids, torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(model, batch):
    ids, targets = batch
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
