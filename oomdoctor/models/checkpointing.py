"""Activation checkpointing: which blocks a person would wrap, and wrapping them.

``--checkpointing`` wraps the model's repeated blocks in non-reentrant ``torch.utils.checkpoint``
(the trace, the real CUDA probe and the smoke run alike, through
``oomdoctor.models.training.build_for_training``). Under the CUDA emulation the recomputation in backward
re-enters the emulation's modes: oomdoctor.sim.recompute.
"""
from __future__ import annotations

from typing import Callable

import torch


def find_repeated_blocks(model: torch.nn.Module, class_name: str | None = None) -> list[str]:
    """Names of the blocks to checkpoint: every module of ``class_name``, or by default the
    repeated block a person would wrap.

    That is the module class, with at least two instances, that holds the most parameters in
    its outermost instances - a transformer's layer, a ResNet's BasicBlock, a U-Net's
    DoubleConv - counting only classes that contain other modules: checkpointing a leaf layer
    (a Conv2d or Linear) saves nothing, since each still keeps its own input for backward,
    and the generic containers (Sequential, ModuleList, ModuleDict) are wrappers, not blocks.
    Ties go to the class with fewer, larger instances. An encoder-decoder has two such classes
    side by side (nn.Transformer's, Whisper's or BART's encoder and decoder layers): a repeated
    class outside the chosen blocks that holds at least a quarter of their parameters is
    wrapped too, as transformers' ``gradient_checkpointing_enable()`` wraps both. A model
    without such a class falls back to the children of a ModuleList/Sequential that share a
    class (the most instances, then the most parameters). ``class_name`` may name several
    classes, comma-separated."""
    if class_name:
        wanted = {c.strip() for c in class_name.split(",")}
        names = [n for n, m in model.named_modules() if type(m).__name__ in wanted and n]
        found = {type(model.get_submodule(n)).__name__ for n in names}
        if found != wanted:
            classes = sorted({type(m).__name__ for _, m in model.named_modules()})
            raise ValueError(f"no module of class {', '.join(sorted(wanted - found))!r} in the "
                             f"model; classes present: {', '.join(classes)}")
        return names
    blocks = _repeated_containers(model)
    if blocks:
        return blocks
    groups: dict[type, list[str]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)):
            for child_name, child in mod.named_children():
                groups.setdefault(type(child), []).append(f"{name}.{child_name}" if name
                                                          else child_name)
    groups = {c: n for c, n in groups.items() if len(n) >= 2
              and sum(p.numel() for p in model.get_submodule(n[0]).parameters()) > 0}
    if not groups:
        raise ValueError("no repeated blocks (ModuleList/Sequential children of one class) "
                         "to checkpoint; pass --checkpoint-class NAME")

    def weight(c: type) -> tuple[int, int]:
        names = groups[c]
        return len(names), sum(p.numel() for p in model.get_submodule(names[0]).parameters())
    best = max(groups, key=weight)
    return groups[best]


_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


def _repeated_containers(model: torch.nn.Module) -> list[str]:
    """The outermost instances of the repeated non-leaf class covering the most parameters;
    where those are stages made of several blocks of one class (timm's ConvNeXt and Swin
    stages) the blocks, as the libraries' own switches checkpoint them (timm's
    ``set_grad_checkpointing``): recomputing a whole stage in backward would hold all of its
    activations at once."""
    by_class: dict[type, list[str]] = {}
    for name, mod in model.named_modules():
        # peft's adapter layers (get_base_layer) wrap one Linear: still a layer, not a block.
        if name and not isinstance(mod, _CONTAINERS) and next(mod.children(), None) is not None \
                and not callable(getattr(mod, "get_base_layer", None)):
            by_class.setdefault(type(mod), []).append(name)

    def params(names: list[str]) -> int:
        return sum(p.numel() for n in names for p in model.get_submodule(n).parameters())
    candidates = []
    for names in by_class.values():
        outer = [n for n in names if not any(n.startswith(o + ".") for o in names)]
        if len(outer) >= 2 and params(outer) > 0:
            candidates.append((params(outer), -len(outer), outer))
    if not candidates:
        return []
    chosen = [_innermost(max(candidates), candidates)]
    for c in sorted(candidates, reverse=True):
        # a second stack beside the first (an encoder's layers beside a decoder's)
        if c[0] >= 0.25 * chosen[0][0] and not any(_overlap(c[2], k[2]) for k in chosen):
            chosen.append(_innermost(c, candidates))
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted((n for k in chosen for n in k[2]), key=order.__getitem__)


def _innermost(best: tuple, candidates: list[tuple]) -> tuple:
    """Blocks inside the chosen blocks, several to an instance, holding nearly all of them
    (timm's stages of blocks), instead of the chosen ones; repeatedly."""
    while True:
        covered, _, names = best
        inner = [c for c in candidates if len(c[2]) > len(names) and c[0] >= 0.9 * covered
                 and all(any(n.startswith(b + ".") for b in names) for n in c[2])]
        if not inner:
            return best
        best = max(inner)


def _overlap(a: list[str], b: list[str]) -> bool:
    """Whether a block of ``a`` contains, or lies inside, a block of ``b`` (or is one)."""
    return any(x == y or x.startswith(y + ".") or y.startswith(x + ".") for x in a for y in b)


def apply_checkpointing(model: torch.nn.Module, class_name: str | None = None, *,
                        preserve_rng_state: bool = True) -> tuple[str, ...]:
    """Wrap each repeated block's forward in non-reentrant ``torch.utils.checkpoint``."""
    names = find_repeated_blocks(model, class_name)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # transformers turns the KV cache off under gradient checkpointing (a recomputed layer
        # would append its keys to the cache a second time); do what its own switch does.
        config.use_cache = False
    for name in names:
        _wrap(model.get_submodule(name), preserve_rng_state)
    return tuple(names)


def _wrap(mod: torch.nn.Module, preserve_rng_state: bool) -> None:
    orig: Callable = mod.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        # recomputed under the emulation's modes: oomdoctor.sim.recompute
        return torch.utils.checkpoint.checkpoint(
            orig, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)
    mod.forward = forward
