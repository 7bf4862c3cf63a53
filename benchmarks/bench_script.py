"""Benchmark a training script's estimate (`oomdoctor estimate -- python train.py`) against the
model file's: the script may take at most twice the model file's time plus its own start-up,
and an HF Trainer script of a 7B config at most 30 s on a 2-core machine (issue #20).

    python benchmarks/bench_script.py            # all sample models + the 7B Trainer script
    python benchmarks/bench_script.py --quick    # tiny_mlp, gpt2_small and the 7B script

Each pair runs in this process, the model file first (its imports warm); the 7B Trainer script
runs through the real CLI in a child process, so its time includes Python's start, transformers'
import and the Trainer's set-up, and its peak RSS is the CLI's own. Prints figures only.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from oomdoctor.models.loader import load_model  # noqa: E402
from oomdoctor.models.script import parse_command  # noqa: E402
from oomdoctor.plans.estimate import Budget, estimate, estimate_script  # noqa: E402
from oomdoctor.sim.gpus import get_profile  # noqa: E402
from oomdoctor.sim.trace import TraceConfig  # noqa: E402

CASES = [("tiny_mlp", 64, "bf16"), ("gpt2_small", 4, "bf16"), ("resnet_cnn", 32, "none"),
         ("bert_base", 8, "fp16"), ("vit_b16", 16, "bf16"), ("lora_gpt", 4, "bf16"),
         ("llama7b", 1, "bf16")]


def _pair(model: str, batch: int, amp: str, budget: Budget) -> tuple[float, float, float]:
    path = os.path.join(ROOT, "sample_models", f"{model}.py")
    start = time.perf_counter()
    ref = estimate(load_model(path), TraceConfig(batch, {"none": "fp32"}.get(amp, amp)), budget)
    t_file = time.perf_counter() - start
    script = parse_command(["python", os.path.join(ROOT, "tests", "scripts", "loop.py"),
                            "--model", path, "--batch-size", str(batch), "--amp", amp])
    start = time.perf_counter()
    with open(os.devnull, "w") as null:
        saved, sys.stdout = sys.stdout, null        # the loop's own prints
        try:
            run = estimate_script(script, TraceConfig(1), budget)
        finally:
            sys.stdout = saved
    t_script = time.perf_counter() - start
    return t_file, t_script, run.peak_allocated_bytes / ref.peak_allocated_bytes - 1


def _trainer_7b() -> tuple[float, float, str]:
    cmd = [sys.executable, "-m", "oomdoctor", "estimate", "--gpu", "a100-80", "--", "python",
           os.path.join(ROOT, "benchmarks", "scripts", "hf_trainer_llama7b.py")]
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20     # KiB -> GiB
    head = r.stdout.splitlines()[1] if r.returncode in (0, 1) else r.stderr.strip()[-200:]
    return wall, rss, head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    budget = Budget(get_profile("a100-80"))
    print(f"{'model':<12} {'batch':>5} {'amp':>5} {'file s':>7} {'script s':>9} {'ratio':>6} "
          f"{'peak vs file':>12}")
    for model, batch, amp in CASES[:2] if args.quick else CASES:
        t_file, t_script, diff = _pair(model, batch, amp, budget)
        print(f"{model:<12} {batch:>5} {amp:>5} {t_file:7.2f} {t_script:9.2f} "
              f"{t_script / t_file:6.2f} {100 * diff:+11.3f}%")
    wall, rss, head = _trainer_7b()
    print(f"\nHF Trainer, LLaMA-7B config, bf16 + gradient checkpointing, through the CLI: "
          f"{wall:.1f} s, peak RSS {rss:.2f} GiB (target: <= 30 s)\n  {head}")


if __name__ == "__main__":
    main()
