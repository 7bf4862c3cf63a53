"""Predicted vs published peak memory of real multi-GPU runs (tests/published_multi.py), the
asserted rows and the ones reported with their known gap.

    python benchmarks/published_multi.py
"""
import json
import os
import sys
import tempfile

from click.testing import CliRunner

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from published_multi import ROWS, model_path, predicted  # noqa: E402

from oomdoctor.cli import cli  # noqa: E402


def main() -> None:
    root = tempfile.mkdtemp()
    print(f"{'run':<40} {'stat':<10} {'predicted GiB':>14} {'published GiB':>14} {'error':>8}")
    for row in ROWS:
        os.environ.update(row.env)
        r = CliRunner().invoke(cli, row.command(model_path(row, root), root))
        for key in row.env:
            os.environ.pop(key)
        if r.exit_code not in (0, 1):
            print(f"{row.name:<40} failed: {r.output.strip()[-200:]}")
            continue
        got = predicted(json.loads(r.stdout), row)
        err = got / row.published_bytes - 1
        mark = "" if row.within else "  (reported)"
        print(f"{row.name:<40} {row.stat:<10} {got / 2**30:>14.2f} "
              f"{row.published_bytes / 2**30:>14.2f} {err:>+8.1%}{mark}")


if __name__ == "__main__":
    main()
