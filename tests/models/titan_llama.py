"""torchtitan's Llama, rebuilt as an oomdoctor model file, for the published torchtitan runs
(tests/test_published_multi.py). Written from torchtitan's ``torchtitan/models/llama/model.py``
(pytorch/torchtitan, 2024): RMSNorm computed in fp32 and cast back, rotary embeddings as complex
multiplication on an fp32 copy of q and k, grouped keys and values repeated to every head,
``F.scaled_dot_product_attention(is_causal=True)``, SwiGLU feed-forward, untied output layer,
and the loss on the flattened logits.

The dimensions come from the environment so one file serves every published row:
TITAN_DIM, TITAN_LAYERS, TITAN_HEADS, TITAN_KV_HEADS, TITAN_FFN, TITAN_VOCAB, TITAN_SEQ, and
TITAN_LOSS_FP32=1 for the releases whose logits are upcast (``self.output(h).float()``), and
TITAN_HOLD_PRED=1 for the training loops that keep ``pred`` through the backward (torchtitan's
``pred = model(input_ids); loss = F.cross_entropy(...)`` until it added ``del pred`` in 2024).
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


DIM = _env("TITAN_DIM", 256)
LAYERS = _env("TITAN_LAYERS", 4)
HEADS = _env("TITAN_HEADS", 8)
KV_HEADS = _env("TITAN_KV_HEADS", HEADS)
FFN = _env("TITAN_FFN", 688)
VOCAB = _env("TITAN_VOCAB", 512)
SEQ = _env("TITAN_SEQ", 128)
LOSS_FP32 = os.environ.get("TITAN_LOSS_FP32") == "1"
HOLD_PRED = os.environ.get("TITAN_HOLD_PRED") == "1"
_PRED: list = []            # train.py's `pred`: rebound only when the next forward returns


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def _rotary(x, freqs):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs).flatten(3)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x, freqs):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, HEADS, self.head_dim)
        k = self.wk(x).view(b, s, KV_HEADS, self.head_dim)
        v = self.wv(x).view(b, s, KV_HEADS, self.head_dim)
        q, k = _rotary(q, freqs), _rotary(k, freqs)
        if KV_HEADS != HEADS:
            rep = HEADS // KV_HEADS
            k = k[:, :, :, None, :].expand(b, s, KV_HEADS, rep, self.head_dim).reshape(
                b, s, HEADS, self.head_dim)
            v = v[:, :, :, None, :].expand(b, s, KV_HEADS, rep, self.head_dim).reshape(
                b, s, HEADS, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = RMSNorm(DIM)
        self.ffn_norm = RMSNorm(DIM)

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        half = DIM // HEADS // 2
        inv = 1.0 / (10000.0 ** (torch.arange(0, half).float() / half))
        angles = torch.outer(torch.arange(SEQ * 2).float(), inv)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        freqs = self.freqs_cis[:s].view(1, s, 1, -1)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h))


def build_model():
    return Transformer()


def make_batch(batch_size):
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ))
    return tokens, torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(model, batch):
    tokens, labels = batch
    pred = model(tokens)
    if LOSS_FP32:
        pred = pred.float()
    if HOLD_PRED:
        _PRED[:] = [pred]
    return F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
