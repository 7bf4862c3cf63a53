"""Predicted vs published peak memory of real LoRA / QLoRA runs (tests/published_peft.py).

    python benchmarks/published_peft.py

Prints one row per run: oomdoctor's predicted ``max_memory_allocated`` and the published one.
"""
import json
import os
import sys
import tempfile

from click.testing import CliRunner

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from published_peft import RUNS, command, write_config  # noqa: E402

from oomdoctor.cli import cli  # noqa: E402


def main() -> None:
    root = tempfile.mkdtemp()
    print(f"{'run':<24} {'predicted GB':>13} {'published GB':>13} {'error':>8}")
    for run in RUNS:
        r = CliRunner().invoke(cli, command(run, write_config(root, run)))
        if r.exit_code not in (0, 1):
            print(f"{run.name:<24} failed: {r.output.strip()}")
            continue
        got = json.loads(r.stdout)["peak_allocated_bytes"]
        err = got / run.published_bytes - 1
        print(f"{run.name:<24} {got / 1e9:>13.2f} {run.published_bytes / 1e9:>13.2f} {err:>+8.1%}")


if __name__ == "__main__":
    main()
