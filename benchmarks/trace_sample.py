"""Real allocator events of one sample-model configuration as the calibration harness trains it
(oomdoctor.runs.measure), for the records tests/test_calibration.py still lists as known
deviations (issue 34: ResNet's convolution workspaces).

    python benchmarks/trace_sample.py resnet_cnn fp32 4 --out DIR [--checkpointing]
        [--moved] [--before 1 2 4]
    python benchmarks/trace_sample.py torchvision:resnet50 bf16 64 --moved --out DIR

MODEL is a sample model's name or a ``timm:NAME`` / ``torchvision:NAME`` source. Writes
DIR/<model>-<precision>-ck<0|1>-b<batch>[-moved][-after].json.gz (benchmarks/alloc_trace.py)
and prints one JSON line with the peaks, the OOM's first line if the run went out of memory
(its events up to the OOM are written too), what the card holds outside the allocator,
cuDNN's version and benchmark flag. Needs CUDA (exit 2 without).

``--moved``: the model is built on the host and moved, as a training script does and as
``oomdoctor probe`` places it (the harness builds it on the GPU). ``--before B ...``: train
these batches first in the same process, each as calibrate.py's trials run (the cache emptied
around each), then the traced one: a long-lived process's history, not a fresh one's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from alloc_trace import write_trace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("precision", choices=["fp32", "fp16", "bf16", "bf16-pure"])
    ap.add_argument("batch", type=int)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--moved", action="store_true", help="build on the host, then .to(cuda)")
    ap.add_argument("--before", type=int, nargs="*", default=[],
                    help="batches trained first in this process (untraced)")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("trace_sample.py: no CUDA GPU visible", file=sys.stderr)
        return 2
    from oomdoctor.models.loader import load_model, load_model_file
    from oomdoctor.runs.measure import TorchRunner, oom_line
    from oomdoctor.sim.trace import TraceConfig
    spec = (load_model(args.model) if ":" in args.model else
            load_model_file(os.path.join(ROOT, "sample_models", f"{args.model}.py")))
    cfg = TraceConfig(args.batch, precision=args.precision, checkpointing=args.checkpointing)
    runner = TorchRunner("cuda:0", build_on_device=not args.moved)
    torch.zeros(1, device="cuda:0")
    runner.cleanup()
    before = [_untraced(runner, spec, cfg, b) for b in args.before]
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc",
                                             stacks="python")
    oom = None
    try:
        runner.train(spec, cfg)
    except torch.OutOfMemoryError as e:   # the events up to the OOM are the point (issue 34)
        oom = oom_line(e)[:300]
        traceback.clear_frames(e.__traceback__)   # its frames hold the run's tensors
    os.makedirs(args.out, exist_ok=True)
    name = (f"{args.model.replace(':', '_')}-{args.precision}-ck{int(args.checkpointing)}-b{args.batch}"
            f"{'-moved' if args.moved else ''}{'-after' if args.before else ''}.json.gz")
    err = write_trace(os.path.join(args.out, name))
    alloc, reserved = runner.peaks()
    print(json.dumps({"file": name, "model": args.model, "precision": args.precision,
                      "checkpointing": args.checkpointing, "batch_size": args.batch,
                      "max_memory_allocated": alloc, "max_memory_reserved": reserved,
                      "oom": oom, "moved": args.moved, "before": before,
                      # what the card holds outside the allocator at the end (CUDA context)
                      "outside_allocator_bytes": runner.outside_allocator(),
                      "cudnn": torch.backends.cudnn.version(),
                      "cudnn_benchmark": torch.backends.cudnn.benchmark,
                      "torch": torch.__version__, "trace_error": err}), flush=True)
    return 0


def _untraced(runner, spec, cfg, batch: int) -> dict:
    """One earlier run in this process, as measured_probe's trial runs it."""
    import torch
    from oomdoctor.runs.measure import oom_line
    from dataclasses import replace
    runner.cleanup()
    oom = None
    try:
        runner.train(spec, replace(cfg, batch_size=batch))
    except torch.OutOfMemoryError as e:
        oom = oom_line(e)[:300]
        traceback.clear_frames(e.__traceback__)
    alloc, reserved = runner.peaks()
    runner.cleanup()
    return {"batch_size": batch, "max_memory_allocated": alloc, "max_memory_reserved": reserved,
            "oom": oom}


if __name__ == "__main__":
    sys.exit(main())
