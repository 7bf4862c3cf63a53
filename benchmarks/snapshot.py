"""Record every command's output on the sample models and test logs, and compare two versions.

    python benchmarks/snapshot.py --against HEAD~3          # the working tree vs. a commit
    python benchmarks/snapshot.py --against main --only explain,help
    python benchmarks/snapshot.py --record before.json       # this tree's outputs, then
    python benchmarks/snapshot.py --compare before.json      # ... after a change

A refactor must leave what users see unchanged: this runs each command in-process (one torch
import for all of them) through click's CliRunner and records its exit code, stdout and stderr.
With ``--against REF`` the same cases run a second time, in a subprocess whose ``oomdoctor``
package comes from a temporary ``git worktree`` of REF (the model files and logs are this
tree's in both runs, so only the package differs), and every difference is printed. Exit 0
when all cases are byte-identical, 1 otherwise. What depends on the machine's speed is masked:
durations on stderr ("in 3.2 s") and the "tracing: ..." lines a slow trace prints.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (group, name, argv). Groups let a partial refactor check only what it touched (--only).
SAMPLE_ESTIMATES = [
    ("tiny_mlp", ["-b", "256", "--gpu", "rtx3090"]),
    ("resnet_cnn", ["-b", "32", "--precision", "fp16", "--gpu", "t4"]),
    ("gpt2_small", ["-b", "8", "--precision", "bf16", "--gpu", "rtx3090"]),
    ("gpt2_small", ["-b", "4", "--checkpointing", "--grad-accum", "4", "--gpu", "rtx3090"]),
    ("bert_base", ["-b", "8", "--precision", "fp16", "--gpu", "v100-16"]),
    ("vit_b16", ["-b", "32", "--precision", "bf16", "--gpu", "a10"]),
    ("lora_gpt", ["-b", "8", "--precision", "bf16", "--gpu", "rtx3060-12"]),
    ("llama7b", ["-b", "1", "--precision", "bf16-pure", "--checkpointing", "--gpu", "a100-80"]),
    ("tiny_mlp", ["-b", "64", "--memory", "8GiB", "--alloc-conf", "expandable_segments:True"]),
    ("tiny_mlp", ["-b", "64", "--gpu", "rtx3090", "--strategy", "zero2", "--num-gpus", "4"]),
]


def cases() -> list[tuple[str, str, list[str]]]:
    out = []
    for i, (model, args) in enumerate(SAMPLE_ESTIMATES):
        path = f"sample_models/{model}.py"
        out.append(("estimate", f"estimate-{i}-{model}", ["estimate", path, *args]))
        out.append(("estimate", f"estimate-{i}-{model}-json", ["estimate", path, *args, "--json"]))
    for model, gpu in (("tiny_mlp", "rtx3090"), ("resnet_cnn", "t4")):
        path = f"sample_models/{model}.py"
        out.append(("probe", f"probe-{model}", ["probe", path, "--gpu", gpu, "-j", "1"]))
        out.append(("probe", f"probe-{model}-json", ["probe", path, "--gpu", gpu, "-j", "1",
                                                      "--json"]))
    out.append(("probe", "probe-tiny-2gpus", ["probe", "sample_models/tiny_mlp.py", "--gpu",
                                              "rtx3090", "--num-gpus", "2", "-j", "1",
                                              "--precision", "fp32"]))
    for model, args in (("tiny_mlp", ["-b", "64"]), ("gpt2_small", ["-b", "4", "--precision",
                                                                     "bf16"])):
        path = f"sample_models/{model}.py"
        for cmd in ("parallel", "split"):
            base = [cmd, path, "--gpus", "2", "--gpu", "rtx3090", *args]
            out.append(("parallel", f"{cmd}-{model}", base))
            out.append(("parallel", f"{cmd}-{model}-json", [*base, "--json"]))
    rec = ["recommend", "sample_models/tiny_mlp.py", "--gpu", "rtx3090", "--num-gpus", "2",
           "-j", "1"]
    out.append(("recommend", "recommend-tiny", rec))
    out.append(("recommend", "recommend-tiny-json", [*rec, "--json"]))
    out.append(("recommend", "recommend-tiny-nop2p", [*rec, "--link", "pcie-no-p2p",
                                                      "--target-batch", "64", "--quick"]))
    rec_big = ["recommend", "sample_models/llama7b.py", "--gpu", "rtx3090", "--num-gpus", "2",
               "--quick", "-j", "1", "--precision", "bf16", "--target-batch", "8"]
    out.append(("recommend", "recommend-llama-2x3090", rec_big))
    for log in sorted(glob.glob(os.path.join(ROOT, "tests", "logs", "*.log"))):
        rel = os.path.relpath(log, ROOT)
        name = os.path.basename(log)[:-4]
        out.append(("explain", f"explain-{name}", ["explain", rel]))
        out.append(("explain", f"explain-{name}-json", ["explain", rel, "--json"]))
    out.append(("explain", "explain-model", ["explain", "tests/logs/" + _first_oom_log(),
                                             "--model", "sample_models/gpt2_small.py",
                                             "--gpu", "rtx3090"]))
    out.append(("check", "check-json", ["check", "--json", "-j", "1"]))
    out.append(("check", "check-github", ["check", "--format", "github", "-j", "1"]))
    out.append(("gpus", "gpus-json", ["gpus", "--json"]))
    out.append(("help", "help", ["--help"]))
    for cmd in ("estimate", "probe", "explain", "check", "parallel", "split", "recommend",
                "smoke", "gpus", "watch"):
        out.append(("help", f"help-{cmd}", [cmd, "--help"]))
    # Usage and model-file errors: their exit codes and one-line messages.
    out.append(("errors", "err-missing-file", ["estimate", "nope.py", "-b", "1"]))
    out.append(("errors", "err-unknown-gpu", ["estimate", "sample_models/tiny_mlp.py", "-b",
                                              "1", "--gpu", "gtx9999"]))
    out.append(("errors", "err-bad-model", ["estimate", "tests/bad_models/syntax_error.py",
                                            "-b", "1", "--gpu", "rtx3090"]))
    out.append(("errors", "err-bf16-t4", ["probe", "sample_models/tiny_mlp.py", "--gpu", "t4",
                                          "--precision", "bf16"]))
    out.append(("errors", "err-explain-missing", ["explain", "nope.log"]))
    return out


def _first_oom_log() -> str:
    for name in ("torch20_reserved_3090.log",):
        if os.path.exists(os.path.join(ROOT, "tests", "logs", name)):
            return name
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "tests", "logs",
                                                                      "*oom*.log")))[0]


_DURATION = re.compile(r"\d+(?:\.\d+)?\s?(?:s|ms|min)\b")
# A long trace says where it is after 3 s: which phase that is depends on the machine's speed.
_SLOW_TRACE = re.compile(r"^tracing: .*\n", re.M)


def record(only: set[str] | None, package_root: str = ROOT, progress=True) -> dict:
    sys.path.insert(0, package_root)       # this tree's package, not an installed one
    from click.testing import CliRunner

    from oomdoctor.cli import cli
    runner = CliRunner()
    out = {"package": os.path.dirname(sys.modules["oomdoctor"].__file__), "cases": {}}
    for group, name, argv in cases():
        if only and group not in only:
            continue
        t = time.perf_counter()
        r = runner.invoke(cli, argv, catch_exceptions=True)
        exc = None
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            exc = f"{type(r.exception).__name__}: {r.exception}"
        out["cases"][name] = {"argv": argv, "exit": r.exit_code, "stdout": r.stdout,
                              "stderr": _DURATION.sub("<t>", _SLOW_TRACE.sub("", r.stderr)),
                              "exception": exc}
        if progress:
            print(f"{name}: exit {r.exit_code} ({time.perf_counter() - t:.1f} s)",
                  file=sys.stderr)
    return out


def compare(old: dict, new: dict) -> list[str]:
    diffs = []
    for name in sorted(set(old["cases"]) | set(new["cases"])):
        a, b = old["cases"].get(name), new["cases"].get(name)
        if a is None or b is None:
            diffs.append(f"{name}: only in {'new' if a is None else 'old'}")
            continue
        for key in ("exit", "stdout", "stderr", "exception"):
            if a[key] != b[key]:
                diffs.append(f"{name}: {key} differs\n  old: {str(a[key])[:600]!r}\n"
                             f"  new: {str(b[key])[:600]!r}")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", metavar="FILE", help="write this tree's outputs here")
    ap.add_argument("--against", metavar="REF", help="compare with this git revision")
    ap.add_argument("--compare", metavar="FILE", help="compare with outputs --record wrote")
    ap.add_argument("--package-root", default=ROOT, help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated groups: estimate, probe, parallel, "
                                   "recommend, explain, check, gpus, help, errors")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    os.chdir(ROOT)
    if args.against and not args.record:
        with tempfile.TemporaryDirectory() as tmp:
            wt = os.path.join(tmp, "ref")
            subprocess.run(["git", "worktree", "add", "--detach", wt, args.against], check=True,
                           capture_output=True)
            try:
                old_json = os.path.join(tmp, "old.json")
                env = dict(os.environ, PYTHONPATH=wt)
                cmd = [sys.executable, os.path.abspath(__file__), "--record", old_json,
                       "--package-root", wt]
                if args.only:
                    cmd += ["--only", args.only]
                subprocess.run(cmd, check=True, env=env)
                with open(old_json, encoding="utf-8") as f:
                    old = json.load(f)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", wt], check=False,
                               capture_output=True)
        if not old["package"].startswith(wt):
            print(f"the reference run imported {old['package']}, not the worktree", file=sys.stderr)
            return 2
        new = record(only)
        if new["package"] != os.path.join(ROOT, "oomdoctor"):
            print(f"this run imported {new['package']}, not {ROOT}", file=sys.stderr)
            return 2
        diffs = compare(old, new)
        for d in diffs:
            print(d)
        print(f"{len(new['cases'])} cases, {len(diffs)} differences against {args.against}")
        return 1 if diffs else 0
    doc = record(only, args.package_root)
    if args.compare:
        with open(args.compare, encoding="utf-8") as f:
            old = json.load(f)
        if only:
            old["cases"] = {k: v for k, v in old["cases"].items() if k in doc["cases"]}
        diffs = compare(old, doc)
        for d in diffs:
            print(d)
        print(f"{len(doc['cases'])} cases, {len(diffs)} differences against {args.compare}")
        return 1 if diffs else 0
    if args.record:
        with open(args.record, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    else:
        print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
