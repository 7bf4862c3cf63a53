"""An HF Trainer fine-tuning script of a 7B LLaMA-shaped model built from its config, for
benchmarks/bench_script.py: bf16, gradient checkpointing, 512-token sequences.

    oomdoctor estimate --gpu a100-80 -- python benchmarks/scripts/hf_trainer_llama7b.py
"""
import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, length, vocab):
        self.n, self.length, self.vocab = n, length, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (self.length,))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--per_device_train_batch_size", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                         max_position_embeddings=4096)
    model = LlamaForCausalLM(config)
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.per_device_train_batch_size,
        bf16=True, gradient_checkpointing=True, max_steps=10, save_strategy="no", report_to=[],
        logging_steps=1)
    Trainer(model=model, args=training_args,
            train_dataset=Tokens(64, args.seq, config.vocab_size)).train()


if __name__ == "__main__":
    main()
