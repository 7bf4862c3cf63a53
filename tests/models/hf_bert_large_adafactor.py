"""oomdoctor estimate tests/models/hf_bert_large_adafactor.py --gpu v100-16 --batch-size 4

HF-7 and HF-8 of docs/ground-truth.md: the bert-large run of hf_bert_large_seqcls.py (same
model, batch and Trainer loop of transformers ~4.16) with ``optim="adafactor"``. The Trainer
then built transformers' own ``Adafactor(scale_parameter=False, relative_step=False,
warmup_init=False, lr=5e-5)``: no first moment (beta1=None), factored second moments (a row and
a column vector per matrix, a full vector per bias/LayerNorm weight), one parameter at a time.
``torch.optim.Adafactor(foreach=False)`` keeps the same state and also steps one parameter at a
time; its temporaries per parameter are one parameter-sized update where transformers' loop
briefly holds two (``update`` and ``-update``) - at most 2 x 125 MB for the word embeddings,
inside the optimizer step, which is not where these runs peak.
"""
import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "hf_bert_large_seqcls", Path(__file__).with_name("hf_bert_large_seqcls.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

build_model = _base.build_model
make_batch = _base.make_batch
# Per-parameter Adafactor, then the era's model.zero_grad() (set_to_none=False).
TrainerAdafactor = _base.in_place_zero_grad(torch.optim.Adafactor)


def make_optimizer(params):
    return TrainerAdafactor(params, lr=5e-5, foreach=False)
