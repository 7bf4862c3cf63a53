"""The optimizer steps of a traced training loop: the loop's own ``step()``, and steps taken
anywhere else - inside backward, where an optimizer-in-backward setup steps each parameter from
its ``register_post_accumulate_grad_hook`` and frees its gradient at once (pytorch/tutorials,
``optimizer_step_in_backward_tutorial.py``).

Every step, wherever it runs, gets what a step needs on a fake trace: factory calls without a
device make host tensors (Adam's and Adagrad's ``step`` counters, read with ``.item()`` - host
tensors on CUDA too; on the meta device they would have no value to read), and the state it
creates is labelled optimizer state. Global optimizer step hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) find the steps; the model file need
not say where they are.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)


def unique_storages(tensors) -> dict[int, torch.Tensor]:
    """One tensor per storage, keyed by the storage (tied weights, shared maps count once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(t.untyped_storage()._cdata, t)
    return seen


def state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) for every tensor of the optimizer's state. A tensor subclass that wraps
    others (torchao's low-bit ``OptimState8bit``: uint8 codes, block scales, a code map) is
    given as the tensors that hold its memory; the wrapper itself holds none."""
    for st in optimizer.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                yield from ((k, t) for t in _leaves(v))


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [leaf for name in names for leaf in _leaves(getattr(t, name))]


def state_bytes(optimizer: torch.optim.Optimizer, keep: Callable[[str, torch.Tensor], bool]
                ) -> int:
    """Bytes of the optimizer's state tensors that ``keep(key, tensor)`` selects, once per
    storage: bitsandbytes shares its quantization maps across parameters."""
    return sum(t.untyped_storage().nbytes() for t in unique_storages(
        v for k, v in state_tensors(optimizer) if keep(k, v)).values())


def host_state(emulate_cuda: bool, optimizer: torch.optim.Optimizer, key: str,
               v: torch.Tensor) -> bool:
    """Whether a state tensor lives outside the GPU allocator."""
    # Adam's `step` counter stays on the host unless capturable/fused
    # (torch/optim/adam.py _init_group), so it is no GPU memory. bitsandbytes' paged state is
    # CUDA unified memory, outside the caching allocator (cudaoptim.paged_optimizers_on_meta).
    if getattr(v, "is_paged", False):
        return True
    return (emulate_cuda and key == "step" and v.dim() == 0
            and not optimizer.defaults.get("fused") and not optimizer.defaults.get("capturable"))


_OPEN_STEPS: list[contextlib.ExitStack] = []      # the steps running now (every_step)


def in_step() -> bool:
    """Whether an optimizer step is running (inside :func:`every_step`)."""
    return bool(_OPEN_STEPS)


@contextlib.contextmanager
def every_step(relabel: Callable[[torch.optim.Optimizer], None]
               ) -> Iterator[list[torch.optim.Optimizer]]:
    """Within the block, every ``optimizer.step()`` runs with host tensors as the default for
    device-less factories, and ``relabel(optimizer)`` hears each finished step. Yields the
    optimizers that stepped, in order of their first step."""
    stepped: list[torch.optim.Optimizer] = []
    open_steps = _OPEN_STEPS

    def pre(optimizer, _args, _kwargs):
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device("cpu"))
        open_steps.append(stack)

    def post(optimizer, _args, _kwargs):
        open_steps.pop().close()
        if not any(o is optimizer for o in stepped):
            stepped.append(optimizer)
        relabel(optimizer)
    hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
    try:
        yield stepped
    finally:
        for h in hooks:
            h.remove()
        while open_steps:                 # a step that raised: leave no device mode behind
            open_steps.pop().close()


def step_notes(optimizer: torch.optim.Optimizer, held: list[torch.optim.Optimizer]) -> list[str]:
    """What the output should say about how the optimizers stepped (``held``: the loop's
    optimizer first, then any stepped inside backward)."""
    notes = []
    if len(held) > 1:
        notes.append(f"{len(held) - 1} optimizers stepped inside backward (optimizer in "
                     "backward): each gradient is freed as soon as its parameter steps")
    paged = state_bytes(optimizer, lambda k, v: getattr(v, "is_paged", False))
    if paged:
        notes.append(f"{type(optimizer).__name__}: {paged / 2**20:.1f} MiB of optimizer "
                     "state is paged (CUDA unified memory, outside PyTorch's allocator): "
                     "not counted in the peak; it takes GPU memory while resident and "
                     "moves to host RAM when the GPU runs short, at the cost of slower "
                     "steps")
    return notes


def compile_notes(optimizer: torch.optim.Optimizer, compiled: list[tuple[str, str]]
                  ) -> list[str]:
    """Notes on the torch.compile calls of a trace (oomdoctor.sim.eager.compile_as_eager)."""
    notes = []
    if any(where == "step" for where, _ in compiled):
        notes.append(f"{type(optimizer).__name__} compiles its step: Inductor fuses the "
                     "update, keeping a full-precision copy of each state tensor while it is "
                     "re-quantized; the eager step's other temporaries are not counted "
                     "(measured with Inductor on the CPU)")
    if any(where == "model" for where, _ in compiled):
        # Measured with benchmarks/bench_compile.py (real CPU training steps, Inductor, torch
        # 2.13, peaks from the profiler's allocator events), compiled/eager peak:
        # - 0.78, a GPT-style stack: mostly the loss; eager's log-softmax backward holds two
        #   more logit-sized tensors, the compiled backward fuses them (its saved tensors are
        #   only 7% fewer);
        # - 1.00, a GELU MLP: AOTAutograd's min-cut partitioner minimises bytes moved, not
        #   held, and kept both the matmul output and its GELU, as eager does;
        # - 0.75, a VGG-style conv net: max-pool's int64 indices become int8 offsets, and the
        #   ReLU output feeding a pool is recomputed, not kept;
        # - 0.95 / 1.09, a U-Net at batch 16 / 4: Inductor's layout optimization (always on
        #   for CPU convolutions with oneDNN, torch/_inductor/graph.py decide_layout_opt)
        #   saves a channels-last copy of every conv weight for backward; at batch 4 that
        #   outweighs the activations it saves (with TORCHINDUCTOR_LAYOUT_OPTIMIZATION=0: 0.94).
        #   On CUDA the same function's heuristic would leave this U-Net channels-first (its
        #   up-path convolutions halve the channels), so the +9% is the CPU's.
        notes.append("the model file calls torch.compile: traced as eager PyTorch. Measured "
                     "on the CPU, compiled training peaked 0-25% below eager (a GPT-style "
                     "stack -22%, an MLP 0%, conv nets -5% to -25%), but a small-batch U-Net "
                     "came out 9% above: Inductor saved a channels-last copy of each conv "
                     "weight for backward (on a GPU only where it picks channels-last). Read "
                     "this as the eager figure, not a bound")
    return notes


def most_live(ranges: list[tuple[int, int]], events, counted: Callable[[int], bool]) -> int:
    """The most bytes alive at once within each [start, stop) range of the event list, over
    the ranges, counting only the storages ``counted`` accepts (allocated inside the range)."""
    most = 0
    for start, stop in ranges:
        live = 0
        for is_alloc, handle, nbytes in events[start:stop]:
            if counted(handle):
                live += nbytes if is_alloc else -nbytes
                most = max(most, live)
    return most


def foreach_measured(notes: list[str], foreach: list[str], steps: list[tuple[int, int]], events,
                     parameter_bytes: int, temporary: Callable[[int], bool]) -> list[str]:
    """The notes with what the step's temporaries came to in the trace added to each foreach
    note: plain SGD and SGD with momentum update in place and make none; Adam(W) makes about
    one parameter-sized set (PT-1)."""
    if not any(n in foreach for n in notes):
        return notes
    most = most_live(steps, events, temporary)
    said = ("its step() made no temporaries in the trace: it updates in place" if not most
            else f"its step() temporaries traced: at most {most / 2**20:,.1f} MiB at once, "
                 f"{most / max(parameter_bytes, 1):.2f}x the parameters' bytes")
    return [f"{n} ({said})" if n in foreach else n for n in notes]


class _OutOfPlaceEps(TorchFunctionMode):
    """The foreach Adam/AdamW step of torch 2.0: ``denom = torch._foreach_add(exp_avg_sq_sqrt,
    eps)`` made a second parameter-sized set of intermediates, alive with the first until
    ``step()`` returned (torch/optim/adam.py at v2.0.0, ``_multi_tensor_adam``). Since 2.1 eps
    is added in place (github.com/pytorch/pytorch/pull/104898): the installed torch runs that,
    and each in-place ``_foreach_add_(tensors, scalar)`` here also makes the old copy, held
    until the step ends. Step counters (0-dim) are left alone."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch._foreach_add_ and len(args) == 2 and not kwargs
                and isinstance(args[1], (int, float)) and all(t.dim() > 0 for t in args[0])):
            self.held.append(torch._foreach_add(args[0], args[1]))
        return func(*args, **kwargs)


@contextlib.contextmanager
def foreach_adam_before_2_1(optimizer: torch.optim.Optimizer, enabled: bool):
    """Around ``optimizer.step()``: torch 2.0's second foreach Adam/AdamW intermediate
    (:class:`_OutOfPlaceEps`) when ``enabled`` and the optimizer runs foreach."""
    foreach = any(g.get("foreach") for g in optimizer.param_groups)
    if not (enabled and foreach and type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)):
        yield
        return
    mode = _OutOfPlaceEps()
    with mode:
        yield
    mode.held.clear()
