"""What the message patterns share: the size pattern, anchor specs, field lookups and the simplest extractor."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from ..draft import _Draft
from ..results import Kind
from ..sizes import _NO_LIMIT, _to_bytes

# Patterns run on "squashed" text (all whitespace removed), so spaces never appear in them.

_SZ = r"(\d+(?:\.\d*)?|\.\d+)([KMGTP]i?B|bytes?|B)"
# XLA/TPU and TensorFlow sizes: also a bare letter ("15.48G", "529.00M"), optionally followed by the
# exact count in parentheses, grouped or not ("28.82G (30950542336 bytes)", "(  554,696,704 bytes)",
# "2.99GiB (3206250496B)"): groups number, unit, exact bytes. Read with _size_x, bytes first.
_SZX = r"(\d+(?:\.\d*)?|\.\d+)([KMGTP](?:i?B)?|bytes?|B)(?:\((-?[\d,]+)(?:bytes|B)\))?"
_I = re.I


@dataclass(frozen=True)
class _AnchorSpec:
    kind: Kind
    triggers: tuple[str, ...]   # lower-case literals, one of which the match must contain: the
    pattern: re.Pattern         # regex only runs on regions that have one (regexes cost ~50 ns/char)
    absorb: int = 150           # a same-kind anchor this close after a kept one is the same message
    fallback: bool = False      # a fragment (a quoted part, a cut message): kept only when no other
                                # anchor of its kind is in the region, and only once per region
    extract: Callable[[str, str, re.Match], _Draft] | None = None   # its own extractor, for an anchor
                                # that reads differently from the others of its kind (formats/__init__.py
                                # maps each kind to one otherwise)


def _rx(p: str) -> re.Pattern:
    return re.compile(p, _I)


def _size(pattern: re.Pattern, text: str) -> int | None:
    m = pattern.search(text)
    if not m:
        return None
    value = _to_bytes(m.group(1), m.group(2))
    return value if value < _NO_LIMIT else None


def _size_x(pattern: re.Pattern, text: str, group: int = 1) -> int | None:
    """A size matched by a pattern holding _SZX at `group`: the exact bytes in parentheses when the
    message has them, else the printed figure."""
    m = pattern.search(text)
    if not m:
        return None
    exact = m.group(group + 2)
    return int(exact.replace(",", "")) if exact else _to_bytes(m.group(group), m.group(group + 1))


def _x_simple(kind: Kind, variant_key: str | None = None):
    def extract(span: str, pre: str, m: re.Match) -> _Draft:
        d = _Draft(kind)
        if variant_key:
            d.details[variant_key] = m.group(0)
        d.sig = ()
        return d
    return extract
