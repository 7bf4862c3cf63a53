"""Let torchvision's Python models import where its compiled ops cannot load (tests only).

The test machines have the CPU-only torch 2.13.0 wheel, while PyPI's torchvision 0.28.0 (the one
built for torch 2.13) links against CUDA torch. Its C++ extension then fails to load, which
torchvision tolerates, except that ``torchvision/_meta_registrations.py`` registers fake kernels
for ``torchvision::nms`` and ``torchvision::qnms`` unconditionally and so raises "operator
torchvision::nms does not exist" at import - from timm, and from transformers, which imports
torchvision when it is installed. Defining those two schemas (no kernels) before torchvision
loads is enough; the models oomdoctor builds by name are pure Python and never call them.

tests/conftest.py puts this folder on sys.path and PYTHONPATH, so the test process and every
process it starts (CLI subprocesses, spawned ranks) load it. It acts only on the first import of
torchvision, and only when the extension does not load. oomdoctor itself reports such a
torchvision as not loading (oomdoctor.models.huggingface).
"""
import importlib.abc
import importlib.util
import sys

_LIBRARY = []   # a torch.library.Library must stay alive for its definitions to stay


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and spec.submodule_search_locations:
            _define_missing_ops(spec.submodule_search_locations[0])
        return spec


def _define_missing_ops(folder: str) -> None:
    import glob
    import os

    import torch
    try:
        torch.ops.load_library(glob.glob(os.path.join(folder, "_C*.so"))[0])
        return                                   # a torchvision built for this torch
    except (IndexError, OSError):
        pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.append(lib)


if "torchvision" not in sys.modules:
    sys.meta_path.insert(0, _BeforeTorchvision())
