"""oomdoctor probe sample_models/resnet_cnn.py --gpu rtx3090

A ResNet-18-style image classifier: 7x7 stem + max-pool, four stages of two
residual BasicBlocks each (64, 128, 256, 512 channels), global average pool,
linear head. BatchNorm2d everywhere, so train mode also updates running stats
(buffers, not parameters). Inputs are 3x224x224 images, 1000 classes.

Parameters: 11,689,512 (same layout as torchvision's resnet18, written here
from scratch).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

IMAGE_SIZE = 224  # input height and width in pixels
IN_CHANNELS = 3  # RGB
NUM_CLASSES = 1000  # ImageNet-1k classes
STAGE_WIDTHS = (64, 128, 256, 512)  # channels of the four residual stages
BLOCKS_PER_STAGE = (2, 2, 2, 2)  # BasicBlocks per stage (ResNet-18)


class BasicBlock(nn.Module):
    """Two 3x3 convs with a skip connection; a 1x1 conv projects the skip when
    the shape changes (first block of a stage that downsamples or widens)."""

    def __init__(self, in_ch, out_ch, stride):
        super().__init__()
        # bias=False: the following BatchNorm has its own shift, a bias would be redundant
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )

    def forward(self, x):  # x: (B, C_in, H, W)
        identity = x if self.downsample is None else self.downsample(x)  # (B, C_out, H/s, W/s)
        out = F.relu(self.bn1(self.conv1(x)))  # (B, C_out, H/s, W/s)
        out = self.bn2(self.conv2(out))  # (B, C_out, H/s, W/s)
        # not in-place: autograd needs the pre-ReLU sum's inputs kept intact
        return F.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        # stem: 224 -> 112 (conv stride 2) -> 56 (max-pool)
        self.conv1 = nn.Conv2d(IN_CHANNELS, STAGE_WIDTHS[0], 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(STAGE_WIDTHS[0])
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages = []
        in_ch = STAGE_WIDTHS[0]
        for i, (width, n_blocks) in enumerate(zip(STAGE_WIDTHS, BLOCKS_PER_STAGE)):
            stride = 1 if i == 0 else 2  # each later stage halves the resolution
            blocks = [BasicBlock(in_ch, width, stride)]
            blocks += [BasicBlock(width, width, 1) for _ in range(n_blocks - 1)]
            stages.append(nn.Sequential(*blocks))
            in_ch = width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(STAGE_WIDTHS[-1], NUM_CLASSES)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):  # x: (B, 3, 224, 224)
        x = F.relu(self.bn1(self.conv1(x)))  # (B, 64, 112, 112)
        x = self.maxpool(x)  # (B, 64, 56, 56)
        x = self.stages(x)  # (B, 512, 7, 7)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)  # (B, 512)
        return self.fc(x)  # (B, NUM_CLASSES)


def build_model():
    return ResNet()


def make_batch(batch_size):
    images = torch.randn(batch_size, IN_CHANNELS, IMAGE_SIZE, IMAGE_SIZE)  # (B, 3, 224, 224)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,))  # (B,)
    return images, labels


def loss_fn(model, batch):
    images, labels = batch
    return F.cross_entropy(model(images), labels)
