"""Stage 3's gathered parameters on one rank's timeline: when each is gathered and released.

The modules are the layout's parameter paths in the order the traced forward ran them (its
storages' module labels place each fetch and release); the backward runs them in reverse, a
checkpointed block's forward again first. The first iteration gathers each module's parameters
as it runs and releases them after it; from the second, DeepSpeed's coordinator prefetches along
the order the first recorded and keeps what it passed
(:mod:`oomdoctor.plans.parallel.zero3_coordinator`). With ``offload_param`` on several GPUs each
gather copies the rank's partitions to the GPU first.
"""
from __future__ import annotations

from oomdoctor.plans.parallel.deepspeed_model import _Model
from oomdoctor.plans.parallel.events import _Context, _Gpu
from oomdoctor.plans.parallel.fsdp import ALL_GATHER_STREAM as GATHER, _shard
from oomdoctor.plans.parallel.layout import MAIN
from oomdoctor.plans.parallel.zero3_coordinator import Module, coordinate
from oomdoctor.sim.trace import Phase


def gathers(ctx: _Context, g: _Gpu, m: _Model) -> None:
    """Stage 3's gathered parameters, module by module: on one GPU (offloaded) each is its
    partition copied to the GPU on the all-gather stream (``NoGatherHandle``, measured); on
    several, ``AllGatherCoalescedHandle.wait`` concatenates each from the gathered partitions
    on the fetching (default) stream (partition_parameters.py, not measured). The first
    iteration records the module order: each module's parameters are gathered as it runs and
    released after it, in the forward and again in the backward; a parameter its module
    reaches through a child that never runs (``nn.MultiheadAttention``'s ``out_proj``) is
    gathered on the default stream by the parameter's getter and registered with the module
    (parameter_offload.py ``ZeROOrderedDict``). From the second on the coordinator prefetches
    along that order and keeps what it passed (oomdoctor.plans.parallel.zero3_coordinator).
    One rank alone gathers nothing (``_no_gather_coalesced``: the partition is the
    parameter)."""
    if m.world == 1 and not m.offload_param:
        return
    tl = ctx.timing
    for ph in tl.marks_of(Phase.FORWARD):
        mark = tl.phases[ph][2]
        bw = tl.backward_of(ph)
        wins = {b: (lo, hi) for lo, hi, b in tl.bwd_windows.get(bw, [])} if bw is not None \
            else {}
        _coordinated(ctx, g, m, _Steps(ctx, ph, tl.fwd_spans.get(ph, {}), wins, bw),
                     complete=bool(mark.iteration))


class _Steps:
    """When a coordinator step's module is fetched and released on the step's timeline: in
    the forward, around the allocations the traced step labels with the module (or a module
    above it), else its block's span; in the backward, its block's window. The root's own
    modules without a label go before the first block or after the last."""

    def __init__(self, ctx: _Context, ph: int, spans: dict, wins: dict, bw: int | None) -> None:
        start, stop, _ = ctx.timing.phases[ph]
        self.spans, self.wins = spans, wins
        self.start, self.stop = start, stop
        self.bstart, self.bstop = ctx.timing.phases[bw][:2] if bw is not None else (stop, stop)
        self.first = min((lo for lo, _ in spans.values()), default=stop)
        self.last = max((hi for _, hi in spans.values()), default=start)
        self.paths: dict[str, tuple[float, float]] = {}
        for st in ctx.storages:
            if start <= st.t_alloc < stop and st.module:
                lo, hi = self.paths.get(st.module, (st.t_alloc, st.t_alloc))
                self.paths[st.module] = (min(lo, st.t_alloc), max(hi, st.t_alloc))

    def _window(self, block: int) -> tuple[float, float] | None:
        """The backward window ``block``'s gradients fall in: its own, else that of the
        nearest later block with one (the windows are cut where each block's last gradient
        is made, last block first, and a block whose gradients end inside a later block's
        window has none); None for a block after every window (its backward runs first)."""
        if block in self.wins:
            return self.wins[block]
        later = [b for b in self.wins if b > block]
        return self.wins[min(later)] if later else None

    def span(self, path: str) -> tuple[float, float] | None:
        """The forward allocations of the module at ``path`` or the nearest module above it."""
        while path:
            if path in self.paths:
                return self.paths[path]
            path = path.rpartition(".")[0]
        return None

    def times(self, mod: Module, backward: bool, recompute: bool = False
              ) -> tuple[float, float]:
        """(fetch, release) of ``mod``'s parameters (``recompute``: its checkpointed block's
        forward run again at the start of the block's backward window)."""
        window = self._window(mod.block) if backward and mod.block != MAIN else None
        if window is not None:
            lo, hi = window
            return (lo + 0.05, lo + 0.08) if recompute else (lo + 0.1, hi - 0.3)
        if backward:        # the root's, or a block whose backward runs first (a tied lm_head)
            return (self.bstop - 0.3, self.bstop - 0.26) if mod.leading else \
                (self.bstart + 0.05, self.bstart + 0.2)
        own = self.span(mod.path)
        if own is not None:
            return own[0] - 0.4, own[1] + 0.5
        if mod.block != MAIN:
            lo, hi = self.spans.get(mod.block, (self.start, self.stop))
            return lo - 0.4, hi + 0.5
        return (self.start + 0.06, self.first - 0.45) if mod.leading else \
            (self.last + 0.45, self.stop - 0.3)


def _coordinated(ctx: _Context, g: _Gpu, m: _Model, at: _Steps, complete: bool) -> None:
    """One iteration: every parameter from the fetch that gathers it to the release after
    which it goes (``complete``: the module trace is recorded, the coordinator prefetches)."""
    modules = _modules(ctx, m, at)
    backward = _backward(ctx, modules)
    steps = modules + [mod for mod, _ in backward]
    n = len(modules)
    times = [at.times(mod, False) for mod in modules] + \
        [at.times(mod, True, again) for mod, again in backward]
    block = {h: mod.block for mod in modules for h, _ in mod.params}
    # a checkpointed block's forward saves nothing; its recomputation keeps what it saves
    recomputed = {mod.block for mod, again in backward if again}
    # the first iteration's getter gathers: a module path that never ran, under one that did
    getter = set() if complete else {h for mod in modules for h, _ in mod.params
                                     if at.span(mod.path) != at.paths.get(mod.path)}
    for h in coordinate(steps, m.ds.prefetch_bucket_size, m.ds.max_live_parameters,
                        m.ds.max_reuse_distance, complete):
        t0 = times[h.gathered][0]
        t1 = times[h.released][1] if h.released is not None else at.bstop - 0.25
        stream = 0 if (h.handle in getter and h.gathered < n) or m.world > 1 else GATHER
        _copy_in(g, m, ctx.size[h.handle], t0 - 0.01)
        g.add("parameters", ctx.size[h.handle], t0, max(t1, t0 + 0.001), stream=stream)
        saved = at.wins.get(block[h.handle]) if ctx.trace.storages[h.handle].view_saved \
            and block[h.handle] not in recomputed else None
        if saved is not None and h.released is not None and h.released < n:
            # released, but a saved view holds the storage until the block's backward
            g.add("parameters", ctx.size[h.handle], t1, saved[1] - 0.3, stream=stream)


def _backward(ctx: _Context, modules: list[Module]) -> list[tuple[Module, bool]]:
    """The backward's module order, each with whether it is a recomputation: blocks last
    first, a checkpointed block's modules run forward again before their backward (its
    forward hooks fire again, and DeepSpeed fetches for them)."""
    recomputed = set(ctx.trace.checkpointed)
    blocks: list[list[Module]] = []
    for mod in modules:
        if blocks and blocks[-1][0].block == mod.block:
            blocks[-1].append(mod)
        else:
            blocks.append([mod])
    out: list[tuple[Module, bool]] = []
    for group in reversed(blocks):
        block = group[0].block
        if block != MAIN and ctx.layout.blocks[block] in recomputed:
            out += [(mod, True) for mod in group]
        out += [(mod, False) for mod in reversed(group)]
    return out


def _modules(ctx: _Context, m: _Model, at: _Steps) -> list[Module]:
    """The modules whose parameters stage 3 gathers, in forward order: each module path's
    parameters (the layout's names, and a tied weight's other names), a block's in the order
    its modules ran, the root's own before the first block or after the one registered
    before them."""
    lay = ctx.layout
    params = sorted((i, h) for h, i in ctx.param_index.items()
                    if i < lay.num_param_storages and h not in m.persistent)
    groups: dict[tuple, tuple[int, list]] = {}     # order key -> (block, [(index, handle)])
    prev = -1
    for i, h in params:
        owner = lay.param_owner[i]
        if owner != MAIN:
            prev = owner
        key = (owner if owner != MAIN else prev, owner == MAIN and prev >= 0,
               lay.param_names[i].rpartition(".")[0])
        groups.setdefault(key, (owner, []))[1].append((i, h))
        for alias in (lay.param_aliases[i] if i < len(lay.param_aliases) else ()):
            found = _alias_key(lay, at, alias.rpartition(".")[0])
            if found is not None:        # a tied weight fetched again by its other module
                groups.setdefault(found[0], (found[1], []))[1].append((i, h))

    def ran(item):
        (block, trailing, path), (_, members) = item
        span = at.span(path)
        return block, trailing, span[0] if span else float("inf"), members[0][0]
    return [Module(owner, tuple((h, lay.param_numel[i]) for i, h in members),
                   leading=key[0] < 0, path=key[2])
            for key, (owner, members) in sorted(groups.items(), key=ran)]


def _alias_key(lay, at: _Steps, path: str) -> tuple[tuple, int] | None:
    """Where a tied weight's other module runs, as :func:`_modules` orders modules, and its
    block: in its block, or the root's before the first block or after the last; None where
    the traced forward never ran it."""
    span = at.paths.get(path)
    if span is None:
        return None
    block = lay.block_of(path)
    if block is not None and block != MAIN:
        return (block, False, path), block
    if span[0] < at.first:
        return (-1, False, path), MAIN
    return (len(lay.blocks), True, path), MAIN


def _copy_in(g: _Gpu, m: _Model, gathered: int, at: float) -> None:
    """Offloaded parameters: a gather first copies this rank's partitions of the block to the
    GPU, held through the all-gather (one GPU: the copy is the parameter)."""
    if m.offload_param and m.world > 1:
        g.add("communication", _shard(gathered, m.world), at, at + 0.015)
