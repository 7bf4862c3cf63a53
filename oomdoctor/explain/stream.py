"""Reading a log: explain_stream, explain_text, explain_file and read_lines, in bounded batches and blocks."""
from __future__ import annotations

import codecs
from typing import IO, Iterable, Iterator

from .findings import _finalise
from .limits import _BATCH_CHARS, _BATCH_LINES, _MAX_LINE, _READ_CHUNK
from .results import ExplainResult
from .scanner import _Scanner


def explain_stream(lines: Iterable[str]) -> ExplainResult:
    """Find and explain every known error in `lines` (an open text file, a list, a generator).

    Lines may or may not end in a newline; bytes are decoded as UTF-8 with replacement. The input
    is consumed once, in bounded batches, so its size does not matter."""
    scanner = _Scanner()
    batch: list[str] = []
    append = batch.append
    size = 0
    for raw in lines:
        if type(raw) is not str:
            raw = bytes(raw).decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray, memoryview)) \
                else str(raw)
        n = len(raw)
        nl = raw.find("\n")
        # The common case - one line, with or without its newline - costs one find() and no copy;
        # batch entries keep their newline so a batch is checked with one "".join().
        if (nl == -1 or nl == n - 1) and n <= _MAX_LINE:
            append(raw)
            size += n
        else:
            for piece in _split_line(raw):
                append(piece)
                size += len(piece)
        if len(batch) >= _BATCH_LINES or size >= _BATCH_CHARS:
            scanner.feed_batch(batch)
            batch = []
            append = batch.append
            size = 0
    if batch:
        scanner.feed_batch(batch)
    scanner.finish()
    return _finalise(scanner)


def _split_line(raw: str) -> Iterator[str]:
    """Lines of `raw` (which may hold several, or one longer than _MAX_LINE) as batch entries."""
    parts = raw.split("\n")
    if parts[-1] == "":
        parts.pop()     # the newline that ends the last line does not start a new one
    for part in parts:
        for k in range(0, max(1, len(part)), _MAX_LINE):
            yield part[k:k + _MAX_LINE]


def explain_text(text: str) -> ExplainResult:
    """explain_stream for a string already in memory."""
    return explain_stream(text.split("\n"))


def explain_file(stream: IO[bytes], chunk_size: int = _READ_CHUNK) -> ExplainResult:
    """explain_stream for a binary file or stdin, read in `chunk_size` blocks.

    The fast path used by the CLI: each block of complete lines is checked as one string, and
    only blocks that contain a keyword are split into lines."""
    scanner = _Scanner()
    for block in _text_blocks(stream, chunk_size):
        scanner.feed_block(block)
    scanner.finish()
    return _finalise(scanner)


def read_lines(stream: IO[bytes], chunk_size: int = _READ_CHUNK) -> Iterator[str]:
    """Decode a binary stream into lines (without their newlines), `chunk_size` bytes at a time.

    UTF-8 (with or without BOM) by default; UTF-16 when the stream starts with a UTF-16 BOM
    (PowerShell 5 `>` redirection writes UTF-16LE). Invalid bytes become U+FFFD; physical lines
    longer than _MAX_LINE characters are cut, so memory stays bounded even without newlines."""
    for block in _text_blocks(stream, chunk_size):
        yield from block.split("\n")


def _text_blocks(stream: IO[bytes], chunk_size: int) -> Iterator[str]:
    """Decoded text in blocks of complete lines: newline-separated, without a trailing newline,
    no line longer than _MAX_LINE."""
    first = stream.read(chunk_size)
    if not first:
        return
    if first.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        decoder = codecs.getincrementaldecoder("utf-16")(errors="replace")
    else:
        decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
    pending = ""
    chunk = first
    while chunk:
        pending += decoder.decode(chunk)
        cut = pending.rfind("\n")
        if cut >= 0:
            block, pending = pending[:cut], pending[cut + 1:]
            yield from _bounded(block)
        while len(pending) > _MAX_LINE:      # a line with no end in sight: cut it
            yield pending[:_MAX_LINE]
            pending = pending[_MAX_LINE:]
        chunk = stream.read(chunk_size)
    pending += decoder.decode(b"", final=True)
    if pending:
        yield from _bounded(pending)


def _bounded(block: str) -> Iterator[str]:
    """`block`, with any line longer than _MAX_LINE cut into pieces (rare: only checked when the
    block itself is long enough to hold such a line)."""
    if len(block) <= _MAX_LINE or _newline_every_half_line(block) or max(map(len, block.split("\n"))) <= _MAX_LINE:
        yield block
    else:
        yield "\n".join(piece for line in block.split("\n") for piece in _split_line(line))


def _newline_every_half_line(block: str) -> bool:
    """Whether every whole stretch [k*h, (k+1)*h) of `block`, h = _MAX_LINE // 2, holds a newline: then no
    line is longer than _MAX_LINE, which would contain one such stretch. A few find()s that stop at the
    first newline, instead of splitting the block (a 64 KiB read and the line it cut are often just over
    _MAX_LINE)."""
    h = _MAX_LINE // 2
    return all(block.find("\n", k, k + h) >= 0 for k in range(0, len(block) - h + 1, h))
