"""Flash attention: softmax(scale * q kᵀ + mask) v, forward, split-KV decoding, and (in attention_bwd.py) backward.

Layout (batch, seq, heads, head_dim), or packed (total_tokens, heads, head_dim) with `cu_seqlens`.
Compute-bound: the floor is the matmul FLOPs; the O(seq²) scores never leave registers. Each forward
program owns BLOCK_M queries of one head and streams the key/value blocks its mask allows, with the
online softmax (running max and rescaled sum, base-2 exponentials); the log-sum-exp it writes lets
the backward recompute the probabilities instead of storing them.

Masks, in query position i and key position j, with shift = seq_k - seq_q:
- causal: j <= i + shift (aligned bottom-right as in flash-attn: the last query sees every key);
- window=w: j >= i + shift - w (w keys to the left plus the diagonal, flash-attn's window_size=(w, 0)
  with causal, (w, -1) without).
A query that sees no key (causal with seq_q > seq_k) gets output 0 and lse -inf.
The key blocks of a query block split into masked edge blocks and unmasked interior blocks, so that
only the edges pay for the mask. GQA/MQA programs read K/V of head h // (heads_q / heads_kv).

On sm_90+ GPUs tiles move through tensor descriptors (TMA); elsewhere, and in the Triton interpreter,
through masked pointer loads: one USE_TMA constexpr, the same math. Short queries against a long
KV cache (decoding) take a split-KV path: the key range is split over programs, each writing a
partial output and its lse, merged by a combine kernel.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from ..roofline.model import Cost, dtype_key
from ..testing.poison import empty
from ..tune import autotune, cdiv, interpreting, launch, next_pow2, num_sms
from . import _validate
from .registry import OpSpec, register

MAX_HEAD_DIM = 256
DTYPES = (torch.bfloat16, torch.float16)
# Split-KV decoding for at most this many queries per sequence against at least DECODE_MIN_SEQ_K keys.
DECODE_MAX_SEQ_Q = 16
DECODE_MIN_SEQ_K = 128
# Most query rows (group heads x queries) one decode program holds, per BLOCK_D (registers).
DECODE_MAX_ROWS_X_D = 8192
# None: tensor descriptors on sm_90+ GPUs, pointers elsewhere. Tests force either.
USE_TMA: Optional[bool] = None
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
NEG_INF = tl.constexpr(float("-inf"))


# Triton 3.6's interpreter multiplies bfloat16 tiles as their uint16 bit patterns: there, dots upcast.
_INTERPRETER_DOT = tl.constexpr(interpreting())


# --- helpers shared with attention_bwd.py ---

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


# --- forward ---

@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_src, v_src, hk, lo, hi, offs_m, seqlen_k, shift, window, stride_kh, stride_ks,
               stride_vh, stride_vs, scale2, softcap_scale, softcap2, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, USE_TMA: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WS: tl.constexpr = False):
    for n0 in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = load_tile(k_src, hk, n0, seqlen_k, stride_kh, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        s = mma(q, tl.trans(k))
        # Without softcap the scale (> 0) applies after the row max and inside the exponent's FMA.
        s_scale = scale2
        if HAS_SOFTCAP:
            s, _ = scores(s, scale2, softcap_scale, softcap2, HAS_SOFTCAP)
            s_scale = 1.0
        if MASKED:
            kpos = n0 + tl.arange(0, BLOCK_N)
            s = tl.where(allowed(offs_m[:, None], kpos[None, :], seqlen_k, shift, window, CAUSAL, HAS_WINDOW),
                         s, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
        # A row with no key so far keeps max -inf; subtracting 0 instead keeps exp2 away from -inf - -inf.
        m_use = tl.where(m_new == NEG_INF, 0.0, m_new) if MASKED else m_new
        p = tl.exp2(s * s_scale - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_src, hk, n0, seqlen_k, stride_vh, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


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


_FWD_CONFIGS, _FWD_PRUNE = tile_configs({
    64: [(128, 128, 8, 3), (128, 128, 8, 3, True), (128, 128, 8, 4), (128, 128, 8, 2), (128, 64, 4, 3),
         (128, 64, 8, 3), (128, 64, 8, 4, True), (64, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4)],
    128: [(128, 128, 8, 3), (128, 128, 8, 3, True), (128, 128, 8, 2), (128, 128, 8, 2, True), (128, 64, 8, 3),
          (128, 64, 8, 3, True), (128, 64, 8, 2), (64, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2)],
    256: [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3)],
}, (32, 16))


@autotune(_FWD_CONFIGS, key=["SEQ_Q_KEY", "SEQ_K_KEY", "HEAD_DIM", "CAUSAL", "HAS_WINDOW", "HAS_SOFTCAP", "VARLEN",
                              "USE_TMA"], prune_configs_by=_FWD_PRUNE)
@triton.jit
def attn_fwd_kernel(Q, K, V, O, LSE, CU_SEQLENS, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                    seqlen_q, seqlen_k, n_heads_q, n_heads_k, group, scale2, softcap_scale, softcap2, window,
                    SEQ_Q_KEY, SEQ_K_KEY, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr = False):
    # Query blocks in reverse: under a causal mask the last blocks are the longest, and starting them
    # first leaves the short ones to fill the tail of the grid.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h = pid_bh // n_heads_q, pid_bh % n_heads_q
    hk = h // group
    q_start, seqlen_q = sequence_bounds(CU_SEQLENS, b, seqlen_q, VARLEN)
    k_start, seqlen_k = sequence_bounds(CU_SEQLENS, b, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    b64 = b.to(tl.int64)
    q_src = tile_source(Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs, n_heads_q, seqlen_q, stride_qh,
                        stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    k_src = tile_source(K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks, n_heads_k, seqlen_k, stride_kh,
                        stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v_src = tile_source(V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs, n_heads_k, seqlen_k, stride_vh,
                        stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    q = load_tile(q_src, h, m0, seqlen_q, stride_qh, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    shift = seqlen_k - seqlen_q
    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, a, b_, hi = kv_block_range(m0, seqlen_q, seqlen_k, window, CAUSAL, HAS_WINDOW, True, BLOCK_M, BLOCK_N)
    args = (q, k_src, v_src, hk)
    tail = (offs_m, seqlen_k, shift, window, stride_kh, stride_ks, stride_vh, stride_vs, scale2, softcap_scale,
            softcap2)
    if HAS_WINDOW:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, *args, lo, a, *tail, True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP,
                                   USE_TMA, HEAD_DIM, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, *args, a, b_, *tail, False, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, USE_TMA,
                               HEAD_DIM, BLOCK_N, BLOCK_D, WS and USE_TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, *args, b_, hi, *tail, True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, USE_TMA,
                               HEAD_DIM, BLOCK_N, BLOCK_D)
    empty_row = l_i == 0.0
    o = acc / tl.where(empty_row, 1.0, l_i)[:, None]
    o_dst = tile_source(O + b64 * stride_ob + q_start.to(tl.int64) * stride_os, n_heads_q, seqlen_q, stride_oh,
                        stride_os, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    store_tile(o_dst, o.to(O.dtype.element_ty), h, m0, seqlen_q, stride_oh, stride_os, HEAD_DIM, BLOCK_M, BLOCK_D,
               USE_TMA)
    lse = tl.where(empty_row, NEG_INF, (m_i + tl.log2(tl.where(empty_row, 1.0, l_i))) * LN2)
    tl.store(LSE + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m, lse, mask=offs_m < seqlen_q)


# --- split-KV decoding ---

def _decode_configs():
    if interpreting():
        return [triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
            for n, w, s in [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (32, 4, 4), (64, 8, 4)]]


@autotune(_decode_configs(), key=["SEQ_K_KEY", "HEAD_DIM", "BLOCK_M", "CAUSAL", "HAS_WINDOW", "HAS_SOFTCAP", "USE_TMA"])
@triton.jit
def attn_decode_split_kernel(Q, K, V, O_PART, LSE_PART, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks,
                             stride_kh, stride_vb, stride_vs, stride_vh, seqlen_q, seqlen_k, n_heads_q, n_heads_k,
                             group, heads_per_program, n_splits, chunk, scale2, softcap_scale, softcap2, window,
                             SEQ_K_KEY, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                             USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: keys [split * chunk, +chunk) against every query of a slice of one KV head's group.

    The group's query heads stack into the rows (head-major, then query), so each K/V tile is read
    once for all of them."""
    split = tl.program_id(0)
    pid_bk = tl.program_id(1)
    b, hk = pid_bk // n_heads_k, pid_bk % n_heads_k
    r = tl.arange(0, BLOCK_M)
    g = tl.program_id(2) * heads_per_program + r // seqlen_q
    i = r % seqlen_q
    row_ok = (r < heads_per_program * seqlen_q) & (g < group)
    h = hk * group + g
    cols = tl.arange(0, BLOCK_D)
    b64 = b.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + i.to(tl.int64)[:, None] * stride_qs + h.to(tl.int64)[:, None] * stride_qh
    q = tl.load(q_ptrs + cols[None, :], mask=row_ok[:, None] & (cols < HEAD_DIM)[None, :], other=0.0)
    k_src = tile_source(K + b64 * stride_kb, n_heads_k, seqlen_k, stride_kh, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D,
                        USE_TMA)
    v_src = tile_source(V + b64 * stride_vb, n_heads_k, seqlen_k, stride_vh, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D,
                        USE_TMA)
    shift = seqlen_k - seqlen_q
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen_k)
    if HAS_WINDOW:  # no query sees a key left of the first query's window
        start = tl.maximum(start, shift - window)
    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Decoding is memory-bound: every block takes the mask, nothing to gain from splitting the loop.
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, hk, start, end, i, end, shift, window, stride_kh,
                               stride_ks, stride_vh, stride_vs, scale2, softcap_scale, softcap2, True, CAUSAL,
                               HAS_WINDOW, HAS_SOFTCAP, USE_TMA, HEAD_DIM, BLOCK_N, BLOCK_D)
    empty_row = l_i == 0.0
    o = acc / tl.where(empty_row, 1.0, l_i)[:, None]
    lse2 = tl.where(empty_row, NEG_INF, m_i + tl.log2(tl.where(empty_row, 1.0, l_i)))
    # Partials are laid out (batch, query, head, split[, d]) so that the combine reads one row's splits contiguously.
    part = ((b64 * seqlen_q + i.to(tl.int64)) * n_heads_q + h) * n_splits + split
    tl.store(O_PART + part[:, None] * HEAD_DIM + cols[None, :], o, mask=row_ok[:, None] & (cols < HEAD_DIM)[None, :])
    tl.store(LSE_PART + part, lse2, mask=row_ok)


@triton.jit
def attn_decode_combine_kernel(O_PART, LSE_PART, O, LSE, stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
                               seqlen_q, n_heads_q, n_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                               BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (batch, query, head)
    h = row % n_heads_q
    i = row // n_heads_q % seqlen_q
    b = row // (n_heads_q * seqlen_q)
    s = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    lse2 = tl.load(LSE_PART + row * n_splits + s, mask=s < n_splits, other=NEG_INF)
    m = tl.max(lse2, 0)
    m = tl.where(m == NEG_INF, 0.0, m)
    w = tl.exp2(lse2 - m)
    total = tl.sum(w, 0)
    mask = (s < n_splits)[:, None] & (cols < HEAD_DIM)[None, :]
    o_part = tl.load(O_PART + (row * n_splits + s)[:, None] * HEAD_DIM + cols[None, :], mask=mask, other=0.0)
    o = tl.sum(o_part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(O + b * stride_ob + i * stride_os + h * stride_oh + cols, o.to(O.dtype.element_ty), mask=cols < HEAD_DIM)
    lse = tl.where(total == 0.0, NEG_INF, (m + tl.log2(tl.where(total == 0.0, 1.0, total))) * LN2)
    tl.store(LSE + b * stride_lb + h * stride_lh + i, lse)


# --- launchers ---

def _alloc_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_tma(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need sm_90+, 16-byte aligned bases and row strides; USE_TMA overrides (tests)."""
    if USE_TMA is not None:
        return USE_TMA
    if interpreting() or not tensors[0].is_cuda or torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    ok = all(t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
             for t in tensors)
    if ok:
        from triton.runtime import _allocation

        # In-kernel descriptors live in a global scratch buffer: Triton asks for it through the allocator.
        if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            triton.set_allocator(_alloc_scratch)
    return ok


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def block_d(d: int) -> int:
    return max(16, next_pow2(d))


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def validate(q, k, v, causal, window, softcap, cu_seqlens, max_seqlen, scale):
    """Check the arguments of `attention`; returns (batch, seqlen_q, seqlen_k) (per-sequence maxima when packed)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _validate.tensor(x, name, dtypes=DTYPES)
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {_names([x.dtype])} but q has {_names([q.dtype])}; use one dtype")
        _validate.same_device(x, name, q, "q")
    varlen = cu_seqlens is not None
    dims = 3 if varlen else 4
    layout = "(total_tokens, heads, head_dim) with cu_seqlens" if varlen else "(batch, seq, heads, head_dim)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != dims:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise ValueError(f"q, k, v must share head_dim, got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} is not supported: head_dim must be 1..{MAX_HEAD_DIM} "
                         f"(full speed at 64 and 128; others pad to the next power of 2)")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or hq % hk:
        raise ValueError(f"k has {hk} heads, which must divide q's {hq} heads (GQA/MQA)")
    if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window >= 0):
        raise ValueError(f"window must be None or an int >= 0 (keys left of the diagonal), got {window!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if not (isinstance(scale, (int, float)) and scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be None or a finite number > 0, got {scale!r}")
    if not varlen:
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"q and k must have the same batch, got {q.shape[0]} and {k.shape[0]}")
        if max_seqlen is not None:
            raise ValueError("max_seqlen goes with cu_seqlens (packed sequences); leave it None for 4-D inputs")
        return q.shape[0], q.shape[1], k.shape[1]
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
            or cu_seqlens.numel() < 2:
        desc = f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor) \
            else type(cu_seqlens).__name__
        raise ValueError(f"cu_seqlens must be an int32 tensor of shape (batch + 1,) holding cumulative sequence "
                         f"offsets [0, len0, len0 + len1, ...], got {desc}")
    _validate.same_device(cu_seqlens, "cu_seqlens", q, "q")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must hold the same total_tokens with one cu_seqlens, got {q.shape[0]} and "
                         f"{k.shape[0]}")
    if max_seqlen is None:  # needs the offsets on the host: check them while they are there
        cu = cu_seqlens.tolist()
        lens = [b - a for a, b in zip(cu, cu[1:])]
        if cu[0] != 0 or min(lens) < 0 or cu[-1] != q.shape[0]:
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at total_tokens={q.shape[0]}, "
                             f"got {cu[:8]}{'...' if len(cu) > 8 else ''}")
        max_seqlen = max(lens)
    elif not (isinstance(max_seqlen, int) and max_seqlen >= 0):
        raise ValueError(f"max_seqlen must be an int >= the longest sequence, got {max_seqlen!r}")
    return cu_seqlens.numel() - 1, max_seqlen, max_seqlen


def _key(n: int) -> int:
    return next_pow2(max(n, 1))


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple:
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _strides(x: torch.Tensor, varlen: bool) -> tuple:
    return (0, *x.stride()[:2]) if varlen else x.stride()[:3]


def _score_args(scale: float, softcap: Optional[float]) -> tuple:
    if softcap:
        return scale * 1.4426950408889634, scale / softcap, softcap * 1.4426950408889634
    return scale * 1.4426950408889634, 0.0, 0.0


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  window: Optional[int] = None, softcap: Optional[float] = None,
                  cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                  scale: Optional[float] = None, checked: bool = False):
    """Launch the forward. Returns (o, lse): o like q (contiguous), lse fp32 natural-log of shape
    (batch, heads_q, seq_q), or (heads_q, total_tokens) when packed. `checked`: the arguments were
    validated already (by `attention`) and max_seqlen is given when packed."""
    if checked:
        batch, seq_q, seq_k = ((q.shape[0], q.shape[1], k.shape[1]) if cu_seqlens is None
                               else (cu_seqlens.numel() - 1, max_seqlen, max_seqlen))
    else:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None and q.dim() >= 1 and q.shape[-1] else scale
        batch, seq_q, seq_k = validate(q, k, v, causal, window, softcap, cu_seqlens, max_seqlen, scale)
    varlen = cu_seqlens is not None
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    o = empty(q.shape, dtype=q.dtype, device=q.device)
    lse = empty(lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    d, hq, hk = q.shape[-1], q.shape[-2], k.shape[-2]
    if o.numel() == 0:
        return o, lse.fill_(float("-inf"))
    if seq_k == 0 and not varlen:
        return o.zero_(), lse.fill_(float("-inf"))
    tma = use_tma(q, k, v, o)
    common = dict(HEAD_DIM=d, BLOCK_D=block_d(d), CAUSAL=bool(causal), HAS_WINDOW=window is not None,
                  HAS_SOFTCAP=softcap is not None, USE_TMA=tma)
    score = (*_score_args(scale, softcap), window or 0)
    if (not varlen and seq_q <= DECODE_MAX_SEQ_Q and seq_k >= DECODE_MIN_SEQ_K
            and seq_q * block_d(d) <= DECODE_MAX_ROWS_X_D):
        _decode(q, k, v, o, lse, batch, seq_q, seq_k, score, common)
        return o, lse
    sq_, sk_, lq = _strides(q, varlen), _strides(k, varlen), lse.stride()
    grid = lambda meta: (cdiv(seq_q, meta["BLOCK_M"]), batch * hq)  # noqa: E731
    launch(attn_fwd_kernel, grid, (_key(seq_q), _key(seq_k), tuple(common.items()), varlen, q.dtype),
           q, k, v, o, lse, cu_seqlens if varlen else q, *sq_, *sk_, *_strides(v, varlen), *_strides(o, varlen),
           0 if varlen else lq[0], lq[0] if varlen else lq[1], seq_q, seq_k, hq, hk, hq // hk, *score,
           _key(seq_q), _key(seq_k), VARLEN=varlen, **common)
    return o, lse


def _decode(q, k, v, o, lse, batch, seq_q, seq_k, score, common):
    hq, hk, d = q.shape[2], k.shape[2], q.shape[3]
    group = hq // hk
    heads_per_program = max(1, min(group, DECODE_MAX_ROWS_X_D // block_d(d) // seq_q))
    slices = cdiv(group, heads_per_program)
    rows = max(16, next_pow2(heads_per_program * seq_q))
    # Enough programs for two waves over the SMs, each streaming at least 256 keys.
    programs = batch * hk * slices
    n_splits = max(1, min(cdiv(2 * num_sms(q.device), programs), cdiv(seq_k, 256)))
    chunk = cdiv(cdiv(seq_k, n_splits), 128) * 128
    n_splits = cdiv(seq_k, chunk)
    o_part = empty((batch, seq_q, hq, n_splits, d), dtype=torch.float32, device=q.device)
    lse_part = empty((batch, seq_q, hq, n_splits), dtype=torch.float32, device=q.device)
    launch(attn_decode_split_kernel, (n_splits, batch * hk, slices),
           (_key(seq_k), rows, tuple(common.items()), q.dtype),
           q, k, v, o_part, lse_part, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], seq_q, seq_k, hq, hk, group,
           heads_per_program, n_splits, chunk, *score, _key(seq_k), BLOCK_M=rows, **common)
    launch(attn_decode_combine_kernel, (batch * seq_q * hq,), None,
           o_part, lse_part, o, lse, *o.stride()[:3], *lse.stride()[:2], seq_q, hq, n_splits, HEAD_DIM=d,
           BLOCK_S=next_pow2(n_splits), BLOCK_D=block_d(d), num_warps=4)


# --- torch.library custom op: one graph node under torch.compile, autograd through our backward ---
# None travels as window -1, softcap 0.0 and max_seqlen 0 (the schema has no Optional[float] defaults).

def _fwd(q, k, v, cu_seqlens, causal, window, softcap, max_seqlen, scale, deterministic=False):
    return attention_fwd(q, k, v, causal, None if window < 0 else window, softcap or None, cu_seqlens,
                         max_seqlen if cu_seqlens is not None else None, scale, checked=True)


@torch.library.custom_op("kernelkit::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                  causal: bool, window: int, softcap: float, max_seqlen: int, scale: float, deterministic: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd(q, k, v, cu_seqlens, causal, window, softcap, max_seqlen, scale)


@_attention_op.register_fake
def _(q, k, v, cu_seqlens, causal, window, softcap, max_seqlen, scale, deterministic):
    return q.new_empty(q.shape), q.new_empty(lse_shape(q, cu_seqlens is not None), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, *ctx.flags = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)


def _backward(ctx, do, dlse):
    from .attention_bwd import attention_bwd_op

    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    return (*attention_bwd_op(do, dlse, q, k, v, o, lse, cu_seqlens, *ctx.flags), *(None,) * 7)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _AttentionFunction(torch.autograd.Function):
    """The eager path: the same launchers as the custom op without its dispatch overhead (decoding)."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _fwd(*inputs)
        ctx.set_materialize_grads(False)
        _setup_context(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, do, dlse):
        from .attention_bwd import attention_bwd

        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        causal, window, softcap, max_seqlen, scale, deterministic = ctx.flags
        return (*attention_bwd(do, dlse, q, k, v, o, lse, causal, None if window < 0 else window, softcap or None,
                               cu_seqlens, max_seqlen, scale, deterministic), *(None,) * 7)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, window: Optional[int] = None,
              softcap: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None,
              max_seqlen: Optional[int] = None, scale: Optional[float] = None, deterministic: bool = False,
              return_lse: bool = False):
    """Flash attention ``softmax(scale * q kᵀ + mask) v`` over (batch, seq, heads, head_dim) tensors.

    q: (batch, seq_q, heads_q, d); k, v: (batch, seq_k, heads_kv, d), heads_kv dividing heads_q (GQA/MQA:
    query head h reads KV head h // (heads_q // heads_kv), never a repeated copy). Packed sequences:
    q, k, v of shape (total_tokens, heads, d) with ``cu_seqlens`` (int32 offsets [0, len0, len0+len1, ...],
    one for q and k) and ``max_seqlen`` (the longest length; computed with a host sync when None, which
    also validates cu_seqlens). bfloat16 or float16, d up to 256 (64 and 128 at full speed).

    ``causal``: key j <= i + seq_k - seq_q (bottom-right aligned, as flash-attn); ``window``: also
    j >= i + seq_k - seq_q - window; ``softcap``: logits become softcap * tanh(logits / softcap) after the
    scale (Gemma-2); ``scale`` defaults to 1/sqrt(d). Fused: scores, masks, softcap, online softmax and
    the value product in one pass; up to 16 queries against >= 128 keys take split-KV decoding.
    Returns o like q, and with ``return_lse`` also the fp32 natural-log log-sum-exp of each row,
    (batch, heads_q, seq_q) or (heads_q, total_tokens) packed; rows that see no key get o = 0, lse = -inf.
    Differentiable in q, k, v (and through lse); ``deterministic`` computes dq without atomics.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if isinstance(q, torch.Tensor) and q.dim() and q.shape[-1] else 1.0
    # Validated here once as given (the op's encodings, window -1 and softcap 0 for None, would hide bad values).
    _, _, max_len = validate(q, k, v, causal, window, softcap, cu_seqlens, max_seqlen, scale)
    flags = (bool(causal), -1 if window is None else window, float(softcap or 0.0),
             max_len if cu_seqlens is not None else 0, float(scale), bool(deterministic))
    if torch.compiler.is_compiling() or is_fake(q):  # traced: one graph node with a registered backward
        o, lse = _attention_op(q, k, v, cu_seqlens, *flags)
    else:
        o, lse = _AttentionFunction.apply(q, k, v, cu_seqlens, *flags)
    return (o, lse) if return_lse else o


# --- reference, cost, benchmark inputs ---

def _mask(sq: int, sk: int, causal: bool, window: Optional[int], device) -> torch.Tensor:
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= i + (sk - sq)
    if window is not None:
        ok &= j >= i + (sk - sq) - window
    return ok


def _reference_dense(q, k, v, causal, window, softcap, scale):
    ct = q.dtype if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = (x.to(ct).transpose(1, 2) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    ok = _mask(q.shape[1], k.shape[1], causal, window, q.device)
    # The max only stabilizes the exponentials: it cancels in o and lse, so no gradient flows through it.
    m = torch.where(ok, s, float("-inf")).amax(-1, keepdim=True).detach() if s.shape[-1] else s.new_zeros(
        (*s.shape[:-1], 1))
    m = torch.where(torch.isinf(m) & (m < 0), 0.0, m)
    p = torch.where(ok, torch.exp(s - m), 0.0)
    denom = p.sum(-1, keepdim=True)
    seen = denom > 0
    o = (p @ vf) / torch.where(seen, denom, 1.0)
    lse = torch.where(seen, m + torch.log(torch.where(seen, denom, 1.0)), float("-inf")).squeeze(-1)
    return o.transpose(1, 2).to(q.dtype), lse if q.dtype == torch.float64 else lse.float()


def reference(q, k, v, causal=False, window=None, softcap=None, cu_seqlens=None, max_seqlen=None, scale=None,
              deterministic=False, return_lse=False):
    """Plain PyTorch attention with the same masks (materializes the scores and repeated K/V)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if cu_seqlens is None:
        o, lse = _reference_dense(q, k, v, causal, window, softcap, scale)
    else:
        cu = cu_seqlens.tolist()
        parts = [_reference_dense(q[None, a:b], k[None, a:b], v[None, a:b], causal, window, softcap, scale)
                 for a, b in zip(cu, cu[1:])]
        o = torch.cat([p[0][0] for p in parts], 0)
        lse = torch.cat([p[1][0] for p in parts], 1)
    return (o, lse) if return_lse else o


def attended_pairs(seq_q: int, seq_k: int, causal: bool, window: Optional[int]) -> int:
    """How many (query, key) pairs the mask keeps for one head of one sequence."""
    i = torch.arange(seq_q, dtype=torch.int64)
    hi = (i + (seq_k - seq_q) + 1).clamp(0, seq_k) if causal else torch.full_like(i, seq_k)
    lo = (i + (seq_k - seq_q) - window).clamp(0, seq_k) if window is not None else torch.zeros_like(i)
    return int((hi - lo).clamp_min(0).sum())


def cost(q, k, v, causal=False, window=None, softcap=None, cu_seqlens=None, max_seqlen=None, scale=None,
         deterministic=False, return_lse=False, backward=False) -> Cost:
    """FLOPs 4·d per attended (query, key) pair and query head (the two matmuls; a causal mask halves
    them, a window counts its area); backward 2.5x. Ideal bytes: q, k, v read and o written once
    (backward: q, k, v, o, do read, dq, dk, dv written)."""
    if cu_seqlens is None:
        pairs = q.shape[0] * attended_pairs(q.shape[1], k.shape[1], causal, window)
    else:
        cu = cu_seqlens.tolist()
        pairs = sum(attended_pairs(b - a, b - a, causal, window) for a, b in zip(cu, cu[1:]))
    flops = 4.0 * q.shape[-2] * q.shape[-1] * pairs
    qb, kvb = q.numel() * q.element_size(), (k.numel() + v.numel()) * k.element_size()
    if backward:
        return Cost(flops=2.5 * flops, bytes=4.0 * qb + 2.0 * kvb, dtype=dtype_key(q.dtype))
    return Cost(flops=flops, bytes=2.0 * qb + kvb, dtype=dtype_key(q.dtype))


def make_inputs(shape, dtype, device, generator=None):
    """shape = (batch, seq, heads, head_dim[, causal[, seq_k[, heads_kv]]]): q, k, v and kwargs {'causal': ...}."""
    b, s, h, d, causal, s_k, h_k = (*shape, *(False, shape[1], shape[2])[len(shape) - 4:])
    q = torch.randn((b, s, h, d), dtype=dtype, device=device, generator=generator)
    k, v = (torch.randn((b, s_k, h_k, d), dtype=dtype, device=device, generator=generator) for _ in range(2))
    return (q, k, v), {"causal": bool(causal)}


def _bhsd(*xs):
    return [x.transpose(1, 2) for x in xs]


def _sdpa(backend=None):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal=False, window=None, softcap=None, cu_seqlens=None, max_seqlen=None, scale=None,
            deterministic=False, return_lse=False):
        if window is not None or softcap is not None or cu_seqlens is not None or return_lse:
            raise NotImplementedError("SDPA takes no window, softcap, cu_seqlens or lse output")
        if causal and q.shape[1] != k.shape[1]:
            raise NotImplementedError("SDPA's is_causal is aligned top-left; only seq_q == seq_k compares")
        qt, kt, vt = _bhsd(q, k, v)
        kw = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
        if backend is None:
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, **kw).transpose(1, 2)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, **kw).transpose(1, 2)

    return run


def _sdpa_loader(backend_name):
    def load():
        from torch.nn.attention import SDPBackend

        return _sdpa(getattr(SDPBackend, backend_name))

    return load


def _deterministic_loader():
    """kernelkit with deterministic=True: dq from its own kernel instead of fp32 atomics (bwd cost of it)."""
    return lambda *a, **kw: attention(*a, **kw, deterministic=True)


def _flex_loader():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v, causal=False, window=None, softcap=None, cu_seqlens=None, max_seqlen=None, scale=None,
            deterministic=False, return_lse=False):
        if window is not None or softcap is not None or cu_seqlens is not None or return_lse:
            raise NotImplementedError("the flex row runs plain and causal attention only")
        block_mask = None
        if causal:
            sq, sk = q.shape[1], k.shape[1]
            key = (sq, sk, q.device)
            if key not in masks:
                masks[key] = create_block_mask(lambda b, h, i, j: j <= i + (sk - sq), None, None, sq, sk,
                                               device=q.device)
            block_mask = masks[key]
        qt, kt, vt = _bhsd(q, k, v)
        return compiled(qt, kt, vt, block_mask=block_mask, scale=scale,
                        enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)

    return run


register(OpSpec(
    name="attention", fn=attention, reference=reference, cost=cost, make_inputs=make_inputs, grad_args=(0, 1, 2),
    test_shapes=[(1, 1, 2, 32), (2, 37, 2, 32, True), (1, 70, 3, 64), (2, 19, 4, 64, True), (2, 5, 4, 32, True, 23, 2)],
    bench_shapes=[(16384 // s, s, 2048 // d, d, c) for d in (64, 128) for s in (512, 1024, 2048, 4096, 8192, 16384)
                  for c in (False, True)],
    latency_shapes=[(1, 1, 32, 128, False, 8192, 8), (16, 1, 32, 128, False, 4096, 8)],  # decoding, GQA 4:1
    dtypes=("bfloat16", "float16"), eager=_sdpa(), generic_rows=(), baseline="sdpa-cudnn",
    competitors={"sdpa-flash": _sdpa_loader("FLASH_ATTENTION"), "sdpa-cudnn": _sdpa_loader("CUDNN_ATTENTION"),
                 "flex": _flex_loader, "kk-deterministic": _deterministic_loader},
    replaces=("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
              "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention"),
    doc="Flash attention fwd+bwd (b, s, h, d): causal (bottom-right), sliding window, softcap, GQA/MQA, "
        "packed varlen, lse output, deterministic bwd, split-KV decoding.",
))
