"""The longest context that fits: for a text model given as a Hugging Face id or config, the
largest sequence length each configuration trains at a given batch size (``oomdoctor probe
MODEL --seq-len max``).

    oomdoctor probe Qwen/Qwen2.5-0.5B --seq-len max -b 1 --gpu rtx3090

Memory grows with the sequence length affinely with a fused attention kernel and with its
square with the math kernel, so the batch probe's affine extrapolation does not carry over.
Each length is traced for real. The search grows from 256 tokens - doubling, then jumping to
where the line through two traced peaks meets the budget - until a length does not fit (or
the model's ``max_position_embeddings`` is reached), then narrows the gap between the longest
length that fits and the shortest that does not to 64 tokens, interpolating and bisecting in
turn: usually six to ten traces per configuration.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.plans.estimate import Budget, estimate
from oomdoctor.models import huggingface, vision
from oomdoctor.models.loader import load_model
from oomdoctor.models.spec import ModelFileError, ModelSpec
from oomdoctor.sim.trace import TraceConfig

STEP = 64                 # lengths are multiples of this (tensor-core friendly)
START = 256
MAX_TRACES = 14           # per configuration; the answer is then "at least"


@dataclass(frozen=True)
class ContextResult:
    precision: str
    checkpointing: bool
    max_seq_len: int | None          # None: not even STEP tokens fit
    limited_by: str                  # "memory" or "max_position_embeddings"
    peak_reserved_bytes: int | None  # at max_seq_len
    exact: bool                      # False: the search stopped within `gap` tokens
    gap: int
    traces: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ContextProbe:
    model: str
    gpu: str
    batch_size: int
    budget_bytes: int
    max_position_embeddings: int
    results: tuple[ContextResult, ...]

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.gpu, "batch_size": self.batch_size,
                "budget_bytes": self.budget_bytes,
                "max_position_embeddings": self.max_position_embeddings,
                "results": [r.to_json() for r in self.results]}


def longest_context(spec: ModelSpec, base: TraceConfig, budget: Budget,
                    configs: list[tuple[str, bool]], alloc: AllocatorConfig = AllocatorConfig(),
                    progress: Callable[[str], None] = lambda _: None) -> ContextProbe:
    """The longest sequence that fits at ``base.batch_size``, per (precision, checkpointing).
    ``spec`` must come from a Hugging Face id or config (its length is rebuilt per trial)."""
    if spec.origin is None or spec.origin[0].endswith(".py") or vision.is_vision(spec.origin[0]):
        raise ModelFileError(f"{spec.name}: --seq-len max needs a Hugging Face id or config; "
                             "a model file makes its own batch (probe it at its length)")
    source, task, attn, dtype = spec.origin[0], spec.origin[1], spec.origin[6], spec.origin[7]
    cap = huggingface.max_tokens(source)
    results = []
    for precision, ckpt in configs:
        cfg = dataclasses.replace(base, precision=precision, checkpointing=ckpt)
        label = f"{precision}{' + checkpointing' if ckpt else ''}"

        def trial(tokens: int) -> tuple[bool, int]:
            at = load_model(source, task=task, seq_len=tokens, adapters=spec.adapters,
                            attn=attn, weights_dtype=dtype)
            progress(f"{label}: tracing {tokens} tokens")
            e = estimate(at, cfg, budget, alloc)
            return e.fits, e.peak_reserved_bytes
        results.append(_search(trial, cap, precision, ckpt, budget.limit_bytes))
        r = results[-1]
        progress(f"{label}: longest context {r.max_seq_len} tokens ({r.traces} traces)")
    name = (spec.label or spec.name).split(" (")[0] + (spec.adapters.label if spec.adapters
                                                        else "")
    return ContextProbe(name, budget.gpu.name, base.batch_size, budget.limit_bytes, cap,
                        tuple(results))


def _search(trial: Callable[[int], tuple[bool, int]], cap: int, precision: str, ckpt: bool,
            limit: int) -> ContextResult:
    seen: dict[int, tuple[bool, int]] = {}

    def run(tokens: int) -> tuple[bool, int]:
        if tokens not in seen:
            seen[tokens] = trial(tokens)
        return seen[tokens]

    def result(best: int | None, by: str, exact: bool = True, gap: int = 0) -> ContextResult:
        return ContextResult(precision, ckpt, best, by, seen[best][1] if best else None,
                             exact, gap, len(seen))
    # Grow until a length does not fit (or the cap does): from two lengths that fit, straight
    # to where the line through their peaks meets the budget (at most 4x further), else 2x.
    lo, hi = None, None
    n = min(START, cap)
    while True:
        fits, peak = run(n)
        if not fits:
            hi = n
            break
        prev, lo = lo, n
        if n >= cap:
            return result(cap, "max_position_embeddings")
        nxt = 2 * n
        if prev is not None and peak > seen[prev][1]:
            slope = (peak - seen[prev][1]) / (n - prev)
            nxt = min(4 * n, max(n + STEP, int(n + (limit - peak) / slope) // STEP * STEP))
        n = min(nxt, cap)
    if lo is None:                    # START does not fit: walk down
        n = hi
        while n > STEP:
            n = max(STEP, (n // 2) // STEP * STEP)
            if run(n)[0]:
                lo = n
                break
            hi = n
        if lo is None:
            return result(None, "memory")
    # Narrow: interpolate the traced peaks (affine with fused attention, but the allocator's
    # rounding makes them steps), alternating with bisection so that the gap at least halves
    # every second trace; always strictly inside the gap.
    narrowing = 0
    while hi - lo > STEP:
        if len(seen) >= MAX_TRACES:
            return result(lo, "memory", exact=False, gap=hi - lo)
        (_, p_lo), (_, p_hi) = seen[lo], seen[hi]
        if narrowing % 2 == 0:
            guess = lo + (hi - lo) * (limit - p_lo) / max(p_hi - p_lo, 1)
        else:
            guess = (lo + hi) / 2
        narrowing += 1
        n = int(guess) // STEP * STEP
        n = min(max(n, lo + STEP), hi - STEP)
        if run(n)[0]:
            lo = n
        else:
            hi = n
    return result(lo, "memory")


def render_text(p: ContextProbe) -> str:
    from tabulate import tabulate
    rows = []
    for r in p.results:
        cfg = f"{r.precision}{' + ckpt' if r.checkpointing else ''}"
        if r.max_seq_len is None:
            rows.append((cfg, f"< {STEP}", "memory", "-", r.traces))
            continue
        tokens = f"{r.max_seq_len}" + ("" if r.exact else f" (+{r.gap} unsearched)")
        limit = ("the model's maximum" if r.limited_by == "max_position_embeddings"
                 else "memory")
        rows.append((cfg, tokens, limit, f"{r.peak_reserved_bytes / 2**30:.2f}", r.traces))
    head = (f"{p.model} on {p.gpu}: longest sequence at batch {p.batch_size}, "
            f"{p.budget_bytes / 2**30:.2f} GiB for the allocator "
            f"(max_position_embeddings {p.max_position_embeddings})")
    table = tabulate(rows, headers=("config", "max tokens", "limited by", "reserved GiB",
                                    "traces"), colalign=("left", "right", "left", "right",
                                                         "right"))
    return f"{head}\n{table}\n(lengths are multiples of {STEP} tokens)"
