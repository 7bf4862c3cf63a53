"""Explain the out-of-memory and multi-GPU launch errors found in a pasted log.

    oomdoctor explain train.log
    python train.py 2>&1 | oomdoctor explain -
    oomdoctor explain train.log --json

`explain_stream(lines)` reads any iterable of log lines - a terminal scroll-back, a notebook
cell, a Slurm or torchrun log, an issue thread - and finds every known error in it: PyTorch
CUDA/HIP/MPS out-of-memory errors in all their versions, cuBLAS/cuDNN allocation failures,
host-memory failures (CPU allocator, Windows paging file, OOM killer, DataLoader workers,
shared memory), TensorFlow and JAX OOMs, launch errors (missing LOCAL_RANK, invalid device
ordinal, NCCL watchdog timeouts, port clashes, P2P) and look-alikes that are not OOMs. For each
it returns the numbers the message states (bytes as ints), a diagnosis those numbers support and
fixes ranked by the memory they buy, with their speed and quality trade-offs.
`explain_file(stream)` does the same for a binary file or stdin, faster (the CLI uses it), and
`render_text(result)` and `to_json(result)` turn the result into terminal text or a JSON-ready
dict. Nothing in this package prints, imports torch, or touches a GPU, and nothing in the input
is ever executed: it is only matched against fixed regular expressions.

Exit codes of `oomdoctor explain` (set in cli.py, documented in docs/explain.md):
    0  at least one known error was found and explained
    1  no known error was found in the input
    2  usage error (unknown option, FILE missing or unreadable) - click's own

Streaming: the input is consumed line by line in batches; quiet batches are rejected by a cheap
substring pre-filter, and only short "regions" around keyword hits are kept and parsed. Memory
is bounded by the constants in limits.py (_BATCH_CHARS, _REGION_MAX_CHARS, _MAX_KEYS, _MAX_FINDINGS),
not by the size of the log.

How a message is read: each line loses its prefixes (timestamps, `[rank3]:`, `(pid=12)`,
pytest `E   `, markdown `> `, log levels) and the lines of a region are concatenated with all
whitespace removed. That makes hard wraps harmless - `31.75` newline `GiB` and `capa` newline
`city` both become contiguous - and every number is then found by its own pattern, so a message
that is truncated or has another rank's line spliced into it still yields the fields it has.

Known limitations:
- Two processes writing to one terminal *without* rank prefixes can interleave lines; their
  messages are then parsed as one text, and a number may be attributed to the wrong message.
- The phase (forward, backward, optimizer step, ...) comes from the Python traceback printed
  before the message (or just after it, VS Code style); logs without a traceback get no phase.
- Fix effects need numbers the log may not contain. Parameter counts, micro-batch size and
  accumulation steps are read when the log prints them (PEFT, HF Trainer, Lightning, nanoGPT,
  argparse namespaces); otherwise effects that depend on them are reported as unknown.
- Localised Windows messages are recognised by the error code (1455), not by their text.
- A keyword split by a hard wrap narrower than ~30 columns can hide a message.

Layout (each module's docstring says what it owns):
    results.py, sizes.py   the result types (Kind, Category, Phase, Finding, ExplainResult, ...)
                           and byte sizes (parse_size, format_bytes)
    stream.py              the entry points: explain_stream, explain_text, explain_file, read_lines
    limits.py              the constants that bound memory and work
    lines.py               line normalisation (prefixes, ranks, ANSI) and the keyword pre-filter
    scanner.py             regions per rank stream, tracebacks, anchors -> drafts, facts of the log
    frames.py              traceback frames and the phase they show
    draft.py               a finding under construction and how repeats merge
    formats/               one module per family of messages - its anchors, the numbers read from
                           it and its diagnosis - and (formats/__init__.py) the tables joining them
    diagnosis.py, fixes.py what every diagnosis uses, and the shared fixes catalogue
    findings.py            drafts -> findings (title, phase, diagnosis, ranked fixes)
    render.py              render_text and to_json
    snapshot.py            a pickled CUDA memory snapshot: the restricted unpickler (refuses any
                           pickle that names a Python object), what was live at its OOM or peak,
                           fragmentation from its segments
    snapshot_report.py     `explain snapshot.pickle`: categories, sites, expandable segments, fixes
"""
from __future__ import annotations

from .limits import _MAX_FINDINGS
from .render import render_text, to_json
from .results import (BYTE_KEYS, Category, Collective, Diagnosis, ExplainResult, Finding, Fix, Kind, Phase,
                      ProcessUse)
from .sizes import GiB, MiB, format_bytes, parse_size
from .stream import explain_file, explain_stream, explain_text, read_lines

__all__ = [
    "BYTE_KEYS", "Category", "Collective", "Diagnosis", "ExplainResult", "Finding", "Fix", "GiB", "Kind", "MiB",
    "Phase", "ProcessUse", "explain_file", "explain_stream", "explain_text", "format_bytes", "parse_size",
    "read_lines", "render_text", "to_json",
    "_MAX_FINDINGS",   # not public; the tests read it as oomdoctor.explain._MAX_FINDINGS
]
