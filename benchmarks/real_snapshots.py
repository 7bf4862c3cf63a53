"""Dump real CUDA memory snapshots of sample models (torch.cuda.memory._dump_snapshot), for
explain and the snapshot writer to be checked against (tests/snapshots/).

    OUT=tests/snapshots python benchmarks/real_snapshots.py      # on a machine with a GPU

Two-step fp32 runs of tiny_mlp (batch 64) and gpt2_small (batch 2) with the history recorded
(python stacks), and the OOM-observer recipe: gpt2_small at batch 8 under a 3 GiB
set_per_process_memory_fraction, the snapshot dumped by the observer at the failed allocation,
plus torch.cuda.memory_summary() after it. snapshots.json records the peaks of each run.
"""
import json, os, sys, torch
sys.path.insert(0, ".")
from oomdoctor.models.loader import load_model_file
from oomdoctor.models.training import compute_loss, make_optimizer
OUT = os.environ.get("OUT", "tests/snapshots")
meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "runs": {}}

def steps(spec, b, n=2):
    m = spec.build_model().cuda(); opt = make_optimizer(spec, m)
    for _ in range(n):
        batch = spec.make_batch(b)
        batch = tuple(t.cuda() for t in batch) if isinstance(batch, (tuple, list)) else {k: v.cuda() for k, v in batch.items()}
        loss = compute_loss(spec, m, batch); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        del loss, batch
    del m, opt

for name, b in (("tiny_mlp", 64), ("gpt2_small", 2)):
    spec = load_model_file(f"sample_models/{name}.py")
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    steps(spec, b)
    path = f"{OUT}/{name}_b{b}_fp32.pickle"
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    meta["runs"][os.path.basename(path)] = {"model": name, "batch": b, "precision": "fp32", "steps": 2,
        "max_memory_allocated": torch.cuda.max_memory_allocated(), "max_memory_reserved": torch.cuda.max_memory_reserved(), "bytes": os.path.getsize(path)}
    print(name, meta["runs"][os.path.basename(path)], flush=True)

# The OOM-observer recipe: a snapshot dumped at the moment of an OOM.
torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
frac = 3 * 2**30 / torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(frac)
oom_path = f"{OUT}/gpt2_small_b8_fp32_oom.pickle"
def oom_observer(device, alloc, device_alloc, device_free):
    torch.cuda.memory._dump_snapshot(oom_path)
torch._C._cuda_attach_out_of_memory_observer(oom_observer)
torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
err = None
try:
    steps(load_model_file("sample_models/gpt2_small.py"), 8)
except Exception as e:   # ModelFileError wrapping the OOM
    err = str(e)
summary = torch.cuda.memory_summary()
torch.cuda.memory._record_memory_history(enabled=None)
open(f"{OUT}/gpt2_small_b8_oom_summary.txt", "w").write((err or "no OOM") + "\n\n" + summary)
meta["runs"][os.path.basename(oom_path)] = {"model": "gpt2_small", "batch": 8, "precision": "fp32", "memory_fraction": frac,
    "error": err, "max_memory_allocated": torch.cuda.max_memory_allocated(), "max_memory_reserved": torch.cuda.max_memory_reserved(),
    "bytes": os.path.getsize(oom_path) if os.path.exists(oom_path) else None}
print(meta["runs"][os.path.basename(oom_path)], flush=True)
json.dump(meta, open(f"{OUT}/snapshots.json", "w"), indent=1)
