"""Step time across nodes: ring collectives whose slowest hop is the link between machines.

    oomdoctor recommend model.py --nodes 2 --num-gpus 2 --inter-node-link ethernet

A ring all-reduce of S bytes over n ranks sends 2(n-1)/n x S bytes through every link of the
ring (reduce-scatter then all-gather, each (n-1)/n x S; Patarasuk and Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009; NCCL's nccl-tests
doc/PERFORMANCE.md uses the same 2(n-1)/n factor for its "bus bandwidth"). A ring that spans
machines crosses the inter-node link, so its time is set by the slower of the GPU link inside
a node and the port between nodes. Hybrid sharding keeps the parameter all-gathers and the
gradient reduce-scatters inside each node and sends only the gradient shards across: every GPU
of a node all-reduces its 1/G shard over the N nodes at once, through the node's one port, so
the port carries 2(N-1)/N of the whole gradient per step.

Known limitations: one port per node and one ring (NCCL can use several NICs and trees); no
latency term (large messages only); what overlaps with the backward follows
:mod:`~oomdoctor.plans.recommend.cost`.
"""
from __future__ import annotations

from oomdoctor.plans.parallel import Layout, Strategy
from oomdoctor.plans.recommend.cost import (BACKWARD_SHARE, CHECKPOINT_RECOMPUTE, StepTime,
                                      dequant_seconds, throughput)
from oomdoctor.plans.recommend.machine import Hardware
from oomdoctor.sim.trace import Trace


def ring_allreduce_bytes(nbytes: float, ranks: int) -> float:
    """Bytes each link of a ring carries to all-reduce ``nbytes`` over ``ranks``: 2(n-1)/n."""
    return 2 * (ranks - 1) / ranks * nbytes if ranks > 1 else 0.0


def ring_allreduce_seconds(nbytes: float, ranks: int, gbps: float) -> float:
    """Seconds of a bandwidth-bound ring all-reduce at ``gbps`` GB/s per link direction."""
    return ring_allreduce_bytes(nbytes, ranks) / (gbps * 1e9)


def node_step_time(layout: Layout, trace: Trace, strategy: Strategy, hw: Hardware,
                   precision: str, checkpointing: bool, micro_batch: int, grad_accum: int
                   ) -> StepTime:
    """Seconds per optimizer step on ``hw.nodes`` machines (``strategy.num_gpus`` in all)."""
    flops = layout.flops_per_sample * micro_batch * (1 + CHECKPOINT_RECOMPUTE * checkpointing)
    t_micro = flops / throughput(hw.gpu, precision) + dequant_seconds(layout, hw.gpu,
                                                                      checkpointing)
    compute = grad_accum * t_micro
    n, g, nodes = strategy.num_gpus, strategy.per_node, strategy.nodes
    intra = hw.link_gbps * 1e9
    inter = hw.inter_node_gbps * 1e9
    # A ring over every GPU of every node moves at its slowest hop.
    ring_bw = min(intra, inter) if nodes > 1 else intra
    grads, params = trace.gradient_bytes, trace.parameter_bytes
    share = (n - 1) / n if n > 1 else 0.0
    name = strategy.name
    comm = traffic = 0.0
    if name == "ddp":
        traffic = ring_allreduce_bytes(grads, n)
        comm = max(0.0, traffic / ring_bw - BACKWARD_SHARE * t_micro)
    elif name == "zero1":
        traffic = ring_allreduce_bytes(grads, n) + share * params
        comm = max(0.0, ring_allreduce_bytes(grads, n) / ring_bw - BACKWARD_SHARE * t_micro) \
            + share * params / ring_bw
    elif name == "zero2":
        traffic = grad_accum * share * grads + share * params
        comm = grad_accum * max(0.0, share * grads / ring_bw - BACKWARD_SHARE * t_micro) \
            + share * params / ring_bw
    elif name == "zero3":
        # All-gather for forward and backward, reduce-scatter of gradients: 3 x (n-1)/n of the
        # parameters per micro-batch, every ring crossing the inter-node link.
        traffic = grad_accum * 3 * share * params
        comm = grad_accum * max(0.0, traffic / grad_accum / ring_bw - t_micro)
    elif name == "hsdp":
        # Inside the node: ZeRO-3's volume over g GPUs, each micro-batch, behind compute.
        local = 3 * (g - 1) / g * params if g > 1 else 0.0
        intra_s = max(0.0, local / intra - t_micro) if g > 1 else 0.0
        # Across: the node's g gradient shards all-reduced over the nodes through one port,
        # once per step (set_requires_all_reduce(False) until the last micro-batch).
        cross = ring_allreduce_bytes(grads, nodes)
        inter_s = max(0.0, cross / inter - BACKWARD_SHARE * t_micro)
        traffic = grad_accum * local + cross / g
        comm = grad_accum * intra_s + inter_s
    return StepTime(compute + comm, compute, comm, round(traffic))
