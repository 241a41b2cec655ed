"""The bf16 ladder's last rung, in Gluon: what Triton decides for you, written out by hand.

Up to rung 6 Triton chooses how warps split the work. Gluon (Triton's lower-level dialect, in Triton 3.6)
exposes the Hopper machinery directly, and this rung uses it to specialize warps by role, as cuBLAS and
CUTLASS do:

- a **producer** warp only issues TMA copies of A and B boxes into a ring of STAGES shared-memory slots; each
  slot has a `ready` mbarrier (the copy engine signals when the bytes land) and an `empty` one (the consumers
  signal when they are done reading it);
- two **consumer** warpgroups each own 64 rows of the 128 x BLOCK_N output tile and only issue wgmma: each
  keeps one MMA in flight (`warpgroup_mma_wait(num_outstanding=1)`) and releases a slot as soon as the MMA
  that read it has finished, so the tensor cores never wait for the loop's bookkeeping or the next loads.

No thread ever waits on a CTA-wide barrier inside the K loop: the roles synchronize only through mbarriers.
Needs a Hopper GPU (wgmma, TMA); Gluon has no interpreter, so on the CPU this rung says it cannot run.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..ops.gemm.tiles import grouped_tile_gluon, ws_ring, ws_ring_invalidate  # grouped order: as rung 3
from ..runtime import num_sms
from .rung import Launch, check_bf16_operands

HALF_M = 64  # rows per consumer warpgroup; the tile is 2 x HALF_M rows
BLOCK_K = 64  # 128 bytes of bf16 per row: one full 128-byte swizzle line
# (BLOCK_N, STAGES): shared memory per stage is (128 + BLOCK_N) x 64 x 2 bytes, plus the two consumers' C
# boxes (64 x BLOCK_N x 2 each), within the 227 KB of an H100 SM.
CONFIGS = [{"BLOCK_N": 256, "STAGES": 3, "GROUP_M": 8}, {"BLOCK_N": 128, "STAGES": 5, "GROUP_M": 8},
           {"BLOCK_N": 128, "STAGES": 4, "GROUP_M": 8}]
CONSUMER_REGS, PRODUCER_REGS = 232, 40  # per thread: a 64 x 256 fp32 accumulator is 128 of them


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    HALF_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    grid_m = gl.cdiv(M, 2 * HALF_M)
    grid_n = gl.cdiv(N, BLOCK_N)
    p = gl.to_tensor(0)
    for tile in range(gl.program_id(0), grid_m * grid_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile_gluon(tile, grid_m, grid_n, GROUP_M)
        for k in range(0, K, BLOCK_K):
            slot = p % STAGES
            # Wait until both consumers released this slot's previous contents (a fresh barrier counts as
            # released: the first round passes at once).
            mbarrier.wait(empty.index(slot), ((p // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_m * 2 * HALF_M, k], bar, a_bufs.index(2 * slot))
            tma.async_copy_global_to_shared(a_desc, [pid_m * 2 * HALF_M + HALF_M, k], bar, a_bufs.index(2 * slot + 1))
            tma.async_copy_global_to_shared(b_desc, [k, pid_n * BLOCK_N], bar, b_bufs.index(slot))
            p += 1


@gluon.jit
def _consumer(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr, HALF: gl.constexpr):
    HALF_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    # One warpgroup's wgmma layout: 4 warps of 16 rows; one instruction spans BLOCK_N columns, k = 16 for bf16.
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    grid_m = gl.cdiv(M, 2 * HALF_M)
    grid_n = gl.cdiv(N, BLOCK_N)
    c_smem = c_bufs.index(HALF)
    c = gl.to_tensor(0)
    for tile in range(gl.program_id(0), grid_m * grid_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile_gluon(tile, grid_m, grid_n, GROUP_M)
        acc = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout=mma_layout)
        prev_slot = gl.to_tensor(0)
        for k in range(0, K, BLOCK_K):
            slot = c % STAGES
            mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(2 * slot + HALF), b_bufs.index(slot), acc, is_async=True)
            # Keep this MMA in flight; the one before it is done, so the slot it read goes back to the producer.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if k > 0:
                mbarrier.arrive(empty.index(prev_slot), count=1)
            prev_slot = slot
            c += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(prev_slot), count=1)
        tma.store_wait(pendings=0)  # this consumer's previous C box has left shared memory
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pid_m * 2 * HALF_M + HALF * HALF_M, pid_n * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def hgemm_gluon_ws_kernel(a_desc, b_desc, c_desc, M, N, K, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """Persistent (one program per SM walks the tiles), warp-specialized: the default partition and one worker
    are the two consumer warpgroups, a one-warp worker is the producer."""
    HALF_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, HALF_M, BLOCK_N], c_desc.layout)
    ready, empty = ws_ring(STAGES, 2)  # ready: a slot's boxes landed; empty: both consumers are done with it
    M = gl.to_tensor(M)  # (integers equal to 1 arrive as constexprs; every partition gets tensors)
    N = gl.to_tensor(N)
    K = gl.to_tensor(K)
    gl.warp_specialize([(_consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, STAGES,
                                     GROUP_M, 0)),
                        (_consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, STAGES,
                                     GROUP_M, 1)),
                        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, STAGES, GROUP_M))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    ws_ring_invalidate(ready, empty, STAGES)


def needs(m: int, n: int, k: int) -> Optional[str]:
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        return "needs a Hopper GPU (wgmma and TMA; Gluon has no CPU interpreter)"
    if n % 8 or k % 8:
        return "needs N % 8 == K % 8 == 0 (TMA: 16-byte aligned row strides)"
    return None


def _launcher(a, b, c, params: dict):
    m, k = a.shape
    n = b.shape[1]
    bn = params["BLOCK_N"]

    def desc(t, block):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)

    a_desc, b_desc, c_desc = desc(a, [HALF_M, BLOCK_K]), desc(b, [BLOCK_K, bn]), desc(c, [HALF_M, bn])
    grid = (min(num_sms(a.device), triton.cdiv(m, 2 * HALF_M) * triton.cdiv(n, bn)),)
    return lambda: hgemm_gluon_ws_kernel[grid](a_desc, b_desc, c_desc, m, n, k, STAGES=params["STAGES"],
                                               GROUP_M=params["GROUP_M"], CONSUMER_REGS=CONSUMER_REGS,
                                               PRODUCER_REGS=PRODUCER_REGS, num_warps=4)


_CHOSEN: dict = {}  # (M, N, K) -> the fastest of CONFIGS on this GPU, timed once per process


def build(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, params: Optional[dict] = None) -> Launch:
    check_bf16_operands(a, b, c)
    m, k = a.shape
    n = b.shape[1]
    if problem := needs(m, n, k):
        raise ValueError(f"hgemm gluon_warp_specialized: {problem} (got M={m}, N={n}, K={k})")
    for t, name in ((a, "a"), (b, "b"), (c, "c")):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned for TMA")
    if params is None:
        if (m, n, k) not in _CHOSEN:  # time each config once (a few ms each), keep the fastest
            times = {i: triton.testing.do_bench(_launcher(a, b, c, cfg), warmup=5, rep=20)
                     for i, cfg in enumerate(CONFIGS)}
            _CHOSEN[(m, n, k)] = CONFIGS[min(times, key=times.get)]
        params = _CHOSEN[(m, n, k)]
    return Launch(_launcher(a, b, c, params), dict(params))
