"""oomdoctor estimate tests/models/scratch_gpt_step3.py --gpu a100-40 --batch-size 8

"Build a LLM From Scratch"'s GPT-2-sized model (163M parameters) with its from-scratch
LayerNorm, tanh-GELU and attention (causal mask made on the fly) and
``torch.optim.AdamW(fused=True)``: the README of rasbt/LLMs-from-scratch
``ch05/10_llm-training-speed`` after its step 3 (LS-3, fp32: 26.2422 GB reserved) and, cast to
bfloat16, after its step 5 (LS-5, ``--precision bf16-pure``: 13.7871 GB). See scratch_gpt.py.
"""
import scratch_gpt
from scratch_gpt import loss_fn, make_batch, make_optimizer  # noqa: F401


def build_model():
    return scratch_gpt.GPTModel(native=False, sdpa=False)
