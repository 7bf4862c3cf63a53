"""A deep stack's event stream from traces of the same model cut to 2, 3 and 4 blocks.

A decoder's 80 layers are one block repeated; so is what each layer allocates and frees. Cut to
k identical blocks, each phase of the traced step reads S0 U1^k S1 U2^k ... Sr: static runs
(embedding, loss, head) around runs of one unit per block (a layer's forward, its recomputation
and backward, its share of each foreach optimizer op, its gradients dropped in zero_grad). The
units are found by diffing the k=2 and k=3 streams (pure insertions, slid to the start of their
periodic run) and must give back the k=2, 3 and 4 streams token for token. Which storage each
free releases is fitted per position as a copy relation - the same block (c + d), the mirrored
block of a backward (k - 1 - c + d), a fixed block from either end - that must explain all
three traces at once; first, middle and last blocks each get their own, since the first block's
input comes from outside the stack. Module and parameter names get their block index the same
way. Anything that does not fit raises :class:`UnrollError` and the caller traces in full.
No torch here: events, storages and marks only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from oomdoctor.sim.recorder import PhaseMark, Storage


class UnrollError(Exception):
    """The short traces do not repeat in a way this module can extend exactly."""


@dataclass(frozen=True)
class Short:
    """One trace of the model cut to ``k`` blocks."""

    k: int
    raw: tuple[tuple[bool, int, int], ...]
    storages: dict[int, Storage]
    marks: tuple[PhaseMark, ...]


@dataclass(frozen=True)
class Unrolled:
    """The stream of the full stack, as a trace of it would record it."""

    raw: tuple[tuple[bool, int, int], ...]
    storages: dict[int, Storage]
    marks: tuple[PhaseMark, ...]


# -- tokens ------------------------------------------------------------------------------------
class _Tokens:
    """Each event as a small int (equal events of different blocks alike), and the block index
    each allocation's module and name carry."""

    def __init__(self, path: str, names: tuple[str, ...] = ()) -> None:
        self.ids: dict[tuple, int] = {}
        self.names = names
        self.index = {name: j for j, name in enumerate(names)}
        # "path.NAME" as a whole module path (not inside a longer one): a ModuleList's or
        # Sequential's blocks are named 0, 1, ...; a ModuleDict's or an OrderedDict
        # Sequential's by their keys
        alts = "|".join(re.escape(x) for x in sorted(names, key=len, reverse=True)) or r"\d+"
        self.pattern = re.compile(r"(?<![\w.])" + re.escape(path) + r"\.(" + alts
                                  + r")(?=\.|$|\s)") if path else None

    def _block(self, name: str) -> int:
        return self.index[name] if self.names else int(name)

    def _name(self, j: int) -> str:
        return self.names[j] if self.names else str(j)

    def strip(self, text: str) -> tuple[str, int | None]:
        """``text`` with its block index replaced by '#', and the index (None: none)."""
        if self.pattern is None:
            return text, None
        found = {self._block(m) for m in self.pattern.findall(text)}
        if len(found) > 1:
            raise UnrollError(f"two block indices in {text!r}")
        if not found:
            return text, None
        return self.rename(text, "#"), found.pop()

    def rename(self, text: str, to: "str | int") -> str:
        """``text`` with its block name replaced: by ``to`` itself (a str), or by the name of
        block ``to`` (an int)."""
        new = to if isinstance(to, str) else self._name(to)
        return self.pattern.sub(lambda m: m.group(0)[:m.start(1) - m.start(0)] + new, text)

    def of(self, short: Short) -> tuple[list[int], dict[int, tuple]]:
        """Token per event; for each allocation's event index, (module index, name index)."""
        toks: list[int] = []
        index: dict[int, tuple] = {}
        for i, (is_alloc, h, n) in enumerate(short.raw):
            if is_alloc:
                s = short.storages[h]
                module, jm = self.strip(s.module)
                name, jn = self.strip(s.name)
                key = (True, n, s.host, s.category, s.phase, s.iteration, s.op, module, name)
                index[i] = (jm, jn)
            else:
                key = (False, n)
            toks.append(self.ids.setdefault(key, len(self.ids)))
        return toks, index


# -- units -------------------------------------------------------------------------------------
def _common(a: list[int], i: int, b: list[int], j: int) -> int:
    """Length of the common prefix of a[i:] and b[j:] (slice compares run in C)."""
    n = min(len(a) - i, len(b) - j)
    got, step = 0, 64
    while got < n:
        s = min(step, n - got)
        if a[i + got:i + got + s] == b[j + got:j + got + s]:
            got += s
            step *= 2
        elif s == 1:
            break
        else:
            step = max(1, s // 2)
    return got


def _slide(a: list[int], b: list[int], found: list[tuple[int, int, int]]
           ) -> list[tuple[int, int, int]]:
    """Each insertion moved to the start of its periodic run (the same place in every cut)."""
    slid, floor = [], 0
    for i, j, n in found:
        while i > floor and b[j + n - 1] == a[i - 1]:
            i, j = i - 1, j - 1
        slid.append((i, j, n))
        floor = i
    return slid


# A unit: (copies fewer than the block count - 0, or 1-2 where the first or last block's run
# differs and stays static -, its tokens); a static run: (None, tokens).
Part = tuple["int | None", list[int]]


def _parts(a: list[int], b: list[int], found: list[tuple[int, int, int]], k: int
           ) -> list[Part] | None:
    parts: list[Part] = []
    prev = 0
    for i, j, n in _slide(a, b, found):
        unit = b[j:j + n]
        copies = 0
        while copies < k and a[i + copies * n:i + (copies + 1) * n] == unit:
            copies += 1
        if i < prev:
            return None
        parts.append((None, a[prev:i]))
        parts.append((k - copies, unit))
        prev = i + copies * n
    parts.append((None, a[prev:]))
    return parts


def _template(a: list[int], b: list[int], k: int, fits) -> list[Part]:
    """One phase's runs from the k-block and (k+1)-block streams: the first split of b into a
    and inserted runs (shortest runs first, backtracking) whose template ``fits``."""
    budget = [20000]

    def search(i: int, j: int, found: list) -> list[Part] | None:
        m = _common(a, i, b, j)
        i, j = i + m, j + m
        surplus = (len(b) - j) - (len(a) - i)
        if i == len(a) and surplus:
            found, j, surplus = found + [(i, j, surplus)], len(b), 0
        if not surplus:
            parts = _parts(a, b, found, k) if i == len(a) else None
            return parts if parts is not None and fits(parts) else None
        for n in range(1, surplus + 1):
            if b[j + n] != a[i]:
                continue
            budget[0] -= 1
            if budget[0] < 0:
                raise UnrollError("no repeated runs found")
            got = search(i, j + n, found + [(i, j, n)])
            if got is not None:
                return got
        return None
    got = search(0, 0, [])
    if got is None:
        raise UnrollError("the phase does not repeat per block")
    return got


def _expand(parts: list[Part], k: int) -> list[int]:
    return [t for e, toks in parts for _ in range(1 if e is None else k - e) for t in toks]


def _coords(parts: list[Part], k: int, phase: int):
    """(phase, part, copy, offset, copies) of each event of the k-block stream; copy -1:
    static."""
    for q, (e, toks) in enumerate(parts):
        m = 1 if e is None else k - e
        for c in range(m) if e is not None else (-1,):
            for o in range(len(toks)):
                yield (phase, q, c, o, m)


# -- relations ---------------------------------------------------------------------------------
def _class(c: int, m: int) -> str:
    return "s" if c < 0 else "f" if c == 0 else "l" if c == m - 1 else "m"


def _forms(c: int, k: int, target: int) -> set[tuple[str, int]]:
    """Every way to say which block ``target`` is, seen from copy ``c`` of a k-block cut."""
    forms = {("start", target), ("end", k - 1 - target)}
    if c >= 0:
        forms |= {("fwd", target - c), ("rev", target + c - (k - 1))}
    return forms


def _apply(form: tuple[str, int], c: int, k: int) -> int:
    kind, d = form
    return {"start": d, "end": k - 1 - d, "fwd": c + d, "rev": k - 1 - c + d}[kind]


class _Fit:
    """Per source position the one relation all its observations share; where the first or
    last copy differs, one per class of copy (first, middle, last)."""

    def __init__(self) -> None:
        self.seen: dict[tuple, list[tuple]] = {}
        self.rules: dict[tuple, tuple] = {}

    def see(self, key: tuple, cls: str, base, c: int, k: int, target: int | None) -> None:
        self.seen.setdefault(key, []).append((cls, base, c, k, target))

    def solve(self) -> None:
        for key, obs in self.seen.items():
            rules = _grouped(obs, _GROUPS)
            if rules is None:
                rules = _spilled(key, obs)
            self.rules.update({(key, cls): r for cls, r in rules.items()})

    def target(self, key: tuple, cls: str, c: int, k: int) -> tuple[object, int | None]:
        rule = self.rules.get((key, cls))
        if rule is None:
            raise UnrollError(f"nothing seen at {key} ({cls})")
        if isinstance(rule, _Spill):
            return rule.at(k if cls == "s" else c)
        base, forms = rule
        if forms is None:
            return base, None
        at = {_apply(f, c, k) for f in forms}
        if len(at) != 1:
            raise UnrollError(f"the traces leave the relation at {key} open")
        return base, at.pop()


# Which copies share a relation: all of them, or the first or last apart (its input comes from
# outside the stack, its output leaves it), or each class on its own.
_GROUPS = ((("s", "f", "m", "l"),), (("s",), ("f",), ("m", "l")), (("s",), ("f", "m"), ("l",)),
           (("s",), ("f",), ("m",), ("l",)))


def _grouped(obs: list[tuple], choices) -> dict[str, tuple] | None:
    """Each class's relation by the first grouping of ``choices`` whose every group with
    observations has one; None where none does."""
    for groups in choices:
        rules = {g: _rule([o for o in obs if o[0] in g]) for g in groups}
        if all(r is not None for g, r in rules.items() if any(o[0] in g for o in obs)):
            return {cls: r for g, r in rules.items() if r is not None for cls in g}
    return None


def _spilled(key: tuple, obs: list[tuple]) -> dict[str, object]:
    """Where no grouping of :data:`_GROUPS` fits: the static run's relation and the copies'
    each on their own, either of them a :class:`_Spill` (for a static run after the copies,
    counted from the end: its copy index is k)."""
    static = [o for o in obs if o[0] == "s"]
    copies = [o for o in obs if o[0] != "s"]
    rules: dict[str, object] = {}
    if static:
        rules["s"] = _rule(static) or _spill([(cls, base, k, k, target)
                                              for cls, base, _, k, target in static])
    if copies:
        rules.update(_grouped(copies, [groups[1:] for groups in _GROUPS[1:]])
                     or dict.fromkeys("fml", _spill(copies)))
    if any(r is None for r in rules.values()):
        raise UnrollError(f"no one relation at {key}")
    return rules


def _rule(obs: list[tuple]) -> tuple | None:
    """(base, forms) that every observation fits, or None."""
    if not obs:
        return None
    if len({o[1] for o in obs}) != 1 or len({o[4] is None for o in obs}) != 1:
        return None
    if obs[0][4] is None:
        return obs[0][1], None
    forms = None
    for _, _, c, k, target in obs:
        here = _forms(c, k, target)
        forms = here if forms is None else forms & here
    return (obs[0][1], forms) if forms else None


@dataclass(frozen=True)
class _Spill:
    """A free of the storage made ``back`` copies earlier, where the copies before the first
    are the static run's blocks: in pure bf16 a Llama layer frees, as it starts, a tensor
    made two layers before, and the first layer's run differs (it is static, with the
    embedding), so the first two copies reach into the static run at ``before``'s places."""

    unit: tuple                      # (phase, part, offset) of the allocation in the copies
    back: int                        # < 0
    before: tuple[tuple[int, tuple], ...]   # (copy index < 0, its place in the static run)

    def at(self, c: int) -> tuple[object, int | None]:
        j = c + self.back
        if j >= 0:
            return self.unit, j
        found = dict(self.before).get(j)
        if found is None:
            raise UnrollError("a free reaches before the static run's blocks")
        return found, None


def _spill(obs: list[tuple]) -> _Spill | None:
    """The one :class:`_Spill` every observation fits (``target - c`` alike where the target
    is a copy, and one static place per copy index before the first), or None."""
    reached = [o for o in obs if o[4] is not None]
    backs = {target - c for _, _, c, _, target in reached}
    units = {base for _, base, _, _, _ in reached}
    if len(backs) != 1 or len(units) != 1 or next(iter(backs)) >= 0:
        return None
    back = backs.pop()
    before: dict[int, tuple] = {}
    for _, base, c, _, target in obs:
        if target is None and (c + back >= 0 or before.setdefault(c + back, base) != base):
            return None
    return _Spill(units.pop(), back, tuple(sorted(before.items())))


# -- the whole stream --------------------------------------------------------------------------
def unroll(shorts: list[Short], n: int, path: str, names: tuple[str, ...] = ()) -> Unrolled:
    """The event stream of ``n`` blocks from traces cut to 2, 3 and 4 (``shorts``, in order);
    ``names``: the blocks' names in their container, in order (default: 0, 1, ...)."""
    if names and len(names) != n:
        raise UnrollError("a name for each block is needed")
    if [s.k for s in shorts] != [2, 3, 4] or n < 5:
        raise UnrollError("needs traces at 2, 3 and 4 blocks and a deeper stack")
    keys = [tuple((m.phase, m.iteration, m.micro) for m in s.marks) for s in shorts]
    if len(set(keys)) != 1:
        raise UnrollError("the phases differ between the short traces")
    tokens = _Tokens(path, names)
    toks, idx = zip(*(tokens.of(s) for s in shorts))
    per_phase = [_split(t, s) for t, s in zip(toks, shorts)]
    templates = []
    for p in range(len(shorts[0].marks)):
        def fits(parts: list[Part], p: int = p) -> bool:
            return all(_expand(parts, s.k) == ph[p] for s, ph in zip(shorts, per_phase))
        templates.append(_template(per_phase[0][p], per_phase[1][p], 2, fits))
    coords = [[xy for p, parts in enumerate(templates) for xy in _coords(parts, s.k, p)]
              for s in shorts]
    frees, names = _fit(shorts, coords, idx)
    return _generate(shorts[-1], coords[-1], templates, n, frees, names, tokens)


def _split(toks: list[int], short: Short) -> list[list[int]]:
    starts = [m.start for m in short.marks] + [len(toks)]
    return [toks[a:b] for a, b in zip(starts, starts[1:])]


def _fit(shorts: list[Short], coords: list[list[tuple]], idx) -> tuple[_Fit, _Fit]:
    """The relations: which allocation each free releases; each name's block index."""
    frees, names = _Fit(), _Fit()
    for s, xy, index in zip(shorts, coords, idx):
        at = {h: i for i, (a, h, _) in enumerate(s.raw) if a}
        for i, (is_alloc, h, _) in enumerate(s.raw):
            p, q, c, o, m = xy[i]
            cls = _class(c, m)
            if is_alloc:
                jm, jn = index[i]
                names.see((p, q, o, "module"), cls, None, c, s.k, jm)
                names.see((p, q, o, "name"), cls, None, c, s.k, jn)
            else:
                tp, tq, tc, to, _ = xy[at[h]]
                frees.see((p, q, o), cls, (tp, tq, to), c, s.k, tc if tc >= 0 else None)
    frees.solve()
    names.solve()
    return frees, names


def _generate(ref: Short, ref_xy: list[tuple], templates: list[list[Part]], n: int,
              frees: _Fit, names: _Fit, tokens: _Tokens) -> Unrolled:
    """Walk the template for ``n`` blocks: fresh handles in allocation order, each free
    resolved by its relation, each storage copied from its place in ``ref`` (the 4-block
    trace) with its block index renamed."""
    sample = {}     # (phase, part, offset) -> a storage of ref there (its token: all alike)
    for i, (is_alloc, h, _) in enumerate(ref.raw):
        if is_alloc:
            sample.setdefault(ref_xy[i][:2] + ref_xy[i][3:4], ref.storages[h])
    raw: list[tuple[bool, int, int]] = []
    storages: dict[int, Storage] = {}
    marks: list[PhaseMark] = []
    handle_at: dict[tuple, int] = {}
    for p, parts in enumerate(templates):
        marks.append(replace(ref.marks[p], start=len(raw)))
        for q, (e, toks) in enumerate(parts):
            m = 1 if e is None else n - e
            for c in range(m) if e is not None else (-1,):
                cls = _class(c, m)
                for o in range(len(toks)):
                    if (p, q, o, "module") in names.seen:
                        h = len(storages)
                        s = _renamed(sample[p, q, o], names, (p, q, o), cls, c, n, tokens)
                        storages[h] = replace(s, handle=h, t_alloc=len(raw), t_free=None)
                        handle_at[(p, q, c, o)] = h
                        raw.append((True, h, s.nbytes))
                        continue
                    (tp, tq, to), tc = frees.target((p, q, o), cls, c, n)
                    h = handle_at.get((tp, tq, -1 if tc is None else tc, to))
                    if h is None or storages[h].t_free is not None:
                        raise UnrollError("a free without its allocation")
                    storages[h].t_free = len(raw)
                    raw.append((False, h, storages[h].nbytes))
    return Unrolled(tuple(raw), storages, tuple(marks))


def _renamed(s: Storage, names: _Fit, key: tuple, cls: str, c: int, n: int,
             tokens: _Tokens) -> Storage:
    """``s`` with the block index of its module and name as copy ``c`` at ``n`` has it."""
    fields = {}
    for attr in ("module", "name"):
        _, j = names.target(key + (attr,), cls, c, n)
        text = getattr(s, attr)
        if j is not None:
            if j < 0 or j >= n:
                raise UnrollError("a block index outside the stack")
            text = tokens.rename(text, j)
        fields[attr] = text
    return replace(s, **fields)
