"""Tests for oomdoctor.sim.emulate: what CUDA does differently from a CPU trace, one piece at a time.

Each emulation is checked against something that does not come from oomdoctor:

- PyTorch's own CUDA autocast test lists, shipped in the wheel
  (torch/testing/_internal/autocast_test_lists.py, read as text);
- PyTorch itself run for real: CPU autocast (its cast cache is the same device-independent
  ``cached_cast`` as CUDA's, and CPU and CUDA agree on the ops used here), autograd's own
  saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``), ATen's CPU kernels;
- exact formulas from the CUDA kernels' documented outputs (flash: out + (B, H, T) fp32
  logsumexp; memory-efficient: logsumexp padded to a multiple of 32) and from the optimizer
  source (torch/optim/adam.py).

The last section pins down details where the emulation once disagreed with what CUDA does
according to PyTorch's source (each test says where in the source).
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import math
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from oomdoctor.models import checkpointing
from oomdoctor.sim import emulate
from oomdoctor.models.loader import load_model_file
from oomdoctor.models.spec import ModelSpec
from oomdoctor.sim.trace import Category, Phase, TraceConfig, trace_training

SAMPLES = Path(__file__).resolve().parent.parent / "sample_models"


def path(name: str) -> str:
    return str(SAMPLES / f"{name}.py")


def load_module(name: str):
    spec = importlib.util.spec_from_file_location(f"emulate_test_{name}", path(name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def traced(name: str, batch_size: int, **cfg):
    return _traced(name, batch_size, tuple(sorted(cfg.items())))


@functools.lru_cache(maxsize=None)
def _traced(name: str, batch_size: int, cfg: tuple):
    return trace_training(load_model_file(path(name)), TraceConfig(batch_size, **dict(cfg)))


def saved_for_backward(fn, *inputs) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
    """(shape, dtype, storage bytes) of every storage autograd saves while ``fn(*inputs)`` runs,
    the inputs' own storages excluded - PyTorch's own account of what is kept for backward."""
    packed: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        fn(*inputs)
    skip = {t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor)}
    seen: dict[int, tuple] = {}
    for t in packed:
        st = t.untyped_storage()
        if st._cdata not in skip:
            seen.setdefault(st._cdata, (tuple(t.shape), t.dtype, st.nbytes()))
    return list(seen.values())


class _Allocations(TorchDispatchMode):
    """Records (op name, output shape, storage bytes) of the fresh outputs of every ATen op."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[str, tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = [r.alias_info is None for r in func._schema.returns]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for is_fresh, o in zip(fresh, outs):
            if is_fresh and isinstance(o, torch.Tensor):
                self.made.append((func.__name__, tuple(o.shape), o.untyped_storage().nbytes()))
        return out


def phase_peak(tr, phase: Phase, iteration: int) -> int:
    """Peak of live bytes inside one phase, from the storages' own lifetimes."""
    starts = [(i, m) for i, m in enumerate(tr.marks)
              if m.phase is phase and m.iteration == iteration]
    best = 0
    for i, m in starts:
        stop = tr.marks[i + 1].start if i + 1 < len(tr.marks) else max(
            s.t_alloc for s in tr.storages.values()) + 1
        for index in range(m.start, stop):
            best = max(best, sum(s.nbytes for s in tr.live_at(index)))
    return best


# ---------------------------------------------------------------------------------------------
# 1. CUDA autocast policy == PyTorch's CUDA autocast test lists
# ---------------------------------------------------------------------------------------------

def _autocast_test_lists() -> dict[str, list[str]]:
    """The op names of class AutocastTestLists (the CUDA lists used by test/test_cuda.py),
    parsed as text: importing the module needs expecttest, which is not installed."""
    file = os.path.join(os.path.dirname(torch.__file__), "testing", "_internal",
                        "autocast_test_lists.py")
    tree = ast.parse(Path(file).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AutocastTestLists")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    lists: dict[str, list[str]] = {}
    for node in ast.walk(init):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Attribute)
                and isinstance(node.value, ast.List)):
            lists[node.targets[0].attr] = [
                e.elts[0].value for e in node.value.elts
                if isinstance(e, ast.Tuple) and isinstance(e.elts[0], ast.Constant)]
    return lists


AUTOCAST = _autocast_test_lists()


def test_autocast_test_lists_were_found():
    for name in ("torch_fp16", "nn_fp16", "linalg_fp16", "methods_fp16", "torch_fp32",
                 "nn_fp32", "methods_fp32", "torch_need_autocast_promote", "banned"):
        assert AUTOCAST.get(name), name
    assert "linear" in AUTOCAST["nn_fp16"] and "layer_norm" in AUTOCAST["torch_fp32"]


# Every entry is compared under its own name. The names are the ones func.__name__ gives for the
# Python-visible callable, which is what CudaAutocast matches: torch.linalg.vecdot and
# torch.linalg.multi_dot report "linalg_vecdot" / "linalg_multi_dot", Tensor.__matmul__ reports
# "__matmul__", and `x ** y` (Tensor.__pow__) reports "pow" (also in the set as "__pow__"), so
# no entry needs skipping. (_thnn_fused_lstm_cell/_gru_cell are commented out in PyTorch's list:
# not Python-exposed.)
@pytest.mark.parametrize("list_name", ["torch_fp16", "nn_fp16", "linalg_fp16", "methods_fp16"])
def test_lower_precision_ops(list_name):
    missing = sorted(set(AUTOCAST[list_name]) - emulate.LOWER_PRECISION)
    assert not missing, f"{list_name}: not run in 16 bit by the emulation: {missing}"


@pytest.mark.parametrize("list_name", ["torch_fp32", "nn_fp32", "methods_fp32"])
def test_fp32_ops(list_name):
    fp32 = emulate.FP32 | emulate.FP32_SET_OPT_DTYPE
    missing = sorted(set(AUTOCAST[list_name]) - fp32)
    assert not missing, f"{list_name}: not run in fp32 by the emulation: {missing}"


def test_promote_ops():
    missing = sorted(set(AUTOCAST["torch_need_autocast_promote"]) - emulate.PROMOTE)
    assert not missing


def test_banned_ops_in_no_list():
    every = (emulate.LOWER_PRECISION | emulate.FP32 | emulate.FP32_SET_OPT_DTYPE
             | emulate.PROMOTE)
    assert not set(AUTOCAST["banned"]) & every


def test_policy_sets_are_disjoint():
    sets = [emulate.LOWER_PRECISION, emulate.FP32, emulate.FP32_SET_OPT_DTYPE, emulate.PROMOTE]
    for i, a in enumerate(sets):
        for b in sets[i + 1:]:
            assert not a & b, a & b


def test_autocast_output_dtypes():
    bf16, fp32 = torch.bfloat16, torch.float32
    with FakeTensorMode():
        x, w = torch.randn(4, 8), torch.randn(8, 8)
        h = torch.randn(4, 8, dtype=bf16)
        img, kern = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
        with emulate.CudaAutocast(bf16):
            # lower precision
            assert F.linear(x, w).dtype == bf16
            assert (x @ w).dtype == bf16
            assert torch.matmul(x, w).dtype == bf16
            assert torch.bmm(x[None], w[None]).dtype == bf16
            assert F.conv2d(img, kern).dtype == bf16
            # fp32 (also for 16-bit inputs)
            assert F.layer_norm(h, (8,)).dtype == fp32
            assert torch.exp(h).dtype == fp32
            assert (h ** 2).dtype == fp32
            assert F.mse_loss(h, h).dtype == fp32
            # fp32 via the dtype argument
            assert F.softmax(h, -1).dtype == fp32
            assert h.softmax(-1).dtype == fp32
            assert F.log_softmax(h, -1).dtype == fp32
            assert h.sum().dtype == fp32
            # promote to the widest input
            assert torch.cat([h, x]).dtype == fp32
            assert torch.stack([h, x]).dtype == fp32
            # no policy: run in the input's dtype
            assert F.relu(h).dtype == bf16
            assert F.gelu(h).dtype == bf16
            assert (h + h).dtype == bf16
        assert F.linear(x, w).dtype == fp32          # and nothing outside the region


# ---------------------------------------------------------------------------------------------
# 2. Autocast memory on a Linear stack (bf16 AMP)
# ---------------------------------------------------------------------------------------------

B, D, H = 64, 256, 512


class LinearStack(nn.Module):
    """fc1 -> relu -> fc2 -> relu [-> fc2 -> relu] -> fc3; fc2 optionally frozen."""

    def __init__(self, frozen: bool = False, twice: bool = False):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(D, H), nn.Linear(H, H), nn.Linear(H, D)
        self.twice = twice
        if frozen:
            self.fc2.requires_grad_(False)

    def forward(self, x):
        h = F.relu(self.fc2(F.relu(self.fc1(x))))
        if self.twice:
            h = F.relu(self.fc2(h))
        return self.fc3(h)


def stack_loss(model, x):
    return model(x).mean()


def stack_spec(**kw) -> ModelSpec:
    return ModelSpec(path="<LinearStack>", build_model=lambda: LinearStack(**kw),
                     make_batch=lambda b: torch.randn(b, D), loss_fn=stack_loss,
                     make_optimizer=None)


def _real_cpu_autocast(kw):
    """What real torch.autocast("cpu", bf16) saves and casts in one forward. CPU and CUDA
    autocast agree here: linear is lower-precision in both lists, relu/mean have no policy, and
    the cast cache (cached_cast in autocast_mode.cpp) does not depend on the device."""
    torch.manual_seed(0)
    model, x = LinearStack(**kw), torch.randn(B, D)
    skip = [p for p in model.parameters()]
    rec = _Allocations()
    with torch.autocast("cpu", dtype=torch.bfloat16), rec:
        saved = saved_for_backward(lambda *_: stack_loss(model, x), x, *skip)
    return saved, [shape for op, shape, _ in rec.made if op.startswith("_to_copy")]


def _emulated_autocast(kw):
    with FakeTensorMode():
        model, x = LinearStack(**kw), torch.randn(B, D)
        skip = [p for p in model.parameters()]
        rec = _Allocations()
        with emulate.CudaAutocast(torch.bfloat16), rec:
            saved = saved_for_backward(lambda *_: stack_loss(model, x), x, *skip)
    return saved, [shape for op, shape, _ in rec.made if op.startswith("_to_copy")]


@pytest.mark.parametrize("kw", [{}, {"twice": True}, {"frozen": True, "twice": True}],
                         ids=["plain", "shared-trainable", "shared-frozen"])
def test_autocast_matches_real_autocast(kw):
    real_saved, real_casts = _real_cpu_autocast(kw)
    emu_saved, emu_casts = _emulated_autocast(kw)
    assert Counter(emu_saved) == Counter(real_saved)
    assert Counter(emu_casts) == Counter(real_casts)
    # every tensor kept for backward is 16-bit (the loss itself is not saved)
    assert {dtype for _, dtype, _ in emu_saved} == {torch.bfloat16}
    # the cache: a trainable weight used twice is cast once; a frozen one on every use
    fc2_casts = Counter(emu_casts)[(H, H)]
    assert fc2_casts == (2 if kw.get("frozen") else 1)


def test_autocast_activation_bytes():
    tr = trace_training(stack_spec(), TraceConfig(B, precision="bf16"))
    acts = sum(s.nbytes for s in tr.storages.values()
               if s.category is Category.ACTIVATIONS and s.iteration == 0)
    # bf16 copies kept for backward: the input cast (B x D), both ReLU outputs (B x H), the
    # fc2 and fc3 weight copies (needed for the input gradient; fc1's input needs none, so
    # autograd does not keep fc1's weight copy), and the bf16 scalar loss.
    assert acts == 2 * (B * D + 2 * B * H + H * H + H * D) + 2


@pytest.mark.parametrize("kw", [{}, {"twice": True}])
def test_cast_cache_holds_two_bytes_per_trainable_param(kw):
    tr = trace_training(stack_spec(**kw), TraceConfig(B, precision="bf16"))
    fwd_end = next(m.start for m in tr.marks if m.phase is Phase.BACKWARD)
    sizes = {2 * n for n in (D * H, H, H * H, H, H * D, D)}
    casts = [s for s in tr.storages.values()
             if s.iteration == 0 and s.phase is Phase.FORWARD and s.op.startswith("_to_copy")
             and s.module in ("fc1", "fc2", "fc3") and s.nbytes in sizes]
    # one cast per trainable parameter, even for fc2 used twice
    assert len(casts) == 6
    assert sum(s.nbytes for s in casts) == 2 * tr.num_trainable_parameters
    # all held at once: the last cast happens before the first one is freed (at the end of the
    # autocast region, or in backward for those autograd keeps)
    last = max(s.t_alloc for s in casts)
    assert all(s.t_free is not None and s.t_free > last for s in casts)
    assert all(s.t_free <= fwd_end or s.category is Category.ACTIVATIONS for s in casts)


def test_frozen_weights_are_cast_per_use():
    tr = trace_training(stack_spec(frozen=True, twice=True), TraceConfig(B, precision="bf16"))
    fc2_weight_casts = [s for s in tr.storages.values()
                        if s.iteration == 0 and s.phase is Phase.FORWARD
                        and s.op.startswith("_to_copy") and s.module == "fc2"
                        and s.nbytes == 2 * H * H]
    assert len(fc2_weight_casts) == 2


@pytest.mark.parametrize("fn", [lambda h: F.layer_norm(h, (h.shape[-1],)),
                                lambda h: F.softmax(h, -1), lambda h: torch.softmax(h, -1),
                                lambda h: F.log_softmax(h, -1)],
                         ids=["layer_norm", "F.softmax", "torch.softmax", "log_softmax"])
def test_normalisation_outputs_are_fp32(fn):
    with FakeTensorMode():
        h = torch.randn(4, 16, 32, dtype=torch.bfloat16)
        with emulate.CudaAutocast(torch.bfloat16):
            out = fn(h)
        assert out.dtype == torch.float32
        assert out.untyped_storage().nbytes() == h.numel() * 4


# ---------------------------------------------------------------------------------------------
# 3. Fused attention
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,cc,kernel", [
    (torch.bfloat16, (8, 6), "flash"),
    (torch.float16, (8, 0), "flash"),
    (torch.float32, (8, 6), "efficient"),     # flash is 16-bit only
    (torch.float16, (7, 5), "efficient"),     # T4: no flash before sm80
])
@pytest.mark.parametrize("T", [100, 256])
def test_fused_attention_saves_out_and_logsumexp(dtype, cc, kernel, T):
    Bq, Hq, Dh = 2, 12, 64
    notes: list[str] = []
    with FakeTensorMode():
        q, k, v = [torch.randn(Bq, Hq, T, Dh, dtype=dtype, requires_grad=True) for _ in range(3)]
        with emulate.CudaKernels(cc, notes):
            saved = saved_for_backward(
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1,
                                                               is_causal=True), q, k, v)
    assert emulate.sdpa_kernel(q, None, 0.1, cc) == kernel
    assert any(f"the {kernel} kernel" in n for n in notes)
    elt = torch.finfo(dtype).bits // 8
    # flash: logsumexp is (B, H, T) fp32; memory-efficient pads T to a multiple of 32
    lse_t = T if kernel == "flash" else math.ceil(T / 32) * 32
    assert sorted(nbytes for _, _, nbytes in saved) == sorted(
        [Bq * Hq * T * Dh * elt, Bq * Hq * lse_t * 4])
    assert all(T * T > math.prod(shape) / (Bq * Hq) for shape, _, _ in saved)  # no T x T


@pytest.mark.parametrize("dtype, kernel", [(torch.bfloat16, "flash"), (torch.float32, "math")])
def test_grouped_query_attention(dtype, kernel):
    """enable_gqa with 2 key/value heads for 8 query heads. Flash (16-bit, torch 2.5+) takes the
    small k and v as they are and saves them; its backward writes dK and dV for every query head,
    (B, Tk, H, D) each, before summing them per group (flash_api.cpp, mha_bwd). The memory-
    efficient kernel does not take GQA, so fp32 falls back to the math path, which expands k and
    v and keeps the (B, H, T, T) probabilities. On the meta device, as the trace runs (the CPU
    has a GQA flash kernel of its own)."""
    B, H, Hkv, T, D = 2, 8, 2, 128, 64
    elt = torch.finfo(dtype).bits // 8
    with torch.device("meta"):
        q = torch.randn(B, H, T, D, dtype=dtype, requires_grad=True)
        k, v = [torch.randn(B, Hkv, T, D, dtype=dtype, requires_grad=True) for _ in range(2)]
        with emulate.CudaKernels((9, 0)):
            def attend(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            saved = saved_for_backward(attend, q, k, v)
            out = attend(q, k, v)
            rec = _Allocations()
            with rec:
                out.sum().backward()
    probabilities = [s for s in saved if s[0][-2:] == (T, T)]
    if kernel == "math":
        assert probabilities
        return
    assert not probabilities
    assert sorted(nbytes for _, _, nbytes in saved) == sorted([B * H * T * D * elt, B * H * T * 4])
    made = sorted(nbytes for _, _, nbytes in rec.made)
    expanded = [n for n in made if n == B * T * H * D * elt]
    # dq and the two expanded gradients are (B, T, H, D)-sized; dk and dv the small ones
    assert len(expanded) == 3
    assert made.count(B * Hkv * T * D * elt) == 2
    assert k.grad.shape == k.shape and q.grad.shape == q.shape


def test_sdpa_kernel_choice():
    with FakeTensorMode():
        bf = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
        fp16 = torch.randn(1, 2, 8, 64, dtype=torch.float16)
        mask = torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16)
        big_head = torch.randn(1, 2, 8, 384, dtype=torch.float16)
    assert emulate.sdpa_kernel(bf, mask, 0.0, (8, 6)) == "efficient"   # explicit mask: no flash
    assert emulate.sdpa_kernel(bf, None, 0.0, (7, 5)) == "math"        # bf16 needs sm80+
    assert emulate.sdpa_kernel(fp16, None, 0.0, (9, 0)) == "flash"
    assert emulate.sdpa_kernel(big_head, None, 0.0, (8, 0)) == "efficient"  # head dim > 256


def test_cpu_flash_output_layout():
    # ATen's own fused kernel (the CPU flash one, used when the emulation is off) allocates the
    # output as (B, T, H, D) and returns it transposed, so `y.transpose(1, 2).contiguous()` in
    # the model is free; the CUDA flash / memory-efficient kernels do the same (see the test below).
    with FakeTensorMode():
        q, k, v = [torch.randn(2, 100, 12, 64).transpose(1, 2) for _ in range(3)]
        assert F.scaled_dot_product_attention(q, k, v).transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype,cc", [(torch.bfloat16, (8, 6)), (torch.float32, (8, 6))])
def test_fused_attention_output_layout(dtype, cc):
    with FakeTensorMode():
        q, k, v = [torch.randn(2, 100, 12, 64, dtype=dtype).transpose(1, 2) for _ in range(3)]
        with emulate.CudaKernels(cc):
            y = F.scaled_dot_product_attention(q, k, v)
        assert y.transpose(1, 2).is_contiguous()


def _activations(tr, iteration=0) -> list:
    return [s for s in tr.storages.values()
            if s.category is Category.ACTIVATIONS and s.iteration == iteration]


def test_gpt2_fused_attention_drops_the_t_by_t_tensors():
    Bg, Hg, T = 1, 12, 1024
    emulated = _activations(traced("gpt2_small", Bg))
    cpu = _activations(traced("gpt2_small", Bg, emulate_cuda=False))
    tt = Bg * Hg * T * T
    # the CPU math path with dropout keeps, per layer, at least the softmax probabilities, the
    # dropout mask and the dropped probabilities, each (B, H, T, T) in fp32 (the fp32
    # counterpart of the 5*a*s^2*b term of Korthikanti et al. in ground-truth.md)
    assert sum(s.nbytes == tt * 4 for s in cpu) >= 3 * 12
    saved = sum(s.nbytes for s in cpu) - sum(s.nbytes for s in emulated)
    assert saved >= 12 * 3 * tt * 4
    # with the fused kernel no (B, H, T, T) probabilities are kept (fp32 or 16-bit) ...
    assert not [s for s in emulated if s.nbytes in (2 * tt, 4 * tt)]
    # ... nor 1-byte masks: the only tt-byte storages are the MLP's two (B, T, 4C) fp32 tensors
    # per layer (c_fc output, GELU output) - 4C * 4 bytes == H * T bytes for GPT-2 at T = 1024
    assert 4 * 768 * 4 == Hg * T
    assert sum(s.nbytes == tt for s in emulated) == 2 * 12
    # but each layer keeps its logsumexp: (B, H, T) fp32, T = 1024 already a multiple of 32
    assert sum(s.nbytes == Bg * Hg * T * 4 for s in emulated) == 12


# ---------------------------------------------------------------------------------------------
# 4. Dropout
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("how", ["functional", "module"])
def test_dropout_mask(dtype, how):
    shape = (4, 250)
    numel = math.prod(shape)

    def drop(x):
        return F.dropout(x, 0.1, True) if how == "functional" else nn.Dropout(0.1)(x)
    with FakeTensorMode():
        x = torch.randn(*shape, dtype=dtype, requires_grad=True)
        with emulate.CudaKernels((8, 6)):
            fused = saved_for_backward(drop, x)
        plain = saved_for_backward(drop, x)
    # CUDA's fused native_dropout keeps a bool mask: one byte per element
    assert fused == [(shape, torch.bool, numel)]
    # the CPU path (Dropout.cpp _dropout_impl: input * bernoulli noise) keeps the noise, in the
    # input's dtype
    assert plain == [(shape, dtype, numel * (torch.finfo(dtype).bits // 8))]


def test_dropout_outside_training_is_untouched():
    with FakeTensorMode():
        x = torch.randn(4, 250, requires_grad=True)
        with emulate.CudaKernels((8, 6)):
            assert saved_for_backward(lambda x: F.dropout(x, 0.1, False), x) == []


# ---------------------------------------------------------------------------------------------
# 5. foreach AdamW
# ---------------------------------------------------------------------------------------------

def test_foreach_adamw_holds_one_parameter_sized_set_of_temporaries():
    # torch/optim/adam.py::_multi_tensor_adam for AdamW (decoupled weight decay, no amsgrad, no
    # maximize, not capturable): _foreach_mul_ (weight decay), _foreach_lerp_, _foreach_mul_,
    # _foreach_addcmul_ all work in place; the one fresh list is
    # exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs), then _foreach_div_/_foreach_add_/
    # _foreach_addcdiv_ in place. So during step(): params + grads + exp_avg + exp_avg_sq + sqrt
    # = 5 x the fp32 parameter bytes, exactly (PT-1 in ground-truth.md: ~1.2 GB of foreach
    # intermediates for 1.2 GB of ViT-L parameters). The `step` counters live on the host.
    tr = traced("tiny_mlp", 8)
    P = tr.parameter_bytes
    assert any("foreach" in n for n in tr.notes)
    assert phase_peak(tr, Phase.OPTIMIZER, 0) == 5 * P
    assert phase_peak(tr, Phase.OPTIMIZER, 1) == 5 * P


def test_for_loop_adamw_temporaries():
    # Without the emulation the CPU default runs (torch/optim/adam.py::_single_tensor_adam):
    # per parameter, denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps) holds the
    # sqrt and the quotient, while the previous parameter's denom is still bound to `denom`.
    # Peak = 4 x params + max_i(size_{i-1} + 2 size_i) over tiny_mlp's parameters in order.
    tr = traced("tiny_mlp", 8, emulate_cuda=False)
    sizes = [4 * n for n in (256 * 512, 512, 512 * 512, 512, 512 * 10, 10)]
    extra = max((sizes[i - 1] if i else 0) + 2 * sizes[i] for i in range(len(sizes)))
    assert phase_peak(tr, Phase.OPTIMIZER, 1) == 4 * tr.parameter_bytes + extra


# ---------------------------------------------------------------------------------------------
# 6. GradScaler
# ---------------------------------------------------------------------------------------------

def test_grad_scaler_adds_only_scalars():
    fp16 = traced("tiny_mlp", 8, precision="fp16")
    bf16 = traced("tiny_mlp", 8, precision="bf16")      # same element sizes, no scaler
    extra = Counter(s.nbytes for s in fp16.storages.values())
    extra.subtract(Counter(s.nbytes for s in bf16.storages.values()))
    added = [n for n, c in extra.items() for _ in range(c) if c > 0]
    assert not [n for n, c in extra.items() if c < 0]
    # scale, growth tracker, found_inf, inverse scale (a double on the way), the scaled loss
    assert added and max(added) <= 8
    assert sum(added) <= 4096
    assert 0 <= fp16.peak_live_bytes - bf16.peak_live_bytes <= 4096
    assert fp16.gradient_bytes == bf16.gradient_bytes == 4 * fp16.num_parameters


# ---------------------------------------------------------------------------------------------
# 7. Checkpointing
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def fake_model(name: str):
    mod = load_module(name)
    with FakeTensorMode():
        return mod, mod.build_model()


@pytest.mark.parametrize("name,cls", [("gpt2_small", "Block"), ("resnet_cnn", "BasicBlock"),
                                      ("vit_b16", "Block"), ("bert_base", "EncoderLayer")])
def test_find_repeated_blocks(name, cls):
    mod, model = fake_model(name)
    expected = [n for n, m in model.named_modules() if isinstance(m, getattr(mod, cls))]
    assert checkpointing.find_repeated_blocks(model) == expected
    assert len(expected) == {"resnet_cnn": 8}.get(name, 12)


def test_gpt2_checkpointed_activations():
    Bg, T, C, V = 1, 1024, 768, 50304
    tr = traced("gpt2_small", Bg, checkpointing=True)
    assert tr.checkpointed == tuple(f"h.{i}" for i in range(12))
    fwd_end = next(m.start for m in tr.marks if m.phase is Phase.BACKWARD and m.iteration == 0)
    live = sum(s.nbytes for s in tr.live_at(fwd_end - 1) if s.category is Category.ACTIVATIONS)
    btc = Bg * T * C
    expected = (12 * btc * 4          # each block's input, kept by the checkpoint
                + btc * 4             # the last block's output, saved by ln_f
                + btc * 4             # ln_f's output, saved by lm_head
                + btc * 1             # the embedding dropout's bool mask
                + Bg * T * V * 4)     # fp32 log-softmax of the logits, saved by cross_entropy
    # Left out: position ids (T int64, 8 KiB), ln_f's mean and rstd (2 x B*T fp32, 8 KiB), the
    # loss and nll's total_weight (scalars): < 64 KiB in all, 0.03 % of the total.
    assert expected <= live <= expected + 64 * 1024
    # against ~870 MB without checkpointing: the blocks' insides are gone
    full = sum(s.nbytes for s in _activations(traced("gpt2_small", Bg)))
    assert full > 3 * live


def test_checkpoint_class_not_found():
    _, model = fake_model("gpt2_small")
    with pytest.raises(ValueError) as err:
        checkpointing.find_repeated_blocks(model, "Nope")
    for name in ("Nope", "Block", "CausalSelfAttention", "MLP", "GPT"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="Linear"):
        trace_training(load_model_file(path("tiny_mlp")),
                       TraceConfig(2, checkpointing=True, checkpoint_class="Nope"))


def test_no_repeated_blocks():
    with pytest.raises(ValueError, match="no repeated blocks"):
        trace_training(load_model_file(path("tiny_mlp")), TraceConfig(2, checkpointing=True))


# ---------------------------------------------------------------------------------------------
# Details CUDA's source decides (each was a disagreement found by review, now fixed)
# ---------------------------------------------------------------------------------------------

def test_amp_cross_entropy_saves_what_cuda_saves():
    N, V = 64, 1000
    # What CUDA runs, spelled out on real CPU tensors with no autocast at all
    x = torch.randn(N, V, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (N,))
    cuda = saved_for_backward(
        lambda x: F.nll_loss(torch.log_softmax(x, 1, dtype=x.dtype).float(), t), x)
    with FakeTensorMode():
        xf = torch.randn(N, V, dtype=torch.bfloat16, requires_grad=True)
        tf = torch.randint(0, V, (N,))
        with emulate.CudaAutocast(torch.bfloat16):
            emulated = saved_for_backward(lambda x: F.cross_entropy(x, tf), xf)

    def big(saved):
        return sorted((str(dt), n) for shape, dt, n in saved if shape == (N, V))
    assert big(emulated) == big(cuda)


def test_fp16_softmax_allocates_only_its_fp32_output():
    with FakeTensorMode():
        h = torch.randn(4, 12, 64, 64, dtype=torch.float16)
        rec = _Allocations()
        with emulate.CudaAutocast(torch.float16), rec:
            F.softmax(h, -1)
    assert sum(n for _, _, n in rec.made) == h.numel() * 4


def test_amp_checkpointing_recomputes_under_the_same_emulation():
    """bert_base: its blocks call F.dropout, a Python composite the emulation re-enters; the
    recomputation in backward must see the modes in the forward's order (autocast above the
    kernels), or the attention mask is saved as fp16 in the forward and recomputed as fp32 and
    torch.utils.checkpoint rejects the mismatch."""
    for precision in ("fp16", "bf16"):
        tr = trace_training(load_model_file(path("bert_base")),
                            TraceConfig(1, precision=precision, checkpointing=True))
        assert len(tr.checkpointed) == 12
    assert emulate._ACTIVE == []


def test_autocast_queries_answer_with_the_emulated_cuda_autocast():
    """peft's 4-bit LoRA asks torch.is_autocast_enabled() whether to cast its adapters' input
    and output (tuners/lora/bnb.py): inside the emulated CUDA autocast the answer is CUDA's."""
    import torch
    from oomdoctor.sim import emulate
    with emulate.autocast_queries():
        assert not torch.is_autocast_enabled() and not torch.is_autocast_enabled("cuda")
        with emulate.CudaAutocast(torch.bfloat16):
            assert torch.is_autocast_enabled() and torch.is_autocast_enabled("meta")
            assert torch.get_autocast_dtype("cuda") is torch.bfloat16
            assert not torch.is_autocast_enabled("cpu")          # the CPU's own, untouched
            with emulate._Off():
                assert not torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cuda") is torch.float16
    assert torch.is_autocast_enabled.__module__ != emulate.__name__   # put back
