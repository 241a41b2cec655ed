"""Tile building blocks of attention's forward and backward kernels, and the layout decisions they share.

Tiles move through one of two sources behind the same calls: TMA tensor descriptors (sm_90+, 16-byte
aligned bases and strides) or masked pointer loads (elsewhere, and in the Triton interpreter), chosen
once per call by `use_tma`. A tile source is one sequence of one (batch, packed-sequence) as a
(heads, rows, head_dim) tensor with any head and row stride and a unit-stride head_dim.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...runtime import ensure_tma_allocator, interpreting, next_pow2

# None: tensor descriptors on sm_90+ GPUs when every tensor allows them, pointers elsewhere. Tests force either.
USE_TMA: Optional[bool] = None
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
NEG_INF = tl.constexpr(float("-inf"))
# TMA's rules for a global tensor: base address and every stride but the innermost a multiple of 16 bytes.
TMA_ALIGN = 16


# Triton 3.6's interpreter multiplies bfloat16 tiles as their uint16 bit patterns: there, dots upcast.
_INTERPRETER_DOT = tl.constexpr(interpreting())


@triton.jit
def mma(a, b, acc=None):
    """tl.dot with fp32 accumulation (bf16/fp16 operands are exact in fp32, so the upcast changes nothing)."""
    if _INTERPRETER_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def tile_source(base, n_heads, n_rows, stride_h, stride_row, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """The (heads, rows, head_dim) tensor of one sequence: a TMA descriptor, or its base pointer."""
    if USE_TMA:
        return tl.make_tensor_descriptor(base, shape=[n_heads, n_rows, HEAD_DIM], strides=[stride_h, stride_row, 1],
                                         block_shape=[1, BLOCK_R, BLOCK_D])
    else:
        return base


@triton.jit
def load_tile(src, head, row0, n_rows, stride_h, stride_row, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows row0 .. row0 + BLOCK_R of one head; rows past n_rows and columns past HEAD_DIM read 0."""
    if USE_TMA:
        return src.load([head, row0, 0]).reshape(BLOCK_R, BLOCK_D)
    else:
        rows = row0 + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        ptrs = src + tl.cast(head, tl.int64) * stride_h + rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
        return tl.load(ptrs, mask=(rows < n_rows)[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def store_tile(dst, value, head, row0, n_rows, stride_h, stride_row, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    if USE_TMA:
        dst.store([head, row0, 0], value.reshape(1, BLOCK_R, BLOCK_D))
    else:
        rows = row0 + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        ptrs = dst + tl.cast(head, tl.int64) * stride_h + rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
        tl.store(ptrs, value, mask=(rows < n_rows)[:, None] & (cols < HEAD_DIM)[None, :])


@triton.jit
def scores(qk, scale2, softcap_scale, softcap2, HAS_SOFTCAP: tl.constexpr):
    """Base-2 logits log2(e) * s with s = scale * qk, or softcap * tanh(scale * qk / softcap); also tanh."""
    if HAS_SOFTCAP:
        # tanh(y) = 1 - 2 / (exp(2y) + 1): one exponential, exact limits at +-inf.
        t = 1.0 - 2.0 / (tl.exp2(qk * (2.0 * LOG2E * softcap_scale)) + 1.0)
        return t * softcap2, t
    else:
        return qk * scale2, qk


@triton.jit
def allowed(qpos, kpos, seqlen_k, shift, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Which (query, key) pairs the mask keeps; qpos and kpos broadcast against each other."""
    ok = kpos < seqlen_k
    if CAUSAL:
        ok = ok & (kpos <= qpos + shift)
    if HAS_WINDOW:
        ok = ok & (kpos >= qpos + shift - window)
    return ok


@triton.jit
def kv_block_range(m0, seqlen_q, seqlen_k, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   MASK_TAIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks of queries m0 .. m0 + BLOCK_M: [lo, a) masked, [a, b) unmasked, [b, hi) masked.

    [lo, a) is empty without a window; [b, hi) without a causal mask, unless MASK_TAIL masks the keys
    past seqlen_k. Every bound is clamped at 0 before a division (the compiler's integer division
    truncates, the interpreter's floors)."""
    shift = seqlen_k - seqlen_q
    m_last = m0 + BLOCK_M - 1
    hi = seqlen_k
    if CAUSAL:
        hi = tl.minimum(hi, tl.maximum(m_last + shift + 1, 0))
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(m0 + shift - window, 0) // BLOCK_N * BLOCK_N
    # Unmasked: every key inside [0, seqlen_k), left of the first row's diagonal, right of the last row's window edge.
    a = lo
    if HAS_WINDOW:
        a = tl.maximum(tl.cdiv(tl.maximum(m_last + shift - window, 0), BLOCK_N) * BLOCK_N, lo)
    b = seqlen_k // BLOCK_N * BLOCK_N if MASK_TAIL else hi
    if CAUSAL:
        b = tl.minimum(b, tl.maximum(m0 + shift + 1, 0) // BLOCK_N * BLOCK_N)
    a = tl.minimum(a, hi)
    b = tl.minimum(tl.maximum(b, a), hi)
    return lo, a, b, hi


@triton.jit
def sequence_bounds(CU_SEQLENS, b, seqlen, VARLEN: tl.constexpr):
    """(first token, length) of sequence b: from cu_seqlens when packed, else (0, seqlen)."""
    if VARLEN:
        start = tl.load(CU_SEQLENS + b)
        return start, tl.load(CU_SEQLENS + b + 1) - start
    else:
        return b * 0, seqlen + b * 0



def tile_configs(table: dict, interpreter_tile: tuple):
    """Autotune configs and their pruner from {head-dim class: [(BLOCK_M, BLOCK_N, warps, stages[, ws]), ...]}.

    The tables hold the tiles that compile for sm_90 (checked with ptxas); the fp32 accumulators grow
    with BLOCK_D, so each head-dim class gets its own. A fifth entry True adds WS=True (Triton's
    warp-specialized loop, `tl.range(..., warp_specialize=True)`). The interpreter runs one small
    tile, so that tiny test shapes span several blocks and every mask edge."""
    if interpreting():
        m, n = interpreter_tile
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4, num_stages=1)], None
    norm = lambda t: (*t[:4], bool(t[4]) if len(t) > 4 else False)  # noqa: E731
    shapes = list(dict.fromkeys(norm(t) for tiles in table.values() for t in tiles))
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, **({"WS": True} if ws else {})}, num_warps=w,
                             num_stages=s) for m, n, w, s, ws in shapes]

    def ident(c):
        return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, bool(c.kwargs.get("WS", False))

    def prune(configs, named_args, **kwargs):
        bd, seq_q, seq_k = (kwargs.get(n, named_args.get(n)) for n in ("BLOCK_D", "SEQ_Q_KEY", "SEQ_K_KEY"))
        allowed = {norm(t) for t in table[min(c for c in table if c >= bd)]}
        # No tile much longer than the sequences it covers.
        keep = [c for c in configs if ident(c) in allowed
                and c.kwargs["BLOCK_M"] <= max(64, seq_q) and c.kwargs["BLOCK_N"] <= max(64, seq_k)]
        return keep or [c for c in configs if ident(c) in allowed][:1]

    return configs, {"early_config_prune": prune}


# --- layouts ---

def block_d(d: int) -> int:
    return max(16, next_pow2(d))


def seq_key(n: int) -> int:
    """A sequence length as an autotune key: its power-of-two class."""
    return next_pow2(max(n, 1))


def row_strides(x: torch.Tensor, varlen: bool) -> tuple:
    """(batch, row, head) strides of a (batch, seq, heads, d) tensor, or of a packed (tokens, heads, d) one."""
    return (0, *x.stride()[:2]) if varlen else x.stride()[:3]


def tma_compatible(tensors, varlen: bool) -> bool:
    """Whether tensor descriptors can address every tensor: 16-byte aligned bases; head and row strides
    (the descriptor's) positive multiples of 16 bytes; batch strides (added to the base pointer, so a
    batch-broadcast stride 0 is fine) multiples of 16 bytes. A stride-0 head or row dim (k broadcast
    over heads for MQA) or an offset view off the 16-byte grid takes the pointer path instead."""
    for t in tensors:
        sb, ss, sh = row_strides(t, varlen)
        size = t.element_size()
        if t.data_ptr() % TMA_ALIGN or (sb * size) % TMA_ALIGN or t.shape[-1] > 1 and t.stride(-1) != 1:
            return False
        if any(s <= 0 or (s * size) % TMA_ALIGN for s in (ss, sh)):
            return False
    return True


def use_tma(*tensors: torch.Tensor, varlen: bool = False, prefer_pointers: bool = False) -> bool:
    """Tensor descriptors on sm_90+ when `tma_compatible`, unless the caller measured the pointer path faster
    at this shape (`prefer_pointers`); USE_TMA overrides both (tests)."""
    if USE_TMA is not None:
        return USE_TMA
    if prefer_pointers or interpreting() or not tensors[0].is_cuda \
            or torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    ok = tma_compatible(tensors, varlen)
    if ok:
        ensure_tma_allocator()
    return ok
