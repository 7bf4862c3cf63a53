"""optimum-benchmark's training scenario on a Hugging Face model built from its config: what the
ROCm rows of tests/test_old_releases.py measured (``ARCH``: "gpt2", "bert" or
"tiny-llama").

The benchmark (huggingface/optimum-benchmark, tests/test_api.py with the training scenario of
optimum_benchmark/scenarios/training/config.py, 2024-25) builds the model with ``no_weights`` (random
weights from the config, fp32), generates 16-token sequences with labels equal to the inputs
and trains with the HF Trainer, per-device batch 2, for 5 steps: the Trainer's default
torch.optim.AdamW (foreach on the GPU), gradients set to None after each step. The Trainer's
gradient clipping scales gradients in place and is left out (it adds no parameter-sized tensor).
"""
import torch

ARCH = "gpt2"
T = 16          # DATASET_SHAPES["sequence_length"]

# architecture -> (config class, model class, config fields): the configs' defaults are the published models'
# (GPT2Config() is openai-community/gpt2, BertConfig() is google-bert/bert-base-uncased)
ARCHS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),           # task text-generation
    "bert": ("BertConfig", "BertForMaskedLM", {}),           # task fill-mask
    # hf-internal-testing/tiny-random-LlamaForCausalLM's config.json (text-generation), as
    # huggingface.co/hf-internal-testing/tiny-random-LlamaForCausalLM/blob/refs%2Fpr%2F3 shows it
    "tiny-llama": ("LlamaConfig", "LlamaForCausalLM",
                   dict(hidden_size=16, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, vocab_size=32000,
                        max_position_embeddings=2048, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)),
}


def build_model():
    import transformers
    config_cls, model_cls, fields = ARCHS[ARCH]
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields))


def make_batch(batch_size):
    vocab = {"gpt2": 50257, "bert": 30522, "tiny-llama": 32000}[ARCH]
    ids = torch.randint(0, vocab, (batch_size, T))
    return {"input_ids": ids, "attention_mask": torch.ones(batch_size, T, dtype=torch.long),
            "labels": ids.clone()}


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=5e-5)    # TrainingArguments' defaults
