"""Checks for the model files in sample_models/.

Every file is loaded by path (as oomdoctor loads a user's model file), built
and stepped on fake tensors, and its parameter count compared with a formula
derived by hand from its architecture. tiny_mlp and lora_gpt also take one
real CPU step.
"""
import importlib.util
import math
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

SAMPLE_DIR = Path(__file__).resolve().parent.parent / "sample_models"

MODEL_NAMES = [
    "tiny_mlp",
    "resnet_cnn",
    "gpt2_small",
    "bert_base",
    "vit_b16",
    "lora_gpt",
    "llama7b",
]


@lru_cache(maxsize=None)
def load(name):
    path = SAMPLE_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"sample_models_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compute_loss(module, model, batch):
    """The protocol: loss_fn if the file has one, else call the model with the
    batch unpacked by type and take the output (or its .loss)."""
    if hasattr(module, "loss_fn"):
        return module.loss_fn(model, batch)
    if isinstance(batch, tuple):
        out = model(*batch)
    elif isinstance(batch, dict):
        out = model(**batch)
    else:
        out = model(batch)
    return out.loss if hasattr(out, "loss") else out


def batch_tensors(batch):
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return list(batch.values())
    return list(batch)


# ---------------------------------------------------------------------------
# Parameter counts, derived by hand.
#
# Shorthand: a Linear(i, o) with bias has i*o + o parameters, a LayerNorm(d)
# 2*d (weight + bias), an RMSNorm(d) d, an Embedding(n, d) n*d, a bias-free
# Conv2d(ci, co, k) ci*co*k*k and a BatchNorm2d(c) 2*c (running stats are
# buffers, not parameters).
# ---------------------------------------------------------------------------


def tiny_mlp_params():
    # Linear(256, 512) + Linear(512, 512) + Linear(512, 10)
    return (256 * 512 + 512) + (512 * 512 + 512) + (512 * 10 + 10)


def resnet18_params():
    def conv_bn(ci, co, k):  # bias-free conv followed by BatchNorm2d
        return ci * co * k * k + 2 * co

    def basic_block(ci, co):  # two 3x3 conv-bn, plus a 1x1 projection when the shape changes
        proj = conv_bn(ci, co, 1) if ci != co else 0
        return conv_bn(ci, co, 3) + conv_bn(co, co, 3) + proj

    stem = conv_bn(3, 64, 7)
    stages = 0
    ci = 64
    for co in (64, 128, 256, 512):  # two blocks per stage
        stages += basic_block(ci, co) + basic_block(co, co)
        ci = co
    fc = 512 * 1000 + 1000
    return stem + stages + fc


def gpt_block_params(C):
    # ln_1 2C + qkv (C*3C + 3C) + proj (C*C + C) + ln_2 2C + fc (C*4C + 4C) + proj (4C*C + C)
    # = 12 C^2 + 13 C  (separate q, k, v Linears give the same count as one fused c_attn)
    return 12 * C**2 + 13 * C


def gpt2_small_params():
    C, V, T, L = 768, 50304, 1024, 12
    # blocks + wte + wpe + ln_f; lm_head is tied to wte and counted once
    return L * gpt_block_params(C) + V * C + T * C + 2 * C


def bert_base_params():
    H, I, V, P, L = 768, 3072, 30522, 512, 12
    embeddings = V * H + P * H + 2 * H + 2 * H  # word + position + token type (2) + LayerNorm
    # q, k, v, out (4 x (H^2 + H)) + attn LayerNorm 2H + fc_in (H*I + I) + fc_out (I*H + H) + ffn LayerNorm 2H
    layer = 4 * (H * H + H) + 2 * H + (H * I + I) + (I * H + H) + 2 * H
    assert layer == 12 * H**2 + 13 * H  # same as a GPT block since I = 4H
    pooler = H * H + H
    classifier = H * 2 + 2
    return embeddings + L * layer + pooler + classifier


def vit_b16_params():
    H, L, n_patches = 768, 12, (224 // 16) ** 2
    patch_embed = 3 * 16 * 16 * H + H  # Conv2d(3, H, 16, stride 16) with bias
    cls_and_pos = H + (n_patches + 1) * H
    # blocks have the GPT layout (MLP 3072 = 4H), final LayerNorm, Linear(H, 1000) head
    return patch_embed + cls_and_pos + L * gpt_block_params(H) + 2 * H + (H * 1000 + 1000)


def lora_adapter_params():
    C, r, L = 768, 8, 6
    # q and v adapters per layer, each A (r, C) + B (C, r)
    return L * 2 * (r * C + C * r)


def lora_gpt_params():
    C, V, T, L = 768, 50304, 512, 6
    base = L * gpt_block_params(C) + V * C + T * C + 2 * C  # tied head, as GPT-2
    return base + lora_adapter_params()


def llama7b_params():
    D, I, V, L = 4096, 11008, 32000, 32
    # wq, wk, wv, wo (4 D^2) + SwiGLU w1, w2, w3 (3 D I) + two RMSNorms (2 D); no biases
    layer = 4 * D * D + 3 * D * I + 2 * D
    # token embedding + blocks + final RMSNorm + untied output head
    return V * D + L * layer + D + D * V


EXPECTED_PARAMS = {
    "tiny_mlp": tiny_mlp_params(),
    "resnet_cnn": resnet18_params(),
    "gpt2_small": gpt2_small_params(),
    "bert_base": bert_base_params(),
    "vit_b16": vit_b16_params(),
    "lora_gpt": lora_gpt_params(),
    "llama7b": llama7b_params(),
}


def test_formulas_match_published_counts():
    # sanity-check the formulas themselves against well-known reference counts
    assert resnet18_params() == 11_689_512  # torchvision resnet18
    assert bert_base_params() == 109_483_778  # bert-base-uncased + 2-label head
    assert vit_b16_params() == 86_567_656  # timm vit_base_patch16_224
    assert llama7b_params() == 6_738_415_616  # LLaMA-7B
    assert gpt2_small_params() == 124_475_904  # nanoGPT gpt2 with vocab 50304


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_protocol_functions(name):
    module = load(name)
    assert callable(module.build_model)
    assert callable(module.make_batch)
    assert module.__doc__.startswith(f"oomdoctor probe sample_models/{name}.py")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_fake_training_step(name):
    module = load(name)
    with FakeTensorMode():
        model = module.build_model()
        assert model.training
        params = list(model.parameters())
        # default factories under the mode: nothing real was allocated
        assert all(isinstance(p, FakeTensor) for p in params)
        n_params = sum(p.numel() for p in params)
        assert n_params == EXPECTED_PARAMS[name]

        batch = module.make_batch(2)
        tensors = batch_tensors(batch)
        assert tensors and all(isinstance(t, FakeTensor) for t in tensors)
        assert all(t.shape[0] == 2 for t in tensors)

        loss = compute_loss(module, model, batch)
        assert isinstance(loss, torch.Tensor)
        assert loss.dim() == 0
        loss.backward()

        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        assert trainable
        missing = [n for n, p in trainable if p.grad is None]
        assert not missing, f"no grad for {missing}"
        for n, p in trainable:
            assert p.grad.shape == p.shape, n

        if hasattr(module, "make_optimizer"):
            # the file's own optimizer must accept fake parameters and step on them
            # (the default AdamW step is oomdoctor's business, and slow to fake)
            module.make_optimizer(model.parameters()).step()


def test_lora_gpt_only_adapters_trainable():
    module = load("lora_gpt")
    with FakeTensorMode():
        model = module.build_model()
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable
        assert all(n.endswith(("lora_A", "lora_B")) for n in trainable), trainable
        # both adapters, on q_proj and v_proj only, in all 6 layers
        assert len(trainable) == 6 * 2 * 2
        assert all(".q_proj." in n or ".v_proj." in n for n in trainable)
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == lora_adapter_params()
        assert all(m.lora_B.shape == (768, 8) for m in model.modules() if hasattr(m, "lora_B"))

        opt = module.make_optimizer(model.parameters())
        opt_params = [p for g in opt.param_groups for p in g["params"]]
        assert len(opt_params) == len(trainable)
        assert all(p.requires_grad for p in opt_params)


def _real_step(module, model, batch):
    opt = module.make_optimizer(model.parameters()) if hasattr(module, "make_optimizer") else torch.optim.AdamW(model.parameters())
    loss = compute_loss(module, model, batch)
    assert loss.dim() == 0
    assert math.isfinite(loss.item())
    loss.backward()
    opt.step()
    return loss


def test_tiny_mlp_real_cpu_step():
    module = load("tiny_mlp")
    torch.manual_seed(0)
    model = module.build_model()
    _real_step(module, model, module.make_batch(2))     # asserts a finite scalar loss
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_lora_gpt_real_cpu_step():
    module = load("lora_gpt")
    torch.manual_seed(0)
    idx, targets = module.make_batch(2)
    # batch 2 at the full T=512 takes several seconds on a 2-core CPU; the
    # model accepts any T <= BLOCK_SIZE, so step on the first 64 positions
    batch = (idx[:, :64], targets[:, :64])
    model = module.build_model()
    # B starts at zero, so the adapted model is exactly the base model
    assert all((m.lora_B == 0).all() for m in model.modules() if hasattr(m, "lora_B"))
    loss = _real_step(module, model, batch)
    # B = 0 at init: the loss is the frozen base model's, about ln(vocab)
    assert abs(loss.item() - math.log(module.VOCAB_SIZE)) < 1.0
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
        else:
            assert p.grad is None, n
    # B's gradient is nonzero (A's is zero while B = 0), so one step moves B
    assert any(m.lora_B.abs().sum() > 0 for m in model.modules() if hasattr(m, "lora_B"))
