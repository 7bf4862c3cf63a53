"""Text of a recommendation: the ranked table, per-GPU memory, lower bounds, the plan."""
from __future__ import annotations

from oomdoctor.plans.recommend.cost import COMPUTE_EFFICIENCY
from oomdoctor.plans.recommend.records import Candidate, Launch, Recommendation


def _duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def render_text(r: Recommendation) -> str:
    """The whole report: header, the ranked table (or why nothing fits), per-GPU memory, lower
    bounds, tensor-parallel and offload plans, notes, the recommended plan, alternatives."""
    lines = _header(r)
    lines += _candidates_table(r) if r.candidates else _nothing_fits(r)
    lines += _by_strategy_table(r)
    lines += _floors_table(r)
    lines += _tensor_parallel(r) + _offload(r)
    lines += [f"note: {n}" for n in r.notes]
    if r.best is not None and r.launch is not None:
        lines += _recommended(r, r.best, r.launch)
    if r.alternatives:
        lines += ["", "what would fit:", *[f"- {a}" for a in r.alternatives]]
    lines += [f"error: {e}" for e in r.errors]
    return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def _on(r: Recommendation) -> str:
    """The GPUs, as "N" or "M nodes x N"."""
    return f"{r.nodes} nodes x {r.num_gpus}" if r.nodes > 1 else f"{r.num_gpus}"


def _label(r: Recommendation, strategy: str, num_gpus: int) -> str:
    """A strategy and its GPUs as the tables show it (nodes x GPUs per node on several nodes)."""
    if r.nodes > 1 and strategy != "single":
        return f"{strategy} {r.nodes}x{num_gpus // r.nodes}"
    return f"{strategy} x{num_gpus}"


def _header(r: Recommendation) -> list[str]:
    """The model, the machine and the target, then a blank line."""
    between = (f", between nodes {r.inter_node} (~{r.inter_node_gbps:g} GB/s)"
               if r.nodes > 1 else "")
    return [f"{r.model} ({r.num_parameters:,} parameters) on {_on(r)} x {r.gpu} "
            f"({_gib(r.device_total_bytes)} GiB each, {_gib(r.budget_bytes)} GiB for the "
            f"allocator), link {r.link} (~{r.link_gbps:g} GB/s){between}, target effective "
            f"batch {r.target_batch}",
            "allocator: PYTORCH_CUDA_ALLOC_CONF=" + (f"{r.allocator} (the launch line sets it)"
                                                     if r.allocator else "unset (the default)"),
            ""]


def _candidates_table(r: Recommendation) -> list[str]:
    """The configurations that fit, best first."""
    from tabulate import tabulate
    rows = [(i + 1, _label(r, c.strategy, c.num_gpus), c.precision,
             "yes" if c.checkpointing else "no", c.micro_batch, c.grad_accum,
             _gib(c.peak_device_bytes), _duration(c.step_seconds),
             _rate(c.samples_per_second), c.numerics.split(":")[0])
            for i, c in enumerate(r.candidates)]
    return ["configurations that fit, best first:",
            tabulate(rows, headers=("#", "strategy", "precision", "ckpt", "micro", "accum",
                                    "GiB/GPU", "step", "samples/s", "numerics"),
                     colalign=("right", "left", "left", "left", "right", "right", "right",
                               "right", "right", "left")),
            "(GiB on the fullest GPU incl. CUDA context; times are estimates for ranking: "
            f"{COMPUTE_EFFICIENCY:.0%} of datasheet FLOP/s, link as above)", ""]


def _nothing_fits(r: Recommendation) -> list[str]:
    return [f"NOTHING FITS: no strategy trains {r.model} on {_on(r)} x {r.gpu} at any "
            "micro-batch with the allowed precisions" + _offload_way_out(r) + ".", ""]


def _by_strategy_table(r: Recommendation) -> list[str]:
    """Every strategy's per-GPU memory at the reference configuration, one row per GPU."""
    if not r.by_strategy:
        return []
    from tabulate import tabulate
    rows = []
    for e in r.by_strategy:
        for i, g in enumerate(e.gpus):
            rows.append((_label(r, e.strategy, e.num_gpus) if i == 0 else "", g.label,
                         "yes" if g.fits else "NO", _gib(g.device_peak_bytes),
                         _gib(g.model_state_bytes), _gib(g.breakdown["activations"]),
                         _gib(g.breakdown["temporaries"] + g.breakdown["communication"])))
    return [f"per-GPU memory of each strategy at {r.by_strategy_config}:",
            tabulate(rows, headers=("strategy", "GPU", "fits", "peak GiB", "model states",
                                    "activations", "temp+comm"),
                     colalign=("left", "left", "left", "right", "right", "right",
                               "right")), ""]


def _floors_table(r: Recommendation) -> list[str]:
    """When nothing fits: the lower bound of each strategy x precision."""
    if not r.floors or r.candidates:
        return []
    from tabulate import tabulate
    precs = list(dict.fromkeys(f.precision for f in r.floors))
    table: dict[str, dict[str, str]] = {}
    for f in r.floors:
        row = table.setdefault(_label(r, f.strategy, 1 if f.strategy == "single"
                                      else r.num_gpus * r.nodes), {})
        row[f.precision] = _gib(f.bytes) + ("" if f.fits else " NO")
    rows = [(s, *[cells.get(p, "") for p in precs]) for s, cells in table.items()]
    return [f"parameters + gradients + optimizer state per GPU, GiB (a lower bound; NO: "
            f"over the {_gib(r.budget_bytes)} GiB budget whatever the batch):",
            tabulate(rows, headers=("strategy", *precs),
                     colalign=("left",) + ("right",) * len(precs)), ""]


def _recommended(r: Recommendation, c: Candidate, lc: Launch) -> list[str]:
    """The plan: its headline, the launch line(s), the code changes and the quality notes."""
    return ["", _recommended_headline(r, c), "",
            *(_launch_lines(lc) if lc.node_commands else
              [" ".join(f"{k}={v}" for k, v in lc.env.items()) + " \\",
               f"  {lc.command}"]), *([lc.env_note] if lc.env_note else []), "",
            "code changes:", "",
            *["    " + ln for ln in lc.snippet.splitlines()], "", "quality:",
            *[f"- {n}" for n in lc.quality_notes]]


def _recommended_headline(r: Recommendation, c: Candidate) -> str:
    return (f"RECOMMENDED: {c.strategy} on "
            + (f"{c.nodes} nodes x {c.num_gpus // c.nodes} GPUs" if c.nodes > 1
               else f"{c.num_gpus} GPU(s)") + f", {c.precision}"
            f"{', activation checkpointing' if c.checkpointing else ''}, micro-batch "
            f"{c.micro_batch} x {c.grad_accum} accumulation = effective batch "
            f"{c.effective_batch}; {_gib(c.peak_device_bytes)} GiB on the fullest GPU, "
            f"~{_duration(c.step_seconds)} per step"
            + (f", up to ~{r.speedup:.1f}x the throughput of one GPU (communication "
               "hidden where it can be; real runs also lose time to synchronisation and "
               "the data pipeline)" if r.speedup else ""))


def _launch_lines(lc: Launch) -> list[str]:
    """Several nodes: each node's line, then the SLURM script."""
    env = " ".join(f"{k}={v}" for k, v in lc.env.items())
    out = []
    for i, cmd in enumerate(lc.node_commands):
        out += [f"# node {i}", f"{env} \\", f"  {cmd}"]
    return out + ["", "or under SLURM (sbatch train.sbatch):", "",
                  *["    " + ln for ln in lc.sbatch.splitlines()]]


def _tensor_parallel(r: Recommendation) -> list[str]:
    if not r.tensor_parallel:
        return []
    from tabulate import tabulate
    rows = [(f"TP {t.degree} x DDP {t.data_parallel}", f"{t.model_state_bytes / 2**30:.2f}",
             "yes" if t.fits else "NO") for t in r.tensor_parallel]
    return ["tensor parallelism inside each node, data parallelism across (model states per "
            "GPU: Linear/Embedding weights split, the rest replicated; activations come on "
            "top, between 1/t and all of one GPU's without sequence parallelism):",
            tabulate(rows, headers=("layout", "GiB/GPU", "fits"),
                     colalign=("left", "right", "left")),
            "(needs a tensor-parallel model: torch.distributed.tensor.parallel or Megatron-LM; "
            "keep TP inside a node - it communicates in every layer)", ""]


def _offload(r: Recommendation) -> list[str]:
    if not r.offload:
        return []
    from tabulate import tabulate

    def gib(n: int) -> str:
        return f"{n / 2**30:.1f}"
    rows = []
    for o in r.offload:
        host_ok = {None: "?", True: "yes", False: "NO"}[o.host_fits]
        replayed = o.gpu_replayed_bytes is not None
        rows.append((o.name, gib(o.gpu_model_state_bytes),
                     gib(o.gpu_bytes) if replayed else "-",
                     ("yes" if o.fits_gpu else "NO") + ("" if replayed else "?"),
                     gib(o.host_bytes_per_node), host_ok,
                     _duration(o.pcie_seconds + o.cpu_optimizer_seconds),
                     "-" if o.slowdown is None else f"{o.slowdown:.1f}x"))
    if r.host_ram_bytes:
        ram = f"{r.host_ram_bytes / 2**30:.0f} GiB per node ({r.host_ram_source})"
    else:
        from oomdoctor.plans.recommend.offload import local_host_ram
        here = local_host_ram()
        ram = "unknown: pass --host-ram SIZE" + (
            f"; this machine has {here / 2**30:.0f} GiB" if here else "")
    out = [f"CPU offload plans (micro-batch 1 per GPU; host RAM {ram}):",
           tabulate(rows, headers=("plan", "states GiB/GPU", "total GiB/GPU", "fits GPU",
                                   "host GiB/node", "fits host", "+ per step", "slowdown"),
                    colalign=("left", "right", "right", "left", "right", "left", "right",
                              "right")),
           "(states: DeepSpeed's estimators of the model states; total: the plan's own step "
           "replayed as its code runs it (reserved + CUDA context); '-' and '?': not traced, "
           "model states only; host: DeepSpeed's estimators; "
           "'+ per step' is a rough estimate: gradients to the host every micro-batch, weights "
           "back every step or, offloaded, every gather, over PCIe; Adam on "
           "the CPU at 20 GB/s of host memory bandwidth; slowdown against the GPUs' compute at "
           "the target batch)"]
    fit = _offload_fitting(r)
    for o in r.offload:
        out.append(f"- {o.name}: {o.description}")
    if fit:
        env = " ".join(f"{k}={v}" for k, v in fit[0].env.items())
        out += [f"offload plan that fits: {fit[0].name}, "
                + ("DeepSpeed config (ds_config.json): " if fit[0].name != "fsdp-offload"
                   else "") + fit[0].config,
                f"  launch: {env + ' ' if env else ''}{fit[0].launch}", "  code:",
                *[f"    {line}" for line in fit[0].sketch.splitlines()]]
    return out + [""]


def _offload_fitting(r) -> list:
    """Offload plans whose GPU side fits and whose host side is not known to be too small."""
    return [o for o in r.offload if o.fits_gpu and o.host_fits is not False]


def _offload_way_out(r) -> str:
    """The headline must not read as "impossible" when a plan below does fit: with the
    optimizer state (and weights) in host RAM the GPUs hold less than any GPU-only strategy."""
    fit = _offload_fitting(r)
    if not fit:
        return ""
    host = "" if fit[0].host_fits else ", given enough host RAM"
    return (f" in GPU memory alone; with CPU offload it does ({fit[0].name}, below{host}), "
            "slower per step")


def _rate(samples_per_second: float) -> str:
    """Samples per second with three significant digits: 0.329 for an LLM's minutes-long step,
    where a whole number read 0."""
    if samples_per_second >= 100:
        return f"{samples_per_second:,.0f}"
    return f"{samples_per_second:.3g}"

