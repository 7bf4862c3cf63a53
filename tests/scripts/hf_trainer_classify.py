"""Fine-tune a Hugging Face classifier with the Trainer: a text model (BERT-style,
AutoModelForSequenceClassification) on token sequences, or an image model (ViT-style,
AutoModelForImageClassification) on images - the model from a saved config folder, the data a
Dataset of examples the Trainer's default collator stacks.

    python tests/scripts/hf_trainer_classify.py --config_dir bert-tiny --seq_len 128 --bf16
"""
import argparse
import tempfile

import torch
from transformers import (AutoConfig, AutoModelForImageClassification,
                          AutoModelForSequenceClassification, Trainer, TrainingArguments)


class Examples(torch.utils.data.Dataset):
    def __init__(self, config, seq_len, n=128):
        self.config, self.seq_len, self.n = config, seq_len, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        c = self.config
        label = torch.tensor(i % c.num_labels)
        if self.seq_len is None:                      # an image classifier
            size = c.image_size
            return {"pixel_values": torch.randn(c.num_channels, size, size), "labels": label}
        ids = torch.randint(0, c.vocab_size, (self.seq_len,))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": label}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config_dir", required=True)
    parser.add_argument("--seq_len", type=int, help="text: tokens per example; images: omit")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--optim", default="adamw_torch_fused")    # the Trainer's default
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.config_dir)
    auto = AutoModelForImageClassification if args.seq_len is None else \
        AutoModelForSequenceClassification
    model = auto.from_config(config)
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.per_device_train_batch_size,
        bf16=args.bf16, gradient_checkpointing=args.gradient_checkpointing, max_steps=10,
        save_strategy="no", report_to=[], logging_steps=5, optim=args.optim)
    Trainer(model=model, args=training_args, train_dataset=Examples(config, args.seq_len)).train()


if __name__ == "__main__":
    main()
