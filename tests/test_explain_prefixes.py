"""Prefix invariance of `oomdoctor explain`: every log in tests/logs, each line prefixed in the
styles real logs carry (syslog, journald, dmesg, Kubernetes, Docker, Ray, launchers' rank tags,
loggers, markdown quotes, CRLF), must give the same findings with the same numbers.

A metamorphic test: the expected answer is the unprefixed log's own, so it needs no per-log
expectation and covers every log added later. The prefixes are written from the formats the
tools print: rsyslog's RFC 3164 `<Mmm dd hh:mm:ss> <host> <tag>[pid]: `, `journalctl -o
short-iso`, `dmesg` and `dmesg -T`, the CRI log format Kubernetes stores (`<RFC3339Nano> stderr F `),
`kubectl logs --timestamps` / `docker logs -t`, `docker compose` service columns, Ray's
`(pid=N, ip=A)` and `(Actor pid=N, ip=A)`, torchrun `--tee` `[rankN]:`, horovodrun's
`[N]<stderr>:`, loguru's and Python logging's default formats, glog, markdown `> `."""
from __future__ import annotations

import io
import time
from pathlib import Path

import pytest

from oomdoctor import explain as ex
from oomdoctor.explain import scanner as ex_scanner

LOGS = Path(__file__).parent / "logs"


def _clock(i: int) -> str:
    return f"14:{(2 + i // 60) % 60:02d}:{i % 60:02d}"


# name -> (prefix of line i, whether the prefix names a rank)
STYLES = {
    "syslog": (lambda i: f"Mar 12 {_clock(i)} gpu-node-07 python3[48213]: ", False),
    "syslog_kernel": (lambda i: f"Mar  2 {_clock(i)} gpu-node-07 kernel: [{86400 + i}.{i * 37 % 1000000:06d}] ",
                      False),
    "journald_iso": (lambda i: f"2024-03-12T{_clock(i)}+0000 gpu-node-07 python3[48213]: ", False),
    "dmesg": (lambda i: f"[{86400 + i:>5}.{i * 37 % 1000000:06d}] ", False),
    "dmesg_T": (lambda i: f"[Tue Mar 12 {_clock(i)} 2024] ", False),
    "kubernetes_cri": (lambda i: f"2024-03-12T{_clock(i)}.{i * 7919 % 10**9:09d}Z stderr F ", False),
    "kubectl_timestamps": (lambda i: f"2024-03-12T{_clock(i)}.{i * 7919 % 10**9:09d}Z ", False),
    "docker_compose": (lambda i: "trainer-1  | ", False),
    "ray": (lambda i: "(pid=48213, ip=10.0.3.17) ", False),
    "ray_actor": (lambda i: "(RayTrainWorker pid=48213, ip=10.0.3.17) ", False),
    "rank": (lambda i: "[rank2]: ", True),
    "horovod": (lambda i: "[1]<stderr>: ", True),
    "stderr": (lambda i: "stderr: ", False),
    "loguru": (lambda i: f"2024-03-12 {_clock(i)}.{i % 1000:03d} | ERROR    | train:main:{100 + i} - ", False),
    "python_logging": (lambda i: f"2024-03-12 {_clock(i)},{i % 1000:03d} - train - ERROR - ", False),
    "glog": (lambda i: f"E0312 {_clock(i)}.{i % 1000000:06d} 48213 api.py:{869 + i}] ", False),
    "markdown": (lambda i: "> ", False),
    "crlf": (lambda i: "", False),
}


def _prefixed(data: bytes, style: str) -> bytes:
    text = data.decode("utf-16" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else "utf-8-sig")
    prefix, _ = STYLES[style]
    lines = text.split("\n")
    end = "\r\n" if style == "crlf" else "\n"
    if lines and lines[-1] == "":
        lines.pop()
        tail = end
    else:
        tail = ""
    return (end.join(prefix(i) + line.rstrip("\r") if line.strip() else line.rstrip("\r")
                     for i, line in enumerate(lines)) + tail).encode()


def _has_rank_prefix(data: bytes) -> bool:
    result = ex.explain_file(io.BytesIO(data))
    return any(f.ranks for f in result.findings)


def _essence(result: ex.ExplainResult, ranked_style: bool) -> list[dict]:
    """What must not change: per finding its kind, every number, every detail, the causes and fix
    ids in order, the phase and how often it was seen. A rank prefix adds that rank (and the
    world size it implies), and ranks are evidence the diagnosis uses (rank 2 on GPU 0: every
    rank on one GPU), so for those styles only the finding and its figures are compared."""
    out = []
    for f in ex.to_json(result)["findings"]:
        item = {k: f[k] for k in ("kind", "category", "title", "numbers", "derived", "details", "phase",
                                  "occurrences", "gpus", "line")}
        if not ranked_style:
            item["causes"] = [d["cause"] for d in f["diagnosis"]]
            item["fixes"] = [x["id"] for x in f["fixes"]]
            item["ranks"] = f["ranks"]
            item["diagnosis"] = [d["text"] for d in f["diagnosis"]]
            item["fix_titles"] = [x["title"] for x in f["fixes"]]
        out.append(item)
    return out


# the test logs and the real ones of tests/logs/public
LOG_NAMES = sorted(p.name for p in LOGS.glob("*.log")) + sorted("public/" + p.name for p in LOGS.glob("public/*.log"))


@pytest.mark.parametrize("style", sorted(STYLES))
def test_every_log_reads_the_same_under_a_line_prefix(style, monkeypatch):
    monkeypatch.setattr(ex_scanner, "_STRICT", True)
    _, ranked = STYLES[style]
    failures = []
    for name in LOG_NAMES:
        data = (LOGS / name).read_bytes()
        if ranked and _has_rank_prefix(data):
            continue   # a launcher's rank tag over another launcher's: no tool writes that
        plain = _essence(ex.explain_file(io.BytesIO(data)), ranked)
        prefixed = _essence(ex.explain_file(io.BytesIO(_prefixed(data, style))), ranked)
        if plain != prefixed:
            failures.append(name)
    assert failures == [], f"{style}: {len(failures)} log(s) read differently: {failures}"
