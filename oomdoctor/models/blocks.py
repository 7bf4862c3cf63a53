"""The units a model's layout places: its repeated blocks and the modules around them."""
from __future__ import annotations

import torch

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def execution_blocks(model: torch.nn.Module) -> list[str]:
    """The units a split or FSDP places: the leaves of the module tree after expanding the root,
    containers (ModuleList/Sequential/ModuleDict) and wrappers around a list of repeated blocks
    (a GPT's `transformer`); a residual block with a small Sequential inside stays whole."""
    out: list[str] = []

    def repeated(c: torch.nn.Module) -> bool:
        kinds = [type(x) for x in c.children()]
        return isinstance(c, _CONTAINERS) and any(kinds.count(k) >= 2 for k in kinds)

    def holds_blocks(m: torch.nn.Module) -> bool:
        return any(repeated(c) for c in m.modules() if c is not m)

    def visit(name: str, mod: torch.nn.Module, root: bool) -> None:
        children = list(mod.named_children())
        if children and (root or isinstance(mod, _CONTAINERS) or holds_blocks(mod)):
            for child_name, child in children:
                visit(f"{name}.{child_name}" if name else child_name, child, False)
        elif not root:
            out.append(name)
    visit("", model, True)
    return out or [""]
