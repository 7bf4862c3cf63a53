"""A tiny decoder whose forward asks a data-dependent question, the way transformers does.

``if attention_mask.all()`` (transformers' ``_ignore_causal_mask_sdpa``): without padding it
calls ``scaled_dot_product_attention(is_causal=True)`` and never builds a mask; with padding it
materialises a (B, 1, T, T) boolean mask from the padding and causal masks. The two branches
differ in memory, so a trace must take the one the real batch takes. ``PADDED`` picks the batch.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

T, D, H, V = 64, 64, 4, 500   # tokens, width, heads, vocabulary
PADDED = False  # the tests flip this to make every batch end in 16 pad tokens


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, D))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, input_ids, attention_mask, labels):
        mask = None
        if not attention_mask.all():              # the data-dependent question
            t = input_ids.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
            mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        x = self.emb(input_ids)
        for blk in self.blocks:
            x = blk(x, mask)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, V), labels.view(-1))


def build_model():
    return Decoder()


def make_batch(batch_size):
    ids = torch.randint(0, V, (batch_size, T))
    mask = torch.ones(batch_size, T, dtype=torch.long)
    if PADDED:
        mask[:, -16:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}
