"""scaled_matmul's precise mode on Hopper, in Gluon: one warpgroup's fp32 promotions hide under the other's MMAs.

Hopper's fp8 wgmma sums in fewer bits than fp32 (DeepSeek-V3 measured ~14), so a precise fp8 GEMM (torch's
``use_fast_accum=False``) adds each 128-deep K tile's partial product to an fp32 accumulator on the CUDA cores,
as cuBLAS does (at K = 16384 its error and this kernel's agree to four digits). What was measured on the H100
(`benchmarks/experiments/h100/scaled_matmul/`):
  - plain Triton, every promotion scheme (per tile, Triton's max_num_imprecise_acc, every 256 of K, one step
    late; 1 or 2 programs per SM): 0.72-0.79x torch._scaled_mm. The add waits for the MMA it reads and the
    next MMA for the add, and the two warpgroups of a CTA step together, so the tensor cores idle during
    every promotion (fp8_precise_variants.json);
  - Gluon, one partition, each K step's MMA started before the previous step's product is added
    (warpgroup_mma_wait(num_outstanding=1)): no faster (0.68-0.70x). ptxas serializes wgmma when other
    instructions read an accumulator before a full wait (C7514), so the overlap never happens
    (fp8_gluon_lagged.json);
  - Gluon, warp-specialized (this kernel): a producer warp and two consumer warpgroups, each owning 64 rows
    of a 128 x 128 tile and running its own loop (no CTA-wide barrier between them). The tensor cores run one
    warpgroup's MMA at a time, so the two drift half a step apart and one's adds run under the other's MMA:
    0.90-0.96x (fp8_gluon_ws.json). Each consumer waits for its MMA in full (no C7514) and releases the slot
    through an mbarrier that counts both consumers.

Scope: tensorwise or rowwise scales (constant along K, applied in the epilogue), a (M, K) row-major and b as
torch._scaled_mm takes it, column-major (``w.t()`` of a K-contiguous (N, K) weight: fp8 wgmma reads B only
K-major), 16-byte aligned, output rows 16-byte aligned. scaled_matmul routes everything else to its Triton
kernel. The tile stops at 128 x 128: a consumer holds its accumulator and one tile product (64 + 64 fp32
registers per thread); 64 x 256 halves would need 256.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...runtime import launch
from ...runtime.gluon import smem_layout
from .tiles import grouped_tile_gluon, ws_ring, ws_ring_invalidate

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 128  # 128 of K: one promotion per K tile, DeepSeek-V3's interval
CONSUMER_REGS, PRODUCER_REGS = 240, 24  # per thread, after setmaxnreg: 2 x 128 x 240 + 128 x 24 = 64,512 of an SM's
# 65,536 (with 232 the 1x128-with-128x1 variant spilled; the producer only computes coordinates)
STAGES = 5  # 32 KiB of a and b per stage (+ 32-64 KiB of C tiles: 5 fit in 227 KiB); on the H100 at 4096^3,
# 3 / 4 / 5 stages gave 1097 / 1206 / 1239 TFLOP/s (benchmarks/experiments/h100/scaled_matmul/fp8_gluon_ws.json)
GROUP_M = 8


@gluon.jit
def _scales(S, start, n, stride, GROUP: gl.constexpr, BLOCK: gl.constexpr, layout: gl.constexpr):
    """A (BLOCK,) fp32 vector of the scales of rows (or columns) start..start+BLOCK along one K block: GROUP
    consecutive rows share a scale (0: all of them; 1: one each; 128: DeepSeek-V3's blocks, which a tile's
    64 or 128 aligned rows never straddle)."""
    if GROUP == 0:
        return gl.full((BLOCK,), 0.0, gl.float32, layout=layout) + gl.load(S)
    elif GROUP == 1:
        idx = start + gl.arange(0, BLOCK, layout=layout)
        return gl.load(S + idx * stride, mask=idx < n, other=0.0)
    else:
        return gl.full((BLOCK,), 0.0, gl.float32, layout=layout) + gl.load(S + (start // GROUP) * stride)


@gluon.jit
def _scalar_scale(S, start, stride, GROUP: gl.constexpr):
    """The one scale a tile's aligned rows (or columns) share, for GROUP 0 (whole tensor) or 128 (blocks)."""
    if GROUP == 0:
        return gl.load(S)
    else:
        return gl.load(S + (start // GROUP) * stride)


@gluon.jit
def _k_block_factors(SCALE_A, SCALE_B, kb, row0, col0, M, N, s_am, s_ak, s_bn, s_bk, A_GROUP: gl.constexpr,
                     B_GROUP: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, row_layout: gl.constexpr,
                     col_layout: gl.constexpr):
    """K block kb's scales folded into what the promotion multiplies by: r (rows) and q (columns). A side
    whose scale is one number for the tile folds into the other side's vector, so the promotion costs one
    FMA per element (two only when both sides vary: 1x128 of a with 128x1 of b)."""
    r = _scales(SCALE_A + kb * s_ak, row0, M, s_am, A_GROUP, HALF_M, row_layout)
    q = _scales(SCALE_B + kb * s_bk, col0, N, s_bn, B_GROUP, BLOCK_N, col_layout)
    if B_GROUP != 1:
        r = r * _scalar_scale(SCALE_B + kb * s_bk, col0, s_bn, B_GROUP)
    if A_GROUP != 1:
        q = q * _scalar_scale(SCALE_A + kb * s_ak, row0, s_am, A_GROUP)
    return r, q


@gluon.jit
def _ws_producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, STAGES: gl.constexpr,
                 GROUP_M: gl.constexpr):
    """One warp: copies each K step's boxes (the tile's two 64-row halves of a, its b box) into the ring, once
    both consumers have released the slot."""
    HALF_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    grid_m = gl.cdiv(M, 2 * HALF_M)
    grid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    my_tiles = gl.cdiv(grid_m * grid_n - gl.program_id(0), gl.num_programs(0))
    p = gl.to_tensor(0)
    for t in range(my_tiles):
        pid_m, pid_n = grouped_tile_gluon(gl.program_id(0) + t * gl.num_programs(0), grid_m, grid_n, GROUP_M)
        for ks in range(k_steps):
            slot = p % STAGES
            # A fresh barrier counts as having completed the phase before its first: round 0 passes at once.
            mbarrier.wait(empty.index(slot), ((p // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_m * 2 * HALF_M, ks * BLOCK_K], bar, a_bufs.index(2 * slot))
            tma.async_copy_global_to_shared(a_desc, [pid_m * 2 * HALF_M + HALF_M, ks * BLOCK_K], bar,
                                            a_bufs.index(2 * slot + 1))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, ks * BLOCK_K], bar, b_bufs.index(slot))
            p += 1


@gluon.jit
def _ws_consumer(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, SCALE_A, SCALE_B, BIAS, M, N, K,
                 stride_sam, stride_sak, stride_sbn, stride_sbk, stride_bias, A_GROUP: gl.constexpr,
                 B_GROUP: gl.constexpr, K_BLOCKED: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                 GROUP_M: gl.constexpr, HALF: gl.constexpr):
    """One warpgroup: rows [64 HALF, 64 HALF + 64) of each tile. Per K step: wait for the boxes, MMA into a
    fresh register tile and wait for it, release the slot, add the tile product to the fp32 accumulator
    (times the K block's scales when they change along K: DeepSeek-V3's 1x128 / 128x128 recipes)."""
    HALF_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    # wgmma's register layout for one warpgroup: 4 warps of 16 rows, one instruction across all BLOCK_N
    # columns, k = 32 for 8-bit operands.
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    grid_m = gl.cdiv(M, 2 * HALF_M)
    grid_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    my_tiles = gl.cdiv(grid_m * grid_n - gl.program_id(0), gl.num_programs(0))
    zero = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout=mma_layout)  # use_acc=False: layout only
    c_smem = c_bufs.index(HALF)
    c = gl.to_tensor(0)
    for t in range(my_tiles):
        pid_m, pid_n = grouped_tile_gluon(gl.program_id(0) + t * gl.num_programs(0), grid_m, grid_n, GROUP_M)
        row0 = pid_m * 2 * HALF_M + HALF * HALF_M
        col0 = pid_n * BLOCK_N
        acc = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout=mma_layout)
        # K-blocked scales are loaded one step ahead, so their latency hides behind a wait and an MMA; not
        # with per-column scales (128x1 of b), whose 32 values per thread a second copy would spill.
        PREFETCH: gl.constexpr = K_BLOCKED and B_GROUP != 1
        if PREFETCH:
            r_next, q_next = _k_block_factors(SCALE_A, SCALE_B, 0, row0, col0, M, N, stride_sam, stride_sak,
                                              stride_sbn, stride_sbk, A_GROUP, B_GROUP, HALF_M, BLOCK_N,
                                              row_layout, col_layout)
        for ks in range(k_steps):
            if PREFETCH:
                r, q = r_next, q_next
                r_next, q_next = _k_block_factors(SCALE_A, SCALE_B, gl.minimum(ks + 1, k_steps - 1), row0, col0,
                                                  M, N, stride_sam, stride_sak, stride_sbn, stride_sbk, A_GROUP,
                                                  B_GROUP, HALF_M, BLOCK_N, row_layout, col_layout)
            elif K_BLOCKED:
                r, q = _k_block_factors(SCALE_A, SCALE_B, ks, row0, col0, M, N, stride_sam, stride_sak, stride_sbn,
                                        stride_sbk, A_GROUP, B_GROUP, HALF_M, BLOCK_N, row_layout, col_layout)
            slot = c % STAGES
            mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
            part = warpgroup_mma(a_bufs.index(2 * slot + HALF), b_bufs.index(slot).permute((1, 0)), zero,
                                 use_acc=False)
            mbarrier.arrive(empty.index(slot), count=1)
            # The promotion, under the other warpgroup's MMA: one FMA per element unless both sides vary.
            if K_BLOCKED and A_GROUP == 1 and B_GROUP == 1:
                acc = acc + part * gl.expand_dims(r, 1) * gl.expand_dims(q, 0)
            elif K_BLOCKED and B_GROUP == 1:
                acc = acc + part * gl.expand_dims(q, 0)
            elif K_BLOCKED:
                acc = acc + part * gl.expand_dims(r, 1)
            else:
                acc = acc + part
            c += 1

        # Epilogue: scales constant along K multiply the fp32 sum once, then bias, one rounding, a TMA store.
        if not K_BLOCKED:
            sa = _scales(SCALE_A, row0, M, stride_sam, A_GROUP, HALF_M, row_layout)
            sb = _scales(SCALE_B, col0, N, stride_sbn, B_GROUP, BLOCK_N, col_layout)
            acc = acc * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
        if HAS_BIAS:
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
            bias = gl.load(BIAS + cols * stride_bias, mask=cols < N, other=0.0).to(gl.float32)
            acc = acc + gl.expand_dims(bias, 0)
        tma.store_wait(pendings=0)  # this warpgroup's last store has finished reading c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row0, pid_n * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def fp8_precise_kernel(a_desc, b_desc, c_desc, SCALE_A, SCALE_B, BIAS, M, N, K,
                       stride_sam, stride_sak,  # scale_a: (row or 128-row block, 128-K block)
                       stride_sbn, stride_sbk,  # scale_b: (column or 128-column block, 128-K block)
                       stride_bias, A_GROUP: gl.constexpr, B_GROUP: gl.constexpr, K_BLOCKED: gl.constexpr,
                       HAS_BIAS: gl.constexpr,
                       STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       PRODUCER_REGS: gl.constexpr):
    """Persistent, warp-specialized: a producer warp and two consumer warpgroups, each consumer on its own
    64-row half of the 128 x BLOCK_N tile. The halves share the b box; their MMAs and promotions drift apart
    on their own (the tensor cores run one warpgroup's MMA at a time), so one's fp32 adds hide under the
    other's MMA."""
    HALF_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, HALF_M, BLOCK_N], c_desc.layout)
    ready, empty = ws_ring(STAGES, 2)  # ready: a slot's boxes landed; empty: both consumers are done with it
    # Integers equal to 1 arrive as constexprs: tensors, so every partition gets the same argument types.
    M = gl.to_tensor(M)
    N = gl.to_tensor(N)
    K = gl.to_tensor(K)
    stride_sam = gl.to_tensor(stride_sam)
    stride_sak = gl.to_tensor(stride_sak)
    stride_sbn = gl.to_tensor(stride_sbn)
    stride_sbk = gl.to_tensor(stride_sbk)
    stride_bias = gl.to_tensor(stride_bias)
    gl.warp_specialize([(_ws_consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, SCALE_A,
                                        SCALE_B, BIAS, M, N, K, stride_sam, stride_sak, stride_sbn, stride_sbk,
                                        stride_bias, A_GROUP, B_GROUP, K_BLOCKED, HAS_BIAS, STAGES, GROUP_M, 0)),
                        (_ws_consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, SCALE_A,
                                        SCALE_B, BIAS, M, N, K, stride_sam, stride_sak, stride_sbn, stride_sbk,
                                        stride_bias, A_GROUP, B_GROUP, K_BLOCKED, HAS_BIAS, STAGES, GROUP_M, 1)),
                        (_ws_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, STAGES, GROUP_M))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    ws_ring_invalidate(ready, empty, STAGES)


def supports(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """What the Gluon kernel needs beyond scaled_matmul's TMA path, which the caller has checked already (unit
    inner strides, 16-byte aligned bases and strides, b K-major; tests may force that path in the interpreter):
    a Hopper GPU (wgmma; not sm_100) and output rows that are 16-byte aligned for the TMA store."""
    n = b.shape[1]
    return (a.is_cuda and torch.cuda.get_device_capability(a.device)[0] == 9
            and (n * torch.empty((), dtype=out_dtype).element_size()) % 16 == 0)


def launch_precise(a, b, out, scale_a, scale_b, bias, a_scaling: tuple, b_scaling: tuple, num_programs: int,
                   stages: int = STAGES) -> None:
    """out = (a * scale_a) @ (b * scale_b) + bias through fp8_precise_kernel (see `supports`). a_scaling and
    b_scaling: (group, stride along rows / columns, stride along 128-K blocks, changes along K), as
    scaled_matmul's _scaling reads them off the scales' shapes."""
    a_group, s_am, s_ak, a_kb = a_scaling
    b_group, s_bn, s_bk, b_kb = b_scaling
    m, k = a.shape
    n = b.shape[1]

    def desc(t, shape, strides, block):
        # the layout made once per (box, dtype): ~10 us of host time each, three a call
        return TensorDescriptor(t, shape, strides, block, smem_layout(tuple(block), t.dtype))

    a_desc = desc(a, [m, k], [a.stride(0), 1], [BLOCK_M // 2, BLOCK_K])  # one 64-row half per consumer
    b_desc = desc(b, [n, k], [b.stride(1), 1], [BLOCK_N, BLOCK_K])  # b (K, N) column-major: w (N, K) row-major
    c_desc = desc(out, [m, n], [out.stride(0), 1], [BLOCK_M // 2, BLOCK_N])
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    bias_arg = bias if bias is not None else scale_a  # never read without HAS_BIAS
    # through runtime.launch: after the first call of a specialization, straight to the compiled kernel's launcher
    launch(
        fp8_precise_kernel, (min(num_programs, tiles),), None, a_desc, b_desc, c_desc, scale_a, scale_b, bias_arg,
        m, n, k, s_am, s_ak, s_bn, s_bk, bias.stride(0) if bias is not None else 0, A_GROUP=a_group, B_GROUP=b_group,
        K_BLOCKED=bool(a_kb or b_kb), HAS_BIAS=bias is not None, STAGES=stages, GROUP_M=GROUP_M,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4)
