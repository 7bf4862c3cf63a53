"""Published multi-GPU runs, rebuilt for oomdoctor (tests/test_published_multi.py and
benchmarks/published_multi.py). Each row is a command as a user would type it, and the figure
the run's authors published; ``within`` says whether the row is asserted (5%) or only reported
with its known gap.

1. torchtitan, pytorch/torchtitan PR #135 "Used per-parameter FSDP" (2024-03-13): Llama-2-7B
   shape (dim 4096, 32 layers, 32 heads, FFN 11008, vocabulary 32000), 8 x H100, local batch 8 x
   2048 tokens, FSDP2 with MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32),
   AdamW; full per-block activation checkpointing ("AC") or the per-op policy ("SAC": mm kept
   except every second one, the flash attention kept). The PR gives peak *active* memory as a
   share of 95.0396 GiB: FSDP2 AC 23.92%, SAC 52.13%. The model is torchtitan's of that commit
   (5d18bf08e: ``output = self.output(h).float()``, and train.py keeps ``pred`` through the
   backward), rebuilt as tests/models/titan_llama.py.
2. fms-acceleration (foundation-model-stack/fms-acceleration, scripts/benchmarks/refs/
   a100_80gb.csv, torch 2.4.1, transformers 4.48.1; the setup of tests/published_peft.py) on 2
   x A100-80GB with accelerate's FSDP (FULL_SHARD, per decoder layer): Mistral-7B full
   fine-tuning in pure bf16 with checkpointing, per-device batch 2 and 4 x 4096 packed tokens,
   ``max_memory_allocated`` on rank 0 (the peak is the optimizer step's in both). Its LoRA
   and QLoRA rows on the same two GPUs (batch 2 and 4) run accelerate's FSDP1 with peft's
   ``fsdp_auto_wrap_policy`` and transformers' reentrant checkpointing, typed with
   ``--fsdp-version 1`` (oomdoctor.plans.parallel.fsdp1, checked on the CPU by
   tests/test_fsdp1.py): asserted, LoRA +0.0% at both batches, QLoRA +2.9% and +3.4%. Under
   FSDP2's model they were 6-13% low (issue #31, found on a CPU rerun of FSDP1 over a fake
   process group with transformers 4.48.1 and peft 0.13.2): the decoder layers' flat
   parameters are all frozen, so FSDP1 reshards them through
   ``_register_post_backward_reshard_only_hook`` (torch/distributed/fsdp/_runtime_utils.py),
   a ``register_multi_grad_hook`` on the layer's inputs. In the reentrant recompute those are
   detached leaves, and the hook's closure keeps their AccumulateGrad nodes (the leaf and its
   ``.grad``) until the backward's final callback (``_finalize_params``) removes it: each
   finished layer leaves its input's gradient alive to the end of the backward, and the peak
   moves to layer 1's backward (fused-loss runs of the same CSV move it only 0.1 GB per sample
   on two GPUs against 0.56 on one). And the first forward runs under ``no_grad``, so no
   pre-backward hook marks the next layer for BACKWARD_PRE's prefetch: one layer gathered at
   a time. (In transformers 4.48 even the plain run keeps each layer's input to the end of the
   backward, which the trace frees; the model keeps the leaf, which shares it, as FSDP1 does in
   a plain-torch stack.)
4. DeepSpeedExamples training/bf16_master_weight (README at 516082c, PR #994; train.py at
   ac3800b rebuilt as tests/models/ds_simple_transformer.py, its configs/baseline.json as
   DS_BASELINE): ZeRO-3 with DeepSpeed's bf16 mode (16-bit model, fp32 master weights and AdamW
   state in the optimizer), ``max_memory_allocated`` per GPU since before the model was built
   (GiB: the script divides by 1024**3). train.py keeps ``logits = model_engine(input_ids)`` in
   a local through the backward and the step, until the next forward returns
   (DS_HOLD_LOGITS=1): 195 MiB of bf16 logits at 254M and micro-batch 4, which the rows missed
   (-4.8% and -8.1% before, -1.6% and -2.8% since). The 6.86B model (hidden 4096, 32 layers, 32
   heads, micro-batch 1 x 512) on 4 GPUs with activation checkpointing: 31.38 GiB, asserted
   (+0.0%; the second step's backward). Without checkpointing 41.28 GiB, reported: -19.4%
   (-24% before DeepSpeed's coordinator was replayed, oomdoctor.plans.parallel.
   zero3_coordinator, which keeps up to stage3_max_live_parameters gathered into the
   backward); 8 GiB more stay on the four GPUs than that, about half the 16-bit model, not
   found in the source. The 254M model (hidden 1024, 12 layers, 16 heads, micro-batch 4): 5.93
   GiB on one GPU and 3.57 GiB per GPU on four, asserted.
5. DeepSpeed-Chat step 1 (DeepSpeedExamples 3a77097, training_log_output/opt-1.3b-
   globalBatchSize128.log, April 2023): facebook/opt-1.3b, ZeRO-2 with fp16, micro-batch 8 x 512
   padded tokens, 16 GPUs (global batch 128 / 8), FusedAdam, eager attention: MaxMemAllocated
   22.95 GiB. Its loop (``outputs = model(**batch, use_cache=False); loss = outputs.loss``,
   no ``del``) keeps the fp16 logits, 0.38 GiB, through the backward and the step
   (``--keep-outputs``). DeepSpeed-Chat then required deepspeed>=0.9.0 (``--deepspeed 0.9.0``): its ZeRO-2
   made the 1 GB reduce bucket before the loss's backward, where since 0.18.3 the first
   gradient's hook makes it (after the logits' gradients are gone; measured on an H200,
   benchmarks/results/deepspeed/). The transformers of that run clamped OPT's attention scores with
   ``torch.max(attn_weights, finfo.min)``, which keeps another copy of every layer's scores for
   the backward (still so in 4.40.2; transformers 5's OPT has no clamp): with 4.40.2 installed
   the row is asserted (tests/test_published_multi.py, run by .ci/run's second virtualenv:
   -0.8%, -2.5% before the loop's outputs were kept); with transformers 5 it is reported, 8.9%
   low by that copy. The same log folder's step-2 reward
   model (opt-350m_globalBatchSize-64.log: OPT-350m's decoder and a value head, rebuilt as
   tests/models/dschat_reward.py; ZeRO stage 0, fp16, 16 GPUs from the global batch 64 / 4,
   4 chosen + 4 rejected sequences of 512 tokens per GPU): MaxMemAllocated 12.81 GiB, asserted
   likewise (+0.9% on 4.40.2, -10.8% on transformers 5).
3. torchtitan's Llama 3.1 8B benchmark (benchmarks/llama3_h100_202412_torchtitan.md, torchtitan
   9dec370): 8 x H100, local batch 2 x 8192 tokens, per-op checkpointing, policy bf16/fp32;
   *reserved* 82.4 GiB (the only figure published). Asserted: -0.0% since the replay keeps
   the blocks of FSDP's all-gather and reduce-scatter streams apart (reported before, when it
   replayed one stream).
6. torchtitan PR #467 ("Activation offloading", awgu, 2024-07-18; branched from 69fe8defc): its
   baseline, Llama 3 8B (torchtitan's "8B" flavour) on 8 GPUs with FSDP2 over all of them,
   local batch 1 x 8192 tokens, no activation checkpointing, ``reshard_after_forward=True``
   (torchtitan: every block but the last), the config's MixedPrecisionPolicy(bfloat16,
   float32), AdamW, no compile or float8 (the toml's defaults), no PYTORCH_CUDA_ALLOC_CONF
   (run_llama_train.sh set none then): "Reserved memory: 78.38GiB(82.48%)" (of 95.0 GiB: H100
   96 GB). Reported: the replay's reserve is 86.4 GiB (+10%). At its peak (the second step's
   first backward op, the 3.9 GiB fp32 gradient of the logits) the default stream holds 77.22
   GiB allocated in 80.0 GiB reserved, and the all-gather and reduce-scatter streams keep 6.4
   GiB cached that only they may reuse, so the published figure leaves that run at most 72 GiB
   allocated: 5 GiB less than the replay, in what it allocated, not in the allocator's reserve
   (benchmarks/results/README.md). Not found.
7. torchao's float8nocompile README (pytorch/ao d99785c0f, PR #1693; benchmarked through
   torchtitan PR #778, January 2025): Llama 3 8B on 8 H100s, batch 1 x 4096 tokens, the
   "bfloat16, eager" baseline (FSDP2 with the config's bf16/fp32 policy, no compile, no
   float8), "Peak memory (GB)" - torchtitan's logged max_reserved in GiB, as the same figures
   appear in its logs (47.65 in torchtitan PR #808 and torchao's float8 README) - with no
   activation checkpointing 53.12, every second block checkpointed ("selective per layer AC")
   40.6, every block ("full AC") 28.07. torchtitan of that week (90567fc98): loss on
   ``pred.float()`` with ``del pred`` before the backward (TITAN_8B), run_llama_train.sh
   setting expandable_segments:True. The PR's own text says "4 H100s" once beside tables
   headed "8 H100s"; the README, its later write-up, says 8 throughout. Asserted: -0.2%,
   -0.4% and -0.6%.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
TITAN = os.path.join(HERE, "models", "titan_llama.py")
GIB = 2**30

# torchtitan 5d18bf08e's llama "7B" flavour and train.py
TITAN_7B = {"TITAN_DIM": "4096", "TITAN_LAYERS": "32", "TITAN_HEADS": "32",
            "TITAN_FFN": "11008", "TITAN_VOCAB": "32000", "TITAN_SEQ": "2048",
            "TITAN_LOSS_FP32": "1", "TITAN_HOLD_PRED": "1"}
# torchtitan 9dec370's llama3 "8B" (FFN: 1.3 x 8/3 x 4096 rounded up to 1024s) and train.py
# (loss on pred.float(), `del pred` before the backward)
TITAN_8B = {"TITAN_DIM": "4096", "TITAN_LAYERS": "32", "TITAN_HEADS": "32",
            "TITAN_KV_HEADS": "8", "TITAN_FFN": "14336", "TITAN_VOCAB": "128256",
            "TITAN_SEQ": "8192", "TITAN_LOSS_FP32": "1", "TITAN_HOLD_PRED": "0"}
# DeepSpeedExamples training/bf16_master_weight/configs/baseline.json (its memory settings)
DS_BASELINE = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
               "zero_optimization": {"stage": 3, "overlap_comm": True,
                                     "contiguous_gradients": True, "reduce_bucket_size": 5e7,
                                     "stage3_param_persistence_threshold": 0}}
DS_7B = {"DS_HIDDEN": "4096", "DS_LAYERS": "32", "DS_HEADS": "32", "DS_HOLD_LOGITS": "1"}
DS_254M = {"DS_HIDDEN": "1024", "DS_LAYERS": "12", "DS_HEADS": "16", "DS_HOLD_LOGITS": "1"}
DS_SIMPLE = os.path.join(HERE, "models", "ds_simple_transformer.py")
DSCHAT_REWARD = os.path.join(HERE, "models", "dschat_reward.py")
# DeepSpeed-Chat's get_train_ds_config at 3a77097, stage 2
DS_CHAT_ZERO2 = {"train_batch_size": 128, "train_micro_batch_size_per_gpu": 8,
                 "zero_optimization": {"stage": 2, "offload_param": {"device": "none"},
                                       "offload_optimizer": {"device": "none"}},
                 "fp16": {"enabled": True, "loss_scale_window": 100}, "gradient_clipping": 1.0}
# facebook/opt-1.3b's config.json
OPT_1_3B = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_dropout": 0.0,
            "activation_function": "relu", "attention_dropout": 0.0, "bos_token_id": 2,
            "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 8192,
            "hidden_size": 2048, "init_std": 0.02, "layerdrop": 0.0,
            "max_position_embeddings": 2048, "num_attention_heads": 32,
            "num_hidden_layers": 24, "pad_token_id": 1, "torch_dtype": "float16",
            "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 2048}
FMS_LORA = ("--lora", "16", "--lora-targets", "q_proj,k_proj,v_proj,o_proj", "--lora-dropout",
            "0.1")


@dataclass(frozen=True)
class Row:
    name: str
    model: str                     # a model file, or "mistral-7b" (a config, published_peft)
    options: tuple[str, ...]
    published_bytes: int
    stat: str = "allocated"        # allocated | reserved (which peak the source published)
    env: dict = field(default_factory=dict)
    within: bool = True            # asserted within 5%; else reported with its known gap
    ds_config: dict | None = None  # a DeepSpeed run's config (--ds-config); else FSDP

    def command(self, model_path: str, root: str) -> list[str]:
        """The `parallel` command a user would type (the DeepSpeed config written to
        ``root``)."""
        if self.ds_config is None:
            return ["parallel", model_path, *self.options, "--strategy", "fsdp", "--json"]
        path = os.path.join(root, "".join(c if c.isalnum() else "_" for c in self.name)
                            + ".json")
        with open(path, "w") as f:
            json.dump(self.ds_config, f)
        return ["parallel", model_path, *self.options, "--ds-config", path, "--json"]


ROWS = (
    Row("torchtitan 7B FSDP2 bf16 AC", TITAN,
        ("--gpus", "8", "--gpu", "h100", "-b", "8", "--precision", "bf16", "--checkpointing"),
        round(0.2392 * 95.0396 * GIB), env=TITAN_7B),
    Row("torchtitan 7B FSDP2 bf16 SAC", TITAN,
        ("--gpus", "8", "--gpu", "h100", "-b", "8", "--precision", "bf16", "--checkpointing",
         "--checkpoint-policy", "op"),
        round(0.5213 * 95.0396 * GIB), env=TITAN_7B),
    Row("fms Mistral-7B full FT 2 GPUs b2", "mistral-7b",
        ("--gpus", "2", "--gpu", "a100-80", "-b", "2", "--precision", "bf16-pure",
         "--checkpointing", "--seq-len", "4096"), 36_225_939_968),
    Row("fms Mistral-7B full FT 2 GPUs b4", "mistral-7b",
        ("--gpus", "2", "--gpu", "a100-80", "-b", "4", "--precision", "bf16-pure",
         "--checkpointing", "--seq-len", "4096"), 36_226_136_576),
    Row("fms Mistral-7B LoRA 2 GPUs b2", "mistral-7b",
        ("--gpus", "2", "--gpu", "a100-80", "-b", "2", "--precision", "bf16-pure",
         "--checkpointing", "--seq-len", "4096", *FMS_LORA, "--fsdp-version", "1"),
        15_144_870_400),
    Row("fms Mistral-7B LoRA 2 GPUs b4", "mistral-7b",
        ("--gpus", "2", "--gpu", "a100-80", "-b", "4", "--precision", "bf16-pure",
         "--checkpointing", "--seq-len", "4096", *FMS_LORA, "--fsdp-version", "1"),
        21_959_827_968),
    Row("fms Mistral-7B QLoRA 2 GPUs b2", "mistral-7b",
        ("--gpus", "2", "--gpu", "a100-80", "-b", "2", "--precision", "bf16",
         "--checkpointing", "--seq-len", "4096", *FMS_LORA, "--quantize", "nf4",
         "--double-quant", "--fsdp-version", "1"), 9_424_594_432),
    Row("fms Mistral-7B QLoRA 2 GPUs b4", "mistral-7b",
        ("--gpus", "2", "--gpu", "a100-80", "-b", "4", "--precision", "bf16",
         "--checkpointing", "--seq-len", "4096", *FMS_LORA, "--quantize", "nf4",
         "--double-quant", "--fsdp-version", "1"), 15_970_067_968),
    Row("torchtitan Llama 3.1 8B SAC (reserved)", TITAN,
        ("--gpus", "8", "--gpu", "h100", "-b", "2", "--precision", "bf16", "--checkpointing",
         "--checkpoint-policy", "op"),
        round(82.4 * GIB), stat="reserved", env=TITAN_8B),
    Row("torchtitan Llama3 8B FSDP2 bf16 no AC (reserved)", TITAN,
        ("--gpus", "8", "--memory", "95.04GiB", "-b", "1", "--precision", "bf16"),
        round(78.38 * GIB), stat="reserved", env=TITAN_8B, within=False),
    *(Row(f"torchao float8nocompile Llama3 8B bf16 {label} (reserved)", TITAN,
          ("--gpus", "8", "--memory", "95.04GiB", "-b", "1", "--precision", "bf16",
           "--alloc-conf", "expandable_segments:True", *ac),
          round(gib * GIB), stat="reserved", env=dict(TITAN_8B, TITAN_SEQ="4096"))
      for label, ac, gib in (("no AC", (), 53.12),
                             ("AC every 2nd block", ("--checkpointing", "--checkpoint-every",
                                                     "2"), 40.6),
                             ("full AC", ("--checkpointing",), 28.07))),
    Row("DeepSpeed ZeRO-3 bf16 6.86B AC", DS_SIMPLE,
        ("--gpus", "4", "--gpu", "h100", "-b", "1", "--checkpointing"),
        round(31.38 * GIB), env=DS_7B, ds_config=DS_BASELINE),
    Row("DeepSpeed ZeRO-3 bf16 6.86B", DS_SIMPLE, ("--gpus", "4", "--gpu", "h100", "-b", "1"),
        round(41.28 * GIB), env=DS_7B, ds_config=DS_BASELINE, within=False),
    Row("DeepSpeed ZeRO-3 bf16 254M 1 GPU", DS_SIMPLE,
        ("--gpus", "1", "--gpu", "h100", "-b", "4"),
        round(5.93 * GIB), env=DS_254M, ds_config=DS_BASELINE),
    Row("DeepSpeed ZeRO-3 bf16 254M 4 GPUs", DS_SIMPLE,
        ("--gpus", "4", "--gpu", "h100", "-b", "4"),
        round(3.57 * GIB), env=DS_254M, ds_config=DS_BASELINE),
    Row("DeepSpeed-Chat OPT-1.3b ZeRO-2 fp16", "opt-1.3b",
        ("--gpus", "16", "--gpu", "a100-40", "-b", "8", "--seq-len", "512", "--attn", "eager",
         "--optimizer", "adamw-fused", "--deepspeed", "0.9.0", "--keep-outputs"),
        round(22.95 * GIB), ds_config=DS_CHAT_ZERO2, within=False),
    Row("DeepSpeed-Chat OPT-350m reward ZeRO-0 fp16", DSCHAT_REWARD,
        ("--gpus", "16", "--gpu", "a100-40", "-b", "4", "--deepspeed", "0.9.0"),
        round(12.81 * GIB), ds_config={**DS_CHAT_ZERO2, "train_batch_size": 64,
                                       "train_micro_batch_size_per_gpu": 4,
                                       "zero_optimization": {"stage": 0}},
        within=False),
)


def model_path(row: Row, root: str) -> str:
    """The model the row's command names: its model file, or a folder with its config.json."""
    if row.model.endswith(".py"):
        return row.model
    folder = os.path.join(root, row.model)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**_peft_configs(), "opt-1.3b": OPT_1_3B}[row.model], f)
    return folder


def _peft_configs() -> dict:
    """tests/published_peft.py's CONFIGS, loaded by path: benchmarks/ has a module of the same
    name, and either folder may come first on sys.path."""
    import importlib.util
    import sys
    name = "_tests_published_peft"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "published_peft.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module             # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name].CONFIGS


def predicted(payload: dict, row: Row) -> int:
    """The fullest GPU's peak of the row's statistic in `parallel --json`'s output."""
    [strategy] = payload["strategies"]
    return max(g[f"peak_{row.stat}_bytes"] for g in strategy["gpus"])
