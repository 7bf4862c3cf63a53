"""oomdoctor estimate tests/models/scratch_gpt_step6.py --gpu a100-40 --batch-size 8
--precision bf16-pure

LS-6: scratch_gpt_step3's model, pure bf16 and fused AdamW, with ``nn.LayerNorm`` and
``nn.GELU(approximate="tanh")`` in place of the from-scratch ones (the README's step 6); the
attention is still the from-scratch one: 11.5645 GB reserved. See scratch_gpt.py.
"""
import scratch_gpt
from scratch_gpt import loss_fn, make_batch, make_optimizer  # noqa: F401


def build_model():
    return scratch_gpt.GPTModel(native=True, sdpa=False)
