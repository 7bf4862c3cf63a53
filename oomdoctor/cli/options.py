"""What the commands share: option decorators, card and allocator parsing, errors, progress."""
from __future__ import annotations

import json
import sys

import click

from oomdoctor.cli.group import EXIT_USAGE
from oomdoctor.sim.allocator import AllocatorConfig
from oomdoctor.configs import (ATTENTIONS, CHECKPOINT_POLICIES, OPTIMIZERS, QUANTIZATIONS, TASKS,
                               WEIGHTS_DTYPES, ZERO_GRAD_MODES)
from oomdoctor.sim.gpus import PROFILES, card_for_arch, custom_profile, get_profile, parse_size


def _die(e: BaseException, debug: bool, code: int) -> None:
    """One line on stderr (what, why, fix) and the exit code; the traceback only with --debug."""
    if debug:
        import traceback
        traceback.print_exception(e)
    click.echo(f"error: {e}" + ("" if debug else " (--debug for the traceback)"), err=True)
    sys.exit(code)


def _progress(msg: str) -> None:
    click.echo(msg, err=True)


_SOURCE = "oomdoctor.source"          # ctx.meta key: --task / --seq-len for load_model


def _remember(ctx: click.Context, param: click.Parameter, value):
    ctx.meta.setdefault(_SOURCE, {})[param.name] = value
    return value


class _SeqLen(click.ParamType):
    """A token count, or "max" (probe: search for the longest that fits)."""
    name = "N|max"

    def convert(self, value, param, ctx):
        if value == "max" or isinstance(value, int):
            return value
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            self.fail(f"{value!r} is not a token count >= 1 or 'max'", param, ctx)
        return n


def _source_options(f):
    """--task and --seq-len (how to build a Hugging Face model given by id or config),
    --image-size and --num-classes (a timm/torchvision model by name) and
    --lora/--quantize (how the model is fine-tuned). They are kept in the context (not passed
    to every command function) and read by _load_model."""
    for opt in reversed([
        click.option("--torch", "torch_release", metavar="VERSION", expose_value=False,
                     callback=_remember_torch, is_eager=True,
                     help="The torch release the training runs, e.g. 2.1 or 2.4.1+rocm6.0: "
                          "its CUDA facts (foreach default, zero_grad, fused attention, BLAS "
                          "workspaces; docs/simulator.md) instead of the installed torch's."),
        click.option("--task", type=click.Choice(TASKS),
                     expose_value=False, callback=_remember, is_eager=True,
                     help="For a Hugging Face id or config: the head to train (default: from "
                          "the config's architectures)."),
        click.option("--seq-len", type=_SeqLen(), expose_value=False,
                     callback=_remember, is_eager=True,
                     help="For a Hugging Face id or config: tokens per sequence (default 1024, "
                          "at most the model's max_position_embeddings); `probe --seq-len max` "
                          "finds the longest that fits."),
        click.option("--attn", type=click.Choice(ATTENTIONS), expose_value=False,
                     callback=_remember, is_eager=True,
                     help="For a Hugging Face id or config: transformers' attention "
                          "implementation (attn_implementation; default sdpa where the "
                          "architecture has it, else eager). eager keeps every layer's "
                          "attention probabilities for the backward."),
        click.option("--weights-dtype", type=click.Choice(list(WEIGHTS_DTYPES)),
                     expose_value=False, callback=_remember, is_eager=True,
                     help="For a Hugging Face id or config: the dtype its weights load in "
                          "(default: what the installed transformers' from_pretrained loads - "
                          "the config's dtype since 5.0, float32 before; auto: the config's)."),
        click.option("--image-size", type=click.IntRange(1), metavar="PIXELS",
                     expose_value=False, callback=_remember, is_eager=True,
                     help="For timm:NAME / torchvision:NAME or a Hugging Face image classifier: "
                          "image height and width (default: the model's own, usually 224)."),
        click.option("--num-classes", type=click.IntRange(1), metavar="N",
                     expose_value=False, callback=_remember, is_eager=True,
                     help="For timm:NAME / torchvision:NAME or a Hugging Face image classifier: "
                          "classes of the head to train (default: the model's, 1000 for "
                          "ImageNet)."),
        click.option("--lora", "lora_rank", type=click.IntRange(1), metavar="RANK",
                     expose_value=False, callback=_remember, is_eager=True,
                     help="Train LoRA adapters of this rank (peft) on the frozen model; under "
                          "fp16/bf16 AMP the frozen weights are 16-bit, as LoRA recipes load "
                          "them. Alpha scales the update, not memory."),
        click.option("--lora-targets", metavar="NAMES", expose_value=False,
                     callback=_remember, is_eager=True,
                     help="Comma-separated module names for LoRA, e.g. q_proj,v_proj (default: "
                          "peft's for the architecture, else every nn.Linear)."),
        click.option("--lora-dropout", type=click.FloatRange(0, 1, max_open=True),
                     default=0.0, expose_value=False, callback=_remember, is_eager=True,
                     help="LoRA dropout (peft's default 0; recipes often use 0.05)."),
        click.option("--quantize", type=click.Choice(QUANTIZATIONS), expose_value=False,
                     callback=_remember, is_eager=True,
                     help="Store the frozen linear layers 4-bit (nf4, fp4: QLoRA with --lora; "
                          "they compute in the AMP dtype) or 8-bit (int8: LLM.int8, "
                          "load_in_8bit) with bitsandbytes."),
        click.option("--keep-outputs", is_flag=True, expose_value=False, callback=_remember,
                     is_eager=True,
                     help="The loop keeps the previous step's outputs and loss alive through "
                          "the next forward (`outputs = model(**batch)` without `del outputs, "
                          "loss`), as KEEP_OUTPUTS = True in a model file does."),
        click.option("--double-quant", is_flag=True, expose_value=False, callback=_remember,
                     is_eager=True,
                     help="With --quantize: quantize the 4-bit weights' scales too "
                          "(bnb_4bit_use_double_quant, about 0.37 bit per parameter less)."),
    ]):
        f = opt(f)
    return f


def _load_model(source: str, longest: bool = False):
    """The model a command was given: a model file, or a Hugging Face id / config folder /
    config.json with the --task and --seq-len of this command line, or timm:/torchvision:NAME
    with its --image-size and --num-classes."""
    from oomdoctor.models.loader import load_model
    ctx = click.get_current_context(silent=True)
    opts = (ctx.meta.get(_SOURCE, {}) if ctx is not None else {})
    seq_len = opts.get("seq_len")
    if seq_len == "max":
        if not longest:
            raise click.UsageError("--seq-len max is for `oomdoctor probe` (the longest "
                                   "context that fits); give a token count here")
        seq_len = None
    return load_model(source, task=opts.get("task"), seq_len=seq_len, adapters=_adapters(opts),
                      image_size=opts.get("image_size"), num_classes=opts.get("num_classes"),
                      keep_outputs=bool(opts.get("keep_outputs")), attn=opts.get("attn"),
                      weights_dtype=opts.get("weights_dtype"))


def _wants_longest_context() -> bool:
    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.meta.get(_SOURCE, {}).get("seq_len") == "max"


def _adapters(opts: dict):
    """--lora / --quantize as an Adapters, or None when neither is given."""
    if not opts.get("lora_rank") and not opts.get("quantize"):
        if opts.get("lora_targets") or opts.get("double_quant") or opts.get("lora_dropout"):
            raise click.UsageError("--lora-targets, --lora-dropout and --double-quant go with "
                                   "--lora RANK or --quantize")
        return None
    if not opts.get("lora_rank"):
        raise click.UsageError("--quantize alone leaves nothing to train (quantized weights "
                               "are frozen); add --lora RANK for QLoRA")
    from oomdoctor.models.adapters import Adapters
    targets = opts.get("lora_targets")
    return Adapters(lora_rank=opts["lora_rank"],
                    lora_targets=tuple(t.strip() for t in targets.split(",") if t.strip())
                    if targets else None,
                    lora_dropout=opts.get("lora_dropout") or 0.0,
                    quantize=opts.get("quantize"), double_quant=bool(opts.get("double_quant")))


def _budget_options(f):
    """Options shared by estimate and probe: the card, the model's configuration, output."""
    opts = [
        click.option("--gpu", "gpu_name", metavar="NAME",
                     help=f"GPU profile: {', '.join(PROFILES)} (default: the local CUDA or "
                          "ROCm GPU, else rtx3090)."),
        click.option("--memory", metavar="SIZE",
                     help="Any card by its capacity, e.g. 24GiB (IEC units)."),
        click.option("--arch", metavar="smXY|gfxNNN", expose_value=False,
                     callback=_remember_arch,
                     help="With --memory: the card's architecture (sm75, sm86, sm89, sm90, ...; "
                          "AMD: gfx90a, gfx942, ...), which decides bf16, the attention kernel "
                          "and the BLAS workspace (default sm80)."),
        click.option("--overhead", metavar="SIZE",
                     help="CUDA context outside the allocator (default: the profile's, "
                          "about 400MiB)."),
        click.option("--other", "other_mem", metavar="SIZE", default="0",
                     help="Memory other processes hold on the card."),
        click.option("--margin", default="5%", show_default=True,
                     help="Safety margin, a share of the capacity."),
        click.option("--alloc-conf", envvar="PYTORCH_CUDA_ALLOC_CONF", default="",
                     help="PYTORCH_CUDA_ALLOC_CONF to simulate, e.g. expandable_segments:True "
                          "(default: the environment variable)."),
        click.option("--checkpoint-class", metavar="NAME[,NAME]",
                     help="Module classes to checkpoint (default: the repeated block; an "
                          "encoder-decoder's two layer classes)."),
        *_checkpoint_granularity_options(),
        click.option("--grad-accum", default=1, show_default=True, type=click.IntRange(1),
                     help="Micro-batches per optimizer step."),
        click.option("--optimizer", type=click.Choice(list(OPTIMIZERS)),
                     help="Override the model file's optimizer (default: its make_optimizer, "
                          "else AdamW)."),
        click.option("--zero-grad", type=click.Choice(ZERO_GRAD_MODES), default=None,
                     callback=_zero_grad_default,
                     help="When the loop drops gradients: after-step (zero_grad(set_to_none="
                          "True) after step; the default), after-forward (zero_grad between "
                          "forward and backward: gradients live through the forward), in-place "
                          "(set_to_none=False: gradients never freed; the default with --torch "
                          "before 2.0)."),
        click.option("--no-cuda-emulation", is_flag=True,
                     help="Trace as the CPU runs (CPU kernels, for-loop optimizer): for checks "
                          "against a real CPU run."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON (bytes as ints)."),
        click.option("--debug", is_flag=True, help="Show tracebacks."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return _source_options(f)


def _card_options(f):
    """The card and the allocator, for the multi-GPU commands."""
    opts = [
        click.option("--gpu", "gpu_name", metavar="NAME",
                     help="GPU profile, e.g. rtx3090 (default: the local CUDA GPU, else "
                          "rtx3090)."),
        click.option("--memory", metavar="SIZE", help="Any card by its capacity, e.g. 24GiB."),
        click.option("--num-gpus", "--gpus", "num_gpus", type=click.IntRange(1), default=None,
                     help="GPUs (default: the local count, else 2)."),
        click.option("--overhead", metavar="SIZE",
                     help="CUDA context outside the allocator (default: the profile's)."),
        click.option("--other", "other_mem", metavar="SIZE", default="0",
                     help="Memory other processes hold on each card."),
        click.option("--margin", default="5%", show_default=True,
                     help="Safety margin, a share of the capacity."),
        click.option("--alloc-conf", envvar="PYTORCH_CUDA_ALLOC_CONF", default="",
                     help="PYTORCH_CUDA_ALLOC_CONF to simulate (default: the environment)."),
        click.option("--checkpoint-class", metavar="NAME[,NAME]",
                     help="Module classes to checkpoint (default: the repeated block; an "
                          "encoder-decoder's two layer classes)."),
        *_checkpoint_granularity_options(),
        click.option("--optimizer", type=click.Choice(list(OPTIMIZERS)),
                     help="Override the model file's optimizer."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON (bytes as ints)."),
        click.option("--debug", is_flag=True, help="Show tracebacks."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return _source_options(f)


_CHECKPOINT = "oomdoctor.checkpoint"  # ctx.meta key: --checkpoint-every, --checkpoint-policy


def _remember_checkpoint(ctx: click.Context, param: click.Parameter, value):
    ctx.meta.setdefault(_CHECKPOINT, {})[param.name] = value
    return value


def _checkpoint_granularity_options() -> list:
    """--checkpoint-every and --checkpoint-policy: how --checkpointing checkpoints (read with
    :func:`_checkpoint_config`, so that every command that checkpoints takes them alike)."""
    return [
        click.option("--checkpoint-every", type=click.IntRange(1), default=1, metavar="N",
                     show_default=True, expose_value=False, callback=_remember_checkpoint,
                     help="With checkpointing: wrap every N-th block only, the N-th, 2N-th, "
                          "... counted from 1 (torchtitan's selective_ac_option \"N\")."),
        click.option("--checkpoint-policy", type=click.Choice(CHECKPOINT_POLICIES),
                     default="full", show_default=True, expose_value=False,
                     callback=_remember_checkpoint,
                     help="With checkpointing: full recomputes each wrapped block; op keeps "
                          "the outputs of matmuls (every second one recomputed), attention "
                          "and max, and recomputes the rest (torchtitan's selective \"op\" "
                          "policy, torch's create_selective_checkpoint_contexts)."),
    ]


def _checkpoint_config(checkpointing: "bool | None" = None) -> dict:
    """TraceConfig's checkpoint_every and checkpoint_policy from the command line. A
    granularity with checkpointing off (``checkpointing`` False) is a usage error."""
    ctx = click.get_current_context(silent=True)
    got = ctx.meta.get(_CHECKPOINT, {}) if ctx is not None else {}
    cfg = {"checkpoint_every": got.get("checkpoint_every") or 1,
           "checkpoint_policy": got.get("checkpoint_policy") or "full"}
    if checkpointing is False and cfg != {"checkpoint_every": 1, "checkpoint_policy": "full"}:
        raise click.UsageError("--checkpoint-every and --checkpoint-policy say how "
                               "checkpointing wraps the blocks, and checkpointing is off: "
                               "add --checkpointing")
    return cfg


_TORCH = "oomdoctor.torch"           # ctx.meta key: --torch, a sim.versions.TorchVersion


def _remember_torch(ctx: click.Context, param: click.Parameter, value):
    from oomdoctor.sim.versions import parse_version
    if value is not None:
        try:
            ctx.meta[_TORCH] = parse_version(value)
        except ValueError as e:
            _die(e, False, EXIT_USAGE)
    return value


def _modelled_torch():
    """--torch as a TorchVersion, or None (the installed torch)."""
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get(_TORCH) if ctx is not None else None


def _torch_config() -> dict:
    """TraceConfig's torch and zero_grad for a command without --zero-grad: the modelled
    release and the loop its `optimizer.zero_grad()` makes."""
    from oomdoctor.sim.versions import default_zero_grad
    version = _modelled_torch()
    return {"torch": version, "zero_grad": default_zero_grad(version)}


def _zero_grad_default(ctx: click.Context, param: click.Parameter, value):
    """--zero-grad, or the loop `optimizer.zero_grad()` makes in the modelled release."""
    if value is not None:
        return value
    from oomdoctor.sim.versions import default_zero_grad
    return default_zero_grad(ctx.meta.get(_TORCH))


_ARCH = "oomdoctor.arch"             # ctx.meta key: --arch, read by _make_budget


def _remember_arch(ctx: click.Context, param: click.Parameter, value):
    ctx.meta[_ARCH] = value
    return value


def _make_budget(gpu_name, memory, overhead, other_mem, margin):
    from oomdoctor.plans.estimate import Budget
    ctx = click.get_current_context(silent=True)
    arch = ctx.meta.get(_ARCH) if ctx is not None else None
    try:
        if gpu_name and memory:
            raise ValueError("give --gpu or --memory, not both")
        if arch and not memory:
            raise ValueError("--arch goes with --memory (a --gpu profile, or the local GPU, "
                             "has its own architecture)")
        if memory:
            gpu = card_for_arch(_card_size(memory), arch)
        elif gpu_name:
            gpu = _profile_or_suggest(gpu_name)
        else:
            gpu = _local_gpu()
        frac = _share(margin, "--margin")
        overhead_bytes = _option_size(overhead, "--overhead") if overhead else None
        other = _option_size(other_mem, "--other")
        context = gpu.context_bytes if overhead_bytes is None else overhead_bytes
        if other and other + context >= gpu.total_bytes:
            raise ValueError(
                f"--other {other_mem} and the CUDA context ({context / 2**20:.0f} MiB) are more "
                f"than the {gpu.total_bytes / 2**30:.2f} GiB card; give what other processes "
                "hold on it (nvidia-smi's process list, or `oomdoctor gpus`)")
        return Budget(gpu, frac, overhead_bytes, other)
    except ValueError as e:
        raise click.UsageError(str(e)) from e


def _profile_or_suggest(name: str):
    """get_profile, with the closest known names in the error when NAME is unknown (rtx309 -> rtx3090)."""
    import difflib
    try:
        return get_profile(name)
    except ValueError as e:
        key = name.lower().replace("_", "-").replace(" ", "")
        close = difflib.get_close_matches(key, list(PROFILES), n=3, cutoff=0.6)
        if not close:
            raise
        raise ValueError(f"unknown GPU {name!r}; did you mean {' or '.join(close)}? (--gpu takes one of: "
                         f"{', '.join(PROFILES)}; or give --memory 24GiB for any card)") from e


_MIN_CARD = 2**20     # below 1 MiB --memory is a typo (the tests plan for 40MiB toy cards)


def _option_size(text: str, option: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise ValueError(f"{option} {text}: {e}") from None


def _card_size(text: str) -> int:
    """--memory: a capacity with its unit; a bare number is refused rather than read as bytes."""
    if text.strip().replace(".", "", 1).isdigit():
        raise ValueError(f"--memory {text}: give a unit, e.g. --memory {text.strip()}GiB")
    size = _option_size(text, "--memory")
    if size < _MIN_CARD:
        raise ValueError(f"--memory {text} is less than any GPU has; write the card's "
                         "capacity, e.g. 24GiB")
    return size


def _share(text: str, option: str) -> float:
    """'5%', '0.05' or '5' -> 0.05; anything else is a usage error that shows the form."""
    t = text.strip()
    try:
        value = float(t.rstrip("%"))
    except ValueError:
        raise ValueError(f"{option} {text}: write a share of the capacity, e.g. 5% or "
                         "0.05") from None
    frac = value / 100 if t.endswith("%") or value >= 1 else value
    if not 0 <= frac < 1:
        raise ValueError(f"{option} {text} must be between 0% and 100%")
    return frac


def _slow_trace_progress(quiet_s: float = 3.0, every_s: float = 2.0):
    """A progress callback for one trace: silent for the first ``quiet_s`` seconds (most
    estimates finish sooner), then where the trace is, at most every ``every_s`` seconds."""
    import time
    start = time.monotonic()
    last = [start]

    def progress(msg: str) -> None:
        now = time.monotonic()
        if now - start >= quiet_s and now - last[0] >= every_s:
            last[0] = now
            click.echo(f"tracing: {msg} ({now - start:.0f} s)", err=True)
    return progress


def _local_gpu():
    """The first CUDA GPU if torch sees one, else the users' typical card, said on stderr."""
    import torch
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        # ROCm builds name the target (gcnArchName "gfx90a:sramecc+:xnack-"); CUDA builds do not.
        gfx = (getattr(props, "gcnArchName", "") or "").split(":")[0] if torch.version.hip else ""
        for p in PROFILES.values():
            if abs(p.total_bytes - props.total_memory) < 2**30 and p.arch == gfx and \
                    p.compute_capability == (props.major, props.minor):
                return p
        if gfx:
            try:
                return card_for_arch(props.total_memory, gfx)
            except ValueError:
                pass            # a target oomdoctor does not know: plan as a CUDA card
        return custom_profile(props.total_memory, props.major >= 8, (props.major, props.minor))
    click.echo("no CUDA GPU here: planning for an rtx3090 (24 GiB); pass --gpu NAME or "
               "--memory SIZE for another card", err=True)
    return get_profile("rtx3090")


def _alloc_config(value: str) -> AllocatorConfig:
    try:
        return AllocatorConfig.from_env(value) if value else AllocatorConfig()
    except ValueError as e:
        raise click.UsageError(f"--alloc-conf: {e}") from e


def _num_gpus(num_gpus):
    """--num-gpus, else the local CUDA count, else the users' two cards (said on stderr)."""
    if num_gpus:
        return num_gpus
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        return torch.cuda.device_count()
    click.echo("planning for 2 GPUs; pass --num-gpus N for another count", err=True)
    return 2


def _detect_gpus(gpu_name, memory, num_gpus):
    """This machine's CUDA GPUs as (profile, count, link), or None: only when the hardware was
    not given (a named card or count means planning for other hardware)."""
    if gpu_name or memory or num_gpus:
        return None
    from oomdoctor.plans import recommend as rec
    return rec.detect_hardware()


def _check_plot_file(path: str) -> None:
    """--plot, before minutes of tracing: a known format, and matplotlib there to draw it."""
    from oomdoctor.configs import install_hint
    from oomdoctor.plans.figures import plot_format
    try:
        plot_format(path)
    except ValueError:
        raise click.UsageError(f"--plot {path}: end the file name in .png, .svg or .html") \
            from None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.UsageError("--plot needs matplotlib, which is not installed: "
                               f"{install_hint('plot')}, or drop --plot") from None


def _write_bar_plot(bars, path: str, title: str, debug: bool) -> dict:
    """Write a probe or recommend bar chart; what --json reports under "plot"."""
    from oomdoctor.plans.barplot import write_bars
    try:
        write_bars(bars, path, title)
    except OSError as e:
        _die(RuntimeError(f"cannot write the plot {path}: {e.strerror or e}; pass a writable "
                          "--plot FILE"), debug, EXIT_USAGE)
    click.echo(f"wrote {path}", err=True)
    return {"path": path, "bars": [{"label": label.replace("\n", " "), "reserved_bytes": t,
                                    "note": n.replace("\n", " "), "fits": f}
                                   for label, t, n, f in zip(bars.labels, bars.totals,
                                                             bars.notes, bars.fits)],
            "budget_bytes": bars.budget_bytes}


def _mp_policy_option(f):
    """--mp-policy/--no-mp-policy: how bf16 runs under zero3 (FSDP)."""
    return click.option(
        "--mp-policy/--no-mp-policy", "mp_policy", default=None,
        help="How --precision bf16 runs under zero3/fsdp. Default (--mp-policy): as FSDP2's "
             "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), "
             "the bf16 of torchtitan, accelerate's FSDP plugin and the Trainer's fsdp + bf16: "
             "fp32 parameters, gradients and AdamW state sharded, each block gathered and "
             "computed in bf16. --no-mp-policy: torch.autocast over gathered fp32 weights.")(f)


def _cpu_offload_option(f):
    """--cpu-offload: FSDP2's CPUOffloadPolicy, on every command that plans FSDP."""
    return click.option(
        "--cpu-offload", is_flag=True,
        help="FSDP (zero3) under FSDP2's CPUOffloadPolicy: parameters, gradients and the "
             "optimizer on the host, each block copied to the GPU as it runs. DeepSpeed's "
             "offload: its config's offload_optimizer/offload_param (--ds-config).")(f)


def _cpu_offload(cpu_offload: bool, strategies) -> bool:
    """--cpu-offload is FSDP's: it needs zero3 among ``strategies`` (empty: all)."""
    if cpu_offload and strategies and not {"zero3", "fsdp"} & set(strategies):
        raise click.UsageError("--cpu-offload is FSDP2's CPUOffloadPolicy: use it with "
                               "--strategy fsdp (zero3); DeepSpeed's offload is set in "
                               "--ds-config")
    return cpu_offload


def _mp_policy(mp_policy: bool | None, precision: str, strategies) -> bool:
    """Whether zero3 (fsdp) runs bf16 under FSDP2's MixedPrecisionPolicy: by default wherever
    bf16 meets zero3, as the frameworks do; ``strategies``: those the command estimates (empty:
    all of them)."""
    fsdp = not strategies or bool({"zero3", "fsdp"} & set(strategies))
    if mp_policy is None:
        return precision == "bf16" and fsdp
    if not mp_policy:
        return False
    if not fsdp:
        raise click.UsageError("--mp-policy is FSDP2's MixedPrecisionPolicy: use it with "
                               "--strategy fsdp (zero3)")
    if precision != "bf16":
        raise click.UsageError("--mp-policy models FSDP2's bf16 MixedPrecisionPolicy: use it "
                               "with --precision bf16")
    return True


def _fsdp_version_option(f):
    """--fsdp-version 1|2: which FSDP zero3 (fsdp) models."""
    return click.option(
        "--fsdp-version", "fsdp_version", type=click.Choice(["1", "2"]), default="2",
        show_default=True,
        help="Which FSDP --strategy fsdp (zero3) means. 2: fully_shard (torchtitan, the "
             "default). 1: FullyShardedDataParallel (FULL_SHARD, a unit per block, BACKWARD_PRE, "
             "use_orig_params) as accelerate's FSDP plugin and the Trainer run it; with "
             "--checkpointing, transformers' reentrant checkpointing is assumed.")(f)


def _fsdp_version(fsdp_version: str, strategies) -> int:
    """The FSDP version zero3 is estimated as; 1 needs zero3 among ``strategies`` (empty:
    all)."""
    version = int(fsdp_version)
    if version == 1 and strategies and not {"zero3", "fsdp"} & set(strategies):
        raise click.UsageError("--fsdp-version 1 is FSDP1's FULL_SHARD: use it with "
                               "--strategy fsdp (zero3)")
    return version


def _bucket_view_option(f):
    """--bucket-view: DDP's gradient_as_bucket_view=True, on every command that plans DDP."""
    return click.option(
        "--bucket-view", is_flag=True,
        help="DDP with gradient_as_bucket_view=True (no second copy of the gradients).")(f)


# GPU-to-GPU links (oomdoctor.plans.recommend.LINKS; spelled out so --help never imports torch)
LINKS = ("pcie-no-p2p", "pcie", "nvlink")


def _link_option(f):
    """--link: the GPU-to-GPU link every command that plans several GPUs assumes."""
    return click.option(
        "--link", type=click.Choice(LINKS),
        help="GPU-to-GPU link (default: detected, else pcie-no-p2p for GeForce cards, whose "
             "boards report P2P 'Not Supported'; --link nvlink for a bridged pair).")(f)

