"""The model-file protocol's types: a loaded model (:class:`ModelSpec`) and its errors.

Every model source (a model file, a Hugging Face id or config, a timm/torchvision name) returns
a ``ModelSpec``; everything downstream takes one. Its errors are one-line messages naming the
file, the function and the fix (the CLI exits 3 on them).
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch


class ModelFileError(Exception):
    """The model file is missing, broken, or does not follow the protocol."""


@dataclass(frozen=True)
class ModelSpec:
    """The protocol's functions, loaded from one file."""

    path: str
    build_model: Callable[[], torch.nn.Module]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None
    make_optimizer: Callable[[Any], torch.optim.Optimizer] | None
    label: str | None = None           # the name to show, when not the file's (Hub ids, configs)
    adapters: Any = None               # LoRA / 4-bit weights (oomdoctor.models.adapters.Adapters)
    origin: tuple | None = None        # load_model's arguments, to rebuild it in a new process
    # The loop keeps the previous step's outputs and loss alive through the next forward
    # (`outputs = model(**batch)` without `del outputs, loss`): KEEP_OUTPUTS = True in a model
    # file, or --keep-outputs.
    keep_outputs: bool = False

    @property
    def name(self) -> str:
        base = self.label or os.path.splitext(os.path.basename(self.path))[0]
        return base + (self.adapters.label if self.adapters is not None else "")



class DataDependentError(ModelFileError):
    """The step asked a question only real data can answer (``.item()``, ``bool(t)``, a
    data-dependent shape). The trace retries with the batch's real values (oomdoctor.sim.values)
    before this reaches the user."""



def first_line(e: BaseException) -> str:
    """The first line of an exception's message, for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


def root_cause(e: BaseException) -> BaseException:
    """The innermost exception of ``e``'s chain (``raise ... from``, or raised while handling)."""
    seen = {id(e)}
    while True:
        nxt = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if nxt is None or id(nxt) in seen:
            return e
        seen.add(id(nxt))
        e = nxt


_TORCHVISION_OPS = "torchvision::"     # in the error of a torchvision whose compiled ops fail


def not_installed(library: str, e: BaseException) -> bool:
    """Whether ``library`` itself is missing (Python names it in the ImportError, or it is not
    found), rather than installed and failing in something it imports."""
    import importlib.util
    return getattr(e, "name", None) == library or importlib.util.find_spec(library) is None


def failed_import(e: BaseException) -> bool:
    """Whether ``e`` is an import that failed: an ImportError, or the RuntimeError of a
    torchvision built for another torch, raised inside whatever imported it."""
    return isinstance(e, ImportError) or _TORCHVISION_OPS in str(root_cause(e))


def import_failure(source: str, what: str, e: BaseException) -> ModelFileError:
    """The one-line error for ``what`` (a library, or a class a library imports on first use)
    failing to import, from the innermost error: transformers' lazy imports say only "Could not
    import module 'LlamaConfig'" and hide it in the chain. The common cause: a torchvision built
    for another torch (PyPI's CUDA wheel next to a CPU-only torch) whose compiled ops do not load,
    so its import raises "operator torchvision::nms does not exist" inside every transformers or
    timm import that touches it."""
    import torch
    root = root_cause(e)
    why = f"{type(root).__name__}: {first_line(root)}"
    if _TORCHVISION_OPS in str(root):
        lead = "" if what == "torchvision" else f"{what} does not load because "
        return ModelFileError(
            f"{source}: {lead}torchvision does not load with this torch "
            f"{torch.__version__} ({why}); install the torchvision release built for this torch "
            "(pytorch.org/get-started; for a CPU-only torch: pip install torchvision "
            "--index-url https://download.pytorch.org/whl/cpu), or uninstall torchvision")
    return ModelFileError(f"{source}: {what} does not load ({why}); install what it names, a "
                          f"release built for this torch {torch.__version__}")


# What moving a fake/meta tensor to CUDA raises: a CPU-only build, or a meta tensor's copy.
_TO_CUDA_TEXT = ("Torch not compiled with CUDA enabled", "Cannot copy out of meta tensor",
                 "Found no NVIDIA driver")


def moves_to_gpu(e: BaseException) -> bool:
    """Whether ``e`` is what ``.cuda()`` / ``.to('cuda')`` raises without a GPU (or on meta)."""
    return any(s in str(e) for s in _TO_CUDA_TEXT)


def user_frame(e: BaseException) -> str | None:
    """``file:line (code)`` of the innermost frame of ``e``'s traceback outside torch,
    installed libraries and oomdoctor: where the user's own code did it."""
    import traceback
    skip = (os.sep + "site-packages" + os.sep, os.sep + "oomdoctor" + os.sep + "models",
            os.sep + "oomdoctor" + os.sep + "sim", "<frozen ")
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not any(s in f.filename for s in skip)]
    if not frames:
        return None
    f = frames[-1]
    where = f"{os.path.basename(f.filename)}:{f.lineno}"
    return f"{where} ({f.line.strip()})" if f.line else where


def library_frame(e: BaseException) -> tuple[str, str] | None:
    """(package, ``file:line (code)``) of the innermost frame of ``e``'s traceback in an
    installed library other than torch, when it is the innermost frame outside torch and
    oomdoctor: the library, not the user's code, did it."""
    import traceback
    torch_dir = os.path.dirname(torch.__file__)
    ours = (os.sep + "oomdoctor" + os.sep, "<frozen ")
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(torch_dir) and not any(s in f.filename for s in ours)]
    marker = os.sep + "site-packages" + os.sep
    if not frames or marker not in frames[-1].filename:
        return None
    f = frames[-1]
    package = f.filename.split(marker, 1)[1].split(os.sep, 1)[0]
    where = f"{os.path.basename(f.filename)}:{f.lineno}"
    return package, (f"{where} ({f.line.strip()})" if f.line else where)


def kept_for(store: dict[int, tuple], spec: ModelSpec) -> dict:
    """The dict of results ``store`` keeps for ``spec`` while it lives: a spec's traces and
    layouts depend on nothing else, so repeated questions about it are answered once. The entry
    goes when the spec is garbage collected (keyed by id, checked through a weak reference)."""
    kept = store.get(id(spec))
    if kept is None or kept[0]() is not spec:
        kept = (weakref.ref(spec, lambda _, i=id(spec): store.pop(i, None)), {})
        store[id(spec)] = kept
    return kept[1]

