"""oomdoctor probe sample_models/lora_gpt.py --gpu rtx3090

A LoRA fine-tune of a 6-layer GPT decoder (768 wide, T=512). Every base
weight is frozen (requires_grad=False); the attention query and value
projections each carry a trainable rank-8 adapter, W x + (B A x) * alpha/r,
with B initialised to zeros so the adapted model starts out identical to the
base. make_optimizer hands AdamW only the adapter parameters, so optimizer
state and gradients exist for 147,456 parameters instead of 81M -- but
activations are still stored for the whole network, because the gradient has
to flow back through frozen layers to reach the adapters in early blocks.

Parameters: 81,702,912 in total, of which 147,456 (the adapters) are
trainable. The frozen lm_head is tied to the token embedding.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

N_LAYER = 6  # transformer blocks
N_HEAD = 12  # attention heads per block
N_EMBD = 768  # residual stream width
VOCAB_SIZE = 50304  # GPT-2 vocabulary padded to a multiple of 64
BLOCK_SIZE = 512  # context length T of make_batch
DROPOUT = 0.0  # short fine-tunes usually run without dropout
LORA_RANK = 8  # rank r of each adapter
LORA_ALPHA = 16  # adapter output is scaled by alpha / r
LEARNING_RATE = 3e-4  # AdamW learning rate for the adapters


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update B @ A."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.base = nn.Linear(in_features, out_features)
        self.lora_A = nn.Parameter(torch.empty(LORA_RANK, in_features))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(out_features, LORA_RANK))  # (out, r)
        # A random, B zero: the update B @ A is exactly zero at step 0
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = LORA_ALPHA / LORA_RANK

    def forward(self, x):  # (B, T, in)
        # never form the (out, in) product B @ A: go through the rank-r bottleneck
        update = F.linear(F.linear(x, self.lora_A), self.lora_B)  # (B, T, r) -> (B, T, out)
        return self.base(x) + update * self.scaling  # (B, T, out)


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        # separate projections so q and v can carry adapters and k does not
        self.q_proj = LoRALinear(N_EMBD, N_EMBD)
        self.k_proj = nn.Linear(N_EMBD, N_EMBD)
        self.v_proj = LoRALinear(N_EMBD, N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)
        self.n_head = N_HEAD
        self.dropout = DROPOUT

    def forward(self, x):
        B, T, C = x.size()  # (B, T, C)
        hs = C // self.n_head
        q = self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.v_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x):  # (B, T, C)
        return self.c_proj(F.gelu(self.c_fc(x)))  # (B, T, 4C) inside


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.mlp = MLP()

    def forward(self, x):  # (B, T, C), pre-LN residual block
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class LoRAGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB_SIZE, N_EMBD)
        self.wpe = nn.Embedding(BLOCK_SIZE, N_EMBD)
        self.h = nn.ModuleList([Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB_SIZE, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        # in a real fine-tune the base weights would come from a checkpoint;
        # for memory only their shapes and the frozen flag matter
        for name, p in self.named_parameters():
            p.requires_grad_(name.endswith(("lora_A", "lora_B")))

    def forward(self, idx, targets=None):
        B, T = idx.size()  # (B, T) int64
        assert T <= BLOCK_SIZE
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V) frozen head, still a big activation
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def build_model():
    return LoRAGPT()


def make_batch(batch_size):
    idx = torch.randint(0, VOCAB_SIZE, (batch_size, BLOCK_SIZE))  # (B, T)
    targets = torch.randint(0, VOCAB_SIZE, (batch_size, BLOCK_SIZE))  # (B, T)
    return idx, targets


def make_optimizer(params):
    # frozen parameters get no AdamW state: only the adapters are optimised
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=LEARNING_RATE)
