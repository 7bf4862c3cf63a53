"""Which parameters ZeRO-3 holds gathered, from which module's fetch to which module's release.

DeepSpeed gathers stage 3's parameters module by module (``PartitionedParameterCoordinator``,
deepspeed/runtime/zero/partitioned_param_coordinator.py, 0.19.8). The first iteration records
the order the modules run in (forward, then backward); from the second on, with that trace:

- ``fetch_sub_module`` gathers the module's parameters, pops their entries off the parameter
  queue (every use of every parameter in trace order, with the step of the use), and then
  prefetches: it pops further entries until it has started gathering
  ``stage3_prefetch_bucket_size`` elements (fewer where the gathered ones would pass
  ``stage3_max_live_parameters``). An entry whose parameter is already gathered is popped
  without counting, and its use is recorded (``__most_recent_step_id_param_fetched_for``).
- ``release_sub_module`` releases the module's parameters, except those whose recorded use
  lies ahead and those used again within ``stage3_max_reuse_distance`` elements of the
  modules to come (``__params_to_release``).

So the prefetcher runs ahead of the forward by up to the live limit, into the backward's
first modules - the last blocks, still gathered - and keeps them, and what it gathers ahead,
until their backward. Measured on an H200 (benchmarks/results/deepspeed/, the held-out 1.4B
model with its parameters offloaded): after the second forward 2.0 GiB stayed gathered, the
last 18 of 24 layers' weights (and every layer's packed attention projection, whose views the
backward saves); a rule by the reuse distance alone kept the last 10.

Each module here is one module path's parameters (a block's linear, norm, attention), in the
order they ran; the backward runs them in reverse, a checkpointed block's forward again first
(:mod:`oomdoctor.plans.parallel.zero3_gathers` builds the order and places it on the timeline).
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Module:
    """One module's fetch: its owning block (or MAIN) and its parameters (handle, elements);
    ``leading``: a root module before the first block (the embeddings)."""

    block: int
    params: tuple[tuple[int, int], ...]
    leading: bool = False
    path: str = ""           # its module path, where the trace labels its allocations


@dataclass(frozen=True)
class Held:
    """One parameter gathered at the fetch of step ``gathered`` and released after the module
    of step ``released`` (None: still gathered when the iteration ends)."""

    handle: int
    gathered: int
    released: int | None


def coordinate(steps: list[Module], prefetch_bucket: int, max_live: int,
               max_reuse: int, complete: bool = True) -> list[Held]:
    """The coordinator over one iteration: ``steps`` are the modules in the order they run
    (the forward's, then the backward's). ``complete`` False: the iteration that records the
    trace, which neither prefetches nor keeps anything (``is_complete_trace``)."""
    numel = {h: n for mod in steps for h, n in mod.params}
    queue = deque((h, s) for s, mod in enumerate(steps)
                  for h in sorted({h for h, _ in mod.params}))
    recorded: dict[int, int] = defaultdict(lambda: -1 << 62)
    since: dict[int, int] = {}            # gathered parameter -> the step it was gathered at
    held: list[Held] = []
    live = 0
    for s, mod in enumerate(steps):
        wanted = {h for h, _ in mod.params}
        for h in wanted - since.keys():
            since[h] = s
            live += numel[h]
        if not complete:
            for h in wanted & since.keys():
                held.append(Held(h, since.pop(h), s))
                live -= numel[h]
            continue
        due = {h for h in wanted if recorded[h] < s}
        while queue and due:
            h, at = queue.popleft()
            recorded[h] = at
            due.discard(h)
        budget, started = min(max_live - live, prefetch_bucket), 0
        while queue and started < budget:
            h, at = queue.popleft()
            recorded[h] = max(recorded[h], at)
            if h not in since:
                since[h] = s
                live += numel[h]
                started += numel[h]
        for h in _released(steps, s, wanted, recorded, max_reuse):
            if h in since:
                held.append(Held(h, since.pop(h), s))
                live -= numel[h]
    return held + [Held(h, at, None) for h, at in since.items()]


def _released(steps: list[Module], s: int, params: set[int], recorded: dict[int, int],
              max_reuse: int) -> set[int]:
    """``__params_to_release`` after step ``s``: the module's parameters but those whose
    recorded use is ahead and those the modules within ``max_reuse`` elements use."""
    out = {h for h in params if recorded[h] <= s + 1}
    walked = 0
    for mod in steps[s + 1:]:
        if walked >= max_reuse or not out:
            break
        for h, n in mod.params:
            out.discard(h)
            walked += n
    return out
