"""``torch.compile(model)`` in a model file: the estimate is the eager trace, and the note says
which way compiled training moves it. Checked against a real CPU run where Inductor really
compiles the model, measured by torch.profiler after a warm-up step (the first step compiles;
the compiler's own allocations are not training memory). benchmarks/bench_compile.py measures
more models; this is the fastest one that pins the note's direction for a loss-dominated peak.
"""
from __future__ import annotations

import os

import torch

from oomdoctor.models.loader import load_model_file
from oomdoctor.sim.trace import TraceConfig, trace_training
from reference import _loss, _profiled_peak, load

MODEL = os.path.join(os.path.dirname(__file__), "models", "compiled_lm.py")


def _compiled_peak(batch: int) -> int:
    """Peak allocated bytes of two real CPU AdamW steps of the compiled model, after one."""
    mod = load(MODEL)
    torch.manual_seed(0)
    model = mod.build_model().train()          # the file's own torch.compile: Inductor, CPU
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        _loss(mod, model, mod.make_batch(batch)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()
    state = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return _profiled_peak(model, lambda: (step(), step())) + state


def test_compiled_training_lands_below_the_eager_estimate():
    est = trace_training(load_model_file(MODEL), TraceConfig(8, emulate_cuda=False))
    assert any("traced as eager" in n and "below eager" in n for n in est.notes)
    real = _compiled_peak(8)
    # measured 0.39 (torch 2.13): eager's log-softmax backward holds the logits, the
    # log-probabilities and two logit-sized gradients at once; Inductor fuses the loss
    # backward and writes the gradient into the logits' buffer
    assert real < 0.6 * est.peak_live_bytes, (real, est.peak_live_bytes)
