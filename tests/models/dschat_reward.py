"""DeepSpeed-Chat's step-2 reward model (DeepSpeedExamples 3a77097,
applications/DeepSpeed-Chat/training/utils/model/reward_model.py), rebuilt as an oomdoctor model
file for tests/published_multi.py: facebook/opt-350m's decoder (OPTModel from its config, no
weights) and a bias-free value head on its 512-wide output; each micro-batch is the chosen and
the rejected answers concatenated (2 x batch_size sequences of 512 padded tokens). The published
loss averages -logsigmoid(chosen - rejected) over each pair's span after they diverge, found
with nonzero() on the token ids (data-dependent); here over the whole sequence, the same
memory to a few kilobytes (the rewards are one number per token)."""
import torch
import torch.nn as nn

SEQ = 512
# facebook/opt-350m's config.json
OPT_350M = {"activation_dropout": 0.0, "activation_function": "relu", "attention_dropout": 0.0,
            "bos_token_id": 2, "do_layer_norm_before": False, "dropout": 0.1, "eos_token_id": 2,
            "ffn_dim": 4096, "hidden_size": 1024, "init_std": 0.02, "layerdrop": 0.0,
            "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 16,
            "num_hidden_layers": 24, "pad_token_id": 1, "vocab_size": 50272,
            "word_embed_proj_dim": 512}


class RewardModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoModel, OPTConfig
        self.rwtransformer = AutoModel.from_config(OPTConfig(**OPT_350M),
                                                   attn_implementation="eager")
        self.v_head = nn.Linear(OPT_350M["word_embed_proj_dim"], 1, bias=False)

    def forward(self, input_ids, attention_mask):
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask,
                                    use_cache=False)[0]
        rewards = self.v_head(hidden).squeeze(-1)
        bs = input_ids.shape[0] // 2
        return -nn.functional.logsigmoid(rewards[:bs] - rewards[bs:]).mean()


def build_model():
    return RewardModel()


def make_batch(batch_size):
    ids = torch.randint(3, OPT_350M["vocab_size"], (2 * batch_size, SEQ))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=5e-5, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
