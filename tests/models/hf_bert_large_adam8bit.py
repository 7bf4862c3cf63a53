"""oomdoctor estimate tests/models/hf_bert_large_adam8bit.py --gpu v100-16 --batch-size 4

HF-9 and HF-10 of docs/ground-truth.md: the bert-large run of hf_bert_large_seqcls.py (same
model, batch and Trainer loop of transformers ~4.16) with bitsandbytes' ``Adam8bit``, built as
the doc shows: two parameter groups, weight decay on all but biases and LayerNorm weights.
The real library steps on the trace's meta tensors (its ops have fake kernels): state is one
uint8 tensor per moment for parameters of 4096 elements or more (``min_8bit_size``), with a
float32 absmax per block, and fp32 moments for smaller ones; the blockwise 8-bit update runs
in place. Needs ``pip install bitsandbytes`` (CPU builds are enough).
"""
import importlib.util
from pathlib import Path

import bitsandbytes as bnb

_spec = importlib.util.spec_from_file_location(
    "hf_bert_large_seqcls", Path(__file__).with_name("hf_bert_large_seqcls.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

build_model = _base.build_model
make_batch = _base.make_batch
# The era's model.zero_grad() (set_to_none=False): gradients zeroed in place, kept.
TrainerAdam8bit = _base.in_place_zero_grad(bnb.optim.Adam8bit)


def make_optimizer(params):
    params = list(params)
    # the doc's grouping, by shape: biases and LayerNorm weights are the 1-D parameters
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    return TrainerAdam8bit([{"params": decay, "weight_decay": 0.0},
                            {"params": no_decay, "weight_decay": 0.0}],
                           lr=5e-5, betas=(0.9, 0.999), eps=1e-8)
