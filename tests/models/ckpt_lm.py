"""A tiny pre-norm attention LM (4 blocks of width 64, 4 heads, sequence 32) for the
checkpointing granularity tests (tests/test_checkpoint_granularity.py): bias-free projections
(aten.mm, the ops torchtitan's per-op policy counts), a biased MLP layer (addmm), SDPA and
LayerNorm, so that every-N-th and per-op checkpointing each keep something different."""
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 256   # token ids
SEQ = 32      # tokens per sequence
WIDTH = 64    # model width
HEADS = 4     # attention heads
LAYERS = 4    # repeated blocks (the tests write a deeper copy for the repeated-stack cut)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x):  # x: (B, SEQ, WIDTH)
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, c // HEADS).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)  # (B, H, T, D)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):  # ids: (B, SEQ) int64
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)  # (B, SEQ, VOCAB) logits


def build_model():
    return LM()


def make_batch(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),
            torch.randint(0, VOCAB, (batch_size, SEQ)))


def loss_fn(model, batch):
    ids, targets = batch
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
