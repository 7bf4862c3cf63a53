"""A few real optimizer steps of a user's training script, as it is; with CUDA, its measured
peaks against oomdoctor's estimate of the same script.

    oomdoctor smoke --steps 3 -- python tests/scripts/mlp_loop.py --samples 256

The script runs unmodified in a child process (:mod:`oomdoctor.runs.script_child`): a fresh
process, so on a GPU a fresh CUDA context and caching allocator. Its optimizer steps are counted
(:mod:`oomdoctor.runs.script_steps`) and it is stopped after the N-th, at its next forward or
backward; each step's loss and time come back as the step ends.

With CUDA, ``torch.cuda.max_memory_allocated/reserved`` at the stop are set next to
``oomdoctor estimate --steps N`` of the same command, whose run of the script on a fake GPU
stops at the same point: an OOM, or a peak more than :data:`TOLERANCE` off, fails the smoke, as a
model file's smoke (:mod:`oomdoctor.runs.smoke`) does. Without CUDA the script's CUDA calls run
on the CPU (:mod:`oomdoctor.runs.cpu_cuda`): the loss and step time are real, GPU memory is not
measured, and the result says so. Either way a loss that is not finite, or does not move, fails.

Known limitations: one process - ``torchrun``, ``accelerate launch`` and ``deepspeed`` are
refused; the script runs for real, so it writes what it writes (checkpoints, logs), and its
``finally:`` blocks run when it is stopped; the stop is an exception raised inside the script's
next forward or backward, which code that catches ``BaseException`` can swallow.
"""
from __future__ import annotations

import collections
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from oomdoctor.models.script import ScriptSpec
from oomdoctor.models.spec import ModelFileError
from oomdoctor.runs import script_child
from oomdoctor.runs.smoke import NoDeviceError, SmokeError, cpu_has_fast_bf16
from oomdoctor.runs.smoke_script_result import (TOLERANCE, ScriptSmokeResult, judge_script,
                                                render_text)

__all__ = ["TOLERANCE", "ScriptSmokeConfig", "ScriptRunError", "ScriptSmokeResult",
           "judge_script", "render_text", "run_script_smoke"]
Progress = Callable[[str], None]
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TAIL = 20                  # the script's last output lines, kept for an error message


@dataclass(frozen=True)
class ScriptSmokeConfig:
    """How to run the script."""

    steps: int = 3                  # optimizer steps, then the script is stopped
    device: str = "auto"            # auto | cuda | cpu
    timeout_s: float = 600.0        # the whole run, the script's setup included
    forwards: int = 200             # top-level forwards without an optimizer step: stopped
    cpu_fp32_fallback: bool = True  # CUDA autocast runs in fp32 on a CPU without fast bf16
    alloc_conf: str = ""            # PYTORCH_CUDA_ALLOC_CONF for the run ("": the environment's)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"unknown device {self.device!r}; choose auto, cuda or cpu")


class ScriptRunError(ModelFileError):
    """The script raised (or exited with an error) before its steps were taken."""


@dataclass
class _Run:
    """What came back from the child process."""

    steps: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_TAIL))
    returncode: int | None = None
    timed_out: bool = False


def run_script_smoke(script: ScriptSpec, cfg: ScriptSmokeConfig = ScriptSmokeConfig(),
                     predict: Callable[[], Any] | None = None,
                     progress: Progress = lambda _: None,
                     output: Progress = lambda _: None) -> ScriptSmokeResult:
    """Run ``script`` for ``cfg.steps`` optimizer steps and judge it. ``predict()`` gives the
    estimate to compare a CUDA run's peaks with (an :class:`~oomdoctor.plans.estimate.Estimate`
    of the same command for ``cfg.steps`` steps); ``output`` gets each line the script writes."""
    _refuse(script)
    cuda = _use_cuda(cfg.device)
    autocast, notes = "bfloat16", []
    if not cuda and cfg.cpu_fp32_fallback and not cpu_has_fast_bf16():
        autocast = ""
    progress(f"smoke: {script.command()} for {cfg.steps} optimizer step"
             f"{'s' if cfg.steps > 1 else ''} on {'CUDA' if cuda else 'the CPU'}")
    run = _launch(script, cfg, cuda, autocast, progress, output)
    end = _ended(script, cfg, run, cuda)
    prediction = None
    if cuda and predict is not None and end.get("memory"):
        progress(f"predicting the peaks to compare with: oomdoctor's run of the script for "
                 f"{cfg.steps} steps")
        try:
            prediction = predict()
        except (ModelFileError, ValueError) as e:
            notes.append(f"no prediction: oomdoctor's estimate of the script failed ({e})")
    memory, problems, judged = judge_script(run.steps, end, cuda, prediction, cfg.steps)
    return ScriptSmokeResult(
        model=script.name, command=script.command(), steps=cfg.steps,
        steps_done=int(end.get("steps", len(run.steps))), ended=end["ended"],
        device="cuda" if cuda else "cpu", gpu=end.get("gpu", ""), cuda_exercised=cuda,
        processes=1, losses=tuple(r.get("loss") for r in run.steps),
        step_seconds=tuple(r["seconds"] for r in run.steps), memory=tuple(memory),
        ok=not problems, problems=tuple(problems), notes=tuple(notes + judged))


def _refuse(script: ScriptSpec) -> None:
    """A command smoke cannot run as one plain process: a ValueError that says what to do."""
    if script.launcher != "python":
        raise ValueError(f"smoke runs a training script as one process (`-- python "
                         f"{script.path} ...`); {script.launcher} launches several, which "
                         "smoke does not yet: run the script with plain python on one device, "
                         f"or plan the launch with `oomdoctor estimate -- {script.launcher} ...`")
    if script.placeholders:
        raise ValueError(f"smoke runs the command as given: replace "
                         f"{{{sorted(script.placeholders)[0]}}} in its arguments with a number")


def _use_cuda(device: str) -> bool:
    """Whether the script runs with CUDA: a GPU is visible and --device allows it; --device
    cuda without one is a :class:`NoDeviceError`."""
    import torch
    have = torch.cuda.is_available() and torch.cuda.device_count() >= 1
    if device == "cuda" and not have:
        raise NoDeviceError("--device cuda asked for a CUDA GPU but none is visible; check "
                            "CUDA_VISIBLE_DEVICES, or drop --device cuda to run on the CPU")
    return have and device != "cpu"


def _launch(script: ScriptSpec, cfg: ScriptSmokeConfig, cuda: bool, autocast: str,
            progress: Progress, output: Progress) -> _Run:
    """Start the child process and gather what it sends until it exits (or the timeout)."""
    read_end, write_end = os.pipe()
    env = dict(os.environ, **script.environment())
    env[script_child.ENV] = json.dumps({
        "fd": write_end, "steps": cfg.steps, "device": "cuda" if cuda else "cpu",
        "autocast": autocast, "forwards": cfg.forwards, "argv": script.argv()})
    env["PYTHONUNBUFFERED"] = "1"   # its prints as they happen, between the step lines
    if cfg.alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = cfg.alloc_conf
    if not cuda:                    # the redirected run must not reach a GPU that is there
        env["CUDA_VISIBLE_DEVICES"] = ""
    try:
        proc = subprocess.Popen([sys.executable, "-c", script_child.BOOT, _ROOT],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, pass_fds=(write_end,), env=env,
                                start_new_session=True)
    finally:
        os.close(write_end)
    run = _Run()
    try:
        _gather(proc, read_end, run, cfg, progress, output)
    finally:
        os.close(read_end)
        _end_group(proc)
    run.returncode = proc.returncode
    return run


def _gather(proc: subprocess.Popen, records: int, run: _Run, cfg: ScriptSmokeConfig,
            progress: Progress, output: Progress) -> None:
    """Read the script's output and the child's records as they come, until both pipes close,
    the child has exited with nothing left to read (a DataLoader worker may keep its output
    open), or the timeout."""
    def on_output(line: str) -> None:
        run.tail.append(line)
        output(line)

    def on_record(line: str) -> None:
        rec = json.loads(line)
        if rec.pop("kind") == "step":
            run.steps.append(rec)
            progress(f"step {rec['step']}/{cfg.steps}: {rec['seconds']:.1f} s")
        else:
            run.end = rec
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout.fileno(), selectors.EVENT_READ, [on_output, b""])
    sel.register(records, selectors.EVENT_READ, [on_record, b""])
    deadline = time.monotonic() + cfg.timeout_s
    while sel.get_map():
        if time.monotonic() > deadline:
            run.timed_out = True
            break
        events = sel.select(timeout=0.1 if proc.poll() is not None else 1.0)
        if not events and proc.poll() is not None:
            break
        for key, _ in events:
            handle, buffered = key.data
            data = os.read(key.fd, 1 << 16)
            if not data:                # closed: what is left is the last line
                sel.unregister(key.fd)
                if buffered:
                    handle(buffered.decode("utf-8", "replace").rstrip("\r"))
                continue
            lines = (buffered + data).split(b"\n")
            key.data[1] = lines.pop()   # a line not finished yet
            for line in lines:
                handle(line.decode("utf-8", "replace").rstrip("\r"))
    sel.close()


def _end_group(proc: subprocess.Popen) -> None:
    """Stop what is left of the child's session (it, or the DataLoader workers it leaves),
    then reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    proc.stdout.close()


def _ended(script: ScriptSpec, cfg: ScriptSmokeConfig, run: _Run, cuda: bool
           ) -> dict[str, Any]:
    """How the run ended, when it ended as a smoke can judge; else the error to raise."""
    if run.timed_out:
        done = (f"it is slow, not stuck: {len(run.steps)} of {cfg.steps} steps completed "
                f"(last {run.steps[-1]['seconds']:.1f} s); run fewer --steps or a smaller "
                "configuration" if run.steps else "no optimizer step completed: is it "
                "waiting on its data, on input, or on other processes?")
        raise SmokeError(f"{script.name} smoke timed out after {cfg.timeout_s:.0f} s; {done}")
    end = run.end
    if end is None:
        code = run.returncode or 0
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0 and
               -code in signal.valid_signals() else f"exited with status {code}")
        oom = " (SIGKILL: the kernel's out-of-memory killer, when host RAM runs out)" \
            if code == -signal.SIGKILL else ""
        last = f"; its last output: {run.tail[-1]}" if run.tail else ""
        raise SmokeError(f"the process running {script.name} {how}{oom} after "
                         f"{len(run.steps)} optimizer step(s), without reporting back{last}")
    if end["ended"] == "error":
        raise _script_error(script, end["error"], run, cuda)
    return end


class _ChildTraceback(Exception):
    """The script's traceback in the child process (--debug shows it)."""


def _script_error(script: ScriptSpec, error: dict[str, Any], run: _Run, cuda: bool
                  ) -> ScriptRunError:
    """One line: where the script failed, what, and what to try."""
    what = f"{error['type']}: {error['message']}"
    if error["type"] == "SystemExit":
        what = f"{error['message']}" + (f" ({run.tail[-1].strip()})" if run.tail else "")
    cpu = "" if cuda or error["type"] == "SystemExit" else (
        " Without CUDA its CUDA calls ran on the CPU, which this may not support: if it runs "
        "on a GPU, smoke it there.")
    e = ScriptRunError(f"{script.name} failed at {error['where']} after {len(run.steps)} "
                       f"optimizer step(s): {what}; run `{script.command()}` to see it fail on "
                       f"its own.{cpu}")
    e.__cause__ = _ChildTraceback(error["traceback"].rstrip()) if error["traceback"] else None
    return e
