"""A LoRA-shaped stack (frozen base Linears, trainable low-rank pairs, frozen embedding,
trainable head) for FSDP1 under reentrant checkpointing (tests/test_fsdp1.py): ``REENTRANT``
set, each block runs in ``checkpoint(..., use_reentrant=True)`` over an input made to require
grad, as transformers' ``gradient_checkpointing_enable()`` and ``enable_input_require_grads()``
do (tests/fsdp1_reference.py sets it; oomdoctor traces the plain model with --checkpointing)."""
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
WIDTH, RANK, VOCAB, SEQ = 256, 8, 64, 16
REENTRANT = False
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(WIDTH, 2 * WIDTH)
        self.out = nn.Linear(2 * WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, RANK, bias=False)
        self.up = nn.Linear(RANK, 2 * WIDTH, bias=False)
        self.base.requires_grad_(False)
        self.out.requires_grad_(False)
    def forward(self, x):
        return x + self.out(torch.relu(self.base(x) + self.up(self.down(x))))
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(6))
        self.head = nn.Linear(WIDTH, VOCAB)
    def forward(self, ids):
        x = self.embed(ids)
        if REENTRANT:
            x.requires_grad_(True)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=True) if REENTRANT else b(x)
        return self.head(x)
def build_model():
    return Net()
def make_batch(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)), torch.randint(0, VOCAB, (batch_size, SEQ)))
def loss_fn(model, batch):
    ids, y = batch
    return F.cross_entropy(model(ids).flatten(0, 1), y.flatten())
def make_optimizer(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-4)
