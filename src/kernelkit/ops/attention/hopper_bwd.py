"""Attention backward's dK / dV on Hopper in Gluon: a producer warp and two consumer warpgroups, as the forward.

A program owns 128 keys of one KV head. The producer warp copies the two 64-row halves of K and V once, then
streams (query, dO) tiles of BLOCK_M[d] rows (64 at d64, 32 at d128) through a ring of STAGES slots with TMA:
every query block of every query head of the GQA group that the mask lets see these keys. Each consumer
warpgroup owns 64 of the keys and, per query block, runs on wgmma:

    Sᵀ  = K Qᵀ                 (64 keys x BLOCK_M queries; both operands in shared memory)
    Pᵀ  = exp2(Sᵀ·scale2 - lse2)   (lse2: the forward's lse in base 2, +inf for rows that saw no key)
    dV += Pᵀ dO                (Pᵀ from registers)
    dPᵀ = V dOᵀ
    dSᵀ = Pᵀ (dPᵀ - delta)     (delta = rowsum(O dO), from the Triton preprocess kernel)
    dK += dSᵀ Q                (dSᵀ from registers)

then releases the slot. dK (times the softmax scale) and dV leave through the K / V halves' shared tiles and TMA
stores.

dQ comes from the Triton dQ kernel (`backward.attn_bwd_dq_kernel`), which recomputes P and dP per query block and
owns its rows: no atomics, bitwise reproducible. With `backward.GLUON_FUSED_DQ` (off) `dkdv_hopper(..., dq=...)`
computes dQ here instead, FA3's way: each warpgroup writes its dSᵀ to shared memory (two slots); once both
halves are there (an mbarrier), each computes half of dQᵀ = Kᵀ dSᵀ over all 128 keys on wgmma (head-dim rows
64 HALF.. at d128, query columns 32 HALF.. at d64) and adds it into a zeroed fp32 buffer with `red.global.add.v2.f32` (Gluon on
Triton 3.6 has no TMA reduce). The buffer holds dQᵀ tile by tile, so inside a tile every address offset is a
constant; one copy casts it into dq at the end.

Off by default (`KERNELKIT_ATTENTION_GLUON_BWD=1` turns it on). H100, stop 42's 14-row table (docs/ops/attention.md):
with the Triton dQ kernel 0.95-1.24x the all-Triton backward (faster on 10 rows), still 0.56-0.95x cuDNN; with dQ
fused 0.81-0.95x of that. Measured slower and removed (stop 42, 0.78-0.99x): a software-pipelined step loop (the
next block's Sᵀ issued behind dV / dPᵀ, its softmax under dK / dQ) with lse / delta staged in shared memory by the
producer.

Scope (`supports`): as the forward's (sm_90, bf16/fp16, head_dim 64 or 128, no window, softcap or packed
sequences, TMA-addressable (b, s, h, d) views) plus dO, dK, dV.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ...runtime import launch
from ...runtime.gluon import smem_layout
from . import hopper as _fwd

HALF_N = 64  # keys per consumer warpgroup
BLOCK_N = 2 * HALF_N
# Queries per step, by head dim: at d128 64 spilled (dK, dV: 64 + 64 fp32 registers a thread, and the 64 x 64 score
# tiles); at d64 the accumulators are half that.
BLOCK_M = {64: 64, 128: 32}
STAGES = 2
CONSUMER_REGS, PRODUCER_REGS = 240, 24
POS_INF = gl.constexpr(float("inf"))


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
def _producer(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, kv_bar, ready, empty, b, hk, n0,
              group, seqlen_q, seqlen_k, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """One warp: K and V halves once, then (Q, dO) of every query block of every head of the group."""
    HALF: gl.constexpr = k_desc.block_type.shape[2]
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
    for g in range(group):
        h = hk * group + g
        for mb in range(lo, hi):
            slot = c % STAGES
            mbarrier.wait(empty.index(slot), ((c // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
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
def _red_add_pairs(ptrs, values):
    """*ptrs += values, fp32, without a result: one `red.global.add.v2.f32` (sm_90) per two neighbouring elements
    of a thread (the wgmma accumulator's column pairs, neighbours in memory, 8-byte aligned)."""
    gl.inline_asm_elementwise("red.relaxed.gpu.global.add.v2.f32 [$2], {$4, $5};\n\tmov.u32 $0, 0;\n\tmov.u32 $1, 0;",
                              "=r,=r,l,l,r,r", [ptrs.to(gl.int64, bitcast=True), values.to(gl.int32, bitcast=True)],
                              dtype=gl.int32, is_pure=False, pack=2)


@gluon.jit
def _dq_issue(k_bufs, ds_bufs, ds_bar, ds_t, c, HALF: gl.constexpr):
    """dQ with the two warpgroups' dSᵀ shared: each writes its 64 keys' dSᵀ to shared memory (two slots, so a
    warpgroup one step ahead never overwrites what the other still reads), and once both are there issues half of
    dQᵀ = Kᵀ dSᵀ over all 128 keys (two wgmmas, not waited): head-dim rows 64 HALF.. at d128, query columns
    BM/2 HALF.. at d64. One atomic per element and key block, not two."""
    BM: gl.constexpr = ds_bufs.type.shape[2]
    HEAD_D: gl.constexpr = k_bufs.type.shape[2]
    NQ: gl.constexpr = BM if HEAD_D == 128 else BM // 2
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
    dslot = c % 2
    ds_bufs.index(dslot * 2 + HALF).store(ds_t)
    fence_async_shared()
    gl.thread_barrier()  # the whole warpgroup's stores, before one thread arrives
    mbarrier.arrive(ds_bar.index(dslot), count=1)
    mbarrier.wait(ds_bar.index(dslot), (c // 2) & 1)
    acc = gl.zeros([64, NQ], gl.float32, layout=acc_l)
    for j in gl.static_range(2):
        if HEAD_D == 128:
            a_op = k_bufs.index(j).slice(HALF * 64, 64, dim=1).permute((1, 0))
            b_op = ds_bufs.index(dslot * 2 + j)
        else:
            a_op = k_bufs.index(j).permute((1, 0))
            b_op = ds_bufs.index(dslot * 2 + j).slice(HALF * NQ, NQ, dim=1)
        acc = warpgroup_mma(a_op, b_op, acc, use_acc=j > 0, is_async=True)
    return acc


@gluon.jit
def _dq_add(acc, mb, h, DQ_ACC, dq_base, stride_dqh, scale, HEAD_D: gl.constexpr, BM: gl.constexpr,
            HALF: gl.constexpr):
    """Add a warpgroup's half of a query block's dQᵀ (`_dq_issue`, waited) into DQ_ACC. DQ_ACC holds dQᵀ tile by
    tile, (batch, heads, query blocks, head_dim, BM), dense: inside a tile every offset is a constant and a thread's
    two neighbouring queries are neighbours in memory."""
    acc_l: gl.constexpr = acc.type.layout
    NQ: gl.constexpr = acc.type.shape[1]
    c0: gl.constexpr = HALF * 64 if HEAD_D == 128 else 0
    q0: gl.constexpr = 0 if HEAD_D == 128 else HALF * NQ
    qcols = q0 + gl.arange(0, NQ, layout=gl.SliceLayout(0, acc_l))
    drows = c0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
    base = DQ_ACC + dq_base + h.to(gl.int64) * stride_dqh + (mb * BM * HEAD_D).to(gl.int64)
    _red_add_pairs(base + gl.expand_dims(drows * BM, 1) + gl.expand_dims(qcols, 0), acc * scale)


@gluon.jit
def _step(k_bufs, v, q_bufs, do_bufs, ds_bufs, ds_bar, ready, empty, c, mb, h, dk, dv, zero_s, keys, LSE2, DELTA,
          DQ_ACC, l_base, dq_base, stride_lh, stride_dqh, seqlen_q, shift, scale, scale2, MASKED: gl.constexpr,
          CAUSAL: gl.constexpr, STAGES: gl.constexpr, FUSED_DQ: gl.constexpr, HALF: gl.constexpr):
    """One query block for one warpgroup's 64 keys (the module docstring's products)."""
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
    if FUSED_DQ:
        dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
        mbarrier.arrive(empty.index(slot), count=1)
        dq_t = _dq_issue(k_bufs, ds_bufs, ds_bar, ds_t, c, HALF)
        dq_t = warpgroup_mma_wait(num_outstanding=0, deps=(dq_t,))
        _dq_add(dq_t, mb, h, DQ_ACC, dq_base, stride_dqh, scale, k.type.shape[1], BM, HALF)
    else:
        dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
        mbarrier.arrive(empty.index(slot), count=1)
    return dk, dv


@gluon.jit
def _consumer(k_bufs, v_bufs, q_bufs, do_bufs, ds_bufs, ds_bar, kv_bar, ready, empty, dk_desc, dv_desc, LSE2, DELTA,
              DQ_ACC, stride_lb, stride_lh, stride_dqb, stride_dqh, b, hk, n0, group, seqlen_q, seqlen_k, scale,
              scale2, CAUSAL: gl.constexpr, STAGES: gl.constexpr, FUSED_DQ: gl.constexpr, HALF: gl.constexpr):
    """One warpgroup: keys [n0 + 64 HALF, +64); dK and dV accumulate over every query block of the group."""
    HALF_N: gl.constexpr = k_bufs.type.shape[1]
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
    dq_base = b.to(gl.int64) * stride_dqb
    k = k_bufs.index(HALF)
    v = v_bufs.index(HALF)
    mbarrier.wait(kv_bar, 0)
    c = gl.to_tensor(0)
    for g in range(group):
        h = hk * group + g
        for mb in range(lo, a):
            dk, dv = _step(k_bufs, v, q_bufs, do_bufs, ds_bufs, ds_bar, ready, empty, c, mb, h, dk, dv, zero_s, keys,
                           LSE2, DELTA, DQ_ACC, l_base, dq_base, stride_lh, stride_dqh, seqlen_q, shift, scale,
                           scale2, True, CAUSAL, STAGES, FUSED_DQ, HALF)
            c += 1
        for mb in range(a, hi):
            dk, dv = _step(k_bufs, v, q_bufs, do_bufs, ds_bufs, ds_bar, ready, empty, c, mb, h, dk, dv, zero_s, keys,
                           LSE2, DELTA, DQ_ACC, l_base, dq_base, stride_lh, stride_dqh, seqlen_q, shift, scale,
                           scale2, False, CAUSAL, STAGES, FUSED_DQ, HALF)
            c += 1
    # every wgmma reading this half's K and V has completed: their tiles carry dK and dV out
    k.store((dk * scale).to(dk_desc.dtype))
    v.store(dv.to(dv_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, n0 + HALF * HALF_N, 0],
                                    k._reinterpret(dk_desc.dtype, dk_desc.block_type.shape, dk_desc.layout))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, n0 + HALF * HALF_N, 0],
                                    v._reinterpret(dv_desc.dtype, dv_desc.block_type.shape, dv_desc.layout))
    tma.store_wait(pendings=0)


@gluon.jit
def attn_bwd_dkdv_hopper_kernel(q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, LSE2, DELTA, DQ_ACC, stride_lb,
                                stride_lh, stride_dqb, stride_dqh, seqlen_q, seqlen_k, n_heads_k, group,
                                scale, scale2, CAUSAL: gl.constexpr, STAGES: gl.constexpr, ROWS_SMEM: gl.constexpr,
                                DS_SMEM: gl.constexpr, FUSED_DQ: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                PRODUCER_REGS: gl.constexpr):
    """Grid (key blocks of 128, batch x KV heads). ROWS_SMEM: the 2-D shared layout of every 64-row box; DS_SMEM:
    that of a warpgroup's dSᵀ tile (64 keys x BLOCK_M queries). FUSED_DQ: dQ by atomics into DQ_ACC (fp32 dQᵀ
    tiles, (batch, heads, query blocks, head_dim, BLOCK_M), strides in elements), else the caller runs the Triton dQ
    kernel."""
    HALF: gl.constexpr = k_desc.block_type.shape[2]
    BM: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = k_desc.block_type.shape[3]
    n0 = gl.program_id(0) * (2 * HALF)
    b = gl.program_id(1) // n_heads_k
    hk = gl.program_id(1) % n_heads_k
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2, HALF, HEAD_D], ROWS_SMEM)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [2, HALF, HEAD_D], ROWS_SMEM)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BM, HEAD_D], ROWS_SMEM)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BM, HEAD_D], ROWS_SMEM)
    ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [4, HALF, BM], DS_SMEM)  # [slot * 2 + warpgroup]
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
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
    stride_dqb = gl.to_tensor(stride_dqb)
    stride_dqh = gl.to_tensor(stride_dqh)
    gl.warp_specialize([(_consumer, (k_bufs, v_bufs, q_bufs, do_bufs, ds_bufs, ds_bar, kv_bar, ready, empty, dk_desc,
                                     dv_desc, LSE2, DELTA, DQ_ACC, stride_lb, stride_lh, stride_dqb, stride_dqh, b,
                                     hk, n0, group, seqlen_q, seqlen_k, scale, scale2, CAUSAL, STAGES, FUSED_DQ,
                                     0)),
                        (_consumer, (k_bufs, v_bufs, q_bufs, do_bufs, ds_bufs, ds_bar, kv_bar, ready, empty, dk_desc,
                                     dv_desc, LSE2, DELTA, DQ_ACC, stride_lb, stride_lh, stride_dqb, stride_dqh, b,
                                     hk, n0, group, seqlen_q, seqlen_k, scale, scale2, CAUSAL, STAGES, FUSED_DQ,
                                     1)),
                        (_producer, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, kv_bar, ready,
                                     empty, b, hk, n0, group, seqlen_q, seqlen_k, CAUSAL, STAGES))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(ds_bar.index(i))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def supports(q, k, v, o, do, dk, dv, causal: bool, window, softcap, varlen: bool) -> bool:
    """The forward's scope, and dO, dK, dV that TMA can address."""
    return _fwd.supports(q, k, v, o, causal, window, softcap, varlen) and all(_fwd._tma_ok(t) for t in (do, dk, dv))


def ds_layout(d: int, dtype: torch.dtype):
    """Shared layout of a warpgroup's dSᵀ tile (64 keys x BLOCK_M[d] queries). At d64 each warpgroup reads half the
    queries for dQ, 32 = 64 bytes: the swizzle is 64 bytes wide, so that half starts on a swizzle atom."""
    if d == 64:
        return gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    return smem_layout((HALF_N, BLOCK_M[d]), dtype)


def dkdv_hopper(q, k, v, do, dk, dv, lse2, delta, causal: bool, scale: float, dq=None,
                stages: int | None = None) -> None:
    """dk, dv of attention through attn_bwd_dkdv_hopper_kernel; lse2 / delta from the Triton preprocess kernel,
    (batch, heads_q, seq_q) fp32. With `dq` (q's shape and dtype) the kernel also computes dq, by atomics into a
    zeroed fp32 buffer of dQᵀ tiles that is then copied into `dq`. `supports` checked by the caller."""
    batch, seq_q, hq, d = q.shape
    seq_k, hk = k.shape[1], k.shape[2]
    bm = BLOCK_M[d]
    rows = smem_layout((HALF_N, d), q.dtype)
    n_mb = -(-seq_q // bm)
    dq_acc = torch.zeros(batch, hq, n_mb, d, bm, dtype=torch.float32, device=q.device) if dq is not None else lse2
    grid = (-(-seq_k // BLOCK_N), batch * hk)
    launch(  # through runtime.launch, as the forward
        attn_bwd_dkdv_hopper_kernel, grid, None,
        _fwd._desc(q, bm), _fwd._desc(do, bm), _fwd._desc(k, HALF_N), _fwd._desc(v, HALF_N),
        _fwd._desc(dk, HALF_N), _fwd._desc(dv, HALF_N), lse2, delta, dq_acc, lse2.stride(0), lse2.stride(1),
        dq_acc.stride(0), dq_acc.stride(1), seq_q, seq_k, hk, hq // hk, scale, scale * 1.4426950408889634,
        CAUSAL=bool(causal), STAGES=stages or STAGES, ROWS_SMEM=rows, DS_SMEM=ds_layout(d, q.dtype),
        FUSED_DQ=dq is not None, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
    if dq is not None:  # (batch, heads, blocks, d, bm) -> (batch, blocks * bm, heads, d), cast while copied
        dq.copy_(dq_acc.permute(0, 2, 4, 1, 3).reshape(batch, n_mb * bm, hq, d)[:, :seq_q])
