"""Real runs: what happens on real hardware, measured against the plans.

Owns the measured probe on a GPU (``measure``), short real training runs of a plan (``smoke``;
``smoke_result``, its result judged against the prediction; ``smoke_nodes`` for a multi-node
plan's ranks; ``ranks``, gathering what each rank reports), a user's training script's real
steps (``smoke_script``, in a child process ``script_child`` that counts its steps with
``script_steps`` and, without CUDA, runs its CUDA calls on the CPU with ``cpu_cuda``;
``smoke_script_result``, the verdict), and the driver's view of the GPUs (``nvml``, the one NVML choke point; ``watch``, sampling them while
a training command runs).

Imports: ``oomdoctor.plans``, ``oomdoctor.sim``, ``oomdoctor.models`` and
``oomdoctor.configs``; only the CLI and the API import this stage. ``nvml`` and ``watch`` load no
torch at import, so ``oomdoctor gpus`` starts without it.
"""
