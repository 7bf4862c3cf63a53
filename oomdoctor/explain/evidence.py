"""What a log states outside its error messages that changes a diagnosis: DeepSpeed's host-memory reports
(see_memory_usage) and DataParallel's imbalance warning, read into the log's facts, and the diagnosis and
fixes each one adds to a finding."""
from __future__ import annotations

import re

from .diagnosis import _F, _QUALITY_NONE, _Ctx, _Out
from .draft import _Draft
from .results import _KIND_INFO, Category
from .sizes import GiB

# deepspeed/runtime/utils.py see_memory_usage: "CPU Virtual Memory:  used = 28.43 GB, percent = 22.6%",
# psutil's (total - available) / 1024**3, so "GB" is GiB; percent is used / total.
_SEE_MEMORY = re.compile(r"CPU Virtual Memory:\s*used\s*=\s*(\d+(?:\.\d+)?)\s*GB,\s*percent\s*=\s*(\d+(?:\.\d+)?)%")
# torch/nn/parallel/data_parallel.py _check_balance: "There is an imbalance between your GPUs. You may
# want to exclude GPU {} which has less than 75% of the memory or cores of GPU {}. ..." (squashed, lower case)
_IMBALANCE = re.compile(r"thereisanimbalancebetweenyourgpus\.youmaywanttoexcludegpu(\d+)whichhaslessthan75%"
                        r"ofthememoryorcoresofgpu(\d+)")
# A host RAM report at or above this share makes host RAM the likely cause of a kill without a reason.
_HOST_FULL_PERMILLE = 800


def _collect_evidence(lines: list[tuple[int, str]], low: str, facts: dict[str, int]) -> None:
    """Read a region's evidence into the log's facts (the last report wins: logs run forward)."""
    if "cpuvirtualmemory" in low:
        for _, body in lines:
            m = _SEE_MEMORY.search(body)
            if m:
                facts["host_used"] = int(float(m.group(1)) * GiB)
                facts["host_used_permille"] = round(float(m.group(2)) * 10)
    if "imbalance" in low and (m := _IMBALANCE.search(low)):
        facts["dp_weak_gpu"], facts["dp_strong_gpu"] = int(m.group(1)), int(m.group(2))


def _host_memory_diag(d: _Draft, ctx: _Ctx, out: _Out) -> None:
    """For a kill or a launcher's stop without a kernel line: what the log's host-memory reports say."""
    used, permille = ctx.facts.get("host_used"), ctx.facts.get("host_used_permille")
    if used is None or not permille:
        return
    d.numbers["host_used"] = used
    total = used * 1000 // permille
    out.derived["host_total"] = total
    share = f"{permille / 10:g}%"
    report = (f"DeepSpeed's last memory report (see_memory_usage) in this log shows {_F(used)} of host RAM in use, "
              f"{share} of about {_F(total)}")
    if permille >= _HOST_FULL_PERMILLE:
        out.diag("host_ram_nearly_full", f"{report}: host RAM was nearly full, so the kernel's OOM killer is the "
                 "likely reason the worker died - no error of its own is printed when it does. Confirm with "
                 "`dmesg -T | grep -i 'killed process'` (or `journalctl -k`) on that machine.")
    else:
        out.diag("host_ram_report", f"{report}. That was before the step that failed, not at the kill: a step that "
                 "loads a checkpoint or builds optimizer states on the CPU (ZeRO offload) can fill the rest in "
                 "seconds. Confirm a kill with `dmesg -T | grep -i 'killed process'` and watch `free -g` during "
                 "that step.")


def _dataparallel_diag(d: _Draft, ctx: _Ctx, out: _Out) -> None:
    """A GPU-memory error in a log where DataParallel warned that the GPUs are unequal."""
    weak, strong = ctx.facts.get("dp_weak_gpu"), ctx.facts.get("dp_strong_gpu")
    if weak is None or strong is None or _KIND_INFO[d.kind][0] is not Category.GPU_MEMORY:
        return
    out.diag("dataparallel_imbalance", f"DataParallel warned that GPU {weak} has less than 75% of the memory or "
             f"cores of GPU {strong}. DataParallel splits every batch evenly over its GPUs, so the smaller card "
             "runs out first; and it keeps the model's master copy, the gathered outputs and the loss on GPU 0 "
             "(device_ids[0]), so GPU 0 holds more than the others at every step.")
    out.fix("exclude_small_gpu", f"Leave the smaller GPU out: CUDA_VISIBLE_DEVICES={strong} (or "
            f"DataParallel(model, device_ids=[...]) without GPU {weak})", None, None,
            "faster: the weak card no longer sets the pace", _QUALITY_NONE, "", cost=0, primary=True)
    out.fix("ddp_not_dp", "Use DistributedDataParallel instead of DataParallel: torchrun --nproc_per_node=<GPUs> "
            "train.py", None, None, "faster than DataParallel (no per-step weight copies, no GIL contention)",
            _QUALITY_NONE, "Each process holds only its own replica and its own part of the batch: nothing is "
            "gathered on GPU 0, so GPU 0 no longer holds more than the others. With unequal cards keep the "
            "per-GPU batch within what the smaller one holds.", cost=1, primary=True)
