"""Traceback frames (Python, IPython, Jupyter, rich) and the phase of a training step they show."""
from __future__ import annotations

import re

from .results import Phase

_TB_HEADER = "Traceback (most recent call last)"
_FRAME_RES = (
    re.compile(r'^File "(?P<file>[^"]*)", line \d+, in (?P<func>\S+)'),
    re.compile(r"^File (?P<file>\S+?):\d+, in (?P<func>[\w.<>]+)"),          # IPython 8
    re.compile(r"^(?P<file>Cell In\s?\[\d*\]), line \d+(?:, in (?P<func>[\w.<>]+))?"),  # Jupyter cell
    re.compile(r"^(?P<file>\S+\.py):\d+ in (?P<func>[\w<>]+)"),                # rich tracebacks
    re.compile(r"^(?P<file>\S+\.py) in (?P<func>[\w<>]+)\("),                  # IPython 7
)
_CODE_MARKER = re.compile(r"^(?:-*>|\u2771)\s*\d+\s+(.*)")   # IPython "---->", rich "\u2771"
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Warning)\b")


class _Frame:
    __slots__ = ("line", "tb", "func", "file", "code")

    def __init__(self, line: int, tb: int, func: str, file: str) -> None:
        self.line, self.tb, self.func, self.file, self.code = line, tb, func, file, ""


_P_OPTIM_FILE = re.compile(r"[/\\]optim[/\\]|adamw?\.py|_functional\.py|bitsandbytes[/\\]optim")
_P_OPTIM_FUNC = re.compile(r"^(?:step|_multi_tensor_\w+|_single_tensor_\w+|_fused_\w+|adamw?|_init_group"
                           r"|_update_step)$")
_P_OPTIM_CODE = re.compile(r"\b(?:optimizer|optim|opt|scaler)\.step\(|\.step\(\)")
_P_BACKWARD_FUNC = re.compile(r"^(?:backward|_engine_run_backward|run_backward|grad)$")
_P_BACKWARD_FILE = re.compile(r"_tensor\.py|autograd[/\\]|graph\.py")
_P_BACKWARD_CODE = re.compile(r"\.backward\(|autograd\.grad\(")
_P_DATA_FILE = re.compile(r"torch[/\\]utils[/\\]data")
_P_DATA_FUNC = re.compile(r"^(?:__getitem__|__getitems__|collate\w*|default_collate|_next_data|pin_memory\w*|fetch)$")
_P_LOAD_FUNC = re.compile(r"^(?:_apply|cuda|load_state_dict|_load_from_state_dict|from_pretrained|load_checkpoint"
                          r"|_load_state_dict_into\w*|dispatch_model|load_model|_load\w*|set_module_tensor_to_device)$")
_P_LOAD_CODE = re.compile(r"\b(?:model|net|module)\s*(?:=\s*\w+\s*)?\.(?:to|cuda)\(|from_pretrained\(|torch\.load\("
                          r"|load_state_dict\(")
_P_FORWARD = re.compile(r"^(?:forward|_call_impl|_wrapped_call_impl|__call__)$")
_P_EVAL = re.compile(r"(?:^|_)(?:eval\w*|evaluat\w*|valid\w*|validation\w*|test_step|predict\w*|prediction_step"
                     r"|inference|infer|generate|sample|sampling)$", re.I)
_P_NOGRAD = re.compile(r"no_grad|inference_mode|decorate_context|_contextlib|grad_mode")
# Library functions known to disable autograd themselves (HF Trainer.prediction_step wraps the
# forward in torch.no_grad(); generate() is decorated with it).
_P_NOGRAD_FUNCS = frozenset({"prediction_step", "evaluation_loop", "generate", "decorate_context"})


def _phase_of(frames: list[_Frame]) -> tuple[Phase | None, bool]:
    """Phase from the innermost recognisable frame; second value: autograd visibly disabled."""
    phase: Phase | None = None
    for f in reversed(frames):
        func, file, code = f.func, f.file, f.code
        if _P_OPTIM_FILE.search(file) and (_P_OPTIM_FUNC.match(func) or func == "step") or _P_OPTIM_CODE.search(code):
            phase = Phase.OPTIMIZER_STEP
        elif (_P_BACKWARD_FUNC.match(func) and _P_BACKWARD_FILE.search(file)) or _P_BACKWARD_CODE.search(code):
            phase = Phase.BACKWARD
        elif _P_DATA_FILE.search(file) or (_P_DATA_FUNC.match(func) and not re.search(r"[/\\]os\.py$", file)):
            phase = Phase.DATA_LOADING
        elif _P_LOAD_FUNC.match(func) or _P_LOAD_CODE.search(code):
            phase = Phase.MODEL_LOADING
        if phase is not None:
            break
    if phase is None and any(_P_FORWARD.match(f.func) or "functional.py" in f.file for f in frames):
        phase = Phase.FORWARD
    in_eval = any(_P_EVAL.search(f.func) for f in frames)
    no_grad = any(_P_NOGRAD.search(f.code) or _P_NOGRAD.search(f.file) or f.func in _P_NOGRAD_FUNCS for f in frames)
    if in_eval and phase in (None, Phase.FORWARD):
        phase = Phase.EVALUATION
    return phase, no_grad
