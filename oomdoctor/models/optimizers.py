"""The optimizers ``--optimizer NAME`` builds, as a training script would (defaults as the
libraries ship them: on CUDA, torch's optimizers pick their foreach implementation, which
oomdoctor.sim.emulate applies in the trace).
"""
from __future__ import annotations

import torch

from oomdoctor.configs import OPTIMIZERS, install_hint


def build_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The ``--optimizer`` override."""
    params = [p for p in model.parameters() if p.requires_grad]
    name = name.lower()
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4)
    if name == "adamw-fused":
        # The HF Trainer's default on torch >= 2.8 (transformers/training_args.py: optim=
        # "adamw_torch_fused"): one kernel per parameter group, no foreach temporaries.
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-4)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-2)
    if name == "adafactor":
        # Factored second moments (a row and a column vector per matrix), no first moment:
        # torch/optim/_adafactor.py. Its scalar reads are answered in the trace (trace.py).
        return torch.optim.Adafactor(params, lr=1e-2)
    if name.startswith("torchao-"):
        # HF Trainer's optim="adamw_torch_8bit" / "adamw_torch_4bit": block-quantized state
        # (uint8 codes, or two 4-bit codes per byte, and an fp32 scale per block).
        try:
            from torchao import optim as ao
        except ImportError:
            raise ValueError(f"--optimizer {name} needs torchao: {install_hint('ao')}"
                             ) from None
        return {"torchao-adamw8bit": ao.AdamW8bit, "torchao-adamw4bit": ao.AdamW4bit}[name](
            params, lr=1e-4)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
