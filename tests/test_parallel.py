"""Per-GPU memory of each strategy, checked against independent numbers: real CPU runs of the same
sharding over gloo (measured by torch.profiler), DeepSpeed's published estimator output, PyTorch's
own bucket assignment, and formulas from the model's parameters."""
import importlib.util
import json
import multiprocessing
import os
import tempfile

import pytest
import torch
from click.testing import CliRunner

from oomdoctor.plans import parallel as par
from oomdoctor.cli import EXIT_OK, EXIT_PROBLEM, LINK_CHOICES, STRATEGY_CHOICES, cli
from oomdoctor.plans.estimate import Budget, estimate_trace
from oomdoctor.sim.gpus import get_profile
from oomdoctor.models.loader import load_model_file
from oomdoctor.sim.trace import TraceConfig, trace_training
from reference import allocator_peak

ROOT = os.path.dirname(os.path.dirname(__file__))
MLP_PATH = os.path.join(ROOT, "sample_models", "tiny_mlp.py")
DEEP_MLP = os.path.join(ROOT, "tests", "models", "deep_mlp.py")   # seven Linear layers
MLP = load_model_file(MLP_PATH)
MLP_PARAMS = 399_370          # sample_models/README.md
GPU = get_profile("rtx3090")

# DeepSpeed's layout for the ZeRO cross-check: 16-bit weights and gradients on the GPU, the
# optimizer keeping fp32 master weights, both Adam moments and an fp32 gradient copy (the
# components DeepSpeed's estimate_zero2_model_states_mem_needs lists: 2 + (2+4+4+8)/N).
MASTER_WEIGHTS = '''
import torch, torch.nn as nn
WIDTH = 128
def build_model():
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4)])
def make_batch(batch_size):
    return torch.randn(batch_size, WIDTH)
def loss_fn(model, batch):
    return model(batch).float().pow(2).mean()

class MasterAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3):
        super().__init__(params, dict(lr=lr))
    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["master"] = p.float()
                    st["exp_avg"] = torch.zeros_like(st["master"])
                    st["exp_avg_sq"] = torch.zeros_like(st["master"])
                    st["grad32"] = torch.zeros_like(st["master"])
                st["grad32"].copy_(p.grad)
                st["exp_avg"].mul_(0.9).add_(st["grad32"], alpha=0.1)
                st["exp_avg_sq"].mul_(0.999).addcmul_(st["grad32"], st["grad32"], value=0.001)
                st["master"].addcdiv_(st["exp_avg"], st["exp_avg_sq"].sqrt().add_(1e-8),
                                      value=-group["lr"])
                p.copy_(st["master"])

def make_optimizer(params):
    return MasterAdam(params)
'''


@pytest.fixture(scope="module")
def model_dir():
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "master_weights.py"), "w") as f:
            f.write(MASTER_WEIGHTS)
        yield tmp


# --- an independent reference: the same sharding really run on the CPU over gloo ---------------

def _load(path):
    spec = importlib.util.spec_from_file_location("ref_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Each job is measured this many times and the smallest peak kept. The profiler records memory
# events only on threads it follows, and gloo's worker thread is not one: when that thread happens
# to drop the last reference to a tensor (the first DDP bucket, whose allreduce work it still holds
# for a moment after the future completes), the free is never seen and the tensor looks alive to
# the end. CI saw this once in ~15 runs on rank 0 (+1 bucket, 1,597,480 B). A missed free can only
# inflate a peak, so the minimum over repeats is the true one.
REPEATS = 3


def _real_rank(rank, world, init, results, jobs):
    """Two AdamW steps (the CPU's for-loop implementation) of each job, written from scratch with
    torch.distributed: DDP, DDP + ZeroRedundancyOptimizer, FSDP2 without / with resharding."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    out = {}
    for name, path, mode, batch_size in [job for job in jobs for _ in range(REPEATS)]:
        mod = _load(path)
        torch.manual_seed(0)
        model = mod.build_model().train()
        if mode in ("zero2", "zero3"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (world,))
            for child in model.children():
                fully_shard(child, mesh=mesh, reshard_after_forward=mode == "zero3")
            fully_shard(model, mesh=mesh, reshard_after_forward=mode == "zero3")
            base = sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())
        else:
            base = sum(p.untyped_storage().nbytes() for p in model.parameters())

        def run(model=model, mod=mod, mode=mode, batch_size=batch_size):
            wrapped = model
            if mode in ("ddp", "zero1"):
                wrapped = torch.nn.parallel.DistributedDataParallel(model)
            if mode == "zero1":
                from torch.distributed.optim import ZeroRedundancyOptimizer
                opt = ZeroRedundancyOptimizer(model.parameters(),
                                              optimizer_class=torch.optim.AdamW, lr=1e-4)
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for step in range(2):
                torch.manual_seed(100 * step + rank)
                batch = mod.make_batch(batch_size)
                loss = mod.loss_fn(wrapped, batch)
                loss.backward()
                del loss, batch
                opt.step()
                opt.zero_grad(set_to_none=True)
        out[name] = min(out.get(name, float("inf")), base + allocator_peak(run))
    results.put((rank, out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def real_runs():
    """{job: [rank 0 peak, rank 1 peak]} from real 2-process CPU runs."""
    deep = DEEP_MLP
    jobs = [("ddp", MLP_PATH, "ddp", 64), ("zero1", MLP_PATH, "zero1", 64),
            ("zero2", deep, "zero2", 8), ("zero3", deep, "zero3", 8)]
    # spawn, not fork: a child forked from a pytest process that already ran many tests
    # (threads, profiler, allocator state) was seen to hang inside the profiled run.
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        procs = [ctx.Process(target=_real_rank, args=(r, 2, init, results, jobs))
                 for r in range(2)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=240) for _ in procs)
        for p in procs:
            p.join(timeout=30)
    return {name: [got[0][name], got[1][name]] for name, *_ in jobs}


def _predicted(path_or_spec, strategy, batch_size, **kw):
    """Live-byte peaks per GPU of the strategy's event lists, for a CPU-semantics trace."""
    spec = path_or_spec if not isinstance(path_or_spec, str) else load_model_file(path_or_spec)
    trace = trace_training(spec, TraceConfig(batch_size, emulate_cuda=False, **kw))
    layout = par.model_layout(spec)
    return [par.live_peak(ev) for _, ev in par.strategy_events(
        trace, layout, par.Strategy(strategy, 2), GPU, workspaces=False)]


@pytest.mark.serial   # real 2-process gloo runs: their peaks move when the cores are shared
def test_ddp_matches_a_real_gloo_run(real_runs):
    """DDP = the single-GPU step + one bucket copy of the gradients; to the byte (within 200 B)."""
    [pred] = _predicted(MLP, "ddp", 64)
    for measured in real_runs["ddp"]:
        assert abs(pred - measured) <= 200, (pred, measured)
    # ... and the difference from one GPU is the gradients once more (the buckets).
    [single] = _predicted(MLP, "single", 64)
    assert pred - single == MLP_PARAMS * 4


@pytest.mark.serial   # real 2-process gloo runs: their peaks move when the cores are shared
def test_zero1_matches_zero_redundancy_optimizer_per_rank(real_runs):
    """ZeroRedundancyOptimizer gives whole parameters to ranks (largest first), so the two ranks
    differ by about 1.3 MB of AdamW state; both are predicted within 200 B."""
    pred = _predicted(MLP, "zero1", 64)
    for p, m in zip(pred, real_runs["zero1"]):
        assert abs(p - m) <= 200, (pred, real_runs["zero1"])
    assert abs(pred[0] - pred[1]) > 10**6


@pytest.mark.serial   # real 2-process gloo runs: their peaks move when the cores are shared
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero2_zero3_match_a_real_fsdp2_run(real_runs, stage):
    """FSDP2 on a CPU mesh over gloo. The real peak is noisy: gloo's collectives copy their
    full-size buffers on the CPU in gloo's own threads (NCCL works in place), at times that vary
    from run to run. ZeRO-2 (reshard_after_forward=False) was 0.91-1.03 of the measured peak
    over repeated runs: within 10%, two-sided. ZeRO-3 is FSDP2's own allocations to 100 bytes
    (tests/test_fsdp.py, over a process group that moves no data), so here it may only sit below
    gloo's peak (0.88-1.0 of it seen), never above. Both far below the single-GPU peak."""
    path = DEEP_MLP
    [pred] = _predicted(path, stage, 8)
    [single] = _predicted(path, "single", 8)
    for measured in real_runs[stage]:
        if stage == "zero2":
            assert abs(pred / measured - 1) < 0.10, (pred, measured)
        else:
            assert 0.8 < pred / measured <= 1 + 1e-4, (pred, measured)
    assert pred < 0.7 * single


def test_ddp_bucket_assignment_is_pytorchs():
    """The rebuilt buckets equal torch.distributed._compute_bucket_assignment_by_size with DDP's
    default limits (1 MiB first, then 25 MiB)."""
    sizes = [100, 300_000, 5, 7_000_000, 262_144, 10, 6_000_000, 6_000_000, 1]
    tensors = [torch.empty(n) for n in sizes]
    indices, _ = torch.distributed._compute_bucket_assignment_by_size(
        tensors, [par.DDP_FIRST_BUCKET_BYTES, par.DDP_BUCKET_BYTES])
    expected = [sum(sizes[i] * 4 for i in bucket) for bucket in indices]
    assert par.ddp_buckets([n * 4 for n in sizes]) == expected


def test_deepspeed_estimators_reproduce_the_published_table():
    """transformers docs (deepspeed.md, "Memory requirements"): bigscience/T0_3B, "2783M total
    params, 65M largest layer params" (the 32128 x 2048 embedding), per-GPU GB (2**30):
    1 GPU: 46.91 / 5.43 (optimizer offloaded) / 0.25 (all offloaded); 2 GPUs: 23.58 / 2.84."""
    p, layer = 2_783_500_000, 32128 * 2048

    def gb(n):
        return round(n / 2**30, 2)
    assert gb(par.deepspeed_zero3_gpu_bytes(p, layer, 1)) == 46.91
    assert gb(par.deepspeed_zero3_gpu_bytes(p, layer, 1, offload_optimizer=True)) == 5.43
    assert gb(par.deepspeed_zero3_gpu_bytes(p, layer, 1, True, True)) == 0.25
    assert gb(par.deepspeed_zero3_gpu_bytes(p, layer, 2)) == 23.58
    assert gb(par.deepspeed_zero3_gpu_bytes(p, layer, 2, offload_optimizer=True)) == 2.84


def test_zero_model_states_against_deepspeed(model_dir):
    """With DeepSpeed's layout (16-bit weights + an optimizer holding fp32 master weights, both
    moments and an fp32 gradient: 16 B/param), ZeRO-2's model states after the optimizer step
    are DeepSpeed's 2P + 18P/N exactly. ZeRO-3 keeps 20P/N at rest: DeepSpeed's 18P/N + 4L
    counts the layer being computed (4L, not resident during the step) and folds the 16-bit
    gradient shard (2P/N, which FSDP keeps) into its fp32 gradient partition."""
    spec = load_model_file(os.path.join(model_dir, "master_weights.py"))
    p = 4 * 128 * 128
    trace = trace_training(spec, TraceConfig(1, precision="bf16-pure"))
    layout = par.model_layout(spec, "bf16-pure")
    budget = Budget(GPU)
    for n in (2, 4):
        z2 = par.estimate_strategy(trace, layout, par.Strategy("zero2", n), budget)
        z3 = par.estimate_strategy(trace, layout, par.Strategy("zero3", n), budget)
        assert z2.gpus[0].resting_state_bytes == par.deepspeed_zero2_gpu_bytes(p, n)
        assert z2.deepspeed_bytes == par.deepspeed_zero2_gpu_bytes(p, n)
        ds3 = par.deepspeed_zero3_gpu_bytes(p, 128 * 128, n)
        assert z3.gpus[0].resting_state_bytes == ds3 - 4 * 128 * 128 + 2 * p // n


def test_dataparallel_gpu0_holds_the_whole_batch():
    """nn.DataParallel scatters from GPU 0: at its backward peak GPU 0 holds the inputs of the
    other replicas' samples too - (N-1) x b x (256 floats + one int64 label) more than one GPU -
    while GPU 1 holds a parameter replica and no optimizer state."""
    b, n = 512, 2
    t1 = trace_training(MLP, TraceConfig(b, optimizer="sgd", emulate_cuda=False))
    t2 = trace_training(MLP, TraceConfig(n * b, optimizer="sgd", emulate_cuda=False))
    sizes = par.Sizes.affine(t1, t2)
    layout = par.model_layout(MLP)
    [(_, single)] = par.strategy_events(t1, layout, par.Strategy("single"), GPU, sizes,
                                        workspaces=False)
    (_, gpu0), (_, gpu1) = par.strategy_events(t1, layout, par.Strategy("dp", n), GPU, sizes,
                                               workspaces=False)
    assert par.live_peak(gpu0) - par.live_peak(single) == (n - 1) * b * (256 * 4 + 8)
    e = par.estimate_strategy(t1, layout, par.Strategy("dp", n), Budget(GPU), sizes=sizes)
    g0, g1 = e.gpus
    assert g0.breakdown["optimizer_state"] == 0 == g1.breakdown["optimizer_state"]   # SGD
    assert g1.breakdown["parameters"] == MLP_PARAMS * 4
    assert g0.device_peak_bytes >= g1.device_peak_bytes
    assert "DistributedDataParallel" in " ".join(e.notes)


def test_split_stages_hold_their_own_parameters():
    """Each stage's parameters, gradients and AdamW state at the optimizer peak equal 4, 4 and
    8 bytes per parameter of the modules the device map puts on that GPU (counted on a real
    nn.Module)."""
    plan = par.plan_split(MLP, TraceConfig(64, emulate_cuda=False), Budget(GPU))
    real = MLP.build_model()
    per_stage = [0, 0]
    for name, p in real.named_parameters():
        module = name.rsplit(".", 1)[0]
        per_stage[plan.partition.device_map[module]] += p.numel()
    assert sum(per_stage) == MLP_PARAMS and all(per_stage)
    for k, g in enumerate(plan.estimate.gpus):
        assert g.peak_phase == "optimizer"
        assert g.breakdown["parameters"] == 4 * per_stage[k]
        assert g.breakdown["gradients"] == 4 * per_stage[k]
        assert g.breakdown["optimizer_state"] == 8 * per_stage[k]
    assert sum(plan.partition.utilisation) == pytest.approx(1.0)
    assert "idles" in plan.estimate.notes[0]


def test_split_picks_the_cut_with_the_smallest_larger_stage():
    trace = trace_training(MLP, TraceConfig(64))
    layout = par.model_layout(MLP)
    budget = Budget(GPU)
    best = par.estimate_strategy(trace, layout, par.Strategy("pipeline2", 2), budget)
    ctx = par._Context(trace, layout, GPU, par.Sizes.of(trace).at(64))
    pipe = par._Pipeline(ctx)
    for cut in range(1, len(layout.blocks)):
        other = max(par._measure(ctx, g, budget, par.AllocatorConfig()).device_peak_bytes
                    for g in pipe.gpus(cut))
        assert best.peak_device_bytes <= other


def test_layout_flops_and_order_match_the_architecture():
    """tiny_mlp: forward 2*in*out per Linear and sample; backward twice that, except fc1, whose
    input needs no gradient."""
    layout = par.model_layout(MLP)
    assert layout.blocks == ("fc1", "fc2", "fc3")
    fwd = [2 * 256 * 512, 2 * 512 * 512, 2 * 512 * 10]
    assert layout.block_flops == (2 * fwd[0], 3 * fwd[1], 3 * fwd[2])
    assert layout.flops_per_sample == sum(layout.block_flops)
    assert layout.num_parameters == MLP_PARAMS
    # What crosses into each block: the input (256 floats), then 512 activations per sample.
    assert [(i.block, i.bytes(8)) for i in layout.inputs] == [(0, 8 * 1024), (1, 8 * 2048),
                                                             (2, 8 * 2048)]


def test_single_strategy_is_the_single_gpu_estimate():
    trace = trace_training(MLP, TraceConfig(64, precision="bf16"))
    budget = Budget(GPU)
    e = par.estimate_strategy(trace, par.model_layout(MLP, "bf16"), par.Strategy("single"),
                              budget)
    one = estimate_trace(trace, budget)
    assert (e.gpus[0].peak_allocated_bytes, e.gpus[0].peak_reserved_bytes) == \
        (one.peak_allocated_bytes, one.peak_reserved_bytes)


def test_ddp_never_lowers_per_gpu_memory():
    trace = trace_training(MLP, TraceConfig(64))
    layout = par.model_layout(MLP)
    budget = Budget(GPU)
    single = par.estimate_strategy(trace, layout, par.Strategy("single"), budget)
    for view in (False, True):
        ddp = par.estimate_strategy(trace, layout, par.Strategy("ddp", 2, view), budget)
        assert ddp.gpus[0].peak_allocated_bytes >= single.gpus[0].peak_allocated_bytes
        assert ddp.effective_batch == 2 * single.effective_batch


def test_affine_sizes_equal_a_trace():
    t1, t2, t5 = (trace_training(MLP, TraceConfig(b)) for b in (1, 2, 5))
    sizes = par.Sizes.affine(t1, t2)
    assert sizes is not None and sizes.at(5) == list(par.Sizes.of(t5).base)


def test_strategy_names_and_errors():
    assert par.parse_strategy("FSDP") == "zero3" and par.parse_strategy("dataparallel") == "dp"
    with pytest.raises(ValueError, match="unknown strategy"):
        par.parse_strategy("tensor-parallel")
    with pytest.raises(ValueError, match="exactly 2 GPUs"):
        par.Strategy("pipeline2", 4)
    assert set(STRATEGY_CHOICES) - {"fsdp"} == set(par.STRATEGIES)
    from oomdoctor.plans.recommend import LINKS
    assert LINK_CHOICES == LINKS


def run(*args):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize("command", ["parallel", "split", "recommend", "smoke"])
def test_commands_have_help(command):
    res = run(command, "--help")
    assert res.exit_code == 0 and "Usage:" in res.stdout


def test_parallel_cli_json():
    res = run("parallel", MLP_PATH, "--gpus", "2", "--gpu", "rtx3090", "-b", "16",
              "--strategy", "ddp", "--strategy", "fsdp", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    d = json.loads(res.stdout)
    assert [s["strategy"] for s in d["strategies"]] == ["ddp", "zero3"]
    for s in d["strategies"]:
        for g in s["gpus"]:
            assert isinstance(g["peak_reserved_bytes"], int)
            assert set(g["breakdown"]) == set(par.BREAKDOWN_KEYS)
    assert "tracing" in res.stderr


def test_split_cli_writes_a_device_map(tmp_path):
    out = tmp_path / "map.json"
    res = run("split", MLP_PATH, "--gpus", "2", "--memory", "1GiB", "--overhead", "0",
              "-b", "8", "--device-map", str(out))
    assert res.exit_code == EXIT_OK, res.stderr
    doc = json.loads(out.read_text())
    assert set(doc["device_map"]) == {"fc1", "fc2", "fc3"}
    assert set(doc["device_map"].values()) == {0, 1} and doc["main_device"] in (0, 1)
    assert "cuda:0" in res.stdout and "cuda:1" in res.stdout
    res = run("split", MLP_PATH, "--gpus", "3")
    assert res.exit_code == 2 and "exactly 2 GPUs" in res.stderr


def test_parallel_cli_nothing_fits():
    res = run("parallel", MLP_PATH, "--gpus", "2", "--memory", "40MiB", "--overhead", "0",
              "-b", "4096", "--strategy", "ddp", "--strategy", "single")
    assert res.exit_code == EXIT_PROBLEM
    assert "NO" in res.stdout
