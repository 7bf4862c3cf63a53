"""The scanner: batches through the pre-filter, one region per rank stream, tracebacks, anchors -> drafts."""
from __future__ import annotations

import bisect
import re
from collections import OrderedDict, deque
from dataclasses import replace

from .draft import _compatible, _Draft, _merge
from .formats import _ABSORBED_BY, _ANCHORS, _EXTRACT
from .formats.frameworks import _F_TF_INUSE, _F_TF_LIMIT, _F_TF_MAXINUSE
from .evidence import _collect_evidence
from .exceptions import _cut_traceback_draft, _exception_draft, _exception_line
from .formats.host import _BUS_ERROR_LINE
from .formats.kills import _KILLED_LINE, _add_kill_evidence
from .formats.launch import _BARE_ENV_LINE, _DP_HANG, _dp_hang_frames, _p2p_table
from .formats.lookalikes import _ASSERT_TEXT
from .formats.nccl import _CONSUMER, _GPU_MODEL, _add_nccl_evidence
from .formats.nccl_debug import NCCL_DEBUG_LINE, _hang_draft
from .formats.patterns import _AnchorSpec
from .formats.signals import _SEGFAULT_LINE, _add_backtrace_evidence
from .formats.torch_async_mps import _CUT_AT_DEVICE, _CUT_ASYNC_LINE
from .frames import _CODE_MARKER, _EXC_LINE, _FRAME_RES, _TB_HEADER, _Frame
from .limits import (_ANCHOR_SPAN, _EXCERPT, _FRAMES_KEEP, _FRAMES_PER_FINDING, _LOOKBACK, _MAX_FINDINGS,
                     _WRAP_LOOKBACK, _MAX_KEYS, _MAX_LOGICAL, _MAX_RANKS, _PRE_SPAN, _REGION_CARRY, _REGION_GLOBAL_QUIET,
                     _REGION_MAX_CHARS, _REGION_MAX_LINES, _REGION_TAIL, _REGION_TAIL_CHARS, _SUB_BATCH, _TB_REACH)
from .lines import (_ANSI, _RANK_SPLIT, _WS, _contains, _has_keyword, _has_traceback, _hit_lines, _keyword_offsets,
                    _line_starts, _strip_prefixes)
from .results import REPORT_KINDS, Kind
from .sizes import _parse_count

# A line that starts something of its own, never the wrapped rest of the line before.
_STARTS_ANEW = re.compile(r"Traceback \(|File \"|During handling|The above exception|[\w.]+(?:Error|Exception|"
                          r"Warning|Interrupt)\b:?")
# Digits in a line's prefix (timestamps, pids) do not make two prefixes different.
_DIGITS = re.compile(r"\d+")
# Markdown emphasis around a whole line ("**Killed**").
_EMPHASIS = "*_`"
# The last character of a rank's line that a terminal hard-wrapped: a line that stops on one of these
# goes on in the next (unprefixed) line - mid-word, mid-number, after "ProcessGroupNCCL'", "TORCH_NCCL_".
_WRAPS_AFTER = ",;('\"_-/="


# --- facts the log states outside the error messages (used to size the fixes) ---------------

# (triggers in the squashed lower-case region, "|"-separated; fact; pattern on the original line)
_FACTS: tuple[tuple[str, str, re.Pattern], ...] = (
    ("params", "trainable_params", re.compile(r"trainable params:\s*([\d,]+)", re.I)),
    ("params", "total_params", re.compile(r"\|\|\s*all params:\s*([\d,]+)", re.I)),
    ("parameters", "trainable_params", re.compile(r"Number of trainable parameters\s*=\s*([\d,]+)", re.I)),
    ("parameters", "trainable_params", re.compile(r"Trained Parameters:\s*([\d,]+)", re.I)),
    ("param", "total_params",
     re.compile(r"Total\s+(?:number\s+of\s+)?param(?:eter)?s\s*[:=]\s*([\d,.]+\s?[KMBT]?)\b", re.I)),
    ("param", "trainable_params", re.compile(r"^Trainable\s+param(?:eter)?s\s*[:=]\s*([\d,.]+\s?[KMBT]?)\b", re.I)),
    ("params", "total_params", re.compile(r"^([\d.]+\s?[KMBT]?)\s+Total params", re.I)),
    ("params", "trainable_params", re.compile(r"^([\d.]+\s?[KMBT]?)\s+Trainable params", re.I)),
    ("parameters", "total_params", re.compile(r"number of parameters:\s*([\d.]+\s?M)\b", re.I)),
    ("batch", "batch_size", re.compile(
        r"(?:Instantaneous batch size per device\s*=|per_device_train_batch_size\s*[=:]|\bbatch[_ ]size\s*[=:])"
        r"\s*(\d+)", re.I)),
    ("accum", "grad_accum", re.compile(
        r"(?:Gradient Accumulation steps\s*=|gradient_accumulation_steps\s*[=:]|accumulate_grad_batches\s*[=:])"
        r"\s*(\d+)", re.I)),
    ("world|nproc", "world_size",
     re.compile(r"(?:\bworld[_ ]size\s*[=:]|nproc[_-]per[_-]node[= ]|\bWORLD_SIZE=)\s*(\d+)", re.I)),
    ("nproc", "nproc_per_node", re.compile(r"nproc[_-]per[_-]node[= ]\s*(\d+)", re.I)),
)
# The same, triggers split once (every region tests them).
_FACT_TESTS = tuple((tuple(triggers.split("|")), name, rx) for triggers, name, rx in _FACTS)


def _lead(text: str, body_len: int) -> str:
    """A line's prefixes (all but its last `body_len` characters), digits made equal (timestamps
    and pids differ from line to line)."""
    lead = text[:len(text) - body_len].strip()
    return _DIGITS.sub("0", lead) if lead else ""


def _squash(lines: list[tuple[int, str]]) -> tuple[str, list[int]]:
    """The region's lines without whitespace, joined, and where each line starts in that text."""
    starts: list[int] = []
    parts: list[str] = []
    pos = 0
    for _, body in lines:
        sq = _WS.sub("", body)
        starts.append(pos)
        parts.append(sq)
        pos += len(sq)
    return "".join(parts), starts


def _add_assertion(draft: _Draft, lines: list[tuple[int, str]]) -> None:
    """A device-side assert: the first assertion text in the region."""
    for _, text in lines:
        a = _ASSERT_TEXT.search(text)
        if a:
            draft.details["assertion"] = a.group(1)[:200]
            break


def _line_draft(kind: Kind, sig: tuple, detail: str, value: str) -> _Draft:
    """The draft of a message recognised by a whole line: one detail and its signature."""
    d = _Draft(kind)
    d.details[detail] = value
    d.sig = sig
    return d


# --- scanning --------------------------------------------------------------------------------

class _KeyState:
    """Per rank stream: what is needed to assemble that rank's messages."""

    __slots__ = ("recent", "region", "region_chars", "quiet", "quiet_chars", "last_hit", "last_region_end", "frames",
                 "tb_id", "tb_headers", "tb_closed_at", "code_wanted")

    def __init__(self) -> None:
        # (line, body, whether it is the wrapped rest of the line before)
        self.recent: deque[tuple[int, str, bool]] = deque(maxlen=_WRAP_LOOKBACK)
        self.region: list[tuple[int, str]] | None = None
        self.region_chars = 0
        self.quiet = 0
        self.quiet_chars = 0
        self.last_hit = 0
        self.last_region_end = 0
        self.frames: deque[_Frame] = deque(maxlen=_FRAMES_KEEP)
        self.tb_id = 0
        self.tb_headers: deque[tuple[int, int]] = deque(maxlen=16)   # (tb id, line)
        self.tb_closed_at: dict[int, int] = {}
        self.code_wanted = 0


# Set by tests: re-raise parser bugs instead of counting them in skipped_regions.
_STRICT = False


class _Scanner:
    def __init__(self) -> None:
        self.keys: OrderedDict[int | None, _KeyState] = OrderedDict()
        self.lineno = 0
        self.by_kind: dict[Kind, list[_Draft]] = {}
        self.dropped = 0
        self.skipped = 0
        self.facts: dict[str, int] = {}
        self.ranks_seen: set[int] = set()
        self.tf_stats: tuple[int, dict[str, int]] | None = None
        self.gpu_model: str | None = None    # the first GPU model the log names (nvidia-smi, NCCL)
        self.last_exception: tuple[int, int | None, str] | None = None   # (line, rank stream, text)
        self.last_traceback: tuple[int, int | None, str] | None = None   # a "Traceback (most recent ..." header
        self.last_body = ""          # the log's last non-blank line: NCCL's debug output when a run hung in it
        self.last_body_key: tuple[int, int | None] = (0, None)
        # A rank-prefixed line that stops mid-sentence, hard-wrapped by a terminal: the next line
        # arrives without the prefix but belongs to the same rank ("... Of the allocated memory 4"
        # / "0.30 GiB is allocated by PyTorch, ...").
        self.wrap_rank: int | None = None
        self.wrap_line = -1
        # That line and the length of its body: its prefix is only worked out when the next line
        # needs it (rarely), not for every line that might wrap.
        self.wrap_text = ""
        self.wrap_body_len = 0
        # Rank streams with an open region: none for most of a log, and then no stream is looked at.
        self.open_regions = 0

    # batches: a cheap pre-filter decides which lines need real work
    def feed_batch(self, batch: list[str]) -> None:
        """Lines (with or without their newline)."""
        text = "\n".join(batch)
        self._feed(batch, text, _keyword_offsets(text))

    def feed_block(self, block: str) -> None:
        """A run of complete lines joined by newlines (no trailing one). Quiet blocks are only
        counted - no per-line strings are made for them."""
        offsets = _keyword_offsets(block)    # searched once: it also says which lines hit
        if not self._busy(self.lineno) and offsets == [] and not _has_traceback(block):
            n = block.count("\n") + 1
            tail = block.rsplit("\n", _LOOKBACK)[-_LOOKBACK:]
            self.lineno += n - len(tail)
            self._remember_tail(tail, self.lineno, False)
            self.lineno += len(tail)
            return
        self._feed(block.split("\n"), block, offsets)

    def _feed(self, batch: list[str], text: str, offsets: list[int] | None) -> None:
        """`batch` joined by newlines is `text`, its keywords at `offsets` (_keyword_offsets): only
        the lines with a keyword, the lines of open regions and tracebacks, and the last lines
        before a quiet stretch are looked at one by one."""
        start = self.lineno
        starts = _line_starts(batch) if offsets else None
        hits = _hit_lines(offsets, starts)
        if hits or self._busy(start) or _has_traceback(text):
            starts = starts or _line_starts(batch)
            for i in range(0, len(batch), _SUB_BATCH):
                sub = batch[i:i + _SUB_BATCH]
                keyword = hits is None or bisect.bisect_left(hits, i) < len(hits) and hits[
                    bisect.bisect_left(hits, i)] < i + _SUB_BATCH
                # The sub-batch is text[starts[i]:starts[i + len(sub)] - 1].
                if not keyword and not self._busy(start + i) \
                        and not _has_traceback(text, starts[i], starts[i + len(sub)] - 1):
                    self._remember_tail(sub, start + i, hits is None)
                    continue
                for j, line in enumerate(sub):
                    # A line the search did not hit has no keyword (ANSI codes may hide one).
                    check = keyword and (hits is None or "\x1b" in line or _contains(hits, i + j))
                    self._line(line, start + i + j + 1, check)
        else:
            self._remember_tail(batch, start, hits is None)
        self.lineno = start + len(batch)

    def _busy(self, lineno: int) -> bool:
        if not self.open_regions:
            return False
        busy = False
        for key, st in list(self.keys.items()):
            if st.region is not None:
                if lineno - st.last_hit > _REGION_GLOBAL_QUIET:
                    self._close(st, key)
                else:
                    busy = True
        return busy

    def _remember_tail(self, lines: list[str], start: int, check: bool) -> None:
        """A keyword wrapped across the batch boundary needs the lines just before it. `check`:
        whether these lines may hold a keyword (the search found none in them; ANSI codes may hide one)."""
        n = len(lines)
        for j in range(max(0, n - _LOOKBACK), n):
            self._line(lines[j], start + j + 1, check or "\x1b" in lines[j])

    def _line(self, raw: str, lineno: int, check: bool = True) -> None:
        if raw.endswith(("\n", "\r")):     # one test for the lines of a block, which have neither
            if raw.endswith("\n"):
                raw = raw[:-1]
            if raw.endswith("\r"):
                raw = raw[:-1]    # CRLF: the line's end, not a carriage return that rewrites it
        if "\x1b" in raw:
            raw = _ANSI.sub("", raw)
        for piece in raw.split("\r") if "\r" in raw else (raw,):
            # The common tagged line - one tag, in front - is one part: no split.
            if ("[rank" in piece or "[default" in piece) \
                    and not (piece.startswith(("[rank", "[default")) and piece.count("[") == 1):
                parts = [p for p in _RANK_SPLIT.split(piece) if p]
                if len(parts) > 1 and not _strip_prefixes(parts[0])[1].strip():
                    parts[:2] = [parts[0] + parts[1]]   # "<time> [rank3]: ...": one line, the time its prefix
            else:
                parts = (piece,)
            for part in parts:
                if len(part) <= _MAX_LOGICAL:
                    self._logical(part, lineno, check)
                else:
                    for k in range(0, len(part), _MAX_LOGICAL):
                        self._logical(part[k:k + _MAX_LOGICAL], lineno, check)

    def _state(self, key: int | None) -> _KeyState:
        st = self.keys.get(key)
        if st is None:
            st = self.keys[key] = _KeyState()
            if len(self.keys) > _MAX_KEYS:
                old_key, old = self.keys.popitem(last=False)
                if old.region is not None:
                    self._close(old, old_key)
        else:
            self.keys.move_to_end(key)
        return st

    def _logical(self, text: str, lineno: int, check: bool = True) -> None:
        rank, body = _strip_prefixes(text)
        # The wrapped rest carries no rank tag of its own: at most the prefix every line of the log
        # has (a timestamp, a pod name), which is then the start of the previous line's prefix.
        wrapped = False
        if rank is None and self.wrap_rank is not None and lineno == self.wrap_line + 1 \
                and self._continues_lead(_lead(text, len(body))) and not _STARTS_ANEW.match(body):
            rank, wrapped = self.wrap_rank, True
        tail = body.rstrip()[-1:]
        # (a line that is all prefix - the terminal cut it right after "[rank3]:[E... ProcessGroupNCCL.cpp:1743] " -
        # goes on in the next line too)
        self.wrap_rank = rank if rank is not None and (not tail or tail.isalnum() or tail in _WRAPS_AFTER) else None
        self.wrap_line = lineno
        if self.wrap_rank is not None:
            self.wrap_text, self.wrap_body_len = text, len(body)
        if rank is not None and len(self.ranks_seen) < _MAX_RANKS:
            self.ranks_seen.add(rank)
        st = self.keys.get(rank)
        if st is None:
            st = self._state(rank)      # a new stream (the oldest may be dropped)
        else:
            self.keys.move_to_end(rank)
        # Most lines are neither in a traceback nor part of one: no call for them. (The words are
        # those _track_frames looks for, less what follows them.)
        if st.tb_headers or "File " in body or ".py" in body or "Cell In" in body or _TB_HEADER in body:
            if _TB_HEADER in body:
                self.last_traceback = (lineno, rank, body)
            self._track_frames(st, body, lineno)
        if tail:
            self.last_body, self.last_body_key = body, (lineno, rank)
            if self.last_traceback is not None and _EXC_LINE.match(body.lstrip()):
                self.last_traceback = None       # closed by its exception line (KeyboardInterrupt too)
        if "rror" in body or "ption" in body or "ailure" in body:
            if _exception_line(body):
                self.last_exception = (lineno, rank, body)
        hit = check and _has_keyword(body)
        if st.region is not None:
            st.region.append((lineno, body))
            st.region_chars += len(body)
            if hit:
                st.quiet = st.quiet_chars = 0
                st.last_hit = lineno
            else:
                st.quiet += 1
                st.quiet_chars += len(body) + 1
            if st.quiet > _REGION_TAIL and st.quiet_chars > _REGION_TAIL_CHARS or st.quiet > 4 * _REGION_TAIL:
                self._close(st, rank)
            elif len(st.region) >= _REGION_MAX_LINES or st.region_chars >= _REGION_MAX_CHARS:
                self._split(st, rank)
        elif hit:
            self.open_regions += 1
            st.region = self._lookback(st)
            st.region.append((lineno, body))
            st.region_chars = sum(len(b) for _, b in st.region)
            st.quiet = st.quiet_chars = 0
            st.last_hit = lineno
        st.recent.append((lineno, body, wrapped))

    @staticmethod
    def _lookback(st: _KeyState) -> list[tuple[int, str]]:
        """The lines before a keyword that its region starts with: the last _LOOKBACK, and further back
        while they are one hard-wrapped line (a keyword the wrap cut in two is found in none of them)."""
        recent = [item for item in st.recent if item[0] > st.last_region_end]
        first = max(0, len(recent) - _LOOKBACK)
        while first > 0 and recent[first][2]:
            first -= 1
        return [(ln, b) for ln, b, _ in recent[first:]]

    def _continues_lead(self, lead: str) -> bool:
        """Whether `lead` starts the prefix of the line that may wrap (every prefix starts with none:
        the common unprefixed line does not need it worked out)."""
        return not lead or _lead(self.wrap_text, self.wrap_body_len).startswith(lead)

    def _track_frames(self, st: _KeyState, body: str, lineno: int) -> None:
        b = body.strip()
        if _TB_HEADER in b and len(b) < 200:
            st.tb_id += 1
            st.tb_headers.append((st.tb_id, lineno))
            st.code_wanted = 0
            return
        frame_like = b.startswith(("File ", "Cell In")) or ".py:" in b or ".py in " in b
        open_tb = bool(st.tb_headers) and st.tb_id not in st.tb_closed_at \
            and lineno - st.tb_headers[-1][1] <= _TB_REACH
        if not open_tb and not frame_like:
            return
        for rx in (_FRAME_RES if frame_like else ()):
            m = rx.match(b)
            if m:
                if not open_tb:
                    # An excerpt that starts mid-traceback: its first frame opens one.
                    st.tb_id += 1
                    st.tb_headers.append((st.tb_id, lineno))
                func = (m.groupdict().get("func") or "<cell>").rsplit(".", 1)[-1]
                st.frames.append(_Frame(lineno, st.tb_id, func[:80], m.group("file")[:200]))
                st.code_wanted = 12 if b.startswith("Cell In") or not b.startswith('File "') else 1
                return
        if st.code_wanted and st.frames:
            marker = _CODE_MARKER.match(b)
            if marker:
                st.frames[-1].code = marker.group(1)[:200]
                st.code_wanted = 0
            elif st.code_wanted == 1:
                st.frames[-1].code = b[:200]
                st.code_wanted = 0
            else:
                st.code_wanted -= 1
            return
        if _EXC_LINE.match(b):
            st.tb_closed_at[st.tb_id] = lineno
            if len(st.tb_closed_at) > 32:
                st.tb_closed_at.pop(next(iter(st.tb_closed_at)))

    def _frames_for(self, st: _KeyState, line: int) -> list[_Frame]:
        """Frames of the traceback that ends at (or just before) `line`, innermost last."""
        for tb_id, header_line in reversed(st.tb_headers):
            if header_line <= line:
                if line - header_line <= _TB_REACH:
                    closed = st.tb_closed_at.get(tb_id)
                    if closed is None or closed >= line - 3:
                        frames = [f for f in st.frames if f.tb == tb_id and f.line < line]
                        if frames:
                            return frames[-_FRAMES_PER_FINDING:]
                break
        # VS Code ("Exception has occurred: ...") prints the message first and then the frames,
        # innermost first: a frame list that starts right after the message belongs to it.
        for tb_id, header_line in st.tb_headers:
            if line < header_line <= line + 3:
                frames = [f for f in st.frames if f.tb == tb_id]
                return frames[:_FRAMES_PER_FINDING][::-1]
        return []

    # regions
    def _close(self, st: _KeyState, key: int | None) -> None:
        if st.region is not None:
            self.open_regions -= 1
        lines, st.region = st.region or [], None
        st.region_chars = 0
        st.quiet = st.quiet_chars = 0
        if lines:
            st.last_region_end = lines[-1][0]
            self._process(st, key, lines, None)

    def _split(self, st: _KeyState, key: int | None) -> None:
        lines = st.region or []
        carry = lines[-_REGION_CARRY:]
        self._process(st, key, lines, carry[0][0] if carry else None)
        st.region = list(carry)
        st.region_chars = sum(len(b) for _, b in carry)

    def finish(self) -> None:
        open_regions = [(st.region[0][0], i, key, st) for i, (key, st) in enumerate(self.keys.items()) if st.region]
        for _, _, key, st in sorted(open_regions):
            self._close(st, key)
        # Only for a log with no other error: what else is found explains the failure better.
        errors = [k for k in self.by_kind if k not in REPORT_KINDS]
        if self.last_exception is not None and not any(k is not Kind.RANK_FAILED for k in errors):
            lineno, key, body = self.last_exception
            match = _exception_line(body)
            if match:
                self._place(_exception_draft(match), self._state(key), key, lineno, body)
        elif self.last_traceback is not None and not errors:
            # A traceback cut before its exception line is still a failure (never "no known error").
            lineno, key, body = self.last_traceback
            self._place(_cut_traceback_draft(), self._state(key), key, lineno, body)
        elif not errors and self.gpu_model and _CONSUMER.search(self.gpu_model) \
                and NCCL_DEBUG_LINE.search(self.last_body):
            # The run stopped inside NCCL's initialisation on consumer cards: a P2P hang.
            lineno, key = self.last_body_key
            self._place(_hang_draft(self.gpu_model), self._state(key), key, lineno, self.last_body)

    def _process(self, st: _KeyState, key: int | None, lines: list[tuple[int, str]], stop_line: int | None) -> None:
        try:
            self._parse_region(st, key, lines, stop_line)
        except Exception:  # noqa: BLE001 - one unparsable region must not lose the others
            if _STRICT:
                raise
            self.skipped += 1

    def _parse_region(self, st: _KeyState, key: int | None, lines: list[tuple[int, str]],
                      stop_line: int | None) -> None:
        """Facts, anchored messages and whole-line messages of one region (none from stop_line on)."""
        sq, starts = _squash(lines)
        low = sq.lower()
        self._collect_facts(lines, sq, low)
        kept = self._anchors(sq, low)
        self._place_anchored(st, key, lines, stop_line, sq, starts, kept)
        # Messages recognised by a whole line.
        kinds = {spec.kind for _, spec, _ in kept}
        self._place_p2p_table(st, key, lines, stop_line, low)
        self._place_whole_lines(st, key, lines, stop_line, low, kinds)

    def _anchors(self, sq: str, low: str) -> list[tuple[int, _AnchorSpec, re.Match]]:
        """Every anchor in the squashed region, in order, less the fallbacks of a kind already
        anchored and the matches an earlier one absorbs."""
        found: list[tuple[int, _AnchorSpec, re.Match]] = []
        for spec in _ANCHORS:
            if not any(map(low.__contains__, spec.triggers)):
                continue
            for m in spec.pattern.finditer(sq):
                found.append((m.start(), spec, m))
        found.sort(key=lambda t: t[0])
        whole = {spec.kind for _, spec, _ in found if not spec.fallback}
        kept: list[tuple[int, _AnchorSpec, re.Match]] = []
        for item in found:
            spec = item[1]
            if spec.fallback and (spec.kind in whole or any(k[1].kind is spec.kind for k in kept)):
                continue
            if not self._absorbed(item, kept):
                kept.append(item)
        return kept

    def _place_anchored(self, st: _KeyState, key: int | None, lines: list[tuple[int, str]], stop_line: int | None,
                        sq: str, starts: list[int], kept: list[tuple[int, _AnchorSpec, re.Match]]) -> None:
        """One draft per kept anchor before stop_line, from its text up to the next anchor."""
        for i, (start, spec, m) in enumerate(kept):
            idx = bisect.bisect_right(starts, start) - 1
            lineno, body = lines[idx]
            if stop_line is not None and lineno >= stop_line:
                continue
            end = kept[i + 1][0] if i + 1 < len(kept) else len(sq)
            span = sq[start:min(end, start + _ANCHOR_SPAN)]
            pre = sq[max(0, start - _PRE_SPAN):start]
            draft = (spec.extract or _EXTRACT[spec.kind])(span, pre, m)
            if draft.kind is Kind.DEVICE_ASSERT:
                _add_assertion(draft, lines)
            elif draft.kind is Kind.NCCL_ERROR:
                _add_nccl_evidence(draft, lines)
            elif draft.kind is Kind.OOM_KILLER:
                _add_kill_evidence(draft, lines)
            if "caught" in draft.details:
                _add_backtrace_evidence(draft, lines)
            self._place(draft, st, key, lineno, body)

    def _place_p2p_table(self, st: _KeyState, key: int | None, lines: list[tuple[int, str]], stop_line: int | None,
                         low: str) -> None:
        if "gpu0" in low and "gpu1" in low and (table := _p2p_table(lines)) is not None:
            if stop_line is None or table[0] < stop_line:
                self._place(table[2], st, key, table[0], table[1])

    def _place_whole_lines(self, st: _KeyState, key: int | None, lines: list[tuple[int, str]], stop_line: int | None,
                           low: str, kinds: set[Kind]) -> None:
        """'Killed', 'Bus error', the cudaMallocAsync message cut at the device, and a bare
        launcher variable that the code reads with os.environ[...]: each a line of its own."""
        # The cut message and the bare variable only when no anchor of their kind is here.
        cut_async = "allocationondevice" in low and Kind.CUDA_ASYNC_OOM not in kinds
        bare_env = Kind.MISSING_LAUNCH_ENV not in kinds and "os.environ[" in low
        if "killed" not in low and "buserror" not in low and "segmentationfault" not in low and not cut_async \
                and not bare_env:
            return
        for lineno, body in lines:
            if stop_line is not None and lineno >= stop_line:
                break
            b = body.strip().strip(_EMPHASIS).strip()
            if cut_async and _CUT_ASYNC_LINE.search(b):
                cut_async = False
                self._place(_line_draft(Kind.CUDA_ASYNC_OOM, (None, None), "format", _CUT_AT_DEVICE),
                            st, key, lineno, body)
            elif bare_env and (bare := _BARE_ENV_LINE.match(b)):
                var = bare.group(1)
                if f"os.environ[\"{var.lower()}\"]" in low or f"os.environ['{var.lower()}']" in low:
                    bare_env = False
                    self._place(_line_draft(Kind.MISSING_LAUNCH_ENV, (var,), "variable", var), st, key, lineno, body)
            elif _KILLED_LINE.match(b):
                # sig (): the shell's line and the kernel's or Slurm's report of one kill are one finding
                self._place(_line_draft(Kind.OOM_KILLER, (), "source", "shell reported 'Killed'"),
                            st, key, lineno, body)
            elif _BUS_ERROR_LINE.match(b):
                self._place(_line_draft(Kind.SHARED_MEMORY, (), "signal", "Bus error"), st, key, lineno, body)
            elif _SEGFAULT_LINE.match(b) and Kind.NATIVE_CRASH not in kinds:
                self._place(_line_draft(Kind.NATIVE_CRASH, ("SIGSEGV",), "signal", "SIGSEGV"), st, key, lineno, body)

    @staticmethod
    def _absorbed(item: tuple[int, _AnchorSpec, re.Match], kept: list) -> bool:
        start, spec, _ = item
        rule = _ABSORBED_BY.get(spec.kind)
        for k_start, k_spec, k_m in reversed(kept):
            distance = start - k_start
            if distance > 400:
                break
            if k_spec.kind == spec.kind and distance <= spec.absorb:
                return True
            if start < k_m.end():
                return True
            if rule and k_spec.kind in rule[0] and distance <= rule[1]:
                return True
        return False

    def _place(self, d: _Draft, st: _KeyState, key: int | None, lineno: int, body: str) -> None:
        d.line = lineno
        d.excerpt = body.strip()[:_EXCERPT]
        if key is not None and key not in d.ranks:
            d.ranks.append(key)
        if key is not None and d.collectives:
            # The "[Rank N]" inside a watchdog line was consumed as this stream's prefix.
            d.collectives = [c if c.rank is not None else replace(c, rank=key) for c in d.collectives]
        d.frames = self._frames_for(st, lineno)
        if d.details.get("source") == _DP_HANG and not _dp_hang_frames(d.frames):
            return   # a Ctrl-C anywhere else is not an error to explain
        if d.kind is Kind.TF_OOM and self.tf_stats and 0 <= lineno - self.tf_stats[0] <= 5000:
            for k, v in self.tf_stats[1].items():
                d.numbers.setdefault(k, v)
        self._add(d)

    def _add(self, d: _Draft) -> None:
        same = self.by_kind.setdefault(d.kind, [])
        for b in same:
            if _compatible(b.sig, d.sig):
                _merge(b, d)
                return
        if sum(len(v) for v in self.by_kind.values()) >= _MAX_FINDINGS:
            self.dropped += 1
            return
        same.append(d)

    def _collect_facts(self, lines: list[tuple[int, str]], sq: str, low: str) -> None:
        facts = [(name, rx) for triggers, name, rx in _FACT_TESTS if any(map(low.__contains__, triggers))]
        for lineno, body in lines if facts else ():
            b = body.strip()
            for name, rx in facts:
                m = rx.search(b)
                if m:
                    value = _parse_count(m.group(1))
                    if value is not None and (name.endswith("params") or value < 1_000_000):
                        self.facts[name] = value
        _collect_evidence(lines, low, self.facts)
        if self.gpu_model is None and ("geforce" in low or "nvidia" in low or "tesla" in low or "rtx" in low):
            found = _GPU_MODEL.search(" ".join(body for _, body in lines))
            self.gpu_model = found.group(1) if found else None
        if "Limit:" in sq and "InUse:" in sq:
            stats = {}
            for name, rx in (("limit", _F_TF_LIMIT), ("in_use", _F_TF_INUSE), ("max_in_use", _F_TF_MAXINUSE)):
                m = rx.search(sq)
                if m:
                    stats[name] = int(m.group(1))
            if stats:
                self.tf_stats = (lines[0][0], stats)
