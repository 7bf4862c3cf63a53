"""What would fit when nothing does: more GPUs (counted with the strategy estimator), a lighter
or fused optimizer, CPU offload - each with its numbers."""
from __future__ import annotations

from typing import Callable

from oomdoctor.configs import leanest_precision
from oomdoctor.plans.estimate import Budget
from oomdoctor.plans.parallel import (Layout, StrategyEstimate, Strategy,
                                      estimate_strategy)
from oomdoctor.plans.recommend.facts import _Facts, floor_bytes
from oomdoctor.plans.recommend.machine import Hardware
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.sim.trace import Trace

Progress = Callable[[str], None]


def zero3_extra(by_strategy: tuple[StrategyEstimate, ...]) -> int | None:
    """What the traced configuration holds besides model states (activations, temporaries,
    allocator overhead) on ZeRO-3's fullest GPU; None when it was not traced."""
    zero3 = [e for e in by_strategy if e.strategy == "zero3"]
    if not zero3:
        return None
    g = max(zero3[0].gpus, key=lambda g: g.peak_reserved_bytes)
    return g.peak_reserved_bytes - g.model_state_bytes


def _more_gpus(trace: Trace, layout: Layout, hw: Hardware, budget: Budget,
               alloc: AllocatorConfig, progress: Progress) -> str | None:
    """The fewest GPUs over which ZeRO-3 fits the traced configuration, each count estimated
    as the tables are (every sharded state, the foreach temporaries that shard with it, the
    allocator): N fits and N - 1 does not, both shown. None past MAX_GPUS."""
    world = hw.num_gpus * hw.nodes
    cfg = trace.config
    tried: dict[int, StrategyEstimate] = {}

    def at(n: int) -> StrategyEstimate:
        if n not in tried:
            tried[n] = estimate_strategy(trace, layout, Strategy("zero3", n), budget, alloc,
                                         grad_accum=cfg.grad_accum)
        return tried[n]
    progress(f"counting the GPUs ZeRO-3 needs at {cfg.precision}, micro-batch "
             f"{cfg.batch_size}")
    gib = 2**30
    label = f"{cfg.precision}{' + checkpointing' if cfg.checkpointing else ''}"
    if at(world).fits:      # a strategy left out of the search (--strategy) fits as it is
        return (f"ZeRO-3/FSDP on these {world} GPUs: {at(world).peak_device_bytes / gib:.1f} "
                f"GiB on the fullest GPU ({label}, micro-batch {cfg.batch_size})")
    lo, hi = world, world + 1           # lo: does not fit
    while not at(hi).fits:
        if hi >= MAX_GPUS:
            return None
        lo, hi = hi, min(2 * hi, MAX_GPUS)
    while hi - lo > 1:                  # fitting is monotone in N: more shards, less each
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if at(mid).fits else (mid, hi)
    fit, short = at(hi), at(hi - 1)
    # device peaks (reserved + CUDA context), against what a GPU may hold in the same terms
    most = budget.limit_bytes + budget.cuda_context_bytes
    return (f"more GPUs: ZeRO-3/FSDP over {hi} x {hw.gpu.name} fits: "
            f"{fit.peak_device_bytes / gib:.1f} GiB on the fullest GPU ({label}, micro-batch "
            f"{cfg.batch_size}, estimated as the tables are); over {hi - 1} it needs "
            f"{short.peak_device_bytes / gib:.1f} GiB, more than the {most / gib:.1f} GiB a GPU "
            f"may hold (the {budget.limit_bytes / gib:.1f} GiB allocator budget and the CUDA "
            "context)")


def _more_gpus_by_model_states(facts: _Facts, hw: Hardware, limit: int, precision: str
                               ) -> str | None:
    """Without a trace: the GPU count at which ZeRO-3's model states alone fit - a lower
    bound, and said to be one."""
    for n in range(hw.num_gpus * hw.nodes + 1, MAX_GPUS + 1):
        need = floor_bytes(facts, precision, Strategy("zero3", n))
        if need <= limit:
            return (f"more GPUs: ZeRO-3/FSDP over at least {n} x {hw.gpu.name}: its model "
                    f"states alone need about {need / 2**30:.1f} GiB per GPU ({precision}); "
                    "activations and temporaries come on top - not traced here")
    return None


# The most GPUs "what would fit" looks at: past this, the answer is another plan, not more cards.
MAX_GPUS = 64


def what_would_fit(facts: _Facts, hw: Hardware, budget: Budget, alloc: AllocatorConfig,
                  allowed: list[str], by_strategy: tuple[StrategyEstimate, ...],
                  reference: tuple[Trace, Layout] | None, progress: Progress) -> list[str]:
    """What would fit when nothing does, each with its numbers."""
    out = []
    lim = budget.limit_bytes
    p = leanest_precision(allowed)
    # What the traced configuration holds besides model states (activations, temporaries,
    # allocator overhead) on the leanest strategy: a realistic margin for the suggestions.
    extra = zero3_extra(by_strategy) or 0
    zero3 = [e for e in by_strategy if e.strategy == "zero3"]
    world = hw.num_gpus * hw.nodes
    more = (_more_gpus(*reference, hw, budget, alloc, progress) if reference is not None
            else _more_gpus_by_model_states(facts, hw, lim, p))
    if more:
        out.append(more)
    for slots, name in ((0, "plain SGD (no momentum: no optimizer state)"),
                        (1, "SGD with momentum or Adafactor-like state (1 slot)")):
        for st in (Strategy("zero3", world),) + ((Strategy("pipeline2", 2),)
                                                 if world == 2 else ()):
            need = floor_bytes(facts, p, st, slots) + extra
            if need <= lim:
                out.append(f"a lighter optimizer: {name} with {st.name} on {world} GPUs "
                           f"needs about {need / 2**30:.1f} GiB per GPU in {p}"
                           + ("" if zero3 else " before activations"))
                break
        else:
            continue
        break
    temps = max((g.breakdown["temporaries"] for e in zero3 for g in e.gpus), default=0)
    if temps > lim // 8:
        out.append(f"a fused optimizer: torch.optim.AdamW(..., fused=True) steps without the "
                   f"foreach implementation's temporaries ({temps / 2**30:.1f} GiB per GPU at "
                   "ZeRO-3's peak here)")
    return out
