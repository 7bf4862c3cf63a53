"""oomdoctor probe sample_models/gpt2_small.py --gpu rtx3090

A GPT-2-small-style decoder in the spirit of nanoGPT: learned token and
position embeddings, 12 pre-LayerNorm blocks of causal self-attention + GELU
MLP, final LayerNorm, and an lm_head that shares its weight with the token
embedding (weight tying). forward(idx, targets) returns the scalar
cross-entropy loss, so no loss_fn is needed: the batch is a tuple
(idx, targets) and oomdoctor calls model(*batch).

Parameters: 124,475,904 (vocab padded to 50304, a multiple of 64, as nanoGPT
does; the tied lm_head weight is counted once).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

N_LAYER = 12  # transformer blocks
N_HEAD = 12  # attention heads per block
N_EMBD = 768  # residual stream width
VOCAB_SIZE = 50304  # GPT-2's 50257 padded up to a multiple of 64
BLOCK_SIZE = 1024  # context length T (and the number of learned positions)
DROPOUT = 0.1  # dropout on embeddings, attention weights and residual branches


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        assert N_EMBD % N_HEAD == 0
        # q, k, v for all heads in one matmul
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)
        self.resid_dropout = nn.Dropout(DROPOUT)
        self.n_head = N_HEAD
        self.dropout = DROPOUT

    def forward(self, x):
        B, T, C = x.size()  # (B, T, C)
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        # fused attention: on CUDA this is flash attention, which never
        # materialises the (T, T) score matrix
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C) re-assemble heads
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x):  # (B, T, C)
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.mlp = MLP()

    def forward(self, x):  # (B, T, C)
        # pre-LN: normalise the branch input, keep the residual stream untouched
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB_SIZE, N_EMBD)  # token embeddings
        self.wpe = nn.Embedding(BLOCK_SIZE, N_EMBD)  # learned position embeddings
        self.drop = nn.Dropout(DROPOUT)
        self.h = nn.ModuleList([Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB_SIZE, bias=False)
        # weight tying: one (V, C) matrix serves as input embedding and output projection
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer) so the
        # residual stream's variance does not grow with depth
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * N_LAYER))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        B, T = idx.size()  # (B, T) int64 token ids
        assert T <= BLOCK_SIZE
        # pos is a fresh (T,) int64 tensor every forward (tiny)
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)  # (B, T, C)
        logits = self.lm_head(x)  # (B, T, V) -- the largest activation of the step
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def build_model():
    return GPT()


def make_batch(batch_size):
    idx = torch.randint(0, VOCAB_SIZE, (batch_size, BLOCK_SIZE))  # (B, T) int64
    targets = torch.randint(0, VOCAB_SIZE, (batch_size, BLOCK_SIZE))  # (B, T) next tokens
    return idx, targets
