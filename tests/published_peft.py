"""Published real-GPU LoRA / QLoRA runs, rebuilt for oomdoctor (used by tests/test_adapters.py
and benchmarks/published_peft.py).

1. fms-acceleration. Source: foundation-model-stack/fms-acceleration, ``scripts/benchmarks/refs/a100_80gb.csv``
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
- transformers 4.48's causal-LM loss makes one more fp32 copy of the (shifted) logits than the
  installed transformers: the LoRA rows' shortfall (tests/test_adapters.py).

2. lit-gpt's resource tables (Lightning-AI/lit-gpt ``tutorials/resource-tables.md``, "Last
updated 10/20/2023", commit 8641822; A100-SXM4-40GB, torch 2.1.0): ``finetune/lora.py`` on
Alpaca with ``--precision bf16-true`` (weights, adapters, gradients and AdamW state bf16),
LoRA r=8 on the query and value projections, dropout 0.05, no activation checkpointing; the
first iteration holds the longest sample (1304 tokens for Llama 2), so micro-batch B peaks at
B x 1304 tokens; it prints ``torch.cuda.max_memory_allocated() / 1e9``. Rebuilt as the
transformers model of meta-llama/Llama-2-7b-hf's config (oomdoctor: ``--precision bf16-pure``;
peft keeps its 4.2 M adapter parameters fp32, 25 MB more than bf16). lit-gpt computes the loss
in 128-token chunks where transformers upcasts all logits to fp32 (0.17 GB per 1304 tokens).
Not used: the table's QLoRA rows (nf4 14.14 GB, nf4-dq 13.84 GB: 2.1 GB above a trace of the
same setup, present with and without double quantization, so something of lit-gpt's 2023
quantized loading path that we have not identified) and its phi-1.5 rows (transformers' Phi
computes gelu_new as Python arithmetic and the full-vocabulary loss, lit-gpt a fused GELU and
a chunked loss: not the same model in memory).
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
# meta-llama/Llama-2-7b-hf's config.json (the architecture only)
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
             "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32,
             "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
             "tie_word_embeddings": False}
FMS = ("--lora", "16", "--lora-targets", "q_proj,k_proj,v_proj,o_proj", "--lora-dropout",
       "0.1", "--checkpointing", "--seq-len", "4096", "--gpu", "a100-80")
LIT_GPT = ("--lora", "8", "--lora-targets", "q_proj,v_proj", "--lora-dropout", "0.05",
           "--seq-len", "1304", "--precision", "bf16-pure", "--gpu", "a100-40")


@dataclass(frozen=True)
class Run:
    name: str
    batch: int
    options: tuple[str, ...]
    published_bytes: int          # max_memory_allocated as published
    config: str = "mistral-7b"    # a key of CONFIGS


CONFIGS = {"mistral-7b": MISTRAL_7B, "llama-2-7b": LLAMA2_7B}

RUNS = (
    Run("standard-peft b4", 4, (*FMS, "--precision", "bf16-pure"), 26_704_571_904),
    Run("standard-peft b8", 8, (*FMS, "--precision", "bf16-pure"), 38_742_912_512),
    Run("baseline-peft-bnb b4", 4, (*FMS, "--precision", "bf16", "--quantize", "nf4",
                                    "--double-quant"), 20_669_338_112),
    Run("baseline-peft-bnb b8", 8, (*FMS, "--precision", "bf16", "--quantize", "nf4",
                                    "--double-quant"), 37_002_646_016),
    Run("lit-gpt llama-2-7b mb1", 1, LIT_GPT, 21_300_000_000, "llama-2-7b"),   # "21.30 GB"
    Run("lit-gpt llama-2-7b mb2", 2, LIT_GPT, 29_070_000_000, "llama-2-7b"),   # "29.07 GB"
)


def write_config(root: str, run: Run) -> str:
    folder = os.path.join(root, run.config)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIGS[run.config], f)
    return folder


def command(run: Run, folder: str) -> list[str]:
    return ["estimate", folder, "-b", str(run.batch), *run.options, "--json"]
