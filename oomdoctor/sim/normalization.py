"""CUDA batch norm's fp32 copy of a large 16-bit input.

    oomdoctor estimate torchvision:resnet50 -b 3312 --precision bf16 --gpu h200   # 10.6 GB each

A 16-bit input of more elements than 32-bit indexing reaches (2**31 - 1) leaves cuDNN's batch
norm for ATen's own kernels, whose training forward takes an fp32 copy of the whole input from
the caching allocator for the statistics and frees it before the op returns. Measured on an
H200 (torch 2.11, benchmarks/results/newpaths/traces/torchvision_resnet50-bf16-ck0-b3312-*):
10,635,706,368 bytes, exactly four bytes per element, in each of the five batch norms of
ResNet-50's forward whose input is that large (the stem's and layer 1's at 56x56 with 256
channels), none in the backward and none below the limit. No ATen output, so no trace sees it:
:func:`upcast_bytes` sizes it and ``oomdoctor.plans.estimate.device_events`` adds it.

Known limitations: measured for bf16 in the channels-first layout only (fp16 is taken to do
the same); not on ROCm.
"""
from __future__ import annotations

import torch

_INT32_MAX = 2**31 - 1


def upcast_elements(name: str, args: tuple) -> int:
    """The elements of a 16-bit training ``native_batch_norm`` call's input (what its fp32 copy
    would hold), 0 for any other op: whether CUDA takes the copy depends on the batch
    (:func:`upcast_bytes`), which the probe changes after tracing."""
    if name != "native_batch_norm.default" or len(args) < 6 or not args[5]:
        return 0
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16):
        return 0
    return x.numel()


def upcast_bytes(elements: int) -> int:
    """The fp32 copy of an input of ``elements``: taken beyond 32-bit indexing only."""
    return elements * 4 if elements > _INT32_MAX else 0
