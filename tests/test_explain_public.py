"""Issue 33: real logs from public threads (tests/logs/public, each with its URL in sources.json) - the
kinds and numbers each states, the invariant that a failure never reads as "no known error", text that
fits the log (ranks, process counts, the OMP_NUM_THREADS value), XLA/TF size notation, hard-wrapped
messages, and snapshot fixes that never repeat what the step already does."""
from __future__ import annotations

import json
import pickle
from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner

from oomdoctor import explain as ex
from oomdoctor.cli import cli
from oomdoctor.explain import Kind
from oomdoctor.explain import scanner as ex_scanner
from oomdoctor.explain.snapshot_report import explain_snapshot

PUBLIC = Path(__file__).parent / "logs" / "public"
SOURCES = {k: v for k, v in json.loads((PUBLIC / "sources.json").read_text()).items() if not k.startswith("_")}
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def value(text: str) -> int:
    """'11500204 KiB' -> bytes, '480' -> 480: computed here, not by oomdoctor's parser."""
    number, _, unit = text.partition(" ")
    return int(Decimal(number) * _UNITS.get(unit, 1))


@pytest.fixture(autouse=True)
def strict_parser(monkeypatch):
    monkeypatch.setattr(ex_scanner, "_STRICT", True)


def findings(name: str) -> tuple[ex.Finding, ...]:
    with open(PUBLIC / name, "rb") as f:
        return ex.explain_file(f).findings


def finding(name: str, kind: Kind) -> ex.Finding:
    found = [f for f in findings(name) if f.kind is kind]
    assert len(found) == 1, [f.kind for f in findings(name)]
    return found[0]


def words(f: ex.Finding) -> str:
    return " ".join([d.text for d in f.diagnosis] + [x.title + " " + x.detail for x in f.fixes])


# --- every real log: its kinds and its numbers ---------------------------------------------------

def test_every_public_log_has_a_source_and_expectations():
    assert {p.name for p in PUBLIC.glob("*.log")} == set(SOURCES)
    assert all(s["url"].startswith("https://") and s["kinds"] for s in SOURCES.values())
    assert sum(s["set"] == "held-out" for s in SOURCES.values()) == 25


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_public_log_kinds_and_numbers(name):
    want = SOURCES[name]
    found = findings(name)
    assert found, "a failure must never read as 'no known error'"
    assert set(want["kinds"]) == {f.kind.value for f in found}
    values = {v for f in found for v in (*f.numbers.values(), *f.derived.values())}
    assert {k for k, v in want["numbers"].items() if value(v) not in values} == set()
    if "ranks" in want:
        assert tuple(want["ranks"]) in {f.ranks for f in found}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_public_log_renders_and_serialises(name):
    with open(PUBLIC / name, "rb") as f:
        result = ex.explain_file(f)
    text = ex.render_text(result)
    assert all(line.isascii() for line in text.splitlines() if not line.startswith("    > "))
    for f in json.loads(json.dumps(ex.to_json(result)))["findings"]:
        assert all(isinstance(v, int) for v in (*f["numbers"].values(), *f["derived"].values()))
        assert f["diagnosis"] and f["fixes"]


# --- the invariant: a signal backtrace, a kill, a ChildFailedError or a traceback is a finding ----

@pytest.mark.parametrize("text, kind", [
    ("[host:12:0:13] Caught signal 11 (Segmentation fault: address not mapped to object at address 0x8)\n",
     Kind.NATIVE_CRASH),
    ("==== backtrace (tid:   3095) ====\n 0 0x0000000000043090 killpg()  ???:0\n", Kind.NATIVE_CRASH),
    ("*** SIGSEGV received at time=1700000000 on cpu 3 ***\n", Kind.NATIVE_CRASH),
    ("Fatal Python error: Segmentation fault\n\nThread 0x00007f (most recent call first):\n", Kind.NATIVE_CRASH),
    ("train.sh: line 4: 1234 Segmentation fault      (core dumped) python train.py\n", Kind.NATIVE_CRASH),
    ("Fatal Python error: Bus error\n", Kind.SHARED_MEMORY),
    ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n", Kind.RANK_FAILED),
    ("[2024-01-01 00:00:00,000] [INFO] [launch.py:316:sigkill_handler] Killing subprocess 4242\n", Kind.RANK_FAILED),
    ("Killing subprocess 4242\n", Kind.RANK_FAILED),
    ("Jan  1 00:00:00 node kernel: Killed process 77 (python) total-vm:100kB, anon-rss:90kB, file-rss:0kB\n",
     Kind.OOM_KILLER),
    ("Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n    main()\n", Kind.EXCEPTION),
])
def test_a_failure_never_reads_as_no_known_error(text, kind):
    found = ex.explain_text(text).findings
    assert [f.kind for f in found] == [kind]


def test_a_traceback_closed_by_ctrl_c_is_not_cut():
    text = "Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\nKeyboardInterrupt\n"
    assert ex.explain_text(text).findings == ()


def test_cut_traceback_asks_for_its_last_line():
    f, = ex.explain_text("Traceback (most recent call last):\n  File \"train.py\", line 9, in main\n").findings
    assert f.cause == "traceback_cut" and f.details["memory_related"] == "unknown"


def test_launcher_stop_gives_way_to_its_exit_code():
    text = ("[INFO] [launch.py:316:sigkill_handler] Killing subprocess 30412\n"
            "[ERROR] [launch.py:322:sigkill_handler] ['python', 'train.py'] exits with return code = 1\n")
    f, = ex.explain_text(text).findings
    assert f.kind is Kind.RANK_FAILED and f.numbers["exit_code"] == 1


# --- kills and launchers: what the numbers in the log support -------------------------------------

def test_deepspeed_memory_report_is_read_and_weighed():
    f = finding("deepspeed_see_memory_usage_killing_subprocess.log", Kind.RANK_FAILED)
    assert f.numbers["host_used"] == value("28.43 GiB")
    assert f.derived["host_total"] == value("28.43 GiB") * 1000 // 226
    text = words(f)
    assert "DeepSpeed's launcher killed the other workers" in text and "22.6%" in text
    assert "dmesg -T | grep -i 'killed process'" in text
    assert "host_ram_report" in [d.cause for d in f.diagnosis]


def test_a_nearly_full_host_makes_the_oom_killer_likely():
    text = ("[INFO] [utils.py:838:see_memory_usage] CPU Virtual Memory:  used = 26.4 GB, percent = 84.6%\n"
            "[INFO] [launch.py:318:sigkill_handler] Killing subprocess 80\n")
    f, = ex.explain_text(text).findings
    assert [d.cause for d in f.diagnosis][1] == "host_ram_nearly_full"
    assert "84.6%" in f.diagnosis[1].text and "likely" in f.diagnosis[1].text


def test_kernel_kill_variants_read_every_figure():
    f = finding("kernel_killed_process_uid_comma.log", Kind.OOM_KILLER)
    assert f.details["process"] == "mysqld" and f.numbers["file_rss"] == 768 * 1024
    g = finding("dmesg_thousands_separators.log", Kind.OOM_KILLER)
    assert g.numbers["total_vm"] == 26184840 * 1024 and "14.66 GiB" in g.diagnosis[0].text


# --- signals caught in native libraries ---------------------------------------------------------

def test_bus_error_in_libnccl_is_dev_shm_in_a_container():
    f = finding("bus_error_libnccl_childfailed.log", Kind.SHARED_MEMORY)
    assert f.cause == "shared_memory_sigbus"
    assert "ncclGroupEnd" in f.diagnosis[0].text and "8d6bf97c3bf4" in f.diagnosis[0].text
    assert [x.id for x in f.fixes] == ["grow_shm", "nccl_shm_disable"]


def test_segfault_names_the_library():
    f = finding("native_segfault_caught_cublas.log", Kind.NATIVE_CRASH)
    assert "cublasSetStream_v2" in f.diagnosis[0].text and f.category is ex.Category.NOT_OOM


# --- NCCL's heartbeat abort, and hard wraps in general ------------------------------------------

HEARTBEAT = ("[PG ID 0 PG GUID 0(default_pg) Rank 3] ProcessGroupNCCL's watchdog got stuck for 480 seconds without "
             "making progress in monitoring enqueued collectives. This typically indicates a NCCL/CUDA API (e.g., "
             "CudaEventDestroy) hang blocking the watchdog, and could be triggered by another thread holding the GIL "
             "inside a CUDA api (for example, CudaEventDestroy), or other deadlock-prone behaviors.If you suspect the "
             "watchdog is not actually stuck and a longer timeout would help, you can either increase the timeout "
             "(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC) to a larger value or disable the heartbeat monitor "
             "(TORCH_NCCL_ENABLE_MONITORING=0).")


@pytest.mark.parametrize("width", [60, 80, 117, 200, 10_000])
def test_heartbeat_abort_reads_the_same_wrapped_at_any_width(width):
    """A terminal cuts the line at its width, mid-word; only the first piece keeps the [rank3]: prefix."""
    line = "[rank3]:[E429 13:55:49.384372190 ProcessGroupNCCL.cpp:1743] " + HEARTBEAT
    text = "\n".join(line[i:i + width] for i in range(0, len(line), width)) + "\n"
    f, = ex.explain_text(text).findings
    assert f.kind is Kind.NCCL_TIMEOUT and f.numbers["heartbeat_timeout_s"] == 480 and f.ranks == (3,)
    assert f.cause == "nccl_watchdog_stuck" and f.fixes[0].id == "find_hung_rank"


def test_heartbeat_beside_a_collective_timeout_counts_its_ranks_as_reporting():
    f = finding("nccl_heartbeat_and_watchdog_timeout.log", Kind.NCCL_TIMEOUT)
    assert f.ranks == (2, 5, 7)
    straggler = next(d.text for d in f.diagnosis if d.cause == "straggler_rank")
    assert "0, 1, 3, 4, 6" in straggler


# --- DataParallel's imbalance warning, P2P from NCCL's debug output ------------------------------

@pytest.mark.parametrize("name, weak, strong", [("dataparallel_imbalance_cudalaunch_oom.log", 0, 1),
                                                ("dataparallel_imbalance_thcudacheck.log", 1, 0)])
def test_imbalance_warning_says_gpu0_holds_more_and_ddp_fixes_it(name, weak, strong):
    f = finding(name, Kind.CUDA_ERROR_OOM)
    text = next(d.text for d in f.diagnosis if d.cause == "dataparallel_imbalance")
    assert f"GPU {weak} has less than 75%" in text and "GPU 0 holds more" in text
    ids = [x.id for x in f.fixes]
    assert ids[:2] == ["exclude_small_gpu", "ddp_not_dp"]
    assert f"CUDA_VISIBLE_DEVICES={strong}" in f.fixes[0].title


def test_nccl_debug_output_ending_in_init_on_rtx4090_is_a_p2p_hang():
    f = finding("nccl_call_hang_rtx4090.log", Kind.P2P)
    assert f.cause == "nccl_p2p_hang" and "RTX 4090" in f.diagnosis[0].text
    assert "nvidia-smi topo -p2p r" in f.diagnosis[0].text and f.fixes[0].id == "nccl_p2p_disable"


def test_nccl_init_on_a_datacenter_card_is_not_called_a_p2p_hang():
    text = ("GPU 0: NVIDIA A100-SXM4-80GB\nhost:1:1 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>\n"
            "host:1:1 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so)\n")
    assert ex.explain_text(text).findings == ()


def test_could_not_enable_p2p_names_the_pair():
    f = finding("ddp_hang_could_not_enable_p2p.log", Kind.P2P)
    assert f.details["unsupported_pairs"] == "GPU0-GPU1" and "GPU 0 and GPU 1" in f.diagnosis[0].text


# --- sizes in every notation frameworks print ----------------------------------------------------

@pytest.mark.parametrize("text, key, expected", [
    ("jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
     "28.82G (30950542336 bytes).\n", "requested", 30950542336),
    ("RESOURCE_EXHAUSTED: Attempting to reserve 15.48G at the bottom of memory. That was not possible. "
     "There are 7.48G free, 0B reserved, and 7.48G reservable.\n", "requested", int(Decimal("15.48") * 2**30)),
    ("RuntimeError: RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 7.48G of 7.48G hbm. "
     "Exceeded hbm capacity by 0B.\n", "hbm_capacity", int(Decimal("7.48") * 2**30)),
    ("XlaRuntimeError: RESOURCE_EXHAUSTED: Failed to allocate request for 2.99GiB (3206250496B) on device "
     "ordinal 0\n", "requested", 3206250496),
    ("E tensorflow/stream_executor/cuda/cuda_driver.cc:828] failed to allocate 28.82G (30950542336 bytes) from "
     "device: CUDA_ERROR_OUT_OF_MEMORY: out of memory\n", "requested", 30950542336),
    ("Top-of-Memory reserved:  529.00M (     554,696,704 bytes)\nRuntimeError: Resource exhausted: Attempting to "
     "reserve 3.95G at the bottom of memory. That was not possible. There are 1.92G free.\n",
     "hbm_free", int(Decimal("1.92") * 2**30)),
])
def test_xla_and_tensorflow_size_notation(text, key, expected):
    f, = ex.explain_text(text).findings
    assert f.numbers[key] == expected


def test_tpu_diagnosis_is_about_the_core_hbm_not_gpu_preallocation():
    f = finding("tpu_hbm_used_of_capacity.log", Kind.JAX_OOM)
    assert f.cause == "tpu_hbm_exhausted" and "1.60 GiB over" in f.diagnosis[0].text
    assert "XLA_PYTHON_CLIENT" not in words(f) and f.title.startswith("XLA out of TPU memory")


# --- torchrun's OMP_NUM_THREADS warning ---------------------------------------------------------

@pytest.mark.parametrize("name", ["omp_warning_alone_run.log", "omp_warning_alone_main.log"])
def test_omp_warning_alone_is_a_note_with_what_when_and_the_value(name):
    f, = findings(name)
    assert f.kind is Kind.OMP_THREADS and f.category is ex.Category.LAUNCH
    text = words(f)
    assert "set it to 1 in every process" in text                      # what torchrun did
    assert "CPU" in text and "data pipeline" in text                    # when it matters
    assert "OMP_NUM_THREADS=<usable cores / processes per node>" in f.fixes[0].title   # the value


def test_omp_value_uses_the_logs_process_count():
    f = finding("omp_and_invalid_ordinal_launch.log", Kind.OMP_THREADS)
    assert f.numbers["nproc_per_node"] == 2 and "OMP_NUM_THREADS=$(( $(nproc) / 2 ))" in f.fixes[0].title


def test_omp_note_comes_after_the_error_and_keeps_the_cli_exit_code_0(tmp_path):
    kinds = [f.kind for f in findings("omp_invalid_ordinal_ranks_2_3_4.log")]
    assert kinds == [Kind.INVALID_DEVICE_ORDINAL, Kind.OMP_THREADS]
    res = CliRunner().invoke(cli, ["explain", str(PUBLIC / "omp_warning_alone_run.log")])
    assert res.exit_code == 0 and res.stdout.startswith("Found 0 error(s) and 1 note(s) that are not errors")


def test_omp_beside_an_exception_keeps_the_exception():
    text = ((PUBLIC / "omp_warning_alone_run.log").read_text()
            + "Traceback (most recent call last):\n  File \"t.py\", line 1, in <module>\nValueError: bad shape\n")
    assert [f.kind for f in ex.explain_text(text).findings] == [Kind.EXCEPTION, Kind.OMP_THREADS]


# --- invalid device ordinal: the log's own ranks and counts --------------------------------------

def test_ordinal_text_uses_the_failed_ranks_of_the_table():
    f = finding("omp_invalid_ordinal_ranks_2_3_4.log", Kind.INVALID_DEVICE_ORDINAL)
    assert f.ranks == (2, 3, 4)
    text = f.diagnosis[0].text
    assert "local ranks 2, 3 and 4 failed" in text and "sees 2 GPUs" in text
    assert "local rank 2 and above find only GPUs 0-1" in text and "local_rank 1" not in text
    assert "--nproc_per_node=2" in f.fixes[0].title


def test_ordinal_text_uses_the_launchers_process_count():
    f = finding("omp_and_invalid_ordinal_launch.log", Kind.INVALID_DEVICE_ORDINAL)
    text = f.diagnosis[0].text
    assert "2 processes per node (--nproc_per_node=2)" in text and "local rank 1 finds only GPU 0" in text
    assert "--nproc_per_node=1 (it was 2)" in f.fixes[0].title


@pytest.mark.parametrize("ranks, procs, expect", [
    ((1,), 2, "local rank 1 finds only GPU 0"),
    ((2, 3), 4, "local rank 2 and above find only GPUs 0-1"),
    ((4, 5, 6, 7), 8, "local rank 4 and above find only GPUs 0-3"),
    ((0, 1), 2, "sees no GPU at all"),
])
def test_ordinal_text_follows_whichever_ranks_failed(ranks, procs, expect):
    text = (f"torchrun --nproc_per_node={procs} train.py\n"
            + "".join(f"[rank{r}]: RuntimeError: CUDA error: invalid device ordinal\n" for r in ranks))
    f, = [f for f in ex.explain_text(text).findings if f.kind is Kind.INVALID_DEVICE_ORDINAL]
    assert f.ranks == ranks and expect in f.diagnosis[0].text


# --- snapshots: no fix that the step already does -----------------------------------------------

def _snapshot(tmp_path, *args: str):
    path = tmp_path / "step.pickle"
    res = CliRunner().invoke(cli, ["estimate", "sample_models/gpt2_small.py", "-b", "1", "--gpu", "rtx3090",
                                   "--snapshot", str(path), *args])
    assert res.exit_code in (0, 1), res.output
    with open(path, "rb") as f:
        return explain_snapshot(f, str(path))


def test_bf16_autocast_snapshot_never_suggests_mixed_precision(tmp_path):
    bf16, fp32 = _snapshot(tmp_path, "--precision", "bf16"), _snapshot(tmp_path)
    assert "mixed_precision" in [x.id for x in fp32.fixes] and fp32.already == ()
    assert "mixed_precision" not in [x.id for x in bf16.fixes] and bf16.already == ("autocast",)


def test_checkpointed_snapshot_never_suggests_checkpointing(tmp_path):
    r = _snapshot(tmp_path, "--checkpointing")
    assert "checkpointing" in r.already and "activation_checkpointing" not in [x.id for x in r.fixes]


def test_a_real_snapshots_stacks_show_what_it_already_does(tmp_path):
    """A recorded snapshot (stacks='all'): ATen's autocast cast, torch.utils.checkpoint, an expandable
    allocator - none of their fixes is offered again."""
    frames = [{"filename": "??", "line": 0, "name": "at::autocast::cached_cast(c10::ScalarType, at::Tensor)"},
              {"filename": "/usr/lib/python3/site-packages/torch/utils/checkpoint.py", "line": 1, "name": "forward"},
              {"filename": "/home/me/train.py", "line": 40, "name": "forward"}]
    block = {"address": 0, "size": 2**20, "requested_size": 2**20, "state": "active_allocated", "frames": frames}
    data = {"segments": [{"address": 0, "total_size": 2**21, "segment_type": "large", "is_expandable": True,
                          "blocks": [block, {"address": 2**20, "size": 2**20, "state": "inactive"}]}],
            "device_traces": [[{"action": "alloc", "addr": 0, "size": 2**20, "frames": frames}]],
            "allocator_settings": {"expandable_segments": True}}
    path = tmp_path / "real.pickle"
    path.write_bytes(pickle.dumps(data))
    with open(path, "rb") as f:
        r = explain_snapshot(f, str(path))
    assert r.already == ("autocast", "checkpointing", "expandable_segments")
    ids = {x.id for x in r.fixes}
    assert not ids & {"mixed_precision", "activation_checkpointing", "expandable_segments"}
    assert "already on" in r.expandable_text


def test_a_real_bf16_autocast_snapshot_is_seen_as_autocast():
    """Recorded on an H200 (tests/logs/snapshots/README.md): python stacks only, yet torch.amp's frames
    show the autocast step, and mixed precision is not offered."""
    path = Path(__file__).parent / "logs" / "snapshots" / "gpt2_small_b2_bf16_autocast.pickle"
    with open(path, "rb") as f:
        r = explain_snapshot(f, str(path))
    assert r.already == ("autocast",) and "mixed_precision" not in [x.id for x in r.fixes]
    assert "activation_checkpointing" in [x.id for x in r.fixes]     # which it does not do
