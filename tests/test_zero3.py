"""oomdoctor.sim.zero3: DeepSpeed ZeRO-3's module hooks and F.linear in a traced step. The
memory they change is checked against the H200 records (tests/test_deepspeed_gpu.py: the
stage-3 runs of DeepSpeedExamples' transformer, whose nn.MultiheadAttention they unpack, within
0.2% allocated); here, that the stand-ins compute what they replace."""
import torch
import torch.nn.functional as F

from oomdoctor.sim import zero3


def test_the_linear_function_computes_f_linear_and_its_gradients():
    """DeepSpeed's LinearFunctionForZeroStage3 against torch's own F.linear, on real CPU
    tensors: outputs and every gradient, for 2-D and 3-D inputs, with and without a bias."""
    torch.manual_seed(0)
    for shape in ((5, 8), (3, 5, 8)):
        for with_bias in (True, False):
            x = torch.randn(*shape, requires_grad=True)
            w = torch.randn(6, 8, requires_grad=True)
            b = torch.randn(6, requires_grad=True) if with_bias else None
            ours = zero3.linear(input=x, weight=w, bias=b)   # F.linear's keywords too
            theirs = F.linear(x, w, b)
            assert torch.allclose(ours, theirs, atol=1e-5)
            g = torch.randn_like(theirs)
            got = torch.autograd.grad(ours, [t for t in (x, w, b) if t is not None], g)
            want = torch.autograd.grad(theirs, [t for t in (x, w, b) if t is not None], g)
            assert all(torch.allclose(a, c, atol=1e-4) for a, c in zip(got, want))


def test_hooks_unpack_multihead_attention_and_are_undone():
    """Under the hooks nn.MultiheadAttention's self-attention no longer sees query is key (it
    projects q, k and v apart, through the patched F.linear), with the same result; after
    the block F.linear and the module's hooks are as they were."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 4, 8)
    plain = mha(x, x, x)[0]
    calls = []
    original = F.linear
    with zero3.applied(mha):
        assert F.linear is zero3.linear
        patched = F.linear

        def counting(*a, **k):
            calls.append(a[0].shape)
            return patched(*a, **k)
        F.linear = counting
        try:
            hooked = mha(x, x, x)[0]
        finally:
            F.linear = patched
    assert F.linear is original and not mha._forward_pre_hooks
    assert len(calls) == 4               # q, k and v apart, then the output projection
    assert torch.allclose(plain, hooked, atol=1e-5)
