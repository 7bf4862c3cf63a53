"""The versions of the libraries a trace followed: the installed code decides the answer.

The trace runs the model's real Python code - transformers' attention and mask logic, peft's
adapters, bitsandbytes' quantized layers - so an estimate holds for the versions installed where
oomdoctor ran. Another transformers release can pick another attention path or mask (4.x asks
whether unmasked batches are padded, 5.x builds masks in ``masking_utils``), so every estimate
names them, and the docs say to install oomdoctor in the training environment.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

# The libraries whose code the trace runs and whose releases change memory; listed only when
# the traced model or optimizer is made of their classes (torch always).
TRACKED = ("torch", "transformers", "peft", "bitsandbytes")


def traced_versions(*objects: Any) -> tuple[tuple[str, str], ...]:
    """((name, version), ...) of the tracked libraries whose code the traced objects run (the
    model's modules and parameter classes, the optimizer's class), in TRACKED order; torch
    always. Decided by the objects, not by what this process happened to import before."""
    used = {"torch"}
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            classes = {type(m) for m in obj.modules()} | {type(p) for p in obj.parameters()}
        else:
            classes = {type(obj)}
        used |= {c.__module__.split(".")[0] for c in classes}
    found = []
    for name in TRACKED:
        module = sys.modules.get(name) if name in used else None
        version = getattr(module, "__version__", None) if module is not None else None
        if version:
            found.append((name, str(version)))
    return tuple(found)


def versions_text(versions: tuple[tuple[str, str], ...] | dict[str, str]) -> str:
    """'torch 2.13.0+cpu, transformers 4.40.2'."""
    items = versions.items() if isinstance(versions, dict) else versions
    return ", ".join(f"{name} {version}" for name, version in items)


def attention_note(model: Any) -> str | None:
    """What transformers' attention the traced model runs (its config's attn_implementation),
    as a note: eager keeps every layer's attention probabilities for the backward, sdpa and
    flash attention do not. None for a model without one."""
    config = getattr(model, "config", None) if model is not None else None
    attn = getattr(config, "_attn_implementation", None)
    if not isinstance(attn, str):
        return None
    return (f"attention: {attn} (transformers' attn_implementation; --attn "
            "eager|sdpa|flash_attention_2 for a Hugging Face id or config)")


def weights_note(model: Any) -> str | None:
    """Which dtype a Hugging Face model's weights were loaded in, and why (the note its builder
    left: oomdoctor.models.huggingface.loaded_dtype). None for other models."""
    note = getattr(model, "_oomdoctor_weights_note", None) if model is not None else None
    return note if isinstance(note, str) and note else None


def weight_dtypes(params) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The dtypes of the trainable and of the frozen weights (bitsandbytes' packed 4-bit
    storage reads as its container dtype, uint8 by default)."""
    seen: tuple[dict, dict] = ({}, {})
    for p in params:
        seen[0 if p.requires_grad else 1][str(p.dtype).removeprefix("torch.")] = None
    return tuple(seen[0]), tuple(seen[1])
