"""Benchmark the caching-allocator simulator: replay time for random alloc/free streams.

    python benchmarks/bench_allocator.py               # 100k and 1M events
    python benchmarks/bench_allocator.py --events 250000

The stream is the one tests/test_allocator.py checks for invariants: half small (<1 MiB), some
medium, one in ten 10-200 MiB, at most 2000 blocks live. A probe replays traces of a few
thousand to a few hundred thousand events many times, so this is the inner loop of `probe`.
Prints figures only; it asserts nothing.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oomdoctor.sim.allocator import replay  # noqa: E402  (after the path set-up above)

MiB = 1 << 20


def random_events(n: int, seed: int = 0) -> list[tuple[bool, int, int]]:
    rng = random.Random(seed)
    live: list[int] = []
    events: list[tuple[bool, int, int]] = []
    handle = 0
    while len(events) < n:
        if live and (rng.random() < 0.5 or len(live) > 2000):
            k = rng.randrange(len(live))
            live[k], live[-1] = live[-1], live[k]
            events.append((False, live.pop(), 0))
        else:
            x = rng.random()
            nbytes = (rng.randint(1, MiB) if x < 0.5 else rng.randint(1, 10 * MiB) if x < 0.9
                      else rng.randint(10 * MiB, 200 * MiB))
            handle += 1
            live.append(handle)
            events.append((True, handle, nbytes))
    return events


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, action="append",
                    help="stream length (repeatable; default 100000 and 1000000)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for n in args.events or [100_000, 1_000_000]:
        events = random_events(n)
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            res = replay(events)
            times.append(time.perf_counter() - t)
        best = min(times)
        print(f"replay {n:>9,} events: best {best:.3f} s, median {statistics.median(times):.3f} s "
              f"({n / best / 1e6:.2f} M events/s); peak allocated "
              f"{res.peak_allocated_bytes / MiB:,.0f} MiB, reserved "
              f"{res.peak_reserved_bytes / MiB:,.0f} MiB")


if __name__ == "__main__":
    main()
