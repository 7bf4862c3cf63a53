"""oomdoctor probe sample_models/vit_b16.py --gpu rtx3090

A ViT-B/16-style image classifier: a stride-16 Conv2d cuts a 224x224 image
into 14x14 = 196 patch tokens, a learned class token is prepended, learned
position embeddings are added, then 12 pre-LayerNorm transformer blocks, a
final LayerNorm and a linear head on the class token.

Parameters: 86,567,656 (the count of timm's vit_base_patch16_224).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

IMAGE_SIZE = 224  # input height and width in pixels
PATCH_SIZE = 16  # side of each square patch
IN_CHANNELS = 3  # RGB
N_LAYER = 12  # transformer blocks
N_HEAD = 12  # attention heads per block
HIDDEN = 768  # token width
MLP_DIM = 3072  # MLP inner width
NUM_CLASSES = 1000  # ImageNet-1k classes
NUM_PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 196 patch tokens (plus 1 class token)
LAYER_NORM_EPS = 1e-6  # ViT's LayerNorm epsilon


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.n_head = N_HEAD

    def forward(self, x):  # (B, N, C), N = 197
        B, N, C = x.size()
        hs = C // self.n_head
        qkv = self.qkv(x).view(B, N, 3, self.n_head, hs).permute(2, 0, 3, 1, 4)  # (3, B, nh, N, hs)
        q, k, v = qkv.unbind(0)  # 3 x (B, nh, N, hs)
        # no mask, no dropout: every patch attends to every patch
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)  # (B, nh, N, hs)
        y = y.transpose(1, 2).reshape(B, N, C)  # (B, N, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, MLP_DIM)
        self.fc2 = nn.Linear(MLP_DIM, HIDDEN)

    def forward(self, x):  # (B, N, C)
        return self.fc2(F.gelu(self.fc1(x)))  # (B, N, MLP_DIM) inside


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)
        self.attn = Attention()
        self.norm2 = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)
        self.mlp = MLP()

    def forward(self, x):  # (B, N, C)
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x


class VisionTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        # a conv with kernel = stride = patch size is a per-patch linear projection
        self.patch_embed = nn.Conv2d(IN_CHANNELS, HIDDEN, PATCH_SIZE, stride=PATCH_SIZE)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, HIDDEN))
        self.pos_embed = nn.Parameter(torch.zeros(1, NUM_PATCHES + 1, HIDDEN))
        self.blocks = nn.ModuleList([Block() for _ in range(N_LAYER)])
        self.norm = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)
        self.head = nn.Linear(HIDDEN, NUM_CLASSES)
        # plain normal_, not trunc_normal_: torch's trunc_normal_ loops on a
        # data-dependent check (mask.any()) that fake tensors cannot answer
        nn.init.normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=0.02)

    def forward(self, images):  # (B, 3, 224, 224)
        x = self.patch_embed(images)  # (B, C, 14, 14)
        x = x.flatten(2).transpose(1, 2)  # (B, 196, C)
        cls = self.cls_token.expand(x.size(0), -1, -1)  # (B, 1, C) a view, no copy
        x = torch.cat([cls, x], dim=1) + self.pos_embed  # (B, 197, C); cat allocates
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)  # (B, 197, C)
        return self.head(x[:, 0])  # (B, NUM_CLASSES) from the class token


def build_model():
    return VisionTransformer()


def make_batch(batch_size):
    images = torch.randn(batch_size, IN_CHANNELS, IMAGE_SIZE, IMAGE_SIZE)  # (B, 3, 224, 224)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,))  # (B,)
    return images, labels


def loss_fn(model, batch):
    images, labels = batch
    return F.cross_entropy(model(images), labels)
