"""The names of what oomdoctor can simulate, importable without torch (the CLI builds its options
from them before any command decides whether it needs torch)."""

PRECISIONS = ("fp32", "fp16", "bf16", "bf16-pure")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "rmsprop", "adagrad")
MAX_BATCH = 1 << 16   # the probe stops searching here; a model this light fits "at least" this
