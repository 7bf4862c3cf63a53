"""Issue 22: explain generalizes - NCCL's generic codes with a diagnosis ladder, kills in every form,
rank failures that are not kills, and a finding for the last exception of any log with one.

Every log named here is in tests/logs (written from the formats NCCL, torchrun, the kernel and the
shells print); test_explain.py checks each one's kind and numbers, this file the diagnosis and fixes."""
from __future__ import annotations

from pathlib import Path

import pytest

from oomdoctor import explain as ex
from oomdoctor.explain import Kind
from oomdoctor.explain import scanner as ex_scanner

LOGS = Path(__file__).parent / "logs"


@pytest.fixture(autouse=True)
def strict_parser(monkeypatch):
    monkeypatch.setattr(ex_scanner, "_STRICT", True)


def findings(name: str) -> tuple[ex.Finding, ...]:
    with open(LOGS / name, "rb") as f:
        return ex.explain_file(f).findings


def only(name: str) -> ex.Finding:
    found = findings(name)
    assert len(found) == 1, [(f.kind, f.line) for f in found]
    return found[0]


def causes(f: ex.Finding) -> list[str]:
    return [d.cause for d in f.diagnosis]


def fix_ids(f: ex.Finding) -> list[str]:
    return [x.id for x in f.fixes]


# --- 1. NCCL's generic codes -----------------------------------------------------------------

@pytest.mark.parametrize("text, code, name", [
    ("terminate called after throwing an instance of 'std::runtime_error'\n  what():  NCCL Error 1: unhandled "
     "cuda error\n", 1, "ncclUnhandledCudaError"),
    ("RuntimeError: NCCL Error 2: unhandled system error\n", 2, "ncclSystemError"),
    ("RuntimeError: NCCL error in: ../torch/lib/c10d/ProcessGroupNCCL.cpp:514, unhandled system error, NCCL "
     "version 2.7.8\n", 2, "ncclSystemError"),
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
     "invalid argument (run with NCCL_DEBUG=WARN for details), NCCL version 2.19.3\nncclInvalidArgument: "
     "Invalid value for an argument.\n", 4, "ncclInvalidArgument"),
    ("nccl-tests: Test NCCL failure common.cu:958 'internal error'\n", 3, "ncclInternalError"),
    ("RuntimeError: ncclSystemError: System call (e.g. socket, malloc) or external library call failed or "
     "device error.\n", 2, "ncclSystemError"),
    ("NcclError: NCCL_ERROR_REMOTE_ERROR: remote process exited or there was a network error\n", 6,
     "ncclRemoteError"),
    ("horovod.common.exceptions.HorovodInternalError: ncclCommInitRank failed: unhandled system error\n", 2,
     "ncclSystemError"),
])
def test_every_nccl_spelling_names_its_code(text, code, name):
    f, = ex.explain_text(text).findings
    assert f.kind is Kind.NCCL_ERROR and f.numbers["nccl_result"] == code and f.details["status"] == name
    assert name in f.title
    assert f.cause == "nccl_relays_error" and "NCCL only relays it" in f.diagnosis[0].text


def test_unhandled_cuda_error_on_rtx4090_puts_p2p_first():
    f, omp = findings("nccl_error1_terminate_rtx4090.log")      # the OMP_NUM_THREADS note comes after it
    assert omp.kind is Kind.OMP_THREADS
    assert causes(f)[:5] == ["nccl_relays_error", "nccl_p2p", "nccl_gpu_memory", "nccl_driver_mismatch",
                             "nccl_shared_memory"]
    text = f.diagnosis[1].text
    assert "NVIDIA GeForce RTX 4090" in text and "no peer-to-peer support at all" in text
    # Without NCCL's WARN line the decisive step is to get it; then one fix per cause, in the same order.
    assert fix_ids(f) == ["nccl_debug_info", "nccl_p2p_disable", "free_memory_for_nccl", "match_driver", "grow_shm"]
    assert "NCCL_DEBUG=INFO" in f.fixes[0].title and "NCCL WARN" in f.fixes[0].title
    assert "NCCL_P2P_DISABLE=1" in f.fixes[1].title and "nvidia-smi topo -m" in f.fixes[1].title
    assert "--shm-size" in f.fixes[4].title


def test_relayed_cuda_failure_moves_its_cause_first_and_is_quoted():
    f = only("nccl_unhandled_last_error_driver.log")
    assert causes(f)[1] == "nccl_driver_mismatch"
    assert "CUDA driver version is insufficient for CUDA runtime version" in f.diagnosis[0].text
    assert "nccl_debug_info" not in fix_ids(f)          # the log already has what NCCL_DEBUG would show
    assert "torch.version.cuda" in f.fixes[0].title


def test_system_error_with_a_full_dev_shm_says_shared_memory_first():
    f = only("nccl_system_error_shm_fallocate.log")
    assert causes(f)[1] == "nccl_shared_memory" and fix_ids(f)[0] == "grow_shm"
    assert "posix_fallocate" in f.diagnosis[0].text and "64 MiB" in f.diagnosis[1].text


def test_remote_error_points_at_the_other_rank():
    f = only("nccl_remote_error.log")
    assert "NET/IB : Got completion from peer" in f.details["last_error"]
    assert "another rank" in f.diagnosis[1].text and "--log-dir" in f.fixes[-1].title


def test_invalid_usage_with_duplicate_gpu_says_set_device():
    f = only("nccl_invalid_usage_duplicate_gpu.log")
    assert "Duplicate GPU detected" in f.diagnosis[0].text
    assert "torch.cuda.set_device(local_rank)" in f.fixes[0].title


def test_horovod_prefix_and_call_name():
    f = only("horovod_comm_init_unhandled.log")
    assert f.details["call"] == "ncclCommInitRank" and f.ranks == (0, 1)


@pytest.mark.parametrize("name, kind", [
    ("p2p_unsupported.log", Kind.P2P), ("nccl_warn_cuda_failure_oom.log", Kind.NCCL_CUDA_OOM),
    ("nccl_calloc_oom.log", Kind.NCCL_CUDA_OOM), ("nccl_shm_docker.log", Kind.SHARED_MEMORY),
    ("nccl_shm_permission.log", Kind.SHARED_MEMORY),
])
def test_specific_nccl_findings_stay_more_specific(name, kind):
    # These logs also carry "unhandled cuda/system error": NCCL relaying what the WARN line names.
    assert only(name).kind is kind


def test_nccl_finding_fields_reach_json():
    data = ex.to_json(ex.explain_text((LOGS / "nccl_unhandled_last_error_driver.log").read_text()))
    f = data["findings"][0]
    assert f["kind"] == "nccl_error" and f["numbers"]["nccl_result"] == 1
    assert f["details"]["cuda_failure"].startswith("CUDA driver version is insufficient")


# --- 2. kills in every form ------------------------------------------------------------------

@pytest.mark.parametrize("line", [
    "Killed",
    "./run.sh: line 7: 48213 Killed                  python preprocess.py",
    "bash: line 1: 60211 Killed python -u finetune.py --model llama",
    "[1]+  Killed                  python train.py",
    "[1]  + 48213 killed     python train.py --bs 64",
    "zsh: killed     python prep.py --workers 32",
    "./train.sh: 12: Killed",
    "Killed: 9",
    "srun: error: gpu017: task 0: Killed",
    "Map:  61%|######    | 612000/1000000 [02:11<01:23, 4650.21 examples/s]Killed",
    "fish: Job 1, 'python train.py' terminated by signal SIGKILL (Forced quit)",
    "subprocess.CalledProcessError: Command '['python', 'train.py']' died with <Signals.SIGKILL: 9>.",
    "subprocess.CalledProcessError: Command '['python', 'train.py']' returned non-zero exit status -9.",
    "  Reason:       OOMKilled",
    "srun: error: gpu042: task 0: Out Of Memory",
    "Mar  3 02:17:44 gpu-node-07 kernel: [1840022.551203] Out of memory: Killed process 771204 (python3) "
    "total-vm:96533448kB, anon-rss:62914560kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:124880kB "
    "oom_score_adj:0",
    "Killed process 30117 (python) total-vm:41943040kB, anon-rss:31457280kB, file-rss:1024kB",
    "Memory cgroup out of memory: Kill process 2211 (python) score 1000 or sacrifice child",
])
def test_every_kill_form_is_a_host_memory_kill(line):
    f, = ex.explain_text(line + "\n").findings
    assert f.kind is Kind.OOM_KILLER and f.cause == "host_oom_killer"
    assert "host RAM" in f.diagnosis[-1].text


@pytest.mark.parametrize("line", [
    "The job was Killed by the admin, we think", "Killed 3 stale sessions in 0.2 s", "killed_count = 0",
    "DataLoader worker (pid 30731) is killed by signal: Killed.",
])
def test_prose_about_killing_is_not_a_shell_kill(line):
    kinds = [f.kind for f in ex.explain_text(line + "\n").findings]
    assert Kind.OOM_KILLER not in kinds


def test_kernel_numbers_parse_in_every_wording():
    f = only("kernel3_kill_sacrifice_child.log")
    assert f.numbers["oom_score"] == 931 and f.numbers["anon_rss"] == 31457280 * 1024
    assert "which held 30.00 GiB of host RAM" in f.diagnosis[0].text
    g = only("cgroup_memcg_oom.log")
    assert g.numbers["cgroup_limit"] == 32 * 2**30 and g.details["constraint"] == "CONSTRAINT_MEMCG"


def test_one_kill_reported_by_shell_slurm_and_cgroup_is_one_finding():
    f = only("slurm_killed_and_oom_event.log")
    assert f.occurrences == 3 and f.kind is Kind.OOM_KILLER
    both = "srun: error: gpu017: task 0: Killed\nslurmstepd: error: Detected 1 oom_kill event in StepId=1.0.\n"
    assert len(ex.explain_text(both).findings) == 1


# --- 3. rank failures that are not kills ----------------------------------------------------

def test_exit_code_1_is_not_the_error_and_says_where_it_is():
    f = only("torchrun_exitcode1_table.log")
    assert f.occurrences == 2                         # the failure line and the Root Cause table
    text = f.diagnosis[0].text
    assert "not the error" in text and "uncaught exception" in text and "Rank(s) 0" in text
    assert "--log-dir" in f.fixes[0].title and "@record" in f.fixes[1].title
    assert "TORCHELASTIC_ERROR_FILE" in f.fixes[1].title


@pytest.mark.parametrize("name, words", [
    ("torchrun_sigsegv_sigabrt.log", "segmentation fault"),
    ("mp_spawn_abort.log", "aborted"),
    ("deepspeed_return_code_1.log", "uncaught exception"),
])
def test_each_exit_code_says_what_it_means(name, words):
    assert words in only(name).diagnosis[0].text


def test_rank_failure_with_its_oom_is_the_oom():
    text = ("[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total "
            "capacity of 23.69 GiB of which 1.06 GiB is free.\n"
            "E0611 04:12:09.330000 1 api.py:869] failed (exitcode: 1) local_rank: 1 (pid: 5522) of binary: python\n")
    assert [f.kind for f in ex.explain_text(text).findings] == [Kind.CUDA_OOM]


# --- 5. never "no known error" for a traceback, an Error: line or a kill --------------------

def test_last_exception_says_not_memory_and_why():
    f = only("traceback_value_error.log")
    assert f.category is ex.Category.NOT_OOM and f.details["memory_related"] == "no"
    assert "mat1 and mat2 shapes" in f.details["message"]
    assert "neither its type nor its message mentions memory" in f.diagnosis[0].text
    assert "forward() in /home/li/cls/model.py" in f.diagnosis[0].text
    assert "NOT an out-of-memory error" in ex.render_text(ex.explain_text((LOGS / "traceback_value_error.log")
                                                                          .read_text()))


def test_error_line_with_memory_words_is_possibly_memory():
    f = only("error_line_memory_words.log")
    assert f.details["memory_related"] == "possibly" and "'memory'" in f.diagnosis[0].text
    assert "NOT an out-of-memory error" not in ex.render_text(ex.ExplainResult((f,), 2, {}))


@pytest.mark.parametrize("text", [
    "Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\nKeyError: 'label'\n",
    "ValueError: too many values to unpack (expected 2)\n",
    "Error: no such file: data/train.jsonl\n",
    "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients joined.\n",
])
def test_a_log_with_an_error_line_always_gets_a_finding(text):
    f, = ex.explain_text(text).findings
    assert f.kind is Kind.EXCEPTION and f.details["memory_related"] == "no"


def test_the_exception_fallback_stays_out_when_a_known_error_is_found():
    result = ex.explain_text((LOGS / "torch20_reserved_3090.log").read_text() + "ValueError: later\n")
    assert [f.kind for f in result.findings] == [Kind.CUDA_OOM]
