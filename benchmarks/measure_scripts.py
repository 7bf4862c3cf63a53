"""Measure training scripts' real peaks on a GPU, stopped where oomdoctor's run of the same
script stops: after the second optimizer step, at the script's next forward or backward.

    python benchmarks/measure_scripts.py --out benchmarks/results/scripts/nvidia-h100-2.x.json

Each case runs in its own process (a fresh CUDA context and caching allocator), as the script
itself, with the hooks below; the peaks are torch.cuda.max_memory_allocated/reserved at the
stop. tests/test_script_gpu.py checks `oomdoctor estimate -- python SCRIPT` against them.
Cases whose libraries are missing on the GPU machine are recorded as skipped.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import runpy
import subprocess
import sys
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = os.path.join("tests", "scripts")
CASES = [
    ("mlp_loop.py", ["--batch-size", "512", "--samples", "2048"]),
    ("mlp_loop.py", ["--batch-size", "512", "--samples", "2048", "--amp", "bf16"]),
    ("pad_loop.py", ["--bs", "16"]),
    ("loop.py", ["--model", "sample_models/gpt2_small.py", "--batch-size", "4", "--amp", "bf16"]),
    ("loop.py", ["--model", "sample_models/gpt2_small.py", "--batch-size", "2"]),
    ("loop.py", ["--model", "sample_models/bert_base.py", "--batch-size", "8", "--amp", "bf16",
                 "--accum", "2"]),
    ("loop.py", ["--model", "sample_models/vit_b16.py", "--batch-size", "16", "--amp", "bf16"]),
    ("loop.py", ["--model", "sample_models/resnet_cnn.py", "--batch-size", "32"]),
    ("hf_trainer_clm.py", ["--per_device_train_batch_size", "8", "--fixed_length", "64",
                           "--bf16"]),
    ("lightning_loop.py", ["--model", "sample_models/gpt2_small.py", "--batch-size", "4",
                           "--precision", "bf16-mixed"]),
]
STEPS = 2


class StopRun(BaseException):
    """The script has taken its steps (BaseException: a script's ``except Exception`` lets it
    through)."""


@contextlib.contextmanager
def stopped_after(steps: int) -> Iterator[list[int]]:
    """While the block runs a training script, its next forward of a top-level module or its
    next backward after ``steps`` optimizer steps raises :class:`StopRun` - where oomdoctor's
    run of a script stops. Yields the steps taken so far (a one-item list). Plain PyTorch, apart
    from oomdoctor's implementation: tests/reference.py uses it for real CPU runs too."""
    import torch
    from torch.nn.modules import module as nn_module
    from torch.optim.optimizer import register_optimizer_step_post_hook
    done, depth = [0], [0]

    def stop_if_done():
        if done[0] >= steps:
            raise StopRun

    def pre(_m, _a):
        if depth[0] == 0:
            stop_if_done()
        depth[0] += 1

    def post(_m, _a, _o):
        depth[0] = max(depth[0] - 1, 0)
    real_backward = torch.autograd.backward

    def backward(*a, **k):
        stop_if_done()
        return real_backward(*a, **k)
    hooks = [nn_module.register_module_forward_pre_hook(pre),
             nn_module.register_module_forward_hook(post, always_call=True),
             register_optimizer_step_post_hook(lambda *_: done.__setitem__(0, done[0] + 1))]
    torch.autograd.backward = backward
    try:
        yield done
    finally:
        torch.autograd.backward = real_backward
        for h in hooks:
            h.remove()


def _one(script: str, args: list[str]) -> None:
    """Run the script under the stop hooks; print one JSON line with its peaks."""
    import torch
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    out = {"script": os.path.basename(script), "args": args}
    with stopped_after(STEPS) as done:
        try:
            runpy.run_path(script, run_name="__main__")
            out["ended"] = "script end"
        except StopRun:
            out["ended"] = "steps"
    torch.cuda.synchronize()
    out.update(steps=done[0], peak_allocated_bytes=torch.cuda.max_memory_allocated(),
               peak_reserved_bytes=torch.cuda.max_memory_reserved())
    sys.stdout.flush()
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


def _environment() -> dict:
    import torch
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python":
           platform.python_version(), "gpu": torch.cuda.get_device_name(0),
           "total_memory": torch.cuda.get_device_properties(0).total_memory}
    try:
        env["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    for lib in ("transformers", "lightning", "accelerate"):
        try:
            env[lib] = __import__(lib).__version__
        except ImportError:
            env[lib] = None
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--one", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.one:
        _one(args.one[0], args.one[1:])
    doc = {"environment": _environment(), "records": []}
    for script, script_args in CASES:
        path = os.path.join(ROOT, S, script)
        r = subprocess.run([sys.executable, __file__, "--out", "-", "--one", path, *script_args],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        rec = json.loads(line[7:]) if line else {
            "script": script, "args": script_args, "error": (r.stderr.strip() or "no result")[-400:]}
        rec["script"] = script
        doc["records"].append(rec)
        print(json.dumps(rec), flush=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
