"""Measure cuDNN's RNN reserve and forward workspace on a real GPU, next to oomdoctor's model.

    python benchmarks/cudnn_rnn.py             # the grid below, on cuda:0
    python benchmarks/cudnn_rnn.py --quick     # a few shapes

oomdoctor models the two sizes cuDNN answers at run time (oomdoctor/sim/rnn.py: ``reserve_bytes``
from the only two published printouts found, ``workspace_bytes`` from this script's grid on an
H200); this script checks both against measurements. For each shape it calls
``torch._cudnn_rnn`` - the op ``nn.LSTM/GRU/RNN`` reach on CUDA in training - on the module's
own flat weight buffer, so nothing else is allocated, and records:

- the reserve: the byte size of the call's fourth output, exactly;
- the forward workspace: ``max_memory_allocated`` during the call minus ``memory_allocated``
  after it (the outputs are allocated before the workspace and outlive it; RNN.cpp).

Writes benchmarks/results/cudnn_rnn/<gpu>-<torch>.json and prints each shape with the model's
figures; tests/test_rnn.py checks the model against every committed file. Without CUDA it exits
with code 2.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT_DIR = os.path.join(ROOT, "benchmarks", "results", "cudnn_rnn")
# cudnnRNNMode_t, which RNN.cpp casts the op's `mode` argument to
CUDNN_MODE = {"RNN_RELU": 0, "RNN_TANH": 1, "LSTM": 2, "GRU": 3}


def measure(mode: str, input_size: int, hidden: int, layers: int, bidirectional: bool,
            steps: int, batch: int, dtype) -> dict:
    import torch
    cls = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU}.get(mode, torch.nn.RNN)
    extra = {"nonlinearity": mode[4:].lower()} if cls is torch.nn.RNN else {}
    rnn = cls(input_size, hidden, num_layers=layers, bidirectional=bidirectional,
              **extra).to("cuda", dtype)
    rnn.flatten_parameters()
    weights = rnn._flat_weights
    storage = weights[0].untyped_storage()
    # the whole flat buffer, as RNNBase passes it (try_get_weight_buf in RNN.cpp)
    buf = weights[0].new_empty(0).set_(storage, 0, (storage.nbytes() // weights[0].element_size(),))
    directions = 2 if bidirectional else 1
    x = torch.randn(steps, batch, input_size, device="cuda", dtype=dtype)
    hx = torch.zeros(layers * directions, batch, hidden, device="cuda", dtype=dtype)
    cx = hx.clone() if mode == "LSTM" else None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = torch._cudnn_rnn(x, weights, len(weights) // (layers * directions), buf, hx, cx,
                           CUDNN_MODE[mode], hidden, 0, layers, False, 0.0, True,
                           bidirectional, [], None)
    torch.cuda.synchronize()
    workspace = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    record = {"mode": mode, "input_size": input_size, "hidden": hidden, "layers": layers,
              "directions": directions, "steps": steps, "batch": batch,
              "dtype": str(dtype).removeprefix("torch."),
              "reserve_bytes": out[3].untyped_storage().nbytes(),
              "forward_workspace_bytes": workspace}
    del out
    return record


def modelled(r: dict) -> tuple[int, int]:
    from oomdoctor.sim import rnn
    elem = 2 if r["dtype"] in ("float16", "bfloat16") else 4
    reserve = rnn.reserve_bytes(r["mode"], r["hidden"], 0, r["layers"], r["directions"],
                                r["steps"] * r["batch"], elem)
    persistent = rnn.small_h_persistent(r["mode"], r["hidden"], 0, False, elem, "forward")
    workspace = rnn.workspace_bytes(r["mode"], r["input_size"], r["hidden"], 0, r["layers"],
                                    r["directions"], r["steps"], r["batch"], elem, persistent)
    return reserve, workspace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes")
    ap.add_argument("--out", help="output file (default benchmarks/results/cudnn_rnn/...)")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print(f"cudnn_rnn.py: no CUDA GPU visible to torch {torch.__version__}; this measures "
              "cuDNN on a GPU", file=sys.stderr)
        return 2
    modes = ("LSTM", "GRU", "RNN_TANH")
    grid = itertools.product(modes, (1, 3), (256, 1024), (False, True), ((100, 16), (400, 32)),
                             (torch.float32, torch.float16))
    if args.quick:
        grid = itertools.product(modes, (2,), (512,), (False,), ((200, 16),), (torch.float32,))
    records = [measure(m, 80, h, n, bi, t, b, dt) for m, n, h, bi, (t, b), dt in grid]
    props = torch.cuda.get_device_properties(0)
    result = {"gpu": props.name, "compute_capability": [props.major, props.minor],
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "records": records}
    name = re.sub(r"[^A-Za-z0-9.]+", "-", f"{props.name}-{torch.__version__}").strip("-")
    path = args.out or os.path.join(OUT_DIR, f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{props.name}, torch {torch.__version__}, cuDNN {result['cudnn']}: {path}")
    print(f"{'shape':44} {'reserve':>14} {'model':>14} {'err':>7} {'workspace':>12} {'model':>12}")
    for r in records:
        reserve, workspace = modelled(r)
        shape = (f"{r['mode']} L{r['layers']} H{r['hidden']} D{r['directions']} "
                 f"T{r['steps']} B{r['batch']} {r['dtype']}")
        err = reserve / r["reserve_bytes"] - 1 if r["reserve_bytes"] else float("nan")
        print(f"{shape:44} {r['reserve_bytes']:14,} {reserve:14,} {err:7.1%} "
              f"{r['forward_workspace_bytes']:12,} {workspace:12,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
