"""The simulator: one training step on fake tensors, as CUDA would run it, through the allocator.

Owns the trace of real training steps on fake/meta tensors (``trace``, with ``recorder`` for the
dispatch mode that records each storage, ``stepping`` for the optimizer steps, ``values`` for
data-dependent questions, ``eager`` for compiled code, ``recompute`` for checkpointed blocks),
what CUDA does differently from the CPU (``emulate``, ``rnn`` for cuDNN's RNNs, ``fusion`` for
compiled optimizer steps, ``workspaces`` for cuBLAS), the replay through PyTorch's caching
allocator (``allocator/``), and the cards it simulates (``gpus``, ``rocm`` for AMD's ROCm build).

Imports: ``oomdoctor.models`` (a spec, and the configured model it trains) and
``oomdoctor.configs``. Never the plans or the real runs. ``gpus``, ``rocm`` and ``allocator``
import no torch, so the CLI can read card profiles and sizes before it decides to load torch.
"""
