"""What each storage of a traced step is: gradients and optimizer state by what holds them,
activations (a forward allocation alive when its forward ends, so held for backward) versus
temporaries, and the storages that never reach the allocator (host-side, fused away)."""
from __future__ import annotations

import torch

from oomdoctor.sim.recorder import Category, Phase, PhaseMark, Recorder
from oomdoctor.sim.stepping import host_state, state_tensors, unique_storages


def label_gradients(rec: Recorder, model: torch.nn.Module) -> int:
    """Label the gradients the backward left and return their bytes (holding no reference:
    one kept here would outlive zero_grad)."""
    grads = unique_storages(p.grad for p in model.parameters() if p.grad is not None)
    names = {p.grad.untyped_storage()._cdata: n for n, p in model.named_parameters()
             if p.grad is not None}
    for key, g in grads.items():
        rec.relabel(g, Category.GRADIENTS, name=f"{names.get(key, 'parameter')}.grad")
    return sum(g.untyped_storage().nbytes() for g in grads.values())


def label_state(rec: Recorder, emulate_cuda: bool, optimizer: torch.optim.Optimizer) -> None:
    owner = {}      # each state tensor's storage -> the parameter's name, for snapshot frames
    for p, st in optimizer.state.items():
        h = rec.handle_of(p) if isinstance(p, torch.Tensor) else None
        for v in st.values():
            if isinstance(v, torch.Tensor) and h is not None:
                owner[v.untyped_storage()._cdata] = rec.storages[h].name
    for k, v in state_tensors(optimizer):
        of = owner.get(v.untyped_storage()._cdata)
        rec.relabel(v, Category.OPTIMIZER_STATE, host=host_state(emulate_cuda, optimizer, k, v),
                    name=f"{type(optimizer).__name__}.step: {k}" + (f" of {of}" if of else ""))


def label_activations(rec: Recorder, marks: list[PhaseMark]) -> list[int]:
    """Categorise what the step made: a forward allocation still alive when the forward ends
    is held for backward (an activation); the rest is temporary. Returns each event's phase
    end (:func:`phase_ends`)."""
    ends = phase_ends(marks, len(rec.raw))
    for s in rec.storages.values():
        if s.category is Category.TEMPORARIES and s.phase is Phase.FORWARD:
            if s.t_free is None or s.t_free >= ends[s.t_alloc]:
                s.category = Category.ACTIVATIONS
    return ends


def allocator_events(rec: Recorder) -> tuple[tuple[bool, int, int], ...]:
    """The allocator's events. Host-side storages stay as 0-byte events (never allocator
    calls): indices stay aligned."""
    for h in rec.fusion.fused_away(rec.storages, rec.raw):
        rec.storages[h].host = True            # in a fused kernel's registers: no memory
    host = {h for h, s in rec.storages.items() if s.host}
    return tuple((a, h, 0) if h in host else (a, h, n) for a, h, n in rec.raw)


def phase_ends(marks: list[PhaseMark], n: int) -> list[int]:
    """For every event index, the index where its phase ends."""
    ends = [n] * n
    for i, m in enumerate(marks):
        stop = marks[i + 1].start if i + 1 < len(marks) else n
        for j in range(m.start, stop):
            ends[j] = stop
    return ends
