"""Rowwise float8_e4m3fn quantization: each row of the last dim scaled so its amax maps to 448.

What the fp8 paths share below the op files (the MoE layer's tokens, h rows and expert channels, fp8_linear's
operands): one Triton kernel on the GPU, its torch-ops definition elsewhere; and the in-kernel pieces (fp8_scale,
fp8_clamp, e4m3_bits) that a kernel quantizing its own output calls to give quantize_rows' bits (rms_norm_fp8).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import triton
import triton.language as tl

from ...runtime import interpreting, launch, next_pow2, num_sms
from .mx import dequantize_fwd, e8m0_to_fp32, encode_fp8, quantize_fwd

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_MAX_TL = tl.constexpr(FP8_MAX)
# The GPU's fp8 and bf16 converts round to nearest even; the interpreter's truncate, so kernels that run there encode
# the bits themselves (mx.mx_encode, e4m3_bits, round_to).
HW_FP8_CAST = tl.constexpr(not interpreting())


@triton.jit
def max_nan(a, b):
    """max that spreads NaN: the reduction of every quantizer's amax."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def round_to(v, DTYPE: tl.constexpr):
    """fp32 v rounded to DTYPE (nearest even) and back to fp32. In the interpreter, whose fp32 -> bf16 cast
    truncates, the bf16 rounding is done on the bits (fp16's cast rounds there too)."""
    if HW_FP8_CAST:
        return v.to(DTYPE).to(tl.float32)
    else:
        if DTYPE == tl.bfloat16:
            b = v.to(tl.uint32, bitcast=True)
            b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
            return b.to(tl.float32, bitcast=True)
        else:
            return v.to(DTYPE).to(tl.float32)


@triton.jit
def fp8_scale(amax, tiny, DTYPE: tl.constexpr):
    """The quantizers' scale for an fp32 amax: amax / 448, at least `tiny` (an all-zero row or column), rounded to
    the input's dtype (so the dequantization multiplies by exactly what the quantization divides by); NaN stays."""
    scale = tl.maximum(amax / FP8_MAX_TL, tiny, propagate_nan=tl.PropagateNan.ALL)
    return round_to(scale, DTYPE)


@triton.jit
def fp8_clamp(v, scale):
    """v / scale clamped to +-448 (e4m3's range), as fp32 for the cast. div_rn: torch's IEEE division (Triton's
    default fp32 divide is approximate and moved values across e4m3 rounding boundaries: the bit-exact GPU test
    caught it at fp16, 37 x 4111)."""
    return tl.clamp(tl.math.div_rn(v, scale), -FP8_MAX_TL, FP8_MAX_TL, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def e4m3_bits(v):
    """The float8_e4m3fn bits (uint8) of fp32 v within +-448 (fp8_clamp's output), nearest even, NaN as NaN: the
    GPU's convert, or the same bits encoded in the interpreter."""
    if HW_FP8_CAST:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return tl.where(v != v, 0x7F, encode_fp8(v, 3, 7)).to(tl.uint8)


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
    amax = tl.reduce(amax, 0, max_nan)
    scale = fp8_scale(amax, tiny, X.dtype.element_ty)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        v = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        q = fp8_clamp(v, scale)
        tl.store(Q + row * stride_q + cols, q.to(tl.float8e4nv), mask=cols < N)
    tl.store(S + row, scale)



@triton.jit
def quantize_cols_t_kernel(X, Q, S, R, C, stride_xb, stride_xr, stride_xc, tiny,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The transposed quantization: X[b] (R, C) -> Q[b] (C, R) contiguous e4m3, one scale per column of X[b] (its
    amax over R mapped to 448, rounded to X's dtype), as quantize_rows_kernel on X[b]^T. One program per (block of
    columns, b): an amax pass down the columns, then a pass that scales, transposes (through shared memory: the
    loads run along C, the stores along R) and stores."""
    b = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    x_cols = X + b * stride_xb + cols.to(tl.int64)[None, :] * stride_xc
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        v = tl.load(x_cols + rr.to(tl.int64)[:, None] * stride_xr, mask=(rr < R)[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.reduce(tl.abs(v), 0, max_nan), propagate_nan=tl.PropagateNan.ALL)
    scale = fp8_scale(amax, tiny, X.dtype.element_ty)
    tl.store(S + b * C + cols, scale, mask=c_ok)
    q_cols = Q + b * C * R + cols.to(tl.int64)[None, :] * R
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        mask = (rr < R)[:, None] & c_ok[None, :]
        v = tl.load(x_cols + rr.to(tl.int64)[:, None] * stride_xr, mask=mask, other=0.0).to(tl.float32)
        q = fp8_clamp(v, scale[None, :])
        tl.store(q_cols + rr[:, None], q.to(tl.float8e4nv), mask=mask)


@triton.jit
def quantize_cols_t_amax_kernel(X, P, R, C, ROWS_PER, stride_xb, stride_xr, stride_xc,
                                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """quantize_cols_t over row chunks, first pass: program (column block, row chunk, b) writes its chunk's amax per
    column to P[b, chunk, :] (NaN-propagating, as quantize_cols_t_kernel's)."""
    b = tl.program_id(2).to(tl.int64)
    rc = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    x_cols = X + b * stride_xb + cols.to(tl.int64)[None, :] * stride_xc
    lo = rc * ROWS_PER
    hi = tl.minimum(R, lo + ROWS_PER)
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        v = tl.load(x_cols + rr.to(tl.int64)[:, None] * stride_xr, mask=(rr < hi)[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.reduce(tl.abs(v), 0, max_nan), propagate_nan=tl.PropagateNan.ALL)
    tl.store(P + (b * tl.num_programs(1) + rc) * C + cols, amax, mask=c_ok)


@triton.jit
def quantize_cols_t_chunk_kernel(X, P, Q, S, R, C, ROWS_PER, stride_xb, stride_xr, stride_xc, tiny,
                                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Second pass: the columns' amax from every chunk's partial, the scale (stored by chunk 0), then this chunk's
    rows quantized and written transposed, as quantize_cols_t_kernel's second loop."""
    b = tl.program_id(2).to(tl.int64)
    rc = tl.program_id(1)
    chunks = tl.num_programs(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for i in range(0, chunks):
        amax = tl.maximum(amax, tl.load(P + (b * chunks + i) * C + cols, mask=c_ok, other=0.0),
                          propagate_nan=tl.PropagateNan.ALL)
    scale = fp8_scale(amax, tiny, X.dtype.element_ty)
    tl.store(S + b * C + cols, scale, mask=c_ok & (rc == 0))
    x_cols = X + b * stride_xb + cols.to(tl.int64)[None, :] * stride_xc
    q_cols = Q + b * C * R + cols.to(tl.int64)[None, :] * R
    lo = rc * ROWS_PER
    hi = tl.minimum(R, lo + ROWS_PER)
    for r0 in range(lo, hi, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        mask = (rr < hi)[:, None] & c_ok[None, :]
        v = tl.load(x_cols + rr.to(tl.int64)[:, None] * stride_xr, mask=mask, other=0.0).to(tl.float32)
        q = fp8_clamp(v, scale[None, :])
        tl.store(q_cols + rr[:, None], q.to(tl.float8e4nv), mask=mask)


@triton.jit
def quantize_segments_t_kernel(X, X_IDX, ROW_SCALE, Q, S, OFFS, POFFS, C, stride_xr, stride_xc, stride_q, tiny,
                               GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_C: tl.constexpr):
    """Per expert e, its rows [OFFS[e], OFFS[e + 1]) of X (row r read at X_IDX[r] with GATHER, times ROW_SCALE[r]
    with HAS_SCALE, rounded to X's dtype) quantized per column and written transposed: Q[c, POFFS[e] + i] for the
    segment's i-th row, zeros up to POFFS[e + 1] (each segment padded to a whole number of K steps of the fp8
    wgrad), one scale per (e, column) in S (E, C). One program per (block of columns, expert)."""
    e = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    cols64 = cols.to(tl.int64)
    start = tl.load(OFFS + e)
    end = tl.load(OFFS + e + 1)
    pstart = tl.load(POFFS + e).to(tl.int64)
    pend = tl.load(POFFS + e + 1).to(tl.int64)
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        v = _segment_rows(X, X_IDX, ROW_SCALE, r0 + tl.arange(0, BLOCK_R), end, cols64, c_ok, stride_xr, stride_xc,
                          GATHER, HAS_SCALE)
        amax = tl.maximum(amax, tl.reduce(tl.abs(v), 0, max_nan), propagate_nan=tl.PropagateNan.ALL)
    scale = fp8_scale(amax, tiny, X.dtype.element_ty)
    tl.store(S + e.to(tl.int64) * C + cols64, scale, mask=c_ok)
    q_cols = Q + cols64[None, :] * stride_q
    for p0 in range(pstart, pend, BLOCK_R):
        pr = p0 + tl.arange(0, BLOCK_R)
        rr = start + (pr - pstart)
        v = _segment_rows(X, X_IDX, ROW_SCALE, rr, end, cols64, c_ok, stride_xr, stride_xc, GATHER, HAS_SCALE)
        q = fp8_clamp(v, scale[None, :])
        q = tl.where((rr < end)[:, None], q, 0.0)  # the padding: zeros, also in a column whose scale is NaN
        tl.store(q_cols + pr[:, None], q.to(tl.float8e4nv), mask=(pr < pend)[:, None] & c_ok[None, :])


@triton.jit
def _segment_rows(X, X_IDX, ROW_SCALE, rr, end, cols64, c_ok, stride_xr, stride_xc, GATHER: tl.constexpr,
                  HAS_SCALE: tl.constexpr):
    """Rows rr (< end) of a quantize_segments_t_kernel segment as fp32 (BLOCK_R, BLOCK_C), zeros elsewhere."""
    r_ok = rr < end
    src = tl.load(X_IDX + rr, mask=r_ok, other=0).to(tl.int64) if GATHER else rr.to(tl.int64)
    v = tl.load(X + src[:, None] * stride_xr + cols64[None, :] * stride_xc, mask=r_ok[:, None] & c_ok[None, :],
                other=0.0)
    if HAS_SCALE:
        v = (v.to(tl.float32) * tl.load(ROW_SCALE + rr, mask=r_ok, other=0.0)[:, None]).to(X.dtype.element_ty)
    return v.to(tl.float32)


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
    launch(quantize_rows_kernel, (x.shape[0],), None, x, q, scale, n, x.stride(0), q.stride(0),
           torch.finfo(t.dtype).tiny, BLOCK_N=block, num_warps=8 if block >= 2048 else 4)
    return q.view(t.shape), scale.view(t.shape[:-1])


# quantize_cols_t_kernel's (BLOCK_R, BLOCK_C, num_warps): 64 columns are a 128-byte row of the bf16 loads. Measured on
# the H100 (moe/moe_fp8_bwd_ab.json, 7 tiles): 1600-1630 GB/s of ideal bytes (3 a weight: 2 read, 1 written) at
# 256 x 64 x 8 warps, 1400 at 64 x 64 x 4; it reads each column twice (amax, then the quantization), so 5 bytes
# move: 90% of what that allows at the 3 TB/s of a copy.
COLS_T_TILE = (256, 64, 8)
# With fewer (column block, b) programs than this many per SM (one dense matrix: 64 column blocks of a 4096-wide
# activation for 132 SMs), each column block is also split over row chunks: an amax pass per chunk, then a pass
# that reduces the chunks' amax and quantizes its chunk. Before the split, 8192x4096 bf16 took 186 µs (~500 GB/s)
# on the H100 (benchmarks/results/h100/fp8_linear_projections.json).
COLS_T_PROGRAMS_PER_SM = 4


def quantize_cols_t_reference(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_cols_t in torch ops: `quantize_rows_reference` of t's last two dims swapped, made contiguous."""
    q, scale = quantize_rows_reference(t.transpose(-1, -2))
    return q.contiguous(), scale


def quantize_cols_t(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed quantization of t (..., R, C): (q, scale) with q (..., C, R) contiguous float8_e4m3fn and
    scale (..., C), t[..., r, c] ~= q[..., c, r] * scale[..., c]: each column scaled so its amax maps to 448, as
    `quantize_rows` would quantize t's transpose, without the transposed copy. The backward's fp8 dgrads read the
    expert weights this way (their reduction runs along the forward's output channels, and fp8 MMAs take both
    operands K-contiguous). On a GPU one Triton kernel (two passes over each column block), or, where column blocks
    are too few to fill the GPU, two (an amax per row chunk, then the quantization of each chunk); elsewhere
    `quantize_cols_t_reference`."""
    if not t.is_cuda or t.numel() == 0:
        return quantize_cols_t_reference(t)
    r, c = t.shape[-2], t.shape[-1]
    x = t.reshape(-1, r, c)  # (a copy only where no single stride walks the leading dims)
    b = x.shape[0]
    q = torch.empty((b, c, r), dtype=torch.float8_e4m3fn, device=t.device)
    scale = torch.empty((b, c), dtype=torch.float32, device=t.device)
    block_r, block_c, warps = COLS_T_TILE
    block_c = min(block_c, next_pow2(c))
    col_blocks = triton.cdiv(c, block_c)
    target = COLS_T_PROGRAMS_PER_SM * num_sms(t.device)
    chunks = min(triton.cdiv(r, block_r), triton.cdiv(target, col_blocks * b))
    tiny = torch.finfo(t.dtype).tiny
    if chunks <= 1:
        launch(quantize_cols_t_kernel, (col_blocks, b), None, x, q, scale, r, c, x.stride(0), x.stride(1), x.stride(2),
               tiny, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    else:
        rows_per = triton.cdiv(triton.cdiv(r, chunks), block_r) * block_r
        chunks = triton.cdiv(r, rows_per)
        partial = torch.empty((b, chunks, c), dtype=torch.float32, device=t.device)
        grid = (col_blocks, chunks, b)
        strides = (x.stride(0), x.stride(1), x.stride(2))
        launch(quantize_cols_t_amax_kernel, grid, None, x, partial, r, c, rows_per, *strides, BLOCK_R=block_r,
               BLOCK_C=block_c, num_warps=warps)
        launch(quantize_cols_t_chunk_kernel, grid, None, x, partial, q, scale, r, c, rows_per, *strides, tiny,
               BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return q.view(*t.shape[:-2], c, r), scale.view(*t.shape[:-2], c)


# --- both quantizations of one 2-D tensor from two reads: an fp8 Linear's output gradient dy ---

# (BLOCK_R, BLOCK_C, num_warps) of the two kernels below, by dy's width: swept on the H100 (stop 40,
# benchmarks/experiments/h100/2026-11-26-stop40/dy/dy_tiles.json, 8 tiles at the fp8 steps' five dy shapes). 128 x 64
# was fastest from 2048 columns up (8192 x 14336: 312 us, 2258 GB/s of the two reads' bytes, against 366 for 64 x
# 128); at 1024 columns 64 x 128 was (38 against 55 us). ROWS_COLS_TILE set to a tile overrides both (the sweep).
ROWS_COLS_TILE = None
ROWS_COLS_TILE_WIDE, ROWS_COLS_TILE_NARROW, ROWS_COLS_WIDE_FROM = (128, 64, 8), (64, 128, 8), 2048


@triton.jit
def amax_rows_cols_kernel(X, RA, CA, R, C, stride_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """First read: each (row block, column block) tile's |x| max per row and per column, folded into RA (R,) and CA
    (C,) with integer atomic max on the fp32 bits (for non-negative floats the bits order as the values do, and a
    NaN's, sign cleared by the abs, order above inf: NaN spreads as in quantize_rows). RA and CA start at 0."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok, c_ok = rows < R, cols < C
    v = tl.abs(tl.load(X + rows.to(tl.int64)[:, None] * stride_r + cols[None, :], mask=r_ok[:, None] & c_ok[None, :],
                       other=0.0).to(tl.float32))
    # relaxed: nothing here reads what the atomics return, and the next launch sees them all; the default acq_rel
    # fences every one of them (PTX atom.acq_rel.gpu)
    tl.atomic_max(RA + rows, tl.reduce(v, 1, max_nan).to(tl.int32, bitcast=True), mask=r_ok, sem="relaxed")
    tl.atomic_max(CA + cols, tl.reduce(v, 0, max_nan).to(tl.int32, bitcast=True), mask=c_ok, sem="relaxed")


@triton.jit
def quantize_rows_cols_t_kernel(X, RA, CA, QR, SR, QC, SC, R, C, stride_r, tiny, BLOCK_R: tl.constexpr,
                                BLOCK_C: tl.constexpr):
    """Second read: the tile quantized both ways, QR (R, C) per row and QC (C, R) per column (transposed), with
    quantize_rows' scale and clamp (bit for bit quantize_rows(x) and quantize_cols_t(x)). The first column block
    writes the row scales, the first row block the column scales."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok, c_ok = rows < R, cols < C
    mask = r_ok[:, None] & c_ok[None, :]
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    v = tl.load(X + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rs = fp8_scale(tl.load(RA + rows, mask=r_ok, other=0).to(tl.float32, bitcast=True), tiny, X.dtype.element_ty)
    cs = fp8_scale(tl.load(CA + cols, mask=c_ok, other=0).to(tl.float32, bitcast=True), tiny, X.dtype.element_ty)
    tl.store(QR + rows64[:, None] * C + cols[None, :], e4m3_bits(fp8_clamp(v, rs[:, None])), mask=mask)
    tl.store(QC + cols64[None, :] * R + rows[:, None], e4m3_bits(fp8_clamp(v, cs[None, :])), mask=mask)
    if pid_c == 0:
        tl.store(SR + rows, rs, mask=r_ok)
    if pid_r == 0:
        tl.store(SC + cols, cs, mask=c_ok)


def quantize_rows_and_cols_t(t: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                       tuple[torch.Tensor, torch.Tensor]]:
    """(quantize_rows(t), quantize_cols_t(t)) of a 2-D t (R, C), bit for bit, from two reads of t instead of four:
    one for both amaxes, one that writes both quantizations. The fp8 Linear's backward quantizes dy both ways (its
    rows for the dgrad, its columns for the wgrad). On a GPU and in the interpreter two Triton kernels; elsewhere
    the two references."""
    if t.dim() != 2:
        raise ValueError(f"quantize_rows_and_cols_t takes a 2-D tensor, got shape {tuple(t.shape)}")
    if not (t.is_cuda or interpreting()) or t.numel() == 0:
        return quantize_rows_reference(t), quantize_cols_t_reference(t)
    x = t if t.stride(-1) == 1 else t.contiguous()
    r, c = x.shape
    ra, ca = torch.zeros(r, dtype=torch.int32, device=t.device), torch.zeros(c, dtype=torch.int32, device=t.device)
    qr = torch.empty((r, c), dtype=torch.uint8, device=t.device)  # e4m3 bits (e4m3_bits), viewed as fp8 below
    qc = torch.empty((c, r), dtype=torch.uint8, device=t.device)
    sr = torch.empty(r, dtype=torch.float32, device=t.device)
    sc = torch.empty(c, dtype=torch.float32, device=t.device)
    block_r, block_c, warps = ROWS_COLS_TILE or (ROWS_COLS_TILE_WIDE if c >= ROWS_COLS_WIDE_FROM
                                                 else ROWS_COLS_TILE_NARROW)
    grid = (triton.cdiv(r, block_r), triton.cdiv(c, block_c))
    launch(amax_rows_cols_kernel, grid, None, x, ra, ca, r, c, x.stride(0), BLOCK_R=block_r, BLOCK_C=block_c,
           num_warps=warps)
    launch(quantize_rows_cols_t_kernel, grid, None, x, ra, ca, qr, sr, qc, sc, r, c, x.stride(0),
           torch.finfo(t.dtype).tiny, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return (qr.view(torch.float8_e4m3fn), sr), (qc.view(torch.float8_e4m3fn), sc)


SEGMENT_PAD = 128  # quantize_segments_t pads each expert's segment to this many rows: the fp8 wgrad's K steps


def padded_offsets(offs: torch.Tensor, pad: int = SEGMENT_PAD) -> torch.Tensor:
    """Each expert's first column in quantize_segments_t's padded layout (E + 1 int32, on the device)."""
    counts = (offs[1:] - offs[:-1]).long()
    padded = (counts + pad - 1) // pad * pad
    return torch.cat([padded.new_zeros(1), padded.cumsum(0)]).to(torch.int32)


def quantize_segments_t_reference(x, offs, idx=None, row_scale=None, pad: int = SEGMENT_PAD):
    """quantize_segments_t in torch ops (one expert at a time; the host reads the offsets): each segment's rows
    (gathered, scaled and rounded to x's dtype as the kernel does) quantized per column by
    `quantize_rows_reference` of its transpose."""
    rows = x if idx is None else x[idx]
    if row_scale is not None:
        rows = (rows.float() * row_scale.float()[:, None]).to(x.dtype)
    bounds = offs.tolist()
    e, c = len(bounds) - 1, x.shape[1]
    poffs = padded_offsets(offs, pad)
    q = torch.zeros((c, _segments_width(rows.shape[0], e, pad)), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((e, c), dtype=torch.float32, device=x.device)
    for i in range(e):
        seg = rows[bounds[i]:bounds[i + 1]]
        if seg.shape[0] == 0:  # an empty expert: the kernel's scale of an all-zero column
            scale[i] = torch.finfo(x.dtype).tiny
            continue
        qi, si = quantize_rows_reference(seg.transpose(0, 1))
        p0 = int(poffs[i])
        q[:, p0:p0 + seg.shape[0]] = qi
        scale[i] = si
    return q, scale, poffs


def _segments_width(rows: int, experts: int, pad: int) -> int:
    """Columns of quantize_segments_t's output: the padded segments' upper bound, rounded to 16 bytes."""
    return (rows + experts * (pad - 1) + 15) // 16 * 16


def quantize_segments_t(x, offs, idx=None, row_scale=None, pad: int = SEGMENT_PAD, poffs=None):
    """The fp8 wgrad's operand: per expert segment [offs[e], offs[e + 1]) of x's rows (x[idx[r]] for row r with
    `idx`, times row_scale[r] with `row_scale`, rounded to x's dtype), each column quantized to float8_e4m3fn with
    its amax over the segment mapped to 448, and written transposed, K-contiguous: (q (C, W), scale (E, C) fp32,
    poffs (E + 1,) int32), segment e in q[:, poffs[e]:poffs[e] + its rows], zeros up to poffs[e + 1] (a multiple
    of `pad`). An empty expert has no columns and the smallest normal as its scales. No host sync: W is the
    padded segments' upper bound. `poffs`: padded_offsets(offs, pad), when the caller has it already. On a GPU
    one Triton kernel; elsewhere `quantize_segments_t_reference`."""
    if not x.is_cuda:
        return quantize_segments_t_reference(x, offs, idx, row_scale, pad)
    rows = x.shape[0] if idx is None else idx.shape[0]
    e, c = offs.shape[0] - 1, x.shape[1]
    poffs = padded_offsets(offs, pad) if poffs is None else poffs
    # read by index in the kernel, without strides
    offs, poffs, idx, row_scale = (None if t is None else t.contiguous() for t in (offs, poffs, idx, row_scale))
    q = torch.empty((c, _segments_width(rows, e, pad)), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((e, c), dtype=torch.float32, device=x.device)
    block_c = min(64, next_pow2(c))
    launch(
        quantize_segments_t_kernel, (triton.cdiv(c, block_c), e), None, x, idx if idx is not None else offs,
        row_scale if row_scale is not None else scale, q, scale, offs, poffs, c, x.stride(0), x.stride(1), q.stride(0), torch.finfo(x.dtype).tiny,
        GATHER=idx is not None, HAS_SCALE=row_scale is not None, BLOCK_R=128, BLOCK_C=block_c, num_warps=8)
    return q, scale, poffs


@triton.jit
def mx_dequant(q, codes, R: tl.constexpr, C: tl.constexpr, KEEP_FP32: tl.constexpr):
    """An (R, C) MXFP8 tile (e4m3 q, E8M0 codes (R, C / 32)) as bfloat16 (exact: a 4-bit significand times a
    power of two), or fp32 with KEEP_FP32 (the interpreter's dots, which multiply bf16 as integers)."""
    v = q.to(tl.float32).reshape(R, C // 32, 32) * e8m0_to_fp32(codes)[:, :, None]
    v = v.reshape(R, C)
    if KEEP_FP32:
        return v
    return v.to(tl.bfloat16)


# --- quantized copies of weights, kept while a `keep_quantized_weights` block is open ---

_KEEP = [0]  # open keep_quantized_weights blocks
_KEPT: dict = {}  # (id(weight), format) -> (weakref to the weight, (version, data_ptr, shape, strides), (q, scales))


@contextlib.contextmanager
def keep_quantized_weights():
    """Inside the block, the fp8 / MXFP8 MoE paths quantize each expert weight once and reuse the copy for as long
    as the weight is unchanged, instead of once per call (at DeepSeek-V3's 256 experts that is 11.3 GB of fp8
    copies made per forward). A weight counts as changed when its version counter moves (any in-place update
    through autograd-visible ops: optimizers, ``copy_`` under no_grad, ``load_state_dict``), its storage or its
    layout changes. Writes through ``.data`` bypass the version counter: call `drop_quantized_weights` after
    them. The copies cost one byte per weight element (plus the scales) and are dropped when the block closes or
    the weight is freed."""
    _KEEP[0] += 1
    try:
        yield
    finally:
        _KEEP[0] -= 1
        if not _KEEP[0]:
            _KEPT.clear()


def drop_quantized_weights() -> None:
    """Forget every quantized weight `keep_quantized_weights` holds."""
    _KEPT.clear()


def quantized_weight(w: torch.Tensor, fmt: str):
    """(q, scales) of w for fmt "fp8" (`quantize_rows`), "fp8_t" (`quantize_cols_t`: the transposed copy) or
    "mxfp8" (`mxfp8_quantize`), or (its MXFP8 values dequantized to bf16, None) for "mxfp8_bf16"; reused from an earlier call inside `keep_quantized_weights` while
    w is unchanged."""
    quantize = {"fp8": quantize_rows, "fp8_t": quantize_cols_t, "mxfp8": quantize_fwd,
                "mxfp8_bf16": lambda t: (dequantize_fwd(*quantize_fwd(t), torch.bfloat16), None)}[fmt]
    if not _KEEP[0] or torch.is_inference(w):  # inference tensors have no version counter to watch
        return quantize(w)
    stamp = (w._version, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device)
    key = (id(w), fmt)
    hit = _KEPT.get(key)
    if hit is not None and hit[0]() is w and hit[1] == stamp:
        return hit[2]
    _KEPT.pop(key, None)  # the stale copy goes before the new one is made
    q = quantize(w)
    _KEPT[key] = (weakref.ref(w, lambda _ref, key=key: _KEPT.pop(key, None)), stamp, q)
    return q
