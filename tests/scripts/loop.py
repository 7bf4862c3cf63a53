"""A plain training loop around one of oomdoctor's sample models, as a user would write it for
their own network: the model and a batch from the model file's functions, the loss, the
optimizer, optional autocast with a GradScaler, gradient accumulation, and the habits of real
loops (zero_grad at the top, a loss.item() log line).

    python tests/scripts/loop.py --model sample_models/gpt2_small.py --batch-size 4 --amp bf16
"""
import argparse
import importlib.util

import torch


def load(path):
    spec = importlib.util.spec_from_file_location("user_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def to(batch, device):
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(t.to(device) for t in batch)
    return batch.to(device)


def loss_of(m, model, batch):
    if hasattr(m, "loss_fn"):
        return m.loss_fn(model, batch)
    out = model(**batch) if isinstance(batch, dict) else (
        model(*batch) if isinstance(batch, (tuple, list)) else model(batch))
    return out if isinstance(out, torch.Tensor) else out.loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none")
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()

    m = load(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = m.build_model().to(device)
    model.train()
    optimizer = (m.make_optimizer(model.parameters()) if hasattr(m, "make_optimizer")
                 else torch.optim.AdamW(model.parameters(), lr=1e-4))
    amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp == "fp16")
    for step in range(args.steps):
        for _ in range(args.accum):
            batch = to(m.make_batch(args.batch_size), device)
            with torch.autocast(device_type="cuda", dtype=amp or torch.float32,
                                enabled=amp is not None):
                loss = loss_of(m, model, batch) / args.accum
            scaler.scale(loss).backward()
            del batch, loss
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            print(f"step {step}")


if __name__ == "__main__":
    main()
