"""oomdoctor: predict, explain and gate PyTorch GPU memory, on machines with or without a GPU.

    import oomdoctor
    oomdoctor.estimate("sample_models/gpt2_small.py", batch_size=8, precision="bf16").fits
    oomdoctor.probe("sample_models/tiny_mlp.py", gpu="rtx3090")

(see oomdoctor/api.py). Importing the package loads nothing heavy: torch comes with the first
call.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # oomdoctor.estimate / oomdoctor.probe: the Python API's functions (oomdoctor/api.py),
    # imported on first use so that `import oomdoctor` stays free of torch.
    if name in ("estimate", "probe"):
        from oomdoctor import api
        return getattr(api, name)
    raise AttributeError(f"module 'oomdoctor' has no attribute {name!r}")
