"""A sequence classifier trained on variable-length token sequences, padded per batch by its
own collate function: the batch shapes come from the data, not from a fixed length.

    python tests/scripts/pad_loop.py --bs 4
"""
import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader


def lengths(n):
    """The dataset's sequence lengths (deterministic, so tests can recompute the padding)."""
    return [8 + (i * 37) % 120 for i in range(n)]


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.items = [torch.randint(1, 1000, (L,)) for L in lengths(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i], i % 3


def collate(batch):
    longest = max(len(x) for x, _ in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    for i, (x, _) in enumerate(batch):
        ids[i, :len(x)] = x
    return ids, torch.tensor([y for _, y in batch])


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 128, padding_idx=0)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(128, 4, 256, batch_first=True), num_layers=2)
        self.head = nn.Linear(128, 3)

    def forward(self, ids):
        pad = ids == 0
        h = self.encoder(self.embed(ids), src_key_padding_mask=pad)
        h = h.masked_fill(pad[..., None], 0).sum(1) / (~pad).sum(1, keepdim=True)
        return self.head(h)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bs", type=int, default=8)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loader = DataLoader(Tokens(64), batch_size=args.bs, shuffle=False, collate_fn=collate)
    model = Classifier().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for ids, labels in loader:
        ids, labels = ids.to(device), labels.to(device)
        loss = nn.functional.cross_entropy(model(ids), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
