"""Patterns from public training scripts that oomdoctor's run of a script must follow, each
behind a flag (found by running pytorch/examples, nanoGPT and accelerate's examples):

    --transform     the dataset applies an nn.Module transform per sample on the CPU, as
                    torchvision's v1 transforms are (imagenet/main.py, accelerate cv_example)
    --evals N       N evaluation forwards under no_grad before the first step (nanoGPT's
                    estimate_loss at iteration 0)
    --manual-sgd    no optimizer: p.data.add_(p.grad, alpha=-lr) (word_language_model)
    --gan           two models, the discriminator stepping on a real and a fake loss (dcgan)
    --batchify      the whole corpus moved to the GPU once, batches sliced from it
                    (word_language_model's batchify), sequence-first (seq, batch) inputs
    --format        f"{loss:.3f}" of the GPU loss (imagenet's AverageMeter)

    oomdoctor estimate -- python tests/scripts/patterns_loop.py --batch-size 8 --transform
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, SEQ, VOCAB = 128, 32, 512


class Noise(nn.Module):
    """A per-sample transform written as a module (torchvision v1 transforms are modules)."""

    def forward(self, x):
        return x + 0.01 * torch.randn_like(x)


class Samples(torch.utils.data.Dataset):
    def __init__(self, n, transform=None):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, WIDTH, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.transform = transform

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i]
        return (self.transform(x) if self.transform else x), self.y[i]


def mlp(out=10, hidden=1024):
    return nn.Sequential(nn.Linear(WIDTH, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, out))


class SeqModel(nn.Module):
    """Sequence-first, as torch's RNNs are by default: (seq, batch) ids."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.rnn = nn.LSTM(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return self.head(out)


def classifier(args, device):
    model = mlp().to(device)
    opt = None if args.manual_sgd else torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Samples(4 * args.batch_size, Noise() if args.transform else None)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True)
    if args.evals:
        with torch.no_grad():
            x = torch.randn(args.batch_size, WIDTH, device=device)
            for _ in range(args.evals):
                model(x)
    for step, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        if opt is None:
            with torch.no_grad():
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-1e-3)
                    p.grad = None
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if args.format:
            print(f"step {step} loss {loss:.3f}")
        if step == 3:
            break


def gan(args, device):
    netG, netD = mlp(WIDTH).to(device), mlp(1).to(device)
    optG = torch.optim.Adam(netG.parameters(), lr=2e-4)
    optD = torch.optim.Adam(netD.parameters(), lr=2e-4)
    loader = torch.utils.data.DataLoader(Samples(4 * args.batch_size), batch_size=args.batch_size)
    for step, (real, _) in enumerate(loader):
        real = real.to(device)
        ones = torch.ones(len(real), 1, device=device)
        netD.zero_grad()
        F.binary_cross_entropy_with_logits(netD(real), ones).backward()
        fake = netG(torch.randn(len(real), WIDTH, device=device))
        F.binary_cross_entropy_with_logits(netD(fake.detach()), 0 * ones).backward()
        optD.step()
        netG.zero_grad()
        F.binary_cross_entropy_with_logits(netD(fake), ones).backward()
        optG.step()
        if step == 3:
            break


def corpus(args, device):
    """batchify: the corpus as (tokens // batch, batch) on the GPU once; bptt slices of it."""
    tokens = torch.randint(0, VOCAB, (4096,))
    n = tokens.numel() // args.batch_size
    data = tokens[:n * args.batch_size].view(args.batch_size, -1).t().contiguous().to(device)
    model = SeqModel().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, i in enumerate(range(0, data.size(0) - 1 - SEQ, SEQ)):
        ids, targets = data[i:i + SEQ], data[i + 1:i + 1 + SEQ]
        loss = F.cross_entropy(model(ids).view(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 3:
            break


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--transform", action="store_true")
    parser.add_argument("--evals", type=int, default=0)
    parser.add_argument("--manual-sgd", action="store_true")
    parser.add_argument("--gan", action="store_true")
    parser.add_argument("--batchify", action="store_true")
    parser.add_argument("--format", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if args.gan:
        gan(args, device)
    elif args.batchify:
        corpus(args, device)
    else:
        classifier(args, device)


if __name__ == "__main__":
    main()
