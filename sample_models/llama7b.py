"""oomdoctor probe sample_models/llama7b.py --gpu rtx3090

A LLaMA-7B-shaped decoder: 32 pre-RMSNorm blocks of rotary-embedded causal
self-attention and a SwiGLU MLP, no biases anywhere, an untied lm_head,
context 2048. About 6.74B parameters: the fp32 weights alone are ~25 GiB, and
weights + grads + AdamW state ~100 GiB, so a full fine-tune cannot fit on one
24 GiB card -- that is the point of this sample.

Build it only under oomdoctor's fake-tensor context (or on the meta device):
constructing it for real allocates those ~25 GiB. Nothing runs at import.

Parameters: 6,738,415,616 (the published LLaMA-7B count).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

N_LAYER = 32  # transformer blocks
N_HEAD = 32  # attention heads per block (no grouped-query attention)
N_EMBD = 4096  # residual stream width
HEAD_DIM = N_EMBD // N_HEAD  # 128, width of one head
INTERMEDIATE = 11008  # SwiGLU inner width (~ 8/3 * 4096, rounded up to a multiple of 256)
VOCAB_SIZE = 32000  # SentencePiece vocabulary
MAX_SEQ_LEN = 2048  # context length T of make_batch
NORM_EPS = 1e-6  # RMSNorm epsilon
ROPE_THETA = 10000.0  # rotary base frequency


class RMSNorm(nn.Module):
    """LayerNorm without mean-centring or bias: x / rms(x) * weight."""

    def __init__(self, dim):
        super().__init__()
        self.eps = NORM_EPS
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (B, T, C)
        # normalise in fp32 so the mean of squares does not overflow in fp16/bf16
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, C)
        return xf.type_as(x) * self.weight


def rotary_tables(seq_len, head_dim):
    """cos/sin tables for rotary embeddings, each (seq_len, head_dim), built
    from arange only (no data-dependent ops, fine on fake tensors)."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2).float() / head_dim))  # (hs/2,)
    t = torch.arange(seq_len).float()  # (T,)
    freqs = torch.outer(t, inv_freq)  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs) same angle for both halves
    return emb.cos(), emb.sin()


def rotate_half(x):  # (..., hs)
    x1, x2 = x.chunk(2, dim=-1)  # 2 x (..., hs/2)
    return torch.cat((-x2, x1), dim=-1)  # (..., hs)


def apply_rotary(x, cos, sin):  # x: (B, nh, T, hs); cos, sin: (T, hs)
    # rotating pairs (i, i + hs/2) by a position-dependent angle makes q.k
    # depend only on the relative distance between positions
    return x * cos + rotate_half(x) * sin  # (B, nh, T, hs), several temporaries


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(N_EMBD, N_EMBD, bias=False)
        self.wk = nn.Linear(N_EMBD, N_EMBD, bias=False)
        self.wv = nn.Linear(N_EMBD, N_EMBD, bias=False)
        self.wo = nn.Linear(N_EMBD, N_EMBD, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.size()  # (B, T, C)
        q = self.wq(x).view(B, T, N_HEAD, HEAD_DIM).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, N_HEAD, HEAD_DIM).transpose(1, 2)  # (B, nh, T, hs)
        v = self.wv(x).view(B, T, N_HEAD, HEAD_DIM).transpose(1, 2)  # (B, nh, T, hs)
        q = apply_rotary(q, cos, sin)  # (B, nh, T, hs)
        k = apply_rotary(k, cos, sin)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(N_EMBD, INTERMEDIATE, bias=False)  # gate
        self.w2 = nn.Linear(INTERMEDIATE, N_EMBD, bias=False)  # down
        self.w3 = nn.Linear(N_EMBD, INTERMEDIATE, bias=False)  # up

    def forward(self, x):  # (B, T, C)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # three (B, T, INTERMEDIATE) inside


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = RMSNorm(N_EMBD)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(N_EMBD)
        self.feed_forward = FeedForward()

    def forward(self, x, cos, sin):  # (B, T, C)
        x = x + self.attention(self.attention_norm(x), cos, sin)
        x = x + self.feed_forward(self.ffn_norm(x))
        return x


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB_SIZE, N_EMBD)
        self.layers = nn.ModuleList([Block() for _ in range(N_LAYER)])
        self.norm = RMSNorm(N_EMBD)
        self.output = nn.Linear(N_EMBD, VOCAB_SIZE, bias=False)  # untied head
        # rotary tables are fixed, so build them once (2 x 1 MiB in fp32) and
        # share them across layers; non-persistent keeps them out of state_dict
        cos, sin = rotary_tables(MAX_SEQ_LEN, HEAD_DIM)
        self.register_buffer("rope_cos", cos, persistent=False)  # (T_max, hs)
        self.register_buffer("rope_sin", sin, persistent=False)  # (T_max, hs)

    def forward(self, tokens, targets=None):
        B, T = tokens.size()  # (B, T) int64
        assert T <= MAX_SEQ_LEN
        x = self.tok_embeddings(tokens)  # (B, T, C)
        cos = self.rope_cos[:T].to(x.dtype)  # (T, hs); a no-op view when dtypes match
        sin = self.rope_sin[:T].to(x.dtype)  # (T, hs)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))  # (B, T, V)
        if targets is None:
            return logits
        # cross-entropy in fp32 even if the model runs in half precision
        return F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), targets.reshape(-1))


def build_model():
    return Llama()


def make_batch(batch_size):
    tokens = torch.randint(0, VOCAB_SIZE, (batch_size, MAX_SEQ_LEN))  # (B, T)
    targets = torch.randint(0, VOCAB_SIZE, (batch_size, MAX_SEQ_LEN))  # (B, T)
    return tokens, targets
