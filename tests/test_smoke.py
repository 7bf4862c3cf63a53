"""The smoke trainer on the CPU: DDP as 2 gloo processes, accumulation, the accelerate split; each
checked against a plain single-process PyTorch computation written here."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from oomdoctor.runs import smoke
from oomdoctor.cli import EXIT_OK, EXIT_PROBLEM, cli
from oomdoctor.models.loader import load_model_file

ROOT = os.path.dirname(os.path.dirname(__file__))
MLP_PATH = os.path.join(ROOT, "sample_models", "tiny_mlp.py")
MLP = load_model_file(MLP_PATH)

# A decoder shaped like sample_models/llama7b.py, tiny: root-level buffers (rotary tables) passed
# to every block, the loss computed in the root's forward against targets, a tied head.
TINY_DECODER = '''
import torch, torch.nn as nn, torch.nn.functional as F
V, C, T = 64, 32, 16
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(C)
        self.fc = nn.Linear(C, C)
    def forward(self, x, cos):
        return x + self.fc(self.norm(x)) * cos
class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.norm = nn.LayerNorm(C)
        self.head = nn.Linear(C, V, bias=False)
        self.register_buffer("cos", torch.linspace(0.5, 1.5, C), persistent=False)
    def forward(self, tokens, targets):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x, self.cos)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, V), targets.reshape(-1))
def build_model():
    return Decoder()
def make_batch(batch_size):
    return torch.randint(0, V, (batch_size, T)), torch.randint(0, V, (batch_size, T))
'''


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny_decoder.py"
    path.write_text(TINY_DECODER)
    return load_model_file(str(path))


def _batches(rank, k, b):
    out = []
    for micro in range(k):
        torch.manual_seed(smoke.batch_seed(rank, micro))
        out.append(MLP.make_batch(b))
    return out


def _reference_sgd_step(batches, lr):
    """One plain SGD step on the concatenation of ``batches`` (mean loss over all samples)."""
    torch.manual_seed(0)
    model = MLP.build_model()
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    F.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        return {n: (p - lr * p.grad).float() for n, p in model.named_parameters()}


def test_ddp_over_gloo_equals_one_large_batch():
    """2 processes x micro-batch 4 after one SGD step == one process on the 8 samples."""
    cfg = smoke.SmokeConfig("ddp", 2, micro_batch=4, steps=1, optimizer="sgd", cpu_batch=4)
    outs = smoke.run_training(MLP, cfg, cuda=False, want_state=True)
    assert [o["rank"] for o in outs] == [0, 1]
    expected = _reference_sgd_step(_batches(0, 1, 4) + _batches(1, 1, 4), lr=1e-2)
    for name, p in outs[0]["state"].items():
        torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6)


def test_accumulation_equals_one_large_batch():
    """K=4 micro-batches of 2, (loss / K).backward() each, one SGD step == one batch of 8."""
    cfg = smoke.SmokeConfig("single", 1, micro_batch=2, grad_accum=4, steps=1, optimizer="sgd")
    [out] = smoke.run_training(MLP, cfg, cuda=False, want_state=True)
    expected = _reference_sgd_step(_batches(0, 4, 2), lr=1e-2)
    for name, p in out["state"].items():
        torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["mlp", "decoder"])
def test_split_equals_the_unsplit_model(which, decoder):
    """accelerate's dispatch_model with both stages on the CPU (hooks attached): the same loss
    and the same gradients as the model in one piece."""
    from oomdoctor.plans import parallel as par
    from oomdoctor.plans.estimate import Budget
    from oomdoctor.sim.gpus import get_profile
    from oomdoctor.models.training import compute_loss
    from oomdoctor.sim.trace import TraceConfig
    spec = MLP if which == "mlp" else decoder
    plan = par.plan_split(spec, TraceConfig(2), Budget(get_profile("rtx3090")))
    assert set(plan.partition.device_map.values()) == {0, 1}
    torch.manual_seed(0)
    whole = spec.build_model()
    torch.manual_seed(0)
    split = spec.build_model()
    split, device = smoke.dispatch_split(split, plan.partition.device_map,
                                         plan.partition.main_stage, cuda=False)
    assert hasattr(split, "_hf_hook")          # the hooks really are attached
    torch.manual_seed(1)
    batch = spec.make_batch(3)
    a = compute_loss(spec, whole, batch)
    b = compute_loss(spec, split, batch)
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b)
    grads = dict(whole.named_parameters())
    for name, p in split.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad)


def test_cpu_smoke_runs_and_says_what_it_did_not_check():
    cfg = smoke.SmokeConfig("ddp", 2, "bf16", micro_batch=8, grad_accum=2, steps=3)
    r = smoke.run_smoke(MLP, cfg)
    assert r.ok and r.device == "cpu" and not r.cuda_exercised and r.processes == 2
    assert len(r.losses) == 3 and r.losses[-1] < r.losses[0]
    assert r.ran_micro_batch == 2 and r.memory == ()
    text = " ".join(r.notes)
    assert "NOT measured" in text and "micro-batch 2 on the CPU" in text and "gloo" in text
    assert "SMOKE PASSED" in smoke.render_text(r)


def test_checkpointed_split_smoke_on_the_cpu(decoder):
    from oomdoctor.plans import parallel as par
    from oomdoctor.plans.estimate import Budget
    from oomdoctor.sim.gpus import get_profile
    from oomdoctor.sim.trace import TraceConfig
    plan = par.plan_split(decoder, TraceConfig(2, checkpointing=True),
                          Budget(get_profile("a100-80")))
    cfg = smoke.SmokeConfig("pipeline2", 2, "bf16", True, micro_batch=2, steps=2,
                            device_map=plan.partition.device_map,
                            main_device=plan.partition.main_stage)
    r = smoke.run_smoke(decoder, cfg)
    assert r.ok, r.problems
    assert all(torch.isfinite(torch.tensor(r.losses)))


def test_memory_check_tolerance():
    ok = smoke.MemoryCheck("cuda:0", 1090, 2000, 1000, 2100)
    off = smoke.MemoryCheck("cuda:0", 1200, 2000, 1000, 2100)
    assert ok.ok and not off.ok
    assert off.off("allocated") == pytest.approx(0.2)
    assert smoke.MemoryCheck("cuda:0", 5, 5, None, None).ok


def test_a_model_too_big_for_the_host_is_refused():
    llama = load_model_file(os.path.join(ROOT, "sample_models", "llama7b.py"))
    with pytest.raises(smoke.SmokeError, match="host memory"):
        smoke.run_smoke(llama, smoke.SmokeConfig("single", 1, device="cpu"))


def test_cuda_asked_without_cuda_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(smoke.SmokeError, match="CUDA"):
        smoke.run_smoke(MLP, smoke.SmokeConfig("single", 1, device="cuda"))


def test_smoke_cli_json():
    res = CliRunner().invoke(cli, ["smoke", MLP_PATH, "--strategy", "zero3", "--gpus", "2",
                                   "-b", "4", "--steps", "2", "--json"])
    assert res.exit_code == EXIT_OK, res.stderr
    d = json.loads(res.stdout)
    assert d["ok"] is True and d["device"] == "cpu" and d["cuda_exercised"] is False
    assert len(d["losses"]) == 2 and d["processes"] == 2


def test_smoke_cli_reports_a_failure_loudly(monkeypatch):
    """A run whose loss does not move fails with exit code 1 and says so."""
    monkeypatch.setattr(smoke, "run_training", lambda *a, **k: [
        {"rank": 0, "losses": [2.0, 2.0, 2.0], "times": [0.1] * 3, "memory": [], "batch": 1,
         "oom": None}])
    res = CliRunner().invoke(cli, ["smoke", MLP_PATH, "--steps", "3"])
    assert res.exit_code == EXIT_PROBLEM
    assert "SMOKE FAILED" in res.stdout and "did not change" in res.stdout


def test_cuda_reporting_branch_with_a_faked_device(monkeypatch):
    """No GPU here: fake two visible CUDA devices and the per-rank measurements to check how the
    CUDA branch compares them with the prediction - rank 1 is 30% over and rank 0 hit an OOM."""
    import dataclasses

    from oomdoctor.plans import parallel as par
    from oomdoctor.plans.estimate import Budget
    from oomdoctor.sim.gpus import get_profile
    from oomdoctor.sim.trace import TraceConfig, trace_training
    trace = trace_training(MLP, TraceConfig(4))
    pred = par.estimate_strategy(trace, par.model_layout(MLP), par.Strategy("ddp", 2),
                                 Budget(get_profile("rtx3090")))
    g = pred.gpus[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(smoke, "run_training", lambda *a, **k: [
        {"rank": 0, "losses": [2.3, 2.2], "times": [0.1, 0.1], "batch": 4,
         "memory": [("cuda:0", g.peak_allocated_bytes, g.peak_reserved_bytes)],
         "oom": "CUDA out of memory at step 2: Tried to allocate 20.00 MiB"},
        {"rank": 1, "losses": [2.3, 2.2], "times": [0.1, 0.1], "batch": 4,
         "memory": [("cuda:1", int(g.peak_allocated_bytes * 1.3), g.peak_reserved_bytes)],
         "oom": None}])
    r = smoke.run_smoke(MLP, smoke.SmokeConfig("ddp", 2, micro_batch=4, steps=2), pred)
    assert r.cuda_exercised and r.device == "cuda" and not r.ok
    assert [m.ok for m in r.memory] == [True, False]
    text = smoke.render_text(r)
    assert "SMOKE FAILED" in text and "out of memory" in text and "more than 10% off" in text
    assert "OFF" in text
    assert dataclasses.asdict(r)["memory"][1]["predicted_allocated_bytes"] == \
        g.peak_allocated_bytes


def test_cpu_smoke_of_pure_fp16_fails_with_adamw_defaults_and_passes_with_eps_1e_4(tmp_path):
    """model.half() with AdamW's default eps=1e-8 really diverges (fp16 rounds eps to 0 and
    small gradients' squares to 0: the update is m/0); eps=1e-4 trains. The smoke says which."""
    default = smoke.run_smoke(MLP, smoke.SmokeConfig("single", 1, "fp16-pure", steps=3))
    assert not default.ok and default.ran_precision == "fp16-pure"
    assert any("not finite" in p for p in default.problems)
    assert any("eps=1e-4" in n for n in default.notes)
    fixed = tmp_path / "mlp_eps.py"
    fixed.write_text(open(MLP_PATH).read() + "\n\ndef make_optimizer(params):\n"
                     "    return torch.optim.AdamW(params, lr=1e-4, eps=1e-4)\n")
    r = smoke.run_smoke(load_model_file(str(fixed)),
                        smoke.SmokeConfig("single", 1, "fp16-pure", steps=3))
    assert r.ok and r.ran_precision == "fp16-pure", r.problems
    assert r.losses[-1] < r.losses[0]
    assert not any("eps=1e-4" in n for n in r.notes)
