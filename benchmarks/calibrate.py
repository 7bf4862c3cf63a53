"""Measure real CUDA peaks of the sample models, for tests/test_calibration.py to check against.

    python benchmarks/calibrate.py                       # all sample models, on cuda:0
    python benchmarks/calibrate.py --models tiny_mlp gpt2_small --out /tmp/x.json
    python benchmarks/calibrate.py --fresh --models resnet_cnn --precisions fp16 bf16

Writes benchmarks/results/<gpu>-<torch>.json (schema in benchmarks/results/README.md): for each
sample model (llama7b only on cards with >= 80 GiB), precision (fp32, fp16, bf16 and bf16-pure
where the card has bf16) and checkpointing off/on, the real max_memory_allocated/reserved at
batch 1, 2, 4 and at the simulator's predicted maximum, plus the measured maximum batch
(oomdoctor.runs.measure.measured_probe) for fp32 and the 16-bit AMP configuration. Without CUDA it
exits with code 2. Every run shares this process unless ``--fresh`` (each in a new one,
oomdoctor.runs.fresh_process): the file's "process" says which, and the calibration test replays
a shared process's history (the address ranges its earlier runs freed).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SCHEMA_VERSION = 1
MAX_SEARCH = 4096   # measured max-batch searches stop here (tiny models fit millions)


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _write(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def _context_after(runner) -> int:
    """The memory outside the allocator once the runs are over. CUDA loads kernel modules
    lazily (CUDA_MODULE_LOADING=LAZY, the default since CUDA 11.7), so the context grows past
    what it held after the first allocation as cuBLAS, cuDNN and the step's kernels load; the
    largest batch that fits sees this one."""
    runner.cleanup()
    return runner.outside_allocator()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", help="sample model names (default: all)")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4])
    ap.add_argument("--out", help="output file (default benchmarks/results/<gpu>-<torch>.json)")
    ap.add_argument("--no-max-batch", action="store_true", help="skip measured max-batch searches")
    ap.add_argument("--search-every", action="store_true",
                    help="measure the max batch of every configuration, not only fp32 and 16-bit "
                         "AMP with checkpointing")
    ap.add_argument("--precisions", nargs="*", help="fp32 fp16 bf16 bf16-pure (default: all the "
                                                    "card runs)")
    ap.add_argument("--fresh", action="store_true",
                    help="each run in a new process (a few seconds more each), as a training "
                         "run starts; without it every run shares this process, whose freed "
                         "address ranges change what fits (the file says which)")
    args = ap.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print(f"calibrate.py: no CUDA GPU visible to torch {torch.__version__}; calibration "
              "measures real GPU memory, so run it on a machine with an NVIDIA GPU and a CUDA "
              "build of torch", file=sys.stderr)
        return 2
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        print("calibrate.py: PYTORCH_CUDA_ALLOC_CONF is set; unset it so the measurements use "
              "the allocator's defaults the tests replay", file=sys.stderr)
        return 2

    from oomdoctor.sim.allocator import AllocatorConfig
    from oomdoctor.plans.estimate import Budget
    from oomdoctor.models.loader import load_model
    from oomdoctor.runs.measure import TorchRunner, measured_probe, profile_for_device
    from oomdoctor.plans.probe import probe_config
    from oomdoctor.sim.trace import TraceConfig

    from oomdoctor.runs.fresh_process import FreshProcessRunner, first_context
    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)    # no context yet (torch's lazy init)
    if args.fresh:     # this process stays without a context: it would take the runs' memory
        context = first_context("cuda:0")
        runner = FreshProcessRunner("cuda:0", build_on_device=True)
    else:
        runner = TorchRunner("cuda:0")
        torch.zeros(1, device=dev)                   # create the context before measuring it
        context = runner.outside_allocator()
    cc = (props.major, props.minor)
    profile = profile_for_device(props.name, props.total_memory, cc)
    budget = Budget(profile, margin=0.0, context_bytes=context)
    bf16 = cc >= (8, 0)
    precisions = args.precisions or ["fp32", "fp16"] + (["bf16", "bf16-pure"] if bf16 else [])

    names = args.models or sorted(os.path.splitext(os.path.basename(p))[0]
                                  for p in glob.glob(os.path.join(ROOT, "sample_models", "*.py")))
    if "llama7b" in names and props.total_memory < 80 * 2**30 and not args.models:
        names.remove("llama7b")
    gpu_slug = re.sub(r"[^a-z0-9]+", "-", props.name.lower()).strip("-")
    torch_slug = torch.__version__.split("+")[0]
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"{gpu_slug}-{torch_slug}.json")
    records: list[dict] = []
    doc = {"schema": SCHEMA_VERSION,
           "process": "fresh" if args.fresh else "one",   # "one": this process, record order
           "gpu": {"name": props.name, "total_bytes": props.total_memory,
                   "compute_capability": list(cc), "profile": profile.name,
                   "context_bytes": context, "driver": _driver(),
                   "cuda": torch.version.cuda, "torch": torch.__version__,
                   "python": platform.python_version()},
           "records": records}

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    for name in names:
        spec = load_model(os.path.join(ROOT, "sample_models", f"{name}.py"))  # --fresh rebuilds
        for precision in precisions:
            for ck in (False, True):
                base = TraceConfig(1, precision=precision, checkpointing=ck)
                try:
                    predicted = probe_config(spec, base, budget, AllocatorConfig(),
                                             max_batch=MAX_SEARCH).max_batch_size
                except ValueError as e:       # e.g. no repeated blocks to checkpoint
                    log(f"{name} {precision} ck={ck}: skipped ({e})")
                    continue
                sizes = sorted(set(args.batches) | ({predicted} if predicted else set()))
                for b in sizes:
                    cfg = replace(base, batch_size=b)
                    trial = measured_probe(spec, cfg, runner=runner, predicted_max=b,
                                           max_batch=b)  # max_batch=b: exactly one trial at b
                    t = trial.trials[0]
                    records.append({"model": name, "precision": precision, "checkpointing": ck,
                                    "batch_size": b, "max_memory_allocated": t.max_memory_allocated,
                                    "max_memory_reserved": t.max_memory_reserved,
                                    "oom": not t.fits})
                    log(f"{name} {precision} ck={ck} b={b}: allocated {t.max_memory_allocated}"
                        f" reserved {t.max_memory_reserved}{' OOM' if not t.fits else ''}")
                _write(out, doc)     # after each configuration: a run cut off keeps its records
                amp16 = "bf16" if bf16 else "fp16"
                searched = args.search_every or (precision, ck) in (("fp32", False), (amp16, True))
                if args.no_max_batch or not searched:
                    continue
                if predicted is None or predicted >= MAX_SEARCH:
                    continue                   # nothing fits, or a search the cap would cut
                r = measured_probe(spec, base, runner=runner, predicted_max=predicted,
                                   max_batch=MAX_SEARCH, progress=log)
                if r.max_batch_size is None or r.capped:
                    continue
                t = next(t for t in r.trials if t.batch_size == r.max_batch_size)
                records.append({"model": name, "precision": precision, "checkpointing": ck,
                                "batch_size": r.max_batch_size,
                                "max_memory_allocated": t.max_memory_allocated,
                                "max_memory_reserved": t.max_memory_reserved, "oom": False,
                                "measured_max_batch": r.max_batch_size,
                                "predicted_max_batch": predicted})

    doc["gpu"]["context_after_bytes"] = runner.context_after if args.fresh else \
        _context_after(runner)
    _write(out, doc)
    log(f"wrote {len(records)} records to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
