"""Processes standing for ranks (the smoke runs, one node or several): how the parent gathers
what each rank reports, without hanging when one fails or never answers."""
from __future__ import annotations

import queue
import time
from typing import Any, Callable


def collect_ranks(procs: list, results: Any, world: int, timeout_s: float,
                  on_step: Callable[[dict[str, Any]], None],
                  timed_out: Callable[[int], str], error: type[Exception]
                  ) -> list[dict[str, Any]]:
    """Every rank's result from the queue, rank order (step messages go to ``on_step``); the
    processes are joined, and the first rank that failed raises ``error`` with its message
    (a timeout too, worded by ``timed_out(ranks done)``)."""
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            try:
                msg = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise error(timed_out(len(out))) from None
            if "step" in msg:
                on_step(msg)
                continue
            out.append(msg)
            if "error" in msg:
                break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    errors = [o for o in out if "error" in o]
    if errors:
        raise error(f"rank {errors[0]['rank']} failed: {errors[0]['error']}\n"
                         f"{errors[0]['traceback']}")
    return sorted(out, key=lambda o: o["rank"])
