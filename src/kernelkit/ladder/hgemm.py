"""The bf16 ladder: HGEMM on the tensor cores, C = A @ B, row-major, in Triton.

`tl.dot` already runs on the tensor cores (wgmma on Hopper), so this ladder starts where the fp32 one ends: the
steps are about feeding them. Rungs 1-5 are one kernel (`hgemm_kernel`) under different launch parameters; read
the table of rungs at the bottom to see exactly what each changes. Rung 6 is a second kernel: persistent, its
operands fetched by the TMA engine through tensor descriptors. Rung 7 (`hgemm_gluon.py`) writes out in Gluon
what Triton decides for you: warps specialized by role, synchronized through mbarriers.

Shapes: any M, N, K. Loads are masked at the edges (rungs 1-5) or clipped by the TMA unit (rung 6, which needs
N % 8 == K % 8 == 0: TMA wants 16-byte aligned row strides). bf16 in, fp32 accumulation, bf16 out, as cuBLAS.
Dense bf16 peak of an H100 SXM: ~989 TFLOP/s; cuBLAS reaches ~740 at 4096^3.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..runtime import autotune, cdiv, ensure_tma_allocator, interpreting, launch, num_sms
from .rung import Launch, Rung, check_bf16_operands

# Triton 3.6's interpreter multiplies bfloat16 tiles as their uint16 bit patterns: there, the dot upcasts
# (bf16 values are exact in fp32, so the result is the tensor cores').
_INTERPRETER_DOT = tl.constexpr(interpreting())


@triton.jit
def _mma(a, b, acc):
    if _INTERPRETER_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tile_position(tile, grid_m, grid_n, GROUP_M: tl.constexpr):
    """Which output tile program `tile` computes. GROUP_M == 1: row-major order, so consecutive programs share
    a row of A but each reads a different column of B. GROUP_M > 1: GROUP_M row tiles sweep the columns
    together, so the B tiles they share are still in L2 when the next row tile asks for them."""
    per_group = GROUP_M * grid_n
    first_m = (tile // per_group) * GROUP_M
    group_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_m
    pid_n = (tile % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def hgemm_kernel(A, B, C, M, N, K,
                 stride_am, stride_ak,  # A (M, K)
                 stride_bk, stride_bn,  # B (K, N)
                 stride_cm, stride_cn,  # C (M, N)
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of C per program, stepping through K by BLOCK_K. How many k-steps of loads
    are in flight at once is the launch's num_stages: 1 waits for each step's loads before its MMA; 3-4 make
    Triton's pipeliner issue asynchronous copies (cp.async) into a ring of shared-memory buffers. cp.async
    moves 4 to 16 bytes per thread: the pipeliner needs to know the rows are aligned, which Triton learns by
    specializing the strides on being multiples of 16 (a row stride of 4096 is; one of 4097 is not)."""
    pid_m, pid_n = _tile_position(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M and columns past N re-read row / column 0 instead of being masked: the loads stay unmasked
    # along M and N (wide, vectorized), and the store's mask drops those outputs.
    rm_in = tl.max_contiguous(tl.multiple_of(tl.where(rm < M, rm, 0), BLOCK_M), BLOCK_M)
    rn_in = tl.max_contiguous(tl.multiple_of(tl.where(rn < N, rn, 0), BLOCK_N), BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + rm_in[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = B + rk[:, None] * stride_bk + rn_in[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=rk[None, :] < K - k0, other=0.0)  # the K tail reads zeros: they add nothing
        b = tl.load(b_ptrs, mask=rk[:, None] < K - k0, other=0.0)
        acc = _mma(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = C + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _tiles(bm, bn, bk, group_m, stages, warps) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_stages=stages, num_warps=warps)


# The interpreter runs a small tile, so the tests' shapes span several programs (masks, tile order and the
# persistent loop get exercised) and the CPU stays quick. On the GPU the autotuned rungs choose among
# Hopper-sized configs: 128 x 128 and 128 x 256 tiles, 64-wide k-steps, 3-5 stages, 4-8 warps.
_INTERPRETER_CONFIG = _tiles(32, 32, 16, 2, 1, 4)
_INTERPRETER_ONLY = [_INTERPRETER_CONFIG] if interpreting() else []
_HOPPER_CONFIGS = [_tiles(128, 256, 64, 8, 3, 8), _tiles(128, 128, 64, 8, 4, 4), _tiles(128, 128, 64, 8, 3, 8),
                   _tiles(256, 128, 64, 8, 3, 8), _tiles(128, 256, 64, 8, 4, 8), _tiles(128, 128, 128, 8, 3, 8),
                   _tiles(64, 256, 64, 8, 4, 4), _tiles(128, 64, 64, 8, 4, 4)]

hgemm_autotuned_kernel = autotune([*_INTERPRETER_ONLY, *_HOPPER_CONFIGS], key=["M", "N", "K"])(hgemm_kernel)


@triton.jit
def hgemm_persistent_tma_kernel(A, B, C, M, N, K, NUM_SMS: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                GROUP_M: tl.constexpr):
    """Persistent: one program per SM loops over output tiles (tile, tile + NUM_SMS, ...), so no program waits
    to be scheduled, and the next tile's loads start while the last tile's store drains. Operands come
    through tensor descriptors: the TMA engine copies whole boxes into shared memory (swizzled for the
    tensor cores, out-of-range rows and columns zero-filled, out-of-range stores dropped) with no address
    arithmetic or masks in the threads. `flatten` merges the tile and k loops into one software pipeline."""
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(B, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    c_desc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_position(tile, grid_m, grid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            a = a_desc.load([pid_m * BLOCK_M, ks * BLOCK_K])
            b = b_desc.load([ks * BLOCK_K, pid_n * BLOCK_N])
            acc = _mma(a, b, acc)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(C.dtype.element_ty))


hgemm_persistent_tma_autotuned = autotune(
    # shared memory per config: stages x (A box + B box) + the C box of the epilogue, within the 227 KB of an SM
    [*_INTERPRETER_ONLY, _tiles(128, 256, 64, 8, 3, 8), _tiles(128, 128, 64, 8, 4, 8),
     _tiles(128, 128, 64, 8, 4, 4), _tiles(128, 128, 64, 8, 5, 8), _tiles(256, 128, 64, 8, 3, 8)],
    key=["M", "N", "K"])(hgemm_persistent_tma_kernel)


# --- launchers ---

def _config(params: dict) -> tuple[dict, dict]:
    """(constexprs, launch options) of a params dict."""
    meta = {k: params[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
    return meta, {"num_warps": params["num_warps"], "num_stages": params["num_stages"]}


def _params(cfg: triton.Config) -> dict:
    return {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _fixed(params: dict) -> dict:
    """A fixed rung's tiles; in the interpreter the small tile (the rung's stages, warps and tile order kept)."""
    if interpreting():
        small = _params(_INTERPRETER_CONFIG)
        return {**params, **{k: small[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}}
    return params


def _chosen(kernel) -> Optional[dict]:
    cfg = getattr(kernel, "best_config", None)
    return _params(cfg) if cfg is not None else None


def _build_tiled(a, b, c, fixed: Optional[dict], params: Optional[dict]) -> Launch:
    """Rungs 1-5: hgemm_kernel with `params` (or the rung's `fixed` tiles); the autotuned rung when both are None."""
    check_bf16_operands(a, b, c)
    m, k = a.shape
    n = b.shape[1]
    args = (a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    if params is None and fixed is None:
        kernel = hgemm_autotuned_kernel
        grid = lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        launch(kernel, grid, (m, n, k, a.dtype), *args)  # tunes (or reads the tuning cache) on this first call
        return Launch(lambda: launch(kernel, grid, (m, n, k, a.dtype), *args), _chosen(kernel) or {})
    params = params or _fixed(fixed)
    meta, options = _config(params)
    grid = (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)
    return Launch(lambda: hgemm_kernel[grid](*args, **meta, **options), dict(params))


def _tma_problem(m: int, n: int, k: int) -> Optional[str]:
    if n % 8 or k % 8:
        return "needs N % 8 == K % 8 == 0 (TMA: 16-byte aligned row strides)"
    return None


def _build_persistent(a, b, c, params: Optional[dict]) -> Launch:
    check_bf16_operands(a, b, c)
    m, k = a.shape
    n = b.shape[1]
    for t, name in ((a, "a"), (b, "b"), (c, "c")):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned for TMA")
    if problem := _tma_problem(m, n, k):
        raise ValueError(f"hgemm persistent_tma: {problem} (got M={m}, N={n}, K={k})")
    if a.is_cuda:
        ensure_tma_allocator()  # descriptors made inside the kernel live in a scratch buffer Triton asks for
    sms = num_sms(a.device) if a.is_cuda else 3  # 3 programs in the interpreter: each loops over several tiles
    grid = lambda meta: (min(sms, cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"])),)  # noqa: E731
    args = (a, b, c, m, n, k)
    if params is None:
        kernel = hgemm_persistent_tma_autotuned
        launch(kernel, grid, (m, n, k, a.dtype, sms), *args, NUM_SMS=sms)
        return Launch(lambda: launch(kernel, grid, (m, n, k, a.dtype, sms), *args, NUM_SMS=sms),
                      _chosen(kernel) or {})
    meta, options = _config(params)
    return Launch(lambda: hgemm_persistent_tma_kernel[grid(meta)](*args, NUM_SMS=sms, **meta, **options),
                  dict(params))


# --- the rungs ---

_TILE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 1}
_PIPELINED = {**_TILE, "num_stages": 4}
_GROUPED = {**_PIPELINED, "GROUP_M": 8}
_WIDE = {**_GROUPED, "BLOCK_N": 256, "num_warps": 8, "num_stages": 3}


def _fixed_rung(name, what_changed, expect, tiles) -> Rung:
    return Rung(name, what_changed, expect, "hgemm_kernel",
                build=lambda a, b, c, params=None: _build_tiled(a, b, c, tiles, params))


RUNGS = [
    _fixed_rung("tile", "one 128x128 tile per program, tl.dot on the tensor cores; num_stages=1: each k-step "
                        "waits for its loads",
                "tensor pipe utilization low; top stall long_scoreboard (waiting on global loads)", _TILE),
    _fixed_rung("pipelined", "num_stages=4: asynchronous copies keep 3 k-steps of A and B in flight while the "
                             "tensor cores work",
                "tensor pipe utilization up, long_scoreboard stalls down; shared memory per block x4", _PIPELINED),
    _fixed_rung("grouped", "grouped tile order (GROUP_M=8): row tiles that share columns of B run together",
                "DRAM throughput and bytes down (L2 hit rate up) for the same work", _GROUPED),
    _fixed_rung("wide_tiles", "128x256 tiles, 8 warps (two warpgroups), 3 stages: more MMA per byte loaded",
                "twice the MMA work per A tile loaded: fewer load bytes per MMA, L2 traffic down; tensor pipe up",
                _WIDE),
    Rung("autotuned", "the fastest of 8 tile / stage / warp configs for this shape on this GPU",
         "the winning config's registers and occupancy; tensor pipe at least the best fixed rung's",
         "hgemm_kernel", build=lambda a, b, c, params=None: _build_tiled(a, b, c, None, params)),
    Rung("persistent_tma", "persistent (one program per SM looping over tiles), operands by TMA tensor "
                           "descriptors, k and tile loops in one pipeline",
         "grid = number of SMs; no LSU global-load requests (TMA moves the bytes); tensor pipe the highest",
         "hgemm_persistent_tma_kernel", build=lambda a, b, c, params=None: _build_persistent(a, b, c, params),
         needs=_tma_problem),
    Rung("gluon_warp_specialized", "Gluon: a producer warp feeds a TMA/mbarrier ring; two consumer warpgroups "
                                   "(64 rows each) only issue wgmma, one MMA always in flight; no CTA barrier in "
                                   "the K loop (hgemm_gluon.py)",
         "3 warpgroups' worth of threads (2 x 128 + 32), setmaxnreg; tensor pipe the highest of the ladder, "
         "barrier stalls gone; top stall on the consumers' mbarrier waits only when loads fall behind",
         "hgemm_gluon_ws_kernel", build=lambda a, b, c, params=None: _gluon().build(a, b, c, params),
         needs=lambda m, n, k: _gluon().needs(m, n, k)),
]


def _gluon():
    from . import hgemm_gluon  # Gluon (Triton 3.6+), imported when the rung is used

    return hgemm_gluon
