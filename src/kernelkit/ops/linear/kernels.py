"""linear's Triton GEMM kernels: the pointer GEMM and the TMA-descriptor GEMM, each with the epilogue (bias,
activation, scale, residual) in its store, and their configs. The launchers, the backward and the op are in the
package's `__init__`."""

from __future__ import annotations

import triton
import triton.language as tl

from ...runtime import autotune
from ..gemm.tiles import INTERPRETER_DOT, gate_up_step, grouped_tile, input_precision, tile_configs

INV_SQRT_2 = 0.7071067811865476
TWO_SQRT_2_OVER_PI = 1.5957691216057308  # 2 * sqrt(2 / pi): gelu_tanh's 0.5 * (1 + tanh(u)) is sigmoid(2u)
GELU_CUBIC = 0.044715
# The same constants for the kernels: a kernel may read only constexpr globals (the host code uses the floats).
K_INV_SQRT_2, K_TWO_SQRT_2_OVER_PI, K_GELU_CUBIC = (tl.constexpr(v) for v in (INV_SQRT_2, TWO_SQRT_2_OVER_PI, GELU_CUBIC))


def _gemm_configs() -> list:
    # The interpreter runs only the first config: small tiles there keep several programs per test shape
    # (masks and the grouped order get exercised) and the CPU fast. The rest are Hopper-sized tiles
    # (128x128x64 and 128x256x64 are where Triton's Hopper matmul tutorial lands), 3-4 stages of
    # shared-memory pipelining, 4-8 warps; the autotuner picks per (M bucket, N, K).
    return tile_configs(((32, 32, 32, 3, 4), (128, 128, 64, 3, 8), (128, 128, 64, 4, 4), (128, 256, 64, 3, 8),
                         (256, 128, 64, 3, 8), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4),
                         (128, 128, 32, 4, 8)))


@triton.jit
def _activate(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == "gelu":
        z = 0.5 * z * (1.0 + tl.erf(z * K_INV_SQRT_2))
    elif ACTIVATION == "gelu_tanh":
        z = z * tl.sigmoid(K_TWO_SQRT_2_OVER_PI * z * (1.0 + K_GELU_CUBIC * z * z))
    elif ACTIVATION == "silu":
        z = z * tl.sigmoid(z)
    elif ACTIVATION == "relu":
        z = tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as torch.relu (PTX max drops it)
    elif ACTIVATION == "relu2":
        z = tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as torch.relu (PTX max drops it)
        z = z * z
    return z


@triton.jit
def _epilogue(acc, acc_up, BIAS, RES, rm64, rn64, m_ok, n_ok, N, stride_bias, stride_rm, stride_rn, scale,
              HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Both GEMM kernels' epilogue on the fp32 tile: bias (the up half's too with swiglu), activation, scale,
    residual."""
    if HAS_BIAS:
        acc += tl.load(BIAS + rn64 * stride_bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION == "swiglu":
            acc_up += tl.load(BIAS + (rn64 + N) * stride_bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == "swiglu":
        acc = acc * tl.sigmoid(acc) * acc_up
    else:
        acc = _activate(acc, ACTIVATION)
    if HAS_SCALE:
        acc = acc * scale
    if HAS_RESIDUAL:
        acc += tl.load(RES + rm64[:, None] * stride_rm + rn64[None, :] * stride_rn,
                       mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    return acc


@autotune(_gemm_configs(), key=["M_BUCKET", "N", "K", "ACTIVATION", "HAS_BIAS", "HAS_RESIDUAL"])
@triton.jit
def linear_fwd_kernel(A, B, C, BIAS, RES,
                      stride_am, stride_ak,  # x (M, K)
                      stride_bk, stride_bn,  # b = W^T (K, N_total): the weight's strides swapped
                      stride_cm, stride_cn,  # out (M, N)
                      stride_rm, stride_rn,  # residual (M, N)
                      stride_bias,
                      M, N, K, M_BUCKET, scale,
                      ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                      HAS_SCALE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # N is the output width; with swiglu the weight has 2N rows: gate columns [0, N), up columns [N, 2N).
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, grid_m, grid_n, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    # Offsets are int64 (a transposed x has stride_ak = M: k * M can pass 2^31), computed once; the loop moves
    # the pointers (recomputing int64 (M, K) and (K, N) offsets every K step: 585 vs 597 TF/s at 4096^3 on the
    # H100, near the noise).
    # Rows past M and columns past N are masked, not clamped to row 0: indices built from tl.arange keep their
    # contiguity, so an N-contiguous B (matmul's row-major (K, N)) or an M-contiguous x still gets wide
    # vector loads. Clamped indices lose it: that B fell from ~550 to 49 TF/s at 4096^3 (measured).
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    rk64 = rk.to(tl.int64)
    a_ptrs = A + rm64[:, None] * stride_am + rk64[None, :] * stride_ak
    # nn.Linear's weight makes B K-contiguous (stride_bk = 1). Measured on the H100 (Triton 3.6, bf16, 4096^3,
    # experiments/h100/gemm/gemm_configs.py): this kernel reaches 0.70-0.72x of cuBLAS with it and 0.92x (706-719 TF/s,
    # 128x256x64 tiles) with an N-contiguous B; loading the K-contiguous tile as (BLOCK_N, BLOCK_K) and
    # handing tl.trans(...) to the MMA changed nothing. The next step is TMA descriptors (the ladder's
    # persistent_tma rung).
    b_ptrs = B + rk64[:, None] * stride_bk + rn64[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The up half of a swiglu gate-up weight. Defined for every activation: the compiler needs a loop-carried
    # value defined before the loop, and drops both when ACTIVATION is not "swiglu".
    up_ptrs = b_ptrs + N * stride_bn
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    step_a = BLOCK_K * stride_ak
    step_b = BLOCK_K * stride_bk
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & n_ok[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        acc, acc_up = gate_up_step(a, b, acc, acc_up, up_ptrs, b_mask, ACTIVATION == "swiglu",
                                   INTERPRETER_DOT, INPUT_PRECISION)
        a_ptrs += step_a
        b_ptrs += step_b
        if ACTIVATION == "swiglu":  # otherwise up_ptrs stays loop-invariant and the compiler drops it
            up_ptrs += step_b

    # Epilogue, in fp32 registers before the one store: bias, activation, scale, residual.
    acc = _epilogue(acc, acc_up, BIAS, RES, rm64, rn64, m_ok, n_ok, N, stride_bias, stride_rm, stride_rn, scale,
                    HAS_BIAS, ACTIVATION, HAS_SCALE, HAS_RESIDUAL)
    mask = m_ok[:, None] & n_ok[None, :]
    tl.store(C + rm64[:, None] * stride_cm + rn64[None, :] * stride_cn, acc.to(C.dtype.element_ty), mask=mask)


def _tma_configs() -> list:
    # Shared memory per config: stages x (A box + B box, + the up box with swiglu) + the C box of the store,
    # within the 227 KB of an H100 SM (the autotuner skips configs that do not fit). 64-row tiles for small M.
    # SUBTILE stores the C tile in two halves: half the store's shared memory, so 128x256 tiles fit 4 stages.
    cfgs = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "SUBTILE": True,
                           "WARP_SPECIALIZE": False}, num_stages=3, num_warps=4)]
    # WS asks for tl.range(warp_specialize=True), but Triton 3.6 ignores it in this kernel: compiled for sm_90,
    # the PTX with and without it is identical (the persistent loop is flatten=True, and the pass wants 4 warps
    # and an unflattened loop; the split store also trips it). So the WS rows of the sweeps measured the same
    # kernel twice: their differences (e.g. 686-693 vs 680 TF/s at 8192x4096x14336) are run-to-run noise.
    # Swept on the H100 (benchmarks/experiments/h100/gemm/gemm_configs-tma.json, bf16, no epilogue): 128x256x64
    # tiles are the best at every shape (716 TF/s at 4096^3, cuBLAS 769 in that run); the ladder's
    # warp_specialized rung has a kernel where the pass does take effect.
    for bm, bn, bk, stages, warps, sub, ws in ((128, 256, 64, 3, 8, False, False), (128, 256, 64, 4, 8, True, False),
                                               (128, 256, 64, 4, 8, True, True), (128, 128, 64, 4, 8, False, False),
                                               (128, 128, 64, 4, 4, False, False), (128, 128, 64, 4, 4, False, True),
                                               (256, 128, 64, 3, 8, True, False), (64, 128, 64, 4, 4, False, False),
                                               (64, 256, 64, 4, 8, True, False), (128, 64, 64, 4, 4, False, False)):
        cfgs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "SUBTILE": sub,
                                   "WARP_SPECIALIZE": ws}, num_stages=stages, num_warps=warps))
    return cfgs


@triton.jit
def _tma_dot(a, b, acc, B_KMAJOR: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    if B_KMAJOR:  # a (BLOCK_N, BLOCK_K) box of the weight: the MMA reads it transposed from shared memory
        b = tl.trans(b)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


# The epilogue is in the key: a residual's loads and a swiglu's second accumulator and boxes change the
# shared memory a config needs (a config tuned without the residual ran out of it with one: 245 KB > 227 KB).
@autotune(_tma_configs(), key=["M_BUCKET", "N", "K", "B_KMAJOR", "ACTIVATION", "HAS_BIAS", "HAS_RESIDUAL"])
@triton.jit
def linear_tma_kernel(A, B, C, BIAS, RES,
                      stride_am,  # x (M, K), K-contiguous
                      stride_b,  # the weight's non-unit stride: (N_total, K) K-contiguous, or (K, N_total)
                      stride_cm,  # out (M, N), N-contiguous
                      stride_rm, stride_rn, stride_bias,
                      M, N, K, M_BUCKET, scale, NUM_SMS: tl.constexpr, B_KMAJOR: tl.constexpr,
                      ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                      HAS_SCALE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      SUBTILE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """The Hopper path of linear_fwd_kernel (same epilogue): persistent (one program per SM walks the output
    tiles in grouped order, so the next tile's loads overlap the last tile's epilogue), operands copied by
    the TMA engine through tensor descriptors (whole swizzled boxes into shared memory, out-of-range rows
    and columns zero-filled, out-of-range stores dropped: no masks or address arithmetic in the K loop).
    nn.Linear's (N, K) weight is read as K-major (BLOCK_N, BLOCK_K) boxes that the MMA takes transposed:
    the layout the pointer kernel could not feed at full speed."""
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_KMAJOR:
        b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[stride_b, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(B, shape=[K, N], strides=[stride_b, 1], block_shape=[BLOCK_K, BLOCK_N])
    if ACTIVATION == "swiglu":  # the up half: rows [N, 2N) of a K-major weight, columns [N, 2N) otherwise
        if B_KMAJOR:
            u_desc = tl.make_tensor_descriptor(B + N * stride_b, shape=[N, K], strides=[stride_b, 1],
                                               block_shape=[BLOCK_N, BLOCK_K])
        else:
            u_desc = tl.make_tensor_descriptor(B + N, shape=[K, N], strides=[stride_b, 1],
                                               block_shape=[BLOCK_K, BLOCK_N])
    STORE_N: tl.constexpr = BLOCK_N // 2 if SUBTILE else BLOCK_N
    c_desc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, STORE_N])
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_SMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(tile, grid_m, grid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            a = a_desc.load([off_m, ks * BLOCK_K])
            if B_KMAJOR:
                b = b_desc.load([off_n, ks * BLOCK_K])
            else:
                b = b_desc.load([ks * BLOCK_K, off_n])
            acc = _tma_dot(a, b, acc, B_KMAJOR, INTERPRETER_DOT, INPUT_PRECISION)
            if ACTIVATION == "swiglu":
                if B_KMAJOR:
                    u = u_desc.load([off_n, ks * BLOCK_K])
                else:
                    u = u_desc.load([ks * BLOCK_K, off_n])
                acc_up = _tma_dot(a, u, acc_up, B_KMAJOR, INTERPRETER_DOT, INPUT_PRECISION)

        # The epilogue (bias, activation, scale, residual in fp32), then one TMA store.
        rm64 = (off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn64 = (off_n + tl.arange(0, BLOCK_N)).to(tl.int64)
        acc = _epilogue(acc, acc_up, BIAS, RES, rm64, rn64, rm64 < M, rn64 < N, N, stride_bias, stride_rm, stride_rn,
                        scale, HAS_BIAS, ACTIVATION, HAS_SCALE, HAS_RESIDUAL)
        if SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c_desc.store([off_m, off_n], left.to(C.dtype.element_ty))
            c_desc.store([off_m, off_n + BLOCK_N // 2], right.to(C.dtype.element_ty))
        else:
            c_desc.store([off_m, off_n], acc.to(C.dtype.element_ty))
