"""``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` as CUDA runs them: one fused cuDNN call, not a loop.

On the CPU, ``torch.lstm`` runs a per-timestep loop of small ops (slow to trace: a 3-layer LSTM
over 400 steps made ~27 s per estimate) that saves per-step tensors CUDA never allocates. On
CUDA with cuDNN, ``_cudnn_impl`` (aten/src/ATen/native/cudnn/RNN.cpp) makes one ``_cudnn_rnn``
call. What that call and its backward allocate, read from RNN.cpp:

forward (``_cudnn_rnn``, training):
- ``x = input.contiguous()``: a (T, B, I) copy when ``batch_first`` (the input is transposed to
  sequence-major first), freed on return;
- ``output`` (T, B, D*Hout), ``hy`` (L*D, B, Hout), ``cy`` (L*D, B, H) for LSTM - exact shapes
  from ``_output_size`` / ``_hidden_size`` / ``_cell_size`` (Hout = proj_size or H);
- ``workspace``: bytes from cudnnGetRNNTempSpaceSizes, freed on return (modelled:
  :func:`workspace_bytes`);
- ``reserve``: bytes from the same query, returned and saved for backward;
- the flat weight buffer is returned as is (parameters already flattened, see below).

backward (``_cudnn_rnn_backward`` = backward_input then backward_weight):
- ``x`` and ``dy = grad_output.contiguous()`` copies when ``batch_first``;
- ``dx`` (like input), ``dhx``, ``dcx``; a workspace (the same query, with the
  algorithm get_algo picks for backward) during backward data;
- ``dw = zeros(weight_buf)`` and a workspace during backward weights; the weight gradients are
  views into ``dw`` (``get_parameters`` on dw + ``_viewParams``) when the layouts' strides agree,
  i.e. with biases; without biases they are copied out to fresh tensors and ``dw`` is dropped.

Parameters on CUDA: ``RNNBase.flatten_parameters`` (called by ``.cuda()`` / ``.to()``) copies the
weights into one buffer of cudnnGetRNNWeightSpaceSize bytes and re-points every parameter into
it. cuDNN's layout always holds both biases (RNN.cpp ``try_get_weight_buf`` asserts
``num_ptrs == num_parameters * (has_biases ? 1 : 2)``), so the buffer equals the parameters'
bytes with ``bias=True`` and is larger by the bias space with ``bias=False``.

The reserve and workspace sizes are cuDNN's answers to a query; NVIDIA publishes no formula.
The models (:func:`reserve_bytes`, :func:`workspace_bytes`) are stated with their evidence and
uncertainty there and in docs/simulator.md.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from oomdoctor.sim import values

# What the model keeps per layer, direction, time step and batch row, in units of H (the hidden
# size), and why. The backward of one step needs the gate activations and the states around it.
# - LSTM: the four gate activations (i, f, g, o), the cell state c_t and the output h_t: 6.
# - GRU: n = tanh(W_in x + r * (W_hn h + b_hn)) needs W_hn h + b_hn apart from the input part,
#   so both GEMMs' three gate pre-activations are kept (3 + 3) plus h_t: 7.
# - RNN (tanh/relu): the pre-activation and h_t: 2.
# The top layer's h_t is the output y, which cuDNN gets as an argument, so it is not kept twice:
# reserve = D * rows * H * (u * L - 1) * bytes per element.
# Evidence: pytorch/pytorch#2895, where a maintainer printed cudnnGetRNNTrainingReserveSize for
# one script run as LSTM and as GRU (P100): 736,000,000 B and 864,000,000 B. The script is not
# in the issue text, but its printed parameter counts (RNN 761,930, GRU 2,279,370, LSTM
# 3,038,090: one gate = 758,720 parameters, plus a 3,210-parameter head) admit L = 4 (with
# H = 320, or H = 160 bidirectional, ...), and (6L - 1) / (7L - 1) = 23/27 = 736/864 holds only
# for L = 4: with D*T*B*H = 8,000,000 (T*B = 25,000 for H = 320) both sizes come out exactly.
# One scale (T*B) is inferred there. SeanNaren/deepspeech.pytorch#172 printed a reserve with its
# shape, and the model gives it with nothing fitted: bidirectional GRU(800), one layer,
# T*B = 326*64, fp32: 801,177,600 B. Packed batches (rows = sum of lengths) are unmeasured.
RESERVE_UNITS = {"LSTM": 6, "GRU": 7, "RNN_TANH": 2, "RNN_RELU": 2}
# The workspace (cudnnGetRNNTempSpaceSizes, freed within each call): see workspace_bytes.
# Read from benchmarks/results/cudnn_rnn/nvidia-h200-2.11.0-grid.json (H200, cuDNN 9.19, 96
# shapes), where each shape ran in fp32 and fp16: ws32 - ws16 is the part that scales with the
# element size, 2 * ws16 - ws32 the part that does not.
# - The part that does not is 8 MiB per layer and direction (+ 512 B: a few bytes more, which
#   the allocator rounds up) in 38 of the 48 pairs; the other 10 are within 2.5 MiB of it,
#   where one of the two took a whole 2 MiB block from the caching allocator.
# - The part that does holds a copy of the weight matrices (not the biases): GRU minus
#   RNN_TANH at the same shape (H 1024, uni, 1 layer) is exactly 2 * H * (I + H) elements at
#   both sequence sizes, two gates' matrices; and deepspeech.pytorch#172's two cuDNN 7
#   workspaces (input widths 672 and 800) differ by exactly 2 * 3 * 800 * 128 fp32 elements,
#   the input matrices' growth (tests/test_rnn.py).
# - Beyond the weights, per row of the (T, B) input: WORKSPACE_ROW_UNITS[directions] * H + 2 * I
#   elements, whatever the cell. The count does not follow the gates (GRU and RNN_TANH take
#   the same 4 * H uni), so it is not a gate buffer; the 4 and 12 are fitted (below).
WORKSPACE_FIXED_BYTES = 8 * 2**20
WORKSPACE_ROW_UNITS = {1: 4, 2: 12}
# CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H (RNN.cpp get_algo, use_rnn_persist_small_h: unpacked,
# not double, no projection, H at most these; the backward's limits are lower) keeps 9 more
# H-wide elements per row (RNN_TANH H 256 in the grid: 13 uni / 19-21 bidirectional).
SMALL_H_LIMIT = {"forward": {"RNN_TANH": 384, "RNN_RELU": 384, "LSTM": 192, "GRU": 192},
                 "backward": {"RNN_TANH": 256, "RNN_RELU": 256, "LSTM": 128, "GRU": 128}}
SMALL_H_ROW_UNITS = 9
GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}
FUNCTIONS = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN_TANH", "rnn_relu": "RNN_RELU"}


def reserve_bytes(mode: str, hidden: int, proj: int, layers: int, directions: int,
                  rows: int, elem: int) -> int:
    """The modelled cuDNN reserve space (see RESERVE_UNITS). ``rows`` is T*B (padded) or
    sum(batch_sizes) (packed: cuDNN is given the per-step batch sizes). With projections the
    kept h_t is the projected one (proj_size wide): the least certain case."""
    hout = proj or hidden
    per_row = layers * (RESERVE_UNITS[mode] - 1) * hidden + (layers - 1) * hout
    return directions * rows * per_row * elem


def small_h_persistent(mode: str, hidden: int, proj: int, packed: bool, elem: int,
                       phase: str) -> bool:
    """Whether PyTorch picks cuDNN's persistent small-H algorithm for this ``phase`` ("forward"
    or "backward"): RNN.cpp get_algo. Its fp16 PERSIST_STATIC choice (input and H multiples of
    128, one layer, one direction) is not modelled: its workspace is unmeasured."""
    return not proj and not packed and elem != 8 and hidden <= SMALL_H_LIMIT[phase][mode]


def workspace_bytes(mode: str, input_size: int, hidden: int, proj: int, layers: int,
                    directions: int, steps: int, batch: int, elem: int,
                    persistent: bool = False) -> int:
    """The modelled cuDNN workspace of one call (forward, backward data or backward weights:
    RNN.cpp asks cudnnGetRNNTempSpaceSizes the same question for each, with that phase's
    algorithm): 8 MiB per layer and direction, plus, in the data type, the weight matrices and
    per (T, B) row WORKSPACE_ROW_UNITS[directions] * H + 2 * I elements (9 * H more with the
    persistent small-H algorithm). A packed batch is taken at its longest sequence times its
    largest batch, the shape of cuDNN's data descriptor (unmeasured).

    Fitted on hidden 256 (LSTM, GRU: 32 records of nvidia-h200-2.11.0-grid.json): max |error|
    14.8%, median 2.2%; held out, hidden 1024 (48 records, LSTM/GRU/RNN_TANH): max 21.2%,
    median 2.6%. The small-H term fitted on (T 100, B 16): max 6.1%; held out on (T 400, B 32):
    max 9.4%, median 3.0%. Whole grid: max 21.2%, median 2.2%; the --quick file (H 512, 2
    layers, T 200, fitted on nothing): -10.4% (LSTM), +1.3% (GRU), +12.7% (RNN_TANH). The
    largest misses: one-layer bidirectional RNN_TANH (+11 to +18%: it takes 10 * H, not 12),
    bidirectional LSTM (-4 to -13%: 14 * H) and 3-layer unidirectional at T 400 (+7 to +21%:
    about 3 * H). cuDNN 7 (the 2017 printouts in tests/test_rnn.py) sized it differently."""
    g = GATES[mode]
    matrices = num_weights(mode, input_size, hidden, proj, layers, directions) \
        - layers * directions * 2 * g * hidden          # the biases are not copied
    units = WORKSPACE_ROW_UNITS[directions] + (SMALL_H_ROW_UNITS if persistent else 0)
    rows = steps * batch
    return WORKSPACE_FIXED_BYTES * layers * directions \
        + elem * (matrices + rows * (units * hidden + 2 * input_size))


def num_weights(mode: str, input_size: int, hidden: int, proj: int, layers: int,
                directions: int) -> int:
    """Elements of cuDNN's flat weight buffer: per layer and direction, the gate matrices for the
    input and the recurrent state, both biases (always present in cuDNN's layout) and, for an
    LSTM with projections, the (proj, H) projection matrix."""
    g = GATES[mode]
    hout = proj or hidden
    total = 0
    for layer in range(layers):
        inp = input_size if layer == 0 else hout * directions
        total += directions * (g * hidden * inp + g * hidden * hout + 2 * g * hidden
                               + (proj * hidden if proj else 0))
    return total


def flatten_parameters(model: torch.nn.Module) -> int:
    """Put each RNN module's parameters into one buffer, as ``flatten_parameters`` does on CUDA;
    returns how many modules were flattened."""
    count = 0
    for mod in model.modules():
        if not isinstance(mod, torch.nn.RNNBase) or mod.mode not in GATES:
            continue
        weights = [w for w in mod._flat_weights if isinstance(w, torch.Tensor)]
        if not weights or len({w.dtype for w in weights}) != 1 or \
                len({w.untyped_storage()._cdata for w in weights}) != len(weights):
            continue
        n = num_weights(mod.mode, mod.input_size, mod.hidden_size, mod.proj_size,
                        mod.num_layers, 2 if mod.bidirectional else 1)
        flat = torch.empty(n, dtype=weights[0].dtype, device=weights[0].device)
        offset = 0
        with torch.no_grad():
            for w in weights:
                w.data = flat[offset:offset + w.numel()].view(w.shape)
                offset += w.numel()
        mod._init_flat_weights()
        count += 1
    return count


class _CudnnRNN(torch.autograd.Function):
    """The allocations of ``_cudnn_rnn`` and ``_cudnn_rnn_backward`` (module docstring)."""

    @staticmethod
    def forward(ctx, p: dict, x: torch.Tensor, hx: torch.Tensor, cx: Any, *weights):
        d, hout = p["directions"], p["hout"]
        x_seq = _seq_major_copy(x) if p["batch_first"] else None   # input.contiguous()
        if p["packed"]:
            output = x.new_empty((x.shape[0], d * hout))
        else:
            output = x.new_empty((p["steps"], p["batch"], d * hout))
        hy = hx.new_empty(hx.shape)
        cy = cx.new_empty(cx.shape) if isinstance(cx, torch.Tensor) else None
        workspace = x.new_empty((p["workspace"]["forward"],), dtype=torch.uint8)
        reserve = x.new_empty((p["reserve"],), dtype=torch.uint8)
        del workspace, x_seq                       # locals of _cudnn_rnn, freed on return
        if p["batch_first"]:
            output = output.transpose(0, 1)        # output.transpose_(0, 1)
        ctx.p = p
        ctx.save_for_backward(x, hx, cx if isinstance(cx, torch.Tensor) else None, output,
                              reserve, *weights)
        return (output, hy, cy) if cy is not None else (output, hy)

    @staticmethod
    def backward(ctx, dout, dhy, *rest):
        # Autograd hands zeros for unused outputs (materialize_grads), as _cudnn_rnn_backward
        # makes zeros_like(output / hx / cx) for undefined gradients.
        p = ctx.p
        x, hx, cx, output, reserve, *weights = ctx.saved_tensors
        # _cudnn_rnn_backward_input: x and dy sequence-major copies, dx, dhx, dcx, workspace.
        x_seq = _seq_major_copy(x) if p["batch_first"] else None
        dy_seq = _seq_major_copy(dout) if p["batch_first"] else None
        if p["batch_first"]:
            dx = _seq_major_copy(x).transpose(0, 1)        # empty_like(transposed input)
        else:
            dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        dhx = hx.new_empty(hx.shape)
        dcx = cx.new_empty(cx.shape) if cx is not None else None
        workspace = x.new_empty((p["workspace"]["backward"],), dtype=torch.uint8)
        del workspace, x_seq, dy_seq
        if not any(ctx.needs_input_grad[4:]):      # frozen weights: output_mask[3] is false
            return (None, dx, dhx, dcx, *[None] * len(weights))
        # _cudnn_rnn_backward_weight: x copied again, dw = zeros(weight_buf), a workspace.
        x_seq = _seq_major_copy(x) if p["batch_first"] else None
        dw = weights[0].new_zeros((p["num_weights"],))
        workspace = x.new_empty((p["workspace"]["backward"],), dtype=torch.uint8)
        del workspace, x_seq
        if p["has_biases"]:
            # get_parameters(dw) + _viewParams: the gradients are views into dw
            grads, offset = [], 0
            for w in weights:
                grads.append(dw[offset:offset + w.numel()].view(w.shape))
                offset += w.numel()
        else:
            # layouts' strides differ without biases: fresh gradients, dw dropped
            grads = [torch.empty_like(w) for w in weights]
        del dw
        return (None, dx, dhx, dcx, *grads)


def _seq_major_copy(t: torch.Tensor) -> torch.Tensor:
    """A new (T, B, ...) tensor for a batch-first (B, T, ...) one."""
    return t.new_empty((t.shape[1], t.shape[0], *t.shape[2:]))


def rnn_as_cudnn(name: str, args: tuple, kwargs: dict, lower: Any = None
                 ) -> tuple[Any, str] | None:
    """``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` as one cuDNN call: the result and a
    note, or None to let the CPU loop run (with the reason in the note of the caller).
    ``lower``: the autocast weight/input cast (CUDA autocast runs ``_cudnn_rnn`` in 16 bit)."""
    mode = FUNCTIONS[name]
    packed = len(args) > 2 and isinstance(args[1], torch.Tensor) and \
        args[1].dtype == torch.int64 and args[1].dim() == 1
    if packed:
        names = ("input", "batch_sizes", "hx", "params", "has_biases", "num_layers", "dropout",
                 "train", "bidirectional")
    else:
        names = ("input", "hx", "params", "has_biases", "num_layers", "dropout", "train",
                 "bidirectional", "batch_first")
    b = {**dict(zip(names, args)), **kwargs}
    x, hx, params = b["input"], b["hx"], list(b["params"])
    if not b["train"]:
        return None
    if isinstance(hx, (list, tuple)):
        hx, cx = hx
    else:
        cx = None
    if lower is not None:
        x, hx = lower(x), lower(hx)
        cx = lower(cx) if cx is not None else None
        params = [lower(w) for w in params]
    directions = 2 if b["bidirectional"] else 1
    layers = b["num_layers"]
    hout = hx.shape[-1]
    hidden = cx.shape[-1] if cx is not None else hout
    proj = hout if hidden != hout else 0
    batch_first = bool(b.get("batch_first", False)) and not packed
    if packed:
        sizes = b["batch_sizes"]
        if sizes.device.type == "meta" or getattr(sizes, "fake_mode", None) is not None:
            raise NotImplementedError("a PackedSequence whose batch_sizes are not real CPU "
                                      "values")
        sizes = [int(s) for s in sizes.tolist()]
        steps, batch, rows = len(sizes), sizes[0], sum(sizes)
    else:
        steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
        rows = steps * batch
    elem = x.element_size()
    reserve = reserve_bytes(mode, hidden, proj, layers, directions, rows, elem)
    shape = (mode, x.shape[-1], hidden, proj, layers, directions, steps, batch, elem)
    workspace = {phase: workspace_bytes(*shape, persistent=small_h_persistent(
        mode, hidden, proj, packed, elem, phase)) for phase in ("forward", "backward")}
    p = dict(mode=mode, directions=directions, hout=hout, steps=steps, batch=batch, rows=rows,
             batch_first=batch_first, packed=packed, reserve=reserve, workspace=workspace,
             has_biases=bool(b["has_biases"]),
             num_weights=num_weights(mode, x.shape[-1], hidden, proj, layers, directions))
    out = _CudnnRNN.apply(p, x, hx, cx, *params)
    note = (f"{mode.lower().replace('_', '-')}: traced as cuDNN's fused kernel (one _cudnn_rnn "
            "call); its reserve and workspace sizes are modelled, not queried from cuDNN "
            "(see docs/simulator.md)")
    if isinstance(b["dropout"], float) and b["dropout"] > 0 and layers > 1:
        note += "; inter-layer dropout's cuDNN state (about 2 MiB, once per GPU) not counted"
    if mode == "LSTM":
        return (out[0], out[1], out[2]), note
    return (out[0], out[1]), note


def run(func: Any, name: str, args: tuple, kwargs: dict, notes: list[str], lower: Any = None
        ) -> Any:
    """``torch.lstm`` & co. for :class:`oomdoctor.sim.emulate.CudaKernels`: cuDNN's call where it
    applies, else the CPU loop (eval mode; packed lengths without values, with a note)."""
    try:
        done = rnn_as_cudnn(name, args, kwargs, lower)
    except NotImplementedError as e:
        notes.append(f"{name}: traced as the CPU's per-step loop, not cuDNN's kernel ({e}): "
                     "slower, and its memory is the loop's")
        return func(*args, **kwargs)
    if done is None:               # eval mode: no reserve; the loop's memory is close
        return func(*args, **kwargs)
    out, note = done
    notes.append(note)
    return out


def with_real_lengths(func: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """``pack_padded_sequence`` and ``Tensor.cpu()`` on the batch's meta tensors.

    Packing needs the lengths' values (they size the packed data and make ``batch_sizes``, a
    CPU tensor on CUDA too); ``pad_packed_sequence`` copies the batch-derived sort indices to
    the host. The trace mirrors the batch's real values (oomdoctor.sim.values) once a step has
    failed on a data-dependent question, which the error below is, so the second trace gets
    the real lengths. A device-to-host copy puts nothing new on the GPU."""
    if name == "cpu":
        t = args[0] if args else None
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            real = values.real_value(t)
            if real is not None:
                with _disable_current_modes():     # a host copy: not a GPU allocation
                    return real.clone()
        return func(*args, **kwargs)
    b = {**dict(zip(("input", "lengths", "batch_first"), args)), **kwargs}
    lengths = b["lengths"]
    if isinstance(lengths, torch.Tensor) and lengths.device.type == "meta":
        real = values.real_value(lengths)
        if real is None:
            raise RuntimeError("pack_padded_sequence: the lengths are data-dependent (a meta "
                               "tensor without values)")
        b["lengths"] = real
    return func(b["input"], b["lengths"], b["batch_first"])
