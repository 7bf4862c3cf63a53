"""The plans: answers to the user's questions, computed with the simulator.

Owns one configuration on one card (``estimate``), the largest batch per configuration
(``probe``) and the longest context (``context``), the numbers for an OOM in a log (``oom``),
the CI gate (``check``), multi-GPU strategies (``parallel/``: DDP, DataParallel, ZeRO, FSDP,
the two-GPU split) and the ranked plan with its launch line (``recommend/``). Results are
frozen dataclasses with bytes as ints; text rendering sits beside the computation, never inside
it, and nothing here prints.

Imports: ``oomdoctor.sim``, ``oomdoctor.models`` and ``oomdoctor.configs``. Never the real runs
(``oomdoctor.runs``) or the CLI.
"""
