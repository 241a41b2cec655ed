"""MXFP8 (OCP Microscaling v1.0) encode and decode, below the op files: the element encoders, `mx_encode` (one
block's E8M0 scale and element bits, which the grouped GEMM's MXFP8-writing epilogue also calls), `e8m0_to_fp32`,
and the quantize / dequantize kernels with their launchers. The format and the conversion rules are written out in
ops/mxfp8.py, the public op over these launchers; gemm/fp8.py and gemm/grouped.py use them directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...runtime.alloc import empty
from ...runtime import autotune, cdiv, interpreting, launch, next_pow2
from .. import _validate

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
def encode_fp8(v, MBITS: tl.constexpr, BIAS: tl.constexpr):
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
        bits = encode_fp8(v, MBITS, BIAS)
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


def hw_cast() -> bool:
    return not interpreting()


def elem_format(elem_dtype):
    if elem_dtype not in ELEM_FORMATS:
        raise TypeError(f"elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem_dtype!r}")
    return ELEM_FORMATS[elem_dtype]


def validate_last_dim(x: torch.Tensor, name: str) -> int:
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"{name}'s last dim ({k}) must be divisible by the MX block size {BLOCK}; "
                         f"pad it to {cdiv(k, BLOCK) * BLOCK}")
    return k


def _grid(m, k):
    return lambda meta: (cdiv(m, meta["ROWS"]) * cdiv(k, meta["BLOCK_K"]),)


def quantize_fwd(x: torch.Tensor, elem_dtype=torch.float8_e4m3fn):
    """Launch the quantizer. Returns (data, scales)."""
    emax, mbits, bias, max_normal = elem_format(elem_dtype)
    _validate.tensor(x, "x", min_dim=1)
    k = validate_last_dim(x, "x")
    data = empty(x.shape, dtype=elem_dtype, device=x.device)
    scales = empty((*x.shape[:-1], k // BLOCK), dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        return data, scales
    x2 = _validate.rows_2d(x, k)
    d2, s2 = data.view(torch.uint8).view(-1, k), scales.view(-1, k // BLOCK)
    m = x2.shape[0]
    launch(mxfp8_quantize_kernel, _grid(m, k), (k, emax, hw_cast(), x.dtype),
           x2, d2, s2, m, k, x2.stride(0), d2.stride(0), s2.stride(0),
           EMAX=emax, MBITS=mbits, BIAS=bias, MAX_NORMAL=max_normal, HW_CAST=hw_cast())
    return data, scales


def dequantize_fwd(data: torch.Tensor, scales: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Launch the dequantizer. Returns data × X in out_dtype, NaN for NaN-scale blocks."""
    _validate.tensor(data, "data", dtypes=tuple(ELEM_FORMATS), min_dim=1)
    _validate.tensor(scales, "scales", dtypes=(torch.uint8,), min_dim=1)
    _validate.same_device(scales, "scales", data, "data")
    if out_dtype not in _validate.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of float32, bfloat16, float16, got {out_dtype!r}")
    k = validate_last_dim(data, "data")
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
    launch(mxfp8_dequantize_kernel, _grid(m, k), (k, bias, hw_cast(), out_dtype),
           d2, s2, o2, m, k, d2.stride(0), s2.stride(0), o2.stride(0), MBITS=mbits, BIAS=bias, HW_CAST=hw_cast())
    return out
