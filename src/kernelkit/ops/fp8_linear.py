"""`fp8_linear(x, weight, bias)`: nn.Linear's forward and both backward GEMMs in float8_e4m3fn with rowwise scales.

The recipe (torchao's "rowwise"): every GEMM's operands are quantized along the dim that GEMM reduces over,
one scale per row of the other dim, so each scale factors out of the sum and the GEMM's epilogue multiplies it
back (`scaled_matmul`'s rowwise recipe, fp32 accumulation, one rounding to the output dtype):

    forward  y  = x @ w.T       x per token (row of x),       w per output channel (row of w)
    dgrad    dx = dy @ w        dy per token (row of dy),     w per input channel (column of w)
    wgrad    dw = dy.T @ x      dy per output channel (column of dy), x per input channel (column of x)

The master weight, the saved activation and every gradient stay in the input's dtype (bf16 or fp16): the
backward quantizes from them again (the transposed quantizations read columns, `quantize_cols_t`). The bias
is added in fp32 in the forward GEMM's epilogue; its gradient is dy's column sum.

On a GPU without fp8 tensor cores (compute capability below 8.9) `fp8_linear` raises; `kernelkit.patch(model,
precision="fp8")` checks first and keeps such layers in their dtype (its report says why). In the Triton
interpreter the quantizers run their torch reference and the GEMM the interpreted kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from .gemm.fp8 import quantize_cols_t, quantize_rows
from .scaled_matmul import fp8_device_unsupported, rowwise_gemm as _gemm

DTYPES = (torch.bfloat16, torch.float16)
ALIGN = 16  # K and N of every fp8 GEMM (torch._scaled_mm's rule; kernelkit's TMA path wants 16-byte rows too)


def unsupported(x: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """Why `fp8_linear` cannot take this call (None when it can): the reason a patched layer stays in its dtype."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        return f"dtype {str(x.dtype).replace('torch.', '')} (fp8 training takes bf16 / fp16 masters, one for x and w)"
    n, k = weight.shape
    if n % ALIGN or k % ALIGN:
        return f"in/out features {k}/{n} are not multiples of {ALIGN}"
    return fp8_device_unsupported(x)


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


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cache):
        xq, sx = quantize_rows(x)
        wq, sw = _weight("rows", weight, cache, quantize_rows)
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.cache = bias is not None, cache
        return _gemm(xq, sx, wq, sw, bias, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            gq, sg = quantize_rows(dy)  # (T, N) per token
            wtq, swt = _weight("cols", weight, ctx.cache, quantize_cols_t)  # (K, N) per input channel
            dx = _gemm(gq, sg, wtq, swt, None, dy.dtype)
        if ctx.needs_input_grad[1]:
            gtq, sgt = quantize_cols_t(dy)  # (N, T) per output channel
            xtq, sxt = quantize_cols_t(x)  # (K, T) per input channel
            dw = _gemm(gtq, sgt, xtq, sxt, None, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.float().sum(0).to(dy.dtype)
        return dx, dw, db, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               cache: Optional[QuantizedWeight] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the forward and both backward GEMMs in fp8 (module docstring).

    x (..., K) and weight (N, K) in bfloat16 or float16 (the same), K and N multiples of 16; bias (N,) or None.
    cache: a `QuantizedWeight` of this weight, to reuse its fp8 copies until the weight changes.
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
    y = _Fp8Linear.apply(x2, weight, bias, cache)
    return y.view(*lead, weight.shape[0])
