"""oomdoctor probe sample_models/tiny_mlp.py --gpu rtx3090

A 3-layer MLP classifier (256 -> 512 -> 512 -> 10, ReLU). It is tiny on
purpose: it builds and steps in milliseconds, so tests can exercise the whole
trace -> predict pipeline (and even a real CPU step) without waiting.

Parameters: 399,370.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

IN_FEATURES = 256  # width of each input vector
HIDDEN = 512  # width of both hidden layers
NUM_CLASSES = 10  # number of output classes


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, NUM_CLASSES)

    def forward(self, x):  # x: (B, IN_FEATURES)
        x = F.relu(self.fc1(x))  # (B, HIDDEN)
        x = F.relu(self.fc2(x))  # (B, HIDDEN)
        return self.fc3(x)  # (B, NUM_CLASSES) logits


def build_model():
    return MLP()


def make_batch(batch_size):
    x = torch.randn(batch_size, IN_FEATURES)  # (B, IN_FEATURES)
    y = torch.randint(0, NUM_CLASSES, (batch_size,))  # (B,) int64 class ids
    return x, y


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
