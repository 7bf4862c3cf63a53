"""Small Hugging Face configs the planning tests write to a folder (no weights are read)."""
from __future__ import annotations

import json
from pathlib import Path

# A 26M-parameter Llama: big enough that sharding, LoRA and the allocator's pages show at a
# card of a few hundred MiB, small enough to trace in seconds
# (test_consistency, test_finetune_plans).
LLAMA_26M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
             "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
             "num_attention_heads": 8, "num_key_value_heads": 8,
             "max_position_embeddings": 512, "tie_word_embeddings": False}


def config_folder(root: Path, config: dict, name: str = "llama") -> str:
    """``root/name/config.json`` holding ``config``: a folder oomdoctor takes as a model."""
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)
