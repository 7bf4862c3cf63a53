"""Tests for `oomdoctor explain`: extraction of every number, diagnoses, robustness, CLI."""
from __future__ import annotations

import builtins
import io
import json
import re
import tracemalloc
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomdoctor import explain as ex
from oomdoctor.cli import EXIT_OK, EXIT_PROBLEM, cli
from oomdoctor.explain import Kind, Phase
from oomdoctor.explain import scanner as ex_scanner

LOGS = Path(__file__).parent / "logs"

_SCALE = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "GB": 2**30, "MB": 2**20}


def sz(text: str) -> int:
    """The byte count a printed size stands for, computed independently of the parser:
    '111.88 MiB' -> int(111.88 * 2**20)."""
    number, unit = text.split()
    return int(float(number) * _SCALE[unit])


@pytest.fixture(autouse=True)
def strict_parser(monkeypatch):
    # In production a parser bug in one region is counted and skipped; in tests it must fail.
    monkeypatch.setattr(ex_scanner, "_STRICT", True)   # read by the scanner, where it lives


def explain_file(name: str) -> ex.ExplainResult:
    with open(LOGS / name, "rb") as f:
        return ex.explain_stream(ex.read_lines(f))


def only(result: ex.ExplainResult) -> ex.Finding:
    assert len(result.findings) == 1, [f.kind for f in result.findings]
    return result.findings[0]


# --- sizes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("1.50 GiB", 1610612736),
    ("111.88 MiB", int(111.88 * 2**20)),
    ("0 bytes", 0),
    ("512 bytes", 512),
    ("1 byte", 1),
    ("1024.00 MiB", 2**30),
    ("1003.50 KiB", int(1003.50 * 2**10)),
    ("17179869184.00 GiB", 2**64),
    ("17.68 GB", int(17.68 * 2**30)),      # MPS labels binary sizes "GB"
    ("184. MiB", 184 * 2**20),             # NumPy's three-significant-digit format
    ("31.75GiB", int(31.75 * 2**30)),
])
def test_parse_size_exact_bytes(text, expected):
    assert ex.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "1.5", "1.5 parsecs", "-1 GiB", "1,5 GiB"])
def test_parse_size_rejects_non_sizes(text):
    with pytest.raises(ValueError, match="not a size"):
        ex.parse_size(text)


@pytest.mark.parametrize("n, text", [
    (0, "0 bytes"), (1023, "1023 bytes"), (1024, "1.00 KiB"), (1610612736, "1.50 GiB"),
    (2**40, "1.00 TiB"), (-(2**30), "-1.00 GiB"),
])
def test_format_bytes_iec(n, text):
    assert ex.format_bytes(n) == text


# --- every log in tests/logs: kind and every stated number ----------------------------------

EXPECTED = {
    "torch20_reserved_3090.log": dict(
        kind=Kind.CUDA_OOM, gpus=(0,), phase=Phase.BACKWARD, cause="model_or_batch_too_big",
        numbers=dict(requested=sz("1.50 GiB"), capacity=sz("23.69 GiB"), allocated=sz("21.93 GiB"),
                     free=sz("111.88 MiB"), reserved=sz("23.27 GiB")),
        derived=dict(reserved_unallocated=sz("23.27 GiB") - sz("21.93 GiB"),
                     shortfall=sz("1.50 GiB") - sz("111.88 MiB")),
        details=dict(format="torch 1.5-2.0")),
    "torch14_cached.log": dict(
        kind=Kind.CUDA_OOM, phase=Phase.FORWARD, cause="model_or_batch_too_big",
        numbers=dict(requested=sz("512.00 MiB"), capacity=sz("10.92 GiB"), allocated=sz("9.81 GiB"),
                     free=sz("190.56 MiB"), reserved_unallocated=sz("4.68 MiB")),
        derived=dict(reserved=sz("9.81 GiB") + sz("4.68 MiB")),
        details=dict(format="torch<=1.4")),
    "torch21_capacty_fragmentation.log": dict(
        kind=Kind.CUDA_OOM, phase=Phase.FORWARD, cause="fragmentation", first_fix="expandable_segments",
        numbers=dict(requested=sz("3.20 GiB"), capacity=sz("15.77 GiB"), free=sz("2.41 GiB"),
                     allocated=sz("7.02 GiB"), reserved_unallocated=sz("5.88 GiB")),
        details=dict(format="torch 2.1")),
    "torch22_two_trainings.log": dict(
        kind=Kind.CUDA_OOM, gpus=(1,), phase=Phase.FORWARD, cause="other_process", first_fix="one_job_per_gpu",
        numbers=dict(requested=sz("768.00 MiB"), capacity=sz("23.68 GiB"), free=sz("301.06 MiB"),
                     this_process=sz("12.17 GiB"), allocated=sz("11.02 GiB"),
                     reserved_unallocated=sz("692.40 MiB")),
        processes=[(48211, sz("11.20 GiB"))],
        derived=dict(other_processes=sz("11.20 GiB"), reserved=sz("11.02 GiB") + sz("692.40 MiB")),
        details=dict(format="torch>=2.2")),
    "torch22_container_self.log": dict(
        kind=Kind.CUDA_OOM, causes={"container_pid_namespace"}, not_causes={"other_process"},
        numbers=dict(requested=sz("496.00 MiB"), capacity=sz("14.75 GiB"), free=sz("235.06 MiB"),
                     allocated=sz("14.06 GiB"), reserved_unallocated=sz("330.42 MiB")),
        processes=[(20398, sz("14.52 GiB"))]),
    "torch22_private_pools_allowed.log": dict(
        kind=Kind.CUDA_OOM, cause="memory_fraction_limit", first_fix="raise_memory_fraction",
        numbers=dict(requested=sz("2.00 MiB"), capacity=sz("79.15 GiB"), free=sz("70.12 GiB"),
                     this_process=sz("8.99 GiB"), limit=sz("8.00 GiB"), allocated=sz("7.31 GiB"),
                     private_pools=sz("120.00 MiB"), reserved_unallocated=sz("584.12 MiB")),
        derived=dict(reserved=sz("7.31 GiB") + sz("120.00 MiB") + sz("584.12 MiB"))),
    "hard_wrapped_80col.log": dict(
        kind=Kind.CUDA_OOM, cause="fragmentation",
        numbers=dict(requested=sz("31.75 GiB"), capacity=sz("79.25 GiB"), free=sz("22.44 GiB"),
                     this_process=sz("56.80 GiB"), allocated=sz("31.75 GiB"),
                     reserved_unallocated=sz("24.37 GiB"))),
    "torchrun_midline_interleave.log": dict(
        kind=Kind.CUDA_OOM, ranks=(0, 1), gpus=(0, 1), occurrences=2,
        numbers=dict(requested=sz("4.00 GiB"), capacity=sz("39.39 GiB"), free=sz("3.11 GiB"),
                     allocated=sz("33.90 GiB"), reserved_unallocated=sz("1.71 GiB"))),
    "windows_spill.log": dict(
        kind=Kind.CUDA_OOM, cause="windows_shared_memory_spill", causes={"request_exceeds_capacity"},
        numbers=dict(requested=sz("10.73 GiB"), capacity=sz("8.00 GiB"), allocated=sz("17.20 GiB"),
                     free=0, reserved=sz("19.15 GiB"))),
    "truncated_progress_bar.log": dict(
        kind=Kind.CUDA_OOM, gpus=(), numbers=dict(requested=sz("20.00 MiB")), cause="out_of_memory"),
    "midword_excerpt.log": dict(
        kind=Kind.CUDA_OOM, gpus=(0,),
        numbers=dict(requested=sz("58.00 MiB"), capacity=sz("3.94 GiB"), allocated=sz("3.21 GiB"),
                     free=sz("42.75 MiB"), reserved=sz("3.35 GiB"))),
    "no_trailing_newline_1024mib.log": dict(
        kind=Kind.CUDA_OOM,
        numbers=dict(requested=sz("1024.00 MiB"), capacity=sz("7.79 GiB"), allocated=sz("6.50 GiB"), free=0,
                     reserved=sz("6.80 GiB"))),
    "jupyter_eval_without_no_grad.log": dict(
        kind=Kind.CUDA_OOM, phase=Phase.EVALUATION, cause="evaluation_without_no_grad",
        first_fix="evaluation_no_grad",
        numbers=dict(requested=sz("3.00 GiB"), capacity=sz("23.69 GiB"), allocated=sz("19.64 GiB"),
                     free=sz("2.17 GiB"), reserved=sz("20.88 GiB"))),
    "pytest_E_prefix.log": dict(
        kind=Kind.CUDA_OOM,
        numbers=dict(requested=sz("392.00 MiB"), capacity=sz("11.76 GiB"), free=sz("212.69 MiB"),
                     this_process=sz("11.53 GiB"), allocated=sz("11.18 GiB"),
                     reserved_unallocated=sz("32.48 MiB"))),
    "markdown_quoted.log": dict(
        kind=Kind.CUDA_OOM,
        numbers=dict(requested=sz("128.00 MiB"), capacity=sz("5.79 GiB"), free=sz("17.56 MiB"),
                     this_process=sz("5.76 GiB"), allocated=sz("5.38 GiB"),
                     reserved_unallocated=sz("231.90 MiB"))),
    "optimizer_step_peft.log": dict(
        kind=Kind.CUDA_OOM, phase=Phase.OPTIMIZER_STEP, causes={"phase_optimizer_step"},
        context=dict(trainable_params=4194304, total_params=6742609920),
        numbers=dict(requested=sz("64.00 MiB"), capacity=sz("23.69 GiB"), free=sz("41.94 MiB"),
                     this_process=sz("23.64 GiB"), allocated=sz("22.95 GiB"),
                     reserved_unallocated=sz("323.82 MiB"))),
    "model_loading.log": dict(
        kind=Kind.CUDA_OOM, phase=Phase.MODEL_LOADING, causes={"phase_model_loading"},
        first_fix="half_precision_weights", absent_fixes={"halve_micro_batch"},
        numbers=dict(requested=sz("172.00 MiB"), capacity=sz("23.69 GiB"), allocated=sz("23.19 GiB"),
                     free=sz("117.06 MiB"), reserved=sz("23.19 GiB"))),
    "cuda_malloc_async.log": dict(
        kind=Kind.CUDA_ASYNC_OOM, gpus=(0,), occurrences=2,
        numbers=dict(allocated=sz("11.02 GiB"), requested=sz("1.25 GiB"), capacity=sz("11.99 GiB"), free=0)),
    "cuda_error_oom_accelerator.log": dict(
        kind=Kind.CUDA_ERROR_OOM, phase=Phase.MODEL_LOADING, cause="gpu_full_at_start", numbers={}),
    "thcudacheck_old.log": dict(kind=Kind.CUDA_ERROR_OOM, occurrences=2, numbers={}),
    "cublas_alloc_failed.log": dict(kind=Kind.CUBLAS_ALLOC, cause="library_alloc_failed",
                                    details=dict(status="CUBLAS_STATUS_ALLOC_FAILED")),
    "cudnn_failures.log": dict(kind=Kind.CUDNN_FAILURE, details=dict(status="CUDNN_STATUS_NOT_SUPPORTED")),
    "cudnn_no_algorithm.log": dict(kind=Kind.CUDNN_FAILURE, cause="cudnn_workspace"),
    "hip_rocm.log": dict(
        kind=Kind.HIP_OOM, cause="fragmentation", first_fix="expandable_segments",
        details=dict(alloc_conf_env="PYTORCH_HIP_ALLOC_CONF"),
        numbers=dict(requested=sz("6.64 GiB"), capacity=sz("19.98 GiB"), free=sz("6.22 GiB"),
                     allocated=sz("5.34 GiB"), reserved_unallocated=sz("7.10 GiB"))),
    # ROCm formats (hipified c10/cuda/CUDACachingAllocator.cpp): torch <= 2.0 on one MI250 GCD,
    # and the >= 2.2 sentence with a memory fraction ("allowed") on an MI300X.
    "hip_mi250_torch20.log": dict(
        kind=Kind.HIP_OOM, phase=Phase.BACKWARD, cause="fragmentation",
        details=dict(format="torch 1.5-2.0"),
        numbers=dict(requested=sz("2.00 GiB"), capacity=sz("63.98 GiB"), free=sz("1.51 GiB"),
                     allocated=sz("60.12 GiB"), reserved=sz("61.90 GiB"))),
    "hip_mi300x_fraction.log": dict(
        kind=Kind.HIP_OOM, cause="memory_fraction_limit", first_fix="raise_memory_fraction",
        details=dict(alloc_conf_env="PYTORCH_HIP_ALLOC_CONF"),
        numbers=dict(requested=sz("3.25 GiB"), capacity=sz("191.98 GiB"), limit=sz("95.99 GiB"),
                     allocated=sz("93.20 GiB"), reserved_unallocated=sz("1.37 GiB"))),
    "issue_thread_repeated.log": dict(
        kind=Kind.HIP_OOM, occurrences=3, cause="free_but_unusable", not_causes={"fragmentation"},
        numbers=dict(requested=sz("432.00 MiB"), capacity=sz("15.92 GiB"), free=sz("7.12 GiB"),
                     allocated=sz("8.08 GiB"), reserved_unallocated=sz("321.96 MiB"))),
    "mps_apple.log": dict(
        kind=Kind.MPS_OOM, cause="mps_high_watermark", absent_fixes={"shard_model_states"},
        numbers=dict(allocated=sz("15.05 GB"), other_allocations=sz("11.91 GB"), limit=sz("27.20 GB"),
                     requested=sz("1.16 GB"))),
    "cpu_allocator.log": dict(kind=Kind.CPU_OOM, cause="host_memory", numbers=dict(requested=96337920000)),
    "cpu_allocator_error12.log": dict(kind=Kind.CPU_OOM, cause="request_absurd",
                                      numbers=dict(requested=5497558138880)),
    "numpy_memoryerror.log": dict(kind=Kind.CPU_OOM, numbers=dict(requested=184 * 2**20),
                                  details=dict(source="NumPy", dtype="float32")),
    "winerror1455_localized.log": dict(kind=Kind.WINDOWS_PAGING_FILE, first_fix="grow_paging_file"),
    "oom_killer_torchrun.log": dict(kind=Kind.OOM_KILLER, ranks=(1,), cause="host_oom_killer"),
    "bash_killed.log": dict(kind=Kind.OOM_KILLER),
    "slurm_oom_kill.log": dict(kind=Kind.OOM_KILLER),
    "dataloader_killed.log": dict(kind=Kind.DATALOADER_KILLED, cause="worker_oom_killed",
                                  details=dict(signal="Killed", worker_pids="30731")),
    "dataloader_shm_docker.log": dict(kind=Kind.SHARED_MEMORY, first_fix="grow_shm"),
    "tensorflow_bfc.log": dict(
        kind=Kind.TF_OOM, gpus=(0,), occurrences=3,
        numbers=dict(requested=64 * 64 * 112 * 224 * 4, limit=10508943360, in_use=10389219072,
                     max_in_use=10462004736),
        details=dict(shape="[64,64,112,224]", dtype="float", device="GPU:0")),
    # The framework's driver layer grabbing its pool (retries with less within one message's
    # reach are one finding); the byte count in parentheses is exact, the first attempt's.
    "tf_driver_pool_retries.log": dict(
        kind=Kind.CUDA_ERROR_OOM, cause="framework_driver_oom",
        numbers=dict(requested=15737028608),
        details={"source": "driver (TensorFlow/XLA stream executor)", "platform": "ROCm/HIP"}),
    "tf_cuda_driver_parenthesised.log": dict(
        kind=Kind.CUDA_ERROR_OOM, cause="framework_driver_oom",
        numbers=dict(requested=7407239424), first_fix="stop_preallocation"),
    # A 6 GiB laptop GPU that also drives the display: 0.76 GiB belongs to nobody the message
    # lists, and 27.31 MiB free is not room for a 20 MiB block - the card is full, not broken.
    "laptop_display_gpu_full.log": dict(
        kind=Kind.CUDA_OOM, phase=Phase.BACKWARD, cause="invisible_process",
        numbers=dict(requested=sz("20.00 MiB"), free=sz("27.31 MiB"), this_process=sz("5.21 GiB")),
        derived=dict(outside_allocator=sz("6.00 GiB") - sz("27.31 MiB") - sz("5.21 GiB")),
        causes={"model_or_batch_too_big", "card_full"}, not_causes={"free_but_unusable"}),
    "jax_pjrt_request.log": dict(kind=Kind.JAX_OOM, numbers=dict(requested=5873025024)),
    # Retyped by hand into an issue, misspelling included.
    "paging_file_paraphrased.log": dict(kind=Kind.WINDOWS_PAGING_FILE),
    "commented_wrapped_old.log": dict(
        kind=Kind.CUDA_OOM, numbers=dict(requested=sz("640.00 MiB"), capacity=sz("7.79 GiB"),
                                         allocated=sz("5.12 GiB"), free=0, reserved=sz("6.40 GiB"))),
    "jax_xla.log": dict(
        kind=Kind.JAX_OOM,
        numbers=dict(requested=4770354232, total_allocation=sz("14.44 GiB"), temp_allocation=sz("4.44 GiB"),
                     parameter_allocation=sz("372.76 MiB"))),
    "missing_local_rank.log": dict(kind=Kind.MISSING_LAUNCH_ENV, phase=None, details=dict(variable="LOCAL_RANK"),
                                   first_fix="use_torchrun"),
    "env_rank_not_set.log": dict(kind=Kind.MISSING_LAUNCH_ENV, details=dict(variable="RANK")),
    "invalid_ordinal_rank1.log": dict(kind=Kind.INVALID_DEVICE_ORDINAL, ranks=(1,), cause="more_ranks_than_gpus"),
    "deserialize_checkpoint.log": dict(kind=Kind.INVALID_DEVICE_ORDINAL, numbers=dict(device=1, device_count=1),
                                       first_fix="map_location"),
    "nccl_watchdog_straggler.log": dict(kind=Kind.NCCL_TIMEOUT, ranks=(0, 1, 2), cause="straggler_rank",
                                        numbers=dict(timeout_ms=600000, elapsed_ms=600043)),
    "nccl_watchdog_mismatch.log": dict(kind=Kind.NCCL_TIMEOUT, ranks=(3, 7), cause="mismatched_collectives"),
    "nccl_old_format.log": dict(kind=Kind.NCCL_TIMEOUT, ranks=(0, 1),
                                numbers=dict(timeout_ms=1800000, elapsed_ms=1802212)),
    "port_in_use.log": dict(kind=Kind.PORT_IN_USE, numbers=dict(port=29500)),
    "port_in_use_new.log": dict(kind=Kind.PORT_IN_USE, numbers=dict(port=29500)),
    "port_permission.log": dict(kind=Kind.PORT_PERMISSION, numbers=dict(port=80)),
    "p2p_unsupported.log": dict(kind=Kind.P2P, first_fix="nccl_p2p_disable"),
    # Retyped by hand ("is not support").
    "p2p_retyped_in_issue.log": dict(kind=Kind.P2P, first_fix="nccl_p2p_disable"),
    "illegal_memory_access.log": dict(kind=Kind.ILLEGAL_MEMORY_ACCESS, first_fix="launch_blocking"),
    "device_side_assert.log": dict(kind=Kind.DEVICE_ASSERT, details=dict(assertion="t >= 0 && t < n_classes")),
    "misaligned_address.log": dict(kind=Kind.MISALIGNED_ADDRESS),
    "logger_prefixes.log": dict(
        kind=Kind.CUDA_OOM, occurrences=2,
        numbers=dict(requested=sz("2.50 GiB"), capacity=sz("47.54 GiB"), free=sz("1.96 GiB"),
                     this_process=sz("45.57 GiB"), allocated=sz("41.11 GiB"),
                     reserved_unallocated=sz("3.84 GiB"))),
    "ray_prefix.log": dict(
        kind=Kind.CUDA_OOM,
        numbers=dict(requested=sz("1.96 GiB"), capacity=sz("21.98 GiB"), free=sz("1.02 GiB"),
                     this_process=sz("20.95 GiB"), allocated=sz("19.74 GiB"),
                     reserved_unallocated=sz("811.33 MiB"))),
    "hf_trainer_full_finetune.log": dict(
        kind=Kind.CUDA_OOM, ranks=(0, 1), gpus=(0, 1), phase=Phase.BACKWARD, cause="model_states_exceed_card",
        first_fix="shard_model_states",
        context=dict(trainable_params=1543714304, batch_size=4, grad_accum=1)),
    "hf_trainer_7b_too_big.log": dict(
        kind=Kind.CUDA_OOM, cause="model_states_exceed_card", absent_fixes={"halve_micro_batch"},
        derived=dict(model_states=16 * 6738415616)),
    "crlf_windows.log": dict(
        kind=Kind.CUDA_OOM,
        numbers=dict(requested=sz("256.00 MiB"), capacity=sz("6.00 GiB"), allocated=sz("5.11 GiB"), free=0,
                     reserved=sz("5.29 GiB"))),
    "utf16_powershell.log": dict(
        kind=Kind.CUDA_OOM, cause="windows_shared_memory_spill",
        numbers=dict(requested=sz("64.00 MiB"), capacity=sz("8.00 GiB"), free=0, allocated=sz("13.98 GiB"),
                     reserved_unallocated=sz("129.48 MiB"))),
    "fraction_allowed_old.log": dict(
        kind=Kind.CUDA_OOM, cause="memory_fraction_limit",
        numbers=dict(requested=sz("60.00 MiB"), capacity=sz("11.76 GiB"), allocated=sz("4.71 GiB"),
                     free=sz("6.31 GiB"), limit=sz("4.77 GiB"), reserved=sz("4.74 GiB"))),
    "rich_traceback.log": dict(
        kind=Kind.CUDA_OOM, phase=Phase.FORWARD,
        numbers=dict(requested=sz("8.00 GiB"), capacity=sz("23.65 GiB"), free=sz("5.83 GiB"),
                     this_process=sz("17.81 GiB"), allocated=sz("17.12 GiB"),
                     reserved_unallocated=sz("246.38 MiB"))),
    "srun_label_and_mpi.log": dict(
        kind=Kind.CUDA_OOM, ranks=(0, 1, 2), gpus=(0, 1, 2), occurrences=3,
        numbers=dict(requested=sz("2.00 GiB"), capacity=sz("31.75 GiB"))),
    "default_prefix_tee.log": dict(
        kind=Kind.CUDA_OOM, ranks=(0, 3), gpus=(0, 3), occurrences=2,
        numbers=dict(requested=sz("640.00 MiB"), capacity=sz("79.11 GiB"), free=sz("85.06 MiB"))),
    "vscode_exception_has_occurred.log": dict(
        kind=Kind.CUDA_OOM, phase=Phase.FORWARD, cause="outside_allocator", first_fix="find_gpu_users",
        numbers=dict(requested=sz("40.00 MiB"), capacity=sz("7.79 GiB"), allocated=sz("2.61 GiB"),
                     free=sz("21.44 MiB"), reserved=sz("2.95 GiB")),
        derived=dict(outside_allocator=sz("7.79 GiB") - sz("21.44 MiB") - sz("2.95 GiB"))),
    "host_kill_variants.log": dict(kind=Kind.OOM_KILLER, cause="host_oom_killer",
                                  details=dict(source="launcher reported SIGKILL (exit code -9)")),
    "nccl_shm_docker.log": dict(kind=Kind.SHARED_MEMORY, first_fix="grow_shm"),
    "cudnn_frontend_engine.log": dict(kind=Kind.CUDNN_FAILURE, cause="cudnn_workspace"),
    "torchrun_sigbus_shm.log": dict(kind=Kind.SHARED_MEMORY, ranks=(2,), first_fix="grow_shm"),
    "fork_errno12.log": dict(kind=Kind.CPU_OOM, phase=Phase.DATA_LOADING, cause="host_memory",
                             details=dict(source="OS refused memory (errno 12, e.g. fork of DataLoader workers)")),
    # Fragments and cut messages (as users quote them in issue threads).
    "quoted_bracket_only.log": dict(
        kind=Kind.CUDA_OOM, gpus=(0,), cause="model_or_batch_too_big",
        numbers=dict(capacity=sz("10.76 GiB"), allocated=sz("9.41 GiB"), free=sz("14.56 MiB"),
                     reserved=sz("9.62 GiB")),
        details=dict(format="torch 1.5-2.0")),
    "quoted_sentences_only.log": dict(
        kind=Kind.CUDA_OOM,
        numbers=dict(this_process=sz("23.41 GiB"), allocated=sz("21.87 GiB"),
                     reserved_unallocated=sz("1.12 GiB"))),
    "torch22_cut_at_gpu.log": dict(
        kind=Kind.CUDA_OOM, phase=Phase.BACKWARD, numbers=dict(requested=sz("20.00 MiB")),
        details=dict(format="unknown (cut after 'GPU')")),
    # the device index unprintable but the message not cut: every number is there
    "torch_unprintable_gpu_index.log": dict(
        kind=Kind.CUDA_OOM, cause="model_or_batch_too_big",
        numbers=dict(requested=sz("2.00 GiB"), capacity=sz("23.68 GiB"), free=sz("1.02 GiB"),
                     allocated=sz("21.90 GiB"))),
    "comfyui_async_cut.log": dict(
        kind=Kind.CUDA_ASYNC_OOM, occurrences=1, numbers={},
        details=dict(format="unknown (cut after 'Allocation on device')")),
    "caffe_check_failed_oom.log": dict(kind=Kind.CUDA_ERROR_OOM, cause="out_of_memory_no_numbers"),
    "cudnn_no_valid_algorithms.log": dict(kind=Kind.CUDNN_FAILURE, phase=Phase.FORWARD, cause="cudnn_workspace"),
    "hip_error_raw.log": dict(kind=Kind.CUDA_ERROR_OOM, details=dict(platform="ROCm/HIP")),
    "xla_rocm_absurd_request.log": dict(
        kind=Kind.CUDA_ERROR_OOM, cause="request_absurd", first_fix="find_bad_size",
        numbers=dict(requested=18446744073709027328), details=dict(platform="ROCm/HIP")),
    "markdown_killed.log": dict(kind=Kind.OOM_KILLER, cause="host_oom_killer",
                                details=dict(source="shell reported 'Killed'")),
    "bare_local_rank.log": dict(kind=Kind.MISSING_LAUNCH_ENV, cause="not_launched_with_torchrun",
                                details=dict(variable="LOCAL_RANK")),
    "kernel_assert_only.log": dict(kind=Kind.DEVICE_ASSERT, details=dict(assertion="t >= 0 && t < n_classes")),
    "tf_cublas_not_initialized_oom.log": dict(
        kind=Kind.CUBLAS_ALLOC, cause="library_not_initialized_oom", first_fix="stop_preallocation",
        details=dict(status="CUBLAS_STATUS_NOT_INITIALIZED")),
    "nccl_timeout_no_seqnum.log": dict(
        kind=Kind.NCCL_TIMEOUT, ranks=(0, 1, 2), cause="mismatched_collectives",
        numbers=dict(timeout_ms=1800000, elapsed_ms=1800417)),
    "jax_internal_constant.log": dict(kind=Kind.JAX_OOM, numbers=dict(requested=201326592)),
    "thc_assert_windows.log": dict(kind=Kind.DEVICE_ASSERT, details=dict(assertion="srcIndex < srcSelectDimSize")),
    "rank_wrapped_inside_number.log": dict(
        kind=Kind.CUDA_OOM, ranks=(3,), gpus=(3,),
        numbers=dict(requested=sz("3.50 GiB"), capacity=sz("79.14 GiB"), free=sz("2.87 GiB"),
                     this_process=sz("76.25 GiB"), allocated=sz("72.18 GiB"),
                     reserved_unallocated=sz("3.36 GiB"))),
    "dataloader_semlock_enospc.log": dict(kind=Kind.SHARED_MEMORY, cause="shared_memory_exhausted",
                                          first_fix="grow_shm"),
    "shm_open_read_write.log": dict(kind=Kind.SHARED_MEMORY, cause="shared_memory_open_failed",
                                    first_fix="sharing_strategy"),
    "tf_bfc_warning_only.log": dict(kind=Kind.TF_OOM, cause="tf_warning_only", numbers=dict(requested=sz("1.27 GiB")),
                                    absent_fixes={"halve_micro_batch"}),
    "xla_pinned_host.log": dict(kind=Kind.CUDA_ERROR_OOM, cause="pinned_host_memory", first_fix="free_host_ram",
                                numbers=dict(requested=4294967296)),
    "nccl_shm_permission.log": dict(kind=Kind.SHARED_MEMORY, cause="shared_memory_permission",
                                    first_fix="fix_shm_permissions", not_causes={"shared_memory_exhausted"}),
    # The seed users' DataParallel questions (issue 12, item 4).
    "topo_p2p_not_supported.log": dict(
        kind=Kind.P2P, cause="dataparallel_p2p", first_fix="ddp_not_dp", numbers=dict(device_count=4),
        details=dict(source="nvidia-smi topo -p2p r",
                     unsupported_pairs="GPU0-GPU1 (NS), GPU0-GPU2 (NS), GPU0-GPU3 (NS), GPU1-GPU3 (NS), "
                                       "GPU2-GPU3 (NS)")),
    "dataparallel_hang_ctrl_c.log": dict(kind=Kind.P2P, cause="dataparallel_p2p", first_fix="ddp_not_dp"),
    "dmesg_oom_killer.log": dict(
        kind=Kind.OOM_KILLER, cause="host_oom_killer",
        numbers=dict(pid=48213, anon_rss=60817408 * 1024, total_vm=71302144 * 1024, shmem_rss=2097152 * 1024),
        details=dict(source="kernel log (dmesg)", process="python")),
    "accelerate_rtx4000_p2p.log": dict(kind=Kind.P2P, cause="accelerate_rtx4000_p2p",
                                       first_fix="nccl_p2p_ib_disable"),
    "port_in_use_windows_10048.log": dict(kind=Kind.PORT_IN_USE, cause="port_taken", first_fix="other_port",
                                          numbers=dict(port=29500),
                                          details=dict(platform="Windows (WSAEADDRINUSE, error 10048)")),
    "nccl_calloc_oom.log": dict(kind=Kind.NCCL_CUDA_OOM, cause="nccl_buffers_oom", ranks=(1,),
                                first_fix="free_memory_for_nccl", numbers=dict(requested=10485760)),
    "nccl_warn_cuda_failure_oom.log": dict(kind=Kind.NCCL_CUDA_OOM, cause="nccl_buffers_oom",
                                           first_fix="free_memory_for_nccl"),
    # NCCL's generic codes (issue 22, item 1): tests/test_explain_generalizes.py checks the ladders.
    "nccl_unhandled_last_error_driver.log": dict(
        kind=Kind.NCCL_ERROR, ranks=(0,), numbers=dict(nccl_result=1), first_fix="match_driver",
        details=dict(nccl_version="2.21.5")),
    "horovod_comm_init_unhandled.log": dict(
        kind=Kind.NCCL_ERROR, ranks=(0, 1), occurrences=2, details=dict(call="ncclCommInitRank")),
    "nccl_system_error_shm_fallocate.log": dict(
        kind=Kind.NCCL_ERROR, numbers=dict(nccl_result=2), first_fix="grow_shm",
        details=dict(nccl_warn="Call to posix_fallocate failed : No space left on device")),
    "nccl_remote_error.log": dict(kind=Kind.NCCL_ERROR, ranks=(3,), numbers=dict(nccl_result=6),
                                  causes={"nccl_peer_gone"}),
    "nccl_invalid_usage_duplicate_gpu.log": dict(kind=Kind.NCCL_ERROR, numbers=dict(nccl_result=5),
                                                 first_fix="set_device_nccl", causes={"nccl_same_gpu"}),
    "nccl_internal_error_old.log": dict(kind=Kind.NCCL_ERROR, numbers=dict(nccl_result=3),
                                        details=dict(nccl_version="2.4.8")),
    "cupy_nccl_unhandled.log": dict(kind=Kind.NCCL_ERROR, numbers=dict(nccl_result=1),
                                    details=dict(status="ncclUnhandledCudaError")),
    # Kills in every form (issue 22, item 2): one finding per event.
    "shell_kills_every_form.log": dict(kind=Kind.OOM_KILLER, details=dict(source="shell reported 'Killed'")),
    "zsh_job_table_killed.log": dict(kind=Kind.OOM_KILLER, details=dict(source="shell reported 'Killed'")),
    "progress_bar_killed.log": dict(kind=Kind.OOM_KILLER, details=dict(source="shell reported 'Killed'")),
    "sh_dash_killed.log": dict(kind=Kind.OOM_KILLER, details=dict(source="shell reported 'Killed'")),
    "bash_killed_command_single_space.log": dict(kind=Kind.OOM_KILLER),
    "fish_sigkill.log": dict(kind=Kind.OOM_KILLER, details=dict(source="shell reported the kill (SIGKILL)")),
    "accelerate_died_sigkill.log": dict(kind=Kind.OOM_KILLER,
                                        details=dict(source="launcher reported SIGKILL (exit code -9)")),
    "syslog_lone_oom_kill.log": dict(
        kind=Kind.OOM_KILLER, numbers=dict(pid=771204, anon_rss=62914560 * 1024, total_vm=96533448 * 1024),
        details=dict(source="kernel log (dmesg)", process="python3")),
    "kernel3_kill_sacrifice_child.log": dict(
        kind=Kind.OOM_KILLER, numbers=dict(pid=30117, oom_score=931, anon_rss=31457280 * 1024,
                                           total_vm=41943040 * 1024, file_rss=1024 * 1024),
        details=dict(process="python")),
    "cgroup_memcg_oom.log": dict(
        kind=Kind.OOM_KILLER, numbers=dict(pid=2211, cgroup_limit=33554432 * 1024, cgroup_usage=33554432 * 1024,
                                           anon_rss=33161216 * 1024),
        details=dict(constraint="CONSTRAINT_MEMCG",
                     source="kernel OOM killer inside a cgroup (container/Slurm/Kubernetes memory limit)")),
    "slurm_killed_and_oom_event.log": dict(kind=Kind.OOM_KILLER, occurrences=3),
    # Rank failures that are not kills (item 3) and the last exception (item 5).
    "torchrun_exitcode1_table.log": dict(kind=Kind.RANK_FAILED, ranks=(0,), numbers=dict(exit_code=1),
                                         first_fix="find_rank_traceback"),
    "torchrun_sigsegv_sigabrt.log": dict(kind=Kind.RANK_FAILED, ranks=(1,), numbers=dict(exit_code=-11),
                                         details=dict(signal="SIGSEGV")),
    "deepspeed_return_code_1.log": dict(kind=Kind.RANK_FAILED, ranks=(1,), numbers=dict(exit_code=1)),
    "mp_spawn_abort.log": dict(kind=Kind.RANK_FAILED, ranks=(1,), details=dict(signal="SIGABRT")),
    "traceback_value_error.log": dict(kind=Kind.EXCEPTION, cause="not_memory_related",
                                      details=dict(exception="RuntimeError", memory_related="no")),
    "error_line_memory_words.log": dict(kind=Kind.EXCEPTION, cause="unrecognised_possibly_memory",
                                        details=dict(exception="Error", memory_related="possibly")),
}

MULTI = {
    # torchrun's OMP_NUM_THREADS warning before the error: its own note, after the error (issue 33).
    "torchrun_two_ranks_interleaved.log": [
        dict(kind=Kind.CUDA_OOM, ranks=(0, 1), gpus=(0, 1), occurrences=2, phase=Phase.FORWARD,
             numbers=dict(requested=sz("2.00 GiB"), capacity=sz("23.69 GiB"), free=sz("1.06 GiB"),
                          this_process=sz("22.62 GiB"), allocated=sz("21.87 GiB"),
                          reserved_unallocated=sz("402.15 MiB"))),
        dict(kind=Kind.OMP_THREADS, cause="omp_threads_set_to_1", first_fix="set_omp_num_threads"),
    ],
    "nccl_error1_terminate_rtx4090.log": [
        dict(kind=Kind.NCCL_ERROR, numbers=dict(nccl_result=1), first_fix="nccl_debug_info",
             details=dict(status="ncclUnhandledCudaError", gpu_model="NVIDIA GeForce RTX 4090")),
        dict(kind=Kind.OMP_THREADS, cause="omp_threads_set_to_1", first_fix="set_omp_num_threads",
             numbers=dict(nproc_per_node=2)),       # --nproc_per_node 2
    ],
    # An H200 OOM under a 3 GiB memory fraction, then torch.cuda.memory_summary() printed right
    # after it (tests/snapshots/gpt2_small_b8_oom_summary.txt): two findings, the message's own
    # explanation unchanged, and the table's rows as printed ("66560 KiB", "2973 MiB").
    "torch211_memory_summary_after_oom.log": [
        dict(kind=Kind.CUDA_OOM, gpus=(0,), cause="memory_fraction_limit",
             first_fix="raise_memory_fraction",
             numbers=dict(requested=sz("72.00 MiB"), allocated=sz("2.90 GiB"), limit=sz("3.00 GiB"),
                          reserved_unallocated=sz("56.34 MiB"))),
        dict(kind=Kind.MEMORY_SUMMARY, gpus=(0,), cause="memory_summary",
             causes={"little_fragmentation"}, absent_fixes={"expandable_segments"},
             numbers=dict(allocated=66560 * 2**10, allocated_peak=2973 * 2**20,
                          reserved=3030 * 2**20, reserved_peak=3030 * 2**20,
                          non_releasable=1024 * 2**10, non_releasable_peak=63966 * 2**10,
                          cuda_ooms=1, alloc_retries=1)),
    ],
    "raw_bytes_and_kib.log": [
        dict(kind=Kind.CUDA_OOM, gpus=(2,), numbers=dict(requested=512, capacity=sz("10.76 GiB"), free=0,
                                                          allocated=sz("9.81 GiB"), reserved=sz("9.98 GiB"))),
        dict(kind=Kind.CUDA_OOM, gpus=(3,), cause="free_but_unusable",
             numbers=dict(requested=sz("20.00 MiB"), allocated=sz("1003.50 KiB"), free=sz("10.12 GiB"),
                          reserved=sz("2.00 MiB"))),
    ],
    "two_different_ooms.log": [
        dict(kind=Kind.CUDA_OOM, numbers=dict(requested=sz("3.00 GiB"), allocated=sz("18.44 GiB"))),
        dict(kind=Kind.CUDA_OOM, numbers=dict(requested=sz("768.00 MiB"), allocated=sz("22.31 GiB"))),
    ],
    "nccl_after_oom.log": [
        dict(kind=Kind.CUDA_OOM, ranks=(1,), gpus=(1,)),
        dict(kind=Kind.NCCL_TIMEOUT, ranks=(0,), causes={"consequence_of_oom"}),
    ],
}


def check(f: ex.Finding, exp: dict, result: ex.ExplainResult) -> None:
    assert f.kind is exp["kind"]
    for key, value in exp.get("numbers", {}).items():
        assert f.numbers.get(key) == value, (key, f.numbers.get(key), value)
    for key, value in exp.get("derived", {}).items():
        assert f.derived.get(key) == value, (key, f.derived.get(key), value)
    for key, value in exp.get("details", {}).items():
        assert f.details.get(key) == value, (key, f.details)
    for key, value in exp.get("context", {}).items():
        assert result.context.get(key) == value, (key, result.context)
    for attr in ("ranks", "gpus", "phase", "occurrences"):
        if attr in exp:
            assert getattr(f, attr) == exp[attr], (attr, getattr(f, attr))
    if "processes" in exp:
        assert [(p.pid, p.bytes) for p in f.processes] == exp["processes"]
    causes = [d.cause for d in f.diagnosis]
    if "cause" in exp:
        assert f.cause == exp["cause"], causes
    assert exp.get("causes", set()) <= set(causes), causes
    assert not exp.get("not_causes", set()) & set(causes), causes
    fix_ids = [x.id for x in f.fixes]
    if "first_fix" in exp:
        assert fix_ids and fix_ids[0] == exp["first_fix"], fix_ids
    assert not exp.get("absent_fixes", set()) & set(fix_ids), fix_ids


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_log_single_finding(name):
    result = explain_file(name)
    check(only(result), EXPECTED[name], result)


@pytest.mark.parametrize("name", sorted(MULTI))
def test_log_several_findings(name):
    result = explain_file(name)
    assert len(result.findings) == len(MULTI[name])
    for f, exp in zip(result.findings, MULTI[name]):
        check(f, exp, result)


def test_every_log_file_has_expectations():
    on_disk = {p.name for p in LOGS.glob("*.log")}
    assert on_disk == set(EXPECTED) | set(MULTI) | {"no_error_training.log"}


def test_every_kind_is_covered_by_a_log():
    kinds = {e["kind"] for e in EXPECTED.values()} | {e["kind"] for es in MULTI.values() for e in es}
    # and the real logs of tests/logs/public (test_explain_public.py checks them)
    public = json.loads((LOGS / "public" / "sources.json").read_text())
    kinds |= {Kind(k) for name, s in public.items() if not name.startswith("_") for k in s["kinds"]}
    assert kinds == set(Kind)


@pytest.mark.parametrize("name", sorted(p.name for p in LOGS.glob("*.log")))
def test_every_log_renders_and_serialises(name):
    result = explain_file(name)
    text = ex.render_text(result)
    # oomdoctor's own words are ASCII (safe on any console); only the quoted excerpt is the user's text.
    assert all(line.isascii() for line in text.splitlines() if not line.startswith("    > "))
    data = json.loads(json.dumps(ex.to_json(result)))
    for f in data["findings"]:
        assert all(isinstance(v, int) for v in f["numbers"].values())
        assert all(isinstance(v, int) for v in f["derived"].values())
        assert all(x["effect_bytes"] is None or isinstance(x["effect_bytes"], int) for x in f["fixes"])
        assert f["diagnosis"], f["kind"]
        assert f["fixes"] or f["kind"] == "nccl_timeout"


@pytest.mark.parametrize("name", sorted(p.name for p in LOGS.glob("*.log")))
def test_empty_cache_is_never_a_fix(name):
    for f in explain_file(name).findings:
        for fix in f.fixes:
            assert "empty_cache" not in fix.title and "empty_cache" not in fix.id


# --- specific diagnoses ----------------------------------------------------------------------

def test_two_trainings_other_process_effect_and_wording():
    f = only(explain_file("torch22_two_trainings.log"))
    fix = f.fixes[0]
    assert fix.effect_bytes == sz("11.20 GiB") and fix.effect_bound == "about"
    assert "two trainings on one GPU" in f.diagnosis[0].text
    assert "enough for the 768.00 MiB request" in f.diagnosis[0].text


def test_container_self_is_not_called_a_competitor():
    f = only(explain_file("torch22_container_self.log"))
    text = next(d.text for d in f.diagnosis if d.cause == "container_pid_namespace")
    assert "Process 20398" in text and "not a competitor" in text
    assert "other_processes" not in f.derived
    assert "one_job_per_gpu" not in [x.id for x in f.fixes]


def test_fragmentation_fix_reports_the_unallocated_gib():
    f = only(explain_file("hip_rocm.log"))
    fix = f.fixes[0]
    assert fix.title.startswith("Set PYTORCH_HIP_ALLOC_CONF=expandable_segments:True")
    assert fix.effect_bytes == sz("7.10 GiB") and fix.effect_bound == "up to"


def test_old_torch_gets_max_split_size_mb_not_expandable_segments():
    f = only(explain_file("torch20_reserved_3090.log"))
    ids = [x.id for x in f.fixes]
    assert "max_split_size_mb" in ids and "expandable_segments" not in ids
    # 1.34 GiB of cache cannot cover the 1.39 GiB missing, so halving the batch ranks first.
    assert ids[0] == "halve_micro_batch"
    assert f.fixes[0].effect_bytes == sz("1.50 GiB") // 2 and f.fixes[0].effect_bound == "at least"


SEED_OOM = ("RuntimeError: CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; 23.69 GiB total capacity; "
            "21.93 GiB already allocated; 111.88 MiB free; 23.27 GiB reserved in total by PyTorch)\n")


@pytest.mark.parametrize("with_traceback", [False, True])
def test_a_fix_that_cannot_cover_the_shortfall_ranks_last_with_or_without_traceback(with_traceback):
    """1.34 GiB of cache cannot cover 1.39 GiB missing: max_split_size_mb goes after every fix that
    can (sized or not), says so in its title and detail, and the order is the same either way."""
    text = (LOGS / "torch20_reserved_3090.log").read_text() if with_traceback else SEED_OOM
    f = only(ex.explain_text(text))
    ids = [x.id for x in f.fixes]
    assert ids[-1] == "max_split_size_mb", ids
    last = f.fixes[-1]
    assert "not enough on its own (up to 1.34 GiB of the 1.39 GiB missing)" in last.title
    assert "cannot cover the shortfall" in last.detail
    assert all("not enough" not in x.title for x in f.fixes[:-1])


def test_output_cites_only_shipped_documents():
    for p in LOGS.glob("*.log"):
        for f in explain_file(p.name).findings:
            words = " ".join([x.detail + x.title for x in f.fixes] + [d.text for d in f.diagnosis] + list(f.notes))
            assert "docs/allocator.md" not in words and "../shared" not in words and "ground-truth" not in words


def test_topo_table_and_dataparallel_hang_advise_ddp_not_p2p():
    for name in ("topo_p2p_not_supported.log", "dataparallel_hang_ctrl_c.log"):
        f = only(explain_file(name))
        assert "DataParallel" in f.diagnosis[0].text and "does not need P2P" in f.diagnosis[0].text
        assert "torchrun --standalone --nproc_per_node=" in f.fixes[0].title
        assert "NCCL_P2P_DISABLE=1" in f.fixes[1].title
    assert "--nproc_per_node=4" in only(explain_file("topo_p2p_not_supported.log")).fixes[0].title


def test_ctrl_c_outside_dataparallel_is_not_an_error():
    text = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n    time.sleep(5)\n"
            "KeyboardInterrupt\n")
    assert ex.explain_text(text).findings == ()
    # A topology table where every pair is OK is not a problem either.
    assert ex.explain_text(" \tGPU0\tGPU1\n GPU0\tX\tOK\n GPU1\tOK\tX\n").findings == ()


def test_dmesg_oom_killer_reports_anon_rss():
    f = only(explain_file("dmesg_oom_killer.log"))
    assert "killed process 48213 (python), which held 58.00 GiB of host RAM" in f.diagnosis[0].text
    assert re.search(r"anon-rss \(process RAM\)\s+58\.00 GiB", ex.render_text(explain_file("dmesg_oom_killer.log")))


def test_accelerate_rtx4000_fix_names_both_variables():
    fix = only(explain_file("accelerate_rtx4000_p2p.log")).fixes[0]
    assert 'NCCL_P2P_DISABLE="1"' in fix.title and 'NCCL_IB_DISABLE="1"' in fix.title
    assert "accelerate launch" in fix.title


def test_windows_10048_is_a_taken_port_in_any_language():
    f = only(explain_file("port_in_use_windows_10048.log"))
    assert "10048" in f.diagnosis[0].text and "MASTER_PORT" in f.fixes[0].detail
    assert "netstat -ano | findstr :29500" in f.fixes[0].detail
    english = ("OSError: [WinError 10048] Only one usage of each socket address (protocol/network address/port) "
               "is normally permitted: ('127.0.0.1', 29500)\n")
    assert only(ex.explain_text(english)).kind is Kind.PORT_IN_USE


def test_nccl_buffer_oom_says_outside_the_allocator_with_the_bytes():
    f = only(explain_file("nccl_calloc_oom.log"))
    assert "10.00 MiB" in f.diagnosis[0].text and "outside PyTorch's caching allocator" in f.diagnosis[0].text
    titles = " ".join(x.title for x in f.fixes)
    assert "expandable_segments:True" in titles and "NCCL_BUFFSIZE" in titles and "nvidia-smi" in titles
    assert f.category is ex.Category.GPU_MEMORY


@pytest.mark.parametrize("name,kind,cause", [
    ("topo_p2p_not_supported.log", "p2p_unsupported", "dataparallel_p2p"),
    ("dataparallel_hang_ctrl_c.log", "p2p_unsupported", "dataparallel_p2p"),
    ("dmesg_oom_killer.log", "oom_killer", "host_oom_killer"),
    ("accelerate_rtx4000_p2p.log", "p2p_unsupported", "accelerate_rtx4000_p2p"),
    ("port_in_use_windows_10048.log", "port_in_use", "port_taken"),
    ("nccl_calloc_oom.log", "nccl_cuda_oom", "nccl_buffers_oom"),
])
def test_seed_dataparallel_questions_through_the_cli(name, kind, cause):
    runner = CliRunner()
    res = runner.invoke(cli, ["explain", str(LOGS / name), "--json"])
    assert res.exit_code == EXIT_OK, res.output
    f = json.loads(res.stdout)["findings"][0]
    assert f["kind"] == kind and f["cause"] == cause
    text = runner.invoke(cli, ["explain", str(LOGS / name)])
    assert text.exit_code == EXIT_OK and f["fixes"][0]["title"][:40] in " ".join(text.stdout.split())


def test_model_states_exceed_card_says_ddp_does_not_help():
    f = only(explain_file("hf_trainer_7b_too_big.log"))
    assert "DDP would not help" in f.diagnosis[0].text
    shard = next(x for x in f.fixes if x.id == "shard_model_states")
    states = 16 * 6738415616
    assert shard.effect_bytes == states - states // 2  # two GPUs assumed
    optim = next(x for x in f.fixes if x.id == "lighter_optimizer")
    assert optim.effect_bytes == 6 * 6738415616


def test_batch_fix_uses_the_logged_batch_size():
    f = only(explain_file("hf_trainer_full_finetune.log"))
    title = next(x.title for x in f.fixes if x.id == "halve_micro_batch")
    assert "(4 -> 2)" in title and "(1 -> 2)" in title
    assert any("DDP replicates the whole model" in n for n in f.notes)


def test_empty_cache_note_explains_why_not():
    f = only(explain_file("torch20_reserved_3090.log"))
    assert any("empty_cache() is not a fix" in n for n in f.notes)


def test_nccl_straggler_names_the_silent_rank():
    f = only(explain_file("nccl_watchdog_straggler.log"))
    assert "did not report the timeout: 3" in f.diagnosis[0].text
    assert [c.rank for c in f.collectives] == [0, 1, 2]


def test_nccl_mismatch_lists_the_different_collectives():
    f = only(explain_file("nccl_watchdog_mismatch.log"))
    text = f.diagnosis[0].text
    assert "rank 3: ALLREDUCE #80078" in text and "rank 7: BROADCAST #80078" in text


def test_lookalikes_are_not_oom():
    for name in ("illegal_memory_access.log", "device_side_assert.log", "misaligned_address.log"):
        f = only(explain_file(name))
        assert f.category is ex.Category.NOT_OOM
        assert "CUDA_LAUNCH_BLOCKING=1" in f.fixes[0].title
    f = only(explain_file("device_side_assert.log"))
    assert "label is outside [0, num_classes)" in f.diagnosis[0].text


def test_no_error_log_has_no_findings():
    result = explain_file("no_error_training.log")
    assert result.findings == () and result.lines_read == 7


def test_json_shape():
    data = ex.to_json(explain_file("torch22_two_trainings.log"))
    f = data["findings"][0]
    assert f["kind"] == "cuda_oom" and f["cause"] == "other_process" and f["gpu"] == 1
    assert f["processes"] == [{"pid": 48211, "bytes": sz("11.20 GiB")}]
    assert f["fixes"][0] == {**f["fixes"][0], "id": "one_job_per_gpu", "effect_bytes": sz("11.20 GiB"),
                             "effect_bound": "about"}
    assert set(f["fixes"][0]) == {"id", "title", "effect_bytes", "effect_bound", "speed", "quality", "detail"}


def test_text_output_has_title_numbers_diagnosis_fixes():
    text = ex.render_text(explain_file("torch20_reserved_3090.log"))
    assert "[1] PyTorch CUDA out of memory (torch 1.5-2.0 message)" in text
    assert re.search(r"requested\s+1\.50 GiB", text)
    assert re.search(r"free on the GPU\s+111\.88 MiB", text)
    assert "Diagnosis" in text and "Fixes, ranked by what they buy" in text
    assert "frees: at least 768.00 MiB | speed:" in text
    assert "during backward" in text


# --- robustness ------------------------------------------------------------------------------

def test_empty_and_blank_inputs():
    for text in ("", "\n", "\n\n\n", "   ", "\r\n\r\n", "\x00\x00"):
        assert ex.explain_text(text).findings == ()
    assert list(ex.read_lines(io.BytesIO(b""))) == []


def test_no_trailing_newline_and_crlf_are_equivalent():
    msg = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity; "
           "6.50 GiB already allocated; 0 bytes free; 6.80 GiB reserved in total by PyTorch)")
    a = ex.explain_stream(ex.read_lines(io.BytesIO(msg.encode())))
    b = ex.explain_stream(ex.read_lines(io.BytesIO((msg + "\r\n").encode())))
    assert a.findings[0].numbers == b.findings[0].numbers


def test_input_is_never_executed(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("explain must not evaluate its input")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    monkeypatch.setattr(builtins, "compile", refuse)
    text = ("__import__('os').system('touch /tmp/oomdoctor_pwned')\n"
            "RuntimeError: CUDA out of memory. Tried to allocate 1.00 GiB (GPU 0; 2.00 GiB total capacity; "
            "1.50 GiB already allocated; 0 bytes free; 1.90 GiB reserved in total by PyTorch)\n"
            "{{7*7}} ${7*7} `id` $(id)\n")
    assert only(ex.explain_text(text)).numbers["requested"] == 2**30


def test_binary_garbage_does_not_crash():
    garbage = bytes(range(256)) * 4096 + b"\xff\xfe\x00" * 1000 + b"CUDA out of memory. Tried to allocate"
    result = ex.explain_stream(ex.read_lines(io.BytesIO(garbage)))
    assert result.skipped_regions == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=3000))
def test_arbitrary_text_never_crashes(text):
    result = ex.explain_text(text)
    ex.render_text(result)
    json.dumps(ex.to_json(result))


_KEYWORDY = st.sampled_from([
    "CUDA out of memory. ", "Tried to allocate ", "1.50 GiB", "(GPU 0; ", " total capacity; ", "0 bytes",
    " free; ", "reserved in total by PyTorch)", "GPU 1 has a total capacity of ", "Process 12 has ",
    "memory in use. ", "[rank3]: ", "Traceback (most recent call last):\n", '  File "x.py", line 1, in step\n',
    "\n", "\r", "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, ",
    "Timeout(ms)=600000) ran for 600001 milliseconds", "KeyError: 'LOCAL_RANK'", "Killed\n", "exitcode: -9",
    "MPS backend out of memory (MPS allocated: ", "Allocation on device 0 would exceed allowed memory.",
    "OOM when allocating tensor with shape[", "and type float on /job:localhost/device:GPU:0",
    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate ", "Assertion `", "` failed.", ";", ".", " ",
])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_KEYWORDY, st.text(max_size=20)), max_size=80))
def test_keyword_soup_never_crashes(parts):
    result = ex.explain_text("".join(parts))
    ex.render_text(result)
    json.dumps(ex.to_json(result))


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=4000))
def test_arbitrary_bytes_never_crash(data):
    ex.explain_stream(ex.read_lines(io.BytesIO(data), chunk_size=7))


def _torch_size(n: int) -> str:
    """A size printed the way PyTorch's format_size prints it (c10/util/Exception / CUDACachingAllocator)."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1048576:
        return f"{n / 1024:.2f} KiB"
    if n <= 1073741824:
        return f"{n / 1048576:.2f} MiB"
    return f"{n / 1073741824:.2f} GiB"


def _hard_wrap(text: str, width: int) -> str:
    return "\n".join(text[i:i + width] for i in range(0, len(text), width))


_PREFIXES = ["", "[rank0]: ", "E   ", "> ", "    ", "2024-01-02 03:04:05,678 ERROR ", "(pid=4242) ", "[123] "]


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=200 * 2**30), min_size=6, max_size=6),
    gpu=st.integers(min_value=0, max_value=15),
    pid=st.integers(min_value=1, max_value=4_000_000),
    width=st.one_of(st.none(), st.integers(min_value=30, max_value=120)),
    prefix=st.sampled_from(_PREFIXES),
    junk=st.lists(st.text(alphabet="abcdefghij 0123456789:=|%", max_size=60), max_size=5),
)
def test_sentence_form_numbers_survive_wraps_and_prefixes(sizes, gpu, pid, width, prefix, junk):
    req, cap, free, other, alloc, unalloc = (_torch_size(n) for n in sizes)
    msg = (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {req}. GPU {gpu} has a total "
           f"capacity of {cap} of which {free} is free. Process {pid} has {other} memory in use. Of the "
           f"allocated memory {alloc} is allocated by PyTorch, and {unalloc} is reserved by PyTorch but "
           "unallocated. If reserved but unallocated memory is large try setting "
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    if width:
        msg = _hard_wrap(msg, width)
    text = "\n".join(junk + [prefix + line for line in msg.split("\n")] + junk)
    f = only(ex.explain_text(text))
    assert f.kind is Kind.CUDA_OOM and f.gpus == (gpu,)
    assert f.numbers["requested"] == ex.parse_size(req)
    assert f.numbers["capacity"] == ex.parse_size(cap)
    assert f.numbers["free"] == ex.parse_size(free)
    assert f.numbers["allocated"] == ex.parse_size(alloc)
    assert f.numbers["reserved_unallocated"] == ex.parse_size(unalloc)
    assert [(p.pid, p.bytes) for p in f.processes] == [(pid, ex.parse_size(other))]


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=80 * 2**30), min_size=5, max_size=5),
    width=st.one_of(st.none(), st.integers(min_value=30, max_value=100)),   # terminals wrap at 80+
    ranks=st.integers(min_value=1, max_value=4),
)
def test_old_form_repeated_per_rank_is_grouped(sizes, width, ranks):
    req, cap, alloc, free, reserved = (_torch_size(n) for n in sizes)
    lines = []
    for r in range(ranks):
        msg = (f"RuntimeError: CUDA out of memory. Tried to allocate {req} (GPU {r}; {cap} total capacity; "
               f"{alloc} already allocated; {free} free; {reserved} reserved in total by PyTorch)")
        lines += [f"[rank{r}]: {line}" for line in (_hard_wrap(msg, width) if width else msg).split("\n")]
    f = only(ex.explain_text("\n".join(lines)))
    assert f.ranks == tuple(range(ranks)) and f.gpus == tuple(range(ranks)) and f.occurrences == ranks
    assert (f.numbers["requested"], f.numbers["capacity"], f.numbers["allocated"], f.numbers["free"],
            f.numbers["reserved"]) == tuple(ex.parse_size(x) for x in (req, cap, alloc, free, reserved))


def test_interleaved_lines_of_two_ranks_are_separated():
    a = ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 23.69 GiB total capacity; "
         "20.00 GiB already allocated; 1.00 GiB free; 21.00 GiB reserved in total by PyTorch)")
    b = a.replace("GPU 0", "GPU 1").replace("1.00 GiB free", "1.10 GiB free")
    wa, wb = _hard_wrap(a, 50).split("\n"), _hard_wrap(b, 50).split("\n")
    mixed = [x for pair in zip(wa, wb) for x in (f"[rank0]: {pair[0]}", f"[rank1]: {pair[1]}")]
    f = only(ex.explain_text("\n".join(mixed)))
    assert f.ranks == (0, 1) and f.gpus == (0, 1) and f.numbers["free"] == sz("1.00 GiB")


# --- streaming and bounded memory ------------------------------------------------------------

def _big_log(total_bytes: int):
    """A training log of `total_bytes`, generated lazily, with one OOM near the end."""
    lines = [
        "step {i} | loss 2.{i:04d} | lr 3.0e-04 | grad_norm 0.87 | 4.31 it/s | tokens/s 45012\n",
        "[2024-06-01 12:00:00,000][train][INFO] - epoch 3 batch {i} done in 0.231 s\n",
        "Epoch 3:  41%|####      | {i}/100000 [03:17<04:43,  2.08it/s, loss=1.20]\n",
        "  warnings.warn('The default value of the antialias parameter will change', UserWarning)\n",
    ]
    size, i = 0, 0
    while size < total_bytes:
        line = lines[i % 4].format(i=i)
        size += len(line)
        i += 1
        yield line
    yield ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of "
           "23.69 GiB of which 111.88 MiB is free. Including non-PyTorch memory, this process has 23.57 GiB "
           "memory in use. Of the allocated memory 21.93 GiB is allocated by PyTorch, and 1.34 GiB is reserved "
           "by PyTorch but unallocated.\n")


class _GeneratedLog(io.RawIOBase):
    """A binary log stream: `repeat` copies of a ~1 MiB block of training output, then one OOM.
    Produced on demand, so the test holds one block, never the log."""

    _BLOCK = "".join(_big_log(2**20)).rsplit("torch.OutOfMemoryError", 1)[0].encode()
    _TAIL = ("torch.OutOfMemoryError" + list(_big_log(0))[-1].split("torch.OutOfMemoryError", 1)[1]).encode()

    def __init__(self, repeat: int):
        self.chunks = iter([self._BLOCK] * repeat + [self._TAIL])
        self.view = memoryview(b"")

    def readable(self):
        return True

    def readinto(self, buf):
        if not self.view:
            chunk = next(self.chunks, None)
            if chunk is None:
                return 0
            self.view = memoryview(chunk)
        n = min(len(buf), len(self.view))
        buf[:n], self.view = self.view[:n], self.view[n:]
        return n


def test_50_mib_stream_with_bounded_memory():
    tracemalloc.start()
    try:
        result = ex.explain_file(io.BufferedReader(_GeneratedLog(repeat=50)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    f = only(result)
    assert f.numbers["requested"] == sz("1.50 GiB")
    assert result.lines_read > 600_000
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB for a 50 MiB log"


def test_line_iterator_api_is_bounded_too():
    tracemalloc.start()
    try:
        result = ex.explain_stream(_big_log(4 * 2**20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert only(result).numbers["requested"] == sz("1.50 GiB")
    assert peak < 4 * 2**20


@pytest.mark.parametrize("name", sorted(p.name for p in LOGS.glob("*.log")))
def test_file_and_line_apis_agree(name):
    data = (LOGS / name).read_bytes()
    a = ex.explain_file(io.BytesIO(data), chunk_size=97)
    b = ex.explain_stream(ex.read_lines(io.BytesIO(data)))
    assert ex.to_json(a) == ex.to_json(b)


def test_keyword_heavy_log_still_finds_the_error():
    # Every line mentions memory: the slow path all the way, and the error at the end is found.
    lines = [f"step {i} | max memory allocated 14.21 GiB | reserved 15.00 GiB\n" for i in range(20000)]
    lines.append("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 23.69 GiB total capacity; "
                 "21.00 GiB already allocated; 1.00 GiB free; 21.50 GiB reserved in total by PyTorch)\n")
    f = only(ex.explain_stream(lines))
    assert f.gpus == (1,) and f.line == 20001


def test_huge_line_without_newline_is_bounded():
    class Endless(io.RawIOBase):
        """8 MiB of one line, then an OOM message, without ever holding it all."""

        def __init__(self):
            self.left = 8 * 2**20
            self.tail = (b" RuntimeError: CUDA out of memory. Tried to allocate 1.00 GiB (GPU 0; 2.00 GiB "
                         b"total capacity; 1.50 GiB already allocated; 0 bytes free; 1.90 GiB reserved in "
                         b"total by PyTorch)\n")

        def readable(self):
            return True

        def readinto(self, buf):
            if self.left > 0:
                n = min(len(buf), self.left)
                buf[:n] = b"x" * n
                self.left -= n
                return n
            n = min(len(buf), len(self.tail))
            buf[:n], self.tail = self.tail[:n], self.tail[n:]
            return n

    tracemalloc.start()
    try:
        result = ex.explain_file(io.BufferedReader(Endless()))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert only(result).numbers["requested"] == 2**30
    assert peak < 8 * 2**20


def test_many_distinct_errors_are_capped():
    text = "\n".join(f"RuntimeError: CUDA out of memory. Tried to allocate {i}.00 MiB (GPU 0; 8.00 GiB total "
                     "capacity; 7.00 GiB already allocated; 0 bytes free; 7.50 GiB reserved in total by PyTorch)"
                     for i in range(1, 400))
    result = ex.explain_text(text)
    assert len(result.findings) == ex._MAX_FINDINGS
    assert result.dropped_findings == 399 - ex._MAX_FINDINGS


# --- command line ----------------------------------------------------------------------------

@pytest.fixture
def runner():
    return CliRunner()


def test_cli_explains_a_file(runner):
    res = runner.invoke(cli, ["explain", str(LOGS / "torch22_two_trainings.log")])
    assert res.exit_code == EXIT_OK == 0
    assert res.stdout.startswith("Found 1 error(s) in 11 lines.")
    assert "two trainings on one GPU" in " ".join(res.stdout.split())
    assert res.stderr == ""


def test_cli_json_is_the_only_stdout(runner):
    res = runner.invoke(cli, ["explain", str(LOGS / "hip_rocm.log"), "--json"])
    assert res.exit_code == 0
    data = json.loads(res.stdout)
    assert data["findings"][0]["numbers"]["requested"] == sz("6.64 GiB")
    assert res.stderr == ""


def test_cli_reads_stdin(runner):
    res = runner.invoke(cli, ["explain", "-"], input=(LOGS / "missing_local_rank.log").read_bytes())
    assert res.exit_code == 0
    assert "torchrun" in res.stdout


def test_cli_no_error_found_exits_1_with_message_on_stderr(runner):
    res = runner.invoke(cli, ["explain", str(LOGS / "no_error_training.log")])
    assert res.exit_code == EXIT_PROBLEM == 1
    assert res.stdout == ""
    assert "no known error found in 7 lines" in res.stderr


def test_cli_no_error_json_still_prints_result(runner):
    res = runner.invoke(cli, ["explain", "-", "--json"], input=b"all good\n")
    assert res.exit_code == 1
    assert json.loads(res.stdout)["findings"] == []


@pytest.mark.parametrize("args", [["explain"], ["explain", "/nonexistent/train.log"], ["explain", "-", "--bogus"]])
def test_cli_usage_errors_exit_2(runner, args):
    res = runner.invoke(cli, args, input=b"")
    assert res.exit_code == 2
    assert res.stdout == ""
    assert "Usage:" in res.stderr


def test_cli_help(runner):
    res = runner.invoke(cli, ["explain", "--help"])
    assert res.exit_code == 0
    assert "Exit codes: 0" in res.stdout and "--json" in res.stdout


def test_cli_utf16_file(runner):
    res = runner.invoke(cli, ["explain", str(LOGS / "utf16_powershell.log"), "--json"])
    assert res.exit_code == 0
    assert json.loads(res.stdout)["findings"][0]["cause"] == "windows_shared_memory_spill"


def test_messages_pytorch_cut_itself_say_so():
    """PyTorch printed the device index as a raw byte, so device 0 ended the message (a NUL); the
    explanation names that instead of asking for the 'complete' message, which never existed."""
    cut_gpu = only(explain_file("torch22_cut_at_gpu.log"))
    assert "pytorch/pytorch#123984" in cut_gpu.diagnosis[0].text
    assert "Paste the complete" not in cut_gpu.diagnosis[0].text
    cut_async = only(explain_file("comfyui_async_cut.log"))
    assert any("pytorch/pytorch#168369" in n and "--disable-cuda-malloc" in n for n in cut_async.notes)
