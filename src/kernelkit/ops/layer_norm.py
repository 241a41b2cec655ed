"""LayerNorm: y = (x - mean) * rstd * w + b over the last dim, forward and backward.

The same plan as RMSNorm (ops/rms_norm/): rows in registers, several per program when short, cooperative
rows (ops/_coop.py) past MAX_FUSED_N for fp32 rows (COOP_DTYPES), else a looped two-pass kernel; a persistent backward whose programs keep their
share of dweight and dbias in registers, finished by a column sum. The backward needs mean and
rstd per row (8 bytes a row, saved by the forward) to rebuild xhat without a second statistics pass.
Holding dw and db as well as w in registers makes the fused backward's limit MAX_FUSED_BWD_N, lower
than the forward's; past it a column-strip backward (`WideBackward`, as RMSNorm's) takes the rows:
a per-row sum, then strips of columns that keep their share of dw and db in registers.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..roofline.model import Cost, dtype_key
from ..runtime.alloc import empty, empty_like
from ..runtime import autotune, cdiv, interpreting, launch, next_pow2, num_sms, prune_row_tiles, row_tile_configs
from . import _coop, _validate
from ._coop import coop_chunk, coop_exchange, coop_row
from .registry import OpSpec, optional_import, register
from ._dispatch import Op, reference_vjp
from ._norm_common import FusedBackward, WideBackward, column_sum, fused_backward, validate_trailing

# Longest row the forward holds in registers; longer rows take the looped kernels.
MAX_FUSED_N = 32768
# The fused backward also keeps w, dw and db (3 fp32 rows) in registers: at 16384 ptxas spills
# ~1.4 KB a thread, and at 32768 no row tile fits 32 elements a thread at all. Longer rows take a
# wide-row backward (WideBackward in ops/_norm_common.py).
MAX_FUSED_BWD_N = 8192
LOOP_BLOCK_N = 4096
# The fused backward by row block, as RMSNorm's (ops/rms_norm FUSED_BWD). H100, bf16, 128 MB inputs, backward
# µs, 8 vs 2 programs per SM (benchmarks/experiments/h100/2026-11-25-norm-bwd-candidates): 280 vs 369 at 256
# columns, 278 vs 341 at 1024, 275 vs 239 and 344 (two readings of one design) at 512, where torch.compile's 180
# beats both: a loss that remains.
FUSED_BWD = (FusedBackward(1024, 8, min_rows=32), FusedBackward(2048, 2), FusedBackward(MAX_FUSED_N, 1))
# The column-strip backward of wide rows; on the H100 at 16K-64K columns (norm_width_sweep.json) 1630 GB/s in
# bf16 and 1690 in fp32, where the looped kernel before it ran 590-1200. Tests and benchmarks set others.
WIDE_BWD = WideBackward(4.0, 4, 512, 4)
# Cooperative rows (ops/_coop.py), as RMSNorm's: past MAX_FUSED_N (forward) and MAX_FUSED_BWD_N (backward) each row
# is split over programs that hold their chunk in registers and exchange (mean, M2) of the chunk (forward: Chan's
# merge, no cancellation for rows with a large mean) or the two row sums of the backward: one read, one write.
# Measured on the H100 (benchmarks/coop_configs.py, width_sweep.py; 2026-11-26-width-sweep): for fp32 rows they
# beat the looped forward and the strips (backward 1854-1998 GB/s at 16K-64K columns against 1686 for the strips);
# for 16-bit rows they lost both ways (forward 1456-1805 vs 1796 at 64K, backward 1107-1508 vs 1622: with x, dy, w,
# dw and db per element in registers one SM holds too few programs), so COOP_DTYPES leaves 16-bit rows to those.
COOP = True
COOP_DTYPES = (torch.float32,)
COOP_CHUNK = 4096
COOP_BWD_CHUNK = 2048
COOP_WARPS = 8
COOP_PER_SM = 3


@autotune(row_tile_configs(), key=["N", "HAS_WEIGHT", "HAS_BIAS"],
          prune_configs_by={"early_config_prune": prune_row_tiles(64)})
@triton.jit
def layer_norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, M, N, eps,
                          HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                          ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    # Centre before squaring (not E[x²] - mean²): no cancellation for rows with a large mean.
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    y = xc * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def layer_norm_fwd_looped_kernel(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, N, eps,
                                 HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = X + row * stride_x, Y + row * stride_y
    # Welford-free two-level sums: per-lane sums, then shifted by the first chunk's mean to keep the
    # variance free of cancellation when |mean| >> std.
    cols0 = tl.arange(0, BLOCK_N)
    x0 = tl.load(x_row + cols0, mask=cols0 < N, other=0.0).to(tl.float32)
    shift = tl.sum(x0, axis=0) / tl.minimum(N, BLOCK_N)
    s1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        d = tl.where(cols < N, x - shift, 0.0)
        s1 += d
        s2 += d * d
    m1 = tl.sum(s1, axis=0) / N
    mean = shift + m1
    rstd = tl.math.rsqrt(tl.maximum(tl.sum(s2, axis=0) / N - m1 * m1, 0.0) + eps)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        y = (tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32) - mean) * rstd
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=m)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def layer_norm_fwd_coop_kernel(WS, CNT, M, N, CHUNK, X, W, B, Y, MEAN, RSTD, stride_x, stride_y, eps,
                               HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr,
                               BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, PHASE: tl.constexpr):
    slot, g, cols, ok = coop_chunk(tl.program_id(0), N, CHUNK, SPLITS, BLOCK_C)
    groups = tl.num_programs(0) // SPLITS
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(B + cols, mask=ok, other=0.0).to(tl.float32)
    n_g = tl.minimum(CHUNK, N - g * CHUNK).to(tl.float32)  # this chunk's columns
    splits = tl.arange(0, BLOCK_S)
    n_all = tl.maximum(tl.minimum(CHUNK, N - splits * CHUNK), 0).to(tl.float32)  # every chunk's (0 past SPLITS)
    step = 0
    row = slot
    x_next = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=ok & (row < M), other=0.0)
    while row < M:  # the next row prefetched before this row's exchange, as RMSNorm's
        r64 = row.to(tl.int64)
        x = x_next.to(tl.float32)
        x_next = tl.load(X + (r64 + groups) * stride_x + cols, mask=ok & (row + groups < M), other=0.0)
        mean_g = tl.sum(x, axis=0) / n_g
        xc = tl.where(ok, x - mean_g, 0.0)
        means, m2s, part_ok = coop_exchange(WS, CNT, slot, row, g, step, mean_g, tl.sum(xc * xc, axis=0), SPLITS,
                                            BLOCK_S, PHASE)
        if PHASE != 1:
            mean = tl.sum(n_all * means, axis=0) / N
            d = tl.where(part_ok, means - mean, 0.0)
            rstd = tl.math.rsqrt(tl.sum(m2s + n_all * d * d, axis=0) / N + eps)
            y = (x - mean) * rstd
            if HAS_WEIGHT:
                y = y * w
            if HAS_BIAS:
                y = y + b
            tl.store(Y + r64 * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)
            tl.store(MEAN + row, mean, mask=g == 0)
            tl.store(RSTD + row, rstd, mask=g == 0)
        row += groups
        step += 1


@triton.jit
def layer_norm_bwd_coop_kernel(WS, CNT, M, N, CHUNK, DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, stride_dy,
                               stride_x, stride_dx, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                               SPLITS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
                               PHASE: tl.constexpr):
    slot, g, cols, ok = coop_chunk(tl.program_id(0), N, CHUNK, SPLITS, BLOCK_C)
    groups = tl.num_programs(0) // SPLITS
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_C], dtype=tl.float32)  # the group's shares of dweight and dbias, this chunk
    db = tl.zeros([BLOCK_C], dtype=tl.float32)
    step = 0
    row = slot
    x_next = coop_row(X, row, stride_x, cols, ok, M)
    dy_next = coop_row(DY, row, stride_dy, cols, ok, M)
    while row < M:
        r64 = row.to(tl.int64)
        x = x_next.to(tl.float32)
        dy = dy_next.to(tl.float32)
        x_next = coop_row(X, row + groups, stride_x, cols, ok, M)
        dy_next = coop_row(DY, row + groups, stride_dy, cols, ok, M)
        rstd = tl.load(RSTD + row)
        xhat = tl.where(ok, (x - tl.load(MEAN + row)) * rstd, 0.0)
        wdy = dy * w if HAS_WEIGHT else dy
        c1s, c2s, _ok = coop_exchange(WS, CNT, slot, row, g, step, tl.sum(xhat * wdy, axis=0), tl.sum(wdy, axis=0),
                                      SPLITS, BLOCK_S, PHASE)
        if PHASE != 1:
            c1 = tl.sum(c1s, axis=0) / N
            c2 = tl.sum(c2s, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
            tl.store(DX + r64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=ok)
            if HAS_WEIGHT:
                dw += dy * xhat
            if HAS_BIAS:
                db += dy
        row += groups
        step += 1
    if HAS_WEIGHT and PHASE != 1:
        tl.store(DW_PARTIAL + slot.to(tl.int64) * N + cols, dw, mask=ok)
    if HAS_BIAS and PHASE != 1:
        tl.store(DB_PARTIAL + slot.to(tl.int64) * N + cols, db, mask=ok)


@autotune(row_tile_configs(warps=(4, 8, 16)), key=["N", "HAS_WEIGHT", "HAS_BIAS"],
          prune_configs_by={"early_config_prune": prune_row_tiles(32)})
@triton.jit
def layer_norm_bwd_kernel(DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, stride_dy, stride_x, stride_dx, M, N,
                          HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                          ROWS: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in tl.range(pid * ROWS, M, tl.num_programs(0) * ROWS, num_stages=STAGES):
        rows = start + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w[None, :] if HAS_WEIGHT else dy
        c1 = tl.sum(xhat * wdy, axis=1) / N
        c2 = tl.sum(wdy, axis=1) / N
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, dw, mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid.to(tl.int64) * N + cols, db, mask=col_ok)


@triton.jit
def layer_norm_bwd_row_dot_kernel(DY, X, W, MEAN, RSTD, C, stride_dy, stride_x, N, HAS_WEIGHT: tl.constexpr,
                                  BLOCK_N: tl.constexpr):
    """c1 = Σ xhat·w·dy / N and c2 = Σ w·dy / N of one row, for the column-strip backward (C: (rows, 2))."""
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    mean = tl.load(MEAN + row)
    a1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        xc = tl.where(m, tl.load(X + r64 * stride_x + cols, mask=m, other=0.0).to(tl.float32) - mean, 0.0)
        wdy = tl.load(DY + r64 * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            wdy = wdy * tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        a1 += xc * wdy
        a2 += wdy
    tl.store(C + 2 * r64, tl.sum(a1, axis=0) * tl.load(RSTD + row) / N)
    tl.store(C + 2 * r64 + 1, tl.sum(a2, axis=0) / N)


@triton.jit
def layer_norm_bwd_strip_kernel(DY, X, W, MEAN, RSTD, C, DX, DW_PARTIAL, DB_PARTIAL, stride_dy, stride_x, stride_dx,
                                M, N, rows_per_group, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                                BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # Last row group first: the rows the row-sum kernel read last may still be in L2.
    group = tl.num_programs(1) - 1 - tl.program_id(1)
    end = tl.minimum(M, (group + 1) * rows_per_group)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for start in range(group * rows_per_group, end, ROWS):
        rows = start + tl.arange(0, ROWS)
        row_ok = rows < end
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        c1 = tl.load(C + 2 * rows64, mask=row_ok, other=0.0)
        c2 = tl.load(C + 2 * rows64 + 1, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w[None, :] if HAS_WEIGHT else dy
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dw += dy * xhat
        if HAS_BIAS:
            db += dy
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + group.to(tl.int64) * N + cols, tl.sum(dw, axis=0), mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + group.to(tl.int64) * N + cols, tl.sum(db, axis=0), mask=col_ok)


def _validate_param(t, name, x):
    if t is None:
        return None
    if isinstance(t, (tuple, list, torch.Size)):
        raise TypeError(f"{name} is a {type(t).__name__}: kernelkit.layer_norm(x, weight, bias, eps) normalizes "
                        f"the last dim and takes no normalized_shape (F.layer_norm's second argument); "
                        f"pass weight and bias by keyword")
    _validate.tensor(t, name)
    _validate.same_device(t, name, x, "x")
    return _validate.vector(t, name, x.shape[-1])


def _validate_inputs(x, weight, bias, eps):
    """Checks the arguments; returns weight and bias as the kernels index them (unit stride)."""
    _validate.tensor(x, "x", min_dim=1)
    _validate.number(eps, "eps", low=0.0)
    return _validate_param(weight, "weight", x), _validate_param(bias, "bias", x)


def layer_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward. Returns (y, mean, rstd); mean and rstd are fp32 of shape x.shape[:-1]. Its signature is
    the schema of kernelkit::layer_norm."""
    weight, bias = _validate_inputs(x, weight, bias, eps)
    n = x.shape[-1]
    y = empty_like(x)
    mean = empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, mean.zero_(), rstd.fill_(1.0 / math.sqrt(eps) if eps > 0 else float("inf"))
    x2, y2 = _validate.rows_2d(x, n), y.view(-1, n)
    m = x2.shape[0]
    w = weight if weight is not None else x2  # dummies, never read
    b = bias if bias is not None else x2
    flags = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None)
    if n <= MAX_FUSED_N:
        grid = lambda meta: (cdiv(m, meta["ROWS"]),)  # noqa: E731
        launch(layer_norm_fwd_kernel, grid, (n, *flags.values(), x.dtype, w.dtype, b.dtype),
               x2, w, b, y2, mean, rstd, x2.stride(0), y2.stride(0), m, n, eps, **flags,
               BLOCK_N=next_pow2(n))
    elif not (COOP and x.dtype in COOP_DTYPES and _coop.launch_rows(layer_norm_fwd_coop_kernel, m, n, COOP_CHUNK,
                                         (x2, w, b, y2, mean, rstd, x2.stride(0), y2.stride(0), eps),
                                         dict(flags, num_warps=COOP_WARPS), x.device, per_sm=COOP_PER_SM)):
        launch(layer_norm_fwd_looped_kernel, (m,), None, x2, w, b, y2, mean, rstd, x2.stride(0), y2.stride(0), n, eps,
               **flags, BLOCK_N=LOOP_BLOCK_N, num_warps=8)
    return y, mean, rstd


def _wide_bwd(cfg: WideBackward, sms, m, n, dy2, x2, w, mean, rstd, dx2, has_w, has_b):
    """Launch the wide-row backward `cfg` describes; returns its dw and db partials (row groups, n)."""
    c = empty((m, 2), dtype=torch.float32, device=x2.device)
    launch(layer_norm_bwd_row_dot_kernel, (m,), None, dy2, x2, w, mean, rstd, c, dy2.stride(0), x2.stride(0), n,
           HAS_WEIGHT=has_w, BLOCK_N=LOOP_BLOCK_N, num_warps=8)
    strips, groups, per_group = cfg.row_groups(sms, m, n)
    dw_part = empty((groups, n), dtype=torch.float32, device=x2.device) if has_w else x2
    db_part = empty((groups, n), dtype=torch.float32, device=x2.device) if has_b else x2
    launch(layer_norm_bwd_strip_kernel, (strips, groups), None, dy2, x2, w, mean, rstd, c, dx2, dw_part, db_part,
           dy2.stride(0), x2.stride(0), dx2.stride(0), m, n, per_group, HAS_WEIGHT=has_w, HAS_BIAS=has_b,
           BLOCK_N=cfg.block_n, ROWS=cfg.rows, num_warps=cfg.num_warps)
    return dw_part, db_part


def _coop_bwd(m, n, dy2, x2, w, mean, rstd, dx2, has_w, has_b):
    """Launch the cooperative backward; returns its (groups, n) dw and db partials, or None where it does not
    apply (nothing launched)."""
    parts = []

    def args(groups):
        new = lambda on: empty((groups, n), dtype=torch.float32, device=x2.device) if on else x2  # noqa: E731
        parts[:] = [new(has_w), new(has_b)]
        return (dy2, x2, w, mean, rstd, dx2, *parts, dy2.stride(0), x2.stride(0), dx2.stride(0))

    ok = _coop.launch_rows(layer_norm_bwd_coop_kernel, m, n, COOP_BWD_CHUNK, args,
                           {"HAS_WEIGHT": has_w, "HAS_BIAS": has_b, "num_warps": COOP_WARPS}, x2.device,
                           per_sm=COOP_PER_SM)
    return tuple(parts) if ok else None


def layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward. Returns (dx, dw, db); dw/db are empty when there is no weight/bias. Its signature is
    the schema of kernelkit::layer_norm_bwd."""
    n = x.shape[-1]
    dx = empty_like(x)
    has_w, has_b = weight is not None, bias is not None
    weight = _validate.vector(weight, "weight", n) if has_w else None
    bias = _validate.vector(bias, "bias", n) if has_b else None
    none = x.new_empty(0)
    if x.numel() == 0:
        zeros = lambda t: torch.zeros(n, dtype=t.dtype, device=x.device)  # noqa: E731
        return dx, (zeros(weight) if has_w else none), (zeros(bias) if has_b else none)
    x2, dy2, dx2 = _validate.rows_2d(x, n), _validate.rows_2d(dy, n), dx.view(-1, n)
    m = x2.shape[0]
    mean, rstd = mean.reshape(-1).contiguous(), rstd.reshape(-1).contiguous()
    w = weight if has_w else x2
    sms = num_sms(x.device)
    flags = dict(HAS_WEIGHT=has_w, HAS_BIAS=has_b)
    strides = (dy2.stride(0), x2.stride(0), dx2.stride(0))
    if n <= min(MAX_FUSED_N, MAX_FUSED_BWD_N):
        block_n = next_pow2(n)
        cfg = fused_backward(FUSED_BWD, block_n, m, sms)
        programs = cfg.programs(sms, m)
        dw_part = torch.empty((programs, n), dtype=torch.float32, device=x.device) if has_w else x2
        db_part = torch.empty((programs, n), dtype=torch.float32, device=x.device) if has_b else x2
        launch(layer_norm_bwd_kernel, (programs,), (n, has_w, has_b, x.dtype, dy.dtype, w.dtype), dy2, x2, w, mean,
               rstd, dx2, dw_part, db_part, *strides, m, n, **flags, BLOCK_N=block_n, STAGES=cfg.stages)
    else:
        coop = COOP and x.dtype in COOP_DTYPES
        parts = _coop_bwd(m, n, dy2, x2, w, mean, rstd, dx2, has_w, has_b) if coop else None
        dw_part, db_part = parts or _wide_bwd(WIDE_BWD, sms, m, n, dy2, x2, w, mean, rstd, dx2, has_w, has_b)
    dw = column_sum(dw_part, weight, sms) if has_w else none
    db = column_sum(db_part, bias, sms) if has_b else none
    return dx, dw, db


# --- the op, declared once: one graph node under torch.compile, autograd through the backward kernel ---

def _fake(x, weight, bias, eps):
    stat = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape), stat, stat.new_empty(stat.shape)


def _bwd_fake(dy, x, weight, bias, mean, rstd):
    none = x.new_empty(0)
    return (x.new_empty(x.shape), weight.new_empty(weight.shape) if weight is not None else none,
            bias.new_empty(bias.shape) if bias is not None else none)


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.eps = eps


def _backward(ctx, kernels, dy):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = kernels.bwd(dy, x, weight, bias, mean, rstd)
    return dx, (dw if weight is not None else None), (db if bias is not None else None), None


def _double_backward(ctx, dy):
    x, weight, bias, _, _ = ctx.saved_tensors
    return reference_vjp(reference, (x, weight, bias, ctx.eps), (dy,))


LAYER_NORM = Op("layer_norm", layer_norm_fwd, fake=_fake, setup_context=_setup_context, backward=_backward,
                bwd=layer_norm_bwd, bwd_fake=_bwd_fake, double_backward=_double_backward, n_grad=3, public=0)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    x: (..., N) fp32/bf16/fp16, any strides; weight, bias: (N,) or None, of any of those dtypes (fp32
    parameters with bf16 activations are fine). One kernel computes the fp32 mean and rstd, normalizes
    and applies the affine; y has x's dtype, rounded once. Differentiable in x, weight and bias: one
    backward kernel writes dx and per-program dweight/dbias partials, summed by a second (in the
    parameters' dtypes).
    """
    for name, t in (("weight", weight), ("bias", bias)):
        if isinstance(t, (tuple, list, torch.Size)):
            _validate_param(t, name, x)
    return LAYER_NORM(x, weight, bias, _validate.number(eps, "eps", low=0.0))


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in for `torch.nn.LayerNorm` (same constructor and state_dict) running kernelkit's kernel.

    Several trailing normalized dims are flattened into one row. Documented fallback: a CPU tensor,
    outside the Triton interpreter, runs torch's own forward.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda" and not interpreting():
            return super().forward(x)
        validate_trailing(x, self.normalized_shape, type(self).__name__)
        n = math.prod(self.normalized_shape)
        w = self.weight.reshape(n) if self.weight is not None else None
        b = self.bias.reshape(n) if self.bias is not None else None
        lead = x.shape[: x.dim() - len(self.normalized_shape)]
        return layer_norm(x.reshape(*lead, n), w, b, self.eps).reshape(x.shape)


def reference(x, weight=None, bias=None, eps=1e-5):
    xf = x.float() if x.dtype != torch.float64 else x
    y = F.layer_norm(xf, (x.shape[-1],), weight.to(xf.dtype) if weight is not None else None,
                     bias.to(xf.dtype) if bias is not None else None, eps)
    return y.to(x.dtype)


def _eager(x, weight=None, bias=None, eps=1e-5):
    """What a model's own LayerNorm code does without a fused kernel: fp32 statistics, several passes."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def cost(x, weight=None, bias=None, eps=1e-5, backward=False) -> Cost:
    """Forward reads x (w, b) and writes y; backward reads x, dy (w) and writes dx (dw, db)."""
    numel, esize = x.numel(), x.element_size()
    params = sum(t.numel() * t.element_size() for t in (weight, bias) if t is not None)
    if backward:
        return Cost(flops=10.0 * numel, bytes=3.0 * numel * esize + 2 * params, dtype=dtype_key(x.dtype))
    return Cost(flops=7.0 * numel, bytes=2.0 * numel * esize + params, dtype=dtype_key(x.dtype))


def make_inputs(shape, dtype, device, generator=None):
    x = 0.5 + torch.randn(shape, dtype=dtype, device=device, generator=generator)  # a nonzero mean, as in models
    w = 1.0 + 0.1 * torch.randn(shape[-1], dtype=dtype, device=device, generator=generator)
    b = 0.1 * torch.randn(shape[-1], dtype=dtype, device=device, generator=generator)
    return (x, w, b), {"eps": 1e-5}


def _torch_layer_norm(x, weight=None, bias=None, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _liger_loader():
    fn = optional_import("liger_kernel.transformers.functional", "liger_layer_norm")()
    return None if fn is None else (lambda x, weight=None, bias=None, eps=1e-5: fn(x, weight, bias, eps))


register(OpSpec(
    name="layer_norm", fn=layer_norm, reference=reference, eager=_eager, cost=cost, make_inputs=make_inputs,
    grad_args=(0, 1, 2), test_shapes=[(3, 7), (37, 1000), (5, 4097), (2, 3, 129)],
    bench_shapes=[(4096, 4096), (16384, 2048), (16384, 4096), (8192, 8192), (16384, 8192)],
    latency_shapes=[(1, 4096)],
    competitors={"F.layer_norm": lambda: _torch_layer_norm, "liger": _liger_loader},
    replaces=("aten::layer_norm", "aten::native_layer_norm", "LayerNorm"),
    doc="LayerNorm forward+backward with optional weight and bias, fp32 statistics.",
))
