"""oomdoctor estimate tests/models/rocm_amp_convnet.py --gpu mi250 --batch-size 1 --precision fp16

The ROCm blog "Automatic mixed precision in PyTorch using AMD GPUs" (Logan Grado, 29 March
2024; https://rocm.blogs.amd.com/artificial-intelligence/automatic-mixed-precision/README.html,
code in github.com/ROCm/rocm-blogs, blogs/artificial-intelligence/automatic-mixed-precision/
amp_blog.py), rebuilt for the tests: a convolutional net of 1x1 convolutions with BatchNorm and
ReLU (hidden size 256, two hidden layers) that maps a (2, 512, 512) grid of x/y coordinates to a
(1, 512, 512) quantized 2-D sine wave; MSE loss, ``Adam(lr=0.001)``; the loop is
``zero_grad(); forward; loss; backward(); step()`` (torch 2.3: zero_grad frees the gradients,
Adam is the foreach implementation). The blog's one "epoch" is the one example, so batch 1.

Published on an AMD GPU with ROCm 6.0 and a torch 2.3 nightly, ``torch.cuda.max_memory_allocated``
over 512 steps: 2061 MiB in fp32, 1035 MiB with autocast (fp16) and GradScaler (the output says
"KB", but the code divides by 1024**2).
"""
import torch
import torch.nn.functional as F

SIDE = 512           # the blog's image side: shape = (512, 512)
HIDDEN, N_HIDDEN = 256, 2


class ConvModel(torch.nn.Module):
    """The blog's ConvModel: Conv2d(2, h, 1)-BN-ReLU, n x (Conv2d(h, h, 1)-BN-ReLU), Conv2d(h, 1, 1)."""

    def __init__(self, hidden_size=HIDDEN, n_hidden_layers=N_HIDDEN):
        super().__init__()
        layers = [torch.nn.Conv2d(2, hidden_size, 1), torch.nn.BatchNorm2d(hidden_size),
                  torch.nn.ReLU()]
        for _ in range(n_hidden_layers):
            layers += [torch.nn.Conv2d(hidden_size, hidden_size, 1),
                       torch.nn.BatchNorm2d(hidden_size), torch.nn.ReLU()]
        layers += [torch.nn.Conv2d(hidden_size, 1, 1)]
        self.model = torch.nn.Sequential(*layers)

    def forward(self, x):
        return self.model(x)       # (B, 2, H, W) -> (B, 1, H, W)


def build_model():
    return ConvModel()


def make_batch(batch_size):
    # The grid of coordinates in [0, 1] and the quantized target; values never change memory.
    inputs = torch.rand(batch_size, 2, SIDE, SIDE)     # (B, 2, 512, 512)
    targets = torch.rand(batch_size, 1, SIDE, SIDE)    # (B, 1, 512, 512)
    return inputs, targets


def loss_fn(model, batch):
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


def make_optimizer(params):
    return torch.optim.Adam(params, lr=0.001)
