"""Measure what cuDNN's convolutions take from the caching allocator on a real GPU.

    python benchmarks/cudnn_conv.py --out FILE            # the grid below, on cuda:0
    python benchmarks/cudnn_conv.py --dry-run --out FILE  # CPU: check the plumbing
    python benchmarks/cudnn_conv.py --set pointwise --out FILE   # ResNet-50's 1x1 shapes

A convolution's forward and backward take transient workspaces from the caching allocator
(``cudnn_convolution`` in aten/src/ATen/native/cudnn/Conv_v8.cpp: the plan's workspace is
allocated through it, freed when the call returns), sized by the algorithm cuDNN's
heuristics pick at run time (issue 34: ResNet's reserved peaks at batch 4096 and vit_b16's
patch embedding). For each shape this runs one forward and one backward of an ``nn.Conv2d``
in the default (channels-first) layout, the input requiring a gradient unless it is the
network's first layer (``first``), and records every allocation of each phase in order
from the allocator's own history, so the workspaces are the allocations that are not the
output, the gradients or the grad-output: their sizes, next to the tensors' sizes, are
what the rule in the simulator is fitted on and checked against. ``--benchmark`` rows set
``torch.backends.cudnn.benchmark``, whose search tries every algorithm once.

Writes one JSON document: the environment (GPU, driver, torch, cuDNN) and one record per
shape, dtype, batch and benchmark flag. Without CUDA (and without --dry-run) it exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

# (name, in channels, out channels, kernel, stride, padding, spatial size, first layer)
SHAPES = [
    ("resnet-stem", 3, 64, 7, 2, 3, 224, True),
    ("vit-patch", 3, 768, 16, 16, 0, 224, True),
    ("mobilenet-stem", 3, 32, 3, 2, 1, 224, True),
    ("3x3-64-56", 64, 64, 3, 1, 1, 56, False),
    ("3x3-64-128-s2", 64, 128, 3, 2, 1, 56, False),
    ("1x1-64-128-s2", 64, 128, 1, 2, 0, 56, False),
    ("3x3-128-28", 128, 128, 3, 1, 1, 28, False),
    ("3x3-256-14", 256, 256, 3, 1, 1, 14, False),
    ("1x1-256-1024-14", 256, 1024, 1, 1, 0, 14, False),
    ("3x3-512-7", 512, 512, 3, 1, 1, 7, False),
]
BATCHES = [2, 16, 128, 1024]
# --set pointwise: the 1x1 convolutions of a ResNet-50 bottleneck, stride 1 and 2, at the
# plane sizes they run at (torchvision's resnet50 staged some where the grid's one 1x1 of
# stride 1 did not)
POINTWISE = [(f"1x1-{ci}-{co}-{hw}" + ("-s2" if s == 2 else ""), ci, co, 1, s, 0, hw, False)
             for ci, co, hw, s in ((64, 256, 56, 1), (256, 64, 56, 1), (128, 512, 28, 1),
                                   (512, 128, 28, 1), (1024, 256, 14, 1), (256, 1024, 14, 1),
                                   (1024, 512, 14, 1), (512, 2048, 7, 1), (2048, 512, 7, 1),
                                   (256, 512, 56, 2), (512, 1024, 28, 2), (1024, 2048, 14, 2))]
SETS = {"grid": (SHAPES, BATCHES, (False, True)), "pointwise": (POINTWISE, [64, 512], (False,))}
MARK = 97 * 2**20 + 512          # a marker allocation's base size: each marker adds 512 bytes


def _tensor_sizes(x, conv, y) -> dict:
    w = conv.weight
    return {"input": x.numel() * x.element_size(), "output": y.numel() * y.element_size(),
            "weight": w.numel() * w.element_size()}


def _run(shape: tuple, batch: int, dtype, benchmark: bool, dev, mark) -> dict:
    import torch
    name, cin, cout, k, s, p, hw, first = shape
    torch.backends.cudnn.benchmark = benchmark
    conv = torch.nn.Conv2d(cin, cout, k, stride=s, padding=p, bias=False).to(dev, dtype)
    x = torch.randn(batch, cin, hw, hw, device=dev, dtype=dtype, requires_grad=not first)
    mark()
    y = conv(x)
    mark()
    grad = torch.ones_like(y)
    mark()
    y.backward(grad)
    mark()
    rec = {"shape": name, "in_channels": cin, "out_channels": cout, "kernel": k, "stride": s,
           "padding": p, "size": hw, "first": first, "batch": batch,
           "dtype": str(dtype).replace("torch.", ""), "benchmark": benchmark,
           "tensors": _tensor_sizes(x, conv, y)}
    del x, y, grad, conv
    return rec


def _phases(events: list, marks: list[int]) -> list[list]:
    """The allocations between consecutive markers: [alloc | free, size] in order."""
    out, cur, open_ = [], None, False
    for e in events:
        size, action = e["size"], e["action"]
        if action == "alloc" and size in marks:
            if cur is not None:
                out.append(cur)
            cur = []
            continue
        if cur is not None and action in ("alloc", "free_completed") and size not in marks:
            cur.append([action[:5], size])
    if cur is not None:
        out.append(cur)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="CPU, two shapes, no events")
    ap.add_argument("--set", choices=list(SETS), default="grid", help="which shapes")
    args = ap.parse_args(argv)
    import torch
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("cudnn_conv.py: no CUDA GPU visible (or pass --dry-run)", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if cuda else "cpu")
    marks: list[int] = []

    def mark() -> None:
        marks.append(MARK + 512 * len(marks))
        if cuda:
            torch.cuda.synchronize()
            torch.empty(marks[-1], dtype=torch.uint8, device=dev)

    shapes, batches, flags = SETS[args.set]
    grid = [(sh, b, dt, bm) for dt in (torch.float32, torch.bfloat16) for sh in shapes
            for b in batches for bm in flags]
    if args.dry_run:
        grid = grid[:2]
    if cuda:
        torch.zeros(1, device=dev)
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, context="alloc",
                                                 stacks="python")
    records = []
    for sh, b, dt, bm in grid:
        start = len(marks)
        records.append(_run(sh, b, dt, bm, dev, mark))
        records[-1]["marks"] = marks[start:start + 4]
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        events = [e for t in torch.cuda.memory._snapshot()["device_traces"] for e in t]
        torch.cuda.memory._record_memory_history(enabled=None)
        phases = _phases(events, marks)
        for i, rec in enumerate(records):      # 4 markers a record: forward, -, backward, -
            rec["forward"], rec["backward"] = phases[4 * i], phases[4 * i + 2]
    doc = {"environment": {
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "allow_tf32": torch.backends.cudnn.allow_tf32, "python": platform.python_version()},
        "records": records}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f)
    print(f"wrote {len(records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
