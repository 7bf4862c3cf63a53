"""Per-GPU event lists on the trace's timeline, and the context every strategy builder shares."""
from __future__ import annotations

from typing import Any, Callable

from oomdoctor.sim.allocator import EMPTY_CACHE
from oomdoctor.sim.gpus import GpuProfile
from oomdoctor.plans.parallel.layout import Layout
from oomdoctor.plans.parallel.results import _CATEGORY_KEY
from oomdoctor.plans.parallel.timeline import _Timing, setup_storages
from oomdoctor.sim.trace import Category, Phase, Trace
from oomdoctor.plans.estimate import blas_workspaces
from oomdoctor.sim.workspaces import reduction_scratch


class _Gpu:
    """One GPU's allocations on the trace's timeline, to be sorted into an event list."""

    def __init__(self, label: str, first_handle: int) -> None:
        self.label = label
        self.items: list[tuple[float, int, bool, int, int]] = []
        self.keys: dict[int, str] = {}
        self.sizes: dict[int, int] = {}
        self.streams: dict[int, int] = {}      # handle -> its stream, when not the default
        self._next = first_handle

    def add(self, key: str, nbytes: int, t_alloc: float, t_free: float | None,
            handle: int | None = None, stream: int = 0) -> int:
        if handle is None:
            handle = self._next
            self._next += 1
        if stream:
            self.streams[handle] = stream
        self.keys[handle] = key
        self.sizes[handle] = nbytes
        self.items.append((t_alloc, len(self.items), True, handle, nbytes))
        if t_free is not None:
            self.items.append((t_free, len(self.items), False, handle, nbytes))
        return handle

    def empty_cache(self, t: float) -> None:
        """``torch.cuda.empty_cache()`` at ``t``."""
        self.items.append((t, len(self.items), False, EMPTY_CACHE, 0))

    def free(self, handle: int, t_free: float) -> None:
        """Free at ``t_free`` what :meth:`add` allocated with no free."""
        self.items.append((t_free, len(self.items), False, handle, self.sizes[handle]))

    def events(self) -> tuple[list[tuple[bool, int, int]], list[float]]:
        items = sorted(self.items)
        return [(a, h, n) for _, _, a, h, n in items], [p for p, *_ in items]


class _Context:
    """What every strategy builder needs: the trace, its timing, sizes at this batch."""

    def __init__(self, trace: Trace, layout: Layout, gpu: GpuProfile, sizes: list[int],
                 sizes_dp: list[int] | None = None, workspaces: bool = True) -> None:
        self.trace = trace
        self.layout = layout
        self.gpu = gpu
        self.timing = _Timing(trace, layout)
        self.size = sizes
        self.size_dp = sizes_dp or sizes
        self.storages = sorted((s for s in trace.storages.values() if not s.host),
                               key=lambda s: s.t_alloc)
        self.first_handle = len(sizes) + 16
        self.with_workspaces = workspaces
        # The model's parameters and buffers (fp16's GradScaler also makes its scale and growth
        # tracker during setup: 4-byte temporaries, not the model's).
        setup = setup_storages(trace, layout)
        if len(setup) != len(layout.param_owner):
            raise ValueError(f"{layout.model}: the trace registered {len(setup)} parameter/buffer "
                             f"storages, the layout {len(layout.param_owner)}; trace and layout "
                             "must come from the same model file and precision")
        self.param_index = {s.handle: i for i, s in enumerate(setup)}
        self.setup_end = min((m.start for m in trace.marks if m.phase is not Phase.SETUP),
                             default=self.timing.end)
        self.opt_param = _optimizer_params(self)

    def key(self, h: int) -> str:
        return _CATEGORY_KEY[self.trace.storages[h].category]

    def workspaces(self, g: _Gpu) -> None:
        """What the device adds to the trace, as estimate.device_events does: the BLAS
        workspaces (before the first forward / backward matmul, kept) and each reduction's
        scratch buffer and semaphores, for the length of its kernel."""
        if not self.with_workspaces:
            return
        for start, nbytes in blas_workspaces(self.trace, self.gpu):
            g.add("temporaries", nbytes, start - 0.5, None)
        for i, (buf, sem) in reduction_scratch(self.trace, self.gpu).items():
            g.add("temporaries", buf, i + 0.01, i + 0.04)
            g.add("temporaries", sem, i + 0.02, i + 0.03)

    def param_bytes(self, owner: int | None = None) -> int:
        total = 0
        for s in self.storages:
            if s.phase is not Phase.SETUP or s.category is not Category.PARAMETERS:
                continue
            if owner is None or self.layout.param_owner[self.param_index[s.handle]] == owner:
                total += self.size[s.handle]
        return total

    def gradients_in_order(self) -> list[int]:
        """Sizes of the gradients of the first backward, in the order they were made."""
        first = [ph for ph in self.timing.marks_of(Phase.BACKWARD)][:1]
        if not first:
            return []
        lo, hi, _ = self.timing.phases[first[0]]
        return [self.size[s.handle] for s in self.storages
                if s.category is Category.GRADIENTS and lo <= s.t_alloc < hi]


def _optimizer_params(ctx: _Context) -> dict[int, int]:
    """For optimizer-phase storages: the index (in layout.param_* order) of the parameter each
    belongs to. Runs of consecutive allocations by one op whose sizes follow the trainable
    parameters (``_foreach_*`` lists, ``zeros_like`` per state slot) are matched element-wise;
    otherwise a pointer walks the parameters by size (for-loop optimizers)."""
    lay = ctx.layout
    params = [i for i in range(lay.num_param_storages) if lay.param_trainable[i]]
    handle_of = {i: h for h, i in ctx.param_index.items()}
    psize = [ctx.trace.storages[handle_of[i]].nbytes for i in params]
    opt = [s for s in ctx.storages if s.phase is Phase.OPTIMIZER]
    out: dict[int, int] = {}
    if not params:
        return out
    runs: list[list] = []
    for s in opt:
        if runs and (runs[-1][0].op, runs[-1][0].iteration) == (s.op, s.iteration):
            runs[-1].append(s)
        else:
            runs.append([s])
    ptr = 0
    n = len(params)
    for run in runs:
        sizes = [s.nbytes for s in run]
        if len(run) % n == 0:
            k = len(run) // n
            # k state slots per parameter (zeros_like for exp_avg, exp_avg_sq) or k lists
            # of one _foreach_* op after another.
            for index in (lambda j: j // k, lambda j: j % n):
                if all(sizes[j] == psize[index(j)] for j in range(len(run))):
                    for j, s in enumerate(run):
                        out[s.handle] = params[index(j)]
                    break
            else:
                index = None
            if index is not None:
                continue
        for s in run:
            if s.nbytes == psize[ptr % n]:
                out[s.handle] = params[ptr % n]
            elif s.nbytes == psize[(ptr + 1) % n]:
                ptr += 1
                out[s.handle] = params[ptr % n]
    return out


def _base(ctx: _Context, g: _Gpu, keep: Callable[[Any], bool] = lambda s: True,
          size: Callable[[Any], int] | None = None) -> None:
    for s in ctx.storages:
        if keep(s):
            g.add(ctx.key(s.handle), size(s) if size else ctx.size[s.handle], s.t_alloc,
                  s.t_free, s.handle)


def _single(ctx: _Context) -> list[_Gpu]:
    g = _Gpu("GPU 0", ctx.first_handle)
    ctx.workspaces(g)
    _base(ctx, g)
    return [g]
