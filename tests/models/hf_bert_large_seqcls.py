"""oomdoctor estimate tests/models/hf_bert_large_seqcls.py --gpu v100-16 --batch-size 4

bert-large-uncased with a 2-label sequence-classification head, written the way
HuggingFace transformers ~4.16 (January 2022) ran it, to rebuild the measurements of
HF-2..HF-6 in docs/ground-truth.md ("Efficient Training on a Single GPU"):

- *eager* attention: matmul -> / sqrt(d) -> + additive mask -> softmax -> dropout ->
  matmul (transformers had no SDPA path then), so the (B, 16, T, T) scores, probabilities
  and dropout mask are saved for backward;
- the additive mask is built in the *parameter* dtype (fp32 even under AMP,
  ``get_extended_attention_mask``), so under fp16 autocast the fp16 scores are promoted to
  fp32 by the mask add and softmax/dropout run in fp32;
- post-LN layers in a ``ModuleList`` of 24 ``BertLayer`` (what ``gradient_checkpointing``
  wraps, and what oomdoctor's ``--checkpointing`` picks);
- the batch has ``input_ids`` and ``labels`` only (the doc's ``Dataset.from_dict``), so the
  model builds an all-ones attention mask and takes token types from a zero buffer.

The Trainer loop of that era is mirrored by :func:`make_optimizer`: transformers' own AdamW
(a per-parameter loop; torch's ``foreach=False`` AdamW has the same memory, give or take one
parameter-sized ``denom`` of the largest tensor) and ``model.zero_grad()``, which on torch 1.10
*zeroed* the gradients in place instead of freeing them, so from the second step on the
gradients stay allocated through the forward. The Trainer's gradient clipping
(``max_grad_norm=1.0``) is left out: it allocates one scalar norm per parameter, nothing a
memory estimate can see, and would only slow the trace.

The torch of the measurement (~1.10) also differs from today's in one place that matters here,
see ``TORCH_1_10_SOFTMAX``.

Parameters: 335,143,938 (bert-large-uncased's 335,141,888 + a 1024x2 classifier).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

N_LAYER = 24  # encoder layers
N_HEAD = 16  # attention heads per layer
HIDDEN = 1024  # hidden size
INTERMEDIATE = 4096  # feed-forward inner width
VOCAB_SIZE = 30522  # WordPiece vocabulary (uncased)
MAX_POSITIONS = 512  # learned absolute positions
TYPE_VOCAB_SIZE = 2  # segment embeddings
NUM_LABELS = 2  # the doc's binary labels
SEQ_LEN = 512  # the doc's sequences are all 512 tokens long
DROPOUT = 0.1  # hidden_dropout_prob = attention_probs_dropout_prob = 0.1
LAYER_NORM_EPS = 1e-12  # BERT's LayerNorm epsilon
# torch < 1.11 saved softmax's *input* as well as its output for backward: the backward took
# ``_softmax_backward_data(grad, output, dim, self)`` (pytorch/pytorch#64000; 1.11 changed the
# last argument to the input dtype, see the ``is_torch_less_than_1_11`` branch of transformers'
# ``pytorch_utils.softmax_backward_data``). The measured runs (January 2022, torch ~1.10) paid
# one more (B, 16, T, T) fp32 tensor per layer: 64 MiB x 24 layers at batch 4. False gives the
# softmax of the torch oomdoctor runs on.
TORCH_1_10_SOFTMAX = True


class BertEmbeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB_SIZE, HIDDEN)
        self.position_embeddings = nn.Embedding(MAX_POSITIONS, HIDDEN)
        self.token_type_embeddings = nn.Embedding(TYPE_VOCAB_SIZE, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)
        self.dropout = nn.Dropout(DROPOUT)
        # non-persistent buffers, as in transformers 4.16
        self.register_buffer("position_ids", torch.arange(MAX_POSITIONS).expand((1, -1)),
                             persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, MAX_POSITIONS, dtype=torch.long),
                             persistent=False)

    def forward(self, input_ids):  # (B, T) int64
        B, T = input_ids.shape
        position_ids = self.position_ids[:, :T]  # (1, T) view of the buffer
        token_type_ids = self.token_type_ids[:, :T].expand(B, T)  # (B, T) view, no copy
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(position_ids)  # (B, T, C)
        return self.dropout(self.LayerNorm(x))


class _Softmax110(torch.autograd.Function):
    """softmax whose autograd node keeps input and output alive, as torch 1.10's did."""

    @staticmethod
    def forward(ctx, x, dim):
        y = torch.softmax(x, dim)
        ctx.dim = dim
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return torch._softmax_backward_data(grad, y, ctx.dim, x.dtype), None


def softmax(x, dim):
    return _Softmax110.apply(x, dim) if TORCH_1_10_SOFTMAX else F.softmax(x, dim=dim)


class BertSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.dropout = nn.Dropout(DROPOUT)
        self.head_size = HIDDEN // N_HEAD

    def split_heads(self, x):  # (B, T, C) -> (B, nh, T, hs), a view
        B, T, _ = x.shape
        return x.view(B, T, N_HEAD, self.head_size).permute(0, 2, 1, 3)

    def forward(self, x, mask):  # x: (B, T, C); mask: (B, 1, 1, T) additive, param dtype
        q = self.split_heads(self.query(x))
        k = self.split_heads(self.key(x))
        v = self.split_heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2))  # (B, nh, T, T)
        scores = scores / math.sqrt(self.head_size)
        scores = scores + mask  # fp16 scores + fp32 mask -> fp32 under autocast
        probs = softmax(scores, dim=-1)  # (B, nh, T, T), saved for backward
        probs = self.dropout(probs)  # + a (B, nh, T, T) mask saved for backward
        ctx = torch.matmul(probs, v)  # (B, nh, T, hs)
        ctx = ctx.permute(0, 2, 1, 3).contiguous()  # (B, T, nh, hs)
        return ctx.view(ctx.shape[0], ctx.shape[1], HIDDEN)  # (B, T, C)


class BertSelfOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, h, x):  # post-LN: normalise after the residual add
        return self.LayerNorm(self.dropout(self.dense(h)) + x)


class BertAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.self = BertSelfAttention()
        self.output = BertSelfOutput()

    def forward(self, x, mask):
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(HIDDEN, INTERMEDIATE)

    def forward(self, x):  # (B, T, C) -> (B, T, 4C)
        return F.gelu(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(INTERMEDIATE, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, h, x):
        return self.LayerNorm(self.dropout(self.dense(h)) + x)


class BertLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = BertAttention()
        self.intermediate = BertIntermediate()
        self.output = BertOutput()

    def forward(self, x, mask):
        a = self.attention(x, mask)
        return self.output(self.intermediate(a), a)


class BertForSequenceClassification(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = BertEmbeddings()
        self.layer = nn.ModuleList([BertLayer() for _ in range(N_LAYER)])
        self.pooler = nn.Linear(HIDDEN, HIDDEN)
        self.dropout = nn.Dropout(DROPOUT)
        self.classifier = nn.Linear(HIDDEN, NUM_LABELS)

    def forward(self, input_ids, labels):
        B, T = input_ids.shape
        # no attention_mask in the batch: BertModel makes an all-ones one, then
        # get_extended_attention_mask casts it to the parameter dtype (fp32 under AMP)
        attention_mask = torch.ones(B, T)
        ext = attention_mask[:, None, None, :].to(self.pooler.weight.dtype)  # (B, 1, 1, T)
        ext = (1.0 - ext) * -10000.0
        x = self.embeddings(input_ids)
        for layer in self.layer:
            x = layer(x, ext)
        pooled = torch.tanh(self.pooler(x[:, 0]))  # (B, C) from [CLS]
        logits = self.classifier(self.dropout(pooled))  # (B, 2)
        return F.cross_entropy(logits.view(-1, NUM_LABELS), labels.view(-1))


def in_place_zero_grad(optimizer_class):
    """``optimizer_class`` as the Trainer of that era used it: its ``model.zero_grad()`` ran with
    torch 1.10's default ``set_to_none=False``, so the gradients are zeroed in place and kept.
    (hf_bert_large_adafactor.py and hf_bert_large_adam8bit.py wrap their optimizers the same.)"""
    class Trainer(optimizer_class):
        def zero_grad(self, set_to_none=True):
            super().zero_grad(set_to_none=False)
    Trainer.__name__ = f"Trainer{optimizer_class.__name__}"
    return Trainer


# The Trainer's update of that era: per-parameter AdamW with the in-place zero_grad above.
TrainerAdamW = in_place_zero_grad(torch.optim.AdamW)


def build_model():
    return BertForSequenceClassification()


def make_batch(batch_size):
    return {
        "input_ids": torch.randint(100, 30000, (batch_size, SEQ_LEN)),  # (B, T) as in the doc
        "labels": torch.randint(0, NUM_LABELS, (batch_size,)),  # (B,) binary labels
    }


def make_optimizer(params):
    # Trainer defaults: lr 5e-5, weight decay 0; transformers.AdamW loops over parameters
    return TrainerAdamW(params, lr=5e-5, weight_decay=0.0, foreach=False)
