"""Scratch memory of CUDA reductions: the global-reduction buffer Reduce.cuh takes from the allocator.

    oomdoctor estimate sample_models/tiny_mlp.py -b 4096 --gpu h200   # 16 MiB at a bias gradient

A sum or mean on CUDA runs ``gpu_reduce_kernel`` (aten/src/ATen/native/cuda/Reduce.cuh). When
``setReduceConfig`` splits each output's inputs across thread blocks (``ctas_per_output > 1``:
many inputs per output, few outputs), the blocks stage partial results in global memory:
``gpu_reduce_kernel`` allocates ``config.global_memory_size()`` bytes and
``config.semaphore_size()`` bytes through the CUDA caching allocator before the launch, and the
two ``at::DataPtr`` locals free them (semaphores first) when it returns. No ATen op outputs
them, so the trace cannot see them. A linear layer's bias gradient (``grad.sum(0)`` over the
batch) is the common case: on an H200, summing a (4096, 512) gradient over its rows stages
4 B x 512 outputs x 64 blocks x 32 lanes x 4-wide vectors = 16 MiB - measured on the GPU as
16 MiB more allocated than the trace at that point (tiny_mlp at batch 4096, fp32, AMP and
pure bf16 alike: the buffer holds float accumulators for every input dtype).

The trace records each reduction's geometry (:func:`reduce_shape`, as TensorIterator orders and
coalesces the input's dimensions); :func:`scratch_bytes` sizes the buffer for a card, whose
multiprocessor count and threads per multiprocessor bound the grid.

Known limitations: only ``sum`` and ``mean`` of floating tensors are modelled (other reductions -
norms, var, max - run the same code with their own accumulator types); inputs over 2**31
elements, which TensorIterator splits into 32-bit-indexable pieces, are sized as one; ROCm's
build caps the blocks per output differently and is not modelled (no scratch on AMD cards).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

# The ATen ops whose CUDA kernels are gpu_reduce_kernel (ReduceSumProdKernel.cu sum_functor,
# ReduceMomentKernel.cu mean_kernel_cuda), and their accumulator (arg_t) size: float for
# 16-bit and 32-bit inputs (at::acc_type on CUDA), double for double.
REDUCE_OPS = frozenset({"sum.default", "sum.dim_IntList", "mean.default", "mean.dim"})
_ACC_BYTES = {torch.float16: 4, torch.bfloat16: 4, torch.float32: 4, torch.float64: 8}
_MAX_THREADS = 512          # mnt_wrapper<T>::MAX_NUM_THREADS (256 only for complex double)
_WARP = 32                  # at::cuda::warp_size() on NVIDIA cards
_INPUT_VEC = 4              # ReduceConfig::input_vec_size


@dataclass(frozen=True)
class ReduceShape:
    """What setReduceConfig reads from a reduction's TensorIterator, independent of the card."""

    acc_bytes: int           # sizeof(arg_t): config.element_size_bytes
    num_outputs: int
    inputs_per_output: int
    on_fastest: bool         # reduction_on_fastest_striding_dimension
    output_vec: int          # config.output_vec_size ("vectorize along output")
    vectorize_input: bool    # config.vectorize_input ("vectorize along input")


def reduce_shape(name: str, args: tuple, kwargs: dict) -> ReduceShape | None:
    """The geometry of a ``sum``/``mean`` call (``name`` as recorded, e.g. "sum.dim_IntList"),
    or None for any other op or an input the model does not cover."""
    if name not in REDUCE_OPS or not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    acc = _ACC_BYTES.get(x.dtype)
    if acc is None or x.numel() <= 1:
        return None
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    ndim = x.dim()
    reduced = (set(range(ndim)) if not dims else
               {d % ndim for d in ([dims] if isinstance(dims, int) else dims)})
    # TensorIterator: size-1 dimensions drop out; reduced dimensions go first
    # (reorder_dimensions: the output's zero strides), each group by the input's strides
    # (fastest first); then coalesce_dimensions merges neighbours that are contiguous.
    order = sorted((d for d in range(ndim) if x.shape[d] != 1),
                   key=lambda d: (d not in reduced, x.stride(d), -d))
    dims_ = []                                        # [reduced, size, stride]
    for d in order:
        last = dims_[-1] if dims_ else None
        if last and last[0] == (d in reduced) and last[1] * last[2] == x.stride(d):
            last[1] *= x.shape[d]
        else:
            dims_.append([d in reduced, x.shape[d], x.stride(d)])
    n_red = sum(1 for r, _, _ in dims_ if r)
    num_outputs = prod(s for r, s, _ in dims_ if not r)
    on_fastest = n_red == len(dims_) or dims_[0][2] < dims_[n_red][2]
    fastest = dims_[0][2] if on_fastest else dims_[n_red][2]
    output_vec, vec_in = 1, False
    if fastest == 1:
        if on_fastest:
            # Case 1 of setReduceConfig (vt0 = 4 >= input_vec_size for sum and mean)
            vec_in = n_red == 1 and x.numel() // num_outputs > 128
        else:
            # get_output_vec_size: 4, halved until it divides the input's address (in elements,
            # the allocator's blocks being 512-byte aligned), the outputs' dimension and every
            # other stride
            vals = [x.storage_offset(), dims_[n_red][1]]
            vals += [st for i, (_, _, st) in enumerate(dims_) if i != n_red]
            output_vec = 4
            while any(v % output_vec for v in vals):
                output_vec //= 2
    return ReduceShape(acc, num_outputs, x.numel() // num_outputs, on_fastest, output_vec, vec_in)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _last_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def scratch_bytes(r: ReduceShape, multiprocessors: int, threads_per_mp: int
                  ) -> tuple[int, int] | None:
    """(global buffer, semaphores) bytes gpu_reduce_kernel allocates for ``r`` on a card with
    that many multiprocessors, or None when it reduces without global memory. The steps of
    ReduceConfig/setReduceConfig in aten/src/ATen/native/cuda/Reduce.cuh, in order."""
    dim0, dim1 = ((r.inputs_per_output, r.num_outputs) if r.on_fastest
                  else (r.num_outputs, r.inputs_per_output))
    dim0 //= _INPUT_VEC if r.vectorize_input else r.output_vec
    # set_block_dimension
    max_threads = _MAX_THREADS // r.output_vec
    d0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    d1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(d0, _WARP)
    height = min(d1, max_threads // width)
    width = min(d0, max_threads // height)
    step_in, step_out = (width, 1) if r.on_fastest else (1, width)   # input_mult[0] / output_mult[0]
    across_warps = _div_up(r.inputs_per_output, step_in) >= min(height * 16, 256)
    if across_warps:
        step_in *= height                                            # input_mult[1]
    else:
        step_out *= height
    per_thread = _div_up(r.inputs_per_output, step_in)
    target = multiprocessors * (threads_per_mp // (width * height))
    grid = _div_up(r.num_outputs // r.output_vec, step_out)
    if not (across_warps and per_thread >= 256 and grid <= target):
        return None
    ctas = max(min(_div_up(target, grid), _div_up(per_thread, 16)), _div_up(per_thread, 256))
    if ctas <= 1:
        return None
    size = r.acc_bytes * r.num_outputs * ctas                        # global_memory_size()
    if not r.on_fastest:                                             # !should_block_x_reduce()
        size *= width * r.output_vec
    return size, 4 * grid                                            # semaphore_size()
