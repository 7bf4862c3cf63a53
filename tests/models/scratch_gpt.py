"""The GPT-2-sized model of "Build a Large Language Model From Scratch" (Raschka), rebuilt in
plain torch for the model files next to this one (scratch_gpt_step3/6/7.py); not a model file
itself.

Published runs (LS-3, LS-5, LS-6, LS-7 in tests/test_ground_truth.py): rasbt/LLMs-from-scratch
``ch05/10_llm-training-speed/README.md`` (added in commit 908dd2f, 2025-02-12; torch
2.6.0+cu124, one A100). The README runs ``00_orig.py`` (this architecture with from-scratch
LayerNorm, tanh-GELU and attention, fp32, foreach AdamW) and then switches on one change after
another, printing ``torch.cuda.memory_reserved() / 1024**3`` after the first epoch (no
``empty_cache`` anywhere, so the high-water mark of the segments); ``01_opt_single_gpu.py``
holds all ten changes at once, which is where the step-6/7 layers are read from. What matters
for memory, as in those files:

- ``GPT_CONFIG_124M``: vocab 50257, context 1024, width 768, 12 heads, 12 layers, dropout 0.1
  (embeddings, attention weights, both residual branches), no qkv bias, an untied ``out_head``:
  163,009,536 parameters;
- batch 8 sequences of 1024 token ids (int64: the dataset's ``torch.tensor(list)``), loss
  ``cross_entropy(logits.flatten(0, 1), targets.flatten())``;
- ``optimizer.zero_grad()`` at the top of each iteration (set_to_none: no gradients during the
  forward, as in oomdoctor's loop); AdamW(lr 5e-4, weight_decay 0.1), ``fused=True`` from step 3;
- pure bf16 from step 5: ``model.to(device).to(torch.bfloat16)`` (AdamW state in bf16 too);
- every 15 steps a no-grad evaluation of one batch and after the epoch a 50-token generation:
  no saved activations, below the training peak, so not traced.

Step 1 made the causal mask on the fly instead of a registered buffer; how exactly is not
published (the final file uses SDPA's ``is_causal``): here a bool ``triu`` per call, 1 MiB.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 50257
CONTEXT = 1024
EMB = 768
HEADS = 12
LAYERS = 12
DROP = 0.1


class ScratchLayerNorm(nn.Module):
    """The book's LayerNorm: mean and biased variance over the last dim, scale and shift."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))
        self.shift = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return self.scale * ((x - mean) / torch.sqrt(var + self.eps)) + self.shift


class ScratchGELU(nn.Module):
    """The book's tanh approximation, written out op by op (the constant is a 0-dim CPU tensor,
    as ``torch.sqrt(torch.tensor(2.0 / torch.pi))`` is in the script)."""

    def forward(self, x):
        c = torch.sqrt(torch.tensor(2.0 / math.pi))
        return 0.5 * x * (1 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3))))


class ScratchAttention(nn.Module):
    """Separate q/k/v projections, explicit scores, in-place causal fill, softmax of the scaled
    scores, dropout on the weights, weights @ values, an output projection."""

    def __init__(self, mask_buffer=False):
        super().__init__()
        self.head_dim = EMB // HEADS
        if mask_buffer:  # 00_orig.py: a float (context x context) upper triangle per layer
            self.register_buffer("mask", torch.triu(torch.ones(CONTEXT, CONTEXT), diagonal=1))
        else:
            self.mask = None
        self.W_query = nn.Linear(EMB, EMB, bias=False)
        self.W_key = nn.Linear(EMB, EMB, bias=False)
        self.W_value = nn.Linear(EMB, EMB, bias=False)
        self.out_proj = nn.Linear(EMB, EMB)
        self.dropout = nn.Dropout(DROP)

    def forward(self, x):
        b, t, _ = x.shape

        def heads(y):
            return y.view(b, t, HEADS, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.W_query(x)), heads(self.W_key(x)), heads(self.W_value(x))
        scores = q @ k.transpose(2, 3)
        if self.mask is not None:
            causal = self.mask.bool()[:t, :t]
        else:  # step 1: made on the fly
            causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        scores.masked_fill_(causal, -torch.inf)
        weights = self.dropout(torch.softmax(scores / k.shape[-1] ** 0.5, dim=-1))
        ctx = (weights @ v).transpose(1, 2).reshape(b, t, EMB)
        return self.out_proj(ctx)


class SDPAAttention(nn.Module):
    """One packed qkv projection, viewed and permuted into (3, B, H, T, d) and passed to
    ``scaled_dot_product_attention`` (causal, dropout in training), then an output projection."""

    def __init__(self):
        super().__init__()
        self.head_dim = EMB // HEADS
        self.qkv = nn.Linear(EMB, 3 * EMB, bias=False)
        self.proj = nn.Linear(EMB, EMB)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, self.head_dim).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                             dropout_p=DROP if self.training else 0.0,
                                             is_causal=True)
        return self.proj(ctx.transpose(1, 2).contiguous().view(b, t, EMB))


class Block(nn.Module):
    def __init__(self, native, sdpa, mask_buffer=False):
        super().__init__()
        norm = nn.LayerNorm if native else ScratchLayerNorm
        self.att = SDPAAttention() if sdpa else ScratchAttention(mask_buffer)
        self.ff = nn.Sequential(nn.Linear(EMB, 4 * EMB),
                                nn.GELU(approximate="tanh") if native else ScratchGELU(),
                                nn.Linear(4 * EMB, EMB))
        self.norm1, self.norm2 = norm(EMB), norm(EMB)
        self.drop_shortcut = nn.Dropout(DROP)

    def forward(self, x):
        x = x + self.drop_shortcut(self.att(self.norm1(x)))
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


class GPTModel(nn.Module):
    def __init__(self, native, sdpa, mask_buffer=False):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, EMB)
        self.pos_emb = nn.Embedding(CONTEXT, EMB)
        self.drop_emb = nn.Dropout(DROP)
        self.trf_blocks = nn.Sequential(*[Block(native, sdpa, mask_buffer) for _ in range(LAYERS)])
        self.final_norm = nn.LayerNorm(EMB) if native else ScratchLayerNorm(EMB)
        self.out_head = nn.Linear(EMB, VOCAB, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        x = self.trf_blocks(self.drop_emb(x))
        return self.out_head(self.final_norm(x))


def make_batch(batch_size):
    inputs = torch.randint(0, VOCAB, (batch_size, CONTEXT))
    targets = torch.randint(0, VOCAB, (batch_size, CONTEXT))
    return inputs, targets


def loss_fn(model, batch):
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=5e-4, weight_decay=0.1, fused=True)
