"""RMSNorm's Triton kernels: the forward in registers (with the fp8 rows of its output when asked), looped, and on
cooperative rows; the persistent fused backward, its column-strip and cooperative-row forms. The launchers, the
op's declaration and the size limits that pick a kernel are in the package's `__init__`."""

from __future__ import annotations

import triton
import triton.language as tl

from ...runtime import autotune, prune_row_tiles, row_tile_configs
from .._coop import coop_chunk, coop_exchange, coop_row
from ..gemm.fp8 import e4m3_bits, fp8_clamp, fp8_scale, max_nan


@autotune(row_tile_configs(), key=["N", "HAS_WEIGHT", "HAS_RESIDUAL", "QUANT"],
          prune_configs_by={"early_config_prune": prune_row_tiles(64)})
@triton.jit
def rms_norm_fwd_kernel(X, R, S, W, Y, RSTD, Q, QS, stride_x, stride_r, stride_s, stride_y, stride_q, M, N, eps,
                        offset, tiny, HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
                        BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # Pre-norm block: s = x + residual is the next residual stream. It is rounded to its dtype
        # before the norm sees it, exactly as the unfused code does.
        r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(S.dtype.element_ty)
        tl.store(S + rows64[:, None] * stride_s + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32) + offset
        y = y * w[None, :]
    y = y.to(Y.dtype.element_ty)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y, mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    if QUANT:
        # The fp8 GEMMs' operand, from the rounded y still in registers: quantize_rows(y) bit for bit (its scale
        # and clamp), without reading y back. Padding columns hold y = 0 and cannot raise the amax.
        yf = y.to(tl.float32)
        scale = fp8_scale(tl.reduce(tl.abs(yf), 1, max_nan), tiny, Y.dtype.element_ty)
        q = e4m3_bits(fp8_clamp(yf, scale[:, None]))
        tl.store(Q + rows64[:, None] * stride_q + cols[None, :], q, mask=mask)
        tl.store(QS + rows, scale, mask=row_ok)


@triton.jit
def rms_norm_fwd_looped_kernel(X, R, S, W, Y, RSTD, stride_x, stride_r, stride_s, stride_y, N, eps, offset,
                               HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = X + row * stride_x, Y + row * stride_y
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s = (x + tl.load(R + row * stride_r + cols, mask=cols < N, other=0.0).to(tl.float32))
            s = s.to(S.dtype.element_ty)
            tl.store(S + row * stride_s + cols, s, mask=cols < N)
            x = s.to(tl.float32)
        acc += x * x
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / N + eps)
    # Second pass re-reads the row (the sum, when fused with the residual add); one row is small
    # enough to be served mostly from L2.
    src_row = S + row * stride_s if HAS_RESIDUAL else x_row
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(src_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = x * rstd
        if HAS_WEIGHT:
            y = y * (tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32) + offset)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=cols < N)
    tl.store(RSTD + row, rstd)


# The backward holds x, dy and their products per element: spilling starts past ~32 per thread.
@autotune(row_tile_configs(warps=(4, 8, 16)), key=["N", "HAS_WEIGHT", "HAS_DS"],
          prune_configs_by={"early_config_prune": prune_row_tiles(32)})
@triton.jit
def rms_norm_bwd_kernel(DY, X, W, RSTD, DS, DX, DW_PARTIAL, stride_dy, stride_x, stride_ds, stride_dx, M, N, offset,
                        HAS_WEIGHT: tl.constexpr, HAS_DS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                        STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Persistent: program pid owns row blocks pid, pid + G, ... and keeps its dw share in registers.
    for start in tl.range(pid * ROWS, M, tl.num_programs(0) * ROWS, num_stages=STAGES):
        rows = start + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        wdy = dy * w[None, :] if HAS_WEIGHT else dy
        c = tl.sum(xhat * wdy, axis=1) / N
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        if HAS_DS:  # gradient arriving along the residual stream of a fused add + norm
            dx += tl.load(DS + rows64[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dw += tl.sum(dy * xhat, axis=0)
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, dw, mask=col_ok)


@triton.jit
def rms_norm_bwd_row_dot_kernel(DY, X, W, RSTD, C, stride_dy, stride_x, N, offset, HAS_WEIGHT: tl.constexpr,
                                BLOCK_N: tl.constexpr):
    """c = rstd · Σ x·w·dy / N of one row, for the column-strip backward."""
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m = cols < N
        wdy = tl.load(DY + r64 * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            wdy = wdy * (tl.load(W + cols, mask=m, other=0.0).to(tl.float32) + offset)
        acc += tl.load(X + r64 * stride_x + cols, mask=m, other=0.0).to(tl.float32) * wdy
    tl.store(C + row, tl.sum(acc, axis=0) * tl.load(RSTD + row) / N)


@triton.jit
def rms_norm_bwd_strip_kernel(DY, X, W, RSTD, C, DS, DX, DW_PARTIAL, stride_dy, stride_x, stride_ds, stride_dx, M, N,
                              rows_per_group, offset, HAS_WEIGHT: tl.constexpr, HAS_DS: tl.constexpr,
                              BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # Last row group first: the rows the row-sum kernel read last may still be in L2.
    group = tl.num_programs(1) - 1 - tl.program_id(1)
    end = tl.minimum(M, (group + 1) * rows_per_group)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for start in range(group * rows_per_group, end, ROWS):
        rows = start + tl.arange(0, ROWS)
        row_ok = rows < end
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        c = tl.load(C + rows, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        wdy = dy * w[None, :] if HAS_WEIGHT else dy
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS + rows64[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dw += dy * xhat
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + group.to(tl.int64) * N + cols, tl.sum(dw, axis=0), mask=col_ok)


@triton.jit
def rms_norm_fwd_coop_kernel(WS, CNT, M, N, CHUNK, X, R, S, W, Y, RSTD, stride_x, stride_r, stride_s, stride_y, eps,
                             offset, HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr,
                             BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, PHASE: tl.constexpr):
    slot, g, cols, ok = coop_chunk(tl.program_id(0), N, CHUNK, SPLITS, BLOCK_C)
    groups = tl.num_programs(0) // SPLITS
    if HAS_WEIGHT:  # this chunk of the weight, loaded once for all the group's rows
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + offset
    step = 0
    row = slot
    # The next row's chunk is loaded before this row's exchange: its bytes are in flight while the group waits.
    first = ok & (row < M)
    x_next = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=first, other=0.0)
    if HAS_RESIDUAL:
        r_next = tl.load(R + row.to(tl.int64) * stride_r + cols, mask=first, other=0.0)
    while row < M:
        r64 = row.to(tl.int64)
        more = ok & (row + groups < M)
        x = x_next.to(tl.float32)
        x_next = tl.load(X + (r64 + groups) * stride_x + cols, mask=more, other=0.0)
        if HAS_RESIDUAL:
            s = (x + r_next.to(tl.float32)).to(S.dtype.element_ty)
            r_next = tl.load(R + (r64 + groups) * stride_r + cols, mask=more, other=0.0)
            if PHASE != 2:
                tl.store(S + r64 * stride_s + cols, s, mask=ok)
            x = s.to(tl.float32)
        part = tl.sum(x * x, axis=0)
        sq, _unused, _ok = coop_exchange(WS, CNT, slot, row, g, step, part, part, SPLITS, BLOCK_S, PHASE)
        if PHASE != 1:
            rstd = tl.math.rsqrt(tl.sum(sq, axis=0) / N + eps)
            y = x * rstd
            if HAS_WEIGHT:
                y = y * w
            tl.store(Y + r64 * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)
            tl.store(RSTD + row, rstd, mask=g == 0)
        row += groups
        step += 1


@triton.jit
def rms_norm_bwd_coop_kernel(WS, CNT, M, N, CHUNK, DY, X, W, RSTD, DS, DX, DW_PARTIAL, stride_dy, stride_x,
                             stride_ds, stride_dx, offset, HAS_WEIGHT: tl.constexpr, HAS_DS: tl.constexpr,
                             SPLITS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, PHASE: tl.constexpr):
    slot, g, cols, ok = coop_chunk(tl.program_id(0), N, CHUNK, SPLITS, BLOCK_C)
    groups = tl.num_programs(0) // SPLITS
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_C], dtype=tl.float32)  # the group's share of dweight over its rows, this chunk
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
        xhat = x * rstd
        wdy = dy * w if HAS_WEIGHT else dy
        part = tl.sum(xhat * wdy, axis=0)
        cs, _unused, _ok = coop_exchange(WS, CNT, slot, row, g, step, part, part, SPLITS, BLOCK_S, PHASE)
        if PHASE != 1:
            c = tl.sum(cs, axis=0) / N
            dx = (wdy - xhat * c) * rstd
            if HAS_DS:
                dx += tl.load(DS + r64 * stride_ds + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(DX + r64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=ok)
            if HAS_WEIGHT:
                dw += dy * xhat
        row += groups
        step += 1
    if HAS_WEIGHT and PHASE != 1:
        tl.store(DW_PARTIAL + slot.to(tl.int64) * N + cols, dw, mask=ok)
