"""What a training script's smoke run found: its result, the verdict on the records its process
sent back (against the estimate of the same script, with CUDA), and its text."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oomdoctor.runs.smoke_result import (TOLERANCE, MemoryCheck, judge_losses, memory_problem,
                                         memory_table, smoke_json)

__all__ = ["TOLERANCE", "ScriptSmokeResult", "judge_script", "render_text", "CPU_NOTE"]

CPU_NOTE = ("no CUDA device here: ran on the CPU, the script's CUDA calls redirected to it; GPU "
            "memory was NOT measured and the CUDA code path (kernels, the caching allocator, "
            "GradScaler) was not exercised")


@dataclass(frozen=True)
class ScriptSmokeResult:
    """A script's smoke run (the keys a model file's SmokeResult shares mean the same)."""

    model: str                        # the script's file name
    command: str                      # the command line it ran with
    steps: int                        # asked (--steps)
    steps_done: int                   # optimizer steps taken
    ended: str                        # steps | script end | no step | oom
    device: str                       # cuda | cpu
    gpu: str                          # the CUDA device's name ("" on the CPU)
    cuda_exercised: bool
    processes: int
    losses: tuple[float | None, ...]  # per step: the backward()'s scalars summed (None: none)
    step_seconds: tuple[float, ...]
    memory: tuple[MemoryCheck, ...]
    ok: bool
    problems: tuple[str, ...]
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return smoke_json(self)


def judge_script(steps: list[dict[str, Any]], end: dict[str, Any], cuda: bool,
                 prediction: Any, asked: int
                 ) -> tuple[list[MemoryCheck], list[str], list[str]]:
    """The child process's records judged: ``steps`` (each a StepRecord as a dict), ``end``
    (how the run ended, its steps, with CUDA its peaks), ``prediction`` (an Estimate of the same
    script for ``asked`` steps, or None). Returns the memory checks, the problems that fail the
    smoke and the notes, in the order the report lists them."""
    problems: list[str] = []
    notes: list[str] = []
    _judge_steps(steps, end, asked, problems, notes)
    losses = tuple(r["loss"] for r in steps if r.get("loss") is not None)
    judge_losses(losses, problems, notes, repeated=False)
    if steps and not losses:
        notes.append("no step's backward() started from a scalar: no loss recorded, so "
                     "finite and moving were not checked")
    memory: list[MemoryCheck] = []
    if cuda:
        memory = _check_memory(end, prediction, problems)
        notes.append(_stop_note(asked) if prediction is not None else
                     "no prediction given: peaks measured, not compared")
    else:
        notes += _cpu_notes(end)
    if end.get("skipped"):
        notes.append(f"the GradScaler skipped the update of {end['skipped']} step(s) "
                     "(inf/NaN gradients at its loss scale); they count as steps, as in "
                     "oomdoctor's estimate")
    return memory, problems, notes


def _judge_steps(steps: list[dict[str, Any]], end: dict[str, Any], asked: int,
                 problems: list[str], notes: list[str]) -> None:
    """How the run ended: an OOM, no optimizer step, or fewer steps than asked."""
    ended, done = end["ended"], len(steps)
    if ended == "oom":
        problems.append(f"CUDA out of memory at step {done + 1}: {end.get('message', '')}")
    elif ended == "no step":
        problems.append(f"{end.get('message', 'no optimizer step')}: smoke counts "
                        "optimizer.step() calls, so the script must reach one - check that "
                        "it trains with these arguments")
    elif done == 0:
        problems.append("the script ended without an optimizer step: smoke counts "
                        "optimizer.step() calls after a backward() - check that it trains with "
                        "these arguments")
    elif ended == "script end" and done < asked:
        notes.append(f"the script ended after {done} of {asked} optimizer steps (its data or "
                     "its own step count ran out): pass fewer --steps, or give it more")


def _check_memory(end: dict[str, Any], prediction: Any,
                  problems: list[str]) -> list[MemoryCheck]:
    """The GPU's measured peaks next to the estimate's; more than TOLERANCE off is a problem."""
    memory = []
    for device, allocated, reserved in end.get("memory", ()):
        check = MemoryCheck(device, int(allocated), int(reserved),
                            prediction.peak_allocated_bytes if prediction else None,
                            prediction.peak_reserved_bytes if prediction else None)
        memory.append(check)
        if not check.ok:
            problems.append(memory_problem(check))
    return memory


def _stop_note(asked: int) -> str:
    """Why the measured and the predicted peaks are comparable."""
    return (f"measured: torch.cuda.max_memory_allocated/reserved from the script's start to "
            f"its stop, at its next forward or backward after optimizer step {asked}; "
            f"predicted: `oomdoctor estimate --steps {asked}` of the same command, whose run of "
            "the script stops at the same point")


def _cpu_notes(end: dict[str, Any]) -> list[str]:
    """What the CPU run did not check, and what it ran instead of the script's CUDA calls."""
    notes = [CPU_NOTE]
    if end.get("autocast") and end.get("cpu_autocast"):
        notes.append(f"the script's CUDA autocast ({', '.join(end['autocast'])}) ran as CPU "
                     f"autocast in {end['cpu_autocast']}")
    elif end.get("autocast"):
        notes.append(f"the script's CUDA autocast ({', '.join(end['autocast'])}) ran in fp32: "
                     "this CPU has no fast bf16 (no AVX512_BF16/AMX), where a bf16 matmul is "
                     "emulated and many times slower; the smoke checks that the loop runs, not "
                     "bf16 numerics")
    if end.get("grad_scaler"):
        notes.append("the script's GradScaler ran disabled (no loss scaling on the CPU)")
    return notes


def render_text(r: ScriptSmokeResult) -> str:
    """The terminal report: the verdict, loss and time per step, the peaks, problems, notes."""
    from tabulate import tabulate
    verdict = "SMOKE PASSED" if r.ok else "SMOKE FAILED"
    where = f"CUDA ({r.gpu})" if r.cuda_exercised and r.gpu else (
        "CUDA" if r.cuda_exercised else "the CPU")
    lines = [f"{verdict}: {r.model}, {r.steps_done} of {r.steps} optimizer steps on {where} "
             f"(1 process)", f"command: {r.command}"]
    rows = [(i + 1, "-" if loss is None else f"{loss:.5g}", f"{t * 1000:.1f}")
            for i, (loss, t) in enumerate(zip(r.losses, r.step_seconds))]
    if rows:
        lines += ["", tabulate(rows, headers=("step", "loss", "ms"), colalign=("right",) * 3)]
    if r.memory:
        lines += ["", memory_table(r.memory)]
    lines += [""] + [f"PROBLEM: {p}" for p in r.problems] + [f"note: {n}" for n in r.notes]
    return "\n".join(lines).rstrip()

