"""timm:NAME and torchvision:NAME: image models by name, built by their own libraries.

Checked against: a real CPU training run of the same library model (written out here as a plain
model file that calls the library directly, measured by tests/reference.py); each library's own
parameter count; a published A100 run of torchvision's vit_b_16 fine-tuned on CIFAR-10
(rasbt/ViT-finetuning-scripts, the VF rows of tests/test_ground_truth.py) given by name instead
of the hand-written rebuild.
"""
from __future__ import annotations

import importlib.util
import textwrap

import pytest
from click.testing import CliRunner

from oomdoctor.cli import EXIT_MODEL, EXIT_OK, cli
from oomdoctor.plans.estimate import Budget, estimate_trace
from oomdoctor.sim.gpus import get_profile
from oomdoctor.models.loader import load_model
from oomdoctor.models.spec import ModelFileError
from oomdoctor.sim.trace import TraceConfig, trace_training
from reference import real_cpu_peak

HAVE = all(importlib.util.find_spec(m) is not None for m in ("timm", "torchvision"))
pytestmark = pytest.mark.skipif(not HAVE, reason="timm / torchvision not installed "
                                                 "(pip install oomdoctor[vision])")

# (source, image size, classes) -> the same step written by hand against the library
CASES = {
    "torchvision:resnet18": (64, 10, "torchvision.models.resnet18(num_classes=10)"),
    "timm:vit_tiny_patch16_224": (64, 10, "timm.create_model('vit_tiny_patch16_224', "
                                          "img_size=64, num_classes=10)"),
}


def reference_file(tmp_path, source: str) -> str:
    size, classes, build = CASES[source]
    f = tmp_path / f"{source.split(':')[1]}_ref.py"
    f.write_text(textwrap.dedent(f"""\
        import torch, torch.nn.functional as F, timm, torchvision

        def build_model():
            return {build}

        def make_batch(batch_size):
            return torch.randn(batch_size, 3, {size}, {size}), torch.randint(0, {classes}, (batch_size,))

        def loss_fn(model, batch):
            images, labels = batch
            return F.cross_entropy(model(images), labels)
        """))
    return str(f)


@pytest.mark.parametrize("source", list(CASES))
def test_peak_matches_a_real_cpu_run_of_the_library_model(tmp_path, source):
    size, classes, _ = CASES[source]
    spec = load_model(source, image_size=size, num_classes=classes)
    # The meta backend: timm computes its drop-path schedule with torch.linspace(...).item()
    # on an explicit CPU device, which the meta device leaves real and FakeTensorMode does not.
    simulated = trace_training(spec, TraceConfig(4, emulate_cuda=False),
                               backend="meta").peak_live_bytes
    # The CPU's convolution backward allocates a scratch weight-gradient buffer per thread
    # inside the kernel (75.6 MB for resnet18 here, 8x its largest conv weight), which CUDA's
    # kernels do not: the real run is read as the trace sees any op, by inputs and outputs.
    real = real_cpu_peak(reference_file(tmp_path, source), 4,
                         opaque=("aten::convolution_backward",))
    assert abs(simulated / real - 1) <= 0.001, (source, simulated, real)


@pytest.mark.parametrize("source, expected", [
    ("torchvision:resnet50", "torchvision.models.resnet50()"),
    ("timm:convnext_tiny", "timm.create_model('convnext_tiny')"),
    ("torchvision:fcn_resnet50", "torchvision.models.segmentation.fcn_resnet50("
                                 "weights_backbone=None)"),
])
def test_parameters_are_the_library_own_count(source, expected):
    import timm  # noqa: F401
    import torch
    import torchvision  # noqa: F401
    with torch.device("meta"):
        own = sum(p.numel() for p in eval(expected).parameters())
    tr = trace_training(load_model(source, image_size=64), TraceConfig(2))
    assert tr.num_parameters == own


def test_image_size_reaches_a_vision_transformer_and_a_cnn():
    vit = load_model("torchvision:vit_b_16", image_size=384)
    assert "384x384" in vit.name and vit.build_model().image_size == 384
    cnn = load_model("timm:resnet18", image_size=96, num_classes=7)
    assert "96x96, 7 classes" in cnn.name
    images, labels = cnn.make_batch(2)
    assert tuple(images.shape) == (2, 3, 96, 96) and int(labels.max()) < 7


def test_defaults_follow_the_model():
    assert "299x299, 1000 classes" in load_model("torchvision:inception_v3").name
    assert "224x224, 21 classes" in load_model("torchvision:fcn_resnet50").name
    seg = load_model("torchvision:lraspp_mobilenet_v3_large", image_size=32)
    _, labels = seg.make_batch(2)
    assert tuple(labels.shape) == (2, 32, 32)      # a class per pixel


def test_inception_and_segmentation_heads_all_train():
    # Inception's aux head and FCN's aux classifier are in the loss, so they get gradients
    for source in ("torchvision:inception_v3", "torchvision:fcn_resnet50"):
        tr = trace_training(load_model(source, image_size=299 if "inception" in source else 64),
                            TraceConfig(2))
        assert tr.gradient_bytes == tr.parameter_bytes, source


def test_vit_b16_by_name_against_the_published_a100_run():
    """VF-7: torchvision vit_b_16, 10-class head, CIFAR-10 at 224, batch 16, fp32, Adam, with
    zero_grad() between the loss and backward(); 3.71 GB max_memory_reserved on an A100
    (tests/test_ground_truth.py has the setup and the source)."""
    spec = load_model("torchvision:vit_b_16", num_classes=10)
    cfg = TraceConfig(16, optimizer="adam", zero_grad="after-forward")
    trace = trace_training(spec, cfg)
    e = estimate_trace(trace, Budget(get_profile("a100-40"), margin=0.0), model=spec.name)
    assert trace.num_parameters == 85_806_346
    dev = e.peak_reserved_bytes / 1e9 / 3.71 - 1
    assert -0.03 <= dev <= 0.03, f"VF-7 by name: {e.peak_reserved_bytes / 1e9:.2f} GB ({dev:+.1%})"


@pytest.mark.parametrize("source, words", [
    ("timm:not_a_model", "timm has no model 'not_a_model'"),
    ("timm:resnet5", "close names: "),
    ("torchvision:fasterrcnn_resnet50_fpn", "a torchvision detection model"),
    ("torchvision:", "name the model, e.g. torchvision:resnet50"),
])
def test_one_line_errors(source, words):
    with pytest.raises(ModelFileError, match=words):
        load_model(source)


def test_options_that_do_not_apply_are_refused():
    with pytest.raises(ModelFileError, match="--image-size and --num-classes apply to timm"):
        load_model("sample_models/tiny_mlp.py", image_size=64)
    with pytest.raises(ModelFileError, match="--task and --seq-len apply to Hugging Face"):
        load_model("timm:resnet18", seq_len=128)


def test_a_missing_library_names_the_extra(monkeypatch):
    import importlib
    real = importlib.import_module

    def no_timm(name, *a, **k):
        if name == "timm":
            raise ModuleNotFoundError("No module named 'timm'", name="timm")   # as Python does
        return real(name, *a, **k)
    monkeypatch.setattr(importlib, "import_module", no_timm)
    with pytest.raises(ModelFileError, match=r"pip install 'oomdoctor\[vision\]'"):
        load_model("timm:resnet18")


def test_cli_estimate_by_name():
    r = CliRunner().invoke(cli, ["estimate", "timm:resnet18", "-b", "4", "--image-size", "64",
                                 "--num-classes", "10", "--gpu", "rtx3090", "--json"])
    assert r.exit_code == EXIT_OK, r.output
    assert '"model": "resnet18 (64x64, 10 classes)"' in r.output
    r = CliRunner().invoke(cli, ["estimate", "timm:no_such_net", "-b", "4"])
    assert r.exit_code == EXIT_MODEL and "timm has no model" in r.output



def test_api_and_check_cases_take_the_vision_options(tmp_path):
    import oomdoctor
    from oomdoctor.plans.check import load_config, measure_case
    by_api = oomdoctor.estimate("timm:resnet18", batch_size=2, image_size=64, num_classes=10)
    cfg_file = tmp_path / "setup.cfg"
    cfg_file.write_text("[oomdoctor:resnet18]\nmodel = timm:resnet18\nbatch_size = 2\n"
                        "image_size = 64\nnum_classes = 10\n")
    cfg = load_config(str(cfg_file))
    assert cfg.cases[0].config()["image_size"] == 64
    measured = measure_case(cfg.cases[0], str(tmp_path))
    assert measured.error is None
    # the same configuration by two routes; and 10 classes at 64 px is not the 1000-class
    # 224 px default
    assert measured.peak_reserved_bytes == by_api.peak_reserved_bytes
    assert oomdoctor.estimate("timm:resnet18", batch_size=2).peak_reserved_bytes \
        > by_api.peak_reserved_bytes


def test_checkpointing_wraps_the_blocks_timm_itself_would(tmp_path):
    """ConvNeXt's repeated classes are its 4 stages and the blocks inside them; timm's own
    ``set_grad_checkpointing()`` checkpoints each block. oomdoctor's --checkpointing picks the
    same blocks, and its trace matches a real CPU run that uses timm's switch."""
    f = tmp_path / "convnext_timm_ckpt.py"
    f.write_text(textwrap.dedent("""\
        import torch, torch.nn.functional as F, timm

        def build_model():
            model = timm.create_model("convnext_atto", num_classes=10)
            model.set_grad_checkpointing(True)
            return model

        def make_batch(batch_size):
            return torch.randn(batch_size, 3, 64, 64), torch.randint(0, 10, (batch_size,))

        def loss_fn(model, batch):
            images, labels = batch
            return F.cross_entropy(model(images), labels)
        """))
    spec = load_model("timm:convnext_atto", image_size=64, num_classes=10)
    tr = trace_training(spec, TraceConfig(8, checkpointing=True, emulate_cuda=False),
                        backend="meta")
    assert len(tr.checkpointed) == 2 + 2 + 6 + 2          # convnext_atto's depths
    assert all(".blocks." in name for name in tr.checkpointed)
    real = real_cpu_peak(str(f), 8, opaque=("aten::convolution_backward",))
    assert abs(tr.peak_live_bytes / real - 1) <= 0.001, (tr.peak_live_bytes, real)
