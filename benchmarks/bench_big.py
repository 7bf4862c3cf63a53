"""Time and peak RSS of a deep model's trace: the unrolled stack (sim.repeat) beside the full
trace, and whether both give the same peaks; the multi-GPU layout cut (plans.parallel.stack)
beside the full one; and the three commands issue #23 set targets for.

    python benchmarks/bench_big.py                    # Llama-3-70B config, QLoRA r16 nf4, ckpt
    python benchmarks/bench_big.py --layers 32 --seq-len 1024
    python benchmarks/bench_big.py --commands         # + estimate/probe/recommend, as users run them

Each path runs in its own process (RSS is per process). Not a test: the figures depend on the
machine; on the 2-core CI machine the 70B estimate went from 35.7 s / 1.49 GB to 9.8 s / 0.58 GB,
the 8-GPU FSDP probe from 107 s to 15-21 s, recommend on 8 x H100 from 141 s to 30-39 s.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA3_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
              "tie_word_embeddings": False}

CHILD = """
import json, resource, sys, time
from oomdoctor.models.adapters import Adapters
from oomdoctor.models.loader import load_model
from oomdoctor.plans.estimate import Budget, estimate_trace
from oomdoctor.sim.gpus import PROFILES
from oomdoctor.sim.trace import TraceConfig, trace_training
folder, seq_len, min_blocks = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
t = time.perf_counter()
spec = load_model(folder, seq_len=seq_len, adapters=Adapters(16, quantize="nf4"))
trace = trace_training(spec, TraceConfig(1, checkpointing=True), min_blocks=min_blocks)
e = estimate_trace(trace, Budget(PROFILES["h100-80"]))
print(json.dumps({"seconds": time.perf_counter() - t, "events": len(trace.events),
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "peaks": [e.peak_allocated_bytes, e.peak_reserved_bytes]}))
"""


LAYOUT = """
import json, resource, sys, time
from oomdoctor.models.loader import load_model
from oomdoctor.plans.parallel import model_layout
folder, seq_len, min_blocks = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
spec = load_model(folder, seq_len=seq_len)
t = time.perf_counter()
layout = model_layout(spec, "bf16", min_blocks=min_blocks)
print(json.dumps({"seconds": time.perf_counter() - t, "inputs": len(layout.inputs),
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "same": repr(layout)}))
"""

# (what, arguments after `oomdoctor`, target seconds) - issue #23's targets on a 70B config
COMMANDS = (
    ("estimate, QLoRA r16 nf4 + ckpt", ["estimate", "{d}", "--seq-len", "{seq}", "-b", "1",
                                        "--lora", "16", "--quantize", "nf4", "--checkpointing",
                                        "--precision", "bf16", "--gpu", "h100-80"], 10),
    ("probe --strategy fsdp x8, bf16", ["probe", "{d}", "--seq-len", "{seq}", "--strategy",
                                        "fsdp", "--num-gpus", "8", "--precision", "bf16",
                                        "--gpu", "h100-80"], 30),
    ("recommend, 8 x h100-80", ["recommend", "{d}", "--seq-len", "{seq}", "--num-gpus", "8",
                                "--gpu", "h100-80"], 60),
)


def run(folder: str, seq_len: int, min_blocks) -> dict:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, folder, str(seq_len),
                          json.dumps(min_blocks)], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["process_seconds"] = time.perf_counter() - start
    return got


def child(code: str, *args) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def command(argv: list[str]) -> tuple[float, int]:
    """Wall seconds (imports included, as a user waits) and exit code of one CLI run."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "oomdoctor", *argv], capture_output=True)
    return time.perf_counter() - start, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--commands", action="store_true",
                    help="also time the CLI commands issue #23 sets targets for")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(
            dict(LLAMA3_70B, num_hidden_layers=args.layers)))
        fast = run(d, args.seq_len, 16)
        full = run(d, args.seq_len, None)
        for name, r in (("unrolled stack", fast), ("full trace", full)):
            print(f"{name:>15}: {r['seconds']:6.1f} s traced ({r['process_seconds']:5.1f} s "
                  f"with imports), peak RSS {r['rss_mib']:7.0f} MiB, {r['events']:,} events")
        print("same peak allocated/reserved:", fast["peaks"] == full["peaks"], fast["peaks"])
        cut, whole = (child(LAYOUT, d, args.seq_len, json.dumps(m)) for m in (16, None))
        print(f"multi-GPU layout (bf16): cut {cut['seconds']:.1f} s, full "
              f"{whole['seconds']:.1f} s, same layout: {cut['same'] == whole['same']}")
        if args.commands:
            for what, argv, target in COMMANDS:
                argv = [a.format(d=d, seq=args.seq_len) for a in argv]
                seconds, code = command(argv)
                print(f"{what:>32}: {seconds:6.1f} s (target {target} s), exit {code}")


if __name__ == "__main__":
    main()
