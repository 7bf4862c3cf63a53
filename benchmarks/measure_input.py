"""Does the GPU wait for data? Measured on a real GPU, for the input-pipeline check to meet.

    python benchmarks/measure_input.py --out input.json -- --delay-ms 0.8 --hidden 8 --batch-size 128

Runs tests/scripts/data_loop.py's model and dataset for real on cuda:0 with num_workers 0, 2, 4,
8 and 16 (up to the cores), and for each: wall time per step and the GPU's own time per step
(CUDA events around the step's work), over steps 3-20 after a warm-up. The GPU waits
``1 - gpu / wall`` of each step. Without CUDA it exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP = os.path.join(ROOT, "tests", "scripts", "data_loop.py")


def measure(args: list[str], workers: int, steps: int = 20, warmup: int = 3) -> dict:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    loop = runpy.run_path(LOOP)                       # its dataset class, not its main()
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--delay-ms", type=float, default=1.5)
    a = p.parse_args(args)
    data = loop["SlowDataset"](max(a.samples, a.batch_size * (steps + warmup + 1)), a.width,
                               a.delay_ms / 1e3)
    loader = DataLoader(data, batch_size=a.batch_size, shuffle=True, drop_last=True,
                        num_workers=workers, pin_memory=False)
    model = nn.Sequential(nn.Linear(a.width, a.hidden * a.width), nn.GELU(),
                          nn.Linear(a.hidden * a.width, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gpu_ms, starts = [], []
    for i, (x, y) in enumerate(loader):
        if i == warmup:
            torch.cuda.synchronize()
        starts.append(time.perf_counter())
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        gpu_ms.append((begin, end))
        if i == warmup + steps:
            break
    torch.cuda.synchronize()
    wall = (starts[-1] - starts[warmup]) / steps
    gpu = sum(b.elapsed_time(e) for b, e in gpu_ms[warmup:warmup + steps]) / steps / 1e3
    return {"num_workers": workers, "wall_seconds_per_step": wall,
            "gpu_seconds_per_step": gpu, "waiting_share": max(0.0, 1 - gpu / wall)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, nargs="*", default=[0, 2, 4, 8, 16])
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("measure_input.py: no CUDA device", file=sys.stderr)
        return 2
    args = [a for a in opts.script_args if a != "--"]
    cores = len(os.sched_getaffinity(0))
    runs = [measure(args, w) for w in opts.workers if w <= cores]
    doc = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "python": platform.python_version(), "cores": cores, "script": "tests/scripts/"
           "data_loop.py", "args": args, "runs": runs}
    with open(opts.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
