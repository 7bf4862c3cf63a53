"""oomdoctor probe sample_models/bert_base.py --gpu rtx3090

A BERT-base-style encoder for sequence classification: word + learned
position + token-type embeddings, 12 post-LayerNorm encoder layers
(self-attention + GELU feed-forward), a tanh pooler over the [CLS] position and
a 2-way classifier. Attention takes an additive padding mask built from the
attention_mask in the batch. The batch is a dict, so oomdoctor calls
model(**batch); the output carries .loss and .logits.

Parameters: 109,483,778 (the same count as bert-base-uncased with a 2-label
classification head).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

N_LAYER = 12  # encoder layers
N_HEAD = 12  # attention heads per layer
HIDDEN = 768  # hidden size
INTERMEDIATE = 3072  # feed-forward inner width
VOCAB_SIZE = 30522  # WordPiece vocabulary (uncased)
MAX_POSITIONS = 512  # learned positions; also the sequence length of make_batch
TYPE_VOCAB_SIZE = 2  # segment A / segment B embeddings
NUM_LABELS = 2  # classifier outputs
DROPOUT = 0.1  # hidden and attention-probability dropout
LAYER_NORM_EPS = 1e-12  # BERT's LayerNorm epsilon


@dataclass
class ClassifierOutput:
    loss: torch.Tensor  # () scalar cross-entropy
    logits: torch.Tensor  # (B, NUM_LABELS)


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.n_head = N_HEAD
        self.dropout = DROPOUT

    def forward(self, x, mask):  # x: (B, T, C); mask: (B, 1, 1, T) additive
        B, T, C = x.size()
        hs = C // self.n_head
        q = self.query(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.key(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.value(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        # an arbitrary float mask rules out flash attention; CUDA picks the
        # memory-efficient kernel, CPU the math path with (B, nh, T, T) scores
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.out(y)


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = SelfAttention()
        self.attn_norm = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)
        self.fc_in = nn.Linear(HIDDEN, INTERMEDIATE)
        self.fc_out = nn.Linear(INTERMEDIATE, HIDDEN)
        self.ffn_norm = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x, mask):  # (B, T, C)
        # post-LN (original BERT): normalise after adding the residual
        x = self.attn_norm(x + self.drop(self.attn(x, mask)))  # (B, T, C)
        h = F.gelu(self.fc_in(x))  # (B, T, INTERMEDIATE)
        x = self.ffn_norm(x + self.drop(self.fc_out(h)))  # (B, T, C)
        return x


class BertForSequenceClassification(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB_SIZE, HIDDEN)
        self.position_embeddings = nn.Embedding(MAX_POSITIONS, HIDDEN)
        self.token_type_embeddings = nn.Embedding(TYPE_VOCAB_SIZE, HIDDEN)
        self.emb_norm = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)
        self.emb_drop = nn.Dropout(DROPOUT)
        self.layers = nn.ModuleList([EncoderLayer() for _ in range(N_LAYER)])
        self.pooler = nn.Linear(HIDDEN, HIDDEN)
        self.cls_drop = nn.Dropout(DROPOUT)
        self.classifier = nn.Linear(HIDDEN, NUM_LABELS)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids, attention_mask, labels=None):
        B, T = input_ids.size()  # (B, T) int64
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        # single-segment input: every token has type 0, so add row 0 of the
        # table instead of materialising a (B, T) tensor of zeros
        x = (
            self.word_embeddings(input_ids)  # (B, T, C)
            + self.position_embeddings(pos)  # (T, C)
            + self.token_type_embeddings.weight[0]  # (C,)
        )
        x = self.emb_drop(self.emb_norm(x))  # (B, T, C)
        # 1 = attend, 0 = padding -> 0 / large negative, added to the scores;
        # built once per forward and shared by all layers
        mask = attention_mask[:, None, None, :].to(x.dtype)  # (B, 1, 1, T)
        mask = (1.0 - mask) * torch.finfo(x.dtype).min  # (B, 1, 1, T)
        for layer in self.layers:
            x = layer(x, mask)
        pooled = torch.tanh(self.pooler(x[:, 0]))  # (B, C) from the [CLS] position
        logits = self.classifier(self.cls_drop(pooled))  # (B, NUM_LABELS)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return ClassifierOutput(loss=loss, logits=logits)


def build_model():
    return BertForSequenceClassification()


def make_batch(batch_size):
    return {
        "input_ids": torch.randint(0, VOCAB_SIZE, (batch_size, MAX_POSITIONS)),  # (B, T)
        "attention_mask": torch.ones(batch_size, MAX_POSITIONS, dtype=torch.long),  # (B, T) no padding
        "labels": torch.randint(0, NUM_LABELS, (batch_size,)),  # (B,)
    }
