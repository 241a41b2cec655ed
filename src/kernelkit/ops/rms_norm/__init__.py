"""RMSNorm: y = x / sqrt(mean(x²) + eps) * (offset + w), forward and backward.

Memory-bound: the floor is one read of x and one write of y (forward), one read of x and dy and one
write of dx (backward). Rows that fit in one block are normalized in registers, several rows per
program for short rows; longer rows take cooperative rows on a GPU (ops/_coop.py: each row split over
programs that hold their chunk and exchange its sum of squares, one pass), else a looped kernel that
makes two passes over the row.
The fused backward is persistent: each program walks a strided set of rows and keeps its share of dw
in registers, so dw costs one (programs × N) fp32 partial, summed in a second stage. Rows too wide for
it take cooperative rows (each program keeps its chunk's dw share over its group's rows), else a column-strip backward (`WideBackward`): a per-row sum, then strips of columns that keep their
share of dw in registers over a group of rows.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ...roofline.model import Cost, dtype_key
from ...runtime.alloc import empty, empty_like
from ...runtime import cdiv, interpreting, launch, next_pow2, num_sms
from .. import _coop, _validate
from .._dispatch import Op, fp8_rows_op, reference_vjp
from .._norm_common import FusedBackward, WideBackward, column_sum, fused_backward, validate_trailing
from ..gemm.fp8 import quantize_rows
from ..registry import OpSpec, optional_import, register
from .kernels import (rms_norm_bwd_coop_kernel, rms_norm_bwd_kernel, rms_norm_bwd_row_dot_kernel,
                      rms_norm_bwd_strip_kernel, rms_norm_fwd_coop_kernel, rms_norm_fwd_kernel,
                      rms_norm_fwd_looped_kernel)

# Longest row held in registers by one program; longer rows take the looped kernels.
MAX_FUSED_N = 32768
# Longest row the fused backward holds: it keeps x, dy, w and dw per element, and past 16384
# ptxas spills heavily (found compiling for sm_90); longer rows take a wide-row backward (below).
MAX_FUSED_BWD_N = 16384
# In fp32 with dsummed (add+RMSNorm) the spills at 16384 cost more: 505 GB/s fused against 1968 for
# the strips backward on the H100 (benchmarks/results/h100/norm_width_sweep.json); bf16 keeps 2037.
MAX_FUSED_BWD_N_FP32_DS = 8192
# Chunk of a long row processed per loop step.
LOOP_BLOCK_N = 4096
# The fused backward by row block. Rows of up to 1024 columns run 8 programs per SM where each gets 32 rows or
# more (more warps resident: the autotuner may then pick small tiles), else two per SM up to 2048 columns and
# one beyond (measured on the H100 at 2048-16384 columns: more only adds dw partial traffic). H100, bf16, 128 MB
# inputs, backward µs, 8 vs 2 programs per SM (benchmarks/experiments/h100/2026-11-25-norm-bwd-candidates, a
# noisy run: one design read twice differed by up to 2.5x): 173 vs 182 and 450 at 512 columns, 152 vs 159 at
# 1024; at 256, 408 for 8 against 279 and 298 for 2 (and 195 for 4): weak evidence, see the README there.
FUSED_BWD = (FusedBackward(1024, 8, min_rows=32), FusedBackward(2048, 2), FusedBackward(MAX_FUSED_N, 1))
# add+RMSNorm's backward reads dsummed too, after the row sum (a barrier): its row loop is pipelined, which keeps
# the next rows' three loads in flight. Same run, pipelined vs not at equal programs: faster in 15 of 18 pairs
# over 256-8192 columns, e.g. 198 vs 212 µs at 8192, 196 vs 212 at 4096, 210 vs 242 at 512.
FUSED_BWD_DS = (FusedBackward(2048, 2, stages=2), FusedBackward(MAX_FUSED_N, 1, stages=2))


# Measured on the H100 at 16K-64K columns, 128 MB inputs (benchmarks/results/h100/norm_width_sweep.json):
# 1640-1670 GB/s in bf16 (~95% of copy bandwidth for the bytes it moves), 1750 in fp32. The looped kernel
# it replaced (two passes over one row at a time, the second re-reading it and adding dy·xhat into an fp32
# dweight partial row) ran 900-1000 in bf16, at most 1170 over the programs per SM, warps, chunks and rows
# per step tried: too few loads in flight per SM, by our reading (not profiled). Tests and benchmarks set
# other strips.
WIDE_BWD = WideBackward(4.0, 4, 512, 4)
# Cooperative rows (ops/_coop.py) past MAX_FUSED_N (forward) and the fused backward's limit (backward): each row
# split over programs that hold their chunk (x and w; x, dy, w and dw's share) in registers and exchange the row's
# sum of squares, or sum(x·w·dy): one read and one write. On (COOP), the longest chunk, warps, programs per SM.
# Where it does not apply (COOP off, or a row needing more programs than are resident) the looped forward and the
# column-strip backward do.
COOP = True
COOP_CHUNK = 8192
COOP_BWD_CHUNK = 4096
# fp32 backward chunks: at 4096x18432, 2202 GB/s in chunks of 8192 against 1586 in 4096 (H100, coop_configs); bf16
# went the other way at 32768 and 65536 columns (2001 and 1851 in 4096, 1750 and 1584 in 8192).
COOP_BWD_CHUNK_FP32 = 8192
COOP_WARPS = 8
COOP_PER_SM = 2


def _forward(x, weight, eps, offset, residual, quant=False):
    """Validate the arguments and launch the forward. Returns (y, rstd, summed, q, scale): rstd of shape
    x.shape[:-1] in fp32, summed = x + residual (None without a residual), normalized in the same pass, and with
    `quant` y's e4m3 rows and row scales (`quantize_rows(y)`; None without). The checks are inline, not a
    helper's: below the two launchers, the eager path makes as many Python calls as before they split."""
    _validate.tensor(x, "x", min_dim=1)
    _validate.number(eps, "eps", low=0.0)
    if weight is not None:  # as the kernels index it: unit stride, copied if not
        _validate.tensor(weight, "weight")
        _validate.same_device(weight, "weight", x, "x")
        weight = _validate.vector(weight, "weight", x.shape[-1])
    has_r = residual is not None
    if has_r:
        _validate.tensor(residual, "residual")
        _validate.same_device(residual, "residual", x, "x")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
    n = x.shape[-1]
    y = empty_like(x)
    summed = empty_like(x) if has_r else None
    rstd = empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    fused_quant = quant and n <= MAX_FUSED_N
    q = empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device) if fused_quant else None
    qs = empty(x.shape[:-1], dtype=torch.float32, device=x.device) if fused_quant else None
    if x.numel() == 0:
        rstd.fill_(1.0 / math.sqrt(eps) if eps > 0 else float("inf"))
        return (y, rstd, summed, *(quantize_rows(y) if quant else (None, None)))
    x2, y2 = _validate.rows_2d(x, n), y.view(-1, n)
    r2, s2 = (_validate.rows_2d(residual, n), summed.view(-1, n)) if has_r else (x2, y2)  # dummies unread
    m = x2.shape[0]
    w = weight if weight is not None else x2  # dummy pointer, never read
    args = (x2, r2, s2, w, y2, rstd, x2.stride(0), r2.stride(0), s2.stride(0), y2.stride(0))
    if n <= MAX_FUSED_N:
        # q as bytes: the kernel writes e4m3 bits (e4m3_bits), the GPU's convert or the interpreter's encoding
        q2, qs2 = (q.view(torch.uint8).view(-1, n), qs) if fused_quant else (y2, rstd)  # dummies unwritten
        grid = lambda meta: (cdiv(m, meta["ROWS"]),)  # noqa: E731
        launch(rms_norm_fwd_kernel, grid, (n, weight is not None, has_r, fused_quant, x.dtype, w.dtype),
               x2, r2, s2, w, y2, rstd, q2, qs2, x2.stride(0), r2.stride(0), s2.stride(0), y2.stride(0),
               q2.stride(0), m, n, eps, offset, torch.finfo(x.dtype).tiny, HAS_WEIGHT=weight is not None,
               HAS_RESIDUAL=has_r, QUANT=fused_quant, BLOCK_N=next_pow2(n))
    elif not (COOP and _coop.launch_rows(rms_norm_fwd_coop_kernel, m, n, COOP_CHUNK, (*args, eps, offset),
                                         {"HAS_WEIGHT": weight is not None, "HAS_RESIDUAL": has_r,
                                          "num_warps": COOP_WARPS}, x.device, per_sm=COOP_PER_SM)):
        launch(rms_norm_fwd_looped_kernel, (m,), None, *args, n, eps, offset, HAS_WEIGHT=weight is not None,
               HAS_RESIDUAL=has_r, BLOCK_N=LOOP_BLOCK_N, num_warps=8)
    if quant and not fused_quant:  # rows past one program's registers: the separate two-pass quantizer
        q, qs = quantize_rows(y)
    return y, rstd, summed, q, qs


def rms_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float = 0.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's launcher, (y, rstd); its signature is the schema of kernelkit::rms_norm."""
    y, rstd, *_ = _forward(x, weight, eps, offset, None)
    return y, rstd


def rms_norm_fp8_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float = 0.0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fp8-writing forward's launcher, (y, rstd, q, scale); its signature is the schema of
    kernelkit::rms_norm_fp8."""
    y, rstd, _, q, qs = _forward(x, weight, eps, offset, None, quant=True)
    return y, rstd, q, qs


def add_rms_norm_fwd(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
                     offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused add's launcher, (normed, rstd, summed); its signature is the schema of kernelkit::add_rms_norm."""
    if residual is None:
        raise TypeError("add_rms_norm needs a residual tensor (got None); without one, call kernelkit.rms_norm")
    return _forward(x, weight, eps, offset, residual)[:3]


def _wide_bwd(cfg: WideBackward, sms, m, n, dy2, x2, w, rstd, ds2, dx2, offset, has_w, has_ds):
    """Launch the wide-row backward `cfg` describes; returns its (row groups, n) dw partial."""
    c = empty((m,), dtype=torch.float32, device=x2.device)
    launch(rms_norm_bwd_row_dot_kernel, (m,), None, dy2, x2, w, rstd, c, dy2.stride(0), x2.stride(0), n, offset,
           HAS_WEIGHT=has_w, BLOCK_N=LOOP_BLOCK_N, num_warps=8)
    strips, groups, per_group = cfg.row_groups(sms, m, n)
    partial = empty((groups, n), dtype=torch.float32, device=x2.device) if has_w else x2
    launch(rms_norm_bwd_strip_kernel, (strips, groups), None, dy2, x2, w, rstd, c, ds2, dx2, partial, dy2.stride(0),
           x2.stride(0), ds2.stride(0), dx2.stride(0), m, n, per_group, offset, HAS_WEIGHT=has_w, HAS_DS=has_ds,
           BLOCK_N=cfg.block_n, ROWS=cfg.rows, num_warps=cfg.num_warps)
    return partial


def _coop_bwd(m, n, dy2, x2, w, rstd, ds2, dx2, offset, has_w, has_ds):
    """Launch the cooperative backward; returns its (groups, n) dw partial (x2 without a weight), or None where
    it does not apply (nothing launched)."""
    partial = []

    def args(groups):
        partial[:] = [empty((groups, n), dtype=torch.float32, device=x2.device) if has_w else x2]
        return (dy2, x2, w, rstd, ds2, dx2, partial[0], dy2.stride(0), x2.stride(0), ds2.stride(0), dx2.stride(0),
                offset)

    chunk = COOP_BWD_CHUNK_FP32 if x2.dtype == torch.float32 else COOP_BWD_CHUNK
    ok = _coop.launch_rows(rms_norm_bwd_coop_kernel, m, n, chunk, args,
                           {"HAS_WEIGHT": has_w, "HAS_DS": has_ds, "num_warps": COOP_WARPS}, x2.device,
                           per_sm=COOP_PER_SM)
    return partial[0] if ok else None


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], rstd: torch.Tensor,
                 offset: float = 0.0, dsummed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward. Returns (dx, dw); dw is empty when there is no weight. Its signature is the schema of
    kernelkit::rms_norm_bwd and kernelkit::add_rms_norm_bwd.

    With `dsummed` (the gradient of x + residual from the residual stream), dx includes it: then
    dx is the gradient of both x and the residual of the fused add."""
    n = x.shape[-1]
    dx = empty_like(x)
    has_w = weight is not None
    weight = _validate.vector(weight, "weight", n) if has_w else None
    if x.numel() == 0:
        dw = torch.zeros(n, dtype=weight.dtype, device=x.device) if has_w else x.new_empty(0)
        return dx, dw
    x2, dy2, dx2 = _validate.rows_2d(x, n), _validate.rows_2d(dy, n), dx.view(-1, n)
    has_ds = dsummed is not None
    ds2 = _validate.rows_2d(dsummed, n) if has_ds else dy2
    m = x2.shape[0]
    rstd = rstd.reshape(-1).contiguous()
    w = weight if has_w else x2
    sms = num_sms(x.device)
    fused_limit = min(MAX_FUSED_N, MAX_FUSED_BWD_N)
    if has_ds and x.dtype == torch.float32:
        fused_limit = min(fused_limit, MAX_FUSED_BWD_N_FP32_DS)
    if n <= fused_limit:
        block_n = next_pow2(n)
        cfg = fused_backward(FUSED_BWD_DS if has_ds else FUSED_BWD, block_n, m, sms)
        programs = cfg.programs(sms, m)
        partial = torch.empty((programs, n), dtype=torch.float32, device=x.device) if has_w else x2
        launch(rms_norm_bwd_kernel, (programs,), (n, has_w, has_ds, x.dtype, dy.dtype, w.dtype, ds2.dtype),
               dy2, x2, w, rstd, ds2, dx2, partial, dy2.stride(0), x2.stride(0), ds2.stride(0), dx2.stride(0),
               m, n, offset, HAS_WEIGHT=has_w, HAS_DS=has_ds, BLOCK_N=block_n, STAGES=cfg.stages)
    else:
        partial = _coop_bwd(m, n, dy2, x2, w, rstd, ds2, dx2, offset, has_w, has_ds) if COOP else None
        if partial is None:
            partial = _wide_bwd(WIDE_BWD, sms, m, n, dy2, x2, w, rstd, ds2, dx2, offset, has_w, has_ds)
    dw = column_sum(partial, weight, sms) if has_w else x.new_empty(0)
    return dx, dw


# --- the ops, declared once: one graph node each under torch.compile, autograd through the backward kernel ---

def _fake(x, weight, eps, offset=0.0):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _bwd_fake(dy, x, weight, rstd, offset=0.0, dsummed=None):
    return x.new_empty(x.shape), (weight.new_empty(weight.shape) if weight is not None else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, eps, offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.eps, ctx.offset = eps, offset


def _backward(ctx, kernels, dy):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = kernels.bwd(dy, x, weight, rstd, ctx.offset, None)
    return dx, (dw if weight is not None else None), None, None


def _double_backward(ctx, dy):
    x, weight, _ = ctx.saved_tensors
    return reference_vjp(reference, (x, weight, ctx.eps, ctx.offset), (dy,))


RMS_NORM = Op("rms_norm", rms_norm_fwd, fake=_fake, setup_context=_setup_context, backward=_backward,
              bwd=rms_norm_bwd, bwd_fake=_bwd_fake, double_backward=_double_backward, n_grad=2, public=0)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
             offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x², -1) + eps) * (offset + weight)``.

    x: (..., N) in float32, bfloat16 or float16, any strides; weight: (N,) or None; offset=1.0
    gives Gemma's ``(1 + w)``. Statistics and the product are computed in fp32 and rounded once to
    x's dtype. Differentiable in x and weight (dweight through a two-stage reduction).
    """
    return RMS_NORM(x, weight, _validate.number(eps, "eps", low=0.0), _validate.number(offset, "offset"))


# --- RMSNorm that also writes its output's fp8 rows (the operand of the fp8 Linears it feeds) ---

RMS_NORM_FP8 = fp8_rows_op("rms_norm_fp8", rms_norm_fp8_fwd, fake=_fake, setup_context=_setup_context,
                          backward=_backward, double_backward=_double_backward, bwd=rms_norm_bwd, bwd_fake=_bwd_fake,
                          n_grad=2, public=(0, 2, 3))


def rms_norm_fp8(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rms_norm` that also writes y's float8_e4m3fn rows in the same pass: (y, q, scale), y as `rms_norm` gives
    it, q (x.shape, e4m3) and scale (x.shape[:-1], fp32) equal to ``quantize_rows(y)`` bit for bit (each row's
    amax mapped to 448, the scale rounded to x's dtype). What fp8 Linears reading y would quantize, written
    while y is still in registers: one extra byte per element instead of a second read of y and a launch.
    Rows wider than one program holds (MAX_FUSED_N) take `rms_norm` then `quantize_rows`. q and scale carry no
    gradient; y's backward is `rms_norm`'s."""
    return RMS_NORM_FP8(x, weight, _validate.number(eps, "eps", low=0.0), _validate.number(offset, "offset"))


# --- fused residual add + RMSNorm (pre-norm blocks) ---

def _add_fake(x, residual, weight, eps, offset=0.0):
    return (*_fake(x, weight, eps, offset), x.new_empty(x.shape))


def _add_setup_context(ctx, inputs, output):
    _x, _residual, weight, eps, offset = inputs
    ctx.save_for_backward(output[2], weight, output[1])
    ctx.eps, ctx.offset = eps, offset


def _add_backward(ctx, kernels, dy, dsummed):
    """One gradient for x and residual: the norm's through summed, plus the residual stream's."""
    summed, weight, rstd = ctx.saved_tensors
    dx, dw = kernels.bwd(dy, summed, weight, rstd, ctx.offset, dsummed)
    return dx, dx, (dw if weight is not None else None), None, None


def _add_double_backward(ctx, dy, dsummed):
    summed, weight, _ = ctx.saved_tensors
    dx, dw, *_ = reference_vjp(reference, (summed, weight, ctx.eps, ctx.offset), (dy,))
    if dsummed is not None:
        dx = dsummed if dx is None else dx + dsummed
    return dx, dx, dw, None, None


ADD_RMS_NORM = Op("add_rms_norm", add_rms_norm_fwd, fake=_add_fake, setup_context=_add_setup_context,
                  backward=_add_backward, bwd=rms_norm_bwd, bwd_fake=_bwd_fake, double_backward=_add_double_backward,
                  n_grad=3, public=(0, 2))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor] = None,
                 eps: float = 1e-6, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused pre-norm step: ``summed = x + residual``; ``normed = rms_norm(summed, weight, eps, offset)``.

    x, residual: (..., N) of one dtype; returns (normed, summed), both x's dtype, in one pass that
    reads x and residual once and writes both outputs once. The backward takes the gradients of
    both outputs (the norm's and the residual stream's) and returns the same gradient for x and
    residual, plus dweight.
    """
    return ADD_RMS_NORM(x, residual, weight, _validate.number(eps, "eps", low=0.0), _validate.number(offset, "offset"))


def add_reference(x, residual, weight=None, eps=1e-6, offset=0.0):
    summed = x + residual
    return reference(summed, weight, eps, offset), summed


def add_cost(x, residual, weight=None, eps=1e-6, offset=0.0, backward=False) -> Cost:
    """RMSNorm's traffic plus the residual stream's: the forward also reads residual and writes summed;
    the backward also reads dsummed (dx serves x and residual, written once)."""
    base = cost(x, weight, backward=backward)
    extra = (1.0 if backward else 2.0) * x.numel() * x.element_size()
    return Cost(flops=base.flops + x.numel(), bytes=base.bytes + extra, dtype=base.dtype)


def add_make_inputs(shape, dtype, device, generator=None):
    x = torch.randn(shape, dtype=dtype, device=device, generator=generator)
    r = torch.randn(shape, dtype=dtype, device=device, generator=generator)
    w = 1.0 + 0.1 * torch.randn(shape[-1], dtype=dtype, device=device, generator=generator)
    return (x, r, w), {"eps": 1e-6}


def _liger_add_loader():
    fn = optional_import("liger_kernel.transformers.functional", "liger_fused_add_rms_norm")()
    if fn is None:
        return None
    # Liger returns (normed, summed) like ours; in_place=False keeps the inputs intact between runs.
    return lambda x, residual, weight=None, eps=1e-6, offset=0.0: fn(x, residual, weight, eps, offset, "llama", False)


class RMSNorm(torch.nn.RMSNorm):
    """Drop-in for `torch.nn.RMSNorm` (same constructor and state_dict) running kernelkit's kernel.

    Several trailing normalized dims are flattened into one row. Documented fallback: a CPU tensor,
    outside the Triton interpreter, runs torch's own forward.
    """

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None, offset: float = 0.0):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda" and not interpreting():
            w = self.weight + self.offset if self.weight is not None and self.offset else self.weight
            return F.rms_norm(x, self.normalized_shape, w, self.eps)
        validate_trailing(x, self.normalized_shape, type(self).__name__)
        n = math.prod(self.normalized_shape)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        w = self.weight.reshape(n) if self.weight is not None else None
        y = rms_norm(x.reshape(*x.shape[: x.dim() - len(self.normalized_shape)], n), w, eps, self.offset)
        return y.reshape(x.shape)


def reference(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
              offset: float = 0.0) -> torch.Tensor:
    """Plain PyTorch RMSNorm (the Llama eager code: fp32 statistics, one rounding at the end)."""
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.to(xf.dtype) + offset)
    return y.to(x.dtype)


def cost(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6, offset: float = 0.0,
         backward: bool = False) -> Cost:
    """Ideal traffic: forward reads x (and w) and writes y; backward reads x, dy (and w), writes dx (and dw)."""
    numel, esize = x.numel(), x.element_size()
    w_bytes = weight.numel() * weight.element_size() if weight is not None else 0
    if backward:
        return Cost(flops=8.0 * numel, bytes=3.0 * numel * esize + 2 * w_bytes, dtype=dtype_key(x.dtype))
    return Cost(flops=4.0 * numel, bytes=2.0 * numel * esize + w_bytes, dtype=dtype_key(x.dtype))


def make_inputs(shape, dtype, device, generator=None):
    x = torch.randn(shape, dtype=dtype, device=device, generator=generator)
    w = 1.0 + 0.1 * torch.randn(shape[-1], dtype=dtype, device=device, generator=generator)
    return (x, w), {"eps": 1e-6}


def _torch_rms_norm(x, weight=None, eps=1e-6, offset=0.0):
    return F.rms_norm(x, (x.shape[-1],), weight + offset if offset else weight, eps)


def _liger_loader():
    fn = optional_import("liger_kernel.transformers.functional", "liger_rms_norm")()
    if fn is None:
        return None
    return lambda x, weight=None, eps=1e-6, offset=0.0: fn(x, weight, eps, offset, "llama", True)


def _quack_loader():
    """quack's RMSNorm (CuTe DSL; `quack-kernels`, where it imports), autograd included."""
    fn = optional_import("quack.rmsnorm", "rmsnorm")()
    if fn is None:
        return None
    return lambda x, weight=None, eps=1e-6, offset=0.0: fn(x, weight, eps=eps, weight_offset=offset)


register(OpSpec(
    name="rms_norm", fn=rms_norm, reference=reference, cost=cost, make_inputs=make_inputs, grad_args=(0, 1),
    test_shapes=[(3, 7), (37, 1000), (5, 4097), (2, 3, 129)],
    bench_shapes=[(4096, 4096), (16384, 2048), (16384, 4096), (8192, 8192), (16384, 8192)],
    latency_shapes=[(1, 4096)],
    competitors={"F.rms_norm": lambda: _torch_rms_norm, "liger": _liger_loader, "quack": _quack_loader},
    replaces=("aten::rms_norm", "aten::_fused_rms_norm", "RMSNorm", "LlamaRMSNorm", "MistralRMSNorm",
              "Qwen2RMSNorm", "Qwen3RMSNorm", "GemmaRMSNorm"),
    doc="RMSNorm forward+backward, fp32 statistics, optional weight and weight offset.",
))
register(OpSpec(
    name="add_rms_norm", fn=add_rms_norm, reference=add_reference, cost=add_cost, make_inputs=add_make_inputs,
    grad_args=(0, 1, 2), test_shapes=[(3, 7), (37, 1000), (5, 4097), (2, 3, 129)],
    bench_shapes=[(4096, 4096), (16384, 2048), (16384, 4096), (8192, 8192), (16384, 8192)],
    latency_shapes=[(1, 4096)], competitors={"liger": _liger_add_loader},
    replaces=("aten::add+aten::rms_norm",),
    doc="Fused residual add + RMSNorm: returns (normed, summed) in one pass; backward included.",
))
