"""Softmax and log-softmax over the last dim, forward and backward, with an optional input scale.

y = softmax(scale * x) or log_softmax(scale * x). The floor is one read of x and one write of y
(forward), one read of y and dy and one write of dx (backward). Rows up to MAX_FUSED_N sit in
registers, several per program when short. Longer rows (vocabularies, 393216-long attention rows)
take an online kernel: one pass keeps a running max and a rescaled running sum, a second pass writes
y; that second read is the price of a row that fits nowhere on chip.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..roofline.model import Cost, dtype_key
from ..testing.poison import empty_like
from ..tune import autotune, launch, prune_row_tiles, row_tile_configs
from . import _validate
from .registry import OpSpec, optional_import, register

MAX_FUSED_N = 32768
LOOP_BLOCK_N = 4096
LOG2E = tl.constexpr(1.4426950408889634)  # a kernel may read only constexpr globals


@autotune(row_tile_configs(), key=["N", "LOG"], prune_configs_by={"early_config_prune": prune_row_tiles(64)})
@triton.jit
def softmax_fwd_kernel(X, Y, stride_x, stride_y, M, N, scale,
                       LOG: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # Masked lanes become -inf after the scale (a negative scale would turn a loaded -inf into +inf),
    # so they drop out of both the max and the sum.
    z = tl.where(mask, x * scale, float("-inf"))
    m = tl.max(z, axis=1)
    e = tl.exp2((z - m[:, None]) * LOG2E)
    s = tl.sum(e, axis=1)
    if LOG:
        y = z - (m + tl.log(s))[:, None]
    else:
        y = e / s[:, None]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def softmax_fwd_looped_kernel(X, Y, stride_x, stride_y, N, scale, LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = X + row * stride_x, Y + row * stride_y
    # Online pass: per-lane running max and sum, rescaled whenever the max grows.
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        z = tl.where(cols < N, tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32) * scale, float("-inf"))
        m_new = tl.maximum(m, z)
        # Lanes still at -inf (nothing seen yet) contribute 0, not NaN from (-inf) - (-inf).
        alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp2((m - m_new) * LOG2E))
        s = s * alpha + tl.where(m_new == float("-inf"), 0.0, tl.exp2((z - m_new) * LOG2E))
        m = m_new
    m_row = tl.max(m, axis=0)
    s_row = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp2((m - m_row) * LOG2E)), axis=0)
    lse = m_row + tl.log(s_row)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        z = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32) * scale
        if LOG:
            y = z - lse
        else:
            y = tl.exp2((z - lse) * LOG2E)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=cols < N)


@autotune(row_tile_configs(warps=(4, 8, 16)), key=["N", "LOG"],
          prune_configs_by={"early_config_prune": prune_row_tiles(32)})
@triton.jit
def softmax_bwd_kernel(DY, Y, DX, stride_dy, stride_y, stride_dx, M, N, scale,
                       LOG: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if LOG:
        y = tl.load(Y + rows64[:, None] * stride_y + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        dx = dy - tl.exp2(y * LOG2E) * tl.sum(dy, axis=1)[:, None]
    else:
        y = tl.load(Y + rows64[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], (dx * scale).to(DX.dtype.element_ty), mask=mask)


@triton.jit
def softmax_bwd_looped_kernel(DY, Y, DX, stride_dy, stride_y, stride_dx, N, scale,
                              LOG: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        dy = tl.load(DY + row * stride_dy + cols, mask=cols < N, other=0.0).to(tl.float32)
        if LOG:
            acc += dy
        else:
            acc += dy * tl.load(Y + row * stride_y + cols, mask=cols < N, other=0.0).to(tl.float32)
    c = tl.sum(acc, axis=0)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        dy = tl.load(DY + row * stride_dy + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = tl.load(Y + row * stride_y + cols, mask=cols < N, other=0.0).to(tl.float32)
        if LOG:
            dx = dy - tl.exp2(y * LOG2E) * c
        else:
            dx = y * (dy - c)
        tl.store(DX + row * stride_dx + cols, (dx * scale).to(DX.dtype.element_ty), mask=cols < N)


def _validate_inputs(x, scale):
    _validate.tensor(x, "x", min_dim=1)
    if not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python number, got {type(scale).__name__}")


def softmax_fwd(x: torch.Tensor, scale: float = 1.0, log: bool = False) -> torch.Tensor:
    _validate_inputs(x, scale)
    n = x.shape[-1]
    y = empty_like(x)
    if x.numel() == 0:
        return y
    x2, y2 = _validate.rows_2d(x, n), y.view(-1, n)
    m = x2.shape[0]
    if n <= MAX_FUSED_N:
        grid = lambda meta: (triton.cdiv(m, meta["ROWS"]),)  # noqa: E731
        launch(softmax_fwd_kernel, grid, (n, log, x.dtype), x2, y2, x2.stride(0), y2.stride(0), m, n, float(scale),
               LOG=log, BLOCK_N=triton.next_power_of_2(n))
    else:
        softmax_fwd_looped_kernel[(m,)](x2, y2, x2.stride(0), y2.stride(0), n, float(scale), LOG=log,
                                        BLOCK_N=LOOP_BLOCK_N, num_warps=8)
    return y


def softmax_bwd(dy: torch.Tensor, y: torch.Tensor, scale: float = 1.0, log: bool = False) -> torch.Tensor:
    n = y.shape[-1]
    dx = empty_like(y)
    if y.numel() == 0:
        return dx
    dy2, y2, dx2 = _validate.rows_2d(dy, n), _validate.rows_2d(y, n), dx.view(-1, n)
    m = y2.shape[0]
    if n <= MAX_FUSED_N:
        grid = lambda meta: (triton.cdiv(m, meta["ROWS"]),)  # noqa: E731
        launch(softmax_bwd_kernel, grid, (n, log, dy.dtype, y.dtype), dy2, y2, dx2, dy2.stride(0), y2.stride(0),
               dx2.stride(0), m, n, float(scale), LOG=log, BLOCK_N=triton.next_power_of_2(n))
    else:
        softmax_bwd_looped_kernel[(m,)](dy2, y2, dx2, dy2.stride(0), y2.stride(0), dx2.stride(0), n, float(scale),
                                        LOG=log, BLOCK_N=LOOP_BLOCK_N, num_warps=8)
    return dx


# --- custom ops (torch.compile) and the eager autograd path ---

@torch.library.custom_op("kernelkit::softmax", mutates_args=())
def _softmax_op(x: torch.Tensor, scale: float, log: bool) -> torch.Tensor:
    return softmax_fwd(x, scale, log)


@_softmax_op.register_fake
def _(x, scale, log):
    return torch.empty_like(x)


@torch.library.custom_op("kernelkit::softmax_bwd", mutates_args=())
def _softmax_bwd_op(dy: torch.Tensor, y: torch.Tensor, scale: float, log: bool) -> torch.Tensor:
    return softmax_bwd(dy, y, scale, log)


@_softmax_bwd_op.register_fake
def _(dy, y, scale, log):
    return torch.empty_like(y)


def _setup_context(ctx, inputs, output):
    _x, scale, log = inputs
    ctx.save_for_backward(output)  # only y: the backward never needs x
    ctx.scale, ctx.log = scale, log


def _backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return _softmax_bwd_op(dy, y, ctx.scale, ctx.log), None, None


_softmax_op.register_autograd(_backward, setup_context=_setup_context)


class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, log):
        y = softmax_fwd(x, scale, log)
        ctx.save_for_backward(y)
        ctx.scale, ctx.log = scale, log
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_bwd(dy, y, ctx.scale, ctx.log), None, None


def _dispatch(x, scale, log):
    if not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a Python number, got {type(scale).__name__}")
    if torch.compiler.is_compiling():
        return _softmax_op(x, float(scale), log)
    return _SoftmaxFunction.apply(x, float(scale), log)


def softmax(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """softmax(scale * x) over the last dim. x: (..., N) fp32/bf16/fp16; fp32 math, one rounding.

    Any N >= 1 (rows over 32768 take the online kernel). The backward reads only y and dy.
    """
    return _dispatch(x, scale, False)


def log_softmax(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """log_softmax(scale * x) over the last dim; same shapes, dtypes and paths as `softmax`."""
    return _dispatch(x, scale, True)


def reference(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    xf = x.float() if x.dtype != torch.float64 else x
    return torch.softmax(xf * scale, dim=-1).to(x.dtype)


def log_reference(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    xf = x.float() if x.dtype != torch.float64 else x
    return torch.log_softmax(xf * scale, dim=-1).to(x.dtype)


def _eager(x, scale=1.0):
    return torch.softmax(x * scale if scale != 1.0 else x, dim=-1)


def _eager_log(x, scale=1.0):
    return torch.log_softmax(x * scale if scale != 1.0 else x, dim=-1)


def cost(x: torch.Tensor, scale: float = 1.0, backward: bool = False) -> Cost:
    """Forward reads x, writes y; backward reads y and dy, writes dx."""
    n, b = x.numel(), x.element_size()
    return Cost(flops=(4.0 if backward else 5.0) * n, bytes=(3.0 if backward else 2.0) * n * b,
                dtype=dtype_key(x.dtype))


def make_inputs(shape, dtype, device, generator=None):
    return (3.0 * torch.randn(shape, dtype=dtype, device=device, generator=generator),), {}


def _liger_loader():
    fn = optional_import("liger_kernel.transformers.functional", "liger_softmax")()
    return None if fn is None else (lambda x, scale=1.0: fn(x * scale if scale != 1.0 else x))


_COMMON = dict(
    cost=cost, make_inputs=make_inputs, grad_args=(0,),
    test_shapes=[(1, 1), (3, 7), (37, 1000), (5, 4097), (2, 3, 129)],
    bench_shapes=[(4096, 4096), (16384, 4096), (8192, 8192), (16384, 8192), (1024, 32768), (64, 393216)],
    latency_shapes=[(1, 4096)],
)
register(OpSpec(name="softmax", fn=softmax, reference=reference, eager=_eager,
                competitors={"liger": _liger_loader},
                replaces=("aten::_softmax", "aten::softmax", "Softmax"),
                doc="softmax(scale * x) over the last dim, forward+backward, online kernel for long rows.",
                **_COMMON))
register(OpSpec(name="log_softmax", fn=log_softmax, reference=log_reference, eager=_eager_log,
                replaces=("aten::_log_softmax", "aten::log_softmax", "LogSoftmax"),
                doc="log_softmax(scale * x) over the last dim, forward+backward.", **_COMMON))
