"""What kernelkit's GEMM kernels share (linear, moe, scaled_matmul, the ladder's Gluon rung): the grouped tile order
(Triton and Gluon), the K-step of a plain or gate-up (SwiGLU) product, and tl.dot's input precision."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ... import switches
from ...runtime import interpreting

# Whether GEMMs load their operands through TMA descriptors on Hopper (linear's TMA kernel, the grouped kernels'
# weights); read once here for every GEMM of the engine.
GEMM_TMA = switches.on("KERNELKIT_GEMM_TMA")

# Triton 3.6's interpreter multiplies bfloat16 tiles as their uint16 bit patterns: there, the dot upcasts
# (16-bit operands are exact in fp32, so the result is what the tensor cores compute).
INTERPRETER_DOT = tl.constexpr(interpreting())


def tile_configs(tiles, group_m: int = 8) -> list:
    """triton.Configs of GEMM tiles given as (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps[, GROUP_M]) tuples
    (GROUP_M `group_m` where a tuple leaves it out). The interpreter runs only the first (see tune.autotune)."""
    return [triton.Config({"BLOCK_M": t[0], "BLOCK_N": t[1], "BLOCK_K": t[2],
                           "GROUP_M": t[5] if len(t) > 5 else group_m}, num_stages=t[3], num_warps=t[4])
            for t in tiles]


@triton.jit
def grouped_tile(pid, grid_m, grid_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` in grouped order: GROUP_M row tiles sweep the column tiles
    together, so the weight tiles they share stay in L2 instead of being re-read once per row tile."""
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(grid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@gluon.jit
def grouped_tile_gluon(pid, grid_m, grid_n, GROUP_M: gl.constexpr):
    """grouped_tile for Gluon kernels (scaled_matmul's precise kernel, the ladder's Gluon rung)."""
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = gl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@gluon.jit
def ws_ring(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """The mbarriers of a warp-specialized GEMM's ring of STAGES shared-memory slots: `ready` (the TMA copies
    of a slot's boxes signal it when their bytes land) and `empty` (each of CONSUMERS warpgroups signals it
    when done reading the slot). Returns (ready, empty); `ws_ring_invalidate` retires them."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return ready, empty


@gluon.jit
def ws_ring_invalidate(ready, empty, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@triton.jit
def gate_up_step(a, b, acc, acc_up, up_ptrs, up_mask, SWIGLU: tl.constexpr, UPCAST: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr):
    """One K step: acc += a @ b, and with SWIGLU acc_up += a @ up (the up half of a gate-up weight, loaded
    here). UPCAST (INTERPRETER_DOT): the operands go to fp32 first."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    if SWIGLU:
        u = tl.load(up_ptrs, mask=up_mask, other=0.0)
        if UPCAST:
            u = u.to(tl.float32)
        acc_up = tl.dot(a, u, acc_up, input_precision=INPUT_PRECISION)
    return acc, acc_up


def input_precision(dtype: torch.dtype, allow_tf32: bool):
    """tl.dot's input_precision: fp32 inputs in true fp32 ("ieee") unless TF32 is allowed; None (Triton's
    default) for 16-bit inputs, which the tensor cores take as they are."""
    if dtype != torch.float32:
        return None
    return "tf32" if allow_tf32 else "ieee"
