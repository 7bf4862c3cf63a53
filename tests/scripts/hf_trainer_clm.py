"""Fine-tune a causal language model with the Hugging Face Trainer, as its examples do: a model
from a config (a small GPT-2 here, so the test runs offline), variable-length token sequences
padded per batch by a collator, bf16 AMP, TrainingArguments from the command line.

    python tests/scripts/hf_trainer_clm.py --per_device_train_batch_size 4 --bf16
"""
import argparse
import random
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Sequences(torch.utils.data.Dataset):
    """Token sequences of 24 to 64 tokens, as a tokenized corpus gives them."""

    def __init__(self, n, vocab, seed=0, length=None):
        rng = random.Random(seed)
        self.items = [[rng.randrange(vocab) for _ in range(length or rng.randint(24, 64))]
                      for _ in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


def pad_collate(features):
    """Right-pad to the longest sequence in the batch; padding is masked and ignored by the loss."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--fixed_length", type=int, help="every sequence this long (no padding)")
    parser.add_argument("--optim", default="adamw_torch")
    parser.add_argument("--deepspeed", help="a DeepSpeed config (the Trainer's integration)")
    parser.add_argument("--local_rank", type=int, default=-1)     # the deepspeed launcher's
    args = parser.parse_args()

    config = GPT2Config(n_layer=args.n_layer, n_embd=256, n_head=4, vocab_size=8192,
                        n_positions=128)
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing, max_steps=20, learning_rate=3e-4,
        logging_steps=5, save_strategy="no", report_to=[], dataloader_num_workers=0,
        optim=args.optim, deepspeed=args.deepspeed)
    data = Sequences(256, 8192, length=args.fixed_length)
    trainer = Trainer(model=model, args=training_args, train_dataset=data,
                      data_collator=pad_collate)
    trainer.train()


if __name__ == "__main__":
    main()
