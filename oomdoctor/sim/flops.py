"""FLOPs of the ops a trace sees, by PyTorch's own formulas.

``torch.utils.flop_counter`` holds a formula per ATen op (matmuls, convolutions, the fused
attention kernels); ``FlopCounterMode`` applies them to each op it sees. A trace already sees
every op in order, so it applies the same formulas itself (:func:`op_flops`) instead of stacking
one more dispatch mode. The counts feed the step-time model (oomdoctor.plans.recommend.cost),
which the multi-GPU layout counts with FlopCounterMode: the same formulas on the same ops.
"""
from __future__ import annotations

from typing import Any

from torch.utils import flop_counter


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """The FLOPs of one ATen op call (0 for ops without a formula: elementwise work, views)."""
    formula = flop_counter.flop_registry.get(getattr(func, "_overloadpacket", None))
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))
