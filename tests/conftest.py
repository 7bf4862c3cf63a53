"""pytest setup shared by every test file."""
import os
import sys

# tests/_site/sitecustomize.py: torchvision's models importable next to a CPU-only torch (see
# its docstring); on sys.path for this process, on PYTHONPATH for the processes it starts.
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH"))
                                           if p)
sys.path.insert(0, _SITE)
import sitecustomize  # noqa: E402,F401  (the venv has none of its own)

import pytest  # noqa: E402


@pytest.fixture
def unrolled(monkeypatch):
    """Records whether each deep trace was unrolled (True) or traced in full (False): the
    outcome of each oomdoctor.sim.repeat.Stack.full call (test_repeat, test_constructs)."""
    from oomdoctor.sim import repeat
    seen: list[bool] = []
    full = repeat.Stack.full

    def spy(self, traces):
        try:
            out = full(self, traces)
        except Exception:
            seen.append(False)
            raise
        seen.append(True)
        return out
    monkeypatch.setattr(repeat.Stack, "full", spy)
    return seen


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """No test may leave a default process group in the pytest process: the smoke tests' rank
    processes are forked from it and inherit it ("trying to initialize the default process
    group twice"). Names the test that leaked one."""
    yield
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left a default torch.distributed process group initialized")


@pytest.fixture
def deepspeed_importable(monkeypatch):
    """``import deepspeed`` works: the real one where installed, else tests/stand_ins/' package
    (the import alone: a script's run replaces deepspeed.initialize either way)."""
    import importlib.util
    if importlib.util.find_spec("deepspeed") is None:
        monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "stand_ins"))
        yield
        sys.modules.pop("deepspeed", None)
    else:
        yield
