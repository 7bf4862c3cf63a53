"""Time one `oomdoctor estimate` of the LSTM from issue #10 (3-layer LSTM 80->512, 400 steps,
batch 16, tests/models/lstm_speech.py), the whole command as a user runs it.

    python benchmarks/bench_rnn.py               # this checkout; target under 10 s
    python benchmarks/bench_rnn.py --against /work/main   # also another checkout, for contrast
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests/models/lstm_speech.py"


def run(checkout: Path) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    start = time.perf_counter()
    # cwd too: `python -m` puts the working directory first on sys.path
    out = subprocess.run([sys.executable, "-m", "oomdoctor", "estimate", str(MODEL),
                          "--batch-size", "16", "--json"], env=env, cwd=checkout,
                         capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if out.returncode not in (0, 1):
        raise SystemExit(f"estimate failed in {checkout} (exit {out.returncode}):\n{out.stderr}")
    return took, json.loads(out.stdout)["peak_allocated_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", type=Path, help="another checkout to time the same way")
    args = parser.parse_args()
    for checkout in [ROOT] + ([args.against] if args.against else []):
        took, peak = run(checkout)
        print(f"{str(checkout):30s} {took:6.1f} s   peak allocated {peak / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()
