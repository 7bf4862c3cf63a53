"""A standard U-Net (the milesial/Pytorch-UNet layout: DoubleConv blocks of Conv2d/BatchNorm2d/ReLU
in an nn.Sequential, four Down and four Up stages), written for the tests: a model whose repeated
block is a container of leaf layers, not a ModuleList child. ``W`` and ``SIZE`` keep it small."""
import torch
import torch.nn as nn
import torch.nn.functional as F

W, SIZE = 16, 64   # base width and image side (the original: 64, 572)


class DoubleConv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.double_conv = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    def forward(self, x):
        return self.double_conv(x)


class Down(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(cin, cout))

    def forward(self, x):
        return self.maxpool_conv(x)


class Up(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = DoubleConv(cin, cout)

    def forward(self, x1, x2):
        return self.conv(torch.cat([x2, self.up(x1)], dim=1))


class UNet(nn.Module):
    def __init__(self, n_channels=3, n_classes=2, w=None):
        w = w or W
        super().__init__()
        self.inc = DoubleConv(n_channels, w)
        self.down1, self.down2 = Down(w, 2 * w), Down(2 * w, 4 * w)
        self.down3, self.down4 = Down(4 * w, 8 * w), Down(8 * w, 16 * w)
        self.up1, self.up2 = Up(16 * w, 8 * w), Up(8 * w, 4 * w)
        self.up3, self.up4 = Up(4 * w, 2 * w), Up(2 * w, w)
        self.outc = nn.Conv2d(w, n_classes, 1)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x4 = self.down3(x3)
        x5 = self.down4(x4)
        x = self.up1(x5, x4)
        x = self.up2(x, x3)
        x = self.up3(x, x2)
        x = self.up4(x, x1)
        return self.outc(x)


def build_model():
    return UNet()


def make_batch(batch_size):
    return torch.randn(batch_size, 3, SIZE, SIZE), torch.randint(0, 2, (batch_size, SIZE, SIZE))


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
