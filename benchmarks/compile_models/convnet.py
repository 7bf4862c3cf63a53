"""A small VGG-style conv net for benchmarks/bench_compile.py: three stages of two
Conv2d(3x3, no bias) -> BatchNorm2d -> ReLU, a 2x2 max-pool after each, global average pooling
and a linear classifier, on 3x64x64 images. Convolutions stay library calls under Inductor;
BatchNorm and ReLU are what it can fuse.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTHS, SIZE, CLASSES = (32, 64, 128), 64, 10


def conv_bn_relu(cin, cout):
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


def build_model():
    layers, cin = [], 3
    for w in WIDTHS:
        layers += conv_bn_relu(cin, w) + conv_bn_relu(w, w) + [nn.MaxPool2d(2)]
        cin = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, CLASSES))


def make_batch(batch_size):
    return torch.randn(batch_size, 3, SIZE, SIZE), torch.randint(0, CLASSES, (batch_size,))


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
