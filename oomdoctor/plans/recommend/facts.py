"""What the lower bound needs from the model built on fake tensors, and the bound itself."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oomdoctor.models.spec import ModelSpec
from oomdoctor.plans.parallel import Strategy, model_state_floor


# Optimizer state per trainable element, in the parameters' dtype, for the lower bound
# (torch/optim/*.py _init_group): Adam/AdamW exp_avg + exp_avg_sq (+ max_exp_avg_sq), SGD with
# momentum a momentum buffer, RMSprop square_avg (+ momentum, grad_avg), Adagrad sum.
def _state_slots(opt: Any) -> int:
    import torch
    d = opt.defaults
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if d.get("amsgrad") else 2
    if isinstance(opt, torch.optim.SGD):
        return 1 if d.get("momentum", 0) else 0
    if isinstance(opt, torch.optim.RMSprop):
        return 1 + bool(d.get("momentum", 0)) + bool(d.get("centered"))
    if isinstance(opt, torch.optim.Adagrad):
        return 1
    return 0        # unknown or factored (Adafactor): keep the bound a bound


@dataclass(frozen=True)
class _Facts:
    """What the lower bound needs, from the model built on fake tensors."""

    num_parameters: int
    num_trainable: int
    state_slots: int
    has_blocks: bool
    blocks_parent: str = ""        # the container of the repeated blocks, e.g. "layers"
    has_batchnorm: bool = False
    largest_leaf_params: int = 0   # DeepSpeed's "largest layer"
    # Parameters tensor parallelism splits (nn.Linear / nn.Embedding weights, Megatron-style);
    # biases and norms stay whole on every rank.
    splittable_params: int = 0


def model_facts(spec: ModelSpec) -> _Facts:
    import gc

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomdoctor.models import checkpointing
    from oomdoctor.models.training import build_checked_model, make_optimizer
    gc.collect()
    with FakeTensorMode():
        model = build_checked_model(spec)
        opt = make_optimizer(spec, model)
        try:
            names = checkpointing.find_repeated_blocks(model)
            parent = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
        except ValueError:
            names, parent = [], ""
        seen: dict[int, torch.nn.Parameter] = {}
        for p in model.parameters():
            seen.setdefault(p.untyped_storage()._cdata, p)
        bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
        leaf = max((sum(p.numel() for p in m.parameters(recurse=False))
                    for m in model.modules()), default=0)
        split = {m.weight.untyped_storage()._cdata: m.weight.numel() for m in model.modules()
                 if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
        return _Facts(sum(p.numel() for p in seen.values()),
                      sum(p.numel() for p in seen.values() if p.requires_grad),
                      _state_slots(opt), bool(names), parent, bn, leaf, sum(split.values()))


def floor_bytes(facts: _Facts, precision: str, strategy: Strategy,
                state_slots: int | None = None) -> int:
    width = 2 if precision == "bf16-pure" else 4
    slots = facts.state_slots if state_slots is None else state_slots
    return model_state_floor(facts.num_parameters * width, facts.num_trainable * width,
                             facts.num_trainable * width * slots, strategy)


def tensor_parallel_bytes(facts: _Facts, precision: str, degree: int,
                          state_slots: int | None = None) -> int:
    """Model states per GPU under tensor parallelism of ``degree`` (Megatron-LM, Shoeybi et al.
    2019, arXiv:1909.08053: each Linear's weight split by columns or rows, the embedding by
    vocabulary; biases, norms and everything else replicated): the split weights / degree plus
    the rest, each with its gradient and optimizer state. Data parallelism across the
    remaining GPUs replicates this (DDP)."""
    width = 2 if precision == "bf16-pure" else 4
    slots = facts.state_slots if state_slots is None else state_slots
    split = min(facts.splittable_params, facts.num_parameters)
    whole = facts.num_parameters - split
    per_gpu_params = -(-split // degree) + whole
    trainable_share = facts.num_trainable / facts.num_parameters if facts.num_parameters else 0
    trainable = round(per_gpu_params * trainable_share)
    return per_gpu_params * width + trainable * width * (1 + slots)
