"""``PYTORCH_CUDA_ALLOC_CONF``: the settings the simulator models, parsed with PyTorch's grammar."""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass

from oomdoctor.sim.allocator.sizes import K_LARGE_BUFFER, MiB

_ENV = "PYTORCH_CUDA_ALLOC_CONF"

# Keys PyTorch accepts that change how device memory is laid out, but that
# this simulator does not reproduce.  Accepting them silently would give
# numbers that differ from the real run, so they are refused.
_NOT_MODELLED = {
    "garbage_collection_threshold": (
        "it makes the allocator free old cached blocks before cudaMalloc once a "
        "memory fraction is set"
    ),
    "roundup_power2_divisions": (
        "it changes how request sizes are rounded (power-of-two divisions instead "
        "of multiples of 512 bytes)"
    ),
    "max_non_split_rounding_mb": (
        "it changes how much larger than the request an oversize cached block may be"
    ),
}

# Keys PyTorch accepts that do not change device-memory accounting (they
# concern the pinned host allocator, or locking): validated, then ignored
# because they have no effect on what is simulated.
_NO_EFFECT_BOOL = {
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_background_threads",
    "graph_capture_record_stream_reuse",
}
_NO_EFFECT_INT = {"pinned_num_register_threads", "pinned_reserve_segment_size_mb"}

_MODELLED = {"expandable_segments", "max_split_size_mb", "backend"}
_KNOWN_KEYS = sorted(_MODELLED | set(_NOT_MODELLED) | _NO_EFFECT_BOOL | _NO_EFFECT_INT)


def _tokenize(value: str) -> list[str]:
    # Same lexing as PyTorch's ConfigTokenizer: ',', ':', '[' and ']' are
    # tokens of their own, whitespace is dropped, anything else is glued.
    tokens: list[str] = []
    buf: list[str] = []
    for ch in value:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` settings the simulator models.

    ``expandable_segments``: one growing segment per pool instead of one
    ``cudaMalloc`` per segment.  ``max_split_size``: in bytes; blocks at least
    this large are "oversize" (see ``get_free_block`` / ``should_split``);
    ``None`` means unlimited, PyTorch's default.  PyTorch only accepts values
    of at least 20 MiB (``max_split_size_mb >= 20``).
    """

    expandable_segments: bool = False
    max_split_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.expandable_segments, bool):
            raise ValueError(
                f"AllocatorConfig.expandable_segments must be a bool, got "
                f"{self.expandable_segments!r}; pass True or False."
            )
        mss = self.max_split_size
        if mss is not None:
            if isinstance(mss, bool) or not isinstance(mss, int):
                raise ValueError(
                    f"AllocatorConfig.max_split_size must be an int number of bytes or "
                    f"None, got {mss!r}; for max_split_size_mb:N pass N * MiB."
                )
            if mss < K_LARGE_BUFFER:
                raise ValueError(
                    f"AllocatorConfig.max_split_size={mss} bytes is below 20 MiB; PyTorch "
                    f"refuses max_split_size_mb below 20 (kLargeBuffer), so such an "
                    f"allocator cannot exist. Use at least {K_LARGE_BUFFER} bytes, or None."
                )

    @classmethod
    def from_env(cls, value: str) -> "AllocatorConfig":
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string.

        Example: ``"expandable_segments:True,max_split_size_mb:128"``.  The
        grammar is PyTorch's (``key:value`` pairs separated by commas,
        whitespace ignored, ``True``/``False`` spelled exactly so).  Raises
        :class:`ValueError` for unknown keys, malformed values, and keys that
        PyTorch knows but this simulator does not model.  Keys that only
        affect the pinned host allocator or locking
        (``release_lock_on_cudamalloc``, ``pinned_*``,
        ``graph_capture_record_stream_reuse``) are validated and accepted,
        since they do not change device memory.  ``backend:native`` is the
        modelled allocator and accepted; ``backend:cudaMallocAsync`` is not.
        """
        if not isinstance(value, str):
            raise ValueError(f"{_ENV} must be a string, got {type(value).__name__}")
        expandable = False
        max_split: int | None = None
        for key, val in _options(value):
            if key == "expandable_segments":
                expandable = val == "True"
            elif key == "max_split_size_mb":
                max_split = int(val) * MiB
        return cls(expandable_segments=expandable, max_split_size=max_split)


def _options(value: str) -> Iterator[tuple[str, str]]:
    """The ``key:value`` pairs of ``value`` in order, each checked (name, shape, value, the
    comma after it) before it is yielded; the first problem raises :class:`ValueError`."""
    tokens = _tokenize(value)
    i = 0
    n = len(tokens)
    while i < n:
        key = tokens[i]
        _check_option_name(value, key, i)
        val = _option_value(value, tokens, i, key)
        _check_value(value, key, val)
        i += 3
        if i < n:
            if tokens[i] != ",":
                raise ValueError(
                    f"{_ENV}={value!r}: expected ',' after {key}:{val}, found "
                    f"{tokens[i]!r}. Separate options with commas."
                )
            i += 1
            if i == n:
                raise ValueError(
                    f"{_ENV}={value!r}: trailing ',' with no option after it."
                )
        yield key, val


def _check_option_name(value: str, key: str, i: int) -> None:
    """Token ``i`` must name an option that PyTorch knows and this simulator models (or that
    has no effect on device memory)."""
    if key in ",:[]":
        raise ValueError(
            f"{_ENV}={value!r}: expected an option name at token {i + 1}, found "
            f"{key!r}. The format is key:value pairs separated by commas, e.g. "
            f"'expandable_segments:True,max_split_size_mb:128'."
        )
    if key not in _KNOWN_KEYS:
        close = difflib.get_close_matches(key, _KNOWN_KEYS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{_ENV}={value!r}: unknown option {key!r}; PyTorch would refuse it "
            f"('Unrecognized key').{hint} Known options: {', '.join(_KNOWN_KEYS)}."
        )
    if key in _NOT_MODELLED:
        raise ValueError(
            f"{_ENV}={value!r}: option {key!r} exists in PyTorch but is not "
            f"modelled by oomdoctor's allocator simulator ({_NOT_MODELLED[key]}), so "
            f"a prediction would differ from the real run. Remove {key!r} from the "
            f"string given to oomdoctor; modelled options are expandable_segments "
            f"and max_split_size_mb."
        )


def _option_value(value: str, tokens: list[str], i: int, key: str) -> str:
    """The value token of the option named at token ``i``: ``key`` ``:`` ``VALUE``."""
    n = len(tokens)
    if i + 1 >= n or tokens[i + 1] != ":":
        raise ValueError(
            f"{_ENV}={value!r}: option {key!r} needs a value, written "
            f"'{key}:VALUE'."
        )
    if i + 2 >= n or tokens[i + 2] in ",:[]":
        raise ValueError(
            f"{_ENV}={value!r}: option {key!r} has no value after ':' (lists in "
            f"[...] are only used by options this simulator does not model)."
        )
    return tokens[i + 2]


def _check_value(value: str, key: str, val: str) -> None:
    """``val`` must be a value PyTorch accepts for ``key`` (for ``backend``: the modelled one)."""
    if key == "expandable_segments" or key in _NO_EFFECT_BOOL:
        if val not in ("True", "False"):
            raise ValueError(
                f"{_ENV}={value!r}: {key} must be True or False (capitalised, as "
                f"PyTorch requires), got {val!r}."
            )
    elif key == "max_split_size_mb" or key in _NO_EFFECT_INT:
        _check_whole_number(value, key, val)
    elif key == "backend":
        if val == "cudaMallocAsync":
            raise ValueError(
                f"{_ENV}={value!r}: backend:cudaMallocAsync exists in PyTorch but is "
                f"not modelled by oomdoctor's allocator simulator (the CUDA driver's "
                f"stream-ordered pool replaces the caching allocator, so its reserved "
                f"memory follows different rules). Drop the option or use "
                f"backend:native to simulate the default caching allocator."
            )
        if val != "native":
            raise ValueError(
                f"{_ENV}={value!r}: unknown allocator backend {val!r}; PyTorch's "
                f"options are native and cudaMallocAsync."
            )


def _check_whole_number(value: str, key: str, val: str) -> None:
    """An integer option: digits only, and within the bounds PyTorch enforces for ``key``."""
    if not val.isdigit():
        raise ValueError(
            f"{_ENV}={value!r}: {key} must be a whole number"
            f"{' of MiB' if key.endswith('_mb') else ''}, got {val!r}."
        )
    num = int(val)
    if key == "max_split_size_mb":
        if num < K_LARGE_BUFFER // MiB:
            raise ValueError(
                f"{_ENV}={value!r}: max_split_size_mb:{num} is too small; "
                f"PyTorch requires max_split_size_mb >= {K_LARGE_BUFFER // MiB} "
                f"(the 20 MiB large-segment size) and refuses to start otherwise. "
                f"Use a value of at least {K_LARGE_BUFFER // MiB}, or drop the "
                f"option (unlimited)."
            )
    elif key == "pinned_num_register_threads" and (num & (num - 1) or num == 0):
        raise ValueError(
            f"{_ENV}={value!r}: pinned_num_register_threads must be a power of "
            f"2, got {num}."
        )
    elif key == "pinned_reserve_segment_size_mb" and num == 0:
        raise ValueError(
            f"{_ENV}={value!r}: pinned_reserve_segment_size_mb must be > 0."
        )
