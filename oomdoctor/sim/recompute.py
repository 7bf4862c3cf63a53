"""Checkpointed blocks recompute under the CUDA emulation, whoever checkpointed them.

``torch.utils.checkpoint`` recomputes a block during backward with the autocast state of its
forward (it saves it with the inputs: ``_get_autocast_kwargs`` in torch/utils/checkpoint.py).
oomdoctor's CUDA emulation is a stack of ``TorchFunctionMode`` s (oomdoctor.sim.emulate), and
backward runs outside them: a recomputed block ran in fp32 where its forward ran in 16 bit. A
non-reentrant checkpoint then failed its own check ("Recomputed values for the following tensors
have different metadata than during the forward pass") - transformers'
``gradient_checkpointing_enable()`` under ``--precision bf16`` in a model file - and a
reentrant one would have counted fp32 activations.

While the emulation is active, both ways into ``torch.utils.checkpoint`` (the non-reentrant
generator and the reentrant ``CheckpointFunction``) are given a function that re-enters the
modes that were active when the block's forward called it: oomdoctor's ``--checkpointing``,
transformers' and a model file's own calls alike. They are module globals that ``checkpoint``
looks up per call, so a ``functools.partial(checkpoint, ...)`` made earlier (transformers makes
one in ``gradient_checkpointing_enable``) goes through them too. Like oomdoctor.sim.eager's patches,
this is not thread-safe: a real checkpoint run by another thread during a trace would re-enter
the trace's modes.
"""
from __future__ import annotations

import types
from typing import Callable, ContextManager

import torch.utils.checkpoint as _ckpt

_ORIGINAL = (_ckpt._checkpoint_without_reentrant_generator, _ckpt.CheckpointFunction)


def install(active: Callable[[], list], reenter: Callable[[list], ContextManager]) -> None:
    """Route every checkpoint through :func:`_reentering` until :func:`uninstall`.

    ``active()``: the emulation's modes now, outermost first; ``reenter(modes)``: a context
    that enters them again when none is active (oomdoctor.sim.emulate._reenter)."""
    generator, function = _ORIGINAL

    def without_reentrant(fn, *args, **kwargs):
        return generator(_reentering(fn, active(), reenter), *args, **kwargs)

    def apply(fn, preserve_rng_state, *args):
        return function.apply(_reentering(fn, active(), reenter), preserve_rng_state, *args)

    _ckpt._checkpoint_without_reentrant_generator = without_reentrant
    _ckpt.CheckpointFunction = types.SimpleNamespace(apply=apply)


def uninstall() -> None:
    _ckpt._checkpoint_without_reentrant_generator, _ckpt.CheckpointFunction = _ORIGINAL


def _reentering(fn: Callable, modes: list, reenter: Callable[[list], ContextManager]
                ) -> Callable:
    def run(*args, **kwargs):
        with reenter(modes):
            return fn(*args, **kwargs)
    return run
