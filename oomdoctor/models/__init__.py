"""Model sources: what the user trains, as a :class:`~oomdoctor.models.spec.ModelSpec`.

    oomdoctor estimate sample_models/gpt2_small.py -b 8        # a model file
    oomdoctor estimate Qwen/Qwen2.5-0.5B -b 1 --seq-len 4096   # a Hugging Face id or config
    oomdoctor estimate timm:convnext_base -b 64                # a timm / torchvision name

Owns the model-file protocol (``spec``, ``loader``), the other sources (``huggingface``,
``vision``), and what turns a spec into one training configuration's model, batch, loss and
optimizer (``training``, with ``adapters`` for LoRA/QLoRA, ``checkpointing`` for
``--checkpointing``, ``optimizers`` for ``--optimizer``, ``casting`` for pure bf16).

Imports: ``oomdoctor.configs`` and torch; optional libraries (transformers, peft,
bitsandbytes, timm, torchvision, torchao) only inside the functions that need them. Nothing from
the simulator, the plans or the real runs: every later stage takes a spec.
"""
