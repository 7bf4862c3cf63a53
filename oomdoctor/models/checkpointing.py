"""Activation checkpointing: which blocks a person would wrap, and wrapping them.

``--checkpointing`` wraps the model's repeated blocks in non-reentrant ``torch.utils.checkpoint``
(the trace, the real CUDA probe and the smoke run alike, through
``oomdoctor.models.training.build_for_training``). Under the CUDA emulation the recomputation in backward
re-enters the emulation's modes: oomdoctor.sim.recompute.

Its granularity follows torchtitan (torchtitan/distributed/activation_checkpoint.py):
``--checkpoint-every N`` wraps every N-th block as its layer-selective option ``"N"`` does
(:func:`every_nth`), and ``--checkpoint-policy op`` checkpoints each wrapped block per op with
torch's ``create_selective_checkpoint_contexts`` and torchtitan's policy (:func:`op_policy`).
"""
from __future__ import annotations

from typing import Callable

import torch

from oomdoctor.configs import CHECKPOINT_POLICIES, ordinal


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
                        preserve_rng_state: bool = True, every: int = 1,
                        policy: str = "full") -> tuple[str, ...]:
    """Wrap every ``every``-th repeated block's forward in non-reentrant
    ``torch.utils.checkpoint``: the whole block recomputed (``policy="full"``) or per op
    (``"op"``: :func:`op_policy`). Returns the wrapped blocks' names."""
    if policy not in CHECKPOINT_POLICIES:
        raise ValueError(f"unknown checkpoint policy {policy!r}; choose one of "
                         f"{', '.join(CHECKPOINT_POLICIES)}")
    names = every_nth(find_repeated_blocks(model, class_name), every, class_name)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # transformers turns the KV cache off under gradient checkpointing (a recomputed layer
        # would append its keys to the cache a second time); do what its own switch does.
        config.use_cache = False
    save_ops = op_save_ops() if policy == "op" else set()
    for name in names:
        block = model.get_submodule(name)
        context_fn = None
        if policy == "op":
            context_fn = _selective_context(save_ops, _forced_recompute_shapes(block, name))
        _wrap(block, preserve_rng_state, context_fn)
    return tuple(names)


def every_nth(names: list[str], every: int, class_name: str | None = None) -> list[str]:
    """The blocks torchtitan's layer-selective checkpointing (``selective_ac_option = "N"``)
    wraps: it counts the blocks from 1 and wraps one when ``count % N == 0`` - the 2nd, 4th,
    ... for N = 2 (``_apply_layer_sac`` in torchtitan/distributed/activation_checkpoint.py,
    pytorch/torchtitan before c5d93d1: ``_layer_sac_count += 1; if not ac_freq or
    _layer_sac_count % ac_freq == 0: return ptd_checkpoint_wrapper(module, ...)``)."""
    if every < 1:
        raise ValueError(f"--checkpoint-every must be >= 1, got {every}")
    chosen = [n for count, n in enumerate(names, 1) if count % every == 0]
    if not chosen:
        what = f"class {class_name}" if class_name else "the repeated class"
        raise ValueError(f"--checkpoint-every {every} wraps none of the {len(names)} blocks of "
                         f"{what} (it wraps the {ordinal(every)}, {ordinal(2 * every)}, ...); "
                         f"choose N <= {len(names)}")
    return chosen


def granularity_note(every: int, policy: str, total: int) -> str | None:
    """What the estimate says about a checkpointing granularity other than every block in
    full (None for that one)."""
    if every == 1 and policy == "full":
        return None
    parts = []
    if every > 1:
        parts.append(f"the {ordinal(every)}, {ordinal(2 * every)}, ... of the {total} blocks "
                     f"(counted from 1, as torchtitan's selective_ac_option \"{every}\" wraps "
                     "them)")
    if policy == "op":
        parts.append("per op with torchtitan's selective policy: the outputs of matmuls "
                     "(every second mm/linear recomputed), attention, convolutions and max "
                     "kept, the rest recomputed")
    return "checkpointing " + ", ".join(parts)


# Ops that stand for one of the save list's kernels on a device that cannot run it: the CUDA
# emulation's fused attention (oomdoctor.sim.emulate registers its op here), which the policy
# must keep as it keeps _scaled_dot_product_flash_attention on a GPU.
STAND_INS: set = set()


def op_save_ops() -> set:
    """The ops whose outputs torchtitan's op policy keeps: ``_get_default_save_ops`` in
    torchtitan/distributed/activation_checkpoint.py (pytorch/torchtitan c5d93d1): torch's own
    compute-intensive ops (``get_default_op_list().compute_intensive_ops``: mm, addmm, bmm,
    convolution, the flash and memory-efficient SDPA kernels, _scaled_mm, ...), the other
    SDPA kernels, max (float8's scale), flex attention, linear, topk, and the collectives whose
    results would otherwise be communicated again; ops that this torch lacks are skipped, as
    torchtitan skips them."""
    from torch._functorch.partitioners import get_default_op_list
    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    for path in _SAVE_OPS:
        found = torch.ops
        try:
            for part in path.split("."):
                found = getattr(found, part)
        except (AttributeError, RuntimeError):
            continue
        ops.add(found)
    flex = getattr(getattr(torch, "_higher_order_ops", None), "flex_attention", None)
    if flex is not None:
        ops.add(flex)
    return ops | STAND_INS


_SAVE_OPS = ("aten._scaled_dot_product_cudnn_attention.default",
             "aten._scaled_dot_product_attention_math.default",
             "aten._scaled_dot_product_fused_attention_overrideable.default",
             "aten.max.default", "aten.linear.default", "aten.topk.default",
             "torch_attn._varlen_attn.default",
             "_c10d_functional.reduce_scatter_tensor.default",
             "_c10d_functional.all_to_all_single.default")
# torchtitan's SelectiveAC.Config.force_recompute_mm_shapes_by_fqns default: a MoE router's
# gate matmul is recomputed whatever its place in the count.
_FORCE_RECOMPUTE = ("moe.router.gate",)


def _forced_recompute_shapes(block: torch.nn.Module, name: str) -> set:
    """(in, out) of the Linear layers torchtitan always recomputes (its MoE router gate)."""
    shapes = set()
    for sub_name, sub in block.named_modules():
        if any(f in f"{name}.{sub_name}" for f in _FORCE_RECOMPUTE) \
                and isinstance(sub, torch.nn.Linear):
            out_f, in_f = sub.weight.shape
            shapes.add((in_f, out_f))
    return shapes


def op_policy(save_ops: set, recompute_shapes: set = frozenset()) -> Callable:
    """torchtitan's per-op policy for one checkpointed call (``SelectiveAC._wrap_block``,
    torchtitan/distributed/activation_checkpoint.py, pytorch/torchtitan c5d93d1): keep the
    outputs of ``save_ops``, except every second mm/linear (counted separately in the forward
    and in the recompute, so both make the same choice); recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy
    mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    count = {False: 0, True: 0}            # mm/linear seen: forward, recompute

    def policy(ctx, func, *args, **kwargs):
        if (func == torch.ops.aten._to_copy.default and "cuda" in str(args[0].device)
                and "device" in kwargs and str(kwargs["device"]) == "cpu"):
            return CheckpointPolicy.MUST_SAVE      # a device-to-host copy: never again
        if func in mm_ops:
            shape = args[1].shape
            if func == torch.ops.aten.linear.default:       # (out, in) -> mm's (in, out)
                shape = torch.Size((shape[1], shape[0]))
            if shape in recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            count[ctx.is_recompute] += 1
        if func in save_ops:
            if func in mm_ops and count[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def _selective_context(save_ops: set, recompute_shapes: set) -> Callable:
    """``context_fn`` for ``checkpoint``: a fresh policy (fresh mm counts) per call."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return lambda: create_selective_checkpoint_contexts(op_policy(save_ops, recompute_shapes))


def _wrap(mod: torch.nn.Module, preserve_rng_state: bool,
          context_fn: Callable | None = None) -> None:
    orig: Callable = mod.forward
    selective = {} if context_fn is None else {"context_fn": context_fn}

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        # recomputed under the emulation's modes: oomdoctor.sim.recompute
        return torch.utils.checkpoint.checkpoint(
            orig, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
            **selective, **kwargs)
    mod.forward = forward
