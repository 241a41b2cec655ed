"""Rowwise float8_e4m3fn quantization: each row of the last dim scaled so its amax maps to 448.

What the fp8 paths share below the op files (the MoE layer's tokens, h rows and expert channels): one Triton
kernel on the GPU, its torch-ops definition elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tune import next_pow2

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_MAX_TL = tl.constexpr(FP8_MAX)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quantize_rows_kernel(X, Q, S, N, stride_x, stride_q, tiny, BLOCK_N: tl.constexpr):
    """One row per program: its amax (first pass), then q = clamp(x / scale, +-448) as e4m3 (second pass),
    scale = amax / 448 rounded to x's dtype. One read for the amax and one read and write for q: what the
    torch-ops version did in five passes and three full-size temporaries (29.9 GB at DeepSeek-V3's experts)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        v = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v), propagate_nan=tl.PropagateNan.ALL)  # NaN spreads to the row
    amax = tl.reduce(amax, 0, _max_nan)
    scale = tl.maximum(amax / FP8_MAX_TL, tiny, propagate_nan=tl.PropagateNan.ALL)
    scale = scale.to(X.dtype.element_ty).to(tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        v = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        # div_rn: torch's IEEE division (Triton's default fp32 divide is approximate and moved values across
        # e4m3 rounding boundaries: the bit-exact GPU test caught it at fp16, 37 x 4111).
        q = tl.clamp(tl.math.div_rn(v, scale), -FP8_MAX_TL, FP8_MAX_TL, propagate_nan=tl.PropagateNan.ALL)
        tl.store(Q + row * stride_q + cols, q.to(tl.float8e4nv), mask=cols < N)
    tl.store(S + row, scale)



def quantize_rows_reference(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in torch ops, in fp32 (the definition; the interpreter's fp8 casts truncate, so CPU and
    interpreter calls take this path)."""
    amax = t.abs().amax(-1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(t.dtype).tiny).to(t.dtype).float()
    q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.squeeze(-1).contiguous()


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) with t ~= q * scale[..., None]: float8_e4m3fn per row of the last dim, the row's amax mapped
    to 448 (scale = amax / 448, rounded to t's dtype so the dequantization multiplies by exactly the number the
    quantization divided by). An all-zero row gets the dtype's smallest normal as its scale and q = 0; NaN
    spreads to its row as in torch.
    On a GPU one Triton kernel (two passes over each row); elsewhere `quantize_rows_reference`."""
    if not t.is_cuda or t.numel() == 0:
        return quantize_rows_reference(t)
    n = t.shape[-1]
    x = t.reshape(-1, n) if t.stride(-1) == 1 else t.contiguous().reshape(-1, n)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=t.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=t.device)
    block = min(next_pow2(n), 4096)
    quantize_rows_kernel[(x.shape[0],)](x, q, scale, n, x.stride(0), q.stride(0), torch.finfo(t.dtype).tiny,
                                        BLOCK_N=block,
                                        num_warps=8 if block >= 2048 else 4)
    return q.view(t.shape), scale.view(t.shape[:-1])
