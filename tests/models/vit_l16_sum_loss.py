"""oomdoctor estimate tests/models/vit_l16_sum_loss.py --gpu a100-80 --batch-size 1

pytorch/tutorials ``optimizer_step_in_backward_tutorial.py`` (ground-truth.md PT-1): torchvision
``vit_l_16`` with its 1000-class head, one random 224x224 image, ``loss = output.sum()``,
``torch.optim.Adam(model.parameters())`` with defaults (foreach on CUDA), then
``optimizer.step(); optimizer.zero_grad()`` - oomdoctor's own loop order.

Parameters: 304,326,632.
"""
import torch

from torchvision_vit import IMAGE_SIZE, VIT_L_16, vit


def build_model():
    return vit(VIT_L_16, 1000)


def make_batch(batch_size):
    return torch.rand(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)  # (B, 3, 224, 224)


def loss_fn(model, batch):
    return model(batch).sum()


def make_optimizer(params):
    return torch.optim.Adam(params)
