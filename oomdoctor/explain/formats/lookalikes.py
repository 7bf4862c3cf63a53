"""Look-alikes that are not out-of-memory errors: illegal memory access, device-side assert, misaligned address."""
from __future__ import annotations

import re

from ..diagnosis import _QUALITY_NONE, _Ctx, _Out
from ..draft import _Draft
from ..results import Kind, Phase
from .patterns import _I, _AnchorSpec

# --- message anchors (squashed text) ---------------------------------------------------------

_ANCHORS: tuple[_AnchorSpec, ...] = (
    _AnchorSpec(Kind.ILLEGAL_MEMORY_ACCESS, ("illegalmemoryaccess", "illegaladdress"), re.compile(
        r"anillegalmemoryaccesswasencountered|cudaErrorIllegalAddress", _I), absorb=400),
    _AnchorSpec(Kind.DEVICE_ASSERT, ("device-sideassert", "cudaerrorassert"),
                re.compile(r"device-sideasserttriggered|cudaErrorAssert", _I), absorb=400),
    # The kernel's own report, printed once per failing thread before the RuntimeError (which a
    # pasted excerpt may leave out): "Loss.cu:103: nll_loss_forward_kernel: block: [5,0,0],
    # thread: [996,0,0] Assertion `t >= 0 && t < n_classes` failed."
    _AnchorSpec(Kind.DEVICE_ASSERT, ("assertion",), re.compile(
        r"\.cuh?:\d+:(?:\w+:)?block:\[[\d,]+\],thread:\[[\d,]+\]Assertion`", _I), fallback=True),
    _AnchorSpec(Kind.MISALIGNED_ADDRESS, ("misaligned",),
                re.compile(r"misalignedaddress|cudaErrorMisalignedAddress", _I), absorb=400),
)


# --- field patterns --------------------------------------------------------------------------

_F_ASSERT = re.compile(r"Assertion`(.{1,120}?)`failed")
_ASSERT_TEXT = re.compile(r"Assertion `(.{1,200}?)` failed")


# --- extractor: squashed message text -> draft -----------------------------------------------

def _x_assert(span: str, pre: str, m: re.Match) -> _Draft:
    d = _Draft(Kind.DEVICE_ASSERT)
    a = _F_ASSERT.search(pre + span)
    if a:
        d.details["assertion"] = a.group(1)
    d.sig = ()
    return d


# --- diagnosis -------------------------------------------------------------------------------

_ASSERT_HINTS = (
    ("n_classes", "a target label is outside [0, num_classes): check the labels and the model's output size"),
    ("srcIndex<srcSelectDimSize", "an index (a token id, usually) is >= the embedding size: check vocab size vs "
                                  "tokenizer, and padding ids"),
    ("index out of bounds", "an index is out of range for the tensor it indexes"),
    ("input_val>=zero&&input_val<=one", "binary cross-entropy got values outside [0, 1]: apply a sigmoid or use "
                                        "BCEWithLogitsLoss"),
)


def _diag_lookalike(d: _Draft, ctx: _Ctx, phase: Phase | None, no_grad: bool, out: _Out) -> None:
    if d.kind is Kind.DEVICE_ASSERT:
        assertion = d.details.get("assertion", "")
        hint = next((h for key, h in _ASSERT_HINTS if key.lower() in assertion.replace(" ", "").lower()),
                    "usually an index or label out of range")
        out.diag("not_oom_device_assert", f"A CUDA kernel's assertion failed - not a memory problem: {hint}.")
    elif d.kind is Kind.ILLEGAL_MEMORY_ACCESS:
        out.diag("not_oom_illegal_access", "A kernel read or wrote outside its memory - not a shortage of memory: "
                 "an out-of-range index, a bug in a custom/compiled kernel, or a library/driver bug.")
    else:
        out.diag("not_oom_misaligned", "A kernel used a misaligned pointer - not a shortage of memory: usually a "
                 "custom or fused kernel given a non-contiguous or oddly offset tensor.")
    out.fix("launch_blocking", "Rerun with CUDA_LAUNCH_BLOCKING=1 to get the real failing line, or run one step "
            "on the CPU for a readable Python error", None, None, "slower while debugging", _QUALITY_NONE,
            "CUDA reports errors asynchronously; the traceback shown may point at a later, innocent call. After "
            "this error the CUDA context is unusable - restart the process.", cost=0, primary=True)
