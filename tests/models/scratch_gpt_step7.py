"""oomdoctor estimate tests/models/scratch_gpt_step7.py --gpu a100-40 --batch-size 8
--precision bf16-pure

LS-7: scratch_gpt_step6's model with the attention replaced by one packed qkv ``Linear`` into
``scaled_dot_product_attention(is_causal=True, dropout_p=0.1)`` (flash on an A100): the
README's step 7, the last before ``torch.compile`` (step 8) and the padded vocabulary (step 9):
5.9004 GB reserved. See scratch_gpt.py.
"""
import scratch_gpt
from scratch_gpt import loss_fn, make_batch, make_optimizer  # noqa: F401


def build_model():
    return scratch_gpt.GPTModel(native=True, sdpa=True)
