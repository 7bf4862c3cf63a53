"""What a smoke run found: its result, the verdict against the prediction, and its text."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from oomdoctor.plans.parallel import StrategyEstimate

TOLERANCE = 0.10          # measured peak vs prediction, relative


@dataclass(frozen=True)
class MemoryCheck:
    """One GPU: measured next to predicted, bytes."""

    device: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    predicted_allocated_bytes: int | None
    predicted_reserved_bytes: int | None

    def off(self, which: str) -> float | None:
        pred = getattr(self, f"predicted_{which}_bytes")
        meas = getattr(self, f"peak_{which}_bytes")
        return None if not pred else meas / pred - 1

    @property
    def ok(self) -> bool:
        return all(o is None or abs(o) <= TOLERANCE
                   for o in (self.off("allocated"), self.off("reserved")))


@dataclass(frozen=True)
class SmokeResult:
    model: str
    strategy: str
    num_gpus: int
    precision: str                    # asked
    ran_precision: str                # run (fp16 runs as bf16 autocast on the CPU)
    checkpointing: bool
    micro_batch: int                  # asked
    ran_micro_batch: int              # run
    grad_accum: int
    steps: int
    device: str                       # cuda | cpu
    cuda_exercised: bool
    processes: int
    losses: tuple[float, ...]         # per step, averaged over ranks
    step_seconds: tuple[float, ...]
    memory: tuple[MemoryCheck, ...]
    ok: bool
    problems: tuple[str, ...]
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return smoke_json(self)


# Pure fp16 with torch's AdamW defaults: the second moment of gradients below ~5e-3 flushes
# to zero and eps=1e-8 rounds to 0, so those weights step by m/0 (configs.PURE_QUALITY). A CPU
# smoke of tiny_mlp shows it: loss 2.207, nan, nan; with eps=1e-4: 2.207, 1.751, 1.501.
FP16_PURE_NAN = ("pure fp16 has no loss scaler and fp16's range: AdamW's default eps=1e-8 "
                 "rounds to 0 in fp16 and small gradients' squares underflow, so updates are "
                 "m/0 = inf/NaN; build the optimizer with eps=1e-4 (make_optimizer), or train "
                 "with --precision fp16 (AMP + GradScaler, fp32 master weights)")


def judge(outs: list[dict[str, Any]], cuda: bool, strategy: str,
          prediction: StrategyEstimate | None, precision: str = ""
          ) -> tuple[list[MemoryCheck], list[str], list[str]]:
    """Every process's result (rank order) judged: the memory checks (CUDA only), the problems
    that fail the smoke and the notes, each in the order the report lists them."""
    problems = [f"rank {o['rank']}: {o['oom']}" for o in outs if o.get("oom")]
    notes: list[str] = []
    judge_losses(tuple(outs[0]["losses"]), problems, notes)
    if precision == "fp16-pure" and any(p.startswith("loss is not finite") for p in problems):
        notes.append(FP16_PURE_NAN)
    memory: list[MemoryCheck] = []
    if cuda:
        memory = _check_memory(outs, strategy, prediction, problems)
        if prediction is None:
            notes.append("no prediction given: peaks measured, not compared")
    return memory, problems, notes


def judge_losses(losses: tuple[float, ...], problems: list[str], notes: list[str],
                 repeated: bool = True) -> None:
    """Per-step losses: finite, and changing; on a ``repeated`` batch (a model file's smoke)
    falling, or a note (a script's fresh batches may not fall in a few steps)."""
    if losses and not all(math.isfinite(x) for x in losses):
        problems.append(f"loss is not finite: {', '.join(f'{x:.4g}' for x in losses)}")
    elif len(losses) >= 2 and all(abs(x - losses[0]) <= 1e-7 * max(1.0, abs(losses[0]))
                                  for x in losses[1:]):
        problems.append(f"loss did not change over {len(losses)} steps ({losses[0]:.6g}): is the "
                        "optimizer stepping the parameters that the loss depends on?")
    elif repeated and len(losses) >= 2 and losses[-1] >= losses[0]:
        notes.append(f"loss did not fall on a repeated batch ({losses[0]:.4g} -> "
                     f"{losses[-1]:.4g}) in {len(losses)} steps; a learning-rate warm-up or a "
                     "tiny learning rate can explain it")


def _check_memory(outs: list[dict[str, Any]], strategy: str,
                  prediction: StrategyEstimate | None, problems: list[str]) -> list[MemoryCheck]:
    """Every GPU's measured peaks next to its predicted ones, in rank and device order; a GPU
    more than :data:`TOLERANCE` off adds a problem."""
    memory = []
    index = 0
    for o in outs:
        for dev, alloc, reserved in o["memory"]:
            pred = _predicted(prediction, strategy, index)
            check = MemoryCheck(dev, alloc, reserved,
                                pred.peak_allocated_bytes if pred else None,
                                pred.peak_reserved_bytes if pred else None)
            memory.append(check)
            if not check.ok:
                problems.append(memory_problem(check))
            index += 1
    return memory


def memory_problem(check: MemoryCheck) -> str:
    """What a GPU whose measured peak is off the prediction says in the report."""
    return (f"{check.device}: measured peak {check.peak_allocated_bytes / 2**30:.2f} GiB "
            f"allocated / {check.peak_reserved_bytes / 2**30:.2f} GiB reserved is more than "
            f"{TOLERANCE:.0%} off the prediction ({check.predicted_allocated_bytes / 2**30:.2f}"
            f" / {check.predicted_reserved_bytes / 2**30:.2f} GiB)")


def _predicted(prediction: StrategyEstimate | None, strategy: str, index: int):
    if prediction is None:
        return None
    gpus = prediction.gpus
    if strategy == "dp":
        return gpus[0] if index == 0 else gpus[-1]
    return gpus[min(index, len(gpus) - 1)]


def render_text(r: SmokeResult) -> str:
    from tabulate import tabulate
    verdict = "SMOKE PASSED" if r.ok else "SMOKE FAILED"
    lines = [f"{verdict}: {r.model}, {r.strategy} x{r.num_gpus}, {r.ran_precision}"
             f"{', checkpointing' if r.checkpointing else ''}, micro-batch {r.ran_micro_batch} x "
             f"{r.grad_accum} accumulation, {r.steps} steps on "
             f"{'CUDA' if r.cuda_exercised else 'the CPU'} ({r.processes} process"
             f"{'es' if r.processes > 1 else ''})", ""]
    rows = [(i + 1, f"{loss:.5g}", f"{t * 1000:.1f}")
            for i, (loss, t) in enumerate(zip(r.losses, r.step_seconds))]
    lines.append(tabulate(rows, headers=("step", "loss", "ms"), colalign=("right",) * 3))
    if r.memory:
        lines += ["", memory_table(r.memory)]
    lines += [""] + [f"PROBLEM: {p}" for p in r.problems] + [f"note: {n}" for n in r.notes]
    return "\n".join(lines).rstrip()


def memory_table(memory: tuple[MemoryCheck, ...]) -> str:
    """Each GPU's measured peaks next to the predicted ones, GiB."""
    from tabulate import tabulate

    def gib(b: int | None) -> str:
        return "-" if b is None else f"{b / 2**30:.2f}"
    rows = [(m.device, gib(m.peak_allocated_bytes), gib(m.predicted_allocated_bytes),
             gib(m.peak_reserved_bytes), gib(m.predicted_reserved_bytes),
             "ok" if m.ok else "OFF") for m in memory]
    return tabulate(rows, headers=("GPU", "allocated", "predicted", "reserved", "predicted",
                                   f"within {TOLERANCE:.0%}"))


def smoke_json(result: Any) -> dict[str, Any]:
    """A smoke result (a model file's or a script's) as JSON: its fields, each memory check
    with how far off the prediction it was."""
    d = asdict(result)
    for m, obj in zip(d["memory"], result.memory):
        m["allocated_off"] = obj.off("allocated")
        m["reserved_off"] = obj.off("reserved")
    return d
