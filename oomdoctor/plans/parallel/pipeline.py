"""The naive two-GPU split (pipeline2): storages attributed to blocks, any cut's two event lists."""
from __future__ import annotations

from oomdoctor.plans.parallel.events import _Context, _Gpu
from oomdoctor.plans.parallel.layout import MAIN
from oomdoctor.plans.parallel.results import Partition
from oomdoctor.sim.trace import Phase


class _Pipeline:
    """Every storage attributed to a block (or MAIN), plus the potential boundary copies, so that
    any cut's two event lists are a filter of one table."""

    def __init__(self, ctx: _Context) -> None:
        self.ctx = ctx
        tl = ctx.timing
        lay = ctx.layout
        self.nblocks = len(lay.blocks)
        rows = []          # (t_alloc, t_free, handle, size, key, attr, producer)
        for s in ctx.storages:
            h = s.handle
            if s.phase is Phase.SETUP:      # the model's storages; the GradScaler's on main
                attr = lay.param_owner[ctx.param_index[h]] if h in ctx.param_index else MAIN
            elif s.phase is Phase.DATA:
                attr = MAIN
            elif s.phase is Phase.FORWARD:
                b = tl.block[h]
                attr = MAIN if b is None else (b if b >= 0 else tl.last_block_at(s.t_alloc))
            elif s.phase is Phase.BACKWARD:
                owner = tl.grad_owner.get(h)
                win = tl.window(s.t_alloc)
                attr = (lay.param_owner[owner] if owner is not None
                        else win[2] if win else MAIN)
            elif s.phase is Phase.OPTIMIZER:
                p = ctx.opt_param.get(h)
                attr = lay.param_owner[p] if p is not None else MAIN
            else:
                attr = MAIN
            rows.append((s.t_alloc, s.t_free, h, ctx.size[h], ctx.key(h), attr, None))
        # Tensors handed to a block on another GPU are copied there by accelerate's hook
        # (send_to_device) before the block runs, and live until the block's backward is done;
        # their gradient comes back as a transient copy on the producer's GPU.
        batch = ctx.trace.config.batch_size
        handle = ctx.first_handle
        for ph in tl.marks_of(Phase.FORWARD):
            spans = tl.fwd_spans.get(ph, {})
            bw = tl.backward_of(ph)
            for inp in lay.inputs:
                span = spans.get(inp.block)
                nbytes = inp.bytes(batch)
                if span is None or nbytes == 0:
                    continue
                win = tl.block_window(bw, inp.block) if bw is not None else None
                end = (win[1] - 0.5) if win else tl.phases[ph][1] - 0.5
                rows.append((span[0] - 0.5, end, handle, nbytes, "activations", inp.block,
                             inp.producer))
                handle += 1
                if inp.requires_grad and win:
                    rows.append((win[1] - 0.45, win[1] - 0.45, handle, nbytes, "temporaries",
                                 inp.producer, inp.block))
                    handle += 1
        self.rows = rows
        self.handle_end = handle

    def stages(self, cut: int) -> list[int]:
        """Stage of each block (index nblocks: MAIN) for a cut before execution index ``cut``;
        tied blocks follow the first of their group; MAIN is the last block's stage."""
        st = [0 if b < cut else 1 for b in range(self.nblocks)]
        for group in self.ctx.layout.tied:
            for b in group[1:]:
                st[b] = st[group[0]]
        st.append(st[-1])
        return st

    def _table(self):
        """All rows as one time-ordered array of +/- 512-rounded sizes (built once)."""
        import numpy as np
        if getattr(self, "_arrays", None) is None:
            ev = []
            for t0, t1, _, n, _, attr, prod in self.rows:
                r = -(-n // 512) * 512 if n else 0
                p = -2 if prod is None else prod
                ev.append((t0, 0, r, attr, p))
                if t1 is not None:
                    ev.append((t1, 1, -r, attr, p))
            ev.sort(key=lambda e: (e[0], e[1]))
            arr = np.array([(d, a, p) for _, _, d, a, p in ev], dtype=np.int64).reshape(-1, 3)
            self._arrays = (arr[:, 0], arr[:, 1], arr[:, 2])
        return self._arrays

    def live_peak(self, cut: int) -> tuple[int, ...]:
        """Peak of live bytes (512-rounded) per stage, without the allocator: for the search."""
        import numpy as np
        delta, attr, prod = self._table()
        st = np.array(self.stages(cut), dtype=np.int64)
        stage = st[attr]
        crossing = (prod == -2) | (st[np.where(prod == -2, 0, prod)] != stage)
        peaks = []
        for k in range(2):
            d = np.where((stage == k) & crossing, delta, 0)
            peaks.append(int(np.cumsum(d).max(initial=0)) if len(d) else 0)
        return tuple(peaks)

    def gpus(self, cut: int) -> list[_Gpu]:
        st = self.stages(cut)
        out = [_Gpu(f"GPU {k} (stage {k})", self.handle_end) for k in range(2)]
        for g in out:               # each process's BLAS workspaces; reductions' scratch on both
            self.ctx.workspaces(g)
        for t0, t1, h, n, key, attr, prod in self.rows:
            if prod is not None and st[prod] == st[attr]:
                continue
            out[st[attr]].add(key, n, t0, t1, h)
        return out

    def partition(self, cut: int) -> Partition:
        lay = self.ctx.layout
        st = self.stages(cut)
        stages = tuple(tuple(b for i, b in enumerate(lay.blocks) if st[i] == k) for k in range(2))
        dmap = {b: st[i] for i, b in enumerate(lay.blocks) if b}
        main = st[self.nblocks]
        for i, name in enumerate(lay.param_names):
            if lay.param_owner[i] == MAIN and lay.persistent[i]:
                dmap[name] = main
        fl = [0.0, 0.0]
        for i, f in enumerate(lay.block_flops):
            fl[st[i]] += f
        total = sum(fl) or 1.0
        batch = self.ctx.trace.config.batch_size
        cross = sum(inp.bytes(batch) for inp in lay.inputs
                    if st[inp.producer] != st[inp.block])
        return Partition(stages, main, dmap, (fl[0] / total, fl[1] / total), cross)
