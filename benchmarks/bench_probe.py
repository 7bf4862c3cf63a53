"""Wall time and peak host RAM of estimate/probe on the realistic sample models.

    python benchmarks/bench_probe.py            # all cases
    python benchmarks/bench_probe.py --quick    # skip the LLaMA-7B case

Each case runs the real command line in a fresh process (what a user waits for, imports
included) and reads the child's peak RSS from getrusage. Targets (issue #2, 2-core machine):
GPT-2-small full probe < 30 s, one estimate < 5 s, LLaMA-7B estimate < 30 s, host RAM < 2 GiB.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [
    ("gpt2_small estimate b=8 bf16", ["estimate", "sample_models/gpt2_small.py", "-b", "8",
                                      "--precision", "bf16", "--gpu", "rtx3090", "--json"], 5),
    ("gpt2_small probe (8 configurations)", ["probe", "sample_models/gpt2_small.py",
                                             "--gpu", "rtx3090", "--json"], 30),
    ("llama7b estimate b=1 bf16-pure", ["estimate", "sample_models/llama7b.py", "-b", "1",
                                        "--precision", "bf16-pure", "--gpu", "a100-80",
                                        "--json"], 30),
]


# A wrapper process per case, so getrusage(RUSAGE_CHILDREN) covers that case only (the CLI
# and any probe workers it forks); ru_maxrss is in KiB on Linux.
_WRAPPER = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "rc = subprocess.run([sys.executable, '-m', 'oomdoctor', *sys.argv[1:]], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode; "
            "print(time.perf_counter() - t, "
            "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, rc)")


def run(args: list[str]) -> tuple[float, int, int]:
    out = subprocess.run([sys.executable, "-c", _WRAPPER, *args], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), int(out[1]), int(out[2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="skip LLaMA-7B")
    opts = ap.parse_args()
    print(f"{'case':40} {'wall s':>8} {'target s':>9} {'peak RSS MiB':>13}  exit")
    for name, args, target in CASES:
        if opts.quick and "llama" in name:
            continue
        wall, rss, rc = run(args)
        flag = "" if wall <= target else "  OVER TARGET"
        print(f"{name:40} {wall:8.1f} {target:9d} {rss / 2**20:13.0f}  {rc}{flag}")
    print(f"(cores: {os.cpu_count()}; peak RSS of the largest process of the case; target < 2048 MiB)")


if __name__ == "__main__":
    main()
