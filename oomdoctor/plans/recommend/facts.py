"""What the lower bound needs from the model built on fake tensors, and the bound itself."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oomdoctor.configs import param_width
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
    # LoRA/QLoRA: (precision, parameter bytes, trainable bytes, quantization statistics bytes)
    # of the model each precision's recipe builds (frozen 16-bit or 4-bit base, fp32 adapters;
    # bitsandbytes' absmax and code tables, which every rank keeps whole), measured on it;
    # empty for full fine-tuning, where every parameter trains at the precision's width.
    adapted_bytes: tuple[tuple[str, int, int, int], ...] = ()
    lora_targets: tuple[str, ...] = ()      # the module names peft put LoRA on

    def state_bytes(self, precision: str) -> tuple[int, int]:
        """Parameter bytes and trainable (gradient-holding) bytes one replica holds."""
        for p, params, trainable, _ in self.adapted_bytes:
            if p == precision:
                return params, trainable
        width = param_width(precision)
        return self.num_parameters * width, self.num_trainable * width


def model_facts(spec: ModelSpec, precisions: tuple[str, ...] | list[str] = ()) -> _Facts:
    """The lower bound's facts from the model built on the meta device, as the trace builds it
    (oomdoctor.sim.device); with adapters, also each of ``precisions``' adapted model."""
    import gc

    import torch

    from oomdoctor.models import checkpointing
    from oomdoctor.models.training import build_checked_model, make_optimizer
    from oomdoctor.sim.device import on_meta
    gc.collect()
    with on_meta():
        model = build_checked_model(spec)
        opt = make_optimizer(spec, model)
        try:
            names = checkpointing.find_repeated_blocks(model)
            parent = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
        except ValueError:
            names, parent = [], ""
        seen = _unique_parameters(model)
        bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
        leaf = max((sum(p.numel() for p in m.parameters(recurse=False))
                    for m in model.modules()), default=0)
        split = {m.weight.untyped_storage()._cdata: m.weight.numel() for m in model.modules()
                 if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
        facts = _Facts(sum(p.numel() for p in seen),
                       sum(p.numel() for p in seen if p.requires_grad), _state_slots(opt),
                       bool(names), parent, bn, leaf, sum(split.values()))
    if spec.adapters is None or not precisions:
        return facts
    return _adapted(spec, facts, precisions)


def _unique_parameters(model: Any) -> list[Any]:
    """Each parameter storage once (tied weights share one)."""
    from oomdoctor.sim.stepping import unique_storages
    return list(unique_storages(model.parameters()).values())


def _adapted(spec: ModelSpec, facts: _Facts, precisions: tuple[str, ...] | list[str]) -> _Facts:
    """``facts`` for the model as LoRA/QLoRA trains it: the adapters are what trains, and each
    precision's recipe holds its own bytes (the 4-bit weights' statistics included), counted
    on the model peft and bitsandbytes build."""
    from dataclasses import replace

    from oomdoctor.models import adapters
    from oomdoctor.models.training import build_for_training
    from oomdoctor.sim.device import on_meta
    from oomdoctor.sim.stepping import unique_storages
    measured = []
    counts = (facts.num_parameters, facts.num_trainable)
    for p in precisions:
        with on_meta():
            model, _ = build_for_training(spec, p)
            params = _unique_parameters(model)
            stats = sum(t.untyped_storage().nbytes()
                        for t in unique_storages(adapters.quant_states(model)).values())
            measured.append((p, sum(q.untyped_storage().nbytes() for q in params),
                             sum(q.untyped_storage().nbytes() for q in params if q.requires_grad),
                             stats))
            counts = (sum(adapters.logical_numel(q) for q in params),
                      sum(q.numel() for q in params if q.requires_grad))
            targets = getattr(model, "peft_config", {}).get("default")
    return replace(facts, num_parameters=counts[0], num_trainable=counts[1],
                   adapted_bytes=tuple(measured),
                   lora_targets=tuple(sorted(getattr(targets, "target_modules", None) or ())))


def floor_bytes(facts: _Facts, precision: str, strategy: Strategy,
                state_slots: int | None = None) -> int:
    params, trainable = facts.state_bytes(precision)
    slots = facts.state_slots if state_slots is None else state_slots
    stats = next((q for p, _, _, q in facts.adapted_bytes if p == precision), 0)
    # Gradients and optimizer state only for what trains (the adapters, under LoRA/QLoRA).
    return model_state_floor(params, trainable, trainable * slots, strategy) + stats


def tensor_parallel_bytes(facts: _Facts, precision: str, degree: int,
                          state_slots: int | None = None) -> int:
    """Model states per GPU under tensor parallelism of ``degree`` (Megatron-LM, Shoeybi et al.
    2019, arXiv:1909.08053: each Linear's weight split by columns or rows, the embedding by
    vocabulary; biases, norms and everything else replicated): the split weights / degree plus
    the rest, each with its gradient and optimizer state. Data parallelism across the
    remaining GPUs replicates this (DDP)."""
    width = param_width(precision)
    slots = facts.state_slots if state_slots is None else state_slots
    split = min(facts.splittable_params, facts.num_parameters)
    whole = facts.num_parameters - split
    per_gpu_params = -(-split // degree) + whole
    trainable_share = facts.num_trainable / facts.num_parameters if facts.num_parameters else 0
    trainable = round(per_gpu_params * trainable_share)
    return per_gpu_params * width + trainable * width * (1 + slots)
