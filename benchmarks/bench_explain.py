"""Benchmark `oomdoctor explain`: time and peak RSS on a generated 100 MiB log, and the time for
the typical logs in tests/logs.

    python benchmarks/bench_explain.py            # 100 MiB
    python benchmarks/bench_explain.py --mib 500  # any size
    python benchmarks/bench_explain.py --public   # score the real logs of tests/logs/public instead

The big log is written to a temporary file and explained by the real CLI in a child process, so
the peak RSS reported is the CLI's own (interpreter + imports + parser), read from
getrusage(RUSAGE_CHILDREN). Prints figures only; it asserts nothing.

--public scores explain on the real logs in tests/logs/public against what their sources.json says
each one holds (written by hand from the log): the share of expected kinds found among the log's
findings, the share of stated numbers found among any finding's numbers or derived values (the
value in bytes or as a count, whatever key explain gives it), and the logs left with no finding.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from oomdoctor import explain as ex  # noqa: E402  (after the path set-up above)

# What a long torchrun log is mostly made of: progress, metrics, warnings, NCCL INFO lines,
# the odd traceback of a caught exception - and one OOM at the end.
_LINES = (
    "[rank{r}]: step {i} | loss 2.{i4} | lr 3.0e-04 | grad_norm 0.87 | 4.31 it/s | tokens/s 45012\n",
    "[2024-06-01 12:00:{s:02d},000][train][INFO] - epoch 3 batch {i} done in 0.231 s\n",
    "Epoch 3:  41%|####      | {i}/1000000 [03:17<04:43,  2.08it/s, loss=1.20, v_num=7]\n",
    "gpu-node:31121:31190 [{r}] NCCL INFO Channel 01/24 :    0   1   2   3   via P2P/IPC/read\n",
    "  warnings.warn('The default value of the antialias parameter of all the resizing transforms')\n",
    "[rank{r}]: max memory allocated 14.21 GiB, reserved 15.00 GiB (step {i})\n",
)
_TAIL = (
    "[rank1]: Traceback (most recent call last):\n"
    '[rank1]:   File "/home/lab/train.py", line 174, in main\n'
    "[rank1]:     loss.backward()\n"
    "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 1 has a total capacity "
    "of 23.69 GiB of which 111.88 MiB is free. Including non-PyTorch memory, this process has 23.57 GiB memory "
    "in use. Of the allocated memory 21.93 GiB is allocated by PyTorch, and 1.34 GiB is reserved by PyTorch but "
    "unallocated.\n"
)


def write_log(path: Path, size: int) -> int:
    written = i = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            # One line in 200 mentions memory: realistic for logs that print memory stats.
            template = _LINES[5] if i % 200 == 0 else _LINES[i % 5]
            line = template.format(r=i % 4, i=i, i4=f"{i % 10000:04d}", s=i % 60)
            f.write(line)
            written += len(line)
            i += 1
        f.write(_TAIL)
    return i + 4


_PARSE_ONLY = """
import sys, time
from oomdoctor import explain as ex
start, cpu = time.perf_counter(), time.process_time()
with open(sys.argv[1], "rb") as f:
    result = ex.explain_file(f)
print(time.perf_counter() - start, time.process_time() - cpu, len(result.findings), result.lines_read)
"""


def _child_peak_kib() -> int:
    # Max RSS over all waited-for children so far (KiB on Linux): run children smallest first.
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss


def bench_big(mib: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.log"
        lines = write_log(path, mib * 2**20)
        size = path.stat().st_size
        subprocess.run([sys.executable, "-c", "import oomdoctor.explain"], env=env, check=True)
        import_kib = _child_peak_kib()
        out = subprocess.run([sys.executable, "-c", _PARSE_ONLY, str(path)], env=env, check=True,
                             capture_output=True, text=True).stdout.split()
        parse_s, parse_cpu, findings = float(out[0]), float(out[1]), int(out[2])
        parse_kib = _child_peak_kib()
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "oomdoctor", "explain", str(path), "--json"],
                              env=env, capture_output=True, text=True)
        cli_s = time.perf_counter() - start
        cli_kib = _child_peak_kib()
    print(f"generated log         {ex.format_bytes(size)} ({lines:,} lines)")
    print(f"explain_file          {parse_s:.2f} s wall, {parse_cpu:.2f} s CPU ({size / 2**20 / parse_s:.1f} MiB/s wall), "
          f"{findings} finding(s)")
    print(f"peak RSS              {ex.format_bytes(parse_kib * 1024)} "
          f"(python + oomdoctor.explain alone: {ex.format_bytes(import_kib * 1024)})")
    print(f"CLI end to end        {cli_s:.2f} s, peak RSS {ex.format_bytes(cli_kib * 1024)}, exit code "
          f"{proc.returncode} (includes everything oomdoctor.cli imports at start-up)")
    if proc.returncode not in (0, 1):
        print(proc.stderr, file=sys.stderr)


def bench_typical(repeat: int = 20) -> None:
    logs = sorted((ROOT / "tests" / "logs").glob("*.log"))
    times = []
    for path in logs:
        data = path.read_bytes()
        runs = []
        for _ in range(repeat):
            start = time.perf_counter()
            ex.render_text(ex.explain_text(data.decode("utf-8", "replace")))
            runs.append(time.perf_counter() - start)
        times.append((statistics.median(runs), path.name, len(data)))
    times.sort()
    med = statistics.median(t for t, _, _ in times)
    slowest = times[-1]
    print(f"typical logs          {len(times)} files in tests/logs, explain + render_text, median of {repeat} runs each")
    print(f"  median per log      {med * 1e3:.2f} ms")
    print(f"  slowest             {slowest[0] * 1e3:.2f} ms  ({slowest[1]}, {slowest[2]:,} bytes)")


_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _expected_value(text: str) -> int:
    """'11500204 KiB' -> 11776208896, '480' -> 480: computed here, not by oomdoctor's parser."""
    number, _, unit = text.partition(" ")
    return int(Decimal(number) * _UNITS.get(unit, 1))


def score_public() -> None:
    folder = ROOT / "tests" / "logs" / "public"
    sources = json.loads((folder / "sources.json").read_text())
    totals: dict[str, list[int]] = {}     # set -> [kinds hit, kinds, numbers hit, numbers, logs, empty]
    for name, want in sorted((k, v) for k, v in sources.items() if not k.startswith("_")):
        with open(folder / name, "rb") as f:
            result = ex.explain_file(f)
        found = {f.kind.value for f in result.findings}
        values = {v for f in result.findings for v in (*f.numbers.values(), *f.derived.values())}
        missing_kinds = [k for k in want["kinds"] if k not in found]
        missing_numbers = [k for k, v in want["numbers"].items() if _expected_value(v) not in values]
        t = totals.setdefault(want.get("set", "held-out"), [0] * 6)
        t[0] += len(want["kinds"]) - len(missing_kinds)
        t[1] += len(want["kinds"])
        t[2] += len(want["numbers"]) - len(missing_numbers)
        t[3] += len(want["numbers"])
        t[4] += 1
        t[5] += not result.findings
        mark = "ok  " if not missing_kinds and not missing_numbers else "MISS"
        print(f"{mark} {name:52} found {sorted(found) or ['(no known error)']}"
              + (f" missing kinds {missing_kinds}" if missing_kinds else "")
              + (f" missing numbers {missing_numbers}" if missing_numbers else ""))
    for label, (kh, k, nh, n, logs, empty) in sorted(totals.items(), key=lambda kv: kv[0] != "held-out"):
        print(f"{label} set ({logs} logs): kinds recognised {kh}/{k} ({100 * kh / max(k, 1):.1f}%), numbers read "
              f"{nh}/{n} ({100 * nh / max(n, 1):.1f}%), no known error in {empty}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=100, help="size of the generated log in MiB (default 100)")
    parser.add_argument("--public", action="store_true",
                        help="score the real logs of tests/logs/public against their sources.json instead")
    args = parser.parse_args()
    if args.public:
        score_public()
        return
    print(f"python {sys.version.split()[0]} on {os.cpu_count()} CPUs, load average "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    bench_typical()
    bench_big(args.mib)


if __name__ == "__main__":
    main()
