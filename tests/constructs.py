"""Model files for the construct matrix (tests/test_constructs.py): one tiny language model
whose blocks sit in a chosen container, at a chosen depth, with tied input/output weights,
a persistent and a non-persistent buffer per block and ``.to("cuda")`` in ``build_model`` -
the constructs real models are made of, which each command must follow."""
from __future__ import annotations

CONTAINERS = ("modulelist", "sequential", "sequential-named", "moduledict", "nested",
              "indexed")

_TEMPLATE = '''
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, VOCAB, SEQ, DEPTH = {width}, 128, 16, {depth}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.register_buffer("scale", torch.ones(WIDTH))
        self.register_buffer("scratch", torch.zeros(WIDTH), persistent=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x)))) * self.scale + self.scratch


def blocks(n):
    return [Block() for _ in range(n)]


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        kind = {container!r}
        if kind == "modulelist" or kind == "indexed":
            self.layers = nn.ModuleList(blocks(DEPTH))
        elif kind == "sequential":
            self.layers = nn.Sequential(*blocks(DEPTH))
        elif kind == "sequential-named":
            self.layers = nn.Sequential(OrderedDict((f"block_{{i}}", b)
                                                    for i, b in enumerate(blocks(DEPTH))))
        elif kind == "moduledict":
            self.layers = nn.ModuleDict({{f"b{{i}}": b for i, b in enumerate(blocks(DEPTH))}})
        else:                   # nested: two stages, each a ModuleList of blocks
            self.layers = nn.Sequential(*(nn.ModuleList(blocks(DEPTH // 2)) for _ in range(2)))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight            # tied

    def forward(self, ids):
        x = self.embed(ids)
        kind = {container!r}
        if kind == "indexed":       # indexes its blocks up to a count, as some models do
            for i in range(DEPTH):
                x = self.layers[i](x)
        elif kind == "moduledict":
            for block in self.layers.values():
                x = block(x)
        elif kind == "nested":
            for stage in self.layers:
                for block in stage:
                    x = block(x)
        else:
            x = self.layers(x) if isinstance(self.layers, nn.Sequential) else x
            if isinstance(self.layers, nn.ModuleList):
                for block in self.layers:
                    x = block(x)
        return self.head(x)


def build_model():
    return LM(){to_cuda}


def make_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ))
    return ids, ids


def loss_fn(model, batch):
    ids, labels = batch
    return F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
'''


def write(folder, container: str, depth: int, width: int = 32, to_cuda: bool = True) -> str:
    """A model file of this construct in ``folder``; its path. ``to_cuda=False``: without the
    ``.to("cuda")``, for a real run on the CPU."""
    path = folder / f"lm_{container.replace('-', '_')}_{depth}{'' if to_cuda else '_cpu'}.py"
    path.write_text(_TEMPLATE.format(container=container, depth=depth, width=width,
                                     to_cuda='.to("cuda")' if to_cuda else ""))
    return str(path)
