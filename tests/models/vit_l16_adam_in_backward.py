"""oomdoctor estimate tests/models/vit_l16_adam_in_backward.py --gpu a100-80 --batch-size 1

pytorch/tutorials ``optimizer_step_in_backward_tutorial.py`` (ground-truth.md PT-2): the PT-1
setup (torchvision ``vit_l_16``, one random 224x224 image, ``loss = output.sum()``) with the
optimizer fused into backward: one ``torch.optim.Adam([p], foreach=False)`` per parameter,
stepped and zeroed from ``p.register_post_accumulate_grad_hook``, so each gradient is freed as
soon as its parameter has stepped. The loop's own optimizer has nothing left to do.
"""
import torch

from torchvision_vit import IMAGE_SIZE, VIT_L_16, vit


def build_model():
    model = vit(VIT_L_16, 1000)
    optimizers = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}

    def step_in_backward(p):
        optimizers[p].step()
        optimizers[p].zero_grad()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    return model


def make_batch(batch_size):
    return torch.rand(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE)  # (B, 3, 224, 224)


def loss_fn(model, batch):
    return model(batch).sum()


def make_optimizer(params):
    # Every gradient is gone by the time the loop steps: this optimizer never finds one.
    return torch.optim.SGD(params, lr=0.0)
