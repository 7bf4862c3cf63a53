"""How fast a training script's DataLoader delivers batches on this machine, per worker count.

A script run through oomdoctor builds its DataLoaders for real (oomdoctor.sim.script keeps them).
Here each is run again, alone, outside the fake GPU: a fresh DataLoader over the same dataset,
batch size and collate function (samples drawn at random, so a short dataset lasts), with 0, 2,
4, ... worker processes, timed in the steady state (after the batches the workers prefetch
while starting). A dataset of few batches per epoch also pays the workers' start-up each
epoch, unless persistent_workers=True. Nothing is guessed: the figure for a worker count is
that worker count's measurement.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

MAX_BATCHES = 24            # timed batches per setting, at most
SECONDS = 3.0               # time per setting, at most (a slow pipeline stops earlier)


@dataclass(frozen=True)
class LoaderTiming:
    """One setting's measurement."""

    num_workers: int
    pin_memory: bool
    seconds_per_batch: float
    batches: int                     # batches timed (after the warm-up)


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's or a job's share)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def clone(loader: Any, num_workers: int, pin_memory: bool, batches: int | None = None
          ) -> torch.utils.data.DataLoader:
    """A DataLoader that yields what ``loader`` yields, with other workers and pinning; with
    ``batches``, a map-style dataset batched by batch size is drawn with replacement for that
    many batches in one epoch (a short dataset still shows the workers' steady state)."""
    common = dict(num_workers=num_workers, collate_fn=loader.collate_fn,
                  pin_memory=pin_memory, worker_init_fn=loader.worker_init_fn,
                  timeout=loader.timeout, generator=loader.generator)
    if num_workers:
        common["prefetch_factor"] = loader.prefetch_factor or 2
    iterable = getattr(loader, "_dataset_kind", 0) == 1
    if loader.batch_size is None and loader.batch_sampler is None:
        return torch.utils.data.DataLoader(loader.dataset, batch_size=None,
                                           sampler=loader.sampler, **common)
    if iterable:                                  # an IterableDataset: no sampler
        return torch.utils.data.DataLoader(loader.dataset, batch_size=loader.batch_size,
                                           drop_last=loader.drop_last, **common)
    if batches and loader.batch_size:
        draw = torch.utils.data.RandomSampler(loader.dataset, replacement=True,
                                              num_samples=batches * loader.batch_size)
        return torch.utils.data.DataLoader(loader.dataset, batch_size=loader.batch_size,
                                           sampler=draw, drop_last=True, **common)
    return torch.utils.data.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler,
                                       **common)


def time_loader(loader: Any, num_workers: int, pin_memory: bool = False,
                max_batches: int = MAX_BATCHES, seconds: float = SECONDS) -> LoaderTiming | None:
    """Seconds per batch of ``loader`` run again with these settings, in the steady state:
    the batches the workers prefetch while starting (``prefetch_factor`` each) are let through
    first, then ``max_batches`` - at least four rounds of the workers - are timed. None when it
    yields too few batches to time."""
    prefetched = num_workers * (loader.prefetch_factor or 2) if num_workers else 1
    want = max(max_batches, 4 * num_workers)
    it = iter(clone(loader, num_workers, pin_memory, prefetched + want))
    try:
        for _ in range(prefetched):
            next(it)
        start, n = time.perf_counter(), 0
        for _ in it:
            n += 1
            if n >= want or time.perf_counter() - start > seconds:
                break
        elapsed = time.perf_counter() - start
    except StopIteration:
        return None
    finally:
        del it                                        # shut its workers down now
    return LoaderTiming(num_workers, pin_memory, elapsed / n, n) if n else None


def worker_counts(most: int) -> list[int]:
    """0, 2, 4, 8, ... up to ``most`` (and ``most`` itself)."""
    counts, w = [0], 2
    while w < most:
        counts.append(w)
        w *= 2
    if most > 0 and counts[-1] != most:
        counts.append(most)
    return counts


def sweep(loader: Any, counts: Iterable[int], enough: Callable[[LoaderTiming], bool],
          pin_memory: bool = False, progress: Callable[[str], None] = lambda _: None
          ) -> list[LoaderTiming]:
    """The loader timed at each worker count in turn, stopping at the first that is
    ``enough`` (the GPU would not wait) or no faster than the one before (more workers than
    the pipeline can use)."""
    out: list[LoaderTiming] = []
    for w in counts:
        progress(f"timing the DataLoader with num_workers={w}")
        t = time_loader(loader, w, pin_memory)
        if t is None:
            break
        out.append(t)
        if enough(t) or (
                len(out) > 1 and t.seconds_per_batch > 0.9 * out[-2].seconds_per_batch):
            break
    return out
