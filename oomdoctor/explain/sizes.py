"""Byte sizes as PyTorch prints them (parse_size, format_bytes) and parameter counts."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

GiB = 1 << 30
MiB = 1 << 20

_UNIT_BYTES = {
    "b": 1, "byte": 1, "bytes": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "pib": 1 << 50,
    # PyTorch's MPS allocator (before 2.3) and the old TH CPU allocator divide by 1024 but label
    # the result "KB/MB/GB" (aten/src/ATen/mps/MPSAllocator.mm format_size; TH/THGeneral.cpp),
    # so these labels are binary too.
    "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40, "pb": 1 << 50,
    # XLA/TPU and TensorFlow's stream executor print a bare letter, binary as well
    # (tsl HumanReadableNumBytes; "529.00M (554,696,704 bytes)" in a TPU HBM report: 529 x 2**20).
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGTP]i?B|bytes?|B)\s*$", re.I)
# 2**64 bytes printed as "17179869184.00 GiB" is PyTorch's "no limit" sentinel (the default
# allowed memory of cudaMallocAsync); anything this large is not a real amount.
_NO_LIMIT = 1 << 60
_NO_GPU_HAS = 1 << 40          # 1 TiB: no single accelerator has this much memory (2026: <= 288 GB)


def parse_size(text: str) -> int:
    """'1.50 GiB' -> 1610612736. Raises ValueError for anything that is not a size."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r}; expected a number and a unit such as '1.50 GiB'")
    return _to_bytes(m.group(1), m.group(2))


def _to_bytes(number: str, unit: str) -> int:
    # Decimal, not float: "111.88 MiB" must give exactly int(111.88 * 2**20) for every input.
    # Thousands separators ("554,696,704 bytes", the kernel's "26,184,840kB") are dropped.
    try:
        return int(Decimal(number.replace(",", "")) * _UNIT_BYTES[unit.lower()])
    except (InvalidOperation, KeyError) as exc:
        raise ValueError(f"not a size: {number!r} {unit!r}") from exc


def format_bytes(n: int) -> str:
    """IEC units with two decimals, like PyTorch's own messages: 1610612736 -> '1.50 GiB'."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n} bytes"
    for unit, scale in (("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30)):
        if n < scale * 1024:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n / (1 << 40):.2f} TiB"


def _parse_count(text: str) -> int | None:
    """'6,742,609,920' / '124 M' / '7.24B' / '124.44M' -> parameter count."""
    t = text.replace(",", "").replace("_", "").strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMBT]?)", t, re.I)
    if not m:
        return None
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}[m.group(2).lower()]
    try:
        value = int(Decimal(m.group(1)) * scale)
    except InvalidOperation:
        return None
    return value if 0 < value < 10**14 else None
