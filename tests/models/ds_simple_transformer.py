"""The transformer of DeepSpeedExamples' training/bf16_master_weight benchmark (train.py at
ac3800b), rebuilt as an oomdoctor model file for tests/published_multi.py: token and learned
position embeddings, post-norm blocks of nn.MultiheadAttention (called with need_weights left
True, so its math path keeps the attention weights) and a GELU feed-forward of 4 x hidden, an
untied output projection; cross-entropy over the logits; DeepSpeed's AdamW (FusedAdam: no
temporaries), here torch's fused AdamW. Sizes from the environment (the published 6.86B run:
DS_HIDDEN=4096 DS_LAYERS=32 DS_HEADS=32, vocabulary 50000, sequence 512). DS_HOLD_LOGITS=1 for
train.py's loop, which keeps ``logits = model_engine(input_ids)`` in a local through the
backward and the step, until the next forward returns; benchmarks/measure_deepspeed.py's
harness computes the loss on them inline and keeps nothing."""
import os

import torch
import torch.nn as nn

HIDDEN = int(os.environ.get("DS_HIDDEN", "256"))
LAYERS = int(os.environ.get("DS_LAYERS", "4"))
HEADS = int(os.environ.get("DS_HEADS", "4"))
VOCAB = int(os.environ.get("DS_VOCAB", "50000"))
SEQ = int(os.environ.get("DS_SEQ", "512"))
HOLD_LOGITS = os.environ.get("DS_HOLD_LOGITS") == "1"
_LOGITS: list = []          # train.py's `logits`: rebound only when the next forward returns


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.norm1 = nn.LayerNorm(HIDDEN)
        self.norm2 = nn.LayerNorm(HIDDEN)
        self.ff = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(),
                                nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x):
        attended, _ = self.attention(x, x, x)
        x = self.norm1(x + attended)
        return self.norm2(x + self.ff(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.pos_embedding = nn.Embedding(SEQ, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.output_proj = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids):
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, -1)
        x = self.embedding(input_ids) + self.pos_embedding(positions)
        for layer in self.layers:
            x = layer(x)
        return self.output_proj(x)


def build_model():
    return Model()


def make_batch(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)), torch.randint(0, VOCAB, (batch_size, SEQ)))


def loss_fn(model, batch):
    input_ids, labels = batch
    logits = model(input_ids)
    if HOLD_LOGITS:
        _LOGITS[:] = [logits]
    return nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
