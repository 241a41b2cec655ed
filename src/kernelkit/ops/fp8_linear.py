"""`fp8_linear(x, weight, bias)`: nn.Linear's forward and both backward GEMMs in float8_e4m3fn with rowwise scales.

The recipe (torchao's "rowwise"): every GEMM's operands are quantized along the dim that GEMM reduces over,
one scale per row of the other dim, so each scale factors out of the sum and the GEMM's epilogue multiplies it
back (`scaled_matmul`'s rowwise recipe, fp32 accumulation, one rounding to the output dtype):

    forward  y  = x @ w.T       x per token (row of x),       w per output channel (row of w)
    dgrad    dx = dy @ w        dy per token (row of dy),     w per input channel (column of w)
    wgrad    dw = dy.T @ x      dy per output channel (column of dy), x per input channel (column of x)

The master weight and every gradient stay in the input's dtype (bf16 or fp16). The activation is not kept in
it: where the weight needs a gradient, the forward quantizes x's columns for the wgrad at once (`quantize_cols_t`,
the transposed quantization the backward would make from x: the same bytes) and keeps those, 1 byte per element
instead of 2. x itself can then be freed after the forward unless another op keeps it (the norm's output before
q/k/v and gate/up, SwiGLU's before down_proj: 0.5 GiB at Llama-3.2-1B shapes). The backward quantizes dy and the
weight's columns. The bias is added in fp32 in the forward GEMM's epilogue; its gradient is dy's column sum.

On a GPU without fp8 tensor cores (compute capability below 8.9) `fp8_linear` raises; `kernelkit.patch(model,
precision="fp8")` checks first and keeps such layers in their dtype (its report says why). In the Triton
interpreter the quantizers run their torch reference and the GEMM the interpreted kernel.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .. import switches
from .gemm.fp8 import quantize_cols_t, quantize_rows, quantize_rows_and_cols_t
from .scaled_matmul import fp8_device_unsupported, rowwise_gemm as _gemm

DTYPES = (torch.bfloat16, torch.float16)
# The backward quantizes dy both ways (rows for the dgrad, columns for the wgrad) from two reads of dy instead of
# four (`quantize_rows_and_cols_t`); KERNELKIT_FP8_DY_ONE_READ=0 runs quantize_rows and quantize_cols_t apart.
DY_ONE_READ = switches.on("KERNELKIT_FP8_DY_ONE_READ")
ALIGN = 16  # K and N of every fp8 GEMM (torch._scaled_mm's rule; kernelkit's TMA path wants 16-byte rows too)


def unsupported(x: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """Why `fp8_linear` cannot take this call (None when it can): the reason a patched layer stays in its dtype."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        return f"dtype {str(x.dtype).replace('torch.', '')} (fp8 training takes bf16 / fp16 masters, one for x and w)"
    n, k = weight.shape
    if n % ALIGN or k % ALIGN:
        return f"in/out features {k}/{n} are not multiples of {ALIGN}"
    return fp8_device_unsupported(x)


def takes_input(x: torch.Tensor) -> bool:
    """Whether x (..., K) can be an fp8_linear operand whatever the weight (its dtype, K, its device): what a
    producer of x checks before writing x's fp8 rows for the fp8 Linears that read it."""
    return x.dtype in DTYPES and x.shape[-1] % ALIGN == 0 and fp8_device_unsupported(x) is None


class QuantizedWeight:
    """The fp8 copies of one weight, kept while the weight is unchanged: its rows (the forward's operand) and
    its columns (the dgrad's). With gradient accumulation the weight is quantized once per optimizer step, not
    once per micro-batch. A copy is reused only while the weight's storage, shape, dtype and version counter
    are the ones it was made from: an optimizer step or any in-place write through the parameter moves the
    counter and the next call quantizes again. (A write through `.data` bypasses the counter: call `clear()`
    after one.) Costs one byte per weight element for each copy kept. Not used under torch.compile."""

    def __init__(self):
        self._kept: dict[str, tuple] = {}

    def clear(self) -> None:
        self._kept.clear()

    def get(self, kind: str, weight: torch.Tensor, quantize):
        if torch.compiler.is_compiling():
            return quantize(weight)
        key = (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.dtype,
               weight._version)
        hit = self._kept.get(kind)
        if hit is not None and hit[0] == key:
            return hit[1]
        value = quantize(weight)
        self._kept[kind] = (key, value)
        return value


def _weight(kind, weight, cache, quantize):
    return quantize(weight) if cache is None else cache.get(kind, weight, quantize)


class SharedInput:
    """One input tensor's fp8 quantizations, shared by the fp8 Linears that read it: its rows (the forward's
    operand, made by the first reader or handed in by the op that produced the tensor) and its transposed
    columns (the wgrad's, made by the first reader whose weight needs a gradient). Both are held while the tensor
    is the kept one; each reader's autograd context saves the columns it needs, so they live as long as a
    backward can read them."""

    __slots__ = ("owner", "rows", "cols", "readers", "origin", "hits")

    def __init__(self, owner, rows=None, origin=None):
        self.owner, self.rows, self.cols, self.origin = owner, rows, None, origin
        self.readers = self.hits = 0  # readers that took the columns / the rows made before them

    def cols_t(self, x: torch.Tensor):
        """quantize_cols_t(x), made once for all the readers (x is the same bytes for each: the key says so)."""
        if self.cols is None:
            self.cols = quantize_cols_t(x)
        self.readers += 1
        return self.cols


class SharedInputs:
    """The fp8 quantizations of the input the fp8 Linears just read, for the next one that reads the same tensor:
    q, k and v read one tensor, gate and up another, and each quantized it on its own (rows in the forward, columns
    in the backward). One per patched model (`kernelkit.patch(model, precision="fp8")`).

    The last input is kept by a weak reference, with the key it was seen under: its storage's address, offset,
    shape, strides, dtype and version counter. A reader whose input has the same key while the kept tensor is
    alive reads the same bytes (an in-place write moves the counter; a write through ``.data`` does not: call
    `clear()` after one) and takes the kept rows. When the kept tensor dies (its last reader is done with it), its
    rows go with it, so no fp8 copy outlives the activation, and a new tensor on the freed storage is a miss. A
    new input replaces the kept one and drops its rows; the first backward drops the last one. Bypassed under
    torch.compile (the Linears quantize on their own there) and for inference tensors (no version counter)."""

    def __init__(self):
        self._kept = None  # (weak reference to the tensor, key, SharedInput)

    def __deepcopy__(self, memo):  # a copied model shares nothing with this one
        return SharedInputs()

    @staticmethod
    def _key(x: torch.Tensor):
        return (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype, x.device,
                x._version)

    def _keep(self, x, entry):
        old, self._kept = self._kept, None
        if old is not None:
            old[2].rows = old[2].cols = None  # the readers' contexts keep the columns they need
            if old[2].origin is not None:  # tell the producer whether its rows were read (see offer)
                old[2].origin(old[2].hits > 0)
        if x is not None:
            self._kept = (weakref.ref(x, self._gone), self._key(x), entry)

    def _gone(self, ref) -> None:
        """The kept tensor died: its rows are freed with it (called by the weak reference)."""
        kept = self._kept
        if kept is not None and kept[0] is ref:
            self._keep(None, None)

    def clear(self) -> None:
        """Forget the kept input (its rows; backwards under way keep their columns)."""
        self._keep(None, None)

    @staticmethod
    def bypassed(x: torch.Tensor) -> bool:
        return torch.compiler.is_compiling() or torch.is_inference(x)

    def entry(self, x: torch.Tensor) -> Optional[SharedInput]:
        """The shared quantizations of `x`: the kept ones if x is the kept input, unchanged, else a new (empty)
        entry that replaces it. None where bypassed."""
        if self.bypassed(x):
            return None
        kept = self._kept
        if kept is not None and kept[0]() is not None and kept[1] == self._key(x):
            return kept[2]
        entry = SharedInput(self)
        self._keep(x, entry)
        return entry

    def has_rows(self, x: torch.Tensor) -> bool:
        """Whether x's rows are kept, made by its producer or an earlier reader (the next reader takes them)."""
        kept = self._kept
        return (not self.bypassed(x) and kept is not None and kept[2].rows is not None and kept[0]() is not None
                and kept[1] == self._key(x))

    def offer(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, origin=None) -> None:
        """Keep `quantize_rows(x)` (q, scale), made by the op that wrote x (the RMSNorm before q/k/v), for the fp8
        Linears that read x next. `origin(read)`, if given, is called when x stops being kept: read says whether
        any Linear took the rows (a producer whose rows nobody reads can stop writing them)."""
        if not self.bypassed(x):
            n = x.shape[-1]
            self._keep(x, SharedInput(self, (q.reshape(-1, n), scale.reshape(-1)), origin))


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cache, shared):
        rows = shared.rows if shared is not None else None
        if rows is None:
            rows = quantize_rows(x)
            if shared is not None:
                shared.rows = rows
        else:
            shared.hits += 1
        wq, sw = _weight("rows", weight, cache, quantize_rows)
        if ctx.needs_input_grad[1]:  # the wgrad's operand now, instead of x (module docstring)
            xtq, sxt = quantize_cols_t(x) if shared is None else shared.cols_t(x)
            ctx.save_for_backward(weight, xtq, sxt)
        else:
            ctx.save_for_backward(weight)
        ctx.has_bias, ctx.cache, ctx.shared = bias is not None, cache, shared
        return _gemm(*rows, wq, sw, bias, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        weight, *x_cols = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and DY_ONE_READ:
            (gq, sg), (gtq, sgt) = quantize_rows_and_cols_t(dy)  # both of dy's quantizations from two reads
        else:
            gq, sg = quantize_rows(dy) if ctx.needs_input_grad[0] else (None, None)  # (T, N) per token
            gtq, sgt = quantize_cols_t(dy) if ctx.needs_input_grad[1] else (None, None)  # (N, T) per output channel
        if ctx.needs_input_grad[0]:
            wtq, swt = _weight("cols", weight, ctx.cache, quantize_cols_t)  # (K, N) per input channel
            dx = _gemm(gq, sg, wtq, swt, None, dy.dtype)
        if ctx.needs_input_grad[1]:
            xtq, sxt = x_cols  # (K, T) per input channel, made in the forward
            dw = _gemm(gtq, sgt, xtq, sxt, None, weight.dtype)
        if ctx.shared is not None:
            ctx.shared.owner.clear()  # the forward is over: its last kept input is not read again
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.float().sum(0).to(dy.dtype)
        return dx, dw, db, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               cache: Optional[QuantizedWeight] = None, shared: Optional[SharedInputs] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the forward and both backward GEMMs in fp8 (module docstring).

    x (..., K) and weight (N, K) in bfloat16 or float16 (the same), K and N multiples of 16; bias (N,) or None.
    cache: a `QuantizedWeight` of this weight, to reuse its fp8 copies until the weight changes.
    shared: the `SharedInputs` of the Linears that may read the same x (one per model), so that x is quantized
    once for all of them (rows in the forward, columns in the backward).
    Raises ValueError with the reason where `unsupported` gives one."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError("fp8_linear: x must be a tensor and weight a 2-D (out_features, in_features) tensor")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fp8_linear: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    why = unsupported(x, weight)
    if why is not None:
        raise ValueError(f"fp8_linear: {why}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if cache is not None and not isinstance(cache, QuantizedWeight):
        raise TypeError(f"fp8_linear: cache must be a QuantizedWeight or None, got {type(cache).__name__}")
    if shared is not None and not isinstance(shared, SharedInputs):
        raise TypeError(f"fp8_linear: shared must be a SharedInputs or None, got {type(shared).__name__}")
    y = _Fp8Linear.apply(x2, weight, bias, cache, shared.entry(x) if shared is not None else None)
    return y.view(*lead, weight.shape[0])
