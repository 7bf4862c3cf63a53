"""Measure real CUDA peaks of the training setups issue 34 asks about: LoRA on a grouped-query
Llama, FSDP2 (fully_shard) with a bf16 MixedPrecisionPolicy on a one-GPU mesh, and QLoRA with
double quantization.

    python benchmarks/measure_newpaths.py --out benchmarks/results/newpaths/nvidia-h200-2.11.0.json
    python benchmarks/measure_newpaths.py --dry-run      # CPU, tiny sizes: checks the plumbing

Each configuration is one fresh process (a fresh CUDA context and caching allocator) that builds
the model, takes 2 optimizer steps (forward ``model(input_ids, labels=input_ids).loss``,
backward, ``AdamW.step()``, ``zero_grad(set_to_none=True)``) and reports
``torch.cuda.max_memory_allocated/reserved``. Peaks are reset once when the process starts
(before anything is on the GPU), so ``max_memory_allocated/reserved`` cover the whole process:
building/moving/quantizing/sharding the model and the 2 steps. The same peaks are also split:
``setup_*`` (start until the optimizer exists, before the first forward) and ``steps[i]`` (each
step on its own: peaks reset at its start, the current figures at its end); the whole-run peak is
the larger of the setup peak and the step peaks, exactly. ``torch.cuda.empty_cache()`` is never
called by this script (peft's ``prepare_model_for_kbit_training`` calls it once, in QLoRA's
setup). Several configuration processes run at once on the one GPU (``--jobs``): each process
has its own caching allocator, so its peaks are its own; the card is far from full.

The model is ``transformers.AutoModelForCausalLM.from_config(LlamaConfig(**MODEL), dtype=...,
attn_implementation="sdpa")`` with random weights (nothing downloaded). Without CUDA, and
without --dry-run, the script exits with code 2; with PYTORCH_CUDA_ALLOC_CONF set it refuses.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback

from alloc_trace import write_trace      # the allocator's events, compact
from calibrate import _driver, _write   # nvidia-smi's driver; an atomic JSON write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = "newpaths-1"
STEPS = 2
LR = 1e-4

# Reduced-width Llama with grouped-query attention (8 query heads, 2 key/value heads).
MODEL = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
SEQ_LEN = 4096
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
TINY_SEQ = 64

LORA = {"r": 16, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}

SETUPS = {
    "lora-bf16-amp": (
        "LoRA: from_config(dtype=bfloat16) - every base weight bf16 and frozen; peft "
        "get_peft_model(LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules="
        "[q_proj, v_proj])) keeps the adapters fp32 (autocast_adapter_dtype=True, its default); "
        "forward and loss under torch.autocast('cuda', dtype=torch.bfloat16); AdamW(lr=1e-4, "
        "torch defaults: foreach) over the adapters. Checkpointing: "
        "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
        "False}) before get_peft_model. oomdoctor's 'bf16' precision with --lora 16."),
    "lora-bf16": (
        "As lora-bf16-amp without autocast: the bf16 base runs in bf16, peft casts each "
        "adapter's input to fp32 and its output back to bf16. oomdoctor's 'bf16-pure' precision "
        "with --lora 16."),
    "fsdp2-bf16-mp": (
        "FSDP2 on a one-GPU mesh: torch.distributed.init_process_group('nccl', rank=0, "
        "world_size=1), init_device_mesh('cuda', (1,)); from_config(dtype=float32) built on the "
        "CPU; checkpointing (when on) enabled as for LoRA before sharding; fully_shard(layer, "
        "mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32)) for each model.model.layers[i], then fully_shard(model, "
        "same arguments) (reshard_after_forward default: True), which moves the CPU parameters to "
        "the GPU; full fine-tuning, AdamW(lr=1e-4, torch defaults: foreach) over all (fp32, "
        "DTensor) parameters; no autocast."),
    "fsdp2-lora-bf16-mp": (
        "FSDP2 with LoRA on a one-GPU mesh: the process group and mesh of fsdp2-bf16-mp; "
        "from_config(dtype=bfloat16) built on the CPU, checkpointing (when on) as for LoRA, the "
        "LoRA of lora-bf16-amp (frozen bf16 base, fp32 adapters); fully_shard(layer, mesh=mesh, "
        "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) "
        "for each decoder layer, then the root, which moves the parameters to the GPU; AdamW over "
        "the adapters (fp32 DTensors); no autocast."),
    "fsdp2-offload-bf16-mp": (
        "FSDP2 with CPU offload on a one-GPU mesh: fsdp2-bf16-mp with offload_policy="
        "CPUOffloadPolicy() (pin_memory=True) on every fully_shard call, so the sharded fp32 "
        "parameters, their gradients and AdamW (foreach, on the CPU) stay on the host and each "
        "block is copied to the GPU when it runs; the model is never moved to the GPU. "
        "oomdoctor's `--strategy fsdp --cpu-offload`, bf16."),
    "qlora-nf4-dq-bf16-amp": (
        "QLoRA: from_config(dtype=bfloat16) on the CPU; every nn.Linear except lm_head replaced "
        "by bitsandbytes.nn.Linear4bit(in, out, bias=False, compute_dtype=torch.bfloat16, "
        "compress_statistics=True, quant_type='nf4') whose weight is Params4bit(<the bf16 "
        "weight>, requires_grad=False, blocksize=64, compress_statistics=True, "
        "quant_type='nf4'); model.to('cuda') quantizes each weight as it moves (nf4, double "
        "quantization: 8-bit absmax with fp32 second-level statistics); model.is_loaded_in_4bit "
        "= True; peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=<ckpt>, "
        "gradient_checkpointing_kwargs={'use_reentrant': False}) freezes everything and casts "
        "embed_tokens, the RMSNorms and lm_head to fp32 (then torch.cuda.empty_cache()); then "
        "get_peft_model with the LoRA config of lora-bf16-amp (adapters fp32); forward and loss "
        "under torch.autocast('cuda', dtype=torch.bfloat16); AdamW over the adapters. This is "
        "what transformers' BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', "
        "bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16) lays out."),
}


# --- one configuration, in its own process ------------------------------------------------------

def _child(job: dict) -> dict:
    import torch
    dry = job["dry_run"]
    cuda = not dry
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    rec: dict = {"setup": job["setup"], "description": SETUPS[job["setup"]],
                 "model": "llama-gqa", "model_config": job["model_config"],
                 "seq_len": job["seq_len"], "batch_size": job["batch_size"],
                 "checkpointing": job["checkpointing"], "steps": STEPS,
                 "attn_implementation": "sdpa", "oom": False, "error": None}
    t0 = time.time()
    if cuda:
        torch.cuda.set_device(dev)
        torch.cuda.reset_peak_memory_stats(dev)

    def mem() -> dict:
        if not cuda:
            return {}
        torch.cuda.synchronize(dev)
        return {"max_memory_allocated": torch.cuda.max_memory_allocated(dev),
                "max_memory_reserved": torch.cuda.max_memory_reserved(dev),
                "memory_allocated": torch.cuda.memory_allocated(dev),
                "memory_reserved": torch.cuda.memory_reserved(dev)}

    if cuda and job.get("snapshot"):
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc",
                                                 stacks="python")
    sdpa_calls: list[dict] = []
    _watch_sdpa(sdpa_calls)
    steps: list[dict] = []
    phase = "setup"
    try:
        model, params, amp = _build(job, dev, rec)
        optimizer = torch.optim.AdamW(params, lr=LR)
        rec["setup_memory"] = mem()
        rec["trainable_parameters"] = sum(p.numel() for p in params)
        gen = torch.Generator(device="cpu").manual_seed(0)
        for i in range(STEPS):
            phase = f"step {i + 1}"
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            _step(model, optimizer, job, gen, dev, amp)
            steps.append(mem())
        if cuda and job.get("snapshot"):
            rec["snapshot_error"] = write_trace(job["snapshot"])
            torch.cuda.memory._record_memory_history(enabled=None)
        rec["step_seconds"] = []
        for i in range(job.get("time_steps", 0)):     # after the peaks: timing only
            phase = f"timed step {i + 1}"
            torch.cuda.synchronize(dev) if cuda else None
            t = time.perf_counter()
            _step(model, optimizer, job, gen, dev, amp)
            torch.cuda.synchronize(dev) if cuda else None
            rec["step_seconds"].append(round(time.perf_counter() - t, 5))
    except torch.OutOfMemoryError as e:
        rec["oom"] = True
        rec["error"] = f"{phase}: {str(e).splitlines()[0]}"
        steps.append(mem())
    except Exception as e:  # noqa: BLE001  (recorded, the parent goes on)
        rec["error"] = f"{phase}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rec["traceback"] = traceback.format_exc()[-4000:]
        steps.append(mem())
    rec["steps_memory"] = steps
    if cuda:
        setup = rec.get("setup_memory") or (steps[0] if steps else {})
        parts = [setup] + steps
        rec["max_memory_allocated"] = max(p.get("max_memory_allocated", 0) for p in parts)
        rec["max_memory_reserved"] = max(p.get("max_memory_reserved", 0) for p in parts)
        rec["train_max_memory_allocated"] = max((s["max_memory_allocated"] for s in steps),
                                                default=None)
        rec["train_max_memory_reserved"] = max((s["max_memory_reserved"] for s in steps),
                                               default=None)
    else:
        rec["max_memory_allocated"] = rec["max_memory_reserved"] = None
    rec["sdpa"] = sdpa_calls[:1]
    if sdpa_calls:
        _sdpa_backend(sdpa_calls[0])       # after the peaks are read: it allocates a little
    rec["sdpa_calls"] = len(sdpa_calls)
    rec["seconds"] = round(time.time() - t0, 2)
    if job["setup"].startswith("fsdp2"):
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    return rec


def _step(model, optimizer, job: dict, gen, dev, amp: bool) -> None:
    import torch
    vocab = job["model_config"]["vocab_size"]
    ids = torch.randint(0, vocab, (job["batch_size"], job["seq_len"]), generator=gen).to(dev)
    with (torch.autocast(dev.type, dtype=torch.bfloat16) if amp else _null()):
        loss = model(ids, labels=ids).loss
    loss.backward()
    del loss, ids
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _watch_sdpa(calls: list[dict]) -> None:
    """Record the first scaled_dot_product_attention call: shapes, dtypes (before and under
    autocast) and flags, without allocating anything (transformers looks the function up on
    torch.nn.functional at each call). :func:`_sdpa_backend` names the fused kernel afterwards."""
    import torch
    import torch.nn.functional as F
    orig = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False, **kw):
        if not calls:
            dt = q.device.type
            amp = torch.is_autocast_enabled(dt)
            calls.append({"q": list(q.shape), "k": list(k.shape), "v": list(v.shape),
                          "dtype": str(q.dtype), "autocast": amp,
                          "effective_dtype": str(torch.get_autocast_dtype(dt) if amp
                                                 and q.is_floating_point() else q.dtype),
                          "mask": None if attn_mask is None else [list(attn_mask.shape),
                                                                  str(attn_mask.dtype)],
                          "is_causal": bool(is_causal), "enable_gqa": bool(enable_gqa),
                          "dropout_p": dropout_p, "scale": scale, "grad": torch.is_grad_enabled(),
                          "device": str(q.device)})
        else:
            calls.append({})
        return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa, **kw)
    F.scaled_dot_product_attention = sdpa


def _sdpa_backend(info: dict) -> None:
    """After the run: the fused backend torch picks for the recorded call
    (torch._fused_sdp_choice on empty tensors of its shapes and effective dtype)."""
    import torch
    if not info or info.get("mask") is not None:
        return
    try:
        dtype = getattr(torch, info["effective_dtype"].removeprefix("torch."))
        q, k, v = (torch.empty(info[n], dtype=dtype, device=info["device"],
                               requires_grad=info["grad"]) for n in ("q", "k", "v"))
        choice = int(torch._fused_sdp_choice(q, k, v, None, info["dropout_p"], info["is_causal"],
                                             scale=info["scale"], enable_gqa=info["enable_gqa"]))
        info["fused_sdp_choice"] = choice
        info["backend"] = torch.nn.attention.SDPBackend(choice).name
    except Exception as e:  # noqa: BLE001
        info["fused_sdp_choice"] = f"unavailable: {type(e).__name__}: {e}"[:300]


def _llama(job: dict, dtype):
    import transformers
    transformers.utils.logging.set_verbosity_error()
    config = transformers.LlamaConfig(**job["model_config"])
    torch_seed()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                          attn_implementation="sdpa")
    return model


def torch_seed() -> None:
    import torch
    torch.manual_seed(0)


def _lora(model):
    import peft
    return peft.get_peft_model(model, peft.LoraConfig(**LORA))


def _ckpt(model) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _build(job: dict, dev, rec: dict):
    """(model in train mode, the parameters AdamW trains, whether to autocast to bf16)."""
    import torch
    setup = job["setup"]
    ck = job["checkpointing"]
    if setup in ("lora-bf16-amp", "lora-bf16"):
        model = _llama(job, torch.bfloat16)
        if ck:
            _ckpt(model)
        model.to(dev)
        model = _lora(model)
        model.train()
        rec["use_cache"] = model.config.use_cache
        params = [p for p in model.parameters() if p.requires_grad]
        rec["parameter_dtypes"] = _dtypes(model)
        return model, params, setup == "lora-bf16-amp"
    if setup in ("fsdp2-bf16-mp", "fsdp2-lora-bf16-mp", "fsdp2-offload-bf16-mp"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(job["port"])
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        cuda = dev.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                                **({"device_id": dev} if cuda else {}))
        mesh = init_device_mesh(dev.type, (1,))
        lora = setup == "fsdp2-lora-bf16-mp"
        model = _llama(job, torch.bfloat16 if lora else torch.float32)
        if ck:
            _ckpt(model)
        if lora:
            model = _lora(model)
        kw = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                              reduce_dtype=torch.float32)}
        if setup == "fsdp2-offload-bf16-mp":     # pinned host memory needs CUDA
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)
        layers = model.base_model.model.model.layers if lora else model.model.layers
        for layer in layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        model.train()
        rec["use_cache"] = model.config.use_cache
        rec["parameter_dtypes"] = _dtypes(model)
        rec["parameter_device"] = str(next(model.parameters()).device)
        return model, [p for p in model.parameters() if p.requires_grad], False
    if setup == "qlora-nf4-dq-bf16-amp":
        import bitsandbytes as bnb
        import peft
        model = _llama(job, torch.bfloat16)
        n = 0
        for name, module in list(model.named_modules()):
            if not isinstance(module, torch.nn.Linear) or name == "lm_head":
                continue
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            q = bnb.nn.Linear4bit(module.in_features, module.out_features,
                                  bias=module.bias is not None, compute_dtype=torch.bfloat16,
                                  compress_statistics=True, quant_type="nf4", device="meta")
            q.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False, blocksize=64,
                                         compress_statistics=True, quant_type="nf4")
            if module.bias is not None:
                q.bias = torch.nn.Parameter(module.bias.data, requires_grad=False)
            setattr(parent, child, q)
            n += 1
        model.to(dev)                                   # Params4bit quantizes on the move
        rec["quantized_linears"] = n
        w = model.model.layers[0].self_attn.q_proj.weight
        st = w.quant_state
        rec["quant_check"] = {"weight": [str(w.dtype), list(w.shape)],
                              "bnb_quantized": bool(getattr(w, "bnb_quantized", False)),
                              "nested": bool(getattr(st, "nested", False)),
                              "absmax": [str(st.absmax.dtype), list(st.absmax.shape)],
                              "quant_type": st.quant_type, "blocksize": st.blocksize}
        model.is_loaded_in_4bit = True
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=ck,
            gradient_checkpointing_kwargs={"use_reentrant": False})
        model = _lora(model)
        model.train()
        rec["use_cache"] = model.config.use_cache
        rec["parameter_dtypes"] = _dtypes(model)
        return model, [p for p in model.parameters() if p.requires_grad], True
    raise ValueError(f"unknown setup {setup}")


def _dtypes(model) -> dict:
    """Bytes of parameters by (dtype, trainable)."""
    out: dict = {}
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        key = f"{str(local.dtype).removeprefix('torch.')}{'/trainable' if p.requires_grad else ''}"
        out[key] = out.get(key, 0) + local.numel() * local.element_size()
    return out


# --- the driver ---------------------------------------------------------------------------------

def _version(name: str) -> str | None:
    try:
        import importlib.metadata as md
        return md.version(name)
    except Exception:  # noqa: BLE001
        return None


def _environment(dry: bool) -> dict:
    import torch
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for lib in ("transformers", "peft", "bitsandbytes", "accelerate"):
        env[lib] = _version(lib)
    if not dry:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, total_bytes=props.total_memory,
                   compute_capability=[props.major, props.minor], driver=_driver(),
                   cudnn=torch.backends.cudnn.version())
    else:
        env.update(gpu="cpu (dry run)", total_bytes=None, driver=None)
    return env


def _run_child(job: dict, timeout: float) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "4")
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        return {**_label(job), "oom": False, "error": f"timed out after {timeout:.0f} s",
                "stderr_tail": (e.stderr or b"")[-2000:].decode(errors="replace")
                if isinstance(e.stderr, bytes) else (e.stderr or "")[-2000:],
                "max_memory_allocated": None, "max_memory_reserved": None}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            rec = json.loads(line[len("RESULT "):])
            rec["process_seconds"] = round(time.time() - t0, 2)
            return rec
    return {**_label(job), "oom": False, "error": f"child exited {p.returncode} with no result",
            "stderr_tail": p.stderr[-3000:], "max_memory_allocated": None,
            "max_memory_reserved": None}


def _label(job: dict) -> dict:
    return {k: job[k] for k in ("setup", "model_config", "seq_len", "batch_size",
                                "checkpointing")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model: check the plumbing")
    ap.add_argument("--setups", nargs="*", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--seq-len", type=int, help=f"default {SEQ_LEN} ({TINY_SEQ} with --dry-run)")
    ap.add_argument("--jobs", type=int, default=4, help="configurations running at once")
    ap.add_argument("--checkpointing", choices=["off", "on", "both"], default="both")
    ap.add_argument("--snapshot-dir", help="also write each run's allocator events "
                                           "(<setup>-ck<0|1>-b<batch>.json.gz) here")
    ap.add_argument("--time-steps", type=int, default=0,
                    help="after the measured steps, time this many more (use --jobs 1)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    ap.add_argument("--out", help="output JSON (default benchmarks/results/newpaths/"
                                  "<gpu>-<torch>.json; /tmp/newpaths-dry.json with --dry-run)")
    args = ap.parse_args(argv)

    if args.child:
        job = json.loads(args.child)
        rec = _child(job)
        print("RESULT " + json.dumps(rec), flush=True)
        return 0

    import torch
    if not args.dry_run:
        if not torch.cuda.is_available():
            print("measure_newpaths.py: no CUDA GPU visible; run on a GPU machine, or pass "
                  "--dry-run", file=sys.stderr)
            return 2
        if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
            print("measure_newpaths.py: PYTORCH_CUDA_ALLOC_CONF is set; unset it",
                  file=sys.stderr)
            return 2
    env = _environment(args.dry_run)
    if args.out:
        out = args.out
    elif args.dry_run:
        out = "/tmp/newpaths-dry.json"
    else:
        slug = re.sub(r"[^a-z0-9]+", "-", env["gpu"].lower()).strip("-")
        out = os.path.join(ROOT, "benchmarks", "results", "newpaths",
                           f"{slug}-{env['torch'].split('+')[0]}.json")
    if args.snapshot_dir:
        os.makedirs(args.snapshot_dir, exist_ok=True)
    cfg = TINY if args.dry_run else MODEL
    seq = args.seq_len or (TINY_SEQ if args.dry_run else SEQ_LEN)
    jobs = []
    for setup in args.setups:
        for ck in {"off": (False,), "on": (True,), "both": (False, True)}[args.checkpointing]:
            for b in args.batches:
                snap = (os.path.join(args.snapshot_dir, f"{setup}-ck{int(ck)}-b{b}.json.gz")
                        if args.snapshot_dir else None)
                jobs.append({"setup": setup, "model_config": cfg, "seq_len": seq, "batch_size": b,
                             "checkpointing": ck, "dry_run": args.dry_run, "snapshot": snap,
                             "time_steps": args.time_steps, "port": 29500 + len(jobs)})
    records: list[dict] = []
    doc = {"schema": SCHEMA, "environment": env,
           "method": {"steps": STEPS, "optimizer": f"torch.optim.AdamW(lr={LR})",
                      "loss": "model(input_ids, labels=input_ids).loss; input_ids uniform "
                              "random over the vocabulary, made on the CPU (seed 0) and moved",
                      "process": "one fresh process per record; --jobs of them at once",
                      "jobs": args.jobs,
                      "peaks": "max_memory_allocated/reserved: whole process (reset at its "
                               "start) = max(setup_memory, steps_memory[*]) max_* figures",
                      "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                      "setups": SETUPS},
           "records": records}
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(_run_child, job, args.timeout): job for job in jobs}
        for fut in concurrent.futures.as_completed(futures):
            rec = fut.result()
            records.append(rec)
            records.sort(key=lambda r: (list(SETUPS).index(r["setup"]), r["checkpointing"],
                                        r["batch_size"]))
            _write(out, doc)
            a, r = rec.get("max_memory_allocated"), rec.get("max_memory_reserved")
            gib = (lambda x: "-" if x is None else f"{x / 2**30:.3f}")
            print(f"[{time.time() - t0:6.1f}s] {rec['setup']:24s} ck={int(rec['checkpointing'])} "
                  f"b={rec['batch_size']}: allocated {gib(a)} GiB reserved {gib(r)} GiB"
                  f"{' OOM' if rec.get('oom') else ''}"
                  f"{' ERROR ' + str(rec['error']) if rec.get('error') and not rec.get('oom') else ''}"
                  f" ({rec.get('process_seconds', '?')} s)", flush=True)
    doc["environment"]["seconds"] = round(time.time() - t0, 1)
    _write(out, doc)
    print(f"wrote {out}")
    return 0 if all(not r.get("error") or r.get("oom") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
