"""Blocks of a frozen base Linear plus a trainable low-rank pair (a LoRA-shaped model written by
hand), a frozen embedding and a trainable head: what FSDP does with frozen parameters
(tests/test_fsdp.py)."""
import torch, torch.nn as nn, torch.nn.functional as F
WIDTH, RANK, VOCAB = 256, 8, 64
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, RANK, bias=False)
        self.up = nn.Linear(RANK, WIDTH, bias=False)
        self.base.requires_grad_(False)
    def forward(self, x):
        return torch.relu(self.base(x) + self.up(self.down(x)))
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(5))
        self.head = nn.Linear(WIDTH, VOCAB)
    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)
def build_model():
    return Net()
def make_batch(batch_size):
    return torch.randint(0, VOCAB, (batch_size, 16)), torch.randint(0, VOCAB, (batch_size, 16))
def loss_fn(model, batch):
    ids, y = batch
    return F.cross_entropy(model(ids).flatten(0, 1), y.flatten())
def make_optimizer(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-4)
