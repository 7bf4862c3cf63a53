"""One process over two GPUs, as users write it: a model file's network trained with
DataParallel (`--spread dp`) or split with accelerate's dispatch_model at a cut (`--spread split
--cut N`: the blocks before the N-th layer on GPU 0, the rest on GPU 1).

    CUDA_VISIBLE_DEVICES=0,1 oomdoctor estimate -- python tests/scripts/spread_loop.py \
        --model tests/models/plan_lm.py --spread dp --batch-size 16
"""
import argparse
import importlib.util
import json

import torch
from torch.utils.data import DataLoader, TensorDataset


def load(path):
    spec = importlib.util.spec_from_file_location("model_file", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def split_map(model, cut):
    """embed and layers before `cut` on GPU 0; the rest on GPU 1."""
    names = [n for n, _ in model.named_children()]
    dmap = {}
    for name in names:
        if name == "layers":
            dmap.update({f"layers.{i}": int(i >= cut) for i in range(len(model.layers))})
        else:
            dmap[name] = 0 if name == names[0] else 1
    return dmap


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--spread", choices=["none", "dp", "split"], default="none")
    parser.add_argument("--cut", type=int, default=2)
    parser.add_argument("--map", default="", help="a device map as JSON (instead of --cut)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    mod = load(args.model)
    model = mod.build_model()
    data = TensorDataset(*mod.make_batch(4 * args.batch_size))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    device = torch.device("cuda", 0)
    if args.spread == "dp":
        model = torch.nn.DataParallel(model.to(device))
    elif args.spread == "split":
        from accelerate import dispatch_model
        dmap = json.loads(args.map) if args.map else split_map(model, args.cut)
        model = dispatch_model(model, device_map=dmap, main_device=1)
        device = torch.device("cuda", 1)
    else:
        model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step, batch in enumerate(loader):
        batch = [t.to(device) for t in batch]
        loss = mod.loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step + 1 == args.steps:
            break


if __name__ == "__main__":
    main()
