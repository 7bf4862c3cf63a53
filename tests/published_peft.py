"""Published real-GPU LoRA / QLoRA runs, rebuilt for oomdoctor (used by tests/test_adapters.py
and benchmarks/published_peft.py).

Source: foundation-model-stack/fms-acceleration, ``scripts/benchmarks/refs/a100_80gb.csv``
(columns ``mem_peak_torch_mem_alloc_in_bytes`` = ``torch.cuda.max_memory_allocated()``), with
the setup from ``scripts/benchmarks/scenarios.yaml`` and ``defaults.yaml`` in the same
repository: mistralai/Mistral-7B-v0.1, one A100 80GB, ``torch_dtype: bfloat16``, LoRA r=16,
alpha 16, dropout 0.1 on q_proj/k_proj/v_proj/o_proj, gradient checkpointing, AdamW, packed
4096-token sequences (``max_seq_len 4096``, ``packing True``), flash-attention 2;
torch 2.4.1, transformers 4.48.1, peft 0.13.2, bitsandbytes 0.43.3, trl 0.13.0
(``refs/requirements.txt``).

- ``standard-peft``: no ``bf16`` flag, so no autocast: bf16 weights, peft's fp32 adapters
  (oomdoctor: ``--precision bf16-pure --lora 16``).
- ``baseline-peft-bnb``: ``bf16: True`` (autocast) with the weights loaded 4-bit; the rest
  of the model at rest (4.31 GB) fits nf4 with double quantization (oomdoctor: ``--precision
  bf16 --lora 16 --quantize nf4 --double-quant``). TRL keeps the embeddings and the head in
  bf16 where peft's ``prepare_model_for_kbit_training`` upcasts them to fp32, which oomdoctor
  follows: about 0.5 GB more at rest here.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

# mistralai/Mistral-7B-v0.1's config.json (the architecture only; no weights are read)
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
              "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "max_position_embeddings": 32768, "sliding_window": 4096,
              "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False}
LORA = ("--lora", "16", "--lora-targets", "q_proj,k_proj,v_proj,o_proj", "--lora-dropout",
        "0.1", "--checkpointing", "--seq-len", "4096", "--gpu", "a100-80")


@dataclass(frozen=True)
class Run:
    name: str
    batch: int
    options: tuple[str, ...]
    published_bytes: int          # max_memory_allocated as published


RUNS = (
    Run("standard-peft b4", 4, ("--precision", "bf16-pure"), 26_704_571_904),
    Run("standard-peft b8", 8, ("--precision", "bf16-pure"), 38_742_912_512),
    Run("baseline-peft-bnb b4", 4, ("--precision", "bf16", "--quantize", "nf4",
                                    "--double-quant"), 20_669_338_112),
    Run("baseline-peft-bnb b8", 8, ("--precision", "bf16", "--quantize", "nf4",
                                    "--double-quant"), 37_002_646_016),
)


def write_config(folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(MISTRAL_7B, f)
    return folder


def command(run: Run, folder: str) -> list[str]:
    return ["estimate", folder, "-b", str(run.batch), *LORA, *run.options, "--json"]
