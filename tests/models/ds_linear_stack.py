"""The model of DeepSpeedExamples' training/offload_states benchmark (offload_states.py, PR
#942), rebuilt as an oomdoctor model file: DS_LAYERS x nn.Linear(DS_WIDTH, DS_WIDTH) with bias
in sequence, cross-entropy of the last output against a class label, DeepSpeed's "Adam"
(FusedAdam, no temporaries: torch's fused Adam here). The published run: 4 layers of 32768
on 4 GPUs, micro-batch 1, ZeRO-3 with bf16 and every other setting DeepSpeed's default."""
import os

import torch
import torch.nn as nn

WIDTH = int(os.environ.get("DS_WIDTH", "256"))
LAYERS = int(os.environ.get("DS_LAYERS", "4"))


def build_model():
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def make_batch(batch_size):
    return torch.randn(batch_size, WIDTH), torch.randint(0, WIDTH, (batch_size,))


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def make_optimizer(params):
    return torch.optim.Adam(params, lr=1e-6, fused=True)
