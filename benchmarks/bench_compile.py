"""How far below eager does ``torch.compile(model)`` training land? Real CPU runs, measured.

For each small model, one real CPU training loop (AdamW, forward + loss + backward + step +
``zero_grad(set_to_none=True)``) is run eagerly and under ``torch.compile(model)`` (Inductor's
CPU backend), and its peak allocated bytes are read from torch.profiler's allocator events with
``tests/reference.py``'s ``_profiled_peak`` (the same reading the tests use). Step 1 runs outside
the profiler (it compiles, and it creates the optimizer state); steps 2-3 are measured, with the
parameters, buffers and optimizer state already allocated counted as the base. oomdoctor's
estimate of the same model file is printed beside them (CPU behaviour: ``emulate_cuda=False``):
it traces the eager model, so it should match the eager column. "above base" compares the
two runs without the parameters, buffers and AdamW state (the same in both): what compile
changes, activations, gradients and temporaries, as a ratio.

    python benchmarks/bench_compile.py            # all models, about 2 minutes on 2 cores
    python benchmarks/bench_compile.py --models gelu_mlp convnet
    python benchmarks/bench_compile.py --inductor-estimate   # and Inductor's own peak estimate

The CPU convolution backward's per-thread scratch is not counted (``opaque``, as in
tests/test_checkpointing.py): it is a CPU kernel's, the trace does not see it, and it would be
the same in both runs.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))        # the independent reference measurement
sys.path.insert(0, str(ROOT))                  # this checkout's oomdoctor, not an installed one

from reference import _loss, _profiled_peak, load  # noqa: E402

from oomdoctor.models.loader import load_model_file  # noqa: E402
from oomdoctor.sim.trace import TraceConfig, trace_training  # noqa: E402

HERE = Path(__file__).resolve().parent / "compile_models"
MODELS = {                                     # name: (model file, batch size)
    "gpt_tiny": (HERE / "gpt_tiny.py", 8),
    "gelu_mlp": (HERE / "gelu_mlp.py", 2048),
    "convnet": (HERE / "convnet.py", 32),
    "unet": (ROOT / "tests/models/unet.py", 4),
    "unet_b16": (ROOT / "tests/models/unet.py", 16),
}
OPAQUE = ("aten::convolution_backward",)


@contextlib.contextmanager
def inductor_estimates(into: list[int]):
    """Collect Inductor's own peak-memory estimate of each graph it schedules (forward, backward):
    its scheduler orders the nodes to lower the peak (``config.reorder_for_peak_memory``, on by
    default) and ``torch/_inductor/memory.py`` estimates the peak of the order it keeps, from
    buffer sizes and lifetimes, graph inputs it may free included. Caches are off so the
    scheduler runs (a cache hit skips it). A candidate model of what compile saves, before any
    kernel is built; compared here with the real run."""
    import torch._inductor.memory as memory
    real = memory.reorder_for_peak_memory

    def spy(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, *a, **kw):
        out = real(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, *a, **kw)
        peak, _ = memory.prepare_planning_info(out, name_to_buf, name_to_fused_node,
                                               graph_inputs, graph_outputs)
        into.append(peak)
        return out
    memory.reorder_for_peak_memory = spy
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            yield
    finally:
        memory.reorder_for_peak_memory = real


def real_peak(path: Path, batch_size: int, compiled: bool, steps: int = 2,
              estimates: list[int] | None = None) -> tuple[int, int]:
    """Peak allocated bytes of `steps` real CPU training steps after one warm-up step, and the
    part of it that was there before the steps (parameters, buffers, AdamW state). With
    ``estimates``, Inductor's estimate of each compiled graph's peak is appended to it."""
    mod = load(str(path))
    torch.manual_seed(0)
    model = mod.build_model().train()
    # a fresh compile per run: dynamo would otherwise recompile the second batch size of the
    # same forward with a dynamic batch dimension, which plans memory differently
    torch._dynamo.reset()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    # torch.compile returns a wrapper sharing the module's parameters; the optimizer holds
    # the same tensors either way
    run_model = torch.compile(model) if compiled else model

    def step():
        batch = mod.make_batch(batch_size)
        loss = _loss(mod, run_model, batch)
        loss.backward()
        del loss, batch
        opt.step()
        opt.zero_grad(set_to_none=True)

    with inductor_estimates(estimates) if estimates is not None else contextlib.nullcontext():
        step()                                 # compiles; creates the AdamW state
    state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)}

    def run():
        for _ in range(steps):
            step()
    # _profiled_peak counts the parameters and buffers; the state is already there too
    base = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(model.parameters()) + list(model.buffers())}.values())
    base += sum(state.values())
    return _profiled_peak(model, run, OPAQUE) + sum(state.values()), base


def estimate(path: Path, batch_size: int) -> int:
    return trace_training(load_model_file(str(path)),
                          TraceConfig(batch_size, emulate_cuda=False)).peak_live_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--inductor-estimate", action="store_true",
                        help="also print params + state + Inductor's largest per-graph peak "
                             "estimate (compiles from scratch: slower)")
    args = parser.parse_args()
    mib = 2**20
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; peak allocated, MiB")
    print(f"{'model':10s} {'batch':>5s} {'eager':>9s} {'compiled':>9s} {'oomdoctor':>9s} "
          f"{'comp/eager':>10s} {'above base':>10s} {'oomd/eager':>10s} {'comp run s':>10s}"
          + (f" {'ind. est':>9s} {'est/comp':>8s}" if args.inductor_estimate else ""))
    for name in args.models:
        path, batch = MODELS[name]
        eager, base = real_peak(path, batch, compiled=False)
        start = time.perf_counter()
        estimates: list[int] | None = [] if args.inductor_estimate else None
        compiled, _ = real_peak(path, batch, compiled=True, estimates=estimates)
        took = time.perf_counter() - start
        sim = estimate(path, batch)
        print(f"{name:10s} {batch:5d} {eager / mib:9.2f} {compiled / mib:9.2f} {sim / mib:9.2f} "
              f"{compiled / eager:10.3f} {(compiled - base) / (eager - base):10.3f} "
              f"{sim / eager:10.4f} {took:10.1f}"
              + (f" {(base + max(estimates)) / mib:9.2f} {(base + max(estimates)) / compiled:8.3f}"
                 if estimates else ""), flush=True)


if __name__ == "__main__":
    main()
