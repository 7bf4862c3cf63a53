"""Real peaks of DeepSpeed's own precision modes on one GPU, phase by phase, for issue 31.

    python benchmarks/measure_deepspeed.py --out FILE [--trace-dir DIR] [--jobs 3]
    python benchmarks/measure_deepspeed.py --dry-run      # CPU (DS_ACCELERATOR=cpu), tiny

The model is DeepSpeedExamples' training/bf16_master_weight transformer
(tests/models/ds_simple_transformer.py, sizes from DS_HIDDEN/DS_LAYERS/DS_HEADS), trained as
its train.py does: the model built on the host, ``deepspeed.initialize`` with the config, then
``logits = engine(ids)``, cross-entropy, backward, ``engine.step()``. Each record is one fresh
single-process run (world size 1, NCCL), so ZeRO's partitioning machinery runs with nothing
to shard: what it allocates besides the shards (gathered parameters, buckets, flat buffers,
fp32 master copies) is what this measures.

The optimizer is torch's fused AdamW through DeepSpeed's ``torch_adam`` switch: the memory of
DeepSpeed's FusedAdam (two fp32 states, no temporaries) without building its CUDA extension
on the machine (``--set second`` also runs DeepSpeed's own FusedAdam, built by its JIT op
builder). fp16 and stage-0 setups call ``engine.backward(loss)`` (the loss scaler needs it, and
stage 0 refuses a direct backward, as DeepSpeed-Chat does it); the others ``loss.backward()`` as
train.py does.

Peaks are per phase (the allocator's peak is reset at each phase's start), so the whole run's
peak is the largest of them; ``--trace-dir`` also writes each run's allocator events
(benchmarks/alloc_trace.py). Without CUDA (and without --dry-run) it exits with code 2.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
MODEL_FILE = os.path.join(ROOT, "tests", "models", "ds_simple_transformer.py")
STEPS = 3
# train.py's configs/baseline.json memory settings; the optimizer as the module docstring says
_ADAMW = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True,
                                      "fused": True}}
_BASELINE_ZERO3 = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                   "reduce_bucket_size": 5e7, "stage3_param_persistence_threshold": 0}
# DeepSpeed-Chat's get_train_ds_config (3a77097): fp16, loss_scale_window 100, clipping 1.0
_CHAT_FP16 = {"fp16": {"enabled": True, "loss_scale_window": 100}, "gradient_clipping": 1.0}
# DeepSpeed's own FusedAdam (built by its JIT op builder on the machine): stage 0's
# FP16_Optimizer path, which DeepSpeed-Chat's runs took
_FUSED_ADAMW = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}
SETUPS = {
    "zero3-bf16": {"bf16": {"enabled": True}, "zero_optimization": _BASELINE_ZERO3},
    "zero2-bf16": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}},
    "zero2-fp16": {**_CHAT_FP16, "zero_optimization": {"stage": 2}},
    "zero0-fp16": {**_CHAT_FP16, "zero_optimization": {"stage": 0}},
    # the second set: stage 1, fp32, small overlapped buckets, accumulation, FusedAdam
    "zero1-bf16": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
    "zero2-fp32": {"zero_optimization": {"stage": 2}},
    "zero2-bf16-small-buckets": {"bf16": {"enabled": True},
                                 "zero_optimization": {"stage": 2, "overlap_comm": True,
                                                       "reduce_bucket_size": 5e7}},
    "zero2-bf16-accum2": {"bf16": {"enabled": True}, "gradient_accumulation_steps": 2,
                          "zero_optimization": {"stage": 2}},
    "zero0-bf16-fusedadam": {"bf16": {"enabled": True}, "optimizer": _FUSED_ADAMW,
                             "zero_optimization": {"stage": 0}},
    "zero0-fp16-fusedadam": {**_CHAT_FP16, "optimizer": _FUSED_ADAMW,
                             "zero_optimization": {"stage": 0}},
}
# ZeRO-Offload: DeepSpeed builds DeepSpeedCPUAdam for the config's AdamW (not torch's: with bf16
# and offload it insists on its own CPU Adam, stage_1_and_2.py _enforce_cpu_offload), whose op
# its JIT builder compiles on the machine
_CPU_ADAMW = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}
_TO_CPU = {"device": "cpu", "pin_memory": True}
SETUPS.update({
    "zero2-bf16-offload": {"bf16": {"enabled": True}, "optimizer": _CPU_ADAMW,
                           "zero_optimization": {"stage": 2, "offload_optimizer": _TO_CPU}},
    "zero3-bf16-offload": {"bf16": {"enabled": True}, "optimizer": _CPU_ADAMW,
                           "zero_optimization": {**_BASELINE_ZERO3, "offload_optimizer": _TO_CPU}},
    "zero3-bf16-offload-all": {"bf16": {"enabled": True}, "optimizer": _CPU_ADAMW,
                               "zero_optimization": {**_BASELINE_ZERO3, "offload_optimizer": _TO_CPU,
                                                     "offload_param": _TO_CPU}},
})
MODELS = {"254m": (1024, 12, 16), "1.4b": (2048, 24, 16), "tiny": (64, 2, 4)}
# (setup, model, batch, checkpointing), by set
JOBS = {
    "first": [("zero3-bf16", "254m", 4, False), ("zero3-bf16", "254m", 4, True),
              ("zero3-bf16", "1.4b", 1, False), ("zero3-bf16", "1.4b", 1, True),
              ("zero2-bf16", "254m", 4, False), ("zero2-fp16", "254m", 4, False),
              ("zero0-fp16", "254m", 4, False)],
    "second": [("zero1-bf16", "254m", 4, False), ("zero2-fp32", "254m", 4, False),
               ("zero2-bf16-small-buckets", "254m", 4, False),
               ("zero2-bf16-accum2", "254m", 2, False),
               ("zero0-bf16-fusedadam", "254m", 4, False),
               ("zero0-fp16-fusedadam", "254m", 4, False)],
    # issue 32's offload plans, not measured yet (results/README.md)
    "offload": [("zero2-bf16-offload", "254m", 4, False), ("zero3-bf16-offload", "254m", 4, False),
                ("zero3-bf16-offload-all", "254m", 4, False)],
    # measured after the model matched "offload": held out
    "offload2": [("zero2-bf16-offload", "254m", 4, True), ("zero3-bf16-offload", "254m", 4, True),
                 ("zero3-bf16-offload-all", "1.4b", 1, False), ("zero2-bf16-offload", "1.4b", 1, True)],
}


def ds_config(setup: str, batch: int) -> dict:
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "optimizer": _ADAMW, **SETUPS[setup]}


def _steps(setup: str) -> int:
    """Forward-backward-step rounds: three optimizer steps' worth."""
    return STEPS * SETUPS[setup].get("gradient_accumulation_steps", 1)


def _child(job: dict) -> dict:
    import torch
    hidden, layers, heads = MODELS[job["model"]]
    os.environ.update(DS_HIDDEN=str(hidden), DS_LAYERS=str(layers), DS_HEADS=str(heads))
    if job["dry_run"]:
        os.environ.update(DS_SEQ="32", DS_VOCAB="1000")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(job["port"]))
    import deepspeed
    import importlib.util
    spec = importlib.util.spec_from_file_location("ds_simple_transformer", MODEL_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cuda = not job["dry_run"]
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    rec = {**_label(job), "ds_config": ds_config(job["setup"], job["batch_size"]),
           "hidden": hidden, "layers": layers, "heads": heads, "seq": mod.SEQ,
           "vocab": mod.VOCAB, "phases": [], "error": None, "oom": False}
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(dev)
        if job.get("trace"):
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc",
                                                     stacks="python")

    def phase(name: str, fn):
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        if cuda:
            torch.cuda.synchronize(dev)
            rec["phases"].append({"phase": name,
                                  "max_memory_allocated": torch.cuda.max_memory_allocated(dev),
                                  "max_memory_reserved": torch.cuda.max_memory_reserved(dev),
                                  "memory_allocated": torch.cuda.memory_allocated(dev),
                                  "memory_reserved": torch.cuda.memory_reserved(dev)})
        else:
            rec["phases"].append({"phase": name})
        return out

    try:
        torch.manual_seed(0)
        model = mod.Model()
        if job["checkpointing"]:
            _checkpoint_blocks(model)
        rec["parameters"] = sum(p.numel() for p in model.parameters())
        engine, *_ = phase("initialize", lambda: deepspeed.initialize(
            model=model, model_parameters=model.parameters(),
            config=ds_config(job["setup"], job["batch_size"])))
        cfg = SETUPS[job["setup"]]
        engine_backward = "fp16" in cfg or cfg["zero_optimization"]["stage"] == 0
        engine.train()
        for step in range(_steps(job["setup"])):
            ids = torch.randint(0, mod.VOCAB, (job["batch_size"], mod.SEQ), device=dev)
            labels = torch.randint(0, mod.VOCAB, (job["batch_size"], mod.SEQ), device=dev)
            loss = phase(f"forward{step}", lambda: torch.nn.functional.cross_entropy(
                engine(ids).view(-1, mod.VOCAB), labels.view(-1)))
            phase(f"backward{step}", (lambda: engine.backward(loss)) if engine_backward
                  else loss.backward)
            del loss
            phase(f"step{step}", engine.step)
    except torch.OutOfMemoryError as e:
        rec.update(oom=True, error=str(e).splitlines()[0][:300])
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}"[:500]
    if cuda:
        done = [p for p in rec["phases"] if "max_memory_allocated" in p]
        rec["max_memory_allocated"] = max((p["max_memory_allocated"] for p in done), default=None)
        rec["max_memory_reserved"] = max((p["max_memory_reserved"] for p in done), default=None)
        if job.get("trace"):
            from alloc_trace import write_trace
            rec["trace_error"] = write_trace(job["trace"])
    return rec


def _checkpoint_blocks(model) -> None:
    """train.py's --activation_checkpointing: its forward with each block called through
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    def forward(input_ids):
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, -1)
        x = model.embedding(input_ids) + model.pos_embedding(positions)
        for layer in model.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return model.output_proj(x)
    model.forward = forward


def _label(job: dict) -> dict:
    return {k: job[k] for k in ("setup", "model", "batch_size", "checkpointing")}


def _run_child(job: dict, timeout: float) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "4")
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**_label(job), "error": f"timed out after {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {**_label(job), "error": f"child exited {p.returncode} with no result",
            "stderr_tail": p.stderr[-3000:]}


def _environment(dry: bool) -> dict:
    import torch
    import importlib.metadata as md
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "deepspeed": md.version("deepspeed"),
           "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if not dry:
        props = torch.cuda.get_device_properties(0)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        env.update(gpu=props.name, total_bytes=props.total_memory,
                   driver=smi.stdout.strip() or None)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model: check the plumbing")
    ap.add_argument("--jobs", type=int, default=3, help="configurations running at once")
    ap.add_argument("--trace-dir", help="also write each run's allocator events here")
    ap.add_argument("--set", choices=list(JOBS), default="first", help="which runs (default first)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    ap.add_argument("--out", default="/tmp/deepspeed-dry.json")
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(_child(json.loads(args.child))), flush=True)
        return 0
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        print("measure_deepspeed.py: no CUDA GPU visible (or pass --dry-run)", file=sys.stderr)
        return 2
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    jobs = []
    for i, (setup, model, batch, ck) in enumerate(JOBS[args.set]):
        name = f"{setup}-{model}-b{batch}-ck{int(ck)}.json.gz"
        jobs.append({"setup": setup, "model": "tiny" if args.dry_run else model,
                     "batch_size": batch, "checkpointing": ck, "dry_run": args.dry_run,
                     "port": 29600 + i,
                     "trace": os.path.join(args.trace_dir, name) if args.trace_dir else None})
    doc = {"environment": _environment(args.dry_run),
           "method": __doc__.split("\n\n", 2)[2].strip(), "steps": STEPS, "records": []}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for rec in pool.map(lambda j: _run_child(j, args.timeout), jobs):
            doc["records"].append(rec)
            print(json.dumps({k: rec.get(k) for k in ("setup", "model", "batch_size",
                                                       "checkpointing", "max_memory_allocated",
                                                       "max_memory_reserved", "error")}),
                  flush=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0 if all(not r.get("error") for r in doc["records"]) else 1


if __name__ == "__main__":
    sys.exit(main())
