"""Seconds per planning command on the seed question (issue #32): a hand-written 14.6B Llama
config (29.2 GB in fp16) on two RTX 3090s without P2P, sequence 2048; targets 30 s for
recommend and `probe --num-gpus 2`, 15 s for parallel, split and the README's first command.

    python benchmarks/bench_plans.py [--only recommend,probe,...]

Run it on an otherwise idle machine: the commands fork one worker per core.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_14B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
             "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 45,
             "num_attention_heads": 40, "num_key_value_heads": 40,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "torch_dtype": "float16",
             "tie_word_embeddings": False}
CARD = ["--seq-len", "2048", "--gpu", "rtx3090"]


def commands(model: str) -> list[tuple[str, float, list[str]]]:
    """(name, target seconds, oomdoctor arguments)."""
    two = ["--num-gpus", "2"]
    return [
        ("recommend-lora", 30, ["recommend", model, *two, "--link", "pcie-no-p2p", "--lora",
                                "16", *CARD]),
        # the full fine-tune fits nowhere: what would fit, and the four offload plans replayed
        ("recommend-full", 30, ["recommend", model, *two, "--link", "pcie-no-p2p", *CARD]),
        ("recommend-qlora", 30, ["recommend", model, *two, "--link", "pcie-no-p2p", "--lora",
                                 "16", "--quantize", "nf4", *CARD]),
        ("probe-qlora-2gpus", 30, ["probe", model, "--lora", "16", "--quantize", "nf4", *two,
                                   *CARD]),
        ("parallel", 15, ["parallel", model, "--gpus", "2", "-b", "2", "--precision", "bf16",
                          "--checkpointing", "--lora", "16", *CARD]),
        ("split", 15, ["split", model, "--gpus", "2", "-b", "2", "--precision", "bf16",
                       "--checkpointing", "--lora", "16", *CARD]),
        ("readme", 15, ["probe", os.path.join(ROOT, "sample_models", "gpt2_small.py"), "--gpu",
                        "rtx3090"]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated command names")
    only = set(filter(None, ap.parse_args().only.split(",")))
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(LLAMA_14B, f)
    print(f"{'command':<20} {'seconds':>8} {'target':>7}  exit")
    for name, target, args in commands(folder):
        if only and name not in only:
            continue
        start = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "oomdoctor", *args], capture_output=True,
                           text=True, cwd=ROOT)
        took = time.perf_counter() - start
        mark = "" if took <= target else "  (over)"
        print(f"{name:<20} {took:>8.1f} {target:>7}  {p.returncode}{mark}", flush=True)


if __name__ == "__main__":
    main()
