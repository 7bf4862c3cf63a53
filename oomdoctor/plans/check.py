"""A CI memory-regression gate: predicted peaks per configured case against a committed baseline.

    oomdoctor check --update     # record oomdoctor-baseline.json (commit it)
    oomdoctor check              # in CI: exit 1 if a case's peak grew beyond the tolerance

Cases live in the project's ``setup.cfg`` (or ``--config FILE``), one section per case::

    [oomdoctor]
    baseline = oomdoctor-baseline.json
    tolerance = 0.02            ; or 2%% (setuptools reads setup.cfg with %-interpolation)

    [oomdoctor:gpt2-bf16]
    model = sample_models/gpt2_small.py
    batch_size = 8
    precision = bf16            ; fp32 | fp16 | bf16 | bf16-pure | fp16-pure
    checkpointing = false
    checkpoint_every = 1        ; optional, with checkpointing: every N-th block (torchtitan's "N")
    checkpoint_policy = full    ; optional, with checkpointing: full | op (per-op, torchtitan's)
    grad_accum = 1
    gpu = rtx3090
    budget = 24GiB              ; optional: must fit a card this size ...
    margin = 0.05               ; ... with this safety margin
    tolerance = 0.01            ; optional per-case override

    [oomdoctor:train-script]
    command = python train.py --bs 8   ; a training script as it is (instead of model =):
    gpu = rtx3090                      ; it runs on a fake GPU until its second step

Everything is computed on fake tensors, so the numbers are identical run after run and process
after process: no clocks, no randomness. A case that cannot be estimated fails the check with
its reason (fail closed). A changed torch version is reported: numbers may legitimately move
with it, and ``--update`` records the new ones.

Exit codes: 0 passed, 1 failed (growth beyond tolerance, budget exceeded, a case error, a case
missing from the baseline), 2 usage or configuration error.
"""
from __future__ import annotations

import configparser
import json
import multiprocessing
import os
import shlex
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from xml.sax.saxutils import escape, quoteattr

import torch

from oomdoctor import __version__
from oomdoctor.sim.allocator import format_size
from oomdoctor.plans.estimate import Budget, estimate
from oomdoctor.sim.gpus import custom_profile, get_profile, parse_size
from oomdoctor.models.loader import load_model
from oomdoctor.models.spec import ModelFileError
from oomdoctor.plans.workers import forked_pool
from oomdoctor.sim.trace import CHECKPOINT_POLICIES, PRECISIONS, TraceConfig

SCHEMA = 1
DEFAULT_BASELINE = "oomdoctor-baseline.json"
DEFAULT_TOLERANCE = 0.02
STRATEGIES = ("single",)


class ConfigError(ValueError):
    """The check's configuration is missing or wrong."""


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    batch_size: int
    precision: str = "fp32"
    checkpointing: bool = False
    grad_accum: int = 1
    optimizer: str | None = None
    strategy: str = "single"
    gpu: str = "rtx3090"
    budget_bytes: int | None = None
    margin: float = 0.05
    tolerance: float = DEFAULT_TOLERANCE
    task: str | None = None          # a Hugging Face id or config as `model`: its task ...
    seq_len: int | None = None       # ... and tokens per sequence
    lora: int | None = None          # LoRA rank (oomdoctor.models.adapters) ...
    lora_targets: str | None = None  # ... its module names, comma-separated ...
    quantize: str | None = None      # ... and 4-bit frozen weights (QLoRA)
    image_size: int | None = None    # timm:, torchvision:, HF image models: input side ...
    num_classes: int | None = None   # ... and head width
    command: str | None = None       # a training script's command line, instead of a model
    torch: str | None = None         # the torch release whose CUDA facts to model (--torch)
    attn: str | None = None          # a Hugging Face model's attention implementation (--attn)
    checkpoint_every: int | None = None   # with checkpointing: every N-th block ...
    checkpoint_policy: str | None = None  # ... whole or per op (--checkpoint-every/-policy)
    weights_dtype: str | None = None # a Hugging Face model's load dtype (--weights-dtype)

    def config(self) -> dict[str, Any]:
        """What defines the numbers: a change here makes the baseline stale. (task, seq_len and
        the LoRA keys only where set: baselines recorded before they existed stay valid.)"""
        d = asdict(self)
        del d["name"], d["tolerance"]
        if self.command:
            # the script decides its loop: the baseline records what it did (Measured.run)
            for key in ("model", "precision", "checkpointing", "grad_accum", "optimizer",
                        "strategy"):
                del d[key]
            if not self.batch_size:
                del d["batch_size"]
        for key in ("task", "seq_len", "lora", "lora_targets", "quantize", "image_size",
                    "num_classes", "command", "torch", "attn", "checkpoint_every",
                    "checkpoint_policy", "weights_dtype"):
            if d[key] is None:
                del d[key]
        return d

    def adapters(self):
        """The case's LoRA / QLoRA, or None."""
        if self.lora is None:
            return None
        from oomdoctor.models.adapters import Adapters
        targets = tuple(t.strip() for t in self.lora_targets.split(",")) \
            if self.lora_targets else None
        return Adapters(self.lora, targets, quantize=self.quantize)


@dataclass(frozen=True)
class CheckConfig:
    baseline: str
    tolerance: float
    cases: tuple[Case, ...]
    root: str            # paths in the config are relative to the config file's folder


@dataclass(frozen=True)
class Measured:
    case: str
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    fits_budget: bool | None = None
    budget_bytes: int | None = None
    error: str | None = None
    run: dict[str, Any] | None = None    # a script's: what its step did (script_run)


def script_run(e) -> dict[str, Any]:
    """What a training script's step did, as its estimate read it from the run: micro-batch,
    accumulation, processes, effective batch, precision, autocast and weight dtypes."""
    return {"batch_size": e.batch_size, "grad_accum": e.grad_accum, "processes": e.processes,
            "effective_batch_size": e.effective_batch_size, "precision": e.precision,
            "autocast_dtype": e.autocast_dtype or None,
            "weight_dtypes": {"trainable": list(e.weight_dtypes[0]),
                              "frozen": list(e.weight_dtypes[1])}}


@dataclass(frozen=True)
class Row:
    case: str
    model: str                      # the model, or the script's command line
    status: str                     # ok | regression | improvement | budget | error | new | stale
    baseline_reserved: int | None
    now_reserved: int | None
    baseline_allocated: int | None
    now_allocated: int | None
    change: float | None            # relative change of reserved (allocated if larger)
    tolerance: float
    message: str
    file: str = ""                  # the file annotations point at: model file or script

    @property
    def failed(self) -> bool:
        return self.status in ("regression", "budget", "error", "new", "stale")


@dataclass(frozen=True)
class CheckResult:
    rows: tuple[Row, ...]
    torch_version: str
    baseline_torch_version: str | None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        return not any(r.failed for r in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "torch_version": self.torch_version,
                "baseline_torch_version": self.baseline_torch_version,
                "torch_version_changed": (self.baseline_torch_version is not None
                                          and self.baseline_torch_version != self.torch_version),
                "notes": list(self.notes), "cases": [asdict(r) for r in self.rows]}


# -- configuration --------------------------------------------------------------------------

def _fraction(text: str, what: str) -> float:
    # "2%%" too: setuptools reads setup.cfg with %-interpolation, so a percent sign there must
    # be doubled (or written as a fraction, 0.02).
    t = text.strip()
    try:
        v = float(t.rstrip("%")) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ConfigError(f"{what} = {text!r} is not a number; write e.g. 2%") from None
    if not 0 <= v < 1:
        raise ConfigError(f"{what} = {text!r} must be between 0% and 100%")
    return v


def load_config(path: str | None = None) -> CheckConfig:
    """Read ``[oomdoctor]`` and ``[oomdoctor:NAME]`` sections from setup.cfg or ``path``."""
    path = path or "setup.cfg"
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such file; put [oomdoctor:NAME] case sections in "
                          "setup.cfg or pass --config FILE")
    cp = configparser.ConfigParser(inline_comment_prefixes=(";", "#"), interpolation=None)
    try:
        cp.read(path)
    except configparser.Error as e:
        raise ConfigError(f"{path}: {e}") from e
    root = os.path.dirname(os.path.abspath(path))
    top = cp["oomdoctor"] if cp.has_section("oomdoctor") else {}
    tolerance = _fraction(top.get("tolerance", "2%"), "tolerance")
    cases = []
    for section in cp.sections():
        if not section.startswith("oomdoctor:"):
            continue
        name = section.split(":", 1)[1].strip()
        s = cp[section]
        where = f"{path} [{section}]"
        known = {"model", "batch_size", "precision", "checkpointing", "grad_accum", "optimizer",
                 "strategy", "gpu", "budget", "margin", "tolerance", "task", "seq_len",
                 "lora", "lora_targets", "quantize", "image_size", "num_classes", "command",
                 "torch", "attn", "checkpoint_every", "checkpoint_policy", "weights_dtype"}
        unknown = set(s) - known
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known: "
                              f"{', '.join(sorted(known))}")
        if "command" in s:
            cases.append(_with_torch(_command_case(name, s, where, tolerance), s, where))
            continue
        if "model" not in s or "batch_size" not in s:
            raise ConfigError(f"{where}: needs `model = path/to/model.py` and `batch_size = N` "
                              "(or `command = python train.py ARGS`)")
        try:
            batch_size = int(s["batch_size"])
            grad_accum = int(s.get("grad_accum", "1"))
            checkpointing = s.getboolean("checkpointing", fallback=False)
            seq_len = int(s["seq_len"]) if "seq_len" in s else None
            lora = int(s["lora"]) if "lora" in s else None
            image_size, num_classes = (int(s[k]) if k in s else None
                                       for k in ("image_size", "num_classes"))
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from e
        precision = s.get("precision", "fp32")
        if precision not in PRECISIONS:
            raise ConfigError(f"{where}: precision = {precision!r}; choose one of "
                              f"{', '.join(PRECISIONS)}")
        strategy = s.get("strategy", "single")
        if strategy not in STRATEGIES:
            raise ConfigError(f"{where}: strategy = {strategy!r} is not supported by check yet; "
                              f"use {', '.join(STRATEGIES)}")
        gpu = s.get("gpu", "rtx3090")
        try:
            get_profile(gpu)
            budget = parse_size(s["budget"]) if "budget" in s else None
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from e
        cases.append(Case(name, s["model"], batch_size, precision, checkpointing, grad_accum,
                          s.get("optimizer"), strategy, gpu, budget,
                          _fraction(s.get("margin", "5%"), "margin"),
                          _fraction(s["tolerance"], "tolerance") if "tolerance" in s
                          else tolerance, s.get("task"), seq_len, lora,
                          s.get("lora_targets"), s.get("quantize"), image_size, num_classes))
        cases[-1] = _with_checkpointing(_with_torch(cases[-1], s, where), s, where)
        if "attn" in s:
            cases[-1] = replace(cases[-1], attn=s["attn"])
        if "weights_dtype" in s:
            cases[-1] = replace(cases[-1], weights_dtype=s["weights_dtype"])
        if lora is None and (s.get("quantize") or s.get("lora_targets")):
            raise ConfigError(f"{where}: quantize and lora_targets need lora = RANK")
        try:
            cases[-1].adapters()
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from e
    if not cases:
        raise ConfigError(f"{path}: no [oomdoctor:NAME] sections; add one per case (see "
                          "`oomdoctor check --help`)")
    return CheckConfig(top.get("baseline", DEFAULT_BASELINE), tolerance, tuple(cases), root)


def _with_torch(case: Case, s: Any, where: str) -> Case:
    """The case with its ``torch = X.Y`` release, checked now (a bad one is a config error)."""
    if "torch" not in s:
        return case
    from oomdoctor.sim.versions import parse_version
    try:
        parse_version(s["torch"])
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from e
    return replace(case, torch=s["torch"])


def _with_checkpointing(case: Case, s: Any, where: str) -> Case:
    """The case with its ``checkpoint_every = N`` and ``checkpoint_policy = full|op``, checked
    now: they say how ``checkpointing = true`` wraps the blocks."""
    if "checkpoint_every" not in s and "checkpoint_policy" not in s:
        return case
    if not case.checkpointing:
        raise ConfigError(f"{where}: checkpoint_every and checkpoint_policy say how "
                          "checkpointing wraps the blocks, and checkpointing is off; add "
                          "`checkpointing = true`")
    try:
        every = int(s.get("checkpoint_every", "1"))
    except ValueError as e:
        raise ConfigError(f"{where}: checkpoint_every: {e}") from e
    policy = s.get("checkpoint_policy", "full")
    if every < 1 or policy not in CHECKPOINT_POLICIES:
        raise ConfigError(f"{where}: checkpoint_every = {every}, checkpoint_policy = "
                          f"{policy!r}: give N >= 1 and one of {', '.join(CHECKPOINT_POLICIES)}")
    return replace(case, checkpoint_every=every, checkpoint_policy=policy)


def _trace_config(case: Case, batch_size: int) -> TraceConfig:
    """The case's TraceConfig: its loop, and the torch release it models."""
    from oomdoctor.sim.versions import default_zero_grad, parse_version
    version = parse_version(case.torch) if case.torch else None
    return TraceConfig(batch_size, case.precision, case.checkpointing, None, case.grad_accum,
                       case.optimizer, zero_grad=default_zero_grad(version), torch=version,
                       checkpoint_every=case.checkpoint_every or 1,
                       checkpoint_policy=case.checkpoint_policy or "full")


def _command_case(name: str, s: Any, where: str, tolerance: float) -> Case:
    """A case that runs a training script: ``command``, ``gpu``, ``budget``, ``margin``,
    ``tolerance`` and an optional ``batch_size`` (every DataLoader's, or ``{batch}``); the
    script decides the rest."""
    loop_keys = set(s) & {"model", "precision", "checkpointing", "checkpoint_every",
                          "checkpoint_policy", "grad_accum", "optimizer",
                          "strategy", "task", "lora", "lora_targets", "quantize", "image_size",
                          "num_classes", "attn", "weights_dtype"}
    if loop_keys:
        raise ConfigError(f"{where}: {', '.join(sorted(loop_keys))} describe a model file's "
                          "loop; a `command` case's script decides them itself")
    try:
        batch_size = int(s["batch_size"]) if "batch_size" in s else 0
        seq_len = int(s["seq_len"]) if "seq_len" in s else None
        get_profile(s.get("gpu", "rtx3090"))
        budget = parse_size(s["budget"]) if "budget" in s else None
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from e
    return Case(name, "", batch_size, gpu=s.get("gpu", "rtx3090"), budget_bytes=budget,
                margin=_fraction(s.get("margin", "5%"), "margin"),
                tolerance=_fraction(s["tolerance"], "tolerance") if "tolerance" in s
                else tolerance, seq_len=seq_len, command=s["command"])


def _script_estimate(case: Case, root: str, budget: Budget):
    """A ``command`` case's estimate: the script (relative to the config's folder) run on a
    fake GPU."""
    import shlex

    from oomdoctor.models.script import parse_command
    from oomdoctor.plans.estimate import script_trace
    from oomdoctor.plans.parallel.scripts import script_gpu_estimate
    from oomdoctor.sim.allocator import AllocatorConfig
    words = shlex.split(case.command)
    for i, w in enumerate(words):               # the script's path, relative to the config
        if w.endswith(".py") and os.path.exists(os.path.join(root, w)):
            words[i] = os.path.join(root, w)
            break
    script = parse_command(words)
    trace = script_trace(script, _trace_config(case, case.batch_size or 1), budget,
                         batch_size=case.batch_size or None, seq_len=case.seq_len)
    return script_gpu_estimate(script, trace, budget, AllocatorConfig(), case.seq_len)


# -- measuring ------------------------------------------------------------------------------

def measure_case(case: Case, root: str) -> Measured:
    """Estimate one case; any failure becomes the case's error (fail closed)."""
    try:
        gpu = get_profile(case.gpu)
        if case.command:
            e = _script_estimate(case, root, Budget(gpu, case.margin))
        else:
            # a path relative to the config's folder, else a Hugging Face id as written
            local = os.path.join(root, case.model)
            spec = load_model(local if os.path.exists(local) else case.model, task=case.task,
                              attn=case.attn, weights_dtype=case.weights_dtype,
                              seq_len=case.seq_len, adapters=case.adapters(),
                              image_size=case.image_size, num_classes=case.num_classes)
            e = estimate(spec, _trace_config(case, case.batch_size), Budget(gpu, case.margin))
        fits = None
        if case.budget_bytes is not None:
            card = custom_profile(case.budget_bytes, gpu.bf16, gpu.compute_capability)
            budget = Budget(card, case.margin, gpu.context_bytes)
            fits = e.peak_reserved_bytes <= budget.limit_bytes
        return Measured(case.name, e.peak_allocated_bytes, e.peak_reserved_bytes, fits,
                        case.budget_bytes, run=script_run(e) if case.command else None)
    except (ModelFileError, ValueError) as e:
        return Measured(case.name, error=str(e))
    except Exception as e:  # fail closed on anything else too, with the reason
        return Measured(case.name, error=f"{type(e).__name__}: {e}")


def _measure_star(args: tuple[Case, str]) -> Measured:
    return measure_case(*args)


def measure_all(cfg: CheckConfig, jobs: int = 1, progress=lambda _: None) -> list[Measured]:
    """Every case, in ``jobs`` forked processes (each loads its own model file)."""
    work = [(c, cfg.root) for c in cfg.cases]
    if jobs > 1 and len(work) > 1 and "fork" in multiprocessing.get_all_start_methods():
        progress(f"estimating {len(work)} cases in {min(jobs, len(work))} processes")
        with forked_pool(min(jobs, len(work))) as pool:
            return list(pool.map(_measure_star, work))
    out = []
    for c, root in work:
        progress(f"estimating {c.name}")
        out.append(measure_case(c, root))
    return out


# -- baseline -------------------------------------------------------------------------------

def baseline_document(cfg: CheckConfig, measured: list[Measured]) -> dict[str, Any]:
    """The baseline file's content: versioned, no timestamps (byte-identical when unchanged)."""
    cases = {}
    for case, m in zip(cfg.cases, measured):
        if m.error:
            raise ValueError(f"case {case.name}: {m.error}; fix it before recording a baseline")
        cases[case.name] = {"config": case.config(),
                            "peak_allocated_bytes": m.peak_allocated_bytes,
                            "peak_reserved_bytes": m.peak_reserved_bytes}
        if m.run is not None:
            cases[case.name]["run"] = m.run
    return {"schema": SCHEMA, "oomdoctor_version": __version__,
            "torch_version": torch.__version__, "cases": cases}


def dumps_baseline(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def read_baseline(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable baseline ({e}); recreate it with "
                          "`oomdoctor check --update`") from e
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ConfigError(f"{path}: baseline schema {doc.get('schema') if isinstance(doc, dict) else '?'}"
                          f" is not {SCHEMA}; recreate it with `oomdoctor check --update`")
    return doc


# -- comparing ------------------------------------------------------------------------------

def compare(cfg: CheckConfig, measured: list[Measured], baseline: dict[str, Any] | None
            ) -> CheckResult:
    rows = []
    base_cases = (baseline or {}).get("cases", {})
    notes = []
    base_torch = baseline.get("torch_version") if baseline else None
    if baseline is None:
        notes.append(f"no baseline file {cfg.baseline}: run `oomdoctor check --update` and "
                     "commit it")
    elif base_torch != torch.__version__:
        notes.append(f"torch changed since the baseline ({base_torch} -> {torch.__version__}): "
                     "peaks may legitimately move; if they did, review and run "
                     "`oomdoctor check --update`")
    for case, m in zip(cfg.cases, measured):
        b = base_cases.get(case.name)
        common = dict(case=case.name, model=case.command or case.model,
                      file=_case_file(case, cfg.root), tolerance=case.tolerance,
                      now_reserved=m.peak_reserved_bytes, now_allocated=m.peak_allocated_bytes,
                      baseline_reserved=b and b.get("peak_reserved_bytes"),
                      baseline_allocated=b and b.get("peak_allocated_bytes"))
        if m.error:
            rows.append(Row(status="error", change=None, message=m.error, **common))
            continue
        if m.fits_budget is False:
            rows.append(Row(status="budget", change=None, message=(
                f"peak reserved {format_size(m.peak_reserved_bytes)} does not fit a "
                f"{format_size(m.budget_bytes)} card with a {case.margin:.0%} margin"),
                **common))
            continue
        if b is None:
            rows.append(Row(status="new", change=None, message=(
                "not in the baseline; run `oomdoctor check --update` and commit the baseline"),
                **common))
            continue
        if b.get("config") != case.config():
            rows.append(Row(status="stale", change=None, message=(
                "the case's configuration changed since the baseline; run "
                "`oomdoctor check --update`"), **common))
            continue
        changes = [(m.peak_reserved_bytes - b["peak_reserved_bytes"]) / b["peak_reserved_bytes"],
                   (m.peak_allocated_bytes - b["peak_allocated_bytes"])
                   / b["peak_allocated_bytes"]]
        change = max(changes, key=abs)
        grew = max(changes)
        if grew > case.tolerance:
            status, msg = "regression", (
                f"peak grew {grew:+.2%} (tolerance {case.tolerance:.0%}): reserved "
                f"{format_size(b['peak_reserved_bytes'])} -> "
                f"{format_size(m.peak_reserved_bytes)}, allocated "
                f"{format_size(b['peak_allocated_bytes'])} -> "
                f"{format_size(m.peak_allocated_bytes)}")
        elif min(changes) < -case.tolerance:
            status, msg = "improvement", (
                f"peak shrank {min(changes):+.2%}: run `oomdoctor check --update` to lock it in")
        else:
            status, msg = "ok", f"within {case.tolerance:.0%}"
        rows.append(Row(status=status, change=change, message=msg, **common))
    return CheckResult(tuple(rows), torch.__version__, base_torch, tuple(notes))


def _case_file(case: Case, root: str) -> str:
    """The file a case's annotation points at, as the config names it: the model file, or
    the script its command runs; "" for a Hugging Face id or a library model name."""
    if case.command:
        from oomdoctor.models.script import script_word
        return script_word(shlex.split(case.command)) or ""
    return case.model if os.path.isfile(os.path.join(root, case.model)) else ""


# -- rendering ------------------------------------------------------------------------------

def render_table(r: CheckResult) -> str:
    from tabulate import tabulate

    def size(n):
        return format_size(n) if n is not None else "-"
    rows = [(x.case, x.status.upper() if x.failed else x.status, size(x.baseline_reserved),
             size(x.now_reserved), "-" if x.change is None else f"{x.change:+.2%}", x.message)
            for x in r.rows]
    out = tabulate(rows, headers=("case", "status", "baseline reserved", "now reserved",
                                  "change", ""))
    lines = [out, ""] + [f"note: {n}" for n in r.notes]
    failed = sum(x.failed for x in r.rows)
    lines.append(f"{'FAILED' if failed else 'passed'}: {len(r.rows) - failed} of {len(r.rows)}"
                 " cases within their limits")
    return "\n".join(lines)


def render_github(r: CheckResult) -> str:
    """GitHub Actions workflow commands: an annotation on each case's model file."""
    def clean(s: str) -> str:   # workflow-command escaping
        return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    lines = []
    for x in r.rows:
        level = "error" if x.failed else ("notice" if x.status == "improvement" else None)
        if level:
            where = f"file={clean(x.file)}," if x.file else ""
            lines.append(f"::{level} {where}title=oomdoctor {x.case}: "
                         f"{x.status}::{clean(x.message)}")
    for n in r.notes:
        lines.append(f"::warning title=oomdoctor::{clean(n)}")
    return "\n".join(lines + [render_table(r)])


def junit_xml(r: CheckResult) -> str:
    failures = sum(x.failed for x in r.rows)
    parts = ['<?xml version="1.0" encoding="utf-8"?>',
             f'<testsuite name="oomdoctor check" tests="{len(r.rows)}" '
             f'failures="{failures}" errors="0">']
    for x in r.rows:
        where = f" file={quoteattr(x.file)}" if x.file else ""
        parts.append(f'  <testcase classname="oomdoctor.plans.check" name={quoteattr(x.case)}'
                     f'{where}>')
        if x.failed:
            parts.append(f'    <failure message={quoteattr(x.status + ": " + x.message)}>'
                         f'{escape(x.message)}</failure>')
        parts.append("  </testcase>")
    parts.append("</testsuite>")
    return "\n".join(parts) + "\n"
