"""What CUDA does differently to optimizers, applied to a trace on fake CPU or meta tensors.

- :func:`cuda_optimizer_defaults` switches optimizers to the ``foreach`` implementation that
  ``torch/optim/optimizer.py::_default_to_fused_or_foreach`` picks for CUDA tensors.
- :func:`fused_optimizers_on_meta` lets ``fused=True`` optimizers run their fused ATen kernels
  (``_fused_adam(w)_``, ``_fused_sgd_``) on the meta device, where torch's device check refuses.
- :func:`paged_optimizers_on_meta` makes bitsandbytes' paged state on the meta device.
- :class:`GradScalerEmulation` does what ``torch.amp.GradScaler`` does to memory without its
  ``found_inf.item()`` sync, which a fake tensor cannot answer.
"""
from __future__ import annotations

import contextlib

import torch


def cuda_optimizer_defaults(optimizer: torch.optim.Optimizer) -> list[str]:
    """Use the implementation CUDA would: ``foreach`` when the user left it unset."""
    notes = []
    for group in optimizer.param_groups:
        if ("foreach" in group and group["foreach"] is None and not group.get("fused")
                and not group.get("differentiable")):
            group["foreach"] = True
            # what its step() made is added once the trace has stepped (oomdoctor.sim.trace)
            notes.append(f"{type(optimizer).__name__}: foreach implementation, the CUDA default")
    return notes


@contextlib.contextmanager
def fused_optimizers_on_meta():
    """Let ``fused=True`` optimizers step on the meta device, as they would on CUDA.

    ``torch/optim/optimizer.py::_device_dtype_check_for_fused`` accepts only the devices in
    ``torch.utils._foreach_utils._get_fused_kernels_supported_devices()`` (cuda, cpu, ...), so
    a meta trace of ``AdamW(fused=True)`` raised before stepping. The fused kernels themselves
    have meta implementations: they update params, ``exp_avg`` and ``exp_avg_sq`` in place and
    allocate nothing (``aten/src/ATen/native/cuda/fused_adamw_impl.cu``), so the only memory
    is the state ``_init_group`` creates - what CUDA allocates too. While active, "meta" counts
    as a supported device wherever CUDA does (not for Adagrad, whose fused kernel is CPU-only:
    it passes ``cuda_unsupported=True`` and torch removes "cuda" - then "meta" goes too)."""
    import torch.optim.optimizer as optim_mod
    real = optim_mod._get_fused_kernels_supported_devices

    class _Devices(list):
        def remove(self, item):            # cuda_unsupported: meta stands for cuda here
            super().remove(item)
            if item == "cuda" and "meta" in self:
                super().remove("meta")

    optim_mod._get_fused_kernels_supported_devices = lambda: _Devices(real() + ["meta"])
    try:
        yield
    finally:
        optim_mod._get_fused_kernels_supported_devices = real


@contextlib.contextmanager
def paged_optimizers_on_meta(optimizer: torch.optim.Optimizer):
    """Let bitsandbytes' paged optimizers (``PagedAdamW8bit``, ``PagedAdamW32bit``,
    ``PagedLion8bit``, ...) make their state on the meta device.

    Their state buffers of 1e5 elements or more come from ``bitsandbytes.functional.get_paged``:
    ``cudaMallocManaged`` unified memory, outside PyTorch's caching allocator, which the CUDA
    driver migrates to host RAM when the GPU runs short (``bitsandbytes/optim/optimizer.py``
    ``get_state_buffer``). Here they are meta tensors marked ``is_paged`` (the trace keeps them
    out of the allocator's bytes, see stepping.host_state); filling and prefetching them, which
    call into the CUDA library, do nothing to memory and are skipped."""
    import sys
    F = sys.modules.get("bitsandbytes.functional")
    if F is None or not getattr(optimizer, "is_paged", False):
        yield
        return

    def get_paged(*shape, dtype=torch.float32, device=None):
        out = torch.zeros(shape, dtype=dtype, device="meta")
        out.is_paged = True
        return out

    saved = {name: getattr(F, name) for name in ("get_paged", "fill", "prefetch_tensor")}
    F.get_paged = get_paged
    F.fill = lambda A, value, device=None, prefetch=True: None
    F.prefetch_tensor = lambda A, to_cpu=False: None
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(F, name, fn)


class GradScalerEmulation:
    """``torch.amp.GradScaler`` for fp16 AMP, memory-wise: a scale tensor, the loss scaled by
    it, grads unscaled in place with a found-inf flag (``_unscale_grads_``). The real scaler
    calls ``found_inf.item()`` to decide whether to step, which fake tensors cannot answer; we
    always step (the step that allocates optimizer state is the one that matters)."""

    def setup(self) -> None:
        self.scale_t = torch.full((), 65536.0)
        self.growth_tracker = torch.zeros((), dtype=torch.int32)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_t

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        inv_scale = self.scale_t.double().reciprocal().float()
        found_inf = torch.full((), 0.0)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
