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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..roofline.model import Cost, dtype_key
from ..runtime.alloc import empty
from ..runtime import autotune, cdiv, interpreting, launch, next_pow2
from . import _validate
from ._dispatch import dispatch
from .registry import OpSpec, register

BLOCK = 32  # elements per shared scale (the MX block size)
E8M0_BIAS, E8M0_NAN = 127, 255
ELEM_NAN = 0x7F  # the NaN written for every element of a NaN-scale block
# element dtype -> (emax_elem, mantissa bits, exponent bias, max normal)
ELEM_FORMATS = {torch.float8_e4m3fn: (8, 3, 7, 448.0), torch.float8_e5m2: (15, 2, 15, 57344.0)}


def _configs():
    return [triton.Config({"ROWS": r, "BLOCK_K": bk}, num_warps=w)
            for bk in (1024, 256, 512, 2048, 4096) for r in (8, 1, 2, 4) for w in (4, 2, 8, 16)]


def _prune(configs, named_args, **kwargs):
    k = {**named_args, **kwargs}["K"]
    keep = [c for c in configs
            if c.kwargs["BLOCK_K"] <= max(256, next_pow2(k))
            and 1024 <= c.kwargs["ROWS"] * c.kwargs["BLOCK_K"] <= 16384
            and 8 <= c.kwargs["ROWS"] * c.kwargs["BLOCK_K"] / (32 * c.num_warps) <= 32]
    return keep or configs[:1]


@triton.jit
def _encode_fp8(v, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """Bits of the nearest-even FP8 (MBITS mantissa bits, exponent bias BIAS) of finite, in-range fp32 v."""
    a = v.to(tl.int32, bitcast=True)
    sign = (a >> 24) & 0x80
    a = a & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MBITS
    # Normal range: round the fp32 mantissa to MBITS bits (ties to even), then rebias the exponent.
    normal = ((a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MBITS)
    # Subnormal range: adding 2^(24 - BIAS - MBITS) makes the fp32 ulp equal the FP8 subnormal step,
    # so the fp32 add itself rounds to nearest-even; the low bits are then the FP8 code.
    MAGIC: tl.constexpr = 2.0 ** (24 - BIAS - MBITS)
    MAGIC_BITS: tl.constexpr = (151 - BIAS - MBITS) << 23
    sub = (a.to(tl.float32, bitcast=True) + MAGIC).to(tl.int32, bitcast=True) - MAGIC_BITS
    code = tl.where(a < ((128 - BIAS) << 23), sub, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _decode_fp8(bits, MBITS: tl.constexpr, BIAS: tl.constexpr):
    """fp32 value of FP8 bits (E4M3FN when BIAS == 7: 0x7F/0xFF are NaN; E5M2: IEEE-like Inf/NaN)."""
    b = bits.to(tl.int32)
    sign = (b & 0x80) << 24
    mag = b & 0x7F
    e = mag >> MBITS
    m = mag & ((1 << MBITS) - 1)
    if BIAS == 7:
        special = mag == 0x7F
        special_bits = 0x7FC00000
    else:
        special = e == 31
        special_bits = (0xFF << 23) | (m << (23 - MBITS))
    normal = (((e + 127 - BIAS) << 23) | (m << (23 - MBITS)))
    sub = (m.to(tl.float32) * (2.0 ** (1 - BIAS - MBITS))).to(tl.int32, bitcast=True)
    out = tl.where(special, special_bits, tl.where(e == 0, sub, normal))
    return (out | sign).to(tl.float32, bitcast=True)


@triton.jit
def _block_tile(M, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's (ROWS, BLOCK_K // 32, 32) tile of 32-element scale blocks, with its masks.

    Column chunks vary fastest, so consecutive programs stream consecutive memory; the block's 32
    elements are the contiguous innermost axis, so per-block reductions stay within a thread group.
    """
    NB: tl.constexpr = BLOCK_K // 32
    n_k = tl.cdiv(K, BLOCK_K)
    rows = ((tl.program_id(0) // n_k) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    blk = (tl.program_id(0) % n_k) * NB + tl.arange(0, NB)
    cols = blk[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    blk_ok = (rows < M)[:, None] & (blk < K // 32)[None, :]
    return rows, blk, cols, blk_ok, blk_ok[:, :, None]


@triton.jit
def mx_encode(x, EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_NORMAL: tl.constexpr,
              HW_CAST: tl.constexpr):
    """(element bits uint8, scale codes int32) of fp32 x shaped (..., blocks, 32): the section 6.3 conversion
    of each 32-element block (the quantizer's and the MoE SwiGLU epilogue's)."""
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=-1)
    exp = amax_bits >> 23  # biased exponent of the amax: 0 for zero/subnormal, 255 for Inf/NaN
    code = tl.where(exp == 255, 255, tl.maximum(exp - EMAX, 0))
    # 1 / X = 2^(127 - code): a normal fp32 for every finite code, so the scaling is exact.
    inv_scale = ((254 - tl.minimum(code, 254)) << 23).to(tl.float32, bitcast=True)
    v = x * tl.expand_dims(inv_scale, -1)
    v = tl.minimum(tl.maximum(v, -MAX_NORMAL), MAX_NORMAL)
    if HW_CAST:
        if BIAS == 7:
            bits = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            bits = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        bits = _encode_fp8(v, MBITS, BIAS)
    bits = tl.where(tl.expand_dims(code == 255, -1), 0x7F, bits).to(tl.uint8)  # ELEM_NAN
    return bits, code


@triton.jit
def e8m0_to_fp32(code):
    """X = 2^(code - 127) in fp32 for E8M0 codes: code 0 is the fp32 subnormal 2^-127, code 255 is NaN."""
    c = code.to(tl.int32)
    return tl.where(c == 255, 0x7FC00000, tl.where(c == 0, 0x00400000, c << 23)).to(tl.float32, bitcast=True)


@autotune(_configs(), key=["K", "EMAX", "HW_CAST"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def mxfp8_quantize_kernel(X, DATA, SCALES, M, K, stride_x, stride_d, stride_s,
                          EMAX: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_NORMAL: tl.constexpr,
                          HW_CAST: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, blk, cols, blk_ok, mask = _block_tile(M, K, ROWS, BLOCK_K)
    x = tl.load(X + rows[:, None, None] * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    bits, code = mx_encode(x, EMAX, MBITS, BIAS, MAX_NORMAL, HW_CAST)
    tl.store(DATA + rows[:, None, None] * stride_d + cols, bits, mask=mask)
    tl.store(SCALES + rows[:, None] * stride_s + blk[None, :], code.to(tl.uint8), mask=blk_ok)


@autotune(_configs(), key=["K", "BIAS", "HW_CAST"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def mxfp8_dequantize_kernel(DATA, SCALES, OUT, M, K, stride_d, stride_s, stride_o,
                            MBITS: tl.constexpr, BIAS: tl.constexpr, HW_CAST: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    rows, blk, cols, blk_ok, mask = _block_tile(M, K, ROWS, BLOCK_K)
    bits = tl.load(DATA + rows[:, None, None] * stride_d + cols, mask=mask, other=0)
    code = tl.load(SCALES + rows[:, None] * stride_s + blk[None, :], mask=blk_ok, other=127).to(tl.int32)
    if HW_CAST:
        if BIAS == 7:
            val = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            val = bits.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        val = _decode_fp8(bits, MBITS, BIAS)
    out = val * e8m0_to_fp32(code)[:, :, None]
    tl.store(OUT + rows[:, None, None] * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)


def _hw_cast() -> bool:
    return not interpreting()


def _elem_format(elem_dtype):
    if elem_dtype not in ELEM_FORMATS:
        raise TypeError(f"elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem_dtype!r}")
    return ELEM_FORMATS[elem_dtype]


def _check_last_dim(x: torch.Tensor, name: str) -> int:
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"{name}'s last dim ({k}) must be divisible by the MX block size {BLOCK}; "
                         f"pad it to {cdiv(k, BLOCK) * BLOCK}")
    return k


def _grid(m, k):
    return lambda meta: (cdiv(m, meta["ROWS"]) * cdiv(k, meta["BLOCK_K"]),)


def quantize_fwd(x: torch.Tensor, elem_dtype=torch.float8_e4m3fn):
    """Launch the quantizer. Returns (data, scales)."""
    emax, mbits, bias, max_normal = _elem_format(elem_dtype)
    _validate.tensor(x, "x", min_dim=1)
    k = _check_last_dim(x, "x")
    data = empty(x.shape, dtype=elem_dtype, device=x.device)
    scales = empty((*x.shape[:-1], k // BLOCK), dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        return data, scales
    x2 = _validate.rows_2d(x, k)
    d2, s2 = data.view(torch.uint8).view(-1, k), scales.view(-1, k // BLOCK)
    m = x2.shape[0]
    launch(mxfp8_quantize_kernel, _grid(m, k), (k, emax, _hw_cast(), x.dtype),
           x2, d2, s2, m, k, x2.stride(0), d2.stride(0), s2.stride(0),
           EMAX=emax, MBITS=mbits, BIAS=bias, MAX_NORMAL=max_normal, HW_CAST=_hw_cast())
    return data, scales


def dequantize_fwd(data: torch.Tensor, scales: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Launch the dequantizer. Returns data × X in out_dtype, NaN for NaN-scale blocks."""
    _validate.tensor(data, "data", dtypes=tuple(ELEM_FORMATS), min_dim=1)
    _validate.tensor(scales, "scales", dtypes=(torch.uint8,), min_dim=1)
    _validate.same_device(scales, "scales", data, "data")
    if out_dtype not in _validate.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of float32, bfloat16, float16, got {out_dtype!r}")
    k = _check_last_dim(data, "data")
    if scales.shape != (*data.shape[:-1], k // BLOCK):
        raise ValueError(f"scales must have shape {(*data.shape[:-1], k // BLOCK)} (one per 32 elements of "
                         f"data), got {tuple(scales.shape)}")
    _, mbits, bias, _ = ELEM_FORMATS[data.dtype]
    out = empty(data.shape, dtype=out_dtype, device=data.device)
    if data.numel() == 0:
        return out
    d2 = _validate.rows_2d(data.view(torch.uint8), k)
    s2 = _validate.rows_2d(scales, k // BLOCK)
    o2 = out.view(-1, k)
    m = d2.shape[0]
    launch(mxfp8_dequantize_kernel, _grid(m, k), (k, bias, _hw_cast(), out_dtype),
           d2, s2, o2, m, k, d2.stride(0), s2.stride(0), o2.stride(0), MBITS=mbits, BIAS=bias, HW_CAST=_hw_cast())
    return out


# --- torch.library custom ops: one graph node each under torch.compile (no autograd: quantization) ---

@torch.library.custom_op("kernelkit::mxfp8_quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, elem_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fwd(x, elem_dtype)


@_quantize_op.register_fake
def _(x, elem_dtype):
    _elem_format(elem_dtype)
    _check_last_dim(x, "x")
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
    emax, _, _, max_normal = _elem_format(elem_dtype)
    k = _check_last_dim(x, "x")
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
    k = _check_last_dim(data, "data")
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
