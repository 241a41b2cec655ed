"""Attention backward on Hopper in Gluon: a producer warp and two consumer warpgroups, as the forward.

A program owns 128 keys of one KV head. The producer warp copies the two 64-row halves of K and V once, then
streams (query, dO) tiles through a ring of STAGES slots with TMA: every query block of every query head of the
GQA group that the mask lets see these keys. Each consumer warpgroup owns 64 of the keys. Two steps:

**dQ fused** (`dkdv_hopper(..., dq=...)`, `_step_keys`; `backward.GLUON_FUSED_DQ`, where `backward.gluon_auto`
sends the call), FlashAttention-3's recipe with keys as rows, BLOCK_M_FUSED[d] queries a step (64 at d128, 128 at
d64):

    Sᵀ = K Qᵀ,  Pᵀ = exp2(Sᵀ·scale2 - lse2)    (lse2, delta: TMA'd into the ring with Q and dO, read where used)
    dPᵀ = V dOᵀ, dSᵀ = Pᵀ (dPᵀ - delta)
    dV += Pᵀ dO,  dK += dSᵀ Q                   (Pᵀ, dSᵀ rounded to 16 bits: register A operands)
    dQ += dS K                                  (dSᵀ through shared memory, both warpgroups': an mbarrier)

Each warpgroup's share of dQ (64 head-dim columns of the 64 queries at d128, 64 of the 128 queries at d64) goes
through a shared fp32 staging tile and one TMA reduce-add (`runtime.gluon.tma_reduce_add`; Gluon on Triton 3.6 has
the op in its builder, not its language) into an fp32 buffer (`dq_buffer`; `backward.attention_bwd` has the
preprocess kernel zero it), cast into dq at the end by `dq_convert_kernel`. Not
deterministic (the order of the adds): `deterministic=True` takes the other step. lse2 and delta rows are padded to
16 bytes for TMA (`stats_desc`); rows past seqlen_q read zeros (Q and dO rows there are zeros too: they add nothing).

**dQ from the Triton dQ kernel** (`_step`, keys as rows, BLOCK_M[d] queries: 64 at d64, 32 at d128): as above
without dQ, lse2 and delta loaded from global memory; `backward.attn_bwd_dq_kernel` recomputes P and dP per query
block and owns its rows: bitwise reproducible.

dK (times the softmax scale) and dV leave through the K / V halves' shared tiles and TMA stores. With the causal mask
the grid runs key block 0 (the longest) of a group of heads first (`LONGEST_FIRST`, `_kv_block`). `SPLIT_WAVES`
splits a GQA group's query heads over programs at small grids, dK and dV then added by fp32 TMA reduces
(`heads_split`).

H100 (docs/ops/attention.md, stop 46; the backward as a whole, preprocess and dQ's cast included), kernels alone:
0.94-1.02x cuDNN at d128 (0.85x in one noisy figure), 1.05-1.12x at d64, 1.13x and 1.21x at the Llama-3-8B and 3.2-1B
shapes (GQA 32/8, 2048 tokens, causal). Stop 44's step with queries as rows (P and dS through shared memory, SS wgmmas
for dV and dK) measured 0.92-0.95x this one at d128 and 0.84-0.85x at d64 without the mask; stop 42's fused step with
keys as rows but dQ by `red.global.add` from registers and lse / delta held in registers 0.81-0.95x the Triton dQ
kernel's backward.

Scope (`supports`): as the forward's (sm_90, bf16/fp16, head_dim 64 or 128, no window, softcap or packed
sequences, TMA-addressable (b, s, h, d) views) plus dO, dK, dV.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...runtime import launch, num_sms
from ...runtime.gluon import descriptor, smem_layout, tma_reduce_add
from . import hopper as _fwd

HALF_N = 64  # keys per consumer warpgroup
BLOCK_N = 2 * HALF_N
# Queries per step with the Triton dQ kernel, by head dim: at d128 64 spilled (dK, dV: 64 + 64 fp32 registers a
# thread, and the 64 x 64 score tiles); at d64 the accumulators are half that.
BLOCK_M = {64: 64, 128: 32}
BLOCK_M_FUSED = {64: 128, 128: 64}  # with dQ fused (`_step_keys`)
CONVERT_ELEMENTS = 8192  # fp32 elements of dQ's buffer a `dq_convert_kernel` program casts (128 rows at d64)
STAGES = 2
CONSUMER_REGS, PRODUCER_REGS = 240, 24
# With the causal mask a key block's work falls with its index (block 0 sees every query, the last one block's worth),
# so programs in launch order (a head's blocks, then the next head's) leave the last head's longest blocks for the
# tail. LONGEST_FIRST walks heads in groups of about as many as run at once in that order (SMs / key blocks: the same
# K / V, Q and dO in L2) and, within a group, key block 0 of every head first (`_kv_block`).
LONGEST_FIRST = True
# GQA at small batch: with dQ fused, a group's query heads are split over several programs per key block when the grid
# would otherwise fill fewer than SPLIT_WAVES waves (`heads_split`): each program adds its dK / dV share into zeroed
# fp32 buffers by TMA reduces (as dQ), cast into dk / dv at the end. At b1 h32/8 s2048 the unsplit causal grid is 8 KV
# heads x 16 key blocks = 128 programs for 132 SMs, the longest with 4 x 32 steps. H100, kernels alone (stop 45,
# benchmarks/experiments/h100/2026-11-26-stop45, on stop 44's step): there 1.40x (292 vs 209 TFLOP/s; cuDNN 303); 0
# turns it off.
SPLIT_WAVES = 2
# With dQ fused and the causal mask: one loop over a key block's query blocks, the mask applied on every step (the
# compare and select cost little; all-true past the diagonal), instead of a masked loop and an unmasked one. ptxas
# (Triton 3.6) spills 68 bytes at d128 instead of 156-180, 172 at d64 instead of 224-244. H100, kernels alone (stop
# 46, benchmarks/experiments/h100/2026-11-27-stop46/1-one-loop): level at d128 (0.99-1.01x), 0.98-1.02x at d64, so
# off (`benchmarks/attention_vs_cudnn.py --bwd-variants`, `kk-bwd-one-loop`).
ONE_LOOP = False
POS_INF = gl.constexpr(float("inf"))
# Shared layout of a warpgroup's P and dS tiles (queries x 64 keys), read as they are and transposed by wgmma; at d64
# a warpgroup's dQ reads half of their rows. 64-byte swizzle; made once (host time).
DS_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
# A query block's lse2 or delta (1 x BM fp32) as TMA writes it, unswizzled, and read back as a vector (`_step_keys`).
STATS_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
STATS_1D = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])


@gluon.jit
def _q_range(n0, seqlen_q, seqlen_k, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Query blocks (in units of BLOCK_M rows) that see keys n0 .. n0 + BLOCK_N: [lo, a) take the causal mask,
    [a, hi) need none (rows past seqlen_q and keys past seqlen_k are zeros and add nothing that is stored)."""
    shift = seqlen_k - seqlen_q
    hi = gl.cdiv(seqlen_q, BLOCK_M)
    if CAUSAL:
        lo = gl.minimum(gl.maximum(n0 - shift, 0) // BLOCK_M, hi)
        a = gl.minimum(gl.maximum(gl.cdiv(gl.maximum(n0 + BLOCK_N - 1 - shift, 0), BLOCK_M), lo), hi)
    else:
        lo = hi * 0
        a = lo
    return lo, a, hi


@gluon.jit
def _kv_block(SPLIT: gl.constexpr):
    """(key block, batch x KV head, part) of this program. The grid is (heads per group x SPLIT, key blocks, groups): in
    launch order a group's programs key block by key block, block 0 of each of its heads first (`LONGEST_FIRST`); a
    group of 1 is head by head, the key blocks in order. `part` (< SPLIT) names the share of the GQA group's query
    heads. From program ids alone, so each partition recomputes it for free."""
    x = gl.program_id(0)
    return gl.program_id(1), gl.program_id(2) * (gl.num_programs(0) // SPLIT) + x // SPLIT, x % SPLIT


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, lse_desc, dl_desc, q_bufs, do_bufs, k_bufs, v_bufs, st_bufs, kv_bar,
              ready, empty, n_heads_k, group, seqlen_q, seqlen_k, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
              SPLIT: gl.constexpr, FUSED_DQ: gl.constexpr):
    """One warp: K and V halves once, then (Q, dO) of every query block of the program's heads of the group, and with
    FUSED_DQ the block's lse2 and delta (TMA zero-fills rows past seqlen_q)."""
    HALF: gl.constexpr = k_desc.block_type.shape[2]
    kv, bh, part = _kv_block(SPLIT)
    n0 = kv * (2 * HALF)
    b = bh // n_heads_k
    hk = bh % n_heads_k
    BM: gl.constexpr = q_desc.block_type.shape[2]
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for i in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hk, n0 + i * HALF, 0], kv_bar,
                                        k_bufs.index(i)._reinterpret(k_desc.dtype, k_desc.block_type.shape,
                                                                     k_desc.layout))
        tma.async_copy_global_to_shared(v_desc, [b, hk, n0 + i * HALF, 0], kv_bar,
                                        v_bufs.index(i)._reinterpret(v_desc.dtype, v_desc.block_type.shape,
                                                                     v_desc.layout))
    lo, _, hi = _q_range(n0, seqlen_q, seqlen_k, CAUSAL, BM, 2 * HALF)
    c = gl.to_tensor(0)
    per = group // SPLIT
    for g in range(part * per, part * per + per):
        h = hk * group + g
        for mb in range(lo, hi):
            slot = c % STAGES
            mbarrier.wait(empty.index(slot), ((c // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            if FUSED_DQ:
                mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + 2 * lse_desc.block_type.nbytes)
                st_row = (b * n_heads_k * group + h)
                tma.async_copy_global_to_shared(lse_desc, [st_row, mb * BM], bar, st_bufs.index(2 * slot))
                tma.async_copy_global_to_shared(dl_desc, [st_row, mb * BM], bar, st_bufs.index(2 * slot + 1))
            else:
                mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [b, h, mb * BM, 0], bar,
                                            q_bufs.index(slot)._reinterpret(q_desc.dtype, q_desc.block_type.shape,
                                                                            q_desc.layout))
            tma.async_copy_global_to_shared(do_desc, [b, h, mb * BM, 0], bar,
                                            do_bufs.index(slot)._reinterpret(do_desc.dtype,
                                                                             do_desc.block_type.shape,
                                                                             do_desc.layout))
            c += 1


@gluon.jit
def _dq_put(acc, stage, dq_desc, row, col, scale):
    """Hand a waited dQᵀ box to the TMA unit: into its shared staging tile, then reduce-add into the fp32 buffer."""
    stage.store(acc * scale)
    fence_async_shared()
    gl.thread_barrier()  # every thread's part of the tile, before one thread issues the reduce
    tma_reduce_add(dq_desc, [row, col], stage)


@gluon.jit
def _step(k_bufs, v, q_bufs, do_bufs, ready, empty, c, mb, h, dk, dv, zero_s, keys, LSE2, DELTA, l_base, stride_lh,
          seqlen_q, shift, scale2, MASKED: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
          HALF: gl.constexpr):
    """One query block for one warpgroup's 64 keys, keys as rows (dQ from the Triton kernel): Sᵀ = K Qᵀ, Pᵀ and dSᵀ
    stay in registers as the A operands of dV += Pᵀ dO and dK += dSᵀ Q."""
    BM: gl.constexpr = q_bufs.type.shape[1]
    s_layout: gl.constexpr = zero_s.type.layout
    acc_layout: gl.constexpr = dk.type.layout
    k = k_bufs.index(HALF)
    HALF_N: gl.constexpr = k.type.shape[0]
    zero_s = gl.zeros([HALF_N, BM], gl.float32, layout=s_layout)  # made here: no registers held across steps
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    slot = c % STAGES
    mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
    q = q_bufs.index(slot)
    do = do_bufs.index(slot)
    s_t = warpgroup_mma(k, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    rows = mb * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout))  # query positions (columns of Sᵀ)
    l_off = l_base + h.to(gl.int64) * stride_lh
    lse2 = gl.load(LSE2 + l_off + rows, mask=rows < seqlen_q, other=POS_INF)
    s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
    if MASKED:  # a key right of a query's diagonal: its score is -inf, its probability 0
        if CAUSAL:
            s_t = gl.where(gl.expand_dims(keys - shift, 1) <= gl.expand_dims(rows, 0), s_t, float("-inf"))
    p_t = gl.exp2(s_t * scale2 - gl.expand_dims(lse2, 0))
    dv = warpgroup_mma(gl.convert_layout(p_t.to(q_bufs.dtype), op_layout), do, dv, is_async=True)
    dp_t = warpgroup_mma(v, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    delta = gl.load(DELTA + l_off + rows, mask=rows < seqlen_q, other=0.0)  # loaded late: fewer live registers
    dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dp_t))
    dv, dp_t = dp_t
    ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(q_bufs.dtype)
    dk = warpgroup_mma(gl.convert_layout(ds_t, op_layout), q, dk, is_async=True)
    dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
    mbarrier.arrive(empty.index(slot), count=1)
    return dk, dv


@gluon.jit
def _step_keys(k_bufs, v, q_bufs, do_bufs, ds_bufs, st_bufs, ds_bar, dq_stage, ready, empty, c, mb, dk, dv, keys,
               dq_desc, dq_tile, shift, scale, scale2, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
               STAGES: gl.constexpr, HALF: gl.constexpr):
    """One query block for one warpgroup's 64 keys with keys as rows and dQ fused, FA3's order: Sᵀ = K Qᵀ
    and dPᵀ = V dOᵀ; Pᵀ and dSᵀ, rounded to 16 bits in registers, are the A operands of dV += Pᵀ dO and dK += dSᵀ Q;
    dSᵀ also goes to shared memory, and once both warpgroups' are in, this warpgroup adds dQ = dS K over all 128 keys
    for its 64 head-dim columns (d128) or its 64 of the 128 queries (d64) by one TMA reduce. lse2 and delta come from
    the ring's shared memory (the producer's TMA), read as vectors right where they are used: registers only while
    they are."""
    BM: gl.constexpr = q_bufs.type.shape[1]
    acc_layout: gl.constexpr = dk.type.layout
    k = k_bufs.index(HALF)
    HALF_N: gl.constexpr = k.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    slot = c % STAGES
    mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
    q = q_bufs.index(slot)
    do = do_bufs.index(slot)
    s_t = warpgroup_mma(k, q.permute((1, 0)), gl.zeros([HALF_N, BM], gl.float32, layout=s_layout), use_acc=False,
                        is_async=True)
    vec: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per query (column of Sᵀ)
    s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t,))
    if MASKED:  # a key right of a query's diagonal: its score is -inf, its probability 0
        if CAUSAL:
            rows = mb * BM + gl.arange(0, BM, layout=vec)  # query positions
            s_t = gl.where(gl.expand_dims(keys - shift, 1) <= gl.expand_dims(rows, 0), s_t, float("-inf"))
    lse2 = st_bufs.index(2 * slot)._reinterpret(gl.float32, [BM], STATS_1D).load(vec)
    p_t = gl.exp2(s_t * scale2 - gl.expand_dims(lse2, 0))
    dv = warpgroup_mma(gl.convert_layout(p_t.to(q_bufs.dtype), op_layout), do, dv, is_async=True)
    dp_t = warpgroup_mma(v, do.permute((1, 0)), gl.zeros([HALF_N, BM], gl.float32, layout=s_layout), use_acc=False,
                         is_async=True)
    dv, dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dp_t))
    delta = st_bufs.index(2 * slot + 1)._reinterpret(gl.float32, [BM], STATS_1D).load(vec)
    ds_t = (p_t * (dp_t - gl.expand_dims(delta, 0))).to(q_bufs.dtype)
    dslot = c % 2  # two slots: a warpgroup a step ahead never overwrites what the other still reads
    ds_s = ds_bufs.index(dslot * 2 + HALF)  # [64 keys, BM queries]
    ds_s.store(ds_t)
    fence_async_shared()
    gl.thread_barrier()  # the whole warpgroup's stores, before one thread arrives
    mbarrier.arrive(ds_bar.index(dslot), count=1)
    dk = warpgroup_mma(gl.convert_layout(ds_t, op_layout), q, dk, is_async=True)
    mbarrier.wait(ds_bar.index(dslot), (c // 2) & 1)
    HEAD_D: gl.constexpr = k.type.shape[1]
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, 64, 16])
    dq = gl.zeros([64, 64], gl.float32, layout=dq_layout)
    for j in gl.static_range(2):  # dS (queries x keys) read transposed from each warpgroup's dSᵀ tile
        if HEAD_D == 128:  # all 64 queries, head-dim columns 64 HALF..
            dq = warpgroup_mma(ds_bufs.index(dslot * 2 + j).permute((1, 0)),
                               k_bufs.index(j).slice(HALF * 64, 64, dim=1), dq, use_acc=j > 0, is_async=True)
        else:  # queries 64 HALF.. of BM = 128, every head-dim column
            gl.static_assert(BM == 128, "keys as rows at head dim 64: 128 queries a step")
            dq = warpgroup_mma(ds_bufs.index(dslot * 2 + j).slice(HALF * 64, 64, dim=1).permute((1, 0)),
                               k_bufs.index(j), dq, use_acc=j > 0, is_async=True)
    dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dq))
    mbarrier.arrive(empty.index(slot), count=1)
    tma.store_wait(pendings=0)  # the previous step's reduce has read the staging tile
    gl.thread_barrier()
    if HEAD_D == 128:
        _dq_put(dq, dq_stage.index(HALF), dq_desc, dq_tile + mb * BM, HALF * 64, scale)
    else:
        _dq_put(dq, dq_stage.index(HALF), dq_desc, dq_tile + mb * BM + HALF * 64, 0, scale)
    return dk, dv


@gluon.jit
def _consumer(k_bufs, v_bufs, q_bufs, do_bufs, ds_bufs, st_bufs, ds_bar, kv_bar, ready, empty, dk_desc,
              dv_desc, LSE2,
              DELTA, dq_desc, dq_stage, stride_lb, stride_lh, n_heads_k, n_mb, group, seqlen_q, seqlen_k,
              scale, scale2, CAUSAL: gl.constexpr, STAGES: gl.constexpr, FUSED_DQ: gl.constexpr,
              ONE_LOOP: gl.constexpr, SPLIT: gl.constexpr, ACC_SMEM: gl.constexpr, HALF: gl.constexpr):
    """One warpgroup: keys [n0 + 64 HALF, +64) of the program's block (`_kv_block`); dK and dV accumulate over every
    query block of the program's heads of the group. SPLIT > 1: dk_desc / dv_desc address fp32 buffers that the
    programs sharing these keys add into (ACC_SMEM: the 2-D layout of a [64, head_dim] fp32 tile)."""
    HALF_N: gl.constexpr = k_bufs.type.shape[1]
    kv, bh, part = _kv_block(SPLIT)  # here, not passed in: fewer values live across the partitions
    n0 = kv * (2 * HALF_N)
    b = bh // n_heads_k
    hk = bh % n_heads_k
    n_heads_q = n_heads_k * group
    HEAD_D: gl.constexpr = k_bufs.type.shape[2]
    BM: gl.constexpr = q_bufs.type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    zero_s = gl.zeros([HALF_N, BM], gl.float32, layout=s_layout)
    dk = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([HALF_N, HEAD_D], gl.float32, layout=acc_layout)
    keys = n0 + HALF * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    shift = seqlen_k - seqlen_q
    lo, a, hi = _q_range(n0, seqlen_q, seqlen_k, CAUSAL, BM, 2 * HALF_N)
    l_base = b.to(gl.int64) * stride_lb
    k = k_bufs.index(HALF)
    v = v_bufs.index(HALF)
    mbarrier.wait(kv_bar, 0)
    c = gl.to_tensor(0)
    per = group // SPLIT
    for g in range(part * per, part * per + per):
        h = hk * group + g
        dq_tile = (b * n_heads_q + h) * n_mb * BM  # dQ buffer row of query block 0
        if FUSED_DQ and ONE_LOOP:  # the mask on every step (`ONE_LOOP`)
            for mb in range(lo, hi):
                dk, dv = _step_keys(k_bufs, v, q_bufs, do_bufs, ds_bufs, st_bufs, ds_bar, dq_stage, ready, empty, c,
                                    mb, dk, dv, keys, dq_desc, dq_tile, shift, scale, scale2, CAUSAL, CAUSAL, STAGES,
                                    HALF)
                c += 1
        elif FUSED_DQ:  # the mask only on the diagonal's blocks
            for mb in range(lo, a):
                dk, dv = _step_keys(k_bufs, v, q_bufs, do_bufs, ds_bufs, st_bufs, ds_bar, dq_stage, ready, empty, c,
                                    mb, dk, dv, keys, dq_desc, dq_tile, shift, scale, scale2, True, CAUSAL, STAGES,
                                    HALF)
                c += 1
            for mb in range(a, hi):
                dk, dv = _step_keys(k_bufs, v, q_bufs, do_bufs, ds_bufs, st_bufs, ds_bar, dq_stage, ready, empty, c,
                                    mb, dk, dv, keys, dq_desc, dq_tile, shift, scale, scale2, False, CAUSAL, STAGES,
                                    HALF)
                c += 1
        else:
            for mb in range(lo, a):
                dk, dv = _step(k_bufs, v, q_bufs, do_bufs, ready, empty, c, mb, h, dk, dv, zero_s, keys, LSE2,
                               DELTA, l_base, stride_lh, seqlen_q, shift, scale2, True, CAUSAL, STAGES, HALF)
                c += 1
            for mb in range(a, hi):
                dk, dv = _step(k_bufs, v, q_bufs, do_bufs, ready, empty, c, mb, h, dk, dv, zero_s, keys, LSE2,
                               DELTA, l_base, stride_lh, seqlen_q, shift, scale2, False, CAUSAL, STAGES, HALF)
                c += 1
    if FUSED_DQ:  # the other warpgroup's dQ = dS K reads this half's K too: both done before K's tile takes dK
        gl.thread_barrier()
        mbarrier.arrive(ds_bar.index(2), count=1)
        mbarrier.wait(ds_bar.index(2), 0)
    if SPLIT > 1:  # add this program's share: staged in fp32 through this warpgroup's half of the (drained) ring
        ring = q_bufs if HALF == 0 else do_bufs
        stage = ring._reinterpret(gl.float32, [HALF_N, HEAD_D], ACC_SMEM)
        box = ring._reinterpret(gl.float32, dk_desc.block_type.shape, dk_desc.layout)
        stage.store(dk * scale)
        fence_async_shared()
        gl.thread_barrier()
        tma_reduce_add(dk_desc, [b, hk, n0 + HALF * HALF_N, 0], box)
        tma.store_wait(pendings=0)
        gl.thread_barrier()
        stage.store(dv)
        fence_async_shared()
        gl.thread_barrier()
        tma_reduce_add(dv_desc, [b, hk, n0 + HALF * HALF_N, 0], box)
        tma.store_wait(pendings=0)
    else:  # every wgmma reading this half's K and V has completed: their tiles carry dK and dV out
        k.store((dk * scale).to(dk_desc.dtype))
        v.store(dv.to(dv_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [b, hk, n0 + HALF * HALF_N, 0],
                                        k._reinterpret(dk_desc.dtype, dk_desc.block_type.shape, dk_desc.layout))
        tma.async_copy_shared_to_global(dv_desc, [b, hk, n0 + HALF * HALF_N, 0],
                                        v._reinterpret(dv_desc.dtype, dv_desc.block_type.shape, dv_desc.layout))
        tma.store_wait(pendings=0)


@gluon.jit
def attn_bwd_dkdv_hopper_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, lse_desc, dl_desc, LSE2,
                                DELTA, stride_lb,
                                stride_lh, n_mb, seqlen_q, seqlen_k, n_heads_k, group,
                                scale, scale2, CAUSAL: gl.constexpr, STAGES: gl.constexpr, ROWS_SMEM: gl.constexpr,
                                DS_SMEM: gl.constexpr, FUSED_DQ: gl.constexpr, ONE_LOOP: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SPLIT: gl.constexpr = 1,
                                ACC_SMEM: gl.constexpr = None):
    """Grid (heads per group x SPLIT, key blocks of 128, groups of batch x KV heads): `_kv_block`. ROWS_SMEM: the 2-D
    shared layout of every 64-row box; DS_SMEM: that of a warpgroup's dSᵀ tiles (64 keys x queries). FUSED_DQ: dQ too
    (`_step_keys`, BLOCK_M_FUSED queries), added by TMA reduces through dq_desc into the fp32 buffer of `dq_buffer`,
    lse2 and delta by TMA through lse_desc / dl_desc (`stats_desc`); else the caller runs the Triton dQ kernel and
    dq_desc, lse_desc and dl_desc are not read. ONE_LOOP: see the module constant. SPLIT > 1 (`heads_split`):
    dk_desc / dv_desc address zeroed fp32 buffers, added into by TMA reduces; ACC_SMEM: the 2-D layout of a
    [64, head_dim] fp32 tile."""
    HALF: gl.constexpr = k_desc.block_type.shape[2]
    BM: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = k_desc.block_type.shape[3]
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2, HALF, HEAD_D], ROWS_SMEM)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [2, HALF, HEAD_D], ROWS_SMEM)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BM, HEAD_D], ROWS_SMEM)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BM, HEAD_D], ROWS_SMEM)
    # both warpgroups' dS of a step (two slots), and [2]: both done with K before it carries dK out
    ds_bar = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(ds_bar.index(i), count=2)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    # Integers equal to 1 arrive as constexprs: tensors, so every partition gets the same argument types.
    seqlen_q = gl.to_tensor(seqlen_q)
    seqlen_k = gl.to_tensor(seqlen_k)
    group = gl.to_tensor(group)
    stride_lb = gl.to_tensor(stride_lb)
    stride_lh = gl.to_tensor(stride_lh)
    n_mb = gl.to_tensor(n_mb)
    n_heads_k = gl.to_tensor(n_heads_k)
    if FUSED_DQ:  # each warpgroup's dSᵀ (two slots; P stays in registers), its fp32 dQ box, each slot's lse2 / delta
        st_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 1, BM], lse_desc.layout)
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [4, HALF, BM], DS_SMEM)  # [slot * 2 + warpgroup]
        dq_stage = gl.allocate_shared_memory(gl.float32, [2, dq_desc.block_type.shape[0], dq_desc.block_type.shape[1]],
                                             dq_desc.layout)
    else:  # not used
        st_bufs = k_bufs
        ds_bufs = k_bufs
        dq_stage = k_bufs
    gl.warp_specialize([(_consumer, (k_bufs, v_bufs, q_bufs, do_bufs, ds_bufs, st_bufs, ds_bar, kv_bar, ready, empty,
                                     dk_desc, dv_desc, LSE2, DELTA, dq_desc, dq_stage, stride_lb, stride_lh, n_heads_k,
                                     n_mb, group, seqlen_q, seqlen_k, scale, scale2, CAUSAL, STAGES, FUSED_DQ,
                                     ONE_LOOP, SPLIT, ACC_SMEM, 0)),
                        (_consumer, (k_bufs, v_bufs, q_bufs, do_bufs, ds_bufs, st_bufs, ds_bar, kv_bar, ready, empty,
                                     dk_desc, dv_desc, LSE2, DELTA, dq_desc, dq_stage, stride_lb, stride_lh, n_heads_k,
                                     n_mb, group, seqlen_q, seqlen_k, scale, scale2, CAUSAL, STAGES, FUSED_DQ,
                                     ONE_LOOP, SPLIT, ACC_SMEM, 1)),
                        (_producer, (q_desc, do_desc, k_desc, v_desc, lse_desc, dl_desc, q_bufs, do_bufs, k_bufs,
                                     v_bufs, st_bufs, kv_bar, ready, empty, n_heads_k, group, seqlen_q, seqlen_k,
                                     CAUSAL, STAGES, SPLIT, FUSED_DQ))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(3):
        mbarrier.invalidate(ds_bar.index(i))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def supports(q, k, v, o, do, dk, dv, causal: bool, window, softcap, varlen: bool) -> bool:
    """The forward's scope, and dO, dK, dV that TMA can address."""
    return _fwd.supports(q, k, v, o, causal, window, softcap, varlen) and all(_fwd._tma_ok(t) for t in (do, dk, dv))


@functools.lru_cache(maxsize=256)  # a loop over n_bh: host time on every call otherwise
def heads_per_group(n_kv: int, n_bh: int, sms: int) -> int:
    """`LONGEST_FIRST`'s group: about as many heads as run at once head by head (ceil(sms / n_kv)), made a divisor of
    n_bh so that every group is whole (the nearest by ratio, the larger on a tie; all heads when fewer)."""
    want = -(-sms // n_kv)
    if want >= n_bh:
        return n_bh
    return min((g for g in range(1, n_bh + 1) if n_bh % g == 0), key=lambda g: (max(g / want, want / g), -g))


def heads_split(group: int, programs: int, sms: int) -> int:
    """How many programs share a key block's GQA group (`SPLIT_WAVES`): the fewest, a divisor of the group, that make
    `programs` (key blocks x batch x KV heads) fill SPLIT_WAVES waves of `sms`; 1 when they already do."""
    return next((s for s in range(1, group + 1) if group % s == 0 and programs * s >= SPLIT_WAVES * sms), group)


def dq_buffer(batch: int, hq: int, seq_q: int, d: int, device, zeroed: bool = True):
    """The fp32 buffer the fused kernel adds dQ into, (batch x heads x n_mb x BLOCK_M_FUSED[d], d) rows, and its TMA
    descriptor (64 x 64 boxes). `zeroed=False`: left for the caller to zero (`backward.attention_bwd` has the
    preprocess kernel do it); only rows below seq_q of each head are read back (`dq_convert_kernel`)."""
    bm = BLOCK_M_FUSED[d]
    acc = (torch.zeros if zeroed else torch.empty)((batch * hq * -(-seq_q // bm) * bm, d), dtype=torch.float32,
                                                   device=device)
    return acc, descriptor(acc, list(acc.shape), [d, 1], [64, 64], smem_layout((64, 64), torch.float32))


@triton.jit
def dq_convert_kernel(ACC, DQ, stride_b, stride_s, stride_h, seqlen_q, n_heads_q, acc_rows, HEAD_DIM: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """dq (batch, seq, heads, d) in its dtype from `dq_buffer`'s fp32 rows (acc_rows a head): one pass, in place of
    a transposing copy (torch's strided copy ran at ~1.9 TB/s on the H100)."""
    pid_bh = tl.program_id(1)
    b, h = pid_bh // n_heads_q, pid_bh % n_heads_q
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    mask = (rows < seqlen_q)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    acc = tl.load(ACC + pid_bh.to(tl.int64) * acc_rows * HEAD_DIM + r64 * HEAD_DIM + cols[None, :], mask=mask,
                  eviction_policy="evict_first")
    tl.store(DQ + b.to(tl.int64) * stride_b + r64 * stride_s + h * stride_h + cols[None, :],
             acc.to(DQ.dtype.element_ty), mask=mask)


def stats_desc(t: torch.Tensor, bm: int) -> TensorDescriptor:
    """The TMA descriptor of a (batch, heads, seq) fp32 lse2 or delta as (batch x heads, seq) rows, box 1 x bm: rows
    padded to 16 bytes (`backward.attention_bwd` allocates them so); reads past seq are zeros."""
    b, h, n = t.shape
    if t.dtype != torch.float32 or t.stride(2) != 1 or t.stride(1) % 4 or t.stride(0) != h * t.stride(1):
        raise ValueError(f"lse2 / delta: need fp32 (batch, heads, seq) rows padded to 16 bytes, got {t.dtype} "
                         f"strides {t.stride()}")
    return descriptor(t, [b * h, n], [t.stride(1), 1], [1, bm], STATS_SMEM)


def dkdv_hopper(q, k, v, do, dk, dv, lse2, delta, causal: bool, scale: float, dq=None,
                stages: int | None = None, dq_acc=None) -> None:
    """dk, dv of attention through attn_bwd_dkdv_hopper_kernel; lse2 / delta from the Triton preprocess kernel,
    (batch, heads_q, seq_q) fp32. With `dq` (q's shape and dtype) the kernel also computes dq, by TMA reduces into a
    zeroed fp32 buffer that `dq_convert_kernel` then casts into `dq`: `dq_acc`, `dq_buffer`'s (buffer, descriptor)
    made and zeroed by the caller, or a zeroed one made here. `supports` checked by the caller."""
    batch, seq_q, hq, d = q.shape
    seq_k, hk = k.shape[1], k.shape[2]
    bm = BLOCK_M_FUSED[d] if dq is not None else BLOCK_M[d]
    rows = smem_layout((HALF_N, d), q.dtype)
    n_mb = -(-seq_q // bm)
    k_desc = _fwd._desc(k, HALF_N)
    n_kv, n_bh = -(-seq_k // BLOCK_N), batch * hk
    sms = num_sms(q.device)
    split = heads_split(hq // hk, n_kv * n_bh, sms) if dq is not None else 1
    per_group = heads_per_group(n_kv * split, n_bh, sms) if causal and LONGEST_FIRST else 1
    if dq is not None:
        dq_acc, dq_desc = dq_acc if dq_acc is not None else dq_buffer(batch, hq, seq_q, d, q.device)
        lse_desc, dl_desc = stats_desc(lse2, bm), stats_desc(delta, bm)
    else:
        dq_desc = lse_desc = dl_desc = k_desc  # not read
    if split > 1:  # dK / dV added into zeroed fp32 buffers by the programs sharing each key block
        dk_acc, dv_acc = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device).unbind(0)
        dk_desc, dv_desc = _fwd._desc(dk_acc, HALF_N), _fwd._desc(dv_acc, HALF_N)
        acc_smem = smem_layout((HALF_N, d), torch.float32)
    else:
        dk_desc, dv_desc, acc_smem = _fwd._desc(dk, HALF_N), _fwd._desc(dv, HALF_N), None
    launch(  # through runtime.launch, as the forward
        attn_bwd_dkdv_hopper_kernel, (per_group * split, n_kv, n_bh // per_group), None,
        _fwd._desc(q, bm), _fwd._desc(do, bm), k_desc, _fwd._desc(v, HALF_N),
        dk_desc, dv_desc, dq_desc, lse_desc, dl_desc, lse2, delta, lse2.stride(0), lse2.stride(1),
        n_mb, seq_q, seq_k, hk, hq // hk, scale, scale * 1.4426950408889634,
        CAUSAL=bool(causal), STAGES=stages or STAGES, ROWS_SMEM=rows, DS_SMEM=DS_SMEM,
        FUSED_DQ=dq is not None, ONE_LOOP=ONE_LOOP and dq is not None and bool(causal), CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, SPLIT=split, ACC_SMEM=acc_smem, num_warps=4)
    if split > 1:
        dk.copy_(dk_acc)
        dv.copy_(dv_acc)
    if dq is None:
        return
    rows_per_prog = CONVERT_ELEMENTS // d
    launch(dq_convert_kernel, (-(-seq_q // rows_per_prog), batch * hq), None, dq_acc, dq, dq.stride(0), dq.stride(1),
           dq.stride(2), seq_q, hq, n_mb * bm, HEAD_DIM=d, BLOCK_M=rows_per_prog, num_warps=4)
