"""Limits that bound memory and work whatever the size of the log (see "Streaming" in __init__.py)."""

_READ_CHUNK = 1 << 16        # bytes read from a file at a time
_MAX_LINE = 1 << 16          # longer physical lines are cut into pieces of this many characters
_MAX_LOGICAL = 1 << 13       # the parser looks at most this many characters of a piece at once
_BATCH_LINES = 256           # lines pre-filtered together
_BATCH_CHARS = 1 << 17
_SUB_BATCH = 16              # a batch with a hit is re-checked in sub-batches of this many lines
_REGION_TAIL = 8             # a region closes after this many lines without a keyword ...
_REGION_TAIL_CHARS = 800     # ... that also hold this many characters (narrow hard wraps),
_REGION_GLOBAL_QUIET = 32    # or once this many lines of the whole log passed without its keyword:
                             # a rank that prints rarely must not keep every other rank's lines
                             # on the slow path
_REGION_MAX_LINES = 400      # ... or when it grows this long (then it is split, with overlap)
_REGION_MAX_CHARS = 1 << 16
_REGION_CARRY = 12           # lines carried into the next region when one is split
_LOOKBACK = 2                # lines before a hit added to its region (a wrapped keyword)
_WRAP_LOOKBACK = 16          # ... and up to this many while they are one hard-wrapped line
_MAX_KEYS = 64               # rank streams tracked at once (least recently used is dropped)
_MAX_FINDINGS = 200          # distinct findings kept; more are counted in dropped_findings
_MAX_RANKS = 4096
_ANCHOR_SPAN = 4000          # squashed characters read after the start of a message
_PRE_SPAN = 160              # squashed characters read before it (exception class, [Rank N])
_TB_REACH = 1500             # a traceback header this many lines back can explain an error
_FRAMES_KEEP = 256
_FRAMES_PER_FINDING = 64
_EXCERPT = 200
