"""Wall time of `oomdoctor check` over this project's cases (all sample models, setup.cfg).

    python benchmarks/bench_check.py [--jobs N]

Prints the wall time of the whole check (a fresh process, imports included, as CI runs it) and
of each case estimated alone, so a slow case stands out.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=None)
    opts = ap.parse_args()
    from oomdoctor.plans.check import load_config, measure_case

    cfg = load_config(os.path.join(ROOT, "setup.cfg"))
    args = [sys.executable, "-m", "oomdoctor", "check"] + (
        ["-j", str(opts.jobs)] if opts.jobs else [])
    t = time.perf_counter()
    rc = subprocess.run(args, cwd=ROOT, capture_output=True).returncode
    total = time.perf_counter() - t
    print(f"oomdoctor check, {len(cfg.cases)} cases: {total:.1f} s wall (exit {rc})")
    for case in cfg.cases:
        t = time.perf_counter()
        m = measure_case(case, cfg.root)
        print(f"  {case.name:24} {time.perf_counter() - t:6.1f} s"
              f"{'  ERROR ' + m.error if m.error else ''}")


if __name__ == "__main__":
    main()
