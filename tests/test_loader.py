"""Bad model files: a one-line error naming the file, the function and the fix; exit code 3."""
import os

import pytest
from click.testing import CliRunner

from oomdoctor.cli import EXIT_MODEL, cli
from oomdoctor.models.loader import load_model_file
from oomdoctor.models.spec import ModelFileError
from oomdoctor.sim.trace import TraceConfig, trace_training

HERE = os.path.dirname(__file__)
BAD = os.path.join(HERE, "bad_models")

CASES = [
    ("does_not_exist.py", r"no such file"),
    ("syntax_error.py", r"syntax_error\.py:2: syntax error"),
    ("import_error.py", r"importing the file raised ModuleNotFoundError"),
    ("no_build_model.py", r"no `build_model` function; define `def build_model"),
    ("not_a_module.py", r"build_model\(\) returned str, expected a torch\.nn\.Module"),
    ("bad_batch.py", r"make_batch\(2\) returned a list of int"),
    ("item_call.py", r"model\.forward uses a value computed from tensor data"),
    ("nonzero_call.py", r"loss_fn uses a value computed from tensor data"),
    ("vector_loss.py", r"has shape \(2, 2\), expected a scalar loss"),
    ("frozen.py", r"no trainable parameters"),
    ("cuda_call.py", r"build_model moves tensors to the GPU at cuda_call\.py:8 .*"
                     r"remove \.cuda\(\)"),
    # inside the step: named where it is, and the fix for code in forward (issue #24)
    ("cuda_in_forward.py", r"loss_fn moves tensors to the GPU at cuda_in_forward\.py:11 "
                           r"\(scale = torch\.ones\(8\)\.cuda\(\)\).*device=x\.device"),
    ("cuda_at_import.py", r"importing the file moves tensors to the GPU at cuda_at_import\.py:4 "
                          r".*needs a GPU this machine does not have.*--device cuda"),
    ("wrong_call.py", r"without loss_fn, oomdoctor calls model\(\*batch\) with 2 tensors .*"
                      r"missing a required argument: 'weight'.*define loss_fn\(model, batch\)"),
]


@pytest.mark.parametrize("name,message", CASES)
def test_library_error(name, message):
    path = os.path.join(BAD, name)
    with pytest.raises(ModelFileError, match=message):
        trace_training(load_model_file(path), TraceConfig(2))


@pytest.mark.parametrize("name,message", CASES)
def test_cli_one_line_and_exit_code(name, message):
    path = os.path.join(BAD, name)
    res = CliRunner().invoke(cli, ["estimate", path, "-b", "2", "--gpu", "rtx3090"])
    assert res.exit_code == EXIT_MODEL, res.output
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0]
    assert "Traceback" not in res.stderr


def test_debug_shows_traceback():
    res = CliRunner().invoke(cli, ["estimate", os.path.join(BAD, "item_call.py"), "-b", "2",
                                   "--gpu", "rtx3090", "--debug"])
    assert res.exit_code == EXIT_MODEL
    assert "Traceback" in res.stderr


def test_directory_and_non_python(tmp_path):
    with pytest.raises(ModelFileError, match="not a Python file"):
        load_model_file(str(tmp_path))
    (tmp_path / "model.txt").write_text("x")
    with pytest.raises(ModelFileError, match="not a Python file"):
        load_model_file(str(tmp_path / "model.txt"))


def test_make_optimizer_must_return_optimizer(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch\n"
                 "def build_model(): return torch.nn.Linear(4, 1)\n"
                 "def make_batch(b): return torch.randn(b, 4)\n"
                 "def loss_fn(m, x): return m(x).sum()\n"
                 "def make_optimizer(params): return 'sgd'\n")
    with pytest.raises(ModelFileError, match="make_optimizer\\(params\\) returned a str"):
        trace_training(load_model_file(str(f)), TraceConfig(2))


def test_two_files_with_the_same_name_do_not_collide(tmp_path):
    for sub, width in (("a", 3), ("b", 5)):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "model.py").write_text(
            "import torch\n"
            f"def build_model(): return torch.nn.Linear({width}, 1)\n"
            f"def make_batch(b): return torch.randn(b, {width})\n"
            "def loss_fn(m, x): return m(x).sum()\n")
    a = trace_training(load_model_file(str(tmp_path / "a" / "model.py")), TraceConfig(1))
    b = trace_training(load_model_file(str(tmp_path / "b" / "model.py")), TraceConfig(1))
    assert (a.num_parameters, b.num_parameters) == (4, 6)


def test_the_protocol_the_errors_point_to_is_in_help():
    for command in ("estimate", "probe", "parallel", "split", "recommend", "smoke"):
        res = CliRunner().invoke(cli, [command, "--help"])
        assert res.exit_code == 0
        for needle in ("build_model() -> nn.Module", "make_batch(batch_size)",
                       "loss_fn(model, batch)", "make_optimizer(params)", "config.json"):
            assert needle in res.stdout, (command, needle)


def test_build_model_may_move_its_model_to_the_gpu(tmp_path):
    """``model.cuda()`` / ``.to("cuda", dtype)`` in build_model, as a file written for a GPU
    machine does: oomdoctor places the model itself, so the move is dropped and the dtype kept
    - the same trace as the file without it."""
    from oomdoctor.models.loader import load_model_file
    from oomdoctor.sim.trace import TraceConfig, trace_training
    body = ("import torch\n"
            "def build_model():\n    return torch.nn.Sequential(torch.nn.Linear(8, 64), "
            "torch.nn.ReLU(), torch.nn.Linear(64, 1)){move}\n"
            "def make_batch(b):\n    return torch.randn(b, 8)\n"
            "def loss_fn(m, x):\n    return m(x.to(next(m.parameters()).dtype)).float().sum()\n")
    traces = {}
    for name, move in [("plain", ".to(torch.bfloat16)"), ("cuda", ".cuda().bfloat16()"),
                       ("to", ".to('cuda', torch.bfloat16)"),
                       ("device", ".to(device=torch.device('cuda'), dtype=torch.bfloat16)")]:
        path = tmp_path / f"{name}.py"
        path.write_text(body.format(move=move))
        traces[name] = trace_training(load_model_file(str(path)), TraceConfig(4))
    first = traces["plain"]
    assert first.weight_dtypes == (("bfloat16",), ())
    for t in traces.values():
        assert (t.events, t.parameter_bytes) == (first.events, first.parameter_bytes)


# A library that is installed but does not load: the innermost error and its fix, exit 3. The
# common case is a torchvision built for another torch (PyPI's CUDA wheel next to a CPU-only
# torch): its import raises "operator torchvision::nms does not exist", which transformers'
# lazy import hides behind "Could not import module 'LlamaConfig'". The tests raise that chain
# themselves (their own torchvision loads, tests/_site/sitecustomize.py).
TORCHVISION_BROKEN = "operator torchvision::nms does not exist"


def _lazy_import_error():
    try:
        raise RuntimeError(TORCHVISION_BROKEN)
    except RuntimeError as e:
        raise ModuleNotFoundError("Could not import module 'LlamaConfig'. Are this object's "
                                  "requirements defined correctly?") from e


def _one_line(res) -> str:
    assert res.exit_code == EXIT_MODEL, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_hugging_face_config_whose_import_fails_names_torchvision(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, '
        '"intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, '
        '"vocab_size": 128}')
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: _lazy_import_error())
    line = _one_line(CliRunner().invoke(cli, ["estimate", str(tmp_path), "-b", "1", "--gpu",
                                              "rtx3090"]))
    assert f"transformers {transformers.__version__} does not load because torchvision does " \
           "not load with this torch" in line
    assert TORCHVISION_BROKEN in line and "--index-url https://download.pytorch.org/whl/cpu" in line
    assert "Could not import module" not in line and "limit of oomdoctor" not in line


def test_vision_library_that_fails_inside_its_import(tmp_path, monkeypatch):
    from oomdoctor.models.vision import _import
    (tmp_path / "brokenvis_dep.py").write_text("import nosuchdep_xyz\n")
    (tmp_path / "brokenvis_tv.py").write_text(f"raise RuntimeError({TORCHVISION_BROKEN!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelFileError, match=r"timm:x: brokenvis_dep does not load "
                                             r"\(ModuleNotFoundError: No module named "
                                             r"'nosuchdep_xyz'\); install what it names"):
        _import("brokenvis_dep", "timm:x")
    with pytest.raises(ModelFileError, match=r"brokenvis_tv does not load because torchvision "
                                             r"does not load with this torch"):
        _import("brokenvis_tv", "timm:x")
    with pytest.raises(ModelFileError, match=r"needs notinstalled_xyz: pip install"):
        _import("notinstalled_xyz", "timm:x")


def test_training_script_whose_import_fails(tmp_path):
    lazy = tmp_path / "lazy.py"
    lazy.write_text("try:\n"
                    f"    raise RuntimeError({TORCHVISION_BROKEN!r})\n"
                    "except RuntimeError as e:\n"
                    "    raise ModuleNotFoundError(\"Could not import module 'LlamaConfig'\") "
                    "from e\n")
    line = _one_line(CliRunner().invoke(cli, ["estimate", "--gpu", "rtx3090", "--", "python",
                                              str(lazy)]))
    assert line.startswith("error: lazy.py:4 ") and "does not load because torchvision" in line
    assert "fake GPU could not follow" not in line
    missing = tmp_path / "missing.py"
    missing.write_text("import torch\nimport nosuchpkg_xyz\n")
    line = _one_line(CliRunner().invoke(cli, ["estimate", "--gpu", "rtx3090", "--", "python",
                                              str(missing)]))
    assert "missing.py:2 (import nosuchpkg_xyz): nosuchpkg_xyz (imported where oomdoctor " \
           "runs) does not load (ModuleNotFoundError: No module named 'nosuchpkg_xyz')" in line
