"""Scaled FP8 GEMM: out = (a · scale_a) @ (b · scale_b) + bias, fp8 operands on the tensor cores, fp32 accumulation.

The contract is `torch._scaled_mm`'s where the two overlap: a (M, K) and b (K, N) in float8_e4m3fn or
float8_e5m2, float32 *dequantization* scales, a bias (N,), a bf16/fp16/fp32 output. Each operand's scale is
read off its shape:

  scale_a                     scale_b                     recipe (Kb = ceil(K/128))
  (), (1,) or (1, 1)          (), (1,) or (1, 1)          tensorwise: one scale per operand
  (M, 1)                      (1, N)                      rowwise: one per row of a, one per column of b
  (M, Kb)                     (Kb, N)                     1x128 blocks of a (DeepSeek-V3's activations), 128x1 of b
  (ceil(M/128), Kb)           (Kb, ceil(N/128))           128x128 blocks (DeepSeek-V3's weights)

in any pairing of the two sides (torch takes tensorwise, rowwise, and 1x128 with 128x128 or 1x128).

Where the scales are constant along K (tensorwise, rowwise), the kernel is a plain fp8 GEMM whose epilogue
multiplies the fp32 accumulator by scale_a[row] · scale_b[col]. A scale that changes along K cannot wait for
the epilogue: each K tile (128 wide on the GPU) computes its partial product on the tensor cores and adds it,
times the scales of its 128-block, to the fp32 accumulator in registers (DeepSeek-V3's recipe).

Precision: Hopper's fp8 MMA sums in fewer bits than fp32. ``use_fast_accum=False`` (torch's default) adds each
K tile's partial product to the fp32 accumulator with a CUDA-core FMA, as the block-scaled path does anyway
(DeepSeek-V3's promotion every 128 of K); ``True`` lets the tensor cores accumulate across all of K (Triton's
sm_90 default, and faster: the next tile's MMA need not wait for the add). On Hopper, precise and block-scaled
calls with TMA-ready operands run the warp-specialized Gluon kernel of gemm/precise.py instead, whose
two consumer warpgroups hide each other's adds (measured in its docstring); this file's Triton kernel serves
the rest (fast accumulation, other layouts, other GPUs, the interpreter).

Operands are read through their strides (torch needs b column-major, i.e. w.t() of a (N, K) weight; here a
row-major b and padded or sliced views work as they are). On sm_90 operands whose base and strides are
16-byte aligned with a unit inner stride go through TMA tensor descriptors; everything else (and the
interpreter) through masked pointer loads.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from .. import switches
from ..roofline.model import Cost
from ..runtime.alloc import empty
from ..runtime import autotune, cdiv, ensure_tma_allocator, interpreting, launch, next_pow2, num_sms
from . import _validate
from ._dispatch import dispatch
from .gemm.tiles import grouped_tile, tile_configs
from .registry import OpSpec, register

try:  # the Hopper precise-mode kernel is written in Gluon (Triton 3.6+)
    from .gemm import precise as _precise
except ImportError:  # pragma: no cover - an older Triton: the Triton kernel serves every call
    _precise = None

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
SCALE_BLOCK = 128  # DeepSeek-V3's quantization block: 1x128 of activations, 128x128 of weights
K_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)
# None: TMA descriptors on sm_90+ where every operand allows them, pointers elsewhere. Tests force either
# (True takes TMA wherever the layout allows it, also in the interpreter).
USE_TMA: Optional[bool] = None
TMA_ALIGN = 16  # bytes: a TMA descriptor's base address and outer strides
# The Gluon kernel for precise mode (gemm/precise.py); KERNELKIT_FP8_GLUON=0 keeps every call on Triton.
GLUON_PRECISE = switches.on("KERNELKIT_FP8_GLUON")


def _configs() -> list:
    # The interpreter runs only the first: small tiles keep several programs per test shape and, with
    # BLOCK_K = 64, two K steps per 128-block of block scales. The rest (the GPU's) are Hopper tiles
    # with BLOCK_K = 128 (one block-scale step per iteration; 128 bytes of fp8 per row, a full swizzle line),
    # 3-4 stages of shared-memory pipelining (128x256x128 is 48 KiB a stage). Tiles of 64 rows keep 2-3 CTAs
    # on an SM, which hides the wait for each K tile's product on the paths that add it on the CUDA cores.
    return tile_configs(((32, 32, 64, 3, 4, 2), (128, 256, 128, 3, 8), (256, 128, 128, 3, 8), (128, 128, 128, 4, 8),
                         (128, 128, 128, 3, 8), (128, 128, 128, 4, 4), (128, 256, 128, 4, 8), (64, 256, 128, 3, 8),
                         (64, 128, 128, 4, 4), (64, 128, 128, 3, 4), (128, 64, 128, 4, 4), (64, 64, 128, 4, 4)))


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    m_bucket, n = args["M_BUCKET"], args["N"]
    keep = []
    for c in configs[1:]:  # the first is the interpreter's
        bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        per_thread = bm * bn // (32 * c.num_warps)  # fp32 accumulator registers per thread
        if args["K_BLOCKED"] and SCALE_BLOCK % bk:
            continue  # a K tile must not straddle a scale block
        if (args["K_BLOCKED"] or not args["FAST_ACCUM"]) and per_thread > 64:
            continue  # a K tile's partial product beside the accumulator: twice the registers (ptxas: spills)
        if per_thread > 128 or bm > max(64, m_bucket) or bn > max(64, next_pow2(n)):
            continue  # spills, or a tile mostly past the matrix
        keep.append(c)
    return keep or configs[-1:]


@triton.jit
def _scale_slice(S, start, idx, n, stride, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """The scales of the BLOCK rows (or columns) idx = start + arange(BLOCK) along one K block: GROUP
    consecutive rows share a scale (0: the whole tensor shares one). Always a (BLOCK,) fp32 vector."""
    if GROUP == 0:
        return tl.zeros((BLOCK,), dtype=tl.float32) + tl.load(S)
    elif GROUP % BLOCK == 0:  # the tile sits inside one scale group (tiles start at multiples of BLOCK)
        return tl.zeros((BLOCK,), dtype=tl.float32) + tl.load(S + (start // GROUP) * stride)
    else:
        return tl.load(S + (idx // GROUP) * stride, mask=idx < n, other=0.0)


@autotune(_configs(), key=["M_BUCKET", "N", "K", "A_GROUP", "B_GROUP", "K_BLOCKED", "FAST_ACCUM", "USE_TMA",
                           "B_K_MAJOR", "HAS_BIAS"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def scaled_matmul_kernel(A, B, C, SCALE_A, SCALE_B, BIAS,
                         stride_am, stride_ak,  # a (M, K), fp8
                         stride_bk, stride_bn,  # b (K, N), fp8
                         stride_cm, stride_cn,  # out (M, N)
                         stride_sam, stride_sak,  # scale_a: (row or 128-row block, 128-K block)
                         stride_sbk, stride_sbn,  # scale_b: (128-K block, column or 128-column block)
                         stride_bias,
                         M, N, K, M_BUCKET,
                         A_GROUP: tl.constexpr, B_GROUP: tl.constexpr, K_BLOCKED: tl.constexpr,
                         HAS_BIAS: tl.constexpr, FAST_ACCUM: tl.constexpr, USE_TMA: tl.constexpr,
                         B_K_MAJOR: tl.constexpr, NUM_SMS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Persistent: one program per SM (NUM_SMS programs) walks the output tiles in grouped order, so the next
    # tile's loads overlap this tile's epilogue; the descriptors are made once per program.
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    if USE_TMA:  # out-of-bounds boxes read as zeros: no masks
        a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
        if B_K_MAJOR:  # b = w.t(): the descriptor walks w (N, K)
            b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[stride_bn, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(B, shape=[K, N], strides=[stride_bk, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = grouped_tile(tile, grid_m, grid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N

        rm = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        a_rows = A + rm[:, None] * stride_am
        b_cols = B + rn[None, :] * stride_bn
        if not K_BLOCKED and not FAST_ACCUM:  # scale_a multiplies every K tile's partial product (below)
            sa = _scale_slice(SCALE_A, m0, rm, M, stride_sam, A_GROUP, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if USE_TMA:
                a = a_desc.load([m0, k0])
                if B_K_MAJOR:
                    b = b_desc.load([n0, k0]).T
                else:
                    b = b_desc.load([k0, n0])
            else:
                kk = (k0 + rk).to(tl.int64)  # a column-major a has stride_ak = M: k * M can pass 2^31
                k_ok = kk < K
                a = tl.load(a_rows + kk[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_cols + kk[:, None] * stride_bk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if K_BLOCKED:
                # The fp32 partial product of this K tile, times the scales of the 128-block it lies in.
                kb = k0 // K_SCALE_BLOCK
                sa_k = _scale_slice(SCALE_A + kb * stride_sak, m0, rm, M, stride_sam, A_GROUP, BLOCK_M)
                sb_k = _scale_slice(SCALE_B + kb * stride_sbk, n0, rn, N, stride_sbn, B_GROUP, BLOCK_N)
                acc += tl.dot(a, b) * (sa_k[:, None] * sb_k[None, :])
            elif FAST_ACCUM:
                acc = tl.dot(a, b, acc)
            else:
                # Promoted every K tile: the tile's partial product is its own fp32 add. Multiplied by scale_a, as
                # `acc + dot(a, b)` alone would be folded back into one long tensor-core accumulation.
                acc += tl.dot(a, b) * sa[:, None]

        if not K_BLOCKED:  # scales constant along K, read after the loop: no registers held through it
            if FAST_ACCUM:
                acc = acc * _scale_slice(SCALE_A, m0, rm, M, stride_sam, A_GROUP, BLOCK_M)[:, None]
            acc = acc * _scale_slice(SCALE_B, n0, rn, N, stride_sbn, B_GROUP, BLOCK_N)[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + rn * stride_bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(C + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(C.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


# --- launcher ---

def _scaling(scale, name: str, side: str, rows: int, k: int) -> tuple[str, int, int, int, bool]:
    """How `scale` maps onto a's rows (side "a", rows = M) or b's columns (side "b", rows = N), from its shape:
    (recipe, group, stride along rows, stride along K blocks, whether it changes along K). `group` rows share
    a scale (0: all of them). Shapes that two recipes share (M = 1, or K <= 128) mean the same under either."""
    kb, rb = cdiv(k, SCALE_BLOCK), cdiv(rows, SCALE_BLOCK)
    shape = tuple(scale.shape)
    if scale.numel() == 1 and scale.dim() <= 2:
        return "tensorwise", 0, 0, 0, False
    if scale.dim() == 2:
        outer, inner = shape if side == "a" else shape[::-1]
        s_outer, s_inner = scale.stride() if side == "a" else scale.stride()[::-1]
        if inner == 1 and outer == rows:
            return "rowwise", 1, s_outer, 0, False
        if inner == kb and outer in (rows, rb):
            group = 1 if outer == rows else SCALE_BLOCK
            recipe = ("1x128" if side == "a" else "128x1") if group == 1 else "128x128"
            return recipe, group, s_outer, s_inner, kb > 1
    if side == "a":
        shapes = (((rows, 1), "rowwise"), ((rows, kb), "1x128 blocks"), ((rb, kb), "128x128 blocks"))
        of = f"a of shape ({rows}, {k})"
    else:
        shapes = (((1, rows), "one per column"), ((kb, rows), "128x1 blocks"), ((kb, rb), "128x128 blocks"))
        of = f"b of shape ({k}, {rows})"
    recipes: dict = {}  # K <= 128 (or 128 rows or fewer) gives recipes one shape: list it once
    for s, recipe in shapes:
        recipes.setdefault(s, []).append(recipe)
    allowed = ["() or (1,) (tensorwise)"] + [f"{s} ({' / '.join(r)})" for s, r in recipes.items()]
    raise ValueError(f"{name} must have shape {', '.join(allowed[:-1])} or {allowed[-1]} for {of}; got {shape}")


def _check(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum):
    """Validate the arguments once; returns (M, K, N, scaling of a, scaling of b)."""
    _validate.tensor(a, "a", dtypes=FP8_DTYPES, min_dim=2)
    _validate.tensor(b, "b", dtypes=FP8_DTYPES, min_dim=2)
    _validate.same_device(b, "b", a, "a")
    if a.dim() != 2 or b.dim() != 2:
        bad, t = ("a", a) if a.dim() != 2 else ("b", b)
        raise ValueError(f"{bad} must be 2-D ((M, K) for a, (K, N) for b), got shape {tuple(t.shape)}")
    m, k = a.shape
    if b.shape[0] != k:
        raise ValueError(f"b must have shape ({k}, N) to match a's K = {k} (torch._scaled_mm's (K, N); for a "
                         f"weight w of shape (N, K), pass w.t()), got {tuple(b.shape)}")
    n = b.shape[1]
    if a.is_cuda and torch.cuda.get_device_capability(a.device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(a.device)
        raise TypeError(f"a and b are fp8, whose tensor-core GEMM needs compute capability 8.9+ (Ada, Hopper); "
                        f"{a.device} is sm_{major}{minor}")
    for s, name in ((scale_a, "scale_a"), (scale_b, "scale_b")):
        if not isinstance(s, torch.Tensor):  # numbers too: torch._scaled_mm takes only tensors
            kind = type(s).__name__ if type(s).__module__ == "builtins" else f"{type(s).__module__}.{type(s).__name__}"
            raise TypeError(f"{name} must be a float32 torch.Tensor (as torch._scaled_mm's), got {kind}: pass "
                            f"torch.tensor({name}, dtype=torch.float32, device=a.device)")
        _validate.tensor(s, name, dtypes=(torch.float32,))
        _validate.same_device(s, name, a, "a")
    sa = _scaling(scale_a, "scale_a", "a", m, k)
    sb = _scaling(scale_b, "scale_b", "b", n, k)
    if bias is not None:
        _validate.tensor(bias, "bias")
        _validate.same_device(bias, "bias", a, "a")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},) to match b's N, got {tuple(bias.shape)}")
    if out_dtype not in _validate.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of torch.bfloat16, torch.float16, torch.float32, got {out_dtype!r}")
    if not isinstance(use_fast_accum, bool):
        raise TypeError(f"use_fast_accum must be a bool, got {type(use_fast_accum).__name__}")
    if torch.is_grad_enabled():
        for t, name in ((a, "a"), (b, "b"), (scale_a, "scale_a"), (scale_b, "scale_b"), (bias, "bias")):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name} requires grad, but kernelkit.scaled_matmul has no backward (fp8 GEMMs "
                                 f"serve inference and the forward of fp8 training recipes); pass {name}.detach() "
                                 f"or call it under torch.no_grad()")
    return m, k, n, sa, sb


def _tma_layout(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, bool]:
    """(use TMA, b is K-major): descriptors need a unit inner stride, 16-byte aligned bases and outer strides."""
    b_k_major = b.stride(0) == 1 and (b.shape[1] == 1 or b.stride(1) != 1)
    if USE_TMA is False or USE_TMA is None and (interpreting() or not a.is_cuda
                                               or torch.cuda.get_device_capability(a.device)[0] < 9):
        return False, b_k_major
    b_outer = b.stride(1) if b_k_major else b.stride(0)
    ok = (a.stride(1) == 1 and (b_k_major or b.stride(1) == 1) and a.shape[1] > 0
          and all(p % TMA_ALIGN == 0 for p in (a.data_ptr(), b.data_ptr()))
          and all(s > 0 and s % TMA_ALIGN == 0 for s in (a.stride(0), b_outer)))  # fp8: bytes = elements
    if ok and a.is_cuda:
        ensure_tma_allocator()
    return ok, b_k_major


def scaled_matmul_fwd(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                      use_fast_accum: bool = False) -> torch.Tensor:
    """Launch the scaled GEMM. Returns out (M, N) in out_dtype."""
    m, k, n, (_, a_group, s_am, s_ak, a_kb), (_, b_group, s_bn, s_bk, b_kb) = _check(
        a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
    out = empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # an empty sum: the block scales have no column to read
        return out.copy_(bias.expand(m, n)) if bias is not None else out.zero_()
    tma, b_k_major = _tma_layout(a, b)
    k_blocked = a_kb or b_kb
    if ((not use_fast_accum or k_blocked) and tma and b_k_major and _precise is not None and GLUON_PRECISE
            and _precise.supports(a, b, out_dtype)):
        # Precise mode (and block scales, which promote every K tile in either mode) on Hopper: the
        # warp-specialized Gluon kernel, whose two consumer warpgroups hide each other's fp32 promotions
        # (0.90-0.96x torch._scaled_mm tensorwise; the Triton kernel 0.67-0.76x).
        _precise.launch_precise(a, b, out, scale_a, scale_b, bias, (a_group, s_am, s_ak, a_kb),
                                (b_group, s_bn, s_bk, b_kb), num_sms(a.device))
        return out
    bias_arg = bias if bias is not None else scale_a  # dummy pointer, never read
    m_bucket = next_pow2(m)
    sms = num_sms(a.device)
    grid = lambda meta: (min(sms, cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"])),)  # noqa: E731
    launch(scaled_matmul_kernel, grid,
           (m_bucket, n, k, a.dtype, b.dtype, out_dtype, bias_arg.dtype, a_group, b_group, k_blocked, use_fast_accum,
            tma, b_k_major, bias is not None, sms),
           a, b, out, scale_a, scale_b, bias_arg,
           a.stride(0), a.stride(1),
           b.stride(0), b.stride(1),
           out.stride(0), out.stride(1),
           s_am, s_ak,
           s_bk, s_bn,
           bias.stride(0) if bias is not None else 0,
           m, n, k, m_bucket,
           A_GROUP=a_group, B_GROUP=b_group, K_BLOCKED=k_blocked, HAS_BIAS=bias is not None,
           FAST_ACCUM=use_fast_accum, USE_TMA=tma, B_K_MAJOR=b_k_major, NUM_SMS=sms)
    return out


# --- torch.library custom op: one graph node under torch.compile (no autograd: see _check) ---

@torch.library.custom_op("kernelkit::scaled_matmul", mutates_args=())
def _scaled_matmul_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      bias: Optional[torch.Tensor], out_dtype: torch.dtype, use_fast_accum: bool) -> torch.Tensor:
    return scaled_matmul_fwd(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)


@_scaled_matmul_op.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum):
    m, _, n, _, _ = _check(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
    return a.new_empty((m, n), dtype=out_dtype)


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16, *,
                  use_fast_accum: bool = False) -> torch.Tensor:
    """``(a · scale_a) @ (b · scale_b) + bias`` on fp8 tensor cores, fp32 accumulation, rounded once to out_dtype.

    a: (M, K), b: (K, N), each float8_e4m3fn or float8_e5m2 (they may differ), any strides (torch._scaled_mm's
    b is column-major: ``w.t()`` of a (N, K) weight). scale_a, scale_b: float32 dequantization scale tensors
    (not Python or numpy numbers, which torch._scaled_mm refuses too) whose shapes pick the recipe per side:
    (), (1,) or (1, 1) tensorwise (the same launch for the three); (M, 1) / (1, N) rowwise; (M, ceil(K/128))
    1x128 blocks of a and (ceil(K/128), ceil(N/128)) 128x128 blocks of b (DeepSeek-V3), or (ceil(M/128),
    ceil(K/128)) / (ceil(K/128), N).
    bias: (N,) float32, bfloat16 or float16, added in fp32. out_dtype: bfloat16 (default), float16 or float32.
    use_fast_accum, a bool (numpy's bool too), as torch's: True leaves the tensor cores' sums in their
    reduced precision across all of K (faster); block-scaled calls promote them every 128 of K anyway.

    No autograd: an input that requires grad (with grad mode on) raises.
    """
    if isinstance(use_fast_accum, np.bool_):  # a flag read from an array; the custom op's schema takes a bool
        use_fast_accum = bool(use_fast_accum)
    return dispatch(_scaled_matmul_op, scaled_matmul_fwd, None, 0,
                    (a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum))


def rowwise_gemm(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                 bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """(a_q * a_s[:, None]) @ (b_q * b_s[:, None]).T: both e4m3 operands K-contiguous (rows of K), one scale per
    row of each (the rowwise recipe of fp8 training: fp8_linear's three GEMMs, the fp8 LM head's two)."""
    return scaled_matmul(a_q, b_q.t(), a_s[:, None], b_s[None, :], bias, out_dtype)


def fp8_device_unsupported(t: torch.Tensor) -> Optional[str]:
    """Why `t`'s device cannot run fp8 GEMMs (None when it can): a GPU below compute capability 8.9, or a CPU
    tensor outside the Triton interpreter."""
    if t.is_cuda:
        major, minor = torch.cuda.get_device_capability(t.device)
        if (major, minor) < (8, 9):
            return f"compute capability {major}.{minor} has no fp8 tensor cores (8.9+: Ada, Hopper, Blackwell)"
    elif not interpreting():
        return "CPU tensor outside the Triton interpreter"
    return None


# --- quantization (plain PyTorch, for tests and benchmarks), reference, cost, registry ---

def quantize(x: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float8_e4m3fn):
    """fp8 quantization of a 2-D x with one scale per block of (rows, cols) (0: the whole dim), in plain PyTorch.

    Returns (q, scale): scale = amax / the fp8 max (float32, shape (ceil(R / rows), ceil(C / cols))), q = x /
    scale rounded to `dtype`, saturating; q · scale ≈ x. (1, 128) and (128, 128) are DeepSeek-V3's blocks of
    activations and weights; (1, 0) rowwise; (0, 0) tensorwise."""
    r, c = x.shape
    br, bc = block[0] or max(r, 1), block[1] or max(c, 1)
    nr, nc = cdiv(r, br), cdiv(c, bc)
    xf = x.detach().float()
    padded = torch.nn.functional.pad(xf, (0, nc * bc - c, 0, nr * br - r))
    amax = padded.abs().reshape(nr, br, nc, bc).amax(dim=(1, 3))
    scale = (amax / FP8_MAX[dtype]).clamp_min(1e-12)
    full = scale.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]
    q = (xf / full).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return q, scale


def _dequantized(x: torch.Tensor, scale: torch.Tensor, recipe: tuple, side: str) -> torch.Tensor:
    """x (a, or b transposed to (N, K)) times its scale broadcast to every element, in float64."""
    _, group, _, _, _ = recipe
    rows, k = x.shape
    s = scale.detach().double().reshape(1, 1) if group == 0 else scale.detach().double()
    if side == "b" and group != 0:
        s = s.t()
    row_idx = torch.arange(rows, device=x.device) // group if group else torch.zeros(rows, dtype=torch.long,
                                                                                      device=x.device)
    k_idx = (torch.arange(k, device=x.device) // SCALE_BLOCK).clamp_max(s.shape[1] - 1)
    return x.double() * s[row_idx][:, k_idx]


def reference(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, *, use_fast_accum=False):
    """Plain PyTorch, in float64: the dequantized product plus bias. Float64 operands (the correctness harness
    dequantizes the fp8 values exactly) give a float64 result; fp8 operands a result in out_dtype."""
    m, k = a.shape
    n = b.shape[1]
    sa = _scaling(scale_a, "scale_a", "a", m, k)
    sb = _scaling(scale_b, "scale_b", "b", n, k)
    out = _dequantized(a, scale_a, sa, "a") @ _dequantized(b.t(), scale_b, sb, "b").t()
    if bias is not None:
        out = out + bias.double()
    return out if a.dtype == torch.float64 else out.to(out_dtype)


def torch_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, *, use_fast_accum=False):
    """torch._scaled_mm with this op's arguments (the "eager" row): cuBLAS; raises where torch lacks the
    recipe or layout (it wants b column-major, sizes divisible by 16, tensorwise or rowwise on both sides,
    or its blockwise pairs)."""
    return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def cost(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, *, use_fast_accum=False,
         backward: bool = False) -> Cost:
    """2·M·N·K FLOPs on the fp8 peak; ideal bytes: a, b, the scales and bias read once, the output written once."""
    m, k = a.shape
    n = b.shape[1]
    read = sum(t.numel() * t.element_size() for t in (a, b, scale_a, scale_b, bias) if t is not None)
    out_es = torch.empty(0, dtype=out_dtype).element_size()
    return Cost(flops=2.0 * m * n * k, bytes=read + m * n * out_es, dtype="fp8")


_RECIPES = {"tensorwise": ((0, 0), (0, 0)), "rowwise": ((1, 0), (1, 0)), "blockwise": ((1, 128), (128, 128))}


def make_inputs(shape, dtype, device, generator=None):
    """shape = (M, K, N[, recipe[, fp8 dtype name]]), recipe "tensorwise", "rowwise" or "blockwise" (default:
    DeepSeek-V3's 1x128 / 128x128); `dtype` is the output's. x (M, K) ~ N(0, 1) and w (N, K) ~ N(0, 1/K)
    (outputs of order 1, within fp16's range), blockwise with magnitudes 2^[-4, 4] per quantization block so
    block scales differ, quantized by `quantize`; b = wq.t() (column-major, as torch._scaled_mm takes it);
    bias (N,) in the output dtype."""
    m, k, n = shape[:3]
    recipe = shape[3] if len(shape) > 3 else "blockwise"
    fp8 = getattr(torch, shape[4]) if len(shape) > 4 else torch.float8_e4m3fn
    a_block, w_block = _RECIPES[recipe]
    x = torch.randn((m, k), device=device, generator=generator)
    w = torch.randn((n, k), device=device, generator=generator) / max(k, 1) ** 0.5
    if recipe == "blockwise":
        def spread(rows, cols, block):
            e = torch.randint(-4, 5, (cdiv(rows, block[0]), cdiv(cols, block[1])), device=device, generator=generator)
            return torch.exp2(e.float()).repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]

        x, w = x * spread(m, k, a_block), w * spread(n, k, w_block)
    aq, sa = quantize(x, a_block, fp8)
    wq, sw = quantize(w, w_block, fp8)
    if recipe == "tensorwise":
        sa, sw = sa.reshape(()), sw.reshape(())
    bias = (0.1 * torch.randn(n, device=device, generator=generator)).to(dtype)
    return (aq, wq.t(), sa, sw.t(), bias), {"out_dtype": dtype}


register(OpSpec(
    name="scaled_matmul", fn=scaled_matmul, reference=reference, cost=cost, make_inputs=make_inputs,
    test_shapes=[(37, 200, 45, "blockwise"), (37, 200, 45, "rowwise"), (5, 129, 33, "tensorwise"),
                 (1, 1, 17, "rowwise"), (1, 300, 130, "blockwise", "float8_e5m2")],
    bench_shapes=[(8192, 8192, 8192, r) for r in _RECIPES] + [(8192, 4096, 14336, r) for r in _RECIPES],
    # fp8 products are exact in fp32: what is left is fp32 summation (the interpreter) and the tensor cores'
    # narrower fp8 sums between promotions (sm_90).
    tolerances={"float32": 1e-3, "bfloat16": 1e-2, "float16": 2e-3},
    layout_shape=(37, 200, 45, "blockwise"),
    eager=torch_scaled_mm, generic_rows=("eager",), baseline="eager",
    doc="fp8 (e4m3/e5m2) GEMM with tensorwise, rowwise or 1x128/128x128 block scales and bias; fp32 accumulation.",
))
