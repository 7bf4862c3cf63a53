"""A DeepSpeed training script as DeepSpeedExamples' training/bf16_master_weight/train.py is
written: the model built on the host, `deepspeed.initialize(model, model_parameters, config)`,
then cross-entropy on `engine(ids)`, backward, `engine.step()` (the loss taken on the logits
inline, as benchmarks/measure_deepspeed.py's harness measured it; train.py itself keeps
`logits` in a local through the backward, tests/published_multi.py). The model is that
benchmark's transformer (tests/models/ds_simple_transformer.py, sizes from DS_HIDDEN/DS_LAYERS/
DS_HEADS); the config a JSON file, as the launcher passes it:

    oomdoctor estimate --gpu h200 -- deepspeed --num_gpus 1 tests/scripts/ds_train.py \
        --deepspeed_config ds.json --batch-size 4
"""
import argparse
import importlib.util
import os

import deepspeed
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "ds_simple_transformer", os.path.join(HERE, "..", "models", "ds_simple_transformer.py"))
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)


def checkpointed(model):
    """train.py's --activation_checkpointing: each block through checkpoint()."""
    def forward(input_ids):
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, -1)
        x = model.embedding(input_ids) + model.pos_embedding(positions)
        for layer in model.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return model.output_proj(x)
    model.forward = forward
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engine-backward", action="store_true",
                        help="engine.backward(loss) (fp16's loss scaler, stage 0)")
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    deepspeed.init_distributed()
    model = mod.Model()
    if args.activation_checkpointing:
        model = checkpointed(model)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model,
                                           model_parameters=model.parameters())
    engine.train()
    device = torch.device("cuda", args.local_rank)
    for step in range(args.steps * engine.gradient_accumulation_steps()):
        ids = torch.randint(0, mod.VOCAB, (args.batch_size, mod.SEQ), device=device)
        labels = torch.randint(0, mod.VOCAB, (args.batch_size, mod.SEQ), device=device)
        loss = F.cross_entropy(engine(ids).view(-1, mod.VOCAB), labels.view(-1))
        if args.engine_backward:
            engine.backward(loss)
        else:
            loss.backward()
        engine.step()


if __name__ == "__main__":
    main()
