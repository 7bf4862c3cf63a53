"""oomdoctor estimate tests/models/vit_l16_cifar10.py --gpu a100-40 --batch-size 32

torchvision ``vit_l_16`` fine-tuned on CIFAR-10 (images resized to 224x224) with its head
replaced by a 10-class ``Linear``: rasbt/ViT-finetuning-scripts
``precision-benchmarks/torchvision-vit16-large`` (ground-truth.md VF-1..VF-6), as the scripts
were when the published numbers were taken (commit 2372d1b): forward, loss,
``optimizer.zero_grad()``, backward, ``Adam(lr=5e-5).step()``; torch 2.1, so zero_grad frees
the gradients and Adam is the foreach implementation.

Parameters: 303,311,882 (vit_l_16's 304,326,632 with a 10-class head instead of 1000).
"""
import torch
import torch.nn.functional as F

from torchvision_vit import IMAGE_SIZE, VIT_L_16, ZeroGradAfterForward, free_grads, vit

NUM_CLASSES = 10  # CIFAR-10


def build_model():
    return vit(VIT_L_16, NUM_CLASSES)


def make_batch(batch_size):
    images = torch.rand(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)  # (B, 3, 224, 224) ToTensor()
    labels = torch.randint(0, NUM_CLASSES, (batch_size,))  # (B,)
    return images, labels


def loss_fn(model, batch):
    images, labels = batch
    loss = F.cross_entropy(model(images), labels)
    free_grads(model)  # the scripts' zero_grad() sits between the loss and backward()
    return loss


def make_optimizer(params):
    return ZeroGradAfterForward(params, lr=5e-5)
