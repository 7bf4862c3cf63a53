"""What the message patterns share: the size pattern, anchor specs, field lookups and the simplest extractor."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..draft import _Draft
from ..results import Kind
from ..sizes import _NO_LIMIT, _to_bytes

# Patterns run on "squashed" text (all whitespace removed), so spaces never appear in them.

_SZ = r"(\d+(?:\.\d*)?|\.\d+)([KMGTP]i?B|bytes?|B)"
_I = re.I


@dataclass(frozen=True)
class _AnchorSpec:
    kind: Kind
    triggers: tuple[str, ...]   # lower-case literals, one of which the match must contain: the
    pattern: re.Pattern         # regex only runs on regions that have one (regexes cost ~50 ns/char)
    absorb: int = 150           # a same-kind anchor this close after a kept one is the same message
    fallback: bool = False      # a fragment (a quoted part, a cut message): kept only when no other
                                # anchor of its kind is in the region, and only once per region


def _rx(p: str) -> re.Pattern:
    return re.compile(p, _I)


def _size(pattern: re.Pattern, text: str) -> int | None:
    m = pattern.search(text)
    if not m:
        return None
    value = _to_bytes(m.group(1), m.group(2))
    return value if value < _NO_LIMIT else None


def _x_simple(kind: Kind, variant_key: str | None = None):
    def extract(span: str, pre: str, m: re.Match) -> _Draft:
        d = _Draft(kind)
        if variant_key:
            d.details[variant_key] = m.group(0)
        d.sig = ()
        return d
    return extract
