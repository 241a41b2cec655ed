"""Attention forward on Hopper in Gluon, FlashAttention-3's layout: a producer warp and two consumer warpgroups.

A tile is 128 queries of one head. A producer warp copies the tile's two 64-row query halves, then streams the
head's key and value tiles through a ring of STAGES shared-memory slots with TMA, K and V each signalling its own
mbarrier (a consumer starts QKᵀ while V is still landing). Each consumer warpgroup owns one 64-row half: per key
block it runs QKᵀ on the tensor cores (wgmma, both operands in shared memory), the online softmax in registers, and
P·V with P straight from registers (wgmma's register A operand), then releases the slot through an mbarrier counting
both consumers. The tensor cores serve one warpgroup's wgmma at a time, so the two drift apart and one's softmax
runs under the other's GEMMs (FA3's ping-pong; a barrier forcing the order, `PINGPONG`, measured no gain). O leaves
through its own shared tiles and a TMA store left in flight.

The walk (`PERSISTENT`): one program per SM walks the tiles head by head, the producer loading the next tile
under this one's epilogue; causal heads of more than 32 query tiles run one program per tile instead (measured
faster there). FA3's intra-warpgroup overlap (`OVERLAP`) is built and measured slower, so off. H100 figures
and what was tried: docs/ops/attention.md.

Scope (`supports`): sm_90, bf16/fp16, head_dim 64 or 128, (batch, seq, heads, head_dim) tensors read in place
through 4-D tensor descriptors (any batch/seq/head strides that TMA takes: non-zero, 16-byte aligned; each head's
rows are zero-filled and clipped at its end), causal or not (bottom-right aligned), GQA/MQA. Packed sequences,
sliding windows, softcap, decoding, every other GPU and the rows where Triton measured faster
(`TRITON_UP_TO`) take the Triton kernels in `forward`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...runtime import cdiv, launch, num_sms
from ...runtime.gluon import descriptor, smem_layout
from .tiles import tma_compatible

HALF_M = 64  # query rows per consumer warpgroup (wgmma's M is 64 per warpgroup)
# Consumer warpgroups per program, by head_dim: a query tile is CONSUMERS x 64 rows. FA3 runs three at d64 (192-row
# tiles: more queries per K/V block loaded, more warps to hide the softmax); their registers come from the same 64K,
# and d128 has neither the registers nor the shared memory for three. H100 (docs/ops/attention.md, stop 41), d64
# forward against two consumers: s16384 502 vs 404-438 TFLOP/s (cuDNN 455), s16384 causal 477 vs 388-426 (cuDNN 448),
# s4096 448 vs 415; but slower for short causal heads (s4096 causal 364 vs 377, s1024 causal 167 vs 263, with the
# persistent walk or one program per tile alike), so causal heads of up to 32 such tiles keep two (`consumers`).
CONSUMERS = {64: 3, 128: 2}
BLOCK_N = 128
# K/V ring slots per head_dim: d128 holds 2 x (32 + 32) KiB of K/V beside 32 KiB of Q and 32 KiB of O tiles
# (192 of the SM's 227 KiB); d64 has room for more.
STAGES = {64: 3, 128: 2}
# The persistent walk (one program per SM walking the tiles, the producer loading the next tile under this one's
# epilogue), by causal: the most query tiles per head it takes (None: any); other calls run one program per tile.
# H100 (benchmarks/experiments/h100/2026-11-26-attention-gluon): persistent 2-11% faster without a mask and for
# causal heads up to 4096 queries (d128 s1024 causal 371 vs 342 TFLOP/s), one program per tile faster for long
# causal heads (d128 s16384 causal 576 vs 430).
PERSISTENT = {False: None, True: 32}
# Where the Triton kernel measured faster on the H100 (benchmarks/attention_vs_cudnn.py): (head_dim, causal) ->
# the longest key length it keeps; longer calls take this kernel.
# d64 s1024 causal: Triton 274 vs 262-265 TFLOP/s; every other row of the table took this kernel.
TRITON_UP_TO = {(64, False): 0, (64, True): 1024, (128, False): 0, (128, True): 0}
# FlashAttention-3's intra-warpgroup overlap (block j's softmax under block j-1's P·V), by head_dim: measured
# 0-12% slower than the serial loop on the H100 (and 24% at d128 s16384 causal), so off; kept for A/B.
OVERLAP = {64: False, 128: False}
# FlashAttention-3's ping-pong, forced: a consumer issues its GEMMs only on its turn and hands the turn to the other
# at once, so one warpgroup's softmax runs under the other's GEMMs by construction, not by drift (`_my_turn`).
# H100: within 3% of the drifting order on every row, with or without OVERLAP (docs/ops/attention.md, stop 41), so
# off; kept for A/B.
PINGPONG = {64: False, 128: False}
CONSUMER_REGS, PRODUCER_REGS = 240, 24
CONSUMER_REGS_3 = 160  # three consumer warpgroups and the producer warp share the SM's 64K registers
HEAD_DIMS = (64, 128)
_GL = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
NEG_INF = gl.constexpr(float("-inf"))
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _block_range(m0, seqlen_q, seqlen_k, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(n_full, n_total): key blocks [0, n_full) need no mask for any of the tile's rows, [n_full, n_total) do
    (the causal diagonal, the ragged last block); blocks past n_total hold no key any row may see."""
    shift = seqlen_k - seqlen_q
    if CAUSAL:
        hi = gl.minimum(gl.maximum(m0 + BLOCK_M + shift, 0), seqlen_k)  # the last row sees keys < m0 + BM + shift
        full = gl.minimum(gl.maximum(m0 + shift + 1, 0), seqlen_k)  # the first row sees keys <= m0 + shift
    else:
        hi = seqlen_k
        full = seqlen_k
    n_total = gl.cdiv(hi, BLOCK_N)
    n_full = gl.minimum(full // BLOCK_N, n_total)
    return n_full, n_total


@gluon.jit
def _tile(t, n_m, n_bh, n_heads_q, group, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """Tile t of the walk: (b, h, hk, m0). Head by head, so the tiles running at once share a few heads' K/V in
    L2 (longest first across heads thrashed it: 16 heads' K/V at 16k tokens is 128 MB). Causal: a head's
    longest query tiles (the last) first, and the persistent walk's odd rounds run backwards (zigzag), so a
    program that drew one of a round's longest tiles draws one of the next round's shortest."""
    if CAUSAL:
        g = gl.num_programs(0)
        r = t // g
        t = gl.where((r % 2 == 1) & ((r + 1) * g <= n_m * n_bh), r * g + (g - 1 - t % g), t)
        pid_m = n_m - 1 - t % n_m
    else:
        pid_m = t % n_m
    pid_bh = t // n_m
    h = pid_bh % n_heads_q
    return pid_bh // n_heads_q, h, h // group, pid_m * BLOCK_M


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty, n_m,
              n_bh, n_heads_q, group, seqlen_q, seqlen_k, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """One warp: for each of the program's tiles, the query tile's two halves once both consumers are done
    with the last tile's, then every key block's K and V into the ring once both consumers have released the
    slot. It runs ahead into the next tile while the consumers finish this one."""
    HALF: gl.constexpr = q_desc.block_type.shape[2]
    N_WG: gl.constexpr = q_bufs.type.shape[0]  # consumer warpgroups: query pieces of HALF rows a tile
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    c = gl.to_tensor(0)  # key blocks issued, over all tiles: the ring's slot and phase
    i = gl.to_tensor(0)  # tiles issued
    for t in range(gl.program_id(0), n_m * n_bh, gl.num_programs(0)):
        b, h, hk, m0 = _tile(t, n_m, n_bh, n_heads_q, group, CAUSAL, N_WG * HALF)
        _, n_total = _block_range(m0, seqlen_q, seqlen_k, CAUSAL, N_WG * HALF, BLOCK_N)
        # A fresh barrier counts as having completed the phase before its first: round 0 passes at once.
        mbarrier.wait(q_empty, (i & 1) ^ 1)
        mbarrier.expect(q_ready, N_WG * q_desc.block_type.nbytes)
        for half in gl.static_range(N_WG):
            dst = q_bufs.index(half)._reinterpret(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
            tma.async_copy_global_to_shared(q_desc, [b, h, m0 + half * HALF, 0], q_ready, dst)
        for j in range(n_total):
            slot = c % STAGES
            mbarrier.wait(kv_empty.index(slot), ((c // STAGES) & 1) ^ 1)
            kd = k_bufs.index(slot)._reinterpret(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(slot), kd)
            vd = v_bufs.index(slot)._reinterpret(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(slot), vd)
            c += 1
        i += 1


@gluon.jit
def _my_turn(turn, c, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """With PINGPONG, wait for this warpgroup's turn at its c-th key block: warpgroup 1's turn comes when warpgroup 0
    has issued block c, warpgroup 0's when warpgroup 1 has issued block c - 1 (a fresh barrier counts as having
    completed the phase before its first, so warpgroup 0 starts). Both walk the same blocks and neither gets more
    than one turn ahead, so the phase parity names the turn."""
    if PINGPONG:
        mbarrier.wait(turn.index(HALF), (c & 1) ^ (1 - HALF))


@gluon.jit
def _their_turn(turn, HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """With PINGPONG, hand the tensor cores to the other warpgroup (this one's GEMMs are issued)."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - HALF), count=1)


@gluon.jit
def _step(q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, j, c, acc, l_i, m_i, zero_s, rows, seqlen_k, shift,
          scale2, MASKED: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr,
          PINGPONG: gl.constexpr):
    """Key block j (the c-th through the ring) of one warpgroup: S = QKᵀ, the online softmax (base 2, the scale
    folded into the exponent's FMA), O = O·alpha + P·V. PINGPONG orders the QKᵀ issues of the two warpgroups."""
    o_layout: gl.constexpr = acc.type.layout
    slot = c % STAGES
    phase = (c // STAGES) & 1
    mbarrier.wait(k_ready.index(slot), phase)
    _my_turn(turn, c, HALF, PINGPONG)
    s = warpgroup_mma(q, k_bufs.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    _their_turn(turn, HALF, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, alpha, m_new, l_i = _softmax(s, m_i, l_i, j, rows, seqlen_k, shift, scale2, MASKED, CAUSAL)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p_op = gl.convert_layout(p.to(k_bufs.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    mbarrier.wait(v_ready.index(slot), phase)
    acc = warpgroup_mma(p_op, v_bufs.index(slot), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(kv_empty.index(slot), count=1)
    return acc, l_i, m_new


@gluon.jit
def _softmax(s, m_i, l_i, j, rows, seqlen_k, shift, scale2, MASKED: gl.constexpr, CAUSAL: gl.constexpr):
    """The online softmax of key block j's scores: (p, alpha, m_new, l_new), base 2, the scale folded into the
    exponent's FMA."""
    BLOCK_N: gl.constexpr = s.type.shape[1]
    if MASKED:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        ok = gl.expand_dims(cols, 0) < seqlen_k
        if CAUSAL:
            ok = ok & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + shift)
        s = gl.where(ok, s, NEG_INF)
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale2)
    if MASKED:  # a row with no key so far keeps max -inf; subtracting 0 keeps exp2 away from -inf - -inf
        m_use = gl.where(m_new == NEG_INF, 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(s * scale2 - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _overlapped_step(q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, j, c, acc, p_prev, l_i, m_i, zero_s,
                     rows, seqlen_k, shift, scale2, MASKED: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                     HALF: gl.constexpr, PINGPONG: gl.constexpr):
    """FlashAttention-3's intra-warpgroup overlap: block j's QKᵀ and block j-1's P·V are both issued, then
    block j's softmax runs while P·V is still on the tensor cores; O is rescaled once P·V lands. PINGPONG orders
    the two warpgroups' issues of that pair."""
    o_layout: gl.constexpr = acc.type.layout
    slot = c % STAGES
    prev = (c - 1) % STAGES
    mbarrier.wait(k_ready.index(slot), (c // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
    _my_turn(turn, c, HALF, PINGPONG)
    s = warpgroup_mma(q, k_bufs.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    acc = warpgroup_mma(p_prev, v_bufs.index(prev), acc, is_async=True)
    _their_turn(turn, HALF, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # groups complete in order: QKᵀ first
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, j, rows, seqlen_k, shift, scale2, MASKED, CAUSAL)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(kv_empty.index(prev), count=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p_op = gl.convert_layout(p.to(k_bufs.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    return acc, p_op, l_i, m_i


@gluon.jit
def _consumer(q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty, turn, o_desc, LSE,
              stride_lb, stride_lh, n_m, n_bh, n_heads_q, group, seqlen_q, seqlen_k, scale2, CAUSAL: gl.constexpr,
              STAGES: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, HALF: gl.constexpr):
    """One warpgroup: rows [m0 + 64 HALF, +64) of each of the program's tiles, every key block the producer
    streams; then O / l through its own shared-memory slot and a TMA store left in flight under the next tile,
    and the rows' log-sum-exp."""
    HALF_M: gl.constexpr = q_bufs.type.shape[1]
    N_WG: gl.constexpr = q_bufs.type.shape[0]
    HEAD_D: gl.constexpr = q_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)  # use_acc=False: its layout only
    q = q_bufs.index(HALF)
    o_smem = o_bufs.index(HALF)
    shift = seqlen_k - seqlen_q
    c = gl.to_tensor(0)
    i = gl.to_tensor(0)
    for t in range(gl.program_id(0), n_m * n_bh, gl.num_programs(0)):
        b, h, hk, m0 = _tile(t, n_m, n_bh, n_heads_q, group, CAUSAL, N_WG * HALF_M)
        n_full, n_total = _block_range(m0, seqlen_q, seqlen_k, CAUSAL, N_WG * HALF_M, BLOCK_N)
        rows = m0 + HALF * HALF_M + gl.arange(0, HALF_M, layout=row_s)
        m_i = gl.full([HALF_M], NEG_INF, gl.float32, layout=row_s)
        l_i = gl.zeros([HALF_M], gl.float32, layout=row_s)
        acc = gl.zeros([HALF_M, HEAD_D], gl.float32, layout=o_layout)
        mbarrier.wait(q_ready, i & 1)
        if OVERLAP:
            if n_total > 0:
                # block 0 alone (masked: it may hold the diagonal or the ragged end), then each step issues
                # block j's QKᵀ with block j-1's P·V, and the last P·V after the loops
                slot = c % STAGES
                mbarrier.wait(k_ready.index(slot), (c // STAGES) & 1)
                _my_turn(turn, c, HALF, PINGPONG)
                s = warpgroup_mma(q, k_bufs.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                _their_turn(turn, HALF, PINGPONG)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, 0, rows, seqlen_k, shift, scale2, True, CAUSAL)
                p_op = gl.convert_layout(p.to(k_bufs.dtype), p_layout)
                c += 1
                for j in range(1, n_full):
                    acc, p_op, l_i, m_i = _overlapped_step(q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, j, c,
                                                           acc, p_op, l_i, m_i, zero_s, rows, seqlen_k, shift,
                                                           scale2, False, CAUSAL, STAGES, HALF, PINGPONG)
                    c += 1
                for j in range(gl.maximum(n_full, 1), n_total):
                    acc, p_op, l_i, m_i = _overlapped_step(q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, j, c,
                                                           acc, p_op, l_i, m_i, zero_s, rows, seqlen_k, shift,
                                                           scale2, True, CAUSAL, STAGES, HALF, PINGPONG)
                    c += 1
                prev = (c - 1) % STAGES
                mbarrier.wait(v_ready.index(prev), ((c - 1) // STAGES) & 1)
                acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(prev), count=1)
        else:
            for j in range(0, n_full):
                acc, l_i, m_i = _step(q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, j, c, acc, l_i, m_i,
                                      zero_s, rows, seqlen_k, shift, scale2, False, CAUSAL, STAGES, HALF, PINGPONG)
                c += 1
            for j in range(n_full, n_total):
                acc, l_i, m_i = _step(q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn, j, c, acc, l_i, m_i,
                                      zero_s, rows, seqlen_k, shift, scale2, True, CAUSAL, STAGES, HALF, PINGPONG)
                c += 1
        mbarrier.arrive(q_empty, count=1)  # every wgmma reading this half's queries has completed
        empty_row = l_i == 0.0
        l_safe = gl.where(empty_row, 1.0, l_i)
        o = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
        tma.store_wait(pendings=0)  # the last tile's store has finished reading o_smem
        o_smem.store(o.to(o_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [b, h, m0 + HALF * HALF_M, 0],
                                        o_smem._reinterpret(o_desc.dtype, o_desc.block_type.shape, o_desc.layout))
        lse = gl.where(empty_row, NEG_INF, (m_i + gl.log2(l_safe)) * LN2)
        gl.store(LSE + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + rows, lse, mask=rows < seqlen_q)
        i += 1
    tma.store_wait(pendings=0)


@gluon.jit
def attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE, stride_lb, stride_lh, seqlen_q, seqlen_k, n_heads_q,
                           group, n_m, n_bh, scale2, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                           OVERLAP: gl.constexpr, PINGPONG: gl.constexpr, Q_SMEM: gl.constexpr,
                           KV_SMEM: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                           N_WG: gl.constexpr = 2):
    """Persistent: a grid of at most one program per SM walks the n_m x n_bh tiles (n_m query tiles of N_WG x 64
    rows per head, one consumer warpgroup a 64-row piece (N_WG 2 or 3), n_bh = batch x heads). Q_SMEM / KV_SMEM: the
    2-D shared layouts of the descriptors' boxes (the same swizzle; the copies see the buffers through the
    descriptors' 4-D layouts)."""
    HALF: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [N_WG, HALF, HEAD_D], Q_SMEM)
    o_bufs = gl.allocate_shared_memory(o_desc.dtype, [N_WG, HALF, HEAD_D], Q_SMEM)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D], KV_SMEM)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_D], KV_SMEM)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=N_WG)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=N_WG)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG's, one per warpgroup
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    # Integers equal to 1 arrive as constexprs: tensors, so every partition gets the same argument types.
    seqlen_q = gl.to_tensor(seqlen_q)
    seqlen_k = gl.to_tensor(seqlen_k)
    stride_lb = gl.to_tensor(stride_lb)
    stride_lh = gl.to_tensor(stride_lh)
    n_heads_q = gl.to_tensor(n_heads_q)
    group = gl.to_tensor(group)
    n_m = gl.to_tensor(n_m)
    n_bh = gl.to_tensor(n_bh)
    # (the frontend takes no tuple arithmetic: each partition's arguments are written out)
    if N_WG == 3:
        gl.warp_specialize([(_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty,
                                         turn, o_desc, LSE, stride_lb, stride_lh, n_m, n_bh, n_heads_q, group, seqlen_q,
                                         seqlen_k, scale2, CAUSAL, STAGES, OVERLAP, PINGPONG, 0)),
                            (_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty,
                                         turn, o_desc, LSE, stride_lb, stride_lh, n_m, n_bh, n_heads_q, group, seqlen_q,
                                         seqlen_k, scale2, CAUSAL, STAGES, OVERLAP, PINGPONG, 1)),
                            (_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty,
                                         turn, o_desc, LSE, stride_lb, stride_lh, n_m, n_bh, n_heads_q, group, seqlen_q,
                                         seqlen_k, scale2, CAUSAL, STAGES, OVERLAP, PINGPONG, 2)),
                            (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
                                         v_ready, kv_empty, n_m, n_bh, n_heads_q, group, seqlen_q, seqlen_k, CAUSAL,
                                         STAGES))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty,
                                         turn, o_desc, LSE, stride_lb, stride_lh, n_m, n_bh, n_heads_q, group, seqlen_q,
                                         seqlen_k, scale2, CAUSAL, STAGES, OVERLAP, PINGPONG, 0)),
                            (_consumer, (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, kv_empty,
                                         turn, o_desc, LSE, stride_lb, stride_lh, n_m, n_bh, n_heads_q, group, seqlen_q,
                                         seqlen_k, scale2, CAUSAL, STAGES, OVERLAP, PINGPONG, 1)),
                            (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready,
                                         v_ready, kv_empty, n_m, n_bh, n_heads_q, group, seqlen_q, seqlen_k, CAUSAL,
                                         STAGES))],
                           [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    mbarrier.invalidate(q_ready)
    mbarrier.invalidate(q_empty)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))


def _tma_ok(t: torch.Tensor) -> bool:
    """A (batch, seq, heads, d) tensor a 4-D descriptor reads in place: what the Triton kernels' descriptors take
    (`tiles.tma_compatible`), and a non-zero batch stride (here the batch is a descriptor dimension, not an offset
    added to the base)."""
    return tma_compatible((t,), False) and t.stride(0) > 0


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, causal: bool, window, softcap,
             varlen: bool) -> bool:
    """Whether this kernel takes the call (the module docstring's scope); the caller falls back to Triton."""
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9 and q.dtype in _GL
            and q.shape[-1] in HEAD_DIMS and not varlen and window is None and not softcap
            and all(_tma_ok(t) for t in (q, k, v, o)))


def preferred(d: int, causal: bool, seq_k: int) -> bool:
    """Whether this kernel measured faster than the Triton one at this head_dim, mask and key length."""
    return seq_k > TRITON_UP_TO.get((d, bool(causal)), 0)


def _desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """The 4-D descriptor (batch, heads, seq, d) over a (batch, seq, heads, d) tensor, box (1, 1, rows, d); `t` passes
    `_tma_ok` (`supports` checks it; `runtime.gluon.descriptor` does not)."""
    b, s, h, d = t.shape
    st = t.stride()
    return descriptor(t, [b, h, s, d], [st[0], st[2], st[1], 1], [1, 1, rows, d], smem_layout((1, 1, rows, d), t.dtype))


def consumers(d: int, causal: bool, seq_q: int) -> int:
    """Consumer warpgroups for this call: CONSUMERS[d], but two where three measured slower: causal heads of up to
    PERSISTENT[True] 192-row tiles (6144 queries; measured at 1024 and 4096, and faster at 16384)."""
    n_wg = CONSUMERS[d]
    cap = PERSISTENT[bool(causal)]
    if n_wg == 3 and causal and (cap is None or cdiv(seq_q, 3 * HALF_M) <= cap):
        return 2
    return n_wg


def attention_fwd_hopper(q, k, v, o, lse, causal: bool, scale2: float, stages: int | None = None) -> None:
    """o, lse = attention(q, k, v) through attn_fwd_hopper_kernel (`supports` checked by the caller)."""
    batch, seq_q, hq, d = q.shape
    seq_k, hk = k.shape[1], k.shape[2]
    q_smem = smem_layout((HALF_M, d), q.dtype)  # made once per box and dtype (host time)
    kv_smem = smem_layout((BLOCK_N, d), q.dtype)
    n_wg = consumers(d, causal, seq_q)
    n_m, n_bh = cdiv(seq_q, n_wg * HALF_M), batch * hq
    cap = PERSISTENT[bool(causal)]
    grid = (min(n_m * n_bh, num_sms(q.device)) if cap is None or n_m <= cap else n_m * n_bh,)
    # through runtime.launch: after a specialization's first call, straight to its compiled launcher (Triton's
    # per-call binding costs host time that a short call does not hide)
    launch(
        attn_fwd_hopper_kernel, grid, None,
        _desc(q, HALF_M), _desc(k, BLOCK_N), _desc(v, BLOCK_N), _desc(o, HALF_M), lse, lse.stride(0), lse.stride(1),
        seq_q, seq_k, hq, hq // hk, n_m, n_bh, scale2, CAUSAL=bool(causal), STAGES=stages or STAGES[d],
        OVERLAP=OVERLAP[d], PINGPONG=PINGPONG[d] and n_wg == 2, Q_SMEM=q_smem, KV_SMEM=kv_smem,
        CONSUMER_REGS=CONSUMER_REGS if n_wg == 2 else CONSUMER_REGS_3, PRODUCER_REGS=PRODUCER_REGS, N_WG=n_wg,
        num_warps=4)
