"""A tiny GPT-2-style decoder for benchmarks/bench_compile.py: the layout of
sample_models/gpt2_small.py (pre-LN blocks, causal SDPA, GELU MLP, tied lm_head, loss inside
forward) at 4 layers, d=256, T=256, vocab 4096. Attention dropout is 0 so that the CPU's SDPA
takes its flash kernel eagerly as well as compiled; the residual branches keep dropout 0.1.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

N_LAYER, N_HEAD, N_EMBD, VOCAB, T = 4, 4, 256, 4096, 256
DROPOUT = 0.1


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x):
        B, L, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, L, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(B, L, C)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(N_EMBD), nn.LayerNorm(N_EMBD)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(N_EMBD, 4 * N_EMBD), nn.GELU(),
                                 nn.Linear(4 * N_EMBD, N_EMBD), nn.Dropout(DROPOUT))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, N_EMBD), nn.Embedding(T, N_EMBD)
        self.drop = nn.Dropout(DROPOUT)
        self.h = nn.ModuleList([Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def build_model():
    return GPT()


def make_batch(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, T)), torch.randint(0, VOCAB, (batch_size, T)))
