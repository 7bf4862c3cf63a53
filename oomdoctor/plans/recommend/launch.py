"""What to run: the launch line and its environment, the training-loop snippet, quality notes."""
from __future__ import annotations

from typing import Any

from oomdoctor.configs import PURE_QUALITY
from oomdoctor.models.spec import ModelSpec
from oomdoctor.plans.parallel import Strategy, policy_applies
from oomdoctor.plans.recommend.facts import _Facts
from oomdoctor.plans.recommend.machine import Hardware
from oomdoctor.plans.recommend.node_launch import sbatch_script, torchrun_lines
from oomdoctor.plans.recommend.records import Candidate, Launch


def _launch(c: Candidate, hw: Hardware, spec: ModelSpec, facts: _Facts,
            allocator: str = "expandable_segments:True") -> Launch:
    """``allocator``: the PYTORCH_CUDA_ALLOC_CONF the plan's numbers were computed with; the
    line sets it (nothing for the default)."""
    st = Strategy(c.strategy, c.num_gpus, nodes=c.nodes) if c.strategy != "pipeline2" else \
        Strategy("pipeline2", 2)
    if c.nodes > 1:
        return _node_launch(c, st, hw, spec, facts, allocator)
    procs = st.processes
    env = _allocator_env(allocator) | {"OMP_NUM_THREADS": str(max(1, hw.cores // procs))}
    gpus = ",".join(str(i) for i in range(c.num_gpus))
    env["CUDA_VISIBLE_DEVICES"] = gpus
    args = f"train.py --batch-size {c.micro_batch} --grad-accum {c.grad_accum}"
    if procs > 1:
        command = f"torchrun --standalone --nproc_per_node={procs} {args}"
    else:
        command = f"python {args}"
    # Planned on another machine (a laptop, CI), the core count is this machine's, not the
    # training server's: say so rather than print a number that looks measured.
    env_note = "" if hw.detected else (
        f"(OMP_NUM_THREADS={env['OMP_NUM_THREADS']} is this machine's {hw.cores} cores / {procs} "
        f"process{'es' if procs > 1 else ''}; on the training server use its cores / {procs})")
    return Launch(command, env, snippet(c, facts.blocks_parent, facts.has_batchnorm,
                                        no_p2p=hw.link == "pcie-no-p2p",
                                        adapters=spec.adapters, targets=facts.lora_targets),
                  quality_notes(c, facts) + _sharded_4bit_note(c, spec.adapters), env_note)


def _sharded_4bit_note(c: Candidate, adapters: Any) -> tuple[str, ...]:
    """fully_shard over bitsandbytes' 4-bit weights works only where Params4bit survives FSDP2's
    chunking of each parameter (bitsandbytes PR #1719, merged August 2025; before it the
    chunks were plain tensors and the quantization state was lost, bitsandbytes issue #1424)."""
    if c.strategy not in ("zero3", "hsdp") or adapters is None or not adapters.quantize:
        return ()
    return ("FSDP2 over 4-bit weights (FSDP-QLoRA) needs a bitsandbytes release from after "
            "August 2025 (its PR #1719: Params4bit keeps its quantization state through "
            "fully_shard); with an older one, upgrade it, or shard with FSDP1 - accelerate's FSDP "
            "plugin, as bitsandbytes' FSDP-QLoRA guide does (plan it with `--fsdp-version 1` in "
            "`oomdoctor parallel`)",)


def _allocator_env(allocator: str) -> dict[str, str]:
    return {"PYTORCH_CUDA_ALLOC_CONF": allocator} if allocator else {}


def _node_launch(c: Candidate, st: Strategy, hw: Hardware, spec: ModelSpec, facts: _Facts,
                 allocator: str) -> Launch:
    """Several nodes: the line for each node (node 0 first) and a SLURM script."""
    g = st.per_node
    env = _allocator_env(allocator) | {"OMP_NUM_THREADS": str(max(1, hw.cores // g))}
    args = f"train.py --batch-size {c.micro_batch} --grad-accum {c.grad_accum}"
    lines = torchrun_lines(st.nodes, g, args)
    note = (f"run line i on node i; HOST is node 0's address, reachable from every node "
            f"(NCCL_SOCKET_IFNAME picks the interface if there are several); "
            f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} is "
            + ("this machine's" if hw.detected else "this machine's, not the nodes'")
            + f" {hw.cores} cores / {g} processes")
    return Launch(lines[0], env, snippet(c, facts.blocks_parent, facts.has_batchnorm,
                                         adapters=spec.adapters, targets=facts.lora_targets),
                  quality_notes(c, facts), note, lines, sbatch_script(st.nodes, g, args, env))


def hsdp_lines(nodes: int, per_node: int, blocks: str, policy: bool = False) -> list[str]:
    """FSDP2 hybrid sharding: a 2-D mesh, replicas across nodes (dim 0), shards within a node
    (dim 1) - fully_shard with a 2-D mesh is HSDP (torch/distributed/fsdp/_fully_shard/
    _fully_shard.py, the ``mesh`` argument); FSDP1 spells it ShardingStrategy.HYBRID_SHARD.
    ``policy``: bf16 as FSDP2's MixedPrecisionPolicy."""
    mp = ", mp_policy=mp" if policy else ""
    return ["from torch.distributed.device_mesh import init_device_mesh",
            "from torch.distributed.fsdp import fully_shard"
            + (", MixedPrecisionPolicy" if policy else "") + "   # FSDP2, torch >= 2.6",
            *(_POLICY if policy else []),
            f"mesh = init_device_mesh('cuda', ({nodes}, {per_node}),   # (nodes, GPUs per node)",
            "                        mesh_dim_names=('replicate', 'shard'))",
            "# the model stays on the CPU: fully_shard moves each block to the GPU as it shards",
            f"for block in {blocks}:         # shard within the node, replicate across",
            f"    fully_shard(block, mesh=mesh{mp})",
            f"fully_shard(model, mesh=mesh{mp})",
            "opt = torch.optim.AdamW(model.parameters(), lr=lr)"]


# Strategies whose ranks run under torchrun with one process per GPU and a DistributedSampler.
_DISTRIBUTED = ("ddp", "zero1", "zero2", "zero3", "hsdp")
# Strategies wrapped in DDP, whose accumulation steps skip the all-reduce with no_sync().
_NO_SYNC = ("ddp", "zero1")
_ADAMW = "opt = torch.optim.AdamW(model.parameters(), lr=lr)"
_DISTRIBUTED_SETUP = ["import torch.distributed as dist",
                      "from torch.utils.data import DataLoader, DistributedSampler",
                      "dist.init_process_group('nccl')                  # torchrun sets RANK etc.",
                      "local_rank = int(os.environ['LOCAL_RANK'])",
                      "torch.cuda.set_device(local_rank)",
                      "device = torch.device('cuda', local_rank)"]
# One process: the device setup of each strategy (the rest use GPU 0).
_LOCAL_SETUP = {"pipeline2": ["from accelerate import dispatch_model"]}
_CHECKPOINTED = ["from torch.utils.checkpoint import checkpoint",
                 "class Checkpointed(torch.nn.Module):           # recompute in backward",
                 "    def __init__(self, block):",
                 "        super().__init__()",
                 "        self.block = block",
                 "    def forward(self, *args, **kwargs):",
                 "        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)"]
_DDP = ["model = torch.nn.parallel.DistributedDataParallel(",     # ZeRO-1 is DDP + sharded Adam
        "    model.to(device), device_ids=[local_rank], gradient_as_bucket_view=True)"]
# Wrapping the model and building the optimizer, for the strategies that need no parameters
# (zero2/zero3, hsdp, dp and the split are built by _wrap_lines); any other strategy is one
# plain GPU.
_WRAP = {
    "ddp": [*_DDP, _ADAMW],
    "zero1": ["from torch.distributed.optim import ZeroRedundancyOptimizer", *_DDP,
              "opt = ZeroRedundancyOptimizer(model.parameters(),",
              "                              optimizer_class=torch.optim.AdamW, lr=lr)"],
}
_PLAIN_WRAP = ["model.to(device)", _ADAMW]
_AUTOCAST = {"fp16": "torch.float16", "bf16": "torch.bfloat16"}
_PURE_DTYPE = {"bf16-pure": "torch.bfloat16", "fp16-pure": "torch.float16"}
# AdamW's default eps=1e-8 is below fp16's smallest subnormal (6e-8) and rounds to 0 in an fp16
# state: a weight whose first second moment underflows (gradients below ~5e-3, or 0) steps by
# m/0 = -inf or NaN at once (configs.PURE_QUALITY, where this was checked); eps=1e-4 does not.
_FP16_EPS = ("for g in opt.param_groups: g['eps'] = 1e-4   # fp16 rounds 1e-8 to 0: "
             "m/0 = inf")


def snippet(c: Candidate, blocks: str = "", batchnorm: bool = False, no_p2p: bool = False,
            adapters: Any = None, targets: tuple[str, ...] = (), cpu_offload: bool = False
            ) -> str:
    """The training-loop changes for this configuration, as a short code sketch; ``adapters``
    (oomdoctor.models.adapters.Adapters): the model is built as LoRA/QLoRA trains it, with
    LoRA on ``targets`` (what peft chose in the trace); ``cpu_offload``: FSDP2 (zero3) with
    CPUOffloadPolicy."""
    distributed = c.strategy in _DISTRIBUTED
    where = f"model.{blocks}" if blocks else "model.layers"
    if adapters is not None:
        # get_peft_model wraps the model: its blocks are the base model's (a PeftModel has no
        # `model.layers`, which the printed loop tried and failed on)
        where = f"model.get_base_model().{blocks or 'model.layers'}"
    lines = _setup_lines(c.strategy, distributed)
    lines += (_adapter_lines(c, adapters, targets, distributed) if adapters is not None
              else _model_lines(c, where))
    if distributed and batchnorm and c.num_gpus > 1:
        lines.append("model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # global BN")
    lines += _wrap_lines(c, where, no_p2p, cpu_offload)
    if c.precision == "fp16-pure":
        lines.append(_FP16_EPS)
    if c.precision == "fp16":
        lines.append("scaler = torch.amp.GradScaler('cuda')")
    lines += _loader_lines(c, distributed)
    lines += _loop_lines(c, distributed)
    return "\n".join(lines)


def _setup_lines(strategy: str, distributed: bool) -> list[str]:
    """Imports, process group and device."""
    lines = ["import os, torch"]
    if strategy in _NO_SYNC:
        lines.append("import contextlib")          # the loop's no_sync() switch
    if distributed:
        return lines + _DISTRIBUTED_SETUP
    lines.append("from torch.utils.data import DataLoader")
    return lines + _LOCAL_SETUP.get(strategy, ["device = torch.device('cuda', 0)"])


def _model_lines(c: Candidate, where: str) -> list[str]:
    """Build the model, cast it for a pure precision, wrap each block for checkpointing."""
    lines = ["model = build_model()"]
    if c.precision == "bf16-pure":
        lines.append("model = model.to(torch.bfloat16)             # pure bf16: weights too")
    elif c.precision == "fp16-pure":
        lines.append("model = model.half()              # pure fp16: weights too, no GradScaler")
    return lines + checkpointing_lines(c.checkpointing, where)


def checkpointing_lines(checkpointing: bool, where: str) -> list[str]:
    """Each block of ``where`` wrapped to recompute in the backward (none without
    ``checkpointing``)."""
    if not checkpointing:
        return []
    return [*_CHECKPOINTED, f"for i, block in enumerate({where}):",
            f"    {where}[i] = Checkpointed(block)"]


def _adapter_lines(c: Candidate, adapters: Any, targets: tuple[str, ...], distributed: bool
                   ) -> list[str]:
    """The model as peft and bitsandbytes build it for this plan (what was traced): 4-bit or
    8-bit frozen weights, the QLoRA recipe's preparation, LoRA on the traced targets."""
    dtype = {"fp32": "torch.float32", "fp16": "torch.float16",
             "fp16-pure": "torch.float16"}.get(c.precision, "torch.bfloat16")
    # QLoRA's recipe upcasts what is not quantized to fp32; a pure 16-bit plan keeps it 16-bit
    # (oomdoctor.models.adapters builds the model the plan's figures are for the same way)
    upcast = adapters.quantize and c.precision not in _PURE_DTYPE
    lines = ["from peft import LoraConfig, get_peft_model"
             + (", prepare_model_for_kbit_training" if upcast else "")]
    load = "model = AutoModelForCausalLM.from_pretrained(MODEL_ID, torch_dtype=" + dtype
    if adapters.quantize:
        lines += ["from transformers import AutoModelForCausalLM, BitsAndBytesConfig"]
        if adapters.quantize == "int8":
            lines.append("bnb = BitsAndBytesConfig(load_in_8bit=True)")
        else:
            lines += [f"bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="
                      f"'{adapters.quantize}',",
                      f"                         bnb_4bit_compute_dtype={dtype},"
                      + (" bnb_4bit_use_double_quant=True," if adapters.double_quant else ""),
                      # FSDP shards one dtype: the 4-bit weights stored as the compute dtype
                      # (FSDP-QLoRA, Answer.AI / transformers' bnb_4bit_quant_storage).
                      *([f"                         bnb_4bit_quant_storage={dtype},"
                         "  # FSDP shards it"] if c.strategy in ("zero3", "hsdp") else []),
                      "                         )"]
        load += (",\n    quantization_config=bnb"
                 + (", device_map={'': local_rank})   # each rank loads its own copy"
                    if distributed and c.strategy not in ("zero3", "hsdp") else ")"))
        lines.append(load)
        if upcast:
            lines.append("model = prepare_model_for_kbit_training(model, use_gradient_"
                         f"checkpointing={c.checkpointing})   # frozen base, norms in fp32")
        elif c.checkpointing:
            # non-reentrant: peft enables the inputs' gradients for reentrant checkpointing
            # only on models that are not quantized (peft_model.py, _prepare_model_for_
            # gradient_checkpointing), and transformers 4.x defaults to reentrant
            lines += ["model.gradient_checkpointing_enable(   # pure 16-bit: nothing upcast",
                      "    gradient_checkpointing_kwargs={'use_reentrant': False})"]
    else:
        lines += ["from transformers import AutoModelForCausalLM   # or your build_model()",
                  load + ")   # frozen base in 16-bit"]
        if c.checkpointing:
            lines.append("model.gradient_checkpointing_enable()")
    names = list(targets or adapters.lora_targets or ())
    lines.append(f"model = get_peft_model(model, LoraConfig(r={adapters.lora_rank}, "
                 f"lora_alpha={adapters.lora_rank}, target_modules={names!r}))")
    # from_pretrained leaves the model in eval mode, where transformers' checkpointing is off
    # (GradientCheckpointingLayer checks self.training): the plan's figure needs it on
    lines.append("model.train()                 # from_pretrained returns it in eval mode")
    return lines


def _wrap_lines(c: Candidate, where: str, no_p2p: bool, cpu_offload: bool = False
                ) -> list[str]:
    """The strategy's wrapper around the model, and the optimizer."""
    if c.strategy == "hsdp":
        return hsdp_lines(c.nodes, c.num_gpus // c.nodes, where, uses_policy(c))
    if c.strategy in ("zero2", "zero3"):
        reshard = "True" if c.strategy == "zero3" else "False"
        policy = uses_policy(c)
        kw = (", mp_policy=mp" if policy else "") + (", offload_policy=offload"
                                                     if cpu_offload else "")
        names = ["fully_shard", *(["MixedPrecisionPolicy"] if policy else []),
                 *(["CPUOffloadPolicy"] if cpu_offload else [])]
        place = (["# the model stays on the CPU, where CPUOffloadPolicy keeps its shards;",
                  "# each block is copied to the GPU when it runs, and AdamW steps on the CPU",
                  "offload = CPUOffloadPolicy()"] if cpu_offload else
                 ["# the model stays on the CPU: fully_shard moves each block to the GPU as it",
                  "# shards it, so no GPU ever holds the whole model"])
        return [f"from torch.distributed.fsdp import {', '.join(names)}   # FSDP2, torch >= 2.6",
                *(_POLICY if policy else []), *place,
                f"for block in {where}:         # each block; embeddings and head too",
                f"    fully_shard(block, reshard_after_forward={reshard}{kw})",
                f"fully_shard(model, reshard_after_forward={reshard}{kw})",
                _ADAMW]
    if c.strategy == "dp":
        return _data_parallel_lines(no_p2p)
    if c.strategy == "pipeline2":
        return _split_lines(c)
    return list(_WRAP.get(c.strategy, _PLAIN_WRAP))


def _split_lines(c: Candidate) -> list[str]:
    """accelerate's dispatch_model at the plan's own cut: the map is printed, not read from a
    file another command writes (with other defaults, `split` can cut elsewhere)."""
    main = c.main_device
    return ["# the plan's split (`oomdoctor split --device-map map.json` writes it as JSON)",
            f"device_map = {device_map_literal(c.device_map or {})}",
            f"model = dispatch_model(model, device_map=device_map, main_device={main})",
            f"device = torch.device('cuda', {main})   # inputs and the loss go here",
            _ADAMW]


def device_map_literal(device_map: dict[str, int]) -> str:
    """A device map as Python, runs of numbered blocks on one GPU as comprehensions:
    {'embed': 0, **{f'layers.{i}': 0 for i in range(0, 40)}, 'head': 1}."""
    import re
    parts: list[str] = []
    run: list = []              # [prefix, first, last, gpu] of the run being written

    def flush() -> None:
        if run:
            prefix, first, last, gpu = run
            parts.append(f"**{{f'{prefix}.{{i}}': {gpu} for i in range({first}, {last + 1})}}"
                         if last - first >= 2 else
                         ", ".join(f"'{prefix}.{i}': {gpu}" for i in range(first, last + 1)))
            run.clear()
    for name, gpu in device_map.items():
        m = re.fullmatch(r"(.+)\.(\d+)", name)
        if m and run and run[0] == m[1] and run[2] + 1 == int(m[2]) and run[3] == gpu:
            run[2] = int(m[2])
            continue
        flush()
        if m:
            run.extend([m[1], int(m[2]), int(m[2]), gpu])
        else:
            parts.append(f"{name!r}: {gpu}")
    flush()
    return "{" + ", ".join(parts) + "}"


# FSDP2's bf16: fp32 master weights sharded, blocks gathered and computed in bf16, gradients
# reduced in fp32 (what the plan's numbers assume: oomdoctor.plans.parallel.fsdp)
_POLICY = ["mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"]


def uses_policy(c: Candidate) -> bool:
    """bf16 under FSDP runs as FSDP2's MixedPrecisionPolicy, not autocast."""
    return policy_applies(c.strategy, c.precision)


def _data_parallel_lines(no_p2p: bool) -> list[str]:
    lines = ["# prefer DDP (torchrun, one process per GPU); DataParallel loads GPU 0"]
    if no_p2p:
        # DataParallel copies weights and gathers outputs GPU to GPU every step
        # (broadcast_coalesced); on boards without P2P that path is known to hang or crawl.
        lines += ["# this board has no GPU-to-GPU P2P: DataParallel's per-step broadcast",
                  "# (broadcast_coalesced) can hang or crawl here - DDP does not need P2P"]
    return lines + ["model = torch.nn.DataParallel(model.to(device))", _ADAMW]


def _loader_lines(c: Candidate, distributed: bool) -> list[str]:
    """The DataLoader at the micro-batch (sharded per rank when distributed)."""
    if distributed:
        return ["sampler = DistributedSampler(dataset, shuffle=True)",
                f"loader = DataLoader(dataset, batch_size={c.micro_batch}, sampler=sampler,",
                "                    num_workers=4, pin_memory=True)"]
    if c.strategy == "dp":
        # DataParallel scatters each loader batch over the GPUs: the loader's batch is the
        # per-GPU micro-batch times the GPUs (torch/nn/parallel/data_parallel.py, scatter).
        return [f"loader = DataLoader(dataset, batch_size={c.micro_batch * c.num_gpus}, "
                f"shuffle=True,   # {c.micro_batch} per GPU x {c.num_gpus} GPUs",
                "                    num_workers=4, pin_memory=True)"]
    return [f"loader = DataLoader(dataset, batch_size={c.micro_batch}, shuffle=True, "
            "num_workers=4, pin_memory=True)"]


def _loop_lines(c: Candidate, distributed: bool) -> list[str]:
    """The epoch loop with gradient accumulation: K micro-batches, then one optimizer step."""
    lines = [f"K = {c.grad_accum}                             # micro-batches per step",
             "for epoch in range(epochs):"]
    if distributed:
        lines.append("    sampler.set_epoch(epoch)                    # a new shuffle per epoch")
    lines += ["    for i, batch in enumerate(loader):",
              "        batch = [t.to(device, non_blocking=True) for t in batch]",
              "        last = (i + 1) % K == 0"]
    if c.precision in _PURE_DTYPE:     # the weights are 16-bit: so are the float inputs
        lines.append(f"        batch = [t.to({_PURE_DTYPE[c.precision]}) if t.is_floating_point()"
                     " else t for t in batch]")
    indent = "        "
    if c.strategy == "hsdp":
        lines.append("        model.set_requires_all_reduce(last)  # across nodes: last only")
    if c.strategy in _NO_SYNC:
        lines.append(f"{indent}with model.no_sync() if not last else contextlib.nullcontext():"
                     "      # skip the all-reduce until the last")
        indent += "    "
    amp = None if uses_policy(c) else _AUTOCAST.get(c.precision)
    return lines + _backward_lines(c.precision, indent, amp) + _step_lines(c.precision)


def _backward_lines(precision: str, indent: str, amp: str | None) -> list[str]:
    """The loss (under autocast for AMP, ``amp`` its dtype; none under FSDP's policy, which
    computes in bf16 itself), scaled by 1/K, and its backward."""
    if amp:
        lines = [f"{indent}with torch.autocast('cuda', dtype={amp}):",
                 f"{indent}    loss = loss_fn(model, batch) / K"]
    else:
        lines = [f"{indent}loss = loss_fn(model, batch) / K"]
    return lines + [f"{indent}{'scaler.scale(loss)' if precision == 'fp16' else 'loss'}"
                    ".backward()"]


def _step_lines(precision: str) -> list[str]:
    """The optimizer step on the last micro-batch (through the GradScaler for fp16)."""
    step = (["            scaler.step(opt)", "            scaler.update()"]
            if precision == "fp16" else ["            opt.step()"])
    return ["        if last:", *step, "            opt.zero_grad(set_to_none=True)"]


def quality_notes(c: Candidate, facts: _Facts | None = None) -> tuple[str, ...]:
    """What the configuration changes in training quality, in the users' terms."""
    e = c.effective_batch
    notes = [f"effective batch {e} = micro-batch {c.micro_batch} x {c.grad_accum} accumulation "
             f"x {Strategy(c.strategy, c.num_gpus, nodes=c.nodes).data_parallel} data-parallel "
             "GPU(s). If your "
             f"learning rate was tuned at batch B, scale it with {e}/B: linearly for SGD (Goyal "
             "et al. 2017, with a few epochs of warm-up), about the square root for Adam/AdamW",
             "gradient accumulation: practically neutral - the summed gradient equals the large "
             "batch's up to float rounding"
             + (" (BatchNorm sees micro-batches only: statistics from "
                f"{c.micro_batch} samples; use SyncBatchNorm or GroupNorm)"
                if facts is not None and getattr(facts, "has_batchnorm", False)
                and c.grad_accum > 1 else ""),
             ]
    if c.precision in ("fp16", "bf16"):
        notes.append(f"{c.precision} AMP: practically neutral (weights, gradients and optimizer "
                     "state stay fp32" + ("; keep the GradScaler - fp16 gradients underflow "
                                          "without it)" if c.precision == "fp16" else ")"))
    elif c.precision in PURE_QUALITY:
        notes.append(PURE_QUALITY[c.precision])
    else:
        notes.append("fp32: numerics unchanged")
    if c.checkpointing:
        notes.append("activation checkpointing: numerically identical (the forward is re-run, "
                     "about +1/3 compute; dropout RNG state is restored)")
    notes.append("a smaller effective batch is not neutral: noisier gradients, retune the "
                 "learning rate - which is why the plan keeps the batch you asked for")
    if c.strategy in ("ddp", "zero1", "zero2", "zero3", "hsdp"):
        notes.append("data parallelism is neutral in theory: every rank sees a different shard "
                     "(DistributedSampler + set_epoch), gradients are averaged")
        if facts is not None and getattr(facts, "has_batchnorm", False) and c.num_gpus > 1:
            notes.append(f"BatchNorm: without SyncBatchNorm each GPU normalises over its own "
                         f"{c.micro_batch} samples, not the global batch; the snippet converts "
                         "it (one all-reduce per BN layer in the forward, a little slower). "
                         "With large micro-batches plain BatchNorm is usually fine")
    return tuple(notes)
