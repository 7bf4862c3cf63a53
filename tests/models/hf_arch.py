"""A tiny transformers model of the architecture ``ARCH`` from a config built in code (no
weights, no download), on an HF-style batch: the support matrix's model (tests/test_hf_releases.py).

``MASK = False`` leaves the attention mask out of the batch: then transformers 4.x asks whether
the first or last tokens are padding (``modeling_utils.warn_if_padding_and_no_attention_mask``,
``pad_token_id in input_ids[:, [-1, 0]]``) in BERT, DistilBERT, ALBERT, OPT and others. ``PAD``
pad tokens end every row (masked out when there is a mask). ``HEAD``: the task's model class.
"""
import torch

ARCH = "opt"
MASK = True
PAD = 16
T, V, H = 64, 512, 64

# architecture -> (config class, model class, config fields beyond the shared ones)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=H, n_layer=2, n_head=4, n_positions=T, pad_token_id=0)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(hidden_size=H, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                 word_embed_proj_dim=H, pad_token_id=1)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, pad_token_id=0)),
    "bert": ("BertConfig", "BertForMaskedLM",
             dict(hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, pad_token_id=0)),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM",
                   dict(dim=H, hidden_dim=128, n_layers=2, n_heads=4, pad_token_id=0)),
    # one layer's weights used by all four layers (ALBERT's cross-layer sharing)
    "albert": ("AlbertConfig", "AlbertForMaskedLM",
               dict(embedding_size=32, hidden_size=H, intermediate_size=128,
                    num_hidden_layers=4, num_attention_heads=4, num_hidden_groups=1,
                    pad_token_id=0)),
}


def build_model():
    import transformers
    config_cls, model_cls, fields = ARCHS[ARCH]
    cfg = getattr(transformers, config_cls)(vocab_size=V, max_position_embeddings=T, **fields)
    model_cls = getattr(transformers, model_cls)
    try:     # SDPA where the release has it for this architecture (OPT: 4.42+), else eager
        return model_cls._from_config(cfg, attn_implementation="sdpa")
    except (ValueError, ImportError):
        return model_cls._from_config(cfg, attn_implementation="eager")


def make_batch(batch_size):
    pad = ARCHS[ARCH][2]["pad_token_id"]
    ids = torch.randint(2, V, (batch_size, T))
    mask = torch.ones(batch_size, T, dtype=torch.long)
    if PAD:
        ids[:, -PAD:] = pad
        mask[:, -PAD:] = 0
    labels = ids.clone()
    if PAD:
        labels[:, -PAD:] = -100
    batch = {"input_ids": ids, "labels": labels}
    if MASK:
        batch["attention_mask"] = mask
    return batch
