"""Flash attention forward: the main kernel, split-KV decoding, argument checks and the launcher.

Each forward program owns BLOCK_M queries of one head and streams the key/value blocks its mask allows,
with the online softmax (running max and rescaled sum, base-2 exponentials); the log-sum-exp it writes
lets the backward recompute the probabilities instead of storing them. The key blocks of a query block
split into masked edge blocks and unmasked interior blocks, so that only the edges pay for the mask.
GQA/MQA programs read K/V of head h // (heads_q / heads_kv). Short queries against a long KV cache
(decoding) take a split-KV path: the key range is split over programs, each writing a partial output
and its lse, merged by a combine kernel.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import switches
from ...runtime.alloc import empty
from ...runtime import autotune, capturing, cdiv, interpreting, launch, next_pow2, num_sms
from .. import _validate
try:  # Gluon ships with Triton >= 3.5; without it every call takes the Triton kernel
    from . import hopper as _hopper
except ImportError:
    _hopper = None
from .tiles import (LN2, NEG_INF, allowed, block_d, kv_block_range, load_tile, mma, row_strides, scores, seq_key,
                    sequence_bounds, store_tile, tile_configs, tile_source, use_tma)

MAX_HEAD_DIM = 256
DTYPES = (torch.bfloat16, torch.float16)
# Split-KV decoding for at most this many queries per sequence against at least DECODE_MIN_SEQ_K keys.
DECODE_MAX_SEQ_Q = 16
DECODE_MIN_SEQ_K = 128
# Most query rows (group heads x queries) one decode program holds, per BLOCK_D (registers).
DECODE_MAX_ROWS_X_D = 8192
# Up to this many keys the main kernel loads tiles through pointers: each program makes its tensor descriptors
# in global memory (a write and a fence per descriptor), which short rows do not amortize. H100, 16k tokens,
# seq 1024 (benchmarks/experiments/h100/2026-11-25-attention-tuning): pointers 9-27% faster at d64/d128,
# causal or not; longer sequences were not measured on pointers and keep the descriptors.
POINTER_MAX_SEQ_K = 1024
# The Gluon producer/consumer kernel (hopper.py) for the calls it takes on sm_90; KERNELKIT_ATTENTION_GLUON=0 keeps
# every call on the Triton kernel.
GLUON = switches.on("KERNELKIT_ATTENTION_GLUON")


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



_FWD_CONFIGS, _FWD_PRUNE = tile_configs({
    # (128, 128, 4, 3): the sweep's fastest at d64 s4096 causal, s16384 and s16384 causal (1-3% over the next).
    64: [(128, 128, 8, 3), (128, 128, 8, 3, True), (128, 128, 8, 4), (128, 128, 8, 2), (128, 64, 4, 3),
         (128, 64, 8, 3), (128, 64, 8, 4, True), (64, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 4, 3)],
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

def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _validate_inputs(q, k, v, causal, window, softcap, cu_seqlens, max_seqlen, scale):
    """Check the arguments of `attention`; returns (batch, seqlen_q, seqlen_k) (per-sequence maxima when packed)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (isinstance(x, torch.Tensor) and x.is_meta and x.dtype in DTYPES):  # meta: shapes only
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
    if max_seqlen is None and cu_seqlens.is_meta:
        raise ValueError("max_seqlen is needed with meta cu_seqlens: the longest sequence cannot be read from them")
    if max_seqlen is None and capturing():
        raise ValueError("max_seqlen is needed with cu_seqlens inside a CUDA graph capture (torch.cuda.graph, "
                         "torch.compile mode='reduce-overhead'): without it the longest sequence is read from "
                         "cu_seqlens on the host, a synchronization a capture cannot hold; pass max_seqlen=")
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


def _validate_offsets(cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> None:
    """The packed-sequence offsets, checked on the device: with max_seqlen given nothing else reads them
    on the host, and a host check would cost a sync per call. `torch._assert_async` raises at once on the
    CPU and fails the next synchronization on CUDA (a device-side assert), so a bad cu_seqlens never
    yields output rows that no program wrote (a tail past cu_seqlens[-1], a sequence past max_seqlen)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == total) & (lens.min() >= 0) & (lens.max() <= max_seqlen)
    torch._assert_async(ok, f"kernelkit.attention: cu_seqlens must start at 0, never decrease, end at "
                            f"total_tokens={total} and hold no sequence longer than max_seqlen={max_seqlen}")


def lse_shape(q: torch.Tensor, varlen: bool) -> tuple:
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


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
    validated already (by `attention`) and max_seqlen is given when packed. q, k, v are read with
    their strides (any head, row and batch strides, 0 included); only a head_dim that is not
    unit-stride is copied."""
    varlen = cu_seqlens is not None
    on_host = varlen and max_seqlen is None and not checked  # _validate_inputs reads the offsets on the host
    if checked:
        batch, seq_q, seq_k = ((q.shape[0], q.shape[1], k.shape[1]) if cu_seqlens is None
                               else (cu_seqlens.numel() - 1, max_seqlen, max_seqlen))
    else:
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None and q.dim() >= 1 and q.shape[-1] else scale
        batch, seq_q, seq_k = _validate_inputs(q, k, v, causal, window, softcap, cu_seqlens, max_seqlen, scale)
    if varlen and not on_host:
        _validate_offsets(cu_seqlens, q.shape[0], seq_q)
    if varlen:  # validated through its strides, read by the kernels by index: a stepped view must not reach them
        cu_seqlens = _validate.dense(cu_seqlens)
    q, k, v = _validate.unit_last(q), _validate.unit_last(k), _validate.unit_last(v)
    o = empty(q.shape, dtype=q.dtype, device=q.device)
    lse = empty(lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    d, hq, hk = q.shape[-1], q.shape[-2], k.shape[-2]
    if o.numel() == 0:
        return o, lse.fill_(float("-inf"))
    if seq_k == 0 and not varlen:
        return o.zero_(), lse.fill_(float("-inf"))
    decode = (not varlen and seq_q <= DECODE_MAX_SEQ_Q and seq_k >= DECODE_MIN_SEQ_K
              and seq_q * block_d(d) <= DECODE_MAX_ROWS_X_D)
    if (not decode and GLUON and _hopper is not None and not interpreting() and _hopper.preferred(d, causal, seq_k)
            and _hopper.supports(q, k, v, o, causal, window, softcap, varlen)):  # first: none of the Triton setup
        _hopper.attention_fwd_hopper(q, k, v, o, lse, causal, _score_args(scale, softcap)[0])
        return o, lse
    tma = use_tma(q, k, v, o, varlen=varlen, prefer_pointers=not decode and seq_k <= POINTER_MAX_SEQ_K)
    common = dict(HEAD_DIM=d, BLOCK_D=block_d(d), CAUSAL=bool(causal), HAS_WINDOW=window is not None,
                  HAS_SOFTCAP=softcap is not None, USE_TMA=tma)
    score = (*_score_args(scale, softcap), window or 0)
    if decode:
        _decode(q, k, v, o, lse, batch, seq_q, seq_k, score, common)
        return o, lse
    sq_, sk_, lq = row_strides(q, varlen), row_strides(k, varlen), lse.stride()
    grid = lambda meta: (cdiv(seq_q, meta["BLOCK_M"]), batch * hq)  # noqa: E731
    launch(attn_fwd_kernel, grid, (seq_key(seq_q), seq_key(seq_k), tuple(common.items()), varlen, q.dtype),
           q, k, v, o, lse, cu_seqlens if varlen else q, *sq_, *sk_, *row_strides(v, varlen), *row_strides(o, varlen),
           0 if varlen else lq[0], lq[0] if varlen else lq[1], seq_q, seq_k, hq, hk, hq // hk, *score,
           seq_key(seq_q), seq_key(seq_k), VARLEN=varlen, **common)
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
           (seq_key(seq_k), rows, tuple(common.items()), q.dtype),
           q, k, v, o_part, lse_part, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], seq_q, seq_k, hq, hk, group,
           heads_per_program, n_splits, chunk, *score, seq_key(seq_k), BLOCK_M=rows, **common)
    launch(attn_decode_combine_kernel, (batch * seq_q * hq,), None,
           o_part, lse_part, o, lse, *o.stride()[:3], *lse.stride()[:2], seq_q, hq, n_splits, HEAD_DIM=d,
           BLOCK_S=next_pow2(n_splits), BLOCK_D=block_d(d), num_warps=4)

