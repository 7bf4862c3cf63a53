"""The fixes catalogue shared by the families: model and batch too big, per-phase advice, model loading."""
from __future__ import annotations

from .diagnosis import _ADAM8BIT_SAVING, _F, _QUALITY_NONE, _SPEED_NONE, _Ctx, _Out, _training_phase
from .draft import _Draft
from .results import Phase


def _batch_title(ctx: _Ctx) -> str:
    b, g = ctx.facts.get("batch_size"), ctx.facts.get("grad_accum")
    if b and b >= 2:
        return (f"Halve the micro-batch ({b} -> {b // 2}) and double gradient accumulation "
                f"({g or 1} -> {2 * (g or 1)})")
    return "Halve the micro-batch and double gradient accumulation steps"


def _size_fixes(out: _Out, d: _Draft, ctx: _Ctx, phase: Phase | None, act: int | None,
                trainable: int | None, states: int | None, env: str, multi_gpu: bool = True) -> None:
    """The remedies for 'the model and batch do not fit', each with what it buys when known."""
    _batch_fixes(out, d, ctx, phase, act)
    _mixed_precision_fix(out, d, act)
    if phase is not Phase.EVALUATION:
        _checkpointing_fix(out, act)
    if _training_phase(phase):
        _model_state_fixes(out, phase, trainable)
        if multi_gpu:
            _shard_fix(out, d, ctx, states)


def _batch_fixes(out: _Out, d: _Draft, ctx: _Ctx, phase: Phase | None, act: int | None) -> None:
    """Shorter inputs when the micro-batch is already 1, else halving it with twice the accumulation."""
    if ctx.facts.get("batch_size") == 1:
        out.fix("shorter_inputs", "The micro-batch is already 1: shorten the inputs (max sequence length, image "
                "resolution, crop size) or pack shorter samples", None, None, "faster",
                "changes what the model sees; truncation may hurt long-context quality",
                "Activation memory scales with sequence length (attention without a fused kernel with its "
                "square).", cost=2)
        return
    eff, bound, why = _halved_activations(d, phase, act)
    out.fix("halve_micro_batch", _batch_title(ctx), eff, bound,
            "slightly slower per sample (smaller kernels), same number of optimizer steps",
            "none: the effective batch is unchanged (BatchNorm sees half as many samples per step)",
            f"Frees about half of the activation memory: {why}. Keep micro_batch x accumulation_steps x "
            "GPUs constant and the learning rate needs no change. Halving the batch *without* accumulation "
            "also works but changes training (noisier gradients; retune the learning rate).", cost=1)


def _halved_activations(d: _Draft, phase: Phase | None, act: int | None) -> tuple[int | None, str | None, str]:
    """What halving the batch frees, its bound, and why: from the activations when known, else from
    the failing request when it is an activation of a batch-shaped phase."""
    req = d.numbers.get("requested")
    batchy = phase in (Phase.FORWARD, Phase.BACKWARD, Phase.EVALUATION)
    if act is not None:
        return (act // 2, "about",
                f"activations are about {_F(act)} here (allocated minus the model states) and scale with the batch")
    if batchy and req is not None:
        return (req // 2, "at least",
                (f"the failing {_F(req)} tensor is an activation of this {phase.value if phase else 'step'} and "
                 "halves with the batch, as do all the other activations"))
    return None, None, "activation memory scales with the micro-batch"


def _mixed_precision_fix(out: _Out, d: _Draft, act: int | None) -> None:
    """Offered unless the traceback shows autocast/half precision already in use."""
    amp_on = any("autocast" in f.code or "GradScaler" in f.code or ".half()" in f.code for f in d.frames)
    if amp_on:
        out.notes.append("The traceback shows autocast/half precision already in use, so mixed precision is "
                         "not offered as a fix.")
        return
    out.fix("mixed_precision", "Train with mixed precision: torch.autocast(dtype=torch.bfloat16) "
            "(or float16 + torch.amp.GradScaler)", act // 2 if act is not None else None, "about",
            "faster on tensor-core GPUs (RTX 20xx/30xx/40xx, A100, H100)",
            "practically none (bf16 needs no loss scaling; fp16 needs GradScaler)",
            "Saved activations are stored in 16 bit instead of 32, roughly halving them, if the model runs "
            "in fp32 today. Weights, gradients and optimizer state stay fp32, so this does not shrink the "
            "model states.", cost=0)


def _checkpointing_fix(out: _Out, act: int | None) -> None:
    out.fix("activation_checkpointing", "Activation (gradient) checkpointing: torch.utils.checkpoint, "
            "or model.gradient_checkpointing_enable() in transformers", act, "up to",
            "about 20-30% slower (the forward is recomputed during backward)", _QUALITY_NONE,
            "Keeps only each checkpointed block's input and recomputes the rest in backward, so the saved "
            "activations shrink from all layers' to roughly one layer's worth.", cost=1)


def _model_state_fixes(out: _Out, phase: Phase | None, trainable: int | None) -> None:
    """Training only: a lighter optimizer state, and adapters instead of every weight."""
    eff = _ADAM8BIT_SAVING * trainable if trainable else None
    out.fix("lighter_optimizer", "Lighter optimizer state: 8-bit AdamW (bitsandbytes) or Adafactor; "
            "and foreach=False on torch.optim", eff, "about", "about the same",
            "8-bit AdamW: near-identical in practice; Adafactor or plain SGD: retune the learning rate",
            "AdamW keeps 8 bytes of state per parameter, 8-bit AdamW 2. With foreach=True (the CUDA "
            "default) step() also holds about one parameter-sized set of temporaries; foreach=False avoids "
            "them at a small speed cost." + ("" if trainable else
            " The log does not print the parameter count, so the saving is not computed."),
            cost=1, primary=phase is Phase.OPTIMIZER_STEP)
    # Per trainable parameter, full fine-tuning with AdamW holds a 4-byte weight, a 4-byte
    # gradient and 8 bytes of state; LoRA keeps a frozen 16-bit copy (2 bytes), QLoRA about
    # half a byte (4-bit weights plus block scales), and trains ~1% as many adapter weights.
    eff = (16 - 2) * trainable if trainable else None
    out.fix("parameter_efficient", "Fine-tune adapters instead of every weight: LoRA (peft), "
            "or QLoRA with the frozen weights stored 4-bit (bitsandbytes); check the fit with "
            "`oomdoctor estimate MODEL --lora 16 --quantize nf4`", eff, "about",
            "similar per step (QLoRA slower: it dequantizes each weight for its matmul)",
            "changes what is trained: adapters come close to full fine-tuning on many "
            "fine-tuning tasks (QLoRA, arXiv:2305.14314), not for pretraining",
            "Gradients and optimizer state exist only for the adapters (about 1% of the "
            "parameters at rank 16), and the frozen weights need no fp32 copy: 2 bytes per "
            "parameter in bf16, about 0.5 with 4-bit storage, instead of the 16 that full "
            "fine-tuning with AdamW holds." + ("" if trainable else
            " The log does not print the parameter count, so the saving is not computed."),
            cost=2)


def _shard_fix(out: _Out, d: _Draft, ctx: _Ctx, states: int | None) -> None:
    """FSDP/ZeRO across the job's GPUs (2 assumed when the log does not say)."""
    n = ctx.world if ctx.world and ctx.world >= 2 else 2
    eff = states - states // n if states else None
    cap = d.numbers.get("capacity")
    need = ""
    if states and cap and states // n > cap * 3 // 4:
        # Leave a quarter of each card for activations, the CUDA context and workspaces.
        n_min = -(-states // (cap * 3 // 4))
        need = (f" With {n} GPUs each still holds {_F(states // n)}: the states alone need at least {n_min} "
                f"cards of {_F(cap)} with ZeRO-3/FSDP, or CPU offload.")
    out.fix("shard_model_states", "Shard weights, gradients and optimizer state across GPUs: FSDP "
            "(torch.distributed.fsdp) or DeepSpeed ZeRO-2/3", eff, "about",
            "slower: extra all-gather/reduce-scatter traffic every step (worse without NVLink)", _QUALITY_NONE,
            f"Each GPU keeps about 1/{n} of the model states instead of all of them"
            + (f" ({_F(states)} in total from the parameter count in this log)" if states else "")
            + (f"; {n} GPUs assumed" if not ctx.world else "")
            + "." + need + " DDP does not do this: it replicates the whole model on every GPU. CPU offload of "
            "the optimizer state (ZeRO-Offload) frees more, much more slowly.", cost=2,
            primary=bool(states and d.numbers.get("capacity") and states > d.numbers["capacity"] * 0.9))


def _empty_cache_note(out: _Out) -> None:
    out.notes.append(
        "torch.cuda.empty_cache() is not a fix: before raising this error the caching allocator already "
        "released its unused cached blocks and retried (c10/cuda/CUDACachingAllocator.cpp, the malloc retry "
        "path), so emptying the cache frees nothing the failed step could have used.")


def _phase_diag(out: _Out, phase: Phase | None, no_grad: bool, d: _Draft, act: int | None) -> None:
    if phase is Phase.FORWARD:
        out.diag("phase_forward", "It failed in the forward pass: the activations kept for backward grow with "
                 "batch size and sequence length/resolution, so the batch-shaped fixes below apply directly.")
    elif phase is Phase.BACKWARD:
        out.diag("phase_backward", "It failed in backward: the saved activations of the whole forward are alive "
                 "and gradients are being allocated on top. Checkpointing and mixed precision shrink the saved "
                 "activations; gradient accumulation with a smaller micro-batch does too.")
    elif phase is Phase.OPTIMIZER_STEP:
        out.diag("phase_optimizer_step", "It failed in optimizer.step(): Adam-type optimizers allocate their two "
                 "state tensors (8 bytes per parameter) lazily at the first step, and the foreach implementation "
                 "adds about one parameter-sized set of temporaries. The batch size barely matters here; the "
                 "optimizer state and the model size do.")
    elif phase is Phase.EVALUATION:
        if no_grad:
            out.diag("phase_evaluation", "It failed during evaluation/inference: activations of the evaluation "
                     "batch (or of generation with a long sequence) did not fit; a smaller evaluation batch helps.")
        else:
            out.diag("evaluation_without_no_grad", "It failed during evaluation/inference and no torch.no_grad() "
                     "or torch.inference_mode() is visible in the traceback: if autograd is on, every layer's "
                     "activations are kept for a backward pass that never comes. (If the call is wrapped outside "
                     "the traceback, this does not apply.)")
            out.fix("evaluation_no_grad", "Run evaluation under torch.inference_mode() (or torch.no_grad()) and "
                    "model.eval()", act if act is not None else d.numbers.get("allocated"), "up to", "faster",
                    _QUALITY_NONE,
                    "Without autograd no activation is kept after its layer, so evaluation needs only the "
                    "largest single layer's working memory.", cost=0, primary=True)
    elif phase is Phase.DATA_LOADING:
        out.diag("phase_data_loading", "It failed while loading data: a Dataset, collate_fn or the pin-memory "
                 "thread created CUDA tensors. Every DataLoader worker that touches CUDA creates its own CUDA "
                 "context and copies.")
        out.fix("data_on_cpu", "Keep Dataset/collate_fn on the CPU; move each batch with .to(device, "
                "non_blocking=True) in the training loop (pin_memory=True in the DataLoader)", None, None,
                _SPEED_NONE, _QUALITY_NONE, "CUDA work in worker processes costs a CUDA context per worker and "
                "duplicates tensors; the training loop is the one place batches should reach the GPU.",
                cost=0, primary=True)
    elif phase is Phase.MODEL_LOADING:
        out.diag("phase_model_loading", "It failed while loading or moving the model to the GPU: the weights "
                 "themselves (plus whatever else is on the card) do not fit - batch size is irrelevant here.")


def _load_fixes(out: _Out, ctx: _Ctx) -> None:
    total = ctx.facts.get("total_params")
    out.fix("half_precision_weights", "Load the weights in bf16/fp16 (torch_dtype=torch.bfloat16), or "
            "8/4-bit with bitsandbytes for inference/QLoRA", 2 * total if total else None, "about",
            "same or faster", "bf16: practically none; 8/4-bit: small, task dependent",
            "fp32 weights take 4 bytes per parameter, bf16 2, 4-bit about 0.5.", cost=1, primary=True)
    n = ctx.world or 2
    out.fix("split_model", "Split the model across GPUs: device_map=\"auto\" (accelerate) or pipeline/tensor "
            "parallelism", (4 * total - 4 * total // n) if total else None, "about",
            "slower than one big GPU (layers run one GPU after another)", _QUALITY_NONE,
            f"Each of {n} GPUs holds about 1/{n} of the layers. This is model parallelism - unlike DDP, which "
            "needs the whole model on every GPU.", cost=2, primary=True)
