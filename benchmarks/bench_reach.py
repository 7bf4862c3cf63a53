"""Wall time of one `oomdoctor estimate` for the setups issue #10 had to reach, each under 1 B
parameters, the whole command as a user runs it (a fresh process, imports included).

    python benchmarks/bench_reach.py           # every case; target: each under 10 s
    python benchmarks/bench_reach.py --quick   # one case per construct

Cases: the sample models, a U-Net, an LSTM and a packed GRU (cuDNN emulation), fused AdamW,
bitsandbytes 8-bit Adam, Adafactor, optimizer-in-backward, transformers BERT-base (seq-cls,
its batch has an attention mask) and GPT-2 from configs written here (no download),
torchvision and timm by name. A case whose library does not import is skipped and says so
(next to a CPU-only torch, PyPI's torchvision does not import, and transformers with it: run
with PYTHONPATH=tests/_site, as the tests do). Exit status 1 when a case is over its target or
fails.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 10.0
GPU = ["--gpu", "rtx3090", "--json"]

# (name, estimate arguments, library it needs or None, in --quick)
CASES = [
    ("gpt2_small bf16 b8", ["sample_models/gpt2_small.py", "-b", "8", "--precision", "bf16"],
     None, True),
    ("bert_base fp16 b16", ["sample_models/bert_base.py", "-b", "16", "--precision", "fp16"],
     None, False),
    ("vit_b16 fp32 b32", ["sample_models/vit_b16.py", "-b", "32"], None, False),
    ("resnet_cnn fp32 b64", ["sample_models/resnet_cnn.py", "-b", "64"], None, False),
    ("U-Net fp32 b4 ckpt", ["tests/models/unet.py", "-b", "4", "--checkpointing"], None, True),
    ("LSTM 3x512, 400 steps, b16", ["tests/models/lstm_speech.py", "-b", "16"], None, True),
    ("packed bidirectional GRU b8", ["tests/models/gru_packed.py", "-b", "8"], None, False),
    ("fused AdamW MLP b64", ["tests/models/fused_adamw_mlp.py", "-b", "64"], None, True),
    ("bert-large Adam8bit b4", ["tests/models/hf_bert_large_adam8bit.py", "-b", "4",
                                "--gpu", "v100-16"], "bitsandbytes", True),
    ("bert-large Adafactor b4", ["tests/models/hf_bert_large_adafactor.py", "-b", "4",
                                 "--gpu", "v100-16"], None, False),
    ("vit_l16 optimizer in backward b1", ["tests/models/vit_l16_adam_in_backward.py", "-b", "1"],
     None, False),
    ("transformers BERT-base seq-cls + mask b16", ["{bert}", "--seq-len", "512", "-b", "16",
                                                   "--precision", "fp16"], "transformers", True),
    ("transformers GPT-2 config b8 bf16", ["{gpt2}", "--seq-len", "1024", "-b", "8",
                                           "--precision", "bf16"], "transformers", True),
    ("torchvision:resnet50 b32", ["torchvision:resnet50", "-b", "32"], "torchvision", True),
    ("timm:convnext_tiny b32", ["timm:convnext_tiny", "-b", "32"], "timm", False),
]


def _has(library: str | None) -> bool:
    if library is None:
        return True
    probe = subprocess.run([sys.executable, "-c", f"import {library}"], capture_output=True)
    return probe.returncode == 0


# Configs written here from transformers' defaults (GPT-2 small, BERT-base): no download.
CONFIGS = {"{gpt2}": ("GPT2Config", "GPT2LMHeadModel"),
           "{bert}": ("BertConfig", "BertForSequenceClassification")}


def _config(folder: Path, key: str) -> str:
    cls, arch = CONFIGS[key]
    subprocess.run([sys.executable, "-c",
                    f"import sys, transformers; c = transformers.{cls}(); "
                    f"c.architectures = ['{arch}']; c.save_pretrained(sys.argv[1])",
                    str(folder / cls)], check=True, capture_output=True)
    return str(folder / cls)


def run(args: list[str]) -> tuple[float, int, dict]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "oomdoctor", "estimate", *args], cwd=ROOT,
                         capture_output=True, text=True)
    took = time.perf_counter() - start
    try:
        result = json.loads(out.stdout)
    except json.JSONDecodeError:
        result = {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return took, out.returncode, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one case per construct")
    opts = ap.parse_args()
    worst = 0
    with tempfile.TemporaryDirectory() as tmp:
        written: dict[str, str] = {}
        print(f"{'case':42} {'seconds':>8} {'exit':>5} {'peak reserved':>14}"
              f"  target {TARGET_S:.0f} s")
        for name, args, library, quick in CASES:
            if opts.quick and not quick:
                continue
            if not _has(library):
                print(f"{name:42} {'skipped':>8}        ({library} is not installed)")
                continue
            for key in CONFIGS:
                if key in args:
                    written[key] = written.get(key) or _config(Path(tmp), key)
                    args = [written[key] if a == key else a for a in args]
            if "--gpu" not in args:
                args = [*args, *GPU]
            elif "--json" not in args:
                args = [*args, "--json"]
            took, rc, result = run(args)
            peak = result.get("peak_reserved_bytes")
            shown = f"{peak / 2**30:.2f} GiB" if peak else result.get("error", "?")[:40]
            flag = "" if took <= TARGET_S and rc in (0, 1) else "  <-- over target or failed"
            print(f"{name:42} {took:8.1f} {rc:5d} {shown:>14}{flag}")
            worst = max(worst, 0 if not flag else 1)
    return worst


if __name__ == "__main__":
    sys.exit(main())
