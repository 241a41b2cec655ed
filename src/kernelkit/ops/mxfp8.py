"""MXFP8 quantize / dequantize per the OCP Microscaling Formats (MX) v1.0 spec.

Format (spec sections 5 and 6.3): blocks of 32 consecutive elements along the last dim share one
E8M0 scale X = 2^shared_exp, stored as its biased exponent in a uint8 (bias 127, 255 = NaN);
elements are FP8 E4M3 (``torch.float8_e4m3fn``) or E5M2 (``torch.float8_e5m2``).

Conversion (section 6.3), with emax_elem = 8 (E4M3) or 15 (E5M2):
  shared_exp = floor(log2(max_i |V_i|)) - emax_elem, clamped below to -127 (so an all-zero block
               gets scale code 0); a block whose max is NaN or ±Inf gets the NaN scale (255):
               floor(log2(Inf)) overflows E8M0, which has no Inf (the rule of the MX authors'
               reference emulation, microsoft/microxcaling: shared_exp > 127 -> NaN),
  P_i        = V_i / X rounded to nearest-even in the element format; normal values beyond the
               element's max normal (448 or 57344) are clamped to it (saturating, as the spec says).
Elements of a NaN-scale block are all stored as NaN (0x7F): the spec makes the whole block NaN.

Layout: ``data`` has x's shape; ``scales`` has shape (..., K // 32), row-major, one byte per block,
unswizzled (no tensor-core tiling of the scales).

Memory-bound: x is read once, data and scales written once. The amax is taken on the integer
bits of |x| (exact, and NaN/Inf land above every finite value), so the scale needs no log2.
On a GPU elements go through the hardware's saturating round-to-nearest-even FP8 convert; under the
Triton interpreter, whose FP8 casts do not round correctly, the kernel encodes the bits itself.
The kernels and their launchers live in gemm/mx.py, where the fp8 MoE's grouped GEMM shares the encoder.
"""

from __future__ import annotations

import torch

from ..roofline.model import Cost, dtype_key
from ._dispatch import dispatch
from .gemm.mx import (BLOCK, E8M0_BIAS, E8M0_NAN, ELEM_FORMATS, ELEM_NAN, dequantize_fwd,  # noqa: F401
                      elem_format, quantize_fwd, validate_last_dim)
from .registry import OpSpec, register


# --- torch.library custom ops: one graph node each under torch.compile (no autograd: quantization) ---

@torch.library.custom_op("kernelkit::mxfp8_quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, elem_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fwd(x, elem_dtype)


@_quantize_op.register_fake
def _(x, elem_dtype):
    elem_format(elem_dtype)
    validate_last_dim(x, "x")
    return (x.new_empty(x.shape, dtype=elem_dtype),
            x.new_empty((*x.shape[:-1], x.shape[-1] // BLOCK), dtype=torch.uint8))


@torch.library.custom_op("kernelkit::mxfp8_dequantize", mutates_args=())
def _dequantize_op(data: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fwd(data, scales, out_dtype)


@_dequantize_op.register_fake
def _(data, scales, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


def mxfp8_quantize(x: torch.Tensor, elem_dtype: torch.dtype = torch.float8_e4m3fn):
    """Quantize x to MXFP8. Returns (data, scales).

    x: (..., K) in float32, bfloat16 or float16, K divisible by 32, any strides (a unit stride along K
    avoids a copy). data: x's shape in ``elem_dtype`` (float8_e4m3fn or float8_e5m2), contiguous.
    scales: (..., K // 32) uint8 E8M0 biased exponents (X = 2^(s - 127), 255 = NaN), row-major,
    unswizzled. One pass: block amax, scale and saturating round-to-nearest-even cast fused.
    """
    return dispatch(_quantize_op, quantize_fwd, None, 0, (x, elem_dtype))  # no gradient: nothing to record


def mxfp8_dequantize(data: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16):
    """Dequantize MXFP8: ``data × 2^(scales - 127)`` per 32-element block, computed in fp32, rounded
    once to ``out_dtype`` (float32, bfloat16 or float16); blocks with scale 255 come back NaN.
    data: (..., K) float8_e4m3fn or float8_e5m2; scales: (..., K // 32) uint8."""
    return dispatch(_dequantize_op, dequantize_fwd, None, 0, (data, scales, out_dtype))


def reference_quantize(x: torch.Tensor, elem_dtype: torch.dtype = torch.float8_e4m3fn):
    """The spec's conversion (section 6.3) in plain PyTorch: returns (data, scales) like mxfp8_quantize."""
    emax, _, _, max_normal = elem_format(elem_dtype)
    k = validate_last_dim(x, "x")
    blocks = x.detach().double().reshape(*x.shape[:-1], k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # floor(log2(amax)) from frexp (amax = m·2^e, m in [0.5, 1)): exact on every device, where log2 is not
    # (CUDA's fp64 log2 returns just under k for some amax = 2^k). A zero amax clamps to -127.
    e = torch.frexp(amax).exponent.double() - 1
    shared = torch.where(amax == 0, -float("inf"), e - emax).clamp(min=-E8M0_BIAS)
    nan_block = ~torch.isfinite(amax) | (shared > E8M0_BIAS)  # NaN, or Inf / out of E8M0 range
    shared = torch.where(nan_block, 0.0, shared)
    p = (blocks / torch.exp2(shared)).clamp(-max_normal, max_normal)
    bits = p.float().to(elem_dtype).view(torch.uint8)
    bits = torch.where(nan_block, ELEM_NAN, bits).to(torch.uint8)
    scales = torch.where(nan_block, E8M0_NAN, shared + E8M0_BIAS).squeeze(-1).to(torch.uint8)
    return bits.reshape(x.shape).view(elem_dtype), scales


def reference_dequantize(data: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16):
    """``data × 2^(scales - 127)`` in fp32 (NaN where the scale is 255), rounded once to out_dtype."""
    k = validate_last_dim(data, "data")
    one = torch.ones(scales.shape, dtype=torch.float32, device=data.device)
    x = torch.ldexp(one, scales.to(torch.int32) - E8M0_BIAS)
    x = torch.where(scales == E8M0_NAN, float("nan"), x)
    out = data.float().reshape(*data.shape[:-1], k // BLOCK, BLOCK) * x[..., None]
    return out.reshape(data.shape).to(out_dtype)


def cost(x: torch.Tensor, elem_dtype=torch.float8_e4m3fn, backward: bool = False) -> Cost:
    """Ideal traffic: x read once, one byte per element and one per 32-element block written."""
    n = x.numel()
    return Cost(flops=4.0 * n, bytes=n * x.element_size() + n + n / BLOCK, dtype=dtype_key(x.dtype))


def make_inputs(shape, dtype, device, generator=None):
    """Normal values with a per-block power-of-two spread of 2^±12, so blocks get different scales."""
    x = torch.randn(shape, dtype=torch.float32, device=device, generator=generator)
    spread = torch.randint(-12, 13, (*shape[:-1], shape[-1] // BLOCK, 1), device=device, generator=generator)
    x = (x.reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK) * torch.exp2(spread.float())).reshape(shape)
    return (x.to(dtype),), {}


register(OpSpec(
    name="mxfp8_quantize", fn=mxfp8_quantize, reference=reference_quantize, cost=cost, make_inputs=make_inputs,
    test_shapes=[(3, 32), (37, 96), (5, 4096), (2, 3, 160)],
    bench_shapes=[(16384, 4096), (8192, 8192), (16384, 14336)],
    latency_shapes=[(1, 4096)],
    tolerances={"float32": 0.0, "bfloat16": 0.0, "float16": 0.0},
    eager=reference_quantize,
    replaces=("to_mx",),
    doc="MXFP8 (OCP MX v1.0) quantization: E8M0 scale per 32 elements, E4M3/E5M2 elements, saturating RNE.",
))
