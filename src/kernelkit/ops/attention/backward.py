"""Flash attention backward: dq, dk, dv from do, recomputing the probabilities from the saved lse.

With P = exp(S - lse) and dS = P * (dP - delta), delta_i = sum_d o_id do_id (minus dlse_i when the lse
output has a gradient): dv = Pᵀ do, dk = scale dSᵀ q, dq = scale dS k (softcap multiplies dS by 1 - tanh²).

- A preprocess kernel writes delta and lse in base 2 (+inf for rows that saw no key, so their P is 0).
- The dk/dv kernel gives each program BLOCK_N keys of one KV head; it walks every query head of the
  group and every query block the mask lets see those keys, so dk and dv of a GQA group sum in
  registers, without atomics. By default it also adds each block's dq share into an fp32 buffer
  with atomics (a TMA reduce on sm_90+): 5 matmuls per tile.
- `deterministic=True`: no atomics; a second kernel recomputes P and dP per query block and owns its
  dq rows (7 matmuls per tile, bitwise reproducible).
- Measured on the H100 (benchmarks/results/h100.csv, `kk-deterministic` row): at head
  dim >= 128 and 1k keys or more the two-kernel path is as fast or faster (1.00-1.11x: no fp32 dq buffer
  to zero, no atomics, no cast), so it is taken there whatever `deterministic` says; the atomic path
  stays for smaller heads and short sequences, where it won. Head dims over 128 always take the
  two-kernel path: the atomic one faulted on the H100 at d=256.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ... import switches
from ...runtime.alloc import empty
from ...runtime import autotune, cdiv, interpreting, launch
from .. import _validate
try:  # Gluon ships with Triton >= 3.5; without it every call takes the Triton kernels
    from . import hopper_bwd as _hopper_bwd
except ImportError:
    _hopper_bwd = None
from .tiles import (LOG2E, NEG_INF, allowed, block_d, kv_block_range, load_tile, mma, row_strides, scores, seq_key,
                    sequence_bounds, store_tile, tile_configs, tile_source, use_tma)

# dq through fp32 atomics in the dk/dv pass when the caller does not ask for determinism.
ATOMIC_DQ = True
# ... except from these sizes up, where the separate dq kernel measured faster on the H100.
SEPARATE_DQ_MIN_HEAD_DIM, SEPARATE_DQ_MIN_SEQ_K = 128, 1024
POS_INF = tl.constexpr(float("inf"))
# The backward through the Gluon producer/consumer kernel (hopper_bwd.py) where it takes the call:
# KERNELKIT_ATTENTION_GLUON_BWD `auto` (GLUON = "auto": where `gluon_auto` says), `1` (True: every call it supports),
# `0` (False: the Triton kernels).
GLUON = {"auto": "auto", "1": True, "0": False}[switches.value("KERNELKIT_ATTENTION_GLUON_BWD")]
# Where "auto" takes it, from the H100 tables (docs/ops/attention.md). With dQ fused (the default): every call at head
# dims 64 and 128 (stop 45, keys as rows: 1.02-1.10x cuDNN at d64, kernels alone, 1.35-1.50x the Triton backward with
# the causal mask). With the Triton dQ kernel (deterministic=True), stop 43: every call at 128 (1.06-1.32x the Triton
# backward from 4k tokens); at 64 without the causal mask from GLUON_AUTO_D64_MIN_SEQ queries and keys (1.08-1.16x at
# 4k-16k, 0.91x at 1k; causal 0.83-0.91x).
GLUON_AUTO_HEAD_DIMS = (128,)
GLUON_AUTO_FUSED_HEAD_DIMS = (64, 128)
GLUON_AUTO_D64_MIN_SEQ = 4096
# ... with dQ in the same kernel, added by TMA reduces (not when the caller asks for determinism: then the Triton dQ
# kernel, which owns its rows).
GLUON_FUSED_DQ = True


def gluon_auto(d: int, causal: bool, seq_q: int, seq_k: int, fused: bool = True) -> bool:
    """Whether KERNELKIT_ATTENTION_GLUON_BWD=auto sends this backward to the Gluon kernel (it must also support it);
    `fused`: with dQ in the same kernel (else the Triton dQ kernel follows)."""
    if d in (GLUON_AUTO_FUSED_HEAD_DIMS if fused else GLUON_AUTO_HEAD_DIMS):
        return True
    return d == 64 and not causal and min(seq_q, seq_k) >= GLUON_AUTO_D64_MIN_SEQ


@triton.jit
def attn_bwd_preprocess_kernel(O, DO, LSE, DLSE, DELTA, LSE2, CU_SEQLENS, DQ_ACC, stride_ob, stride_os, stride_oh,
                               stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, stride_wb, stride_wh,
                               seqlen_q, n_heads_q, acc_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                               HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr, ZERO_DQ: tl.constexpr,
                               BLOCK_M: tl.constexpr):
    """delta and lse2 of each query row; with ZERO_DQ also zeroes those rows of the Gluon kernel's fp32 dQ buffer
    (DQ_ACC: (batch x heads, acc_rows, HEAD_DIM) contiguous; rows past seqlen_q are never read back), one launch
    less than a separate fill."""
    pid_bh = tl.program_id(1)
    b, h = pid_bh // n_heads_q, pid_bh % n_heads_q
    q_start, seqlen_q = sequence_bounds(CU_SEQLENS, b, seqlen_q, VARLEN)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < seqlen_q)[:, None] & (cols < HEAD_DIM)[None, :]
    b64, tok = b.to(tl.int64), (q_start + rows).to(tl.int64)
    o = tl.load(O + b64 * stride_ob + tok[:, None] * stride_os + h * stride_oh + cols[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b64 * stride_dob + tok[:, None] * stride_dos + h * stride_doh + cols[None, :], mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lptr = b64 * stride_lb + h * stride_lh + tok
    lse = tl.load(LSE + lptr, mask=rows < seqlen_q, other=0.0)
    if HAS_DLSE:
        delta -= tl.load(DLSE + lptr, mask=rows < seqlen_q, other=0.0)
    wptr = b64 * stride_wb + h * stride_wh + tok  # DELTA and LSE2: their own (row-padded) strides
    tl.store(DELTA + wptr, delta, mask=rows < seqlen_q)
    tl.store(LSE2 + wptr, tl.where(lse == NEG_INF, POS_INF, lse * LOG2E), mask=rows < seqlen_q)
    if ZERO_DQ:
        acc = DQ_ACC + pid_bh.to(tl.int64) * acc_rows * HEAD_DIM
        tl.store(acc + rows.to(tl.int64)[:, None] * HEAD_DIM + cols[None, :],
                 tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=mask)


@triton.jit
def q_block_range(n0, seqlen_q, seqlen_k, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks that see keys n0 .. n0 + BLOCK_N: [lo, a) masked, [a, b) unmasked, [b, hi) masked."""
    shift = seqlen_k - seqlen_q
    n_last = n0 + BLOCK_N - 1
    lo = n0 * 0
    if CAUSAL:
        lo = tl.maximum(n0 - shift, 0) // BLOCK_M * BLOCK_M
    hi = seqlen_q + n0 * 0
    if HAS_WINDOW:
        hi = tl.minimum(hi, tl.maximum(n_last - shift + window + 1, 0))
    # Unmasked: every query right of the last key's diagonal and left of the first key's window edge
    # (keys past seqlen_k read as zeros and add nothing to dq; their dk, dv rows are never stored).
    a = lo
    if CAUSAL:
        a = tl.maximum(tl.cdiv(tl.maximum(n_last - shift, 0), BLOCK_M) * BLOCK_M, lo)
    b = hi
    if HAS_WINDOW:
        b = tl.minimum(b, tl.maximum(n0 - shift + window + 1, 0) // BLOCK_M * BLOCK_M)
    a = tl.minimum(a, hi)
    b = tl.minimum(tl.maximum(b, a), hi)
    return lo, a, b, hi


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_src, do_src, dq_dst, LSE2, DELTA, h, l_off, lo, hi, offs_n, seqlen_q, seqlen_k,
                shift, window, stride_qh, stride_qs, stride_doh, stride_dos, stride_dqh, stride_dqs, scale, scale2,
                softcap_scale, softcap2, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr, USE_TMA: tl.constexpr,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    for m0 in tl.range(lo, hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        q = load_tile(q_src, h, m0, seqlen_q, stride_qh, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        lse2 = tl.load(LSE2 + l_off + rows, mask=rows < seqlen_q, other=POS_INF)
        # Transposed tiles (keys x queries): dk and dv accumulate along the queries without a transpose.
        s_t, tanh_t = scores(mma(k, tl.trans(q)), scale2, softcap_scale, softcap2, HAS_SOFTCAP)
        p_t = tl.exp2(s_t - lse2[None, :])
        if MASKED:
            p_t = tl.where(allowed(rows[None, :], offs_n[:, None], seqlen_k, shift, window, CAUSAL, HAS_WINDOW),
                           p_t, 0.0)
        do = load_tile(do_src, h, m0, seqlen_q, stride_doh, stride_dos, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        dv = mma(p_t.to(do.dtype), do, dv)
        delta = tl.load(DELTA + l_off + rows, mask=rows < seqlen_q, other=0.0)
        ds_t = p_t * (mma(v, tl.trans(do)) - delta[None, :])
        if HAS_SOFTCAP:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        ds_t = ds_t.to(q.dtype)
        dk = mma(ds_t, q, dk)
        if ATOMIC_DQ:
            # dqᵀ = kᵀ dsᵀ: head_dim is the M side of the matmul, so even 32 or 64 query rows stay on wgmma.
            dq_t = mma(tl.trans(k), ds_t) * scale
            if DQ_TMA:
                dq_dst.atomic_add([h, m0, 0], tl.trans(dq_t).reshape(1, BLOCK_M, BLOCK_D))
            else:
                cols = tl.arange(0, BLOCK_D)
                ptrs = dq_dst + tl.cast(h, tl.int64) * stride_dqh + rows.to(tl.int64)[None, :] * stride_dqs
                tl.atomic_add(ptrs + cols[:, None], dq_t, mask=(rows < seqlen_q)[None, :] & (cols < HEAD_DIM)[:, None],
                              sem="relaxed")
    return dk, dv


# Per head-dim class: (BLOCK_M queries, BLOCK_N keys, warps, stages) that compile without spills on sm_90
# (the dk/dv accumulators, BLOCK_N x BLOCK_D fp32 each, take half the registers).
_DKDV_CONFIGS, _DKDV_PRUNE = tile_configs({
    64: [(32, 128, 8, 2), (64, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2), (32, 128, 8, 3), (64, 64, 4, 2),
         (64, 128, 8, 3), (32, 128, 4, 3)],
    128: [(32, 128, 8, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 3),
          (32, 128, 4, 3), (64, 64, 4, 3)],
    256: [(32, 64, 8, 1), (32, 64, 8, 2), (64, 64, 8, 1), (32, 32, 4, 2)],
}, (16, 32))
_DQ_CONFIGS, _DQ_PRUNE = tile_configs({
    64: [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 4), (128, 32, 4, 3)],
    128: [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 4)],
    256: [(128, 32, 8, 2), (64, 32, 4, 3), (64, 64, 4, 2)],
}, (32, 16))


_BWD_KEY = ["SEQ_Q_KEY", "SEQ_K_KEY", "HEAD_DIM", "CAUSAL", "HAS_WINDOW", "HAS_SOFTCAP", "VARLEN", "USE_TMA"]


@autotune(_DKDV_CONFIGS, key=_BWD_KEY + ["ATOMIC_DQ", "GROUP_KEY"], reset_to_zero=["DQ_ACC"],
          prune_configs_by=_DKDV_PRUNE)
@triton.jit
def attn_bwd_dkdv_kernel(Q, K, V, DO, DK, DV, DQ_ACC, LSE2, DELTA, CU_SEQLENS, stride_qb, stride_qs, stride_qh,
                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_dob, stride_dos,
                         stride_doh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                         stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, seqlen_q, seqlen_k, n_heads_q,
                         n_heads_k, group, scale, scale2, softcap_scale, softcap2, window, SEQ_Q_KEY, SEQ_K_KEY,
                         GROUP_KEY, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
                         HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, VARLEN: tl.constexpr,
                         USE_TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_bh = tl.program_id(1)
    b, hk = pid_bh // n_heads_k, pid_bh % n_heads_k
    q_start, seqlen_q = sequence_bounds(CU_SEQLENS, b, seqlen_q, VARLEN)
    k_start, seqlen_k = sequence_bounds(CU_SEQLENS, b, seqlen_k, VARLEN)
    n0 = tl.program_id(0) * BLOCK_N
    if n0 >= seqlen_k:
        return
    b64, qs64, ks64 = b.to(tl.int64), q_start.to(tl.int64), k_start.to(tl.int64)
    k_src = tile_source(K + b64 * stride_kb + ks64 * stride_ks, n_heads_k, seqlen_k, stride_kh, stride_ks, HEAD_DIM,
                        BLOCK_N, BLOCK_D, USE_TMA)
    v_src = tile_source(V + b64 * stride_vb + ks64 * stride_vs, n_heads_k, seqlen_k, stride_vh, stride_vs, HEAD_DIM,
                        BLOCK_N, BLOCK_D, USE_TMA)
    q_src = tile_source(Q + b64 * stride_qb + qs64 * stride_qs, n_heads_q, seqlen_q, stride_qh, stride_qs, HEAD_DIM,
                        BLOCK_M, BLOCK_D, USE_TMA)
    do_src = tile_source(DO + b64 * stride_dob + qs64 * stride_dos, n_heads_q, seqlen_q, stride_doh, stride_dos,
                         HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    dq_dst = tile_source(DQ_ACC + b64 * stride_dqb + qs64 * stride_dqs, n_heads_q, seqlen_q, stride_dqh, stride_dqs,
                         HEAD_DIM, BLOCK_M, BLOCK_D, DQ_TMA)
    k = load_tile(k_src, hk, n0, seqlen_k, stride_kh, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v = load_tile(v_src, hk, n0, seqlen_k, stride_vh, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    shift = seqlen_k - seqlen_q
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo, a, b_, hi = q_block_range(n0, seqlen_q, seqlen_k, window, CAUSAL, HAS_WINDOW, BLOCK_M, BLOCK_N)
    for g in range(group):
        h = hk * group + g
        l_off = b64 * stride_lb + tl.cast(h, tl.int64) * stride_lh + q_start
        args = (k, v, q_src, do_src, dq_dst, LSE2, DELTA, h, l_off)
        tail = (offs_n, seqlen_q, seqlen_k, shift, window, stride_qh, stride_qs, stride_doh, stride_dos, stride_dqh,
                stride_dqs, scale, scale2, softcap_scale, softcap2)
        # (constexprs are passed one by one: packed in a tuple, the compiler turns them into tensors)
        if CAUSAL:
            dk, dv = _dkdv_inner(dk, dv, *args, lo, a, *tail, True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, ATOMIC_DQ,
                                 DQ_TMA, USE_TMA, HEAD_DIM, BLOCK_M, BLOCK_D)
        dk, dv = _dkdv_inner(dk, dv, *args, a, b_, *tail, False, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, ATOMIC_DQ, DQ_TMA,
                             USE_TMA, HEAD_DIM, BLOCK_M, BLOCK_D)
        if HAS_WINDOW:
            dk, dv = _dkdv_inner(dk, dv, *args, b_, hi, *tail, True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, ATOMIC_DQ,
                                 DQ_TMA, USE_TMA, HEAD_DIM, BLOCK_M, BLOCK_D)
    dk_dst = tile_source(DK + b64 * stride_dkb + ks64 * stride_dks, n_heads_k, seqlen_k, stride_dkh, stride_dks,
                         HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    dv_dst = tile_source(DV + b64 * stride_dvb + ks64 * stride_dvs, n_heads_k, seqlen_k, stride_dvh, stride_dvs,
                         HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    store_tile(dk_dst, (dk * scale).to(DK.dtype.element_ty), hk, n0, seqlen_k, stride_dkh, stride_dks, HEAD_DIM,
               BLOCK_N, BLOCK_D, USE_TMA)
    store_tile(dv_dst, dv.to(DV.dtype.element_ty), hk, n0, seqlen_k, stride_dvh, stride_dvs, HEAD_DIM, BLOCK_N,
               BLOCK_D, USE_TMA)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_src, v_src, hk, lo, hi, offs_m, seqlen_k, shift, window, stride_kh,
              stride_ks, stride_vh, stride_vs, scale2, softcap_scale, softcap2, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, USE_TMA: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    for n0 in tl.range(lo, hi, BLOCK_N):
        k = load_tile(k_src, hk, n0, seqlen_k, stride_kh, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        s, tanh = scores(mma(q, tl.trans(k)), scale2, softcap_scale, softcap2, HAS_SOFTCAP)
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            kpos = n0 + tl.arange(0, BLOCK_N)
            p = tl.where(allowed(offs_m[:, None], kpos[None, :], seqlen_k, shift, window, CAUSAL, HAS_WINDOW), p, 0.0)
        v = load_tile(v_src, hk, n0, seqlen_k, stride_vh, stride_vs, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
        ds = p * (mma(do, tl.trans(v)) - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - tanh * tanh)
        dq = mma(ds.to(k.dtype), k, dq)
    return dq


@autotune(_DQ_CONFIGS, key=_BWD_KEY, prune_configs_by=_DQ_PRUNE)
@triton.jit
def attn_bwd_dq_kernel(Q, K, V, DO, DQ, LSE2, DELTA, CU_SEQLENS, stride_qb, stride_qs, stride_qh, stride_kb,
                       stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                       stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, seqlen_q, seqlen_k, n_heads_q,
                       n_heads_k, group, scale, scale2, softcap_scale, softcap2, window, SEQ_Q_KEY, SEQ_K_KEY,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       HAS_SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    pid_bh = tl.program_id(1)
    b, h = pid_bh // n_heads_q, pid_bh % n_heads_q
    hk = h // group
    q_start, seqlen_q = sequence_bounds(CU_SEQLENS, b, seqlen_q, VARLEN)
    k_start, seqlen_k = sequence_bounds(CU_SEQLENS, b, seqlen_k, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    b64, qs64, ks64 = b.to(tl.int64), q_start.to(tl.int64), k_start.to(tl.int64)
    q_src = tile_source(Q + b64 * stride_qb + qs64 * stride_qs, n_heads_q, seqlen_q, stride_qh, stride_qs, HEAD_DIM,
                        BLOCK_M, BLOCK_D, USE_TMA)
    do_src = tile_source(DO + b64 * stride_dob + qs64 * stride_dos, n_heads_q, seqlen_q, stride_doh, stride_dos,
                         HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    k_src = tile_source(K + b64 * stride_kb + ks64 * stride_ks, n_heads_k, seqlen_k, stride_kh, stride_ks, HEAD_DIM,
                        BLOCK_N, BLOCK_D, USE_TMA)
    v_src = tile_source(V + b64 * stride_vb + ks64 * stride_vs, n_heads_k, seqlen_k, stride_vh, stride_vs, HEAD_DIM,
                        BLOCK_N, BLOCK_D, USE_TMA)
    q = load_tile(q_src, h, m0, seqlen_q, stride_qh, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    do = load_tile(do_src, h, m0, seqlen_q, stride_doh, stride_dos, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    l_off = b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start
    lse2 = tl.load(LSE2 + l_off + offs_m, mask=offs_m < seqlen_q, other=POS_INF)
    delta = tl.load(DELTA + l_off + offs_m, mask=offs_m < seqlen_q, other=0.0)
    shift = seqlen_k - seqlen_q
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys past seqlen_k read as zeros and add nothing to dq: only the causal and window edges take the mask.
    lo, a, b_, hi = kv_block_range(m0, seqlen_q, seqlen_k, window, CAUSAL, HAS_WINDOW, False, BLOCK_M, BLOCK_N)
    args = (q, do, lse2, delta, k_src, v_src, hk)
    tail = (offs_m, seqlen_k, shift, window, stride_kh, stride_ks, stride_vh, stride_vs, scale2, softcap_scale,
            softcap2)
    if HAS_WINDOW:
        dq = _dq_inner(dq, *args, lo, a, *tail, True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, USE_TMA, HEAD_DIM, BLOCK_N,
                       BLOCK_D)
    dq = _dq_inner(dq, *args, a, b_, *tail, False, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, USE_TMA, HEAD_DIM, BLOCK_N,
                   BLOCK_D)
    if CAUSAL:
        dq = _dq_inner(dq, *args, b_, hi, *tail, True, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, USE_TMA, HEAD_DIM, BLOCK_N,
                       BLOCK_D)
    dq_dst = tile_source(DQ + b64 * stride_dqb + qs64 * stride_dqs, n_heads_q, seqlen_q, stride_dqh, stride_dqs,
                         HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    store_tile(dq_dst, (dq * scale).to(DQ.dtype.element_ty), h, m0, seqlen_q, stride_dqh, stride_dqs, HEAD_DIM,
               BLOCK_M, BLOCK_D, USE_TMA)


def attention_bwd(do: Optional[torch.Tensor], dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, causal: bool, window: Optional[int],
                  softcap: Optional[float], cu_seqlens: Optional[torch.Tensor], max_seqlen: int, scale: float,
                  deterministic: bool = False):
    """Launch the backward for the outputs (o, lse) of `attention_fwd`. Returns (dq, dk, dv) shaped like q, k, v."""
    varlen = cu_seqlens is not None
    batch, seq_q, seq_k = ((cu_seqlens.numel() - 1, max_seqlen, max_seqlen) if varlen
                           else (q.shape[0], q.shape[1], k.shape[1]))
    q, k, v, o = _validate.unit_last(q), _validate.unit_last(k), _validate.unit_last(v), _validate.unit_last(o)
    do = torch.zeros_like(o) if do is None else _validate.unit_last(do)
    cu_seqlens = _validate.dense(cu_seqlens) if varlen else None  # the kernels read it by index, without strides
    dk = empty(k.shape, dtype=k.dtype, device=k.device)
    dv = empty(v.shape, dtype=v.dtype, device=v.device)
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    d, hq, hk = q.shape[-1], q.shape[-2], k.shape[-2]
    bd = block_d(d)
    # lse's shape, rows padded to 16 bytes: the Gluon kernel reads query blocks of them by TMA
    n = lse.shape[-1]
    delta, lse2 = empty((2, *lse.shape[:-1], -(-n // 4) * 4), dtype=torch.float32, device=q.device)[..., :n].unbind(0)
    dlse = dlse.contiguous() if dlse is not None else None
    lse = lse.contiguous()
    ls = lse.stride()
    l_strides = (0, ls[0]) if varlen else ls[:2]  # lse's and dlse's
    w_strides = (0, delta.stride(0)) if varlen else delta.stride()[:2]  # delta's and lse2's
    fused = GLUON_FUSED_DQ and not deterministic
    gluon = ((GLUON is True or (GLUON == "auto" and gluon_auto(d, causal, seq_q, seq_k, fused)))
             and _hopper_bwd is not None and not interpreting()
             and _hopper_bwd.supports(q, k, v, o, do, dk, dv, causal, window, softcap, varlen))
    # dQ fused: the Gluon kernel adds into an fp32 buffer that the preprocess kernel zeroes
    fused_acc = _hopper_bwd.dq_buffer(batch, hq, seq_q, d, q.device, zeroed=False) if gluon and fused else None
    rows = 16 if interpreting() else 64
    launch(attn_bwd_preprocess_kernel, (cdiv(seq_q, rows), batch * hq), None,
           o, do, lse, dlse if dlse is not None else lse, delta, lse2, cu_seqlens if varlen else q,
           fused_acc[0] if fused_acc is not None else lse, *row_strides(o, varlen), *row_strides(do, varlen), *l_strides,
           *w_strides, seq_q, hq, fused_acc[0].shape[0] // (batch * hq) if fused_acc is not None else 0, HEAD_DIM=d,
           BLOCK_D=bd, HAS_DLSE=dlse is not None, VARLEN=varlen, ZERO_DQ=fused_acc is not None, BLOCK_M=rows,
           num_warps=4)
    if fused_acc is not None:  # dQ in the same kernel: none of the Triton setup below
        dq = empty(q.shape, dtype=q.dtype, device=q.device)
        _hopper_bwd.dkdv_hopper(q, k, v, do, dk, dv, lse2, delta, causal, scale, dq=dq, dq_acc=fused_acc)
        return dq, dk, dv
    tma = use_tma(q, k, v, do, dk, dv, varlen=varlen)
    separate_faster = gluon or (d >= SEPARATE_DQ_MIN_HEAD_DIM and seq_k >= SEPARATE_DQ_MIN_SEQ_K)
    # Head dims over 128 never take the atomic path: its dq reduce hit an illegal address on the H100 at
    # d=256 (tests/test_attention.py::test_gpu_large_shapes, atomic only; the dq kernel passes).
    atomic = ATOMIC_DQ and not deterministic and not separate_faster and d <= 128
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic else \
        torch.empty(1, dtype=torch.float32, device=q.device)  # unread, but the autotuner zeroes it: not q
    common = dict(HEAD_DIM=d, BLOCK_D=bd, CAUSAL=bool(causal), HAS_WINDOW=window is not None,
                  HAS_SOFTCAP=softcap is not None, VARLEN=varlen, USE_TMA=tma)
    softcap_scale, softcap2 = (scale / softcap, softcap * 1.4426950408889634) if softcap else (0.0, 0.0)
    score = (scale, scale * 1.4426950408889634, softcap_scale, softcap2, window or 0)
    head = (seq_q, seq_k, hq, hk, hq // hk, *score, seq_key(seq_q), seq_key(seq_k))
    cu = cu_seqlens if varlen else q
    dq_strides = row_strides(dq_acc, varlen) if atomic else (0, 0, 0)
    grid = lambda meta: (cdiv(seq_k, meta["BLOCK_N"]), batch * hk)  # noqa: E731
    key = (seq_key(seq_q), seq_key(seq_k), tuple(common.items()), atomic, hq // hk, q.dtype)
    if gluon:  # dK / dV only: dQ from the Triton dQ kernel below
        _hopper_bwd.dkdv_hopper(q, k, v, do, dk, dv, lse2, delta, causal, scale)
    else:
        launch(attn_bwd_dkdv_kernel, grid, key, q, k, v, do, dk, dv, dq_acc, lse2, delta, cu,
               *row_strides(q, varlen), *row_strides(k, varlen), *row_strides(v, varlen), *row_strides(do, varlen),
               *row_strides(dk, varlen), *row_strides(dv, varlen), *dq_strides, *w_strides, *head, seq_key(hq // hk),
               ATOMIC_DQ=atomic, DQ_TMA=atomic and tma and not interpreting(), **common)
    if atomic:
        return dq_acc.to(q.dtype), dk, dv
    dq = empty(q.shape, dtype=q.dtype, device=q.device)
    grid = lambda meta: (cdiv(seq_q, meta["BLOCK_M"]), batch * hq)  # noqa: E731
    launch(attn_bwd_dq_kernel, grid, (seq_key(seq_q), seq_key(seq_k), tuple(common.items()), q.dtype),
           q, k, v, do, dq, lse2, delta, cu, *row_strides(q, varlen), *row_strides(k, varlen), *row_strides(v, varlen),
           *row_strides(do, varlen), *row_strides(dq, varlen), *w_strides, *head, **common)
    return dq, dk, dv

