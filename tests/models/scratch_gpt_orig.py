"""oomdoctor estimate tests/models/scratch_gpt_orig.py --gpu a100-40 --batch-size 8

LS-0: rasbt/LLMs-from-scratch ``ch05/10_llm-training-speed/00_orig.py`` as published: the
GPT-2-sized model with from-scratch layers, the causal mask a registered float buffer in every
attention layer, fp32, and ``torch.optim.AdamW(lr=5e-4, weight_decay=0.1)`` left to its CUDA
default (foreach): 26.2617 GB reserved. See scratch_gpt.py.
"""
import torch

import scratch_gpt
from scratch_gpt import loss_fn, make_batch  # noqa: F401


def build_model():
    return scratch_gpt.GPTModel(native=False, sdpa=False, mask_buffer=True)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=5e-4, weight_decay=0.1)
