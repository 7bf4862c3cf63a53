"""A two-layer LLaMA from a transformers config, imported *inside* build_model (transformers
loads model classes lazily), trained on an HF-style batch: input_ids, attention_mask, labels.

transformers asks whether the mask has padding (``padding_mask.all()``) before it picks the
attention path; ``PAD`` pad tokens at the end of every sequence change the answer, and
``MASK = False`` leaves the mask out of the batch. ``CHECKPOINT`` calls transformers' own
``gradient_checkpointing_enable`` with that ``use_reentrant`` (None: off). ``PACKED = True``
gives the padding-free batch of transformers' ``DataCollatorWithFlattening``: the batch's
sequences in one row, ``position_ids`` restarting at each, no mask.
"""
import torch

T, V = 64, 512
PAD = 0
MASK = True
CHECKPOINT = None
PACKED = False


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    if CHECKPOINT is not None:
        model.gradient_checkpointing_enable({"use_reentrant": CHECKPOINT})
    return model


def make_batch(batch_size):
    if PACKED:
        ids = torch.randint(0, V, (1, batch_size * T))
        return {"input_ids": ids, "position_ids": torch.arange(T).repeat(batch_size)[None],
                "labels": ids}
    ids = torch.randint(0, V, (batch_size, T))
    mask = torch.ones(batch_size, T, dtype=torch.long)
    if PAD:
        mask[:, -PAD:] = 0
    if not MASK:
        return {"input_ids": ids, "labels": ids}
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}
