"""Text of a recommendation: the ranked table, per-GPU memory, lower bounds, the plan."""
from __future__ import annotations

from oomdoctor.recommend.cost import COMPUTE_EFFICIENCY
from oomdoctor.recommend.records import Recommendation


def _duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def render_text(r: Recommendation) -> str:
    from tabulate import tabulate

    def gib(n: int) -> str:
        return f"{n / 2**30:.2f}"
    lines = [f"{r.model} ({r.num_parameters:,} parameters) on {r.num_gpus} x {r.gpu} "
             f"({gib(r.device_total_bytes)} GiB each, {gib(r.budget_bytes)} GiB for the "
             f"allocator), link {r.link} (~{r.link_gbps:g} GB/s), target effective batch "
             f"{r.target_batch}", ""]
    if r.candidates:
        rows = [(i + 1, f"{c.strategy} x{c.num_gpus}", c.precision,
                 "yes" if c.checkpointing else "no", c.micro_batch, c.grad_accum,
                 gib(c.peak_device_bytes), _duration(c.step_seconds),
                 f"{c.samples_per_second:,.0f}", c.numerics.split(":")[0])
                for i, c in enumerate(r.candidates)]
        lines += ["configurations that fit, best first:",
                  tabulate(rows, headers=("#", "strategy", "precision", "ckpt", "micro", "accum",
                                          "GiB/GPU", "step", "samples/s", "numerics"),
                           colalign=("right", "left", "left", "left", "right", "right", "right",
                                     "right", "right", "left")),
                  "(GiB on the fullest GPU incl. CUDA context; times are estimates for ranking: "
                  f"{COMPUTE_EFFICIENCY:.0%} of datasheet FLOP/s, link as above)", ""]
    else:
        lines += [f"NOTHING FITS: no strategy trains {r.model} on {r.num_gpus} x {r.gpu} at any "
                  "micro-batch with the allowed precisions.", ""]
    if r.by_strategy:
        rows = []
        for e in r.by_strategy:
            for i, g in enumerate(e.gpus):
                rows.append((f"{e.strategy} x{e.num_gpus}" if i == 0 else "", g.label,
                             "yes" if g.fits else "NO", gib(g.device_peak_bytes),
                             gib(g.model_state_bytes), gib(g.breakdown["activations"]),
                             gib(g.breakdown["temporaries"] + g.breakdown["communication"])))
        lines += [f"per-GPU memory of each strategy at {r.by_strategy_config}:",
                  tabulate(rows, headers=("strategy", "GPU", "fits", "peak GiB", "model states",
                                          "activations", "temp+comm"),
                           colalign=("left", "left", "left", "right", "right", "right",
                                     "right")), ""]
    if r.floors and not r.candidates:
        precs = list(dict.fromkeys(f.precision for f in r.floors))
        table: dict[str, dict[str, str]] = {}
        for f in r.floors:
            table.setdefault(f"{f.strategy} x{1 if f.strategy == 'single' else r.num_gpus}",
                             {})[f.precision] = gib(f.bytes) + ("" if f.fits else " NO")
        rows = [(s, *[cells.get(p, "") for p in precs]) for s, cells in table.items()]
        lines += [f"parameters + gradients + optimizer state per GPU, GiB (a lower bound; NO: "
                  f"over the {gib(r.budget_bytes)} GiB budget whatever the batch):",
                  tabulate(rows, headers=("strategy", *precs),
                           colalign=("left",) + ("right",) * len(precs)), ""]
    lines += [f"note: {n}" for n in r.notes]
    if r.best is not None and r.launch is not None:
        c, lc = r.best, r.launch
        lines += ["", f"RECOMMENDED: {c.strategy} on {c.num_gpus} GPU(s), {c.precision}"
                  f"{', activation checkpointing' if c.checkpointing else ''}, micro-batch "
                  f"{c.micro_batch} x {c.grad_accum} accumulation = effective batch "
                  f"{c.effective_batch}; {gib(c.peak_device_bytes)} GiB on the fullest GPU, "
                  f"~{_duration(c.step_seconds)} per step"
                  + (f", up to ~{r.speedup:.1f}x the throughput of one GPU (communication "
                     "hidden where it can be; real runs also lose time to synchronisation and "
                     "the data pipeline)" if r.speedup else ""),
                  "",
                  " ".join(f"{k}={v}" for k, v in lc.env.items()) + " \\",
                  f"  {lc.command}", *([lc.env_note] if lc.env_note else []), "",
                  "code changes:", "",
                  *["    " + ln for ln in lc.snippet.splitlines()], "", "quality:",
                  *[f"- {n}" for n in lc.quality_notes]]
    if r.alternatives:
        lines += ["", "what would fit:", *[f"- {a}" for a in r.alternatives]]
    lines += [f"error: {e}" for e in r.errors]
    return "\n".join(lines)
