"""Softmax and log-softmax over the last dim, forward and backward, with an optional input scale.

y = softmax(scale * x) or log_softmax(scale * x). The floor is one read of x and one write of y
(forward), one read of y and dy and one write of dx (backward); the backward never needs x.

Three paths by row length N and row count M:
- N <= MAX_FUSED_N: the row sits in registers, several rows per program when short: one HBM pass.
- longer rows, many of them: one program per row, online statistics (running max and rescaled sum in
  one read), then a second sweep re-reads the row and writes y.
- longer rows, on a GPU (the default): cooperative rows (ops/_coop.py). Each row is split over a group of
  programs that hold their chunk in registers and exchange the chunk's (max, sum), forward, or dot(dy, y),
  backward: one read and one write, at any row length whose chunks the GPU holds at once.
- longer rows where that does not apply (COOP off, or a row needing more programs than are resident): one
  program per row, online statistics (running max and rescaled sum in one read), then a second sweep
  re-reads the row and writes y; with fewer rows than SPLIT_PROGRAMS_PER_SM per SM, each row is split
  into chunks: one kernel writes per-chunk (max, sum) partials, a second combines a row's partials and
  writes its chunk, walking the chunks in reverse so that it first re-reads what the first kernel read
  last, while that is still in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..roofline.model import Cost, dtype_key
from ..runtime.alloc import empty_like
from ..runtime import autotune, cdiv, launch, next_pow2, num_sms, prune_row_tiles, row_tile_configs
from . import _coop, _validate
from ._coop import coop_chunk, coop_exchange
from ._dispatch import Op
from .registry import OpSpec, optional_import, register

# Longest row held in registers by one program (32 fp32 per thread at 32 warps).
MAX_FUSED_N = 32768
# Chunk of a long row processed per loop step; split chunks are multiples of it (aligned vectors).
LOOP_BLOCK_N = 4096
# Programs per SM the split path aims for: several in flight per SM to cover HBM latency.
SPLIT_PROGRAMS_PER_SM = 4
# Cooperative rows (ops/_coop.py) for rows over MAX_FUSED_N: on, the longest chunk one program holds (forward:
# x; backward: dy and y), its warps, and the programs per SM aimed for. H100 (benchmarks/coop_configs.py, results in
# benchmarks/results/h100/coop_configs.json), GB/s fwd/bwd: fp32 1024x262144 2548/2322 against the two-pass
# kernels' 1941/1772; bf16 4096x36864 2125/2381 against 1983/1801 (2 per SM: 1888 forward); 4096-column chunks
# or 16-warp programs were slower.
COOP = True
COOP_CHUNK = 8192
COOP_BWD_CHUNK = 8192
COOP_WARPS = 8
COOP_PER_SM = 3
LOG2E = tl.constexpr(1.4426950408889634)  # a kernel may read only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)
NEG_INF = tl.constexpr(float("-inf"))


# --- fused: whole rows in registers ---

# Short rows go up to 64 per program so that even N = 32 moves a useful tile per program.
@autotune(row_tile_configs(rows=(1, 2, 4, 8, 16, 32, 64)), key=["N", "LOG"],
          prune_configs_by={"early_config_prune": prune_row_tiles(64)})
@triton.jit
def softmax_fwd_kernel(X, Y, stride_x, stride_y, M, N, scale,
                       LOG: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # Base-2 logits (scale * log2(e) folded into one multiply). Masked lanes become -inf after the
    # scale, so that a negative scale cannot turn them into +inf.
    z = tl.where(mask, x * (scale * LOG2E), NEG_INF)
    m = tl.max(z, axis=1)
    e = tl.exp2(z - m[:, None])
    s = tl.sum(e, axis=1)
    if LOG:
        y = (z - m[:, None]) * LN2 - tl.log(s)[:, None]
    else:
        y = e * (1.0 / s)[:, None]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


# The backward holds y, dy and their product per element: spilling starts past ~32 per thread.
@autotune(row_tile_configs(rows=(1, 2, 4, 8, 16, 32, 64), warps=(4, 8, 16)), key=["N", "LOG"],
          prune_configs_by={"early_config_prune": prune_row_tiles(32)})
@triton.jit
def softmax_bwd_kernel(DY, Y, DX, stride_dy, stride_y, stride_dx, M, N, scale,
                       LOG: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + rows64[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if LOG:
        dx = dy - tl.exp2(y * LOG2E) * tl.sum(dy, axis=1)[:, None]
    else:
        dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], (dx * scale).to(DX.dtype.element_ty), mask=mask)


# --- long rows: building blocks over one stretch [lo, hi) of a row ---

@triton.jit
def _online_stats(x_row, lo, hi, scale2, BLOCK_N: tl.constexpr):
    """(max, sum of 2^(z - max)) of the base-2 logits z = scale2 * x over [lo, hi), in one read of x.

    The max runs over tiles, the sum per lane, rescaled when the max grows: one exp2 per element.
    Exponents are taken against a max of 0 while the max is still -inf (nothing but -inf seen), which
    keeps -inf - -inf (NaN) out; a NaN in x reaches the sum and poisons the row, as in torch.
    """
    m = tl.max(tl.full([BLOCK_N], NEG_INF, tl.float32), axis=0)
    s = tl.zeros([BLOCK_N], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < hi
        z = tl.where(ok, tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32) * scale2, NEG_INF)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_ref = tl.where(m_new == NEG_INF, 0.0, m_new)
        s = s * tl.exp2(m - m_ref) + tl.exp2(z - m_ref)
        m = m_new
    return m, tl.sum(s, axis=0)


@triton.jit
def _merge_stats(m, s):
    """Merge per-chunk (max, sum) pairs of base-2 logits into one; -inf maxima carry nothing."""
    m_all = tl.max(m, axis=0)
    return m_all, tl.sum(s * tl.exp2(m - tl.where(m_all == NEG_INF, 0.0, m_all)), axis=0)


@triton.jit
def _write_probs(x_row, y_row, lo, hi, scale2, m, s, LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    # 2^(z - max) / sum rather than 2^(z - lse): z - max is exact near the max, where y is large.
    inv_s = 1.0 / s
    log_s = tl.log(s)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < hi
        z = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32) * scale2
        if LOG:
            y = (z - m) * LN2 - log_s
        else:
            y = tl.exp2(z - m) * inv_s
        tl.store(y_row + cols, y.to(y_row.dtype.element_ty), mask=ok)


@triton.jit
def _row_dot(dy_row, y_row, lo, hi, LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    """sum(dy * y) over [lo, hi) for softmax; sum(dy) for log-softmax (which then skips reading y)."""
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < hi
        dy = tl.load(dy_row + cols, mask=ok, other=0.0).to(tl.float32)
        if LOG:
            acc += dy
        else:
            acc += dy * tl.load(y_row + cols, mask=ok, other=0.0).to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def _write_dx(dy_row, y_row, dx_row, lo, hi, c, scale, LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < hi
        dy = tl.load(dy_row + cols, mask=ok, other=0.0).to(tl.float32)
        y = tl.load(y_row + cols, mask=ok, other=0.0).to(tl.float32)
        if LOG:
            dx = dy - tl.exp2(y * LOG2E) * c
        else:
            dx = y * (dy - c)
        tl.store(dx_row + cols, (dx * scale).to(dx_row.dtype.element_ty), mask=ok)


@triton.jit
def _chunk(pid, N, CHUNK, SPLITS):
    """Row and [lo, hi) column range of split-path program `pid` (SPLITS chunks per row)."""
    row = pid // SPLITS
    lo = (pid - row * SPLITS) * CHUNK
    return row.to(tl.int64), lo, tl.minimum(lo + CHUNK, N)


def _loop_configs():
    return [triton.Config({}, num_warps=w) for w in (8, 4, 16)]


# --- long rows, one program per row ---

@autotune(_loop_configs(), key=["N", "LOG"])
@triton.jit
def softmax_fwd_looped_kernel(X, Y, stride_x, stride_y, N, scale, LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = X + row * stride_x, Y + row * stride_y
    m, s = _online_stats(x_row, 0, N, scale * LOG2E, BLOCK_N)
    _write_probs(x_row, y_row, 0, N, scale * LOG2E, m, s, LOG, BLOCK_N)


@autotune(_loop_configs(), key=["N", "LOG"])
@triton.jit
def softmax_bwd_looped_kernel(DY, Y, DX, stride_dy, stride_y, stride_dx, N, scale,
                              LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dy_row, y_row, dx_row = DY + row * stride_dy, Y + row * stride_y, DX + row * stride_dx
    c = _row_dot(dy_row, y_row, 0, N, LOG, BLOCK_N)
    _write_dx(dy_row, y_row, dx_row, 0, N, c, scale, LOG, BLOCK_N)


# --- long rows, few of them: each row split over SPLITS programs ---

@autotune(_loop_configs(), key=["N", "SPLITS"])
@triton.jit
def softmax_fwd_partial_kernel(X, PART_M, PART_S, stride_x, N, CHUNK, SPLITS, scale, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    row, lo, hi = _chunk(pid, N, CHUNK, SPLITS)
    m, s = _online_stats(X + row * stride_x, lo, hi, scale * LOG2E, BLOCK_N)
    tl.store(PART_M + pid, m)
    tl.store(PART_S + pid, s)


@autotune(_loop_configs(), key=["N", "SPLITS", "LOG"])
@triton.jit
def softmax_fwd_split_kernel(X, Y, PART_M, PART_S, stride_x, stride_y, N, CHUNK, SPLITS, scale,
                             LOG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    # Reverse order: the chunks the partial kernel read last are the likeliest still in L2.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    row, lo, hi = _chunk(pid, N, CHUNK, SPLITS)
    parts = row * SPLITS + tl.arange(0, BLOCK_S)
    ok = tl.arange(0, BLOCK_S) < SPLITS
    m, s = _merge_stats(tl.load(PART_M + parts, mask=ok, other=NEG_INF), tl.load(PART_S + parts, mask=ok, other=0.0))
    _write_probs(X + row * stride_x, Y + row * stride_y, lo, hi, scale * LOG2E, m, s, LOG, BLOCK_N)


@autotune(_loop_configs(), key=["N", "SPLITS", "LOG"])
@triton.jit
def softmax_bwd_partial_kernel(DY, Y, PART, stride_dy, stride_y, N, CHUNK, SPLITS,
                               LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    row, lo, hi = _chunk(pid, N, CHUNK, SPLITS)
    tl.store(PART + pid, _row_dot(DY + row * stride_dy, Y + row * stride_y, lo, hi, LOG, BLOCK_N))


@autotune(_loop_configs(), key=["N", "SPLITS", "LOG"])
@triton.jit
def softmax_bwd_split_kernel(DY, Y, DX, PART, stride_dy, stride_y, stride_dx, N, CHUNK, SPLITS, scale,
                             LOG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    row, lo, hi = _chunk(pid, N, CHUNK, SPLITS)
    parts = row * SPLITS + tl.arange(0, BLOCK_S)
    c = tl.sum(tl.load(PART + parts, mask=tl.arange(0, BLOCK_S) < SPLITS, other=0.0), axis=0)
    _write_dx(DY + row * stride_dy, Y + row * stride_y, DX + row * stride_dx, lo, hi, c, scale, LOG, BLOCK_N)


# --- long rows, cooperative: each row split over a group of programs that exchange its statistics ---

@triton.jit
def softmax_fwd_coop_kernel(WS, CNT, M, N, CHUNK, X, Y, stride_x, stride_y, scale, LOG: tl.constexpr,
                            SPLITS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
                            PHASE: tl.constexpr):
    slot, g, cols, ok = coop_chunk(tl.program_id(0), N, CHUNK, SPLITS, BLOCK_C)
    groups = tl.num_programs(0) // SPLITS
    scale2 = scale * LOG2E
    step = 0
    row = slot
    # The next row's chunk is loaded (in x's dtype) before this row's exchange, so that its bytes are in flight
    # while the group waits for each other.
    x_next = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=ok & (row < M), other=0.0)
    while row < M:
        r64 = row.to(tl.int64)
        x = x_next
        x_next = tl.load(X + (r64 + groups) * stride_x + cols, mask=ok & (row + groups < M), other=0.0)
        z = tl.where(ok, x.to(tl.float32) * scale2, NEG_INF)
        m = tl.max(z, axis=0)
        s = tl.sum(tl.exp2(z - tl.where(m == NEG_INF, 0.0, m)), axis=0)
        ms, ss, part_ok = coop_exchange(WS, CNT, slot, row, g, step, m, s, SPLITS, BLOCK_S, PHASE)
        if PHASE != 1:
            m_all, s_all = _merge_stats(tl.where(part_ok, ms, NEG_INF), ss)
            if LOG:
                y = (z - m_all) * LN2 - tl.log(s_all)
            else:
                y = tl.exp2(z - m_all) * (1.0 / s_all)
            tl.store(Y + r64 * stride_y + cols, y.to(Y.dtype.element_ty), mask=ok)
        row += groups
        step += 1


@triton.jit
def softmax_bwd_coop_kernel(WS, CNT, M, N, CHUNK, DY, Y, DX, stride_dy, stride_y, stride_dx, scale,
                            LOG: tl.constexpr, SPLITS: tl.constexpr, BLOCK_C: tl.constexpr,
                            BLOCK_S: tl.constexpr, PHASE: tl.constexpr):
    slot, g, cols, ok = coop_chunk(tl.program_id(0), N, CHUNK, SPLITS, BLOCK_C)
    groups = tl.num_programs(0) // SPLITS
    step = 0
    row = slot
    first = ok & (row < M)
    dy_next = tl.load(DY + row.to(tl.int64) * stride_dy + cols, mask=first, other=0.0)
    y_next = tl.load(Y + row.to(tl.int64) * stride_y + cols, mask=first, other=0.0)
    while row < M:  # prefetching the next row as the forward does
        r64 = row.to(tl.int64)
        dy = dy_next.to(tl.float32)
        y = y_next.to(tl.float32)
        more = ok & (row + groups < M)
        dy_next = tl.load(DY + (r64 + groups) * stride_dy + cols, mask=more, other=0.0)
        y_next = tl.load(Y + (r64 + groups) * stride_y + cols, mask=more, other=0.0)
        if LOG:
            part = tl.sum(dy, axis=0)
        else:
            part = tl.sum(dy * y, axis=0)
        cs, _unused, part_ok = coop_exchange(WS, CNT, slot, row, g, step, part, part, SPLITS, BLOCK_S, PHASE)
        if PHASE != 1:
            c = tl.sum(cs, axis=0)
            if LOG:
                dx = dy - tl.exp2(y * LOG2E) * c
            else:
                dx = y * (dy - c)
            tl.store(DX + r64 * stride_dx + cols, (dx * scale).to(DX.dtype.element_ty), mask=ok)
        row += groups
        step += 1


# --- launchers ---

def _splits(m: int, n: int, device) -> tuple[int, int]:
    """(splits per row, chunk length) for rows longer than MAX_FUSED_N; splits == 1: one program per row.

    A looped program streams one tile at a time, so an SM needs several of them to keep enough bytes
    in flight: rows are split until there are about SPLIT_PROGRAMS_PER_SM programs per SM.
    """
    target = SPLIT_PROGRAMS_PER_SM * num_sms(device)
    if m >= target:
        return 1, n
    splits = min(cdiv(n, LOOP_BLOCK_N), cdiv(target, m))
    chunk = cdiv(cdiv(n, splits), LOOP_BLOCK_N) * LOOP_BLOCK_N
    return cdiv(n, chunk), chunk


def _validate_scale(scale):
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python number, got {type(scale).__name__}")


def softmax_fwd(x: torch.Tensor, scale: float, log: bool) -> torch.Tensor:
    """Launch the forward: y = (log_)softmax(scale * x) over the last dim, x's dtype and shape."""
    _validate.tensor(x, "x", min_dim=1)
    _validate_scale(scale)
    n, scale = x.shape[-1], float(scale)
    y = empty_like(x)
    if x.numel() == 0:
        return y
    x2, y2 = _validate.rows_2d(x, n), y.view(-1, n)
    m = x2.shape[0]
    if n <= MAX_FUSED_N:
        grid = lambda meta: (cdiv(m, meta["ROWS"]),)
        launch(softmax_fwd_kernel, grid, (n, log, x.dtype), x2, y2, x2.stride(0), y2.stride(0), m, n, scale,
               LOG=log, BLOCK_N=next_pow2(n))
        return y
    if COOP and _coop.launch_rows(softmax_fwd_coop_kernel, m, n, COOP_CHUNK,
                                  (x2, y2, x2.stride(0), y2.stride(0), scale), {"LOG": log, "num_warps": COOP_WARPS},
                                  x.device, per_sm=COOP_PER_SM):
        return y
    splits, chunk = _splits(m, n, x.device)
    if splits == 1:
        launch(softmax_fwd_looped_kernel, (m,), (n, log, x.dtype), x2, y2, x2.stride(0), y2.stride(0), n, scale,
               LOG=log, BLOCK_N=LOOP_BLOCK_N)
        return y
    part_m = torch.empty(m * splits, dtype=torch.float32, device=x.device)
    part_s = torch.empty(m * splits, dtype=torch.float32, device=x.device)
    grid = (m * splits,)
    launch(softmax_fwd_partial_kernel, grid, (n, splits, x.dtype), x2, part_m, part_s, x2.stride(0), n, chunk,
           splits, scale, BLOCK_N=LOOP_BLOCK_N)
    launch(softmax_fwd_split_kernel, grid, (n, splits, log, x.dtype), x2, y2, part_m, part_s, x2.stride(0),
           y2.stride(0), n, chunk, splits, scale, LOG=log, BLOCK_N=LOOP_BLOCK_N,
           BLOCK_S=next_pow2(splits))
    return y


def softmax_bwd(dy: torch.Tensor, y: torch.Tensor, scale: float, log: bool) -> torch.Tensor:
    """Launch the backward from the forward's output y: dx = scale * y * (dy - sum(dy * y)) for
    softmax, dx = scale * (dy - exp(y) * sum(dy)) for log-softmax."""
    n, scale = y.shape[-1], float(scale)
    dx = empty_like(y)
    if y.numel() == 0:
        return dx
    dy2, y2, dx2 = _validate.rows_2d(dy, n), _validate.rows_2d(y, n), dx.view(-1, n)
    m = y2.shape[0]
    strides = (dy2.stride(0), y2.stride(0), dx2.stride(0))
    if n <= MAX_FUSED_N:
        grid = lambda meta: (cdiv(m, meta["ROWS"]),)
        launch(softmax_bwd_kernel, grid, (n, log, dy.dtype, y.dtype), dy2, y2, dx2, *strides, m, n, scale,
               LOG=log, BLOCK_N=next_pow2(n))
        return dx
    if COOP and _coop.launch_rows(softmax_bwd_coop_kernel, m, n, COOP_BWD_CHUNK, (dy2, y2, dx2, *strides, scale),
                                  {"LOG": log, "num_warps": COOP_WARPS}, y.device, per_sm=COOP_PER_SM):
        return dx
    splits, chunk = _splits(m, n, y.device)
    if splits == 1:
        launch(softmax_bwd_looped_kernel, (m,), (n, log, dy.dtype, y.dtype), dy2, y2, dx2, *strides, n, scale,
               LOG=log, BLOCK_N=LOOP_BLOCK_N)
        return dx
    part = torch.empty(m * splits, dtype=torch.float32, device=y.device)
    grid = (m * splits,)
    launch(softmax_bwd_partial_kernel, grid, (n, splits, log, dy.dtype, y.dtype), dy2, y2, part, strides[0],
           strides[1], n, chunk, splits, LOG=log, BLOCK_N=LOOP_BLOCK_N)
    launch(softmax_bwd_split_kernel, grid, (n, splits, log, dy.dtype, y.dtype), dy2, y2, dx2, part, *strides, n,
           chunk, splits, scale, LOG=log, BLOCK_N=LOOP_BLOCK_N, BLOCK_S=next_pow2(splits))
    return dx


# --- the op, declared once: custom ops (torch.compile), fakes, autograd, the eager path ---

def _setup_context(ctx, inputs, output):
    _x, scale, log = inputs
    ctx.save_for_backward(output)  # only y: the backward never needs x
    ctx.scale, ctx.log = scale, log


def _backward(ctx, kernels, dy):
    (y,) = ctx.saved_tensors
    return kernels.bwd(dy, y, ctx.scale, ctx.log), None, None


def _double_backward(ctx, dy):
    """The backward in PyTorch ops, from y and dy: differentiable, for create_graph=True."""
    (y,) = ctx.saved_tensors
    yf, dyf = y.float(), dy.float()
    if ctx.log:
        dx = dyf - yf.exp() * dyf.sum(-1, keepdim=True)
    else:
        dx = yf * (dyf - (dyf * yf).sum(-1, keepdim=True))
    return (ctx.scale * dx).to(y.dtype), None, None


SOFTMAX = Op("softmax", softmax_fwd, fake=lambda x, scale, log: x.new_empty(x.shape), setup_context=_setup_context,
             backward=_backward, bwd=softmax_bwd, bwd_fake=lambda dy, y, scale, log: y.new_empty(y.shape),
             double_backward=_double_backward, n_grad=1)


def _along(x, dim, scale, log):
    """Validate the torch-style arguments, run the kernels over the last dim, with `dim` moved there."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int (the dim to normalize over), got {type(dim).__name__}; "
                        f"the scale is keyword-only: softmax(x, dim=-1, scale=...)")
    _validate_scale(scale)
    nd = max(x.dim(), 1)
    if not -nd <= dim < nd:
        raise IndexError(f"dim {dim} is out of range for a {x.dim()}-D x (expected in [{-nd}, {nd - 1}])")
    if x.dim() == 0:  # torch: a 0-d input is one row of one element
        return SOFTMAX(x.reshape(1), float(scale), log).reshape(())
    if dim % nd == nd - 1:
        return SOFTMAX(x, float(scale), log)
    # The kernels normalize the last dim: move `dim` there (the launcher copies it to unit stride) and back.
    y = SOFTMAX(x.movedim(dim, -1), float(scale), log)
    return y.movedim(-1, dim)


def softmax(x: torch.Tensor, dim: int = -1, *, scale: float = 1.0) -> torch.Tensor:
    """``softmax(scale * x, dim)``, like ``torch.softmax(x * scale, dim)``.

    x: any shape, float32/bfloat16/float16, any strides; returns x's shape and dtype. The kernels
    normalize the last dim; another `dim` is moved there (one copy of x) and back. The scale
    (attention's 1/sqrt(d), say) is fused into the load; max, exponentials and sum are fp32 and y is
    rounded once. Rows up to 32768 are held in registers; longer rows take an online kernel (split
    over several programs per row when there are fewer rows than SMs). The backward reads only y and
    dy: dx = scale * y * (dy - sum(dy * y)).
    """
    return _along(x, dim, scale, False)


def log_softmax(x: torch.Tensor, dim: int = -1, *, scale: float = 1.0) -> torch.Tensor:
    """``log_softmax(scale * x, dim)``; shapes, dtypes, dims and paths as `softmax`.

    The backward reads only y and dy: dx = scale * (dy - exp(y) * sum(dy)).
    """
    return _along(x, dim, scale, True)


def reference(x: torch.Tensor, dim: int = -1, *, scale: float = 1.0) -> torch.Tensor:
    xf = x.float() if x.dtype != torch.float64 else x
    return torch.softmax(xf * scale, dim=dim).to(x.dtype)


def log_reference(x: torch.Tensor, dim: int = -1, *, scale: float = 1.0) -> torch.Tensor:
    xf = x.float() if x.dtype != torch.float64 else x
    return torch.log_softmax(xf * scale, dim=dim).to(x.dtype)


def _eager(x, dim=-1, *, scale=1.0):
    return torch.softmax(x * scale if scale != 1.0 else x, dim=dim)


def _eager_log(x, dim=-1, *, scale=1.0):
    return torch.log_softmax(x * scale if scale != 1.0 else x, dim=dim)


def cost(x: torch.Tensor, dim: int = -1, *, scale: float = 1.0, backward: bool = False) -> Cost:
    """Ideal traffic: forward reads x, writes y; backward reads y and dy, writes dx."""
    n, b = x.numel(), x.element_size()
    return Cost(flops=(4.0 if backward else 5.0) * n, bytes=(3.0 if backward else 2.0) * n * b,
                dtype=dtype_key(x.dtype))


def make_inputs(shape, dtype, device, generator=None):
    # Logits of spread 3: peaked enough that the max subtraction matters, flat enough to keep every y finite.
    return (3.0 * torch.randn(shape, dtype=dtype, device=device, generator=generator),), {}


def _liger_loader():
    fn = optional_import("liger_kernel.transformers.functional", "liger_softmax")()
    # Liger's softmax normalizes the last dim, the only dim the benchmarks use.
    return None if fn is None else (lambda x, dim=-1, *, scale=1.0: fn(x * scale if scale != 1.0 else x))


def _quack_loader():
    """quack's softmax (CuTe DSL; `quack-kernels`, where it imports): rows of a 2-D input, autograd included."""
    fn = optional_import("quack.softmax", "softmax")()
    if fn is None:
        return None

    def quack(x, dim=-1, *, scale=1.0):
        x = x * scale if scale != 1.0 else x
        return fn(x.reshape(-1, x.shape[-1])).reshape(x.shape)

    return quack


_COMMON = {
    "cost": cost, "make_inputs": make_inputs, "grad_args": (0,),
    "test_shapes": [(1, 1), (3, 7), (37, 1000), (5, 4097), (2, 3, 129)],
    "bench_shapes": [(4096, 4096), (16384, 4096), (8192, 8192), (16384, 8192), (1024, 32768), (64, 393216)],
    "latency_shapes": [(1, 4096)],
    # Rows of 129: in 16-bit, dx = y * (dy - sum(dy * y)) of rows this short cancels to a relative error
    # near bf16's tolerance from y's rounding alone (see test_softmax), whatever the layout.
    "layout_shape": (2, 3, 129),
}
register(OpSpec(name="softmax", fn=softmax, reference=reference, eager=_eager,
                competitors={"liger": _liger_loader, "quack": _quack_loader},
                replaces=("aten::_softmax", "aten::softmax", "Softmax"),
                doc="softmax(scale * x) over the last dim, forward+backward; online, row-split kernels for long rows.",
                **_COMMON))
# Liger has no log-softmax: only the generic rows compete.
register(OpSpec(name="log_softmax", fn=log_softmax, reference=log_reference, eager=_eager_log,
                replaces=("aten::_log_softmax", "aten::log_softmax", "LogSoftmax"),
                doc="log_softmax(scale * x) over the last dim, forward+backward; same paths as softmax.",
                **_COMMON))
