"""A bigram-style language model whose peak is its loss (2048 tokens, a 4096-word vocabulary,
width 64: embedding, LayerNorm, output projection), compiled with ``torch.compile``. Eager, the
log-softmax backward holds two more logit-sized tensors at the peak; compiled, Inductor fuses
the cross-entropy backward. Small enough for Inductor to compile in seconds on the CPU
(tests/test_compile.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, T = 4096, 64, 256


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets):
        logits = self.head(self.ln(self.wte(idx)))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def build_model():
    return torch.compile(LM())


def make_batch(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, T)), torch.randint(0, VOCAB, (batch_size, T)))
