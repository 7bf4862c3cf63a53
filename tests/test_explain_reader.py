"""The reader's shortcuts against the plain definitions they speed up: the keyword pre-filter (one
anchored regex and find() passes over a block) must hit exactly the lines whose lower-cased text
holds a keyword, and a block is cut only where it holds a line longer than _MAX_LINE."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from oomdoctor.explain.limits import _MAX_LINE
from oomdoctor.explain.lines import _ANCHORED, _KEYWORDS, _hit_lines, _keyword_offsets, _line_starts
from oomdoctor.explain.stream import _bounded, _split_line

LOGS = Path(__file__).parent / "logs"


def _lines_with_a_keyword(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if any(k in line.lower() for k in _KEYWORDS)]


def _hits(text: str) -> list[int]:
    offsets = _keyword_offsets(text)
    assert offsets is not None      # only None when lower() changes the length (not in these texts)
    return _hit_lines(offsets, _line_starts(text.split("\n"))) or []


def test_the_regex_takes_a_share_of_the_keywords():
    assert 0 < len(_ANCHORED) < len(_KEYWORDS)


@pytest.mark.parametrize("seed", range(4))
def test_hit_lines_are_the_lines_holding_a_keyword(seed):
    # Keywords, their heads and tails (a keyword cut by a newline, or two that overlap), the anchor
    # letters alone, in three cases.
    rng = random.Random(seed)
    pieces = [*_KEYWORDS, " ", "\n", "\n", "x", "k", "y", "z", "g", "w", "b", "v", "'", "_"]
    pieces += [k[:i] for k in _KEYWORDS for i in range(1, len(k))]
    pieces += [k[i:] for k in _KEYWORDS for i in range(1, len(k))]
    for _ in range(500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 50)))
        text = rng.choice((str, str.upper, str.title))(text)
        assert _hits(text) == _lines_with_a_keyword(text.split("\n")), text


def test_hit_lines_of_every_test_log():
    for path in sorted(LOGS.glob("*.log")):
        text = path.read_text("utf-8", "replace")
        if len(text.lower()) == len(text):
            assert _hits(text) == _lines_with_a_keyword(text.split("\n")), path.name


@pytest.mark.parametrize("lengths", [
    [_MAX_LINE, 10],                  # just over _MAX_LINE in all: nothing to cut
    [10, _MAX_LINE + 1],              # one character too long
    [_MAX_LINE // 2] * 5,             # lines of half the limit, back to back
    [_MAX_LINE // 2 - 1, _MAX_LINE + 3, 7],
    [3 * _MAX_LINE],
])
def test_a_block_is_cut_only_at_lines_longer_than_the_limit(lengths):
    block = "\n".join("a" * n for n in lengths)
    expected = "\n".join(piece for line in block.split("\n") for piece in _split_line(line))
    assert list(_bounded(block)) == [expected]
