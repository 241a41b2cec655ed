"""Attention forward on Hopper in Gluon, FlashAttention-3's layout: a producer warp and two consumer warpgroups.

One CTA owns 128 queries of one head. A producer warp copies the two 64-row halves of the query tile once,
then streams the head's key and value tiles through a ring of STAGES shared-memory slots with TMA, each
tile signalling its own mbarrier (a consumer starts QKᵀ while V is still landing). Each consumer warpgroup
owns one 64-row half: per key block it runs QKᵀ on the tensor cores (wgmma, both operands in shared
memory), the online softmax in registers, and P·V with P straight from registers (wgmma's register A
operand: the score accumulator's layout converts to it without a shuffle), then releases the slot through an
mbarrier counting both consumers. The tensor cores serve one warpgroup's wgmma at a time, so the two
warpgroups drift apart and one's softmax runs under the other's GEMMs (FA3's "ping-pong", here without
a named barrier forcing the order).

Scope (`supports`): sm_90, bf16/fp16, head_dim 64 or 128, (batch, seq, heads, head_dim) tensors read in place
through 4-D tensor descriptors (any batch/seq/head strides that TMA takes: non-zero, 16-byte aligned),
causal or not (bottom-right aligned), GQA/MQA. Packed sequences, sliding windows, softcap, decoding and every
other GPU take the Triton kernels in `forward`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...runtime import cdiv

HALF_M = 64  # query rows per consumer warpgroup (wgmma's M is 64 per warpgroup)
BLOCK_M = 2 * HALF_M
BLOCK_N = 128
STAGES = 2  # K and V slots: d128 keeps 2 x (32 + 32) KiB of K/V and 32 KiB of Q in shared memory
CONSUMER_REGS, PRODUCER_REGS = 240, 24
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
def _producer(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, b, h, hk, m0,
              seqlen_q, seqlen_k, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the query tile's two halves, then every key block's K and V into the ring once both consumers
    have released the slot."""
    HALF: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    _, n_total = _block_range(m0, seqlen_q, seqlen_k, CAUSAL, 2 * HALF, BLOCK_N)
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    for i in gl.static_range(2):
        dst = q_bufs.index(i)._reinterpret(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
        tma.async_copy_global_to_shared(q_desc, [b, h, m0 + i * HALF, 0], q_bar, dst)
    for j in range(n_total):
        slot = j % STAGES
        # A fresh barrier counts as having completed the phase before its first: round 0 passes at once.
        mbarrier.wait(kv_empty.index(slot), ((j // STAGES) & 1) ^ 1)
        kd = k_bufs.index(slot)._reinterpret(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(slot), kd)
        vd = v_bufs.index(slot)._reinterpret(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(slot), vd)


@gluon.jit
def _step(q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, j, acc, l_i, m_i, zero_s, rows, seqlen_k, shift, scale2,
          MASKED: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """One key block of one warpgroup: S = QKᵀ, the online softmax (base 2, the scale folded into the
    exponent's FMA), O = O·alpha + P·V."""
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    s_layout: gl.constexpr = zero_s.type.layout
    o_layout: gl.constexpr = acc.type.layout
    slot = j % STAGES
    phase = (j // STAGES) & 1
    mbarrier.wait(k_ready.index(slot), phase)
    s = warpgroup_mma(q, k_bufs.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    if MASKED:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
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
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p_op = gl.convert_layout(p.to(k_bufs.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    mbarrier.wait(v_ready.index(slot), phase)
    acc = warpgroup_mma(p_op, v_bufs.index(slot), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(kv_empty.index(slot), count=1)
    return acc, l_i, m_new


@gluon.jit
def _consumer(q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, o_desc, LSE, stride_lb, stride_lh, b, h,
              m0, seqlen_q, seqlen_k, scale2, CAUSAL: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr):
    """One warpgroup: rows [m0 + 64 HALF, +64) of the tile, every key block the producer streams, then O / l
    through shared memory (the query half's slot) and a TMA store, and the row's log-sum-exp."""
    HALF_M: gl.constexpr = q_bufs.type.shape[1]
    HEAD_D: gl.constexpr = q_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    n_full, n_total = _block_range(m0, seqlen_q, seqlen_k, CAUSAL, 2 * HALF_M, BLOCK_N)
    rows = m0 + HALF * HALF_M + gl.arange(0, HALF_M, layout=row_s)
    shift = seqlen_k - seqlen_q
    m_i = gl.full([HALF_M], NEG_INF, gl.float32, layout=row_s)
    l_i = gl.zeros([HALF_M], gl.float32, layout=row_s)
    acc = gl.zeros([HALF_M, HEAD_D], gl.float32, layout=o_layout)
    zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)  # use_acc=False: its layout only
    q = q_bufs.index(HALF)
    mbarrier.wait(q_bar, 0)
    for j in range(0, n_full):
        acc, l_i, m_i = _step(q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, j, acc, l_i, m_i, zero_s, rows,
                              seqlen_k, shift, scale2, False, CAUSAL, STAGES)
    for j in range(n_full, n_total):
        acc, l_i, m_i = _step(q, k_bufs, v_bufs, k_ready, v_ready, kv_empty, j, acc, l_i, m_i, zero_s, rows,
                              seqlen_k, shift, scale2, True, CAUSAL, STAGES)
    empty_row = l_i == 0.0
    l_safe = gl.where(empty_row, 1.0, l_i)
    o = acc / gl.expand_dims(gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout)), 1)
    q.store(o.to(o_desc.dtype))  # every wgmma reading this half's queries has completed
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, m0 + HALF * HALF_M, 0],
                                    q._reinterpret(o_desc.dtype, o_desc.block_type.shape, o_desc.layout))
    lse = gl.where(empty_row, NEG_INF, (m_i + gl.log2(l_safe)) * LN2)
    gl.store(LSE + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + rows, lse, mask=rows < seqlen_q)
    tma.store_wait(pendings=0)


@gluon.jit
def attn_fwd_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE, stride_lb, stride_lh, seqlen_q, seqlen_k, n_heads_q,
                           group, scale2, CAUSAL: gl.constexpr, STAGES: gl.constexpr, Q_SMEM: gl.constexpr,
                           KV_SMEM: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Grid (query tiles, batch x heads). Q_SMEM / KV_SMEM: the 2-D shared layouts of the descriptors' boxes
    (the same swizzle; the copies see the buffers through the descriptors' 4-D layouts)."""
    HALF: gl.constexpr = q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    # Query tiles in reverse under a causal mask: the last are the longest, started first they leave the
    # short ones to fill the grid's tail.
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0) if CAUSAL else gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // n_heads_q
    h = pid_bh % n_heads_q
    hk = h // group
    m0 = pid_m * (2 * HALF)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2, HALF, HEAD_D], Q_SMEM)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D], KV_SMEM)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_D], KV_SMEM)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    # Integers equal to 1 arrive as constexprs: tensors, so every partition gets the same argument types.
    seqlen_q = gl.to_tensor(seqlen_q)
    seqlen_k = gl.to_tensor(seqlen_k)
    stride_lb = gl.to_tensor(stride_lb)
    stride_lh = gl.to_tensor(stride_lh)
    gl.warp_specialize([(_consumer, (q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, o_desc, LSE,
                                     stride_lb, stride_lh, b, h, m0, seqlen_q, seqlen_k, scale2, CAUSAL, STAGES, 0)),
                        (_consumer, (q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready, kv_empty, o_desc, LSE,
                                     stride_lb, stride_lh, b, h, m0, seqlen_q, seqlen_k, scale2, CAUSAL, STAGES, 1)),
                        (_producer, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_bar, k_ready, v_ready,
                                     kv_empty, b, h, hk, m0, seqlen_q, seqlen_k, CAUSAL, STAGES))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))


def _tma_ok(t: torch.Tensor) -> bool:
    """A (batch, seq, heads, d) tensor a 4-D descriptor reads in place: unit last stride, the others non-zero
    and 16-byte multiples, a 16-byte aligned base."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and (s * size) % 16 == 0 for s in t.stride()[:3]))


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, causal: bool, window, softcap,
             varlen: bool) -> bool:
    """Whether this kernel takes the call (the module docstring's scope); the caller falls back to Triton."""
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9 and q.dtype in _GL
            and q.shape[-1] in HEAD_DIMS and not varlen and window is None and not softcap
            and all(_tma_ok(t) for t in (q, k, v, o)))


def _desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """The 4-D descriptor (batch, heads, seq, d) over a (batch, seq, heads, d) tensor, box (1, 1, rows, d)."""
    d = t.shape[-1]
    block = [1, 1, rows, d]
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL[t.dtype])
    return TensorDescriptor(t, [t.shape[0], t.shape[2], t.shape[1], d], [t.stride(0), t.stride(2), t.stride(1), 1],
                            block, layout)


def attention_fwd_hopper(q, k, v, o, lse, causal: bool, scale2: float, stages: int = STAGES) -> None:
    """o, lse = attention(q, k, v) through attn_fwd_hopper_kernel (`supports` checked by the caller)."""
    batch, seq_q, hq, d = q.shape
    seq_k, hk = k.shape[1], k.shape[2]
    dt = _GL[q.dtype]
    q_smem = gl.NVMMASharedLayout.get_default_for([HALF_M, d], dt)
    kv_smem = gl.NVMMASharedLayout.get_default_for([BLOCK_N, d], dt)
    grid = (cdiv(seq_q, BLOCK_M), batch * hq)
    attn_fwd_hopper_kernel[grid](
        _desc(q, HALF_M), _desc(k, BLOCK_N), _desc(v, BLOCK_N), _desc(o, HALF_M), lse, lse.stride(0), lse.stride(1),
        seq_q, seq_k, hq, hq // hk, scale2, CAUSAL=bool(causal), STAGES=stages, Q_SMEM=q_smem, KV_SMEM=kv_smem,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)

