"""A small decoder LM (4 pre-norm blocks of SDPA attention + MLP, width 512, 256 tokens, vocab
8192; 21.0M parameters) whose step is a few hundred MiB: large enough that a plan's per-GPU
figure is its model states and activations, not the CUDA context, and quick to trace. The model
the printed plans are run on (tests/test_plan_scripts.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 8192, 256, 512, 8, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):  # (B, SEQ, WIDTH)
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, c // HEADS).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class PlanLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):  # (B, SEQ) int64
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))


def build_model():
    return PlanLM()


def make_batch(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),
            torch.randint(0, VOCAB, (batch_size, SEQ)))


def loss_fn(model, batch):
    ids, targets = batch
    return F.cross_entropy(model(ids).flatten(0, 1).float(), targets.flatten())
