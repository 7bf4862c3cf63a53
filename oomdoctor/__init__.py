"""oomdoctor: predict, explain and gate PyTorch GPU memory, on machines with or without a GPU."""

__version__ = "0.1.0"
