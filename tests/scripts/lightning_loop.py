"""A PyTorch Lightning training script around one of oomdoctor's sample models: a
LightningModule with the model file's network, loss and AdamW, a DataLoader of its batches, and
`Trainer(accelerator="gpu", precision=...)`.fit - Lightning's own loop, AMP and device handling.

    python tests/scripts/lightning_loop.py --model sample_models/gpt2_small.py --precision bf16-mixed
"""
import argparse
import importlib.util

import lightning as L
import torch


def load(path):
    spec = importlib.util.spec_from_file_location("user_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Batches(torch.utils.data.Dataset):
    """The model file's make_batch(1), one sample per item (the DataLoader stacks them)."""

    def __init__(self, m, n):
        self.m, self.n = m, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        batch = self.m.make_batch(1)
        if isinstance(batch, dict):
            return {k: v[0] for k, v in batch.items()}
        return tuple(t[0] for t in batch)


class Module(L.LightningModule):
    def __init__(self, m):
        super().__init__()
        self.m = m
        self.model = m.build_model()

    def training_step(self, batch, _index):
        m = self.m
        if hasattr(m, "loss_fn"):
            return m.loss_fn(self.model, batch)
        out = self.model(**batch) if isinstance(batch, dict) else self.model(*batch)
        return out if isinstance(out, torch.Tensor) else out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-4)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()
    m = load(args.model)
    loader = torch.utils.data.DataLoader(Batches(m, 64), batch_size=args.batch_size)
    trainer = L.Trainer(accelerator="gpu", devices=1, precision=args.precision, max_steps=20,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Module(m), loader)


if __name__ == "__main__":
    main()
