"""Gated linear units: SwiGLU silu(gate) * up and GeGLU gelu(gate) * up, forward and backward.

Elementwise and memory-bound: the floor reads gate and up once and writes the product once; the
backward reads gate, up and dout and writes dgate and dup, recomputing the activation instead of
saving it (saving would cost a write and a read of one more tensor). Gate and up come as two tensors
or as one (..., 2H) tensor with gate in the first half, as fused gate-up projections produce.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..roofline.model import Cost, dtype_key
from ..testing.poison import empty
from ..tune import autotune, launch
from . import _validate
from .registry import OpSpec, optional_import, register

SILU, GELU_TANH, GELU_ERF = 0, 1, 2
_ACTS = {"swiglu": SILU, "tanh": GELU_TANH, "none": GELU_ERF}
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
INV_SQRT_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr, NEED_GRAD: tl.constexpr):
    """Activation of g (fp32) and, when asked, its derivative."""
    if ACT == 0:  # silu
        sig = tl.sigmoid(g)
        a = g * sig
        da = sig * (1.0 + g * (1.0 - sig)) if NEED_GRAD else a
    elif ACT == 1:  # gelu, tanh approximation; tanh(u) written as 2*sigmoid(2u) - 1
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * g * g) \
            if NEED_GRAD else a
    else:  # gelu, exact (erf)
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327 if NEED_GRAD else a
    return a, da


def _configs():
    return [triton.Config({"BLOCK_H": b}, num_warps=w) for b in (1024, 2048, 4096) for w in (4, 8)]


@autotune(_configs(), key=["H", "ACT"])
@triton.jit
def glu_fwd_kernel(G, U, OUT, stride_g, stride_u, stride_o, H, ACT: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    g = tl.load(G + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT, False)
    tl.store(OUT + row * stride_o + cols, (a * u).to(OUT.dtype.element_ty), mask=m)


@autotune(_configs(), key=["H", "ACT"])
@triton.jit
def glu_bwd_kernel(DO, G, U, DG, DU, stride_do, stride_g, stride_u, stride_dg, stride_du, H,
                   ACT: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    do = tl.load(DO + row * stride_do + cols, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT, True)
    tl.store(DG + row * stride_dg + cols, (do * u * da).to(DG.dtype.element_ty), mask=m)
    tl.store(DU + row * stride_du + cols, (do * a).to(DU.dtype.element_ty), mask=m)


def _split(gate: torch.Tensor, up: torch.Tensor | None):
    """Row views (rows, H) of gate and up, unit stride along H."""
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(f"gate holds gate and up concatenated, so its last dim must be even, got {gate.shape[-1]}")
        h = gate.shape[-1] // 2
        gu = _validate.rows_2d(gate, 2 * h)
        return gu[:, :h], gu[:, h:], h
    _validate.tensor(up, "up")
    _validate.same_device(up, "up", gate, "gate")
    if up.shape != gate.shape:
        raise ValueError(f"up must have gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    if up.dtype != gate.dtype:
        raise TypeError(f"up has dtype {up.dtype} but gate has {gate.dtype}; use one dtype")
    h = gate.shape[-1]
    return _validate.rows_2d(gate, h), _validate.rows_2d(up, h), h


def _grid(rows, h):
    return lambda meta: (rows, triton.cdiv(h, meta["BLOCK_H"]))


def glu_fwd(gate: torch.Tensor, up: torch.Tensor | None, act: int) -> torch.Tensor:
    _validate.tensor(gate, "gate", min_dim=1)
    g2, u2, h = _split(gate, up)
    out_shape = (*gate.shape[:-1], h)
    out = empty(out_shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    o2 = out.view(-1, h)
    rows = g2.shape[0]
    launch(glu_fwd_kernel, _grid(rows, h), (h, act, gate.dtype), g2, u2, o2, g2.stride(0), u2.stride(0),
           o2.stride(0), h, ACT=act)
    return out


def glu_bwd(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None, act: int):
    """Returns (dgate, dup); with the concatenated layout dgate is the (..., 2H) gradient and dup None."""
    g2, u2, h = _split(gate, up)
    dgate = empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = empty(up.shape, dtype=up.dtype, device=up.device) if up is not None else None
    if dout.numel() == 0:
        return dgate, dup
    do2 = _validate.rows_2d(dout, h)
    if up is None:
        d2 = dgate.view(-1, 2 * h)
        dg2, du2 = d2[:, :h], d2[:, h:]
    else:
        dg2, du2 = dgate.view(-1, h), dup.view(-1, h)
    launch(glu_bwd_kernel, _grid(g2.shape[0], h), (h, act, gate.dtype, dout.dtype), do2, g2, u2, dg2, du2,
           do2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0), h, ACT=act)
    return dgate, dup


# --- custom ops (torch.compile) and the eager autograd path ---

@torch.library.custom_op("kernelkit::glu", mutates_args=())
def _glu_op(gate: torch.Tensor, up: torch.Tensor | None, act: int) -> torch.Tensor:
    return glu_fwd(gate, up, act)


@_glu_op.register_fake
def _(gate, up, act):
    h = gate.shape[-1] if up is not None else gate.shape[-1] // 2
    return gate.new_empty((*gate.shape[:-1], h))


@torch.library.custom_op("kernelkit::glu_bwd", mutates_args=())
def _glu_bwd_op(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None, act: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    dg, du = glu_bwd(dout, gate, up, act)
    return dg, (du if du is not None else gate.new_empty(0))


@_glu_bwd_op.register_fake
def _(dout, gate, up, act):
    return torch.empty_like(gate), (torch.empty_like(up) if up is not None else gate.new_empty(0))


def _setup_context(ctx, inputs, output):
    gate, up, act = inputs
    ctx.save_for_backward(gate, up)
    ctx.act = act


def _backward(ctx, dout):
    gate, up = ctx.saved_tensors
    dg, du = _glu_bwd_op(dout, gate, up, ctx.act)
    return dg, (du if up is not None else None), None


_glu_op.register_autograd(_backward, setup_context=_setup_context)


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act):
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return glu_fwd(gate, up, act)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dg, du = glu_bwd(dout, gate, up, ctx.act)
        return dg, du, None


def _dispatch(gate, up, act):
    if torch.compiler.is_compiling():
        return _glu_op(gate, up, act)
    return _GLUFunction.apply(gate, up, act)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up. gate, up: (..., H) of one float dtype; or gate alone as (..., 2H) = [gate | up].

    Returns (..., H). fp32 math, one rounding; the backward recomputes silu from gate.
    """
    return _dispatch(gate, up, SILU)


def geglu(gate: torch.Tensor, up: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up with `approximate` 'tanh' or 'none' (erf), as `F.gelu`; layouts as `swiglu`."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return _dispatch(gate, up, _ACTS[approximate])


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


def _liger(name):
    def load():
        fn = optional_import("liger_kernel.transformers.functional", name)()
        return None if fn is None else (lambda gate, up=None, **kw: fn(*_halves(gate, up)))
    return load


_COMMON = dict(cost=cost, make_inputs=make_inputs, grad_args=(0, 1),
               test_shapes=[(1, 1), (3, 7), (37, 1000), (5, 4097), (2, 3, 129)],
               bench_shapes=[(8192, 14336), (4096, 11008), (16384, 8192)], latency_shapes=[(1, 14336)])
register(OpSpec(name="swiglu", fn=swiglu, reference=swiglu_reference, eager=_swiglu_eager,
                competitors={"liger": _liger("liger_swiglu")},
                replaces=("LlamaMLP.act", "SiLUAndMul", "aten::silu+aten::mul"),
                doc="silu(gate) * up, forward+backward, separate or concatenated gate/up.", **_COMMON))
# Liger's GeGLU uses the tanh approximation, the default here.
register(OpSpec(name="geglu", fn=geglu, reference=geglu_reference, eager=_geglu_eager,
                competitors={"liger": _liger("liger_geglu")},
                replaces=("GeluAndMul", "aten::gelu+aten::mul"),
                doc="gelu(gate) * up (tanh or erf), forward+backward.", **_COMMON))
