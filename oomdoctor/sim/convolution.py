"""The workspaces cuDNN's convolutions take from the caching allocator.

    oomdoctor estimate sample_models/resnet_cnn.py -b 256 --gpu h200   # one per conv and pass

On CUDA, ``cudnn_convolution`` and its backward (aten/src/ATen/native/cudnn/Conv_v8.cpp) run
the plan cuDNN's heuristics pick and allocate that plan's workspace through the caching
allocator for the length of the call: after the output (forward), after the input's gradient
(the data pass), after the weight's gradient (the weight pass), each freed before the op
returns. No ATen op outputs it, so no trace sees it; at a large batch it is the size of the
activations - 10 GiB in a ResNet stem's forward at batch 4096 on an H200 - and its cached
segment decides the reserved peak.

The size is the plan's, which cuDNN chooses at run time; :func:`workspace_bytes` is the rule
measured on an H200 (cuDNN 9.19, torch 2.11; benchmarks/cudnn_conv.py: ten shapes at batches 2
to 1024 and ResNet-50's twelve 1x1 shapes at 64 and 512, fp32 and bf16:
benchmarks/results/cudnn_conv/). On tensor-core cards cuDNN's kernels are channels-last, and a
channels-first convolution stages its operands in the workspace: the input with its channels
padded to the kernel's vector width (4 for TF32, 8 for 16 bits; only a 3-channel image is
short of it), the output (or the output's gradient) and the filter, plus a 16-byte tail (a
KiB in the weight pass). A 1x1 convolution stages input and output only, and only where its
plan is the channels-last one (:func:`_pointwise`). One operand holds at most 2**31 - 1
elements, so a large batch is staged in pieces (a ResNet stem at batch 4096 stages 2674
samples). On the measurements the rule is exact for 94 of 128 forwards and 98 of 104 data
passes and never more than 8.4 MB low; where cuDNN picked a plan that stages less (some first
layers, fp32 3x3 at small batches) it errs high. The weight pass's split-K partial sums (0 to
25 MB, per plan) are left out. Held out, the calibration's ResNet-18 and ViT-B/16 training
runs agree to 0.0-2.5% reserved at batches 1-4 and ViT's at 4096, and torchvision's
ResNet-50 runs out of memory where the probe says it does not fit (batch 3312 in bf16, 1712
in fp32; without the 1x1 rule it said both fit); at a ResNet-18's batch 4096 some layers' plans
differ (-11% to +19% reserved).

Known limitations: measured on Hopper only and applied to NVIDIA cards of compute capability
8.0 and newer (TF32 and 16-bit tensor cores); older cards and ROCm's MIOpen get none. Only 2-D
convolutions with one group (depthwise and grouped ones take other kernels) and not
transposed. ``torch.backends.cudnn.benchmark=True`` first tries every plan with one workspace
as large as the free memory allows, then empties the cache: not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

import torch

_TAIL = 16                       # past the staged operands (fwd and data pass)
_WEIGHT_TAIL = 1024              # the weight pass's, rounded up (144-751 bytes measured)
_MAX_ELEMENTS = 2**31 - 1        # int32 indexing: the most elements staged per operand
_DTYPES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


@dataclass(frozen=True)
class ConvCall:
    """One cuDNN convolution pass, as the trace saw it (per-sample sizes in elements)."""

    role: str                    # "forward", "data" (grad input) or "weight" (grad weight)
    itemsize: int
    batch: int
    in_channels: int
    out_channels: int
    kernel: int                  # elements of one filter plane (kh * kw)
    strided: bool                # a stride over 1
    in_plane: int                # elements of one input channel (h * w)
    out_plane: int               # of one output channel


def conv_calls(name: str, args: tuple, kwargs: dict) -> dict[int, ConvCall]:
    """The cuDNN passes of a ``convolution`` / ``convolution_backward`` call, by the index of
    the output each follows; {} for any other op or a convolution the rule does not cover."""
    if name == "convolution.default":      # input, weight, bias, stride, padding, dilation,
        call = _forward(*args[:2], *args[3:7], args[8])   # transposed, _, groups
        return {0: call} if call else {}
    if name != "convolution_backward.default":
        return {}
    # grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, _, groups,
    # output_mask
    call = _forward(*args[1:3], *args[4:8], args[9])
    if call is None:
        return {}
    mask = args[10] if len(args) > 10 else kwargs.get("output_mask", (True, True, True))
    out = {}
    if mask[0]:
        out[0] = replace(call, role="data")
    if mask[1]:
        out[1] = replace(call, role="weight")
    return out


def _forward(x, w, stride, padding, dilation, transposed, groups) -> ConvCall | None:
    """The forward pass of a convolution the rule covers (2-D, one group, not transposed)."""
    if (not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() != 4
            or transposed or groups != 1 or x.dtype not in _DTYPES):
        return None
    kernel = prod(w.shape[2:])
    out = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, s, p, d in
           zip(x.shape[2:], w.shape[2:], _pair(stride), _pair(padding), _pair(dilation))]
    return ConvCall("forward", _DTYPES[x.dtype], x.shape[0], x.shape[1], w.shape[0], kernel,
                    _pair(stride) != (1, 1), x.shape[2] * x.shape[3], out[0] * out[1])


def _pair(v) -> tuple[int, int]:
    v = tuple(v) if isinstance(v, (list, tuple)) else (v,)
    return (v[0], v[-1])


def workspace_bytes(call: ConvCall, batch: int | None = None) -> int:
    """The workspace of one pass at ``batch`` (the traced one by default; the probe
    extrapolates): 0 where the rule takes none."""
    width = 4 if call.itemsize == 4 else 8           # TF32 / 16-bit vector width
    padded = -(-call.in_channels // width) * width
    x_sample, y_sample = padded * call.in_plane, call.out_channels * call.out_plane
    n = call.batch if batch is None else batch
    staged = min(n, max(1, _MAX_ELEMENTS // max(x_sample, y_sample, 1)))
    if call.kernel == 1:
        return _pointwise(call, staged, x_sample, y_sample)
    x = staged * (x_sample if call.role != "data" else call.in_channels * call.in_plane)
    ws = (x + staged * y_sample + call.out_channels * padded * call.kernel) * call.itemsize
    return ws + (_WEIGHT_TAIL if call.role == "weight" else _TAIL)


def _pointwise(call: ConvCall, staged: int, x_sample: int, y_sample: int) -> int:
    """A 1x1 convolution (benchmarks/results/cudnn_conv/*-pointwise.json, ResNet-50's shapes):
    input and output staged, no filter, where cuDNN's plan is the channels-last one - stride 2,
    a 7x7 output plane, or a 16-bit one with at least 1024 x 512 channels on a 14x14 plane - and
    a few hundred bytes otherwise; at stride 2 an fp32 56x56 input stages the filter instead of
    the output. The weight pass of a plan that stages none keeps one partial filter per sample
    in fp32."""
    stages = call.strided or call.out_plane <= 49 or (
        call.itemsize == 2 and call.out_plane <= 196
        and call.in_channels * call.out_channels >= 1 << 19)
    if not stages:
        return staged * call.in_channels * call.out_channels * 4 if call.role == "weight" else 0
    second = staged * y_sample
    if call.strided and call.role == "forward" and call.itemsize == 4 and call.in_plane >= 3136:
        second = call.out_channels * call.in_channels           # the filter
    return ((staged * x_sample + second) * call.itemsize
            + (_WEIGHT_TAIL if call.role == "weight" else _TAIL))
