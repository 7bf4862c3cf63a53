"""The process `oomdoctor smoke -- python train.py` runs a training script in: the script
unmodified as ``__main__``, stopped after its N-th optimizer step, its steps and peaks sent to
the parent.

A fresh process, so that a GPU run starts from a fresh CUDA context and caching allocator, as
the script's own run would. Started by :mod:`oomdoctor.runs.smoke_script`, never imported by
it: the configuration comes as JSON in the environment variable :data:`ENV`, and the records go
back as JSON lines on the file descriptor it names - ``{"kind": "step", ...}`` as each step ends
(:class:`oomdoctor.runs.script_steps.StepRecord`), then one ``{"kind": "end", ...}``: how the
run ended, the steps taken and, on CUDA, ``torch.cuda.max_memory_allocated/reserved``. The
script's own output stays on this process's stdout and stderr.
"""
from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import traceback
from dataclasses import asdict
from typing import Any, Callable

ENV = "OOMDOCTOR_SMOKE_CHILD"
# `python -c BOOT ROOT`: oomdoctor importable from ROOT even when it is not installed.
BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
        "from oomdoctor.runs.script_child import main; main()")


def main() -> None:
    """Run the script the environment describes; send its records; exit without the
    interpreter's teardown (a stopped script's threads, process groups and CUDA context need
    none of it, and can hang in it)."""
    cfg = json.loads(os.environ.pop(ENV))
    _as_the_script(cfg["argv"][0])
    records = os.fdopen(cfg["fd"], "w", encoding="utf-8")

    def send(kind: str, **fields: Any) -> None:
        records.write(json.dumps({"kind": kind, **fields}) + "\n")
        records.flush()
    end = run(cfg, lambda r: send("step", **asdict(r)))
    send("end", **end)
    records.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _as_the_script(path: str) -> None:
    """``sys.path`` as ``python train.py`` sets it: the script's folder first, no working
    directory (``python -c`` put it there, after BOOT's ROOT)."""
    del sys.path[0]                            # BOOT's ROOT
    if sys.path and sys.path[0] == "":
        del sys.path[0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))


def run(cfg: dict[str, Any], on_step: Callable) -> dict[str, Any]:
    """The script under the step watch (and, without CUDA, CUDA redirected to the CPU); how
    it ended."""
    import torch

    from oomdoctor.runs.cpu_cuda import Seen, cuda_on_cpu
    from oomdoctor.runs.script_steps import StepWatch, watching
    cuda = cfg["device"] == "cuda"
    seen = Seen()
    watch = StepWatch(cfg["steps"], on_step, torch.cuda.synchronize if cuda else None,
                      cfg["forwards"])
    with contextlib.ExitStack() as stack:
        if not cuda:
            dtype = getattr(torch, cfg["autocast"]) if cfg["autocast"] else None
            stack.enter_context(cuda_on_cpu(seen, dtype))
        stack.enter_context(watching(watch))
        end = _run_file(cfg["argv"])
    end.update(steps=watch.done, skipped=watch.skipped, autocast=seen.autocast,
               grad_scaler=seen.grad_scaler, cpu_autocast="" if cuda else cfg["autocast"])
    if cuda:
        # the fullest GPU the script used (DataParallel's or a split's may not be the current
        # one), as the estimate of a script that spreads itself predicts its fullest GPU
        device = max(range(torch.cuda.device_count()), key=torch.cuda.max_memory_reserved)
        end["memory"] = [(f"cuda:{device}", torch.cuda.max_memory_allocated(device),
                          torch.cuda.max_memory_reserved(device))]
        end["gpu"] = torch.cuda.get_device_name(device)
    return end


def _run_file(argv: list[str]) -> dict[str, Any]:
    """Run the script as ``__main__``; how it ended: "steps" (stopped after them), "script
    end", "no step", "oom" or "error" (with what it raised)."""
    import torch

    from oomdoctor.runs.script_steps import NoStep, StopRun
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
        return {"ended": "script end"}
    except StopRun:
        return {"ended": "steps"}
    except NoStep as e:
        return {"ended": "no step", "message": f"{e} (the script was at {_where(e)})"}
    except SystemExit as e:
        if e.code in (None, 0):
            return {"ended": "script end"}
        return {"ended": "error", "error": {"type": "SystemExit", "message":
                                            f"exited with {e.code!r}", "where": _where(e),
                                            "traceback": ""}}
    except torch.cuda.OutOfMemoryError as e:    # the caching allocator's OOM
        return {"ended": "oom", "message": _first_line(e)}
    except Exception as e:                      # noqa: BLE001 - reported to the parent
        return {"ended": "error", "error": {"type": type(e).__name__, "message":
                                            _first_line(e), "where": _where(e),
                                            "traceback": traceback.format_exc()}}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


def _where(e: BaseException) -> str:
    """``file:line (code)`` of the innermost frame of the user's own code in ``e``'s traceback
    (outside torch, installed libraries, oomdoctor and the standard library)."""
    import sysconfig

    import torch
    skip = (os.sep + "site-packages" + os.sep, os.path.dirname(torch.__file__),
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "<frozen ",
            sysconfig.get_paths()["stdlib"] + os.sep)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not any(s in f.filename for s in skip)]
    if not frames:
        return os.path.basename(sys.argv[0])
    f = frames[-1]
    where = f"{os.path.basename(f.filename)}:{f.lineno}"
    return f"{where} ({f.line.strip()})" if f.line else where
