"""What every family's diagnosis uses: the log's context, the collector of causes and fixes, fix ranking."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .draft import _Draft
from .results import Diagnosis, Fix, Kind, Phase
from .sizes import MiB, format_bytes

_F = format_bytes

# Costs order fixes that buy the same: 0 free, 1 a little slower or a code change,
# 2 real setup work or a quality risk, 3 much slower.
_SPEED_NONE = "none"
_QUALITY_NONE = "none"

# The CUDA context and loaded kernels live outside the allocator: "hundreds of MiB to ~1.3 GiB
# depending on GPU, driver, CUDA version and lazy loading (CUDA_MODULE_LOADING=LAZY, CUDA >= 11.7); the
# Hugging Face transformers guide "Model training anatomy" measures 1343 MB of CUDA kernels on a
# V100 before any tensor exists. Memory outside the allocator beyond this margin is something else.
_CONTEXT_MARGIN = 1536 * MiB

# Bytes per trainable parameter for weights + gradients + AdamW state: 4+4+8 in fp32, 2+2+12 with
# bf16/fp16 mixed precision and fp32 master weights - 16 either way (ZeRO, Rajbhandari et al.
# 2020, arXiv:1910.02054, section 3.1). Frozen parameters: weights only, assumed 16-bit.
_STATE_BYTES_TRAINABLE = 16
_STATE_BYTES_FROZEN = 2
# AdamW keeps 8 B/param of state (two fp32 moments, torch/optim/adamw.py), 8-bit Adam 2 B/param
# (two 8-bit moments: Dettmers et al. 2021, arXiv:2110.02861).
_ADAM8BIT_SAVING = 6


@dataclass
class _Ctx:
    facts: dict[str, int]
    world: int | None
    kinds: set[Kind]
    memory_ranks: list[int]
    gpu_model: str | None = None     # the GPU model the log names anywhere


class _Out:
    """Collects one finding's diagnosis, fixes, notes and derived numbers."""

    def __init__(self) -> None:
        self.diagnosis: list[Diagnosis] = []
        self.notes: list[str] = []
        self.derived: dict[str, int] = {}
        self.shortfall: int | None = None
        self.held: int | None = None      # what the process holds on the device, when stated
        self._fixes: dict[str, tuple[Fix, int, bool, int]] = {}

    def diag(self, cause: str, text: str) -> None:
        if all(d.cause != cause for d in self.diagnosis):
            self.diagnosis.append(Diagnosis(cause, text))

    def fix(self, fid: str, title: str, effect: int | None, bound: str | None, speed: str, quality: str,
            detail: str, cost: int, primary: bool = False) -> None:
        if fid in self._fixes:
            return
        if effect is not None and effect <= 0:
            effect, bound = None, None
        self._fixes[fid] = (Fix(fid, title, effect, bound if effect is not None else None, speed, quality, detail),
                            cost, primary, len(self._fixes))

    def ranked(self) -> tuple[Fix, ...]:
        """Fixes for the diagnosed cause first (unless their known effect falls short of what is
        missing), then fixes that cover the shortfall, then the rest by what they are expected to
        buy; ties go to the cheaper fix. A fix whose stated effect ("about" or "up to") is smaller
        than the shortfall cannot fix the error on its own: its text says so, and it goes after every
        fix that can - one that covers it, one whose lower bound ("at least") or unknown effect may -
        so the order does not depend on whether a traceback sized the other fixes. An unknown effect
        cannot exceed what the process holds on the device, so when the shortfall is larger than
        that and no fix covers it, nothing can on its own and the order stays by expected effect."""
        need = self.shortfall if self.shortfall and self.shortfall > 0 else None

        def short(fix: Fix) -> bool:
            return (need is not None and fix.effect_bytes is not None and fix.effect_bound != "at least"
                    and fix.effect_bytes < need)

        fixes = [item[0] for item in self._fixes.values()]
        unknown_may = need is not None and (self.held is None or need <= self.held)
        demote = any(not short(f) and (f.effect_bytes is not None or unknown_may) for f in fixes)

        def key(item: tuple[Fix, int, bool, int]) -> tuple:
            fix, cost, primary, order = item
            eff = fix.effect_bytes
            enough = eff is None or need is None or eff >= need
            if demote and short(fix):
                group = 4
            elif primary and enough:
                group = 0
            elif eff is not None and need is not None and eff >= need:
                group = 1
            elif eff is not None:
                group = 2
            else:
                group = 3
            if group == 3:
                return (group, cost, order)
            return (group, -_expected(fix), cost, order)

        ranked = []
        for fix, *_ in sorted(self._fixes.values(), key=key):
            if short(fix):
                missing, frees = _F(need or 0), f"{fix.effect_bound} {_F(fix.effect_bytes or 0)}"
                fix = replace(fix, title=f"{fix.title} - not enough on its own ({frees} of the {missing} missing)",
                              detail=(fix.detail + " " if fix.detail else "") + f"On its own this cannot cover "
                              f"the shortfall: it frees {frees} and {missing} was missing, so "
                              + ("use a fix above, or this one together with another." if demote else
                                 "combine it with others."))
            ranked.append(fix)
        return tuple(ranked)

    def ordered_diagnosis(self) -> tuple[Diagnosis, ...]:
        """The most explanatory cause first; phase remarks and side observations last."""
        return tuple(sorted(self.diagnosis, key=lambda d: _CAUSE_ORDER.get(d.cause, 50)))


# Causes in the order they explain an error: one that makes the others moot comes first.
_CAUSE_ORDER = {name: i for i, name in enumerate((
    "consequence_of_oom", "windows_shared_memory_spill", "request_absurd", "request_exceeds_capacity", "model_states_exceed_card",
    "memory_fraction_limit", "other_process", "evaluation_without_no_grad", "invisible_process",
    "outside_allocator", "non_pytorch_memory", "gpu_full_at_start", "all_ranks_on_one_gpu", "fragmentation",
    "free_but_unusable", "huge_single_allocation", "model_or_batch_too_big", "card_full",
    "container_pid_namespace",
))}


def _expected(fix: Fix) -> float:
    """What a fix is expected to buy, for ranking: an upper bound ("up to") is often not reached
    and a lower bound ("at least") is often exceeded, so they are weighted accordingly."""
    if fix.effect_bytes is None:
        return 0.0
    return fix.effect_bytes * {"up to": 0.5, "at least": 1.5}.get(fix.effect_bound or "", 1.0)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "?"


def _where(d: _Draft) -> str:
    return f"GPU {d.gpus[0]}" if d.gpus else "the GPU"


def _training_phase(phase: Phase | None) -> bool:
    return phase in (None, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER_STEP)


def _model_states(ctx: _Ctx) -> tuple[int | None, int | None]:
    trainable = ctx.facts.get("trainable_params")
    total = ctx.facts.get("total_params")
    if trainable is None:
        trainable = total
    if trainable is None:
        return None, None
    frozen = total - trainable if total is not None and total > trainable else 0
    return trainable, _STATE_BYTES_TRAINABLE * trainable + _STATE_BYTES_FROZEN * frozen
