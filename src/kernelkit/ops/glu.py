"""Gated linear units: SwiGLU silu(gate) * up and GeGLU gelu(gate) * up, forward and backward.

Elementwise and memory-bound: the floor reads gate and up once and writes the product once; the
backward reads gate, up and dout and writes dgate and dup, recomputing the activation instead of
saving it (saving would cost a write and a read of one more tensor). Gate and up come as two tensors
or as one (..., 2H) tensor with gate in the first half, as fused gate-up projections produce.

`swiglu_fp8` also writes the output's float8_e4m3fn rows and row scales in the same pass (the operand of an fp8
down projection, bit for bit `quantize_rows` of the output): one row per program, in registers.

Contiguous inputs run a flat 1-D grid: each program streams one run of consecutive elements, so the
GPU walks memory in order, without the partial blocks that row tails of a (row, column block) grid
leave. Strided rows (the two halves of a gate-up tensor) take row x column tiles.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..roofline.model import Cost, dtype_key
from ..runtime.alloc import empty
from ..runtime import autotune, cdiv, launch, next_pow2
from . import _validate
from .gemm.fp8 import e4m3_bits, fp8_clamp, fp8_scale, max_nan, quantize_rows
from ._dispatch import Op, fp8_rows_op, reference_vjp
from .registry import OpSpec, optional_import, register

SILU, GELU_TANH, GELU_ERF = 0, 1, 2
_GELU = ("tanh", "none")
_ACTS = {"tanh": GELU_TANH, "none": GELU_ERF}
# Kernels may read only constexpr globals.
TWO_SQRT_2_OVER_PI = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))
GELU_CUBIC = tl.constexpr(0.044715)
INV_SQRT_2 = tl.constexpr(1.0 / math.sqrt(2.0))
INV_SQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
# Widest column block of the strided (gate-up halves) layout: 2 KiB of 16-bit data per row segment.
MAX_BLOCK_H = 1024
# Widest row swiglu_fp8 holds in one program (Llama-3-8B's MLP is 14336 wide); wider rows take swiglu, then
# quantize_rows.
FP8_MAX_N = 16384


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr, NEED_GRAD: tl.constexpr):
    """Activation of g (fp32) and, when asked, its derivative."""
    if ACT == 0:  # silu
        sig = tl.sigmoid(g)
        a = g * sig
        da = sig * (1.0 + g * (1.0 - sig)) if NEED_GRAD else a
    elif ACT == 1:
        # gelu, tanh approximation: 0.5 * (1 + tanh(u)) is sigmoid(2u), which also avoids the
        # cancellation of 1 + tanh(u) for negative inputs.
        p = tl.sigmoid(TWO_SQRT_2_OVER_PI * g * (1.0 + GELU_CUBIC * g * g))
        a = g * p
        da = p + g * p * (1.0 - p) * TWO_SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * g * g) if NEED_GRAD else a
    else:  # gelu, exact (erf)
        cdf = 0.5 * (1.0 + tl.erf(g * INV_SQRT_2))
        a = g * cdf
        da = cdf + g * tl.exp(-0.5 * g * g) * INV_SQRT_2PI if NEED_GRAD else a
    return a, da


@triton.jit
def _tile(stride, M, N, FLAT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    """Element offsets and mask of this program's tile of an (M, N) view with row stride `stride`.

    FLAT (every tensor contiguous): N is the element count and a tile is BLOCK consecutive elements,
    so programs stream memory in order with 16-byte vectors and no row tails. Otherwise (the halves
    of a gate-up tensor, strided rows) a tile is BLOCK // BLOCK_H rows by BLOCK_H columns, with the
    column blocks of a row on consecutive programs so that they still walk memory in order.
    """
    pid = tl.program_id(0)
    if FLAT:
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
    else:
        ROWS: tl.constexpr = BLOCK // BLOCK_H
        col_blocks = tl.cdiv(N, BLOCK_H)
        row_block = pid // col_blocks
        cols = (pid - row_block * col_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        rows = row_block * ROWS + tl.arange(0, ROWS)
        offs = rows.to(tl.int64)[:, None] * stride + cols[None, :]
        mask = (rows < M)[:, None] & (cols < N)[None, :]
    return offs, mask


# 8 or 16 elements per thread: one or two 16-byte vectors of 16-bit data per tensor in flight.
def _configs():
    return [triton.Config({"BLOCK": b}, num_warps=w) for b, w in
            ((2048, 8), (1024, 4), (2048, 4), (4096, 8), (4096, 16), (8192, 16))]


@autotune(_configs(), key=["N", "ACT", "FLAT"])
@triton.jit
def glu_fwd_kernel(G, U, OUT, stride_g, stride_u, stride_o, M, N, ACT: tl.constexpr, FLAT: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    offs_g, mask = _tile(stride_g, M, N, FLAT, BLOCK, BLOCK_H)
    offs_u, _ = _tile(stride_u, M, N, FLAT, BLOCK, BLOCK_H)
    offs_o, _ = _tile(stride_o, M, N, FLAT, BLOCK, BLOCK_H)
    g = tl.load(G + offs_g, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs_u, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT, False)
    tl.store(OUT + offs_o, (a * u).to(OUT.dtype.element_ty), mask=mask)


@autotune(_configs(), key=["N", "ACT", "FLAT"])
@triton.jit
def glu_bwd_kernel(DO, G, U, DG, DU, stride_do, stride_g, stride_u, stride_dg, stride_du, M, N,
                   ACT: tl.constexpr, FLAT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    offs_do, mask = _tile(stride_do, M, N, FLAT, BLOCK, BLOCK_H)
    offs_g, _ = _tile(stride_g, M, N, FLAT, BLOCK, BLOCK_H)
    offs_u, _ = _tile(stride_u, M, N, FLAT, BLOCK, BLOCK_H)
    do = tl.load(DO + offs_do, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs_g, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs_u, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT, True)
    offs_dg, _ = _tile(stride_dg, M, N, FLAT, BLOCK, BLOCK_H)
    offs_du, _ = _tile(stride_du, M, N, FLAT, BLOCK, BLOCK_H)
    tl.store(DG + offs_dg, (do * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs_du, (do * a).to(DU.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_fp8_kernel(G, U, H, Q, S, stride_g, stride_u, stride_h, stride_q, N, tiny, BLOCK_N: tl.constexpr):
    """One row per program: h = silu(g) * u rounded to H's dtype and stored, then the e4m3 bits of that rounded row
    and its scale (quantize_rows(h) bit for bit: the same scale and clamp) without reading h back. Padding
    columns load g = u = 0, so h = 0 there and cannot raise the amax."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, 0, False)
    h = (a * u).to(H.dtype.element_ty)
    tl.store(H + row * stride_h + cols, h, mask=mask)
    hf = h.to(tl.float32)
    scale = fp8_scale(tl.reduce(tl.abs(hf), 0, max_nan), tiny, H.dtype.element_ty)
    tl.store(Q + row * stride_q + cols, e4m3_bits(fp8_clamp(hf, scale)), mask=mask)
    tl.store(S + row, scale)


def _rows(gate: torch.Tensor, up: torch.Tensor | None, h: int):
    """(rows, H) views of gate and up with a unit stride along H (the two halves of a gate-up tensor)."""
    if up is None:
        gu = _validate.rows_2d(gate, 2 * h)
        return gu[:, :h], gu[:, h:]
    return _validate.rows_2d(gate, h), _validate.rows_2d(up, h)


def _launch(kernel, key: tuple, tensors: list, rows: int, h: int, act: int) -> None:
    """Launch an elementwise GLU kernel over (rows, h) views: flat when every view is contiguous."""
    strides = [t.stride(0) for t in tensors]
    flat = rows == 1 or all(st == h for st in strides)
    if flat:
        m, n, block_h = 1, rows * h, 1
        grid = lambda meta: (cdiv(n, meta["BLOCK"]),)
    else:
        # Every config's BLOCK is at least MAX_BLOCK_H, so a tile holds one or more whole column blocks.
        m, n, block_h = rows, h, min(next_pow2(h), MAX_BLOCK_H)
        grid = lambda meta: (cdiv(m, meta["BLOCK"] // block_h) * cdiv(n, block_h),)
    launch(kernel, grid, (n, act, flat, *key), *tensors, *strides, m, n, ACT=act, FLAT=flat, BLOCK_H=block_h)


def _width(gate: torch.Tensor, up: torch.Tensor | None) -> int:
    """Validate gate and up; H, the output's width."""
    _validate.tensor(gate, "gate", min_dim=1)
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(f"gate holds gate and up concatenated, so its last dim must be even, got {gate.shape[-1]}")
        h = gate.shape[-1] // 2
    else:
        _validate.tensor(up, "up")
        _validate.same_device(up, "up", gate, "gate")
        if up.shape != gate.shape:
            raise ValueError(f"up must have gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
        if up.dtype != gate.dtype:
            raise TypeError(f"up has dtype {up.dtype} but gate has {gate.dtype}; use one dtype")
        h = gate.shape[-1]
    return h


def glu_fwd(gate: torch.Tensor, up: torch.Tensor | None, act: int) -> torch.Tensor:
    """Validate the inputs and launch the forward: act(gate) * up of shape (..., H) in gate's dtype."""
    h = _width(gate, up)
    out = empty((*gate.shape[:-1], h), dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    g2, u2 = _rows(gate, up, h)
    _launch(glu_fwd_kernel, (gate.dtype,), [g2, u2, out.view(-1, h)], g2.shape[0], h, act)
    return out


# The custom ops' schemas: one launcher per public op, the activation fixed or named as in F.gelu.
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    return glu_fwd(gate, up, SILU)


def swiglu_fp8_fwd(gate: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """swiglu_fp8's launcher, (h, q, scale); its signature is the schema of kernelkit::swiglu_fp8."""
    h = _width(gate, up)
    if h > FP8_MAX_N or gate.numel() == 0:
        out = glu_fwd(gate, up, SILU)  # rows past one program: the two-pass pair
        return (out, *quantize_rows(out))
    out = empty((*gate.shape[:-1], h), dtype=gate.dtype, device=gate.device)
    q = empty(out.shape, dtype=torch.float8_e4m3fn, device=gate.device)
    scale = empty(out.shape[:-1], dtype=torch.float32, device=gate.device)
    g2, u2 = _rows(gate, up, h)
    o2, q2 = out.view(-1, h), q.view(torch.uint8).view(-1, h)  # q as bytes: the kernel writes e4m3 bits
    block = next_pow2(h)
    launch(swiglu_fp8_kernel, (g2.shape[0],), None, g2, u2, o2, q2, scale, g2.stride(0), u2.stride(0), o2.stride(0),
           q2.stride(0), h, torch.finfo(gate.dtype).tiny, BLOCK_N=block,
           num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4)
    return out, q, scale


def geglu_fwd(gate: torch.Tensor, up: torch.Tensor | None, approximate: str) -> torch.Tensor:
    return glu_fwd(gate, up, _ACTS[approximate])


def glu_bwd(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None, act: int) -> list[torch.Tensor]:
    """Launch the backward, recomputing act(gate). Returns [dgate, dup]; with the concatenated layout
    [dgate], the (..., 2H) gradient of both halves."""
    h = gate.shape[-1] // 2 if up is None else gate.shape[-1]
    dgate = empty(gate.shape, dtype=gate.dtype, device=gate.device)
    grads = [dgate] if up is None else [dgate, empty(up.shape, dtype=up.dtype, device=up.device)]
    if dout.numel() == 0:
        return grads
    g2, u2 = _rows(gate, up, h)
    do2 = _validate.rows_2d(dout, h)
    if up is None:
        d2 = dgate.view(-1, 2 * h)
        dg2, du2 = d2[:, :h], d2[:, h:]
    else:
        dg2, du2 = dgate.view(-1, h), grads[1].view(-1, h)
    _launch(glu_bwd_kernel, (gate.dtype, dout.dtype), [do2, g2, u2, dg2, du2], g2.shape[0], h, act)
    return grads


# --- the ops, declared once: custom ops (torch.compile), fakes, autograd, the eager path ---

def _fake(gate, up, *_):
    h = gate.shape[-1] if up is not None else gate.shape[-1] // 2
    return gate.new_empty((*gate.shape[:-1], h))


def _bwd_fake(dout, gate, up, act):
    return [gate.new_empty(gate.shape)] + ([up.new_empty(up.shape)] if up is not None else [])


def _setup_context(ctx, inputs, output):
    gate, up, *approximate = inputs
    ctx.save_for_backward(gate, up)  # the inputs only: the backward recomputes the activation
    ctx.approximate = approximate  # [] for swiglu, [approximate] for geglu
    ctx.act = _ACTS[approximate[0]] if approximate else SILU


def _backward(ctx, kernels, dout):
    gate, up = ctx.saved_tensors
    dgate, *dup = kernels.bwd(dout, gate, up, ctx.act)
    return (dgate, dup[0] if dup else None) + (None,) * len(ctx.approximate)


def _double_backward(ctx, dout):
    gate, up = ctx.saved_tensors
    if ctx.approximate:
        return reference_vjp(geglu_reference, (gate, up, *ctx.approximate), (dout,))
    return reference_vjp(swiglu_reference, (gate, up), (dout,))


_GLU = dict(fake=_fake, setup_context=_setup_context, backward=_backward, bwd=glu_bwd, bwd_fake=_bwd_fake,
            double_backward=_double_backward, n_grad=2)
SWIGLU = Op("swiglu", swiglu_fwd, **_GLU)
GEGLU = Op("geglu", geglu_fwd, **_GLU)


SWIGLU_FP8 = fp8_rows_op("swiglu_fp8", swiglu_fp8_fwd, fake=_fake, setup_context=_setup_context, backward=_backward,
                        double_backward=_double_backward, bwd=glu_bwd, bwd_fake=_bwd_fake, n_grad=2)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``, the SwiGLU of Llama-style MLPs.

    gate, up: (..., H) of one dtype (float32, bfloat16 or float16), any strides; or ``up=None`` and
    gate the concatenated (..., 2H) output of a fused gate-up projection, gate in the first half.
    Returns (..., H) in the input dtype: activation and product in fp32, rounded once. The backward
    reads gate, up and the output gradient and recomputes silu (nothing extra is saved); with the
    concatenated layout it returns one (..., 2H) gradient.
    """
    return SWIGLU(gate, up)


def swiglu_fp8(gate: torch.Tensor, up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`swiglu` that also writes its output's float8_e4m3fn rows in the same pass: (h, q, scale), h as `swiglu`
    gives it, q (h.shape, e4m3) and scale (h.shape[:-1], fp32) equal to ``quantize_rows(h)`` bit for bit. What
    an fp8 down projection reading h would quantize, written while h is still in registers (one byte more per
    element instead of a second read of h and a launch). Rows wider than FP8_MAX_N take `swiglu` then
    `quantize_rows`. q and scale carry no gradient; h's backward is `swiglu`'s."""
    return SWIGLU_FP8(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(gate, approximate) * up`` with `approximate` 'tanh' (the default, as Liger's GeGLU) or
    'none' (exact erf), as `F.gelu`; shapes, dtypes, layouts and backward as `swiglu`."""
    if approximate not in _GELU:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return GEGLU(gate, up, approximate)


def _halves(gate, up):
    return (gate.chunk(2, dim=-1) if up is None else (gate, up))


def swiglu_reference(gate, up=None):
    g, u = _halves(gate, up)
    gf = g.float() if g.dtype != torch.float64 else g
    return (F.silu(gf) * u.to(gf.dtype)).to(g.dtype)


def geglu_reference(gate, up=None, approximate="tanh"):
    g, u = _halves(gate, up)
    gf = g.float() if g.dtype != torch.float64 else g
    return (F.gelu(gf, approximate=approximate) * u.to(gf.dtype)).to(g.dtype)


def _swiglu_eager(gate, up=None):
    g, u = _halves(gate, up)
    return F.silu(g) * u


def _geglu_eager(gate, up=None, approximate="tanh"):
    g, u = _halves(gate, up)
    return F.gelu(g, approximate=approximate) * u


def cost(gate: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "tanh",
         backward: bool = False) -> Cost:
    """Forward reads gate and up, writes out; backward reads gate, up, dout, writes dgate, dup."""
    n = gate.numel() if up is not None else gate.numel() // 2
    b = gate.element_size()
    return Cost(flops=(12.0 if backward else 6.0) * n, bytes=(5.0 if backward else 3.0) * n * b,
                dtype=dtype_key(gate.dtype))


def make_inputs(shape, dtype, device, generator=None):
    g = torch.randn(shape, dtype=dtype, device=device, generator=generator)
    u = torch.randn(shape, dtype=dtype, device=device, generator=generator)
    return (g, u), {}


def _liger_swiglu():
    fn = optional_import("liger_kernel.transformers.functional", "liger_swiglu")()
    return None if fn is None else (lambda gate, up=None: fn(*_halves(gate, up)))


def _liger_geglu():
    fn = optional_import("liger_kernel.transformers.functional", "liger_geglu")()
    if fn is None:
        return None

    def run(gate, up=None, approximate="tanh"):
        if approximate != "tanh":  # Liger computes the tanh approximation only
            raise NotImplementedError("Liger's GeGLU has only approximate='tanh'")
        return fn(*_halves(gate, up))
    return run


_COMMON = {"cost": cost, "make_inputs": make_inputs, "grad_args": (0, 1),
           "test_shapes": [(1, 1), (3, 7), (37, 1000), (5, 4097), (2, 3, 129)],
           "bench_shapes": [(8192, 14336), (4096, 11008), (16384, 8192)], "latency_shapes": [(1, 14336)]}
register(OpSpec(name="swiglu", fn=swiglu, reference=swiglu_reference, eager=_swiglu_eager,
                competitors={"liger": _liger_swiglu},
                replaces=("LlamaMLP.act", "SiLUAndMul", "aten::silu+aten::mul"),
                doc="silu(gate) * up, forward+backward, separate or concatenated gate/up.", **_COMMON))
# Liger's GeGLU is the tanh approximation, kernelkit's default: the benchmark compares like with like.
register(OpSpec(name="geglu", fn=geglu, reference=geglu_reference, eager=_geglu_eager,
                competitors={"liger": _liger_geglu},
                replaces=("GeluAndMul", "aten::gelu+aten::mul"),
                doc="gelu(gate) * up (tanh or erf), forward+backward.", **_COMMON))
