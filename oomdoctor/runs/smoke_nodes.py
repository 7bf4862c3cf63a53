"""A multi-node plan run as processes on this machine: each node's ranks, over gloo, on the CPU.

    oomdoctor smoke sample_models/tiny_mlp.py --strategy hsdp --nodes 2 --num-gpus 2

Every rank gets the environment torchrun would give it on its node (RANK, LOCAL_RANK,
GROUP_RANK - the node rank -, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE, MASTER_ADDR/PORT;
torch/distributed/run.py lists them), joins one gloo process group through ``env://``, and runs
:func:`oomdoctor.runs.smoke.train_process` - DDP, ZeRO (FSDP2) or hybrid sharding on a 2-D mesh. At
its last step each rank counts the bytes of the parameters, gradients and optimizer state it
really holds (its FSDP shards, ``DTensor.to_local``) and the smoke sets them next to the plan's
per-GPU model states (:func:`oomdoctor.plans.recommend.floor_bytes`, the formula the recommendation
ranks with). Nothing crosses a network and no GPU is used: this proves the ranks, the mesh and
the sharding a plan would use, not the inter-node link or GPU memory.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import socket
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from oomdoctor.configs import param_width
from oomdoctor.models.loader import for_process, in_process
from oomdoctor.models.spec import ModelSpec
from oomdoctor.models.training import build_checked_model, make_optimizer
from oomdoctor.plans.parallel import Strategy, model_state_floor, zero_partition
from oomdoctor.runs.ranks import collect_ranks
from oomdoctor.runs.smoke import SmokeConfig, SmokeError, train_process

STATE_TOLERANCE = 0.02     # measured model states vs the plan's formula (FSDP pads dim 0)
NODE_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class RankCheck:
    """One rank: where it sits, and the model states it held against the plan's."""

    rank: int
    node_rank: int
    local_rank: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    planned_bytes: int

    @property
    def measured_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    @property
    def ok(self) -> bool:
        return abs(self.measured_bytes - self.planned_bytes) <= STATE_TOLERANCE * \
            self.planned_bytes


@dataclass(frozen=True)
class NodesSmokeResult:
    model: str
    strategy: str
    nodes: int
    gpus_per_node: int
    precision: str
    steps: int
    losses: tuple[float, ...]           # per step, averaged over ranks
    step_seconds: tuple[float, ...]     # rank 0's
    ranks: tuple[RankCheck, ...]
    env: tuple[dict[str, str], ...]     # what each rank saw, rank order
    ok: bool
    problems: tuple[str, ...]
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for r, obj in zip(d["ranks"], self.ranks):
            r["measured_bytes"] = obj.measured_bytes
            r["ok"] = obj.ok
        return d


def torchrun_env(rank: int, nodes: int, per_node: int, addr: str, port: int) -> dict[str, str]:
    """The variables torchrun sets for global rank ``rank`` (ranks are contiguous per node:
    node k runs ranks k*G .. k*G+G-1)."""
    node, local = divmod(rank, per_node)
    world = nodes * per_node
    return {"RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node),
            "ROLE_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_WORLD_SIZE": str(nodes), "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": addr, "MASTER_PORT": str(port)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t      # a DTensor's own shard


def held_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this process holds (its shards under
    FSDP). Scalar state (Adam's ``step``) is left out, as the plan's formula leaves it out."""
    seen: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        seen.setdefault(id(p), p)
    params = grads = 0
    for p in seen.values():
        local = _local(p)
        params += local.numel() * local.element_size()
        if p.grad is not None:
            g = _local(p.grad)
            grads += g.numel() * g.element_size()
    state = 0
    inner = getattr(opt, "optim", opt)           # ZeroRedundancyOptimizer wraps the local one
    for s in inner.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                v = _local(v)
                state += v.numel() * v.element_size()
    return {"parameters": params, "gradients": grads, "optimizer_state": state}


def planned_state_bytes(spec: ModelSpec, cfg: SmokeConfig, nodes: int, per_node: int
                        ) -> list[int]:
    """Each rank's model states as the plan counts them (the model built on fake tensors):
    the closed form of :func:`oomdoctor.plans.parallel.model_state_floor`, and for ZeRO-1 the whole
    parameters ZeroRedundancyOptimizer gives each rank (:func:`zero_partition`)."""
    from oomdoctor.sim.device import on_meta   # builds as the trace does

    from oomdoctor.plans.recommend.facts import _state_slots
    world = nodes * per_node
    with on_meta():
        model = build_checked_model(spec)
        slots = _state_slots(make_optimizer(spec, model))
        seen = {p.untyped_storage()._cdata: p for p in model.parameters()}
    width = param_width(cfg.precision)
    params = [p.numel() for p in seen.values()]
    trainable = [p.numel() for p in seen.values() if p.requires_grad]
    total, train = sum(params) * width, sum(trainable) * width
    if cfg.strategy == "zero1":
        owner = zero_partition(trainable, world)
        return [total + train + sum(n for n, r in zip(trainable, owner) if r == rank)
                * width * slots for rank in range(world)]
    st = Strategy(cfg.strategy, world, nodes=nodes)
    return [model_state_floor(total, train, train * slots, st)] * world


def _rank_main(source: ModelSpec | tuple, cfg: SmokeConfig, env: dict[str, str], results: Any) -> None:
    import torch.distributed as dist
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    try:
        os.environ.update(env)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="env://")
        try:
            spec = in_process(source)
            out = train_process(spec, cfg, False, rank, world,
                                on_step=(lambda i, t: results.put({"step": i, "seconds": t}))
                                if rank == 0 else None, inspect_last=held_state_bytes)
            t = torch.tensor(out["losses"] or [0.0], dtype=torch.float64)
            dist.all_reduce(t)
            out["losses"] = (t / world).tolist() if out["losses"] else []
            out["env"] = {k: os.environ[k] for k in env}
            results.put(out)
        finally:
            dist.destroy_process_group()
    except BaseException as e:          # report any failure to the parent, never hang it
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc()})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(spec: ModelSpec, cfg: SmokeConfig, nodes: int, per_node: int,
              progress: Progress = lambda _: None) -> list[dict[str, Any]]:
    """Start nodes x per_node processes with torchrun's per-rank environment; their results,
    rank order."""
    world = nodes * per_node
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    results = ctx.Queue()
    port = _free_port()
    source = for_process(spec, method)
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(source, cfg, torchrun_env(r, nodes, per_node, "127.0.0.1",
                                                            port), results))
             for r in range(world)]
    for p in procs:
        p.start()
    return collect_ranks(
        procs, results, world, cfg.timeout_s,
        lambda msg: progress(f"step {msg['step']}/{cfg.steps}: {msg['seconds']:.2f} s"),
        lambda done: (f"{cfg.strategy} over {nodes} nodes x {per_node} timed out after "
                      f"{cfg.timeout_s:.0f} s with {done} of {world} ranks done (gloo "
                      "rendezvous or a hang in the model)"), SmokeError)


def run_nodes_smoke(spec: ModelSpec, cfg: SmokeConfig, nodes: int, per_node: int,
                    progress: Progress = lambda _: None) -> NodesSmokeResult:
    """Run the plan as nodes x per_node gloo processes; judge the loss and each rank's model
    states against the plan's (:func:`planned_state_bytes`)."""
    if cfg.strategy not in NODE_STRATEGIES:
        raise ValueError(f"--nodes runs one process per GPU: --strategy {cfg.strategy} does not "
                         f"(choose one of {', '.join(NODE_STRATEGIES)})")
    progress(f"smoke: {nodes} nodes x {per_node} GPU(s) as {nodes * per_node} gloo processes "
             "on this machine's CPU")
    planned = planned_state_bytes(spec, cfg, nodes, per_node)
    outs = run_ranks(spec, cfg, nodes, per_node, progress)
    ranks = []
    for o in outs:
        held = o["inspect"]
        node, local = divmod(o["rank"], per_node)
        ranks.append(RankCheck(o["rank"], node, local, held["parameters"], held["gradients"],
                               held["optimizer_state"], planned[o["rank"]]))
    losses = tuple(outs[0]["losses"])
    problems = [f"rank {r.rank} (node {r.node_rank}): holds {r.measured_bytes:,} B of model "
                f"states, the plan says {r.planned_bytes:,} B" for r in ranks if not r.ok]
    if not all(math.isfinite(x) for x in losses):
        problems.append(f"loss is not finite: {', '.join(f'{x:.4g}' for x in losses)}")
    elif len(losses) >= 2 and losses[-1] == losses[0]:
        problems.append(f"loss did not change over {len(losses)} steps ({losses[0]:.6g})")
    notes = ("no GPU and no network: the ranks ran as processes on this CPU over gloo; the "
             "inter-node link and GPU memory were not exercised",
             f"micro-batch {outs[0]['batch']} per rank on the CPU")
    return NodesSmokeResult(spec.name, cfg.strategy, nodes, per_node, cfg.precision, cfg.steps,
                            losses, tuple(outs[0]["times"]), tuple(ranks),
                            tuple(o["env"] for o in outs), not problems, tuple(problems),
                            notes)


def render_text(r: NodesSmokeResult) -> str:
    from tabulate import tabulate
    verdict = "SMOKE PASSED" if r.ok else "SMOKE FAILED"
    lines = [f"{verdict}: {r.model}, {r.strategy} on {r.nodes} nodes x {r.gpus_per_node}, "
             f"{r.precision}, {r.steps} steps as {len(r.ranks)} gloo processes", ""]
    rows = [(i + 1, f"{loss:.5g}", f"{t * 1000:.1f}")
            for i, (loss, t) in enumerate(zip(r.losses, r.step_seconds))]
    lines += [tabulate(rows, headers=("step", "loss", "ms"), colalign=("right",) * 3), ""]
    rows = [(c.rank, c.node_rank, c.local_rank, f"{c.parameter_bytes:,}",
             f"{c.gradient_bytes:,}", f"{c.optimizer_state_bytes:,}",
             f"{c.planned_bytes:,}", "ok" if c.ok else "OFF") for c in r.ranks]
    lines.append(tabulate(rows, headers=("RANK", "GROUP_RANK", "LOCAL_RANK", "params B",
                                         "grads B", "optim B", "plan B",
                                         f"within {STATE_TOLERANCE:.0%}")))
    lines += [""] + [f"PROBLEM: {p}" for p in r.problems] + [f"note: {n}" for n in r.notes]
    return "\n".join(lines).rstrip()
