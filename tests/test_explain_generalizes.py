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
    f = only("nccl_error1_terminate_rtx4090.log")
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
