"""Mixture-of-experts layer (Mixtral / Qwen3-MoE / DeepSeek-V3 routing, SwiGLU experts), forward and backward.

out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = idx[t, j], with (w, idx) the top-k of
softmax or sigmoid router probabilities (optionally renormalized to sum to one).

The experts run as grouped GEMMs over the (token, slot) pairs sorted by expert, every expert's rows one
contiguous group, with no Python loop over experts and no host sync (the host never reads a count):
- router: logits GEMM, softmax/sigmoid and top-k in torch ops, in fp32, under torch autograd (so the
  gradient of the routing weights reaches x and the router through torch);
- permute: a stable sort of the flattened expert ids and a searchsorted for each expert's first row;
- gate-up GEMM: A rows gathered from x through the permutation inside the kernel's loads, SwiGLU in the
  epilogue (gate column j and up column I + j in one tile), h written in x's dtype;
- down GEMM: the routing weight multiplied in the epilogue, each row stored at its (token, slot) position;
  the combine is then a sum over the k slots of each token (deterministic, no atomics anywhere).
The backward reuses the grouped GEMM for the two dgrads (the weights read through transposed strides) and
has a second kernel for the per-expert wgrads (each program loops over its expert's rows); the SwiGLU
backward and the routing weight's gradient ride the down-dgrad's epilogue.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..roofline.model import Cost, dtype_key
from ..testing.poison import empty
from ..tune import autotune, cdiv, ensure_tma_allocator, interpreting, launch, next_pow2
from . import _validate
from .mxfp8 import e8m0_to_fp32
from ._fp8 import (HW_FP8_CAST, drop_quantized_weights, keep_quantized_weights,  # noqa: F401 (re-exported)
                   mx_dequant, quantize_rows, quantize_rows_reference, quantized_weight)
from ._gemm import INTERPRETER_DOT, gate_up_step, grouped_tile, input_precision
from ._dispatch import differentiable_backward, dispatch, reference_vjp, wants_grad
from .mxfp8 import mx_encode, mxfp8_dequantize, mxfp8_quantize
from .registry import OpSpec, register

SCORINGS = ("softmax", "sigmoid")
PRECISIONS = ("bf16", "fp8", "mxfp8")
def _gemm_configs() -> list:
    # The first config is the interpreter's: 16-row tiles split the test shapes' experts (5-20 rows each) into
    # several tiles with ragged tails. The rest are Hopper GEMM tiles as in linear.py, plus 16/32-row tiles for
    # few tokens per expert (decode, or 256 experts), where a 128-row tile would be mostly padding.
    cfgs = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8}, num_stages=2, num_warps=4)]
    for bm, bn, bk, stages, warps in ((128, 128, 64, 3, 8), (128, 128, 64, 4, 4), (128, 256, 64, 3, 8),
                                      (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4),
                                      (64, 256, 64, 3, 8), (32, 128, 64, 4, 4), (16, 128, 128, 4, 4),
                                      (128, 128, 128, 3, 8), (64, 128, 128, 4, 4)):
        cfgs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                                  num_stages=stages, num_warps=warps))
    return cfgs


def _prune_gemm(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    # The SwiGLU epilogues keep two fp32 accumulators (gate and up): 128x256 of each spills registers.
    if args.get("EPILOGUE") == "swiglu":
        return [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128]
    return configs


def _wgrad_configs() -> list:
    cfgs = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 8}, num_stages=2, num_warps=4)]
    for bm, bn, bk, stages, warps in ((128, 128, 64, 3, 8), (128, 128, 32, 4, 8), (64, 128, 64, 4, 4),
                                      (128, 64, 64, 4, 4), (64, 64, 64, 4, 4), (128, 256, 64, 3, 8)):
        cfgs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                                  num_stages=stages, num_warps=warps))
    return cfgs


@triton.jit
def _expert_of_tile(OFFS, tile, E, E_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, expert's end row) of row tile `tile`; expert >= E past the last real tile.

    The tile map is computed here, per program, from the E + 1 row offsets rather than on the host: its tile
    counts depend on BLOCK_M, which is autotuned, and E <= 256 offsets are one vector load, a prefix sum and a
    compare (a branch-free search: the expert is the number of experts whose tiles end at or before `tile`;
    an empty expert owns no tile and is skipped)."""
    es = tl.arange(0, E_P2)
    real = es < E
    start = tl.load(OFFS + es, mask=real, other=0)
    end = tl.load(OFFS + es + 1, mask=real, other=0)
    n_tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(n_tiles, 0)
    e = tl.sum((tiles_end <= tile).to(tl.int32), 0)
    mine = es == e
    first_tile = tl.sum(tl.where(mine, tiles_end - n_tiles, 0), 0)
    row0 = tl.sum(tl.where(mine, start, 0), 0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(mine, end, 0), 0)
    return e, row0, row_end


@triton.jit
def _mx_dot(a, sa, bt, sb, acc, BN: tl.constexpr, BK: tl.constexpr, MX_MODE: tl.constexpr, UPCAST: tl.constexpr):
    """acc + A @ W^T for an MXFP8 K step: a (BM, BK) (dequantized already for MX_MODE "dequant") with its E8M0
    codes sa (BM, BK / 32), bt (BN, BK) e4m3 with its codes sb (BN, BK / 32)."""
    if MX_MODE == "dot_scaled":
        # (its fp8 operands go in as their bytes: Triton 3.6 asserts on an fp8e4nv tensor here)
        acc = tl.dot_scaled(a.to(tl.uint8, bitcast=True), sa, "e4m3", tl.trans(bt).to(tl.uint8, bitcast=True), sb,
                            "e4m3", acc)
    elif MX_MODE == "promote":  # BK == 32: one block, its product scaled per row and column
        if UPCAST:
            bt = bt.to(tl.float32)
        factor = e8m0_to_fp32(tl.reshape(sa, (sa.shape[0], 1))) * e8m0_to_fp32(tl.reshape(sb, (1, BN)))
        acc += tl.dot(a, tl.trans(bt)) * factor
    else:
        acc = tl.dot(a, tl.trans(mx_dequant(bt, sb, BN, BK, UPCAST)), acc)
    return acc


@autotune(_gemm_configs(), key=["ROWS_BUCKET", "N", "K", "E", "EPILOGUE", "GATHER_A", "SCATTER_C", "B_TMA", "SCALES",
                                "Q_OUT", "MX_MODE"],
          prune_configs_by={"early_config_prune": _prune_gemm}, reset_to_zero=["AUX"])
@triton.jit
def moe_grouped_gemm_kernel(A, A_IDX, stride_am, stride_ak,  # A (rows, K); row r read at A_IDX[r] with GATHER_A
                            B, stride_be, stride_bk, stride_bn,  # expert e's weight read as (K, N) [(K, 2N): swiglu]
                            C, C_IDX, stride_cm, stride_cn,  # C (rows, N) [(rows, 2N): swiglu_bwd]; row r at C_IDX[r]
                            Z, stride_zm, stride_zn,  # gate | up pre-activations (rows, 2N)
                            SCALE,  # routing weight per row (HAS_SCALE)
                            AUX, stride_aux,  # swiglu_bwd: (rows, N tiles) partial sums of dh * h; Q_OUT: C's scales
                            A_SCALE, stride_as, B_SCALE, stride_bse, stride_bsn,  # SCALES: A's and B's (see below)
                            OFFS, ROWS, N, K, E, ROWS_BUCKET,  # expert e owns rows [OFFS[e], OFFS[e + 1])
                            EPILOGUE: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr,
                            HAS_SCALE: tl.constexpr, STORE_Z: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                            B_TMA: tl.constexpr, SCALES: tl.constexpr, Q_OUT: tl.constexpr, MX_MODE: tl.constexpr,
                            E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr):
    """C[r] = epilogue(A[r] @ W[e(r)]) for the rows r of every expert. EPILOGUE "none" (times the row's routing
    weight with HAS_SCALE); "swiglu": silu(gate) * up of the (K, 2N) weight's two halves, storing the
    pre-activations in Z with STORE_Z; "swiglu_bwd": A @ W is dh/w, Z holds (gate, up): stores d(gate, up) of
    h = silu(gate) * up at dh = w * (A @ W) and this tile's share of the routing weight's gradient <A @ W, h>.

    SCALES: "" (A and W in x's dtype); "rowwise" (float8_e4m3fn A and W, A_SCALE one fp32 per A row, B_SCALE
    (E, N') one per output channel: dequantized in the epilogue); "mx" (MXFP8: E8M0 codes per 32 elements along
    K, A_SCALE (A rows, K / 32), B_SCALE (E, N', K / 32): dequantized in the main loop, see below).
    Q_OUT (swiglu): h is stored as MXFP8, e4m3 bits in C (a uint8 view) and its E8M0 codes in AUX (rows, N / 32):
    the quantization the down GEMM's A needs, done on the fp32 tile before it leaves registers."""
    # An fp8 tl.dot takes K >= 32 a step, and MX blocks are 32 wide: the interpreter's 16-wide config steps by 32
    # there (as it does when CI compiles the interpreter's launches for sm_90); Q_OUT quantizes 32-column blocks.
    BK: tl.constexpr = 32 if (SCALES != "" and BLOCK_K < 32) or MX_MODE == "promote" else BLOCK_K
    BN: tl.constexpr = 32 if Q_OUT and BLOCK_N < 32 else BLOCK_N
    pid = tl.program_id(0)
    # The grid covers an upper bound of row tiles known on the host without reading the counts: every expert
    # adds at most one partial tile to cdiv(ROWS, BLOCK_M). Programs past the real tiles exit at once.
    grid_m = tl.cdiv(ROWS, BLOCK_M) + E
    grid_n = tl.cdiv(N, BN)
    # Grouped order: the weight tiles of an expert with several row tiles are read from L2, not once per row tile.
    pid_m, pid_n = grouped_tile(pid, grid_m, grid_n, GROUP_M)
    e, row0, row_end = _expert_of_tile(OFFS, pid_m, E, E_P2, BLOCK_M)
    if e >= E:
        return

    rows = row0 + tl.arange(0, BLOCK_M)
    m_ok = rows < row_end
    rows64 = rows.to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    if GATHER_A:  # the permutation fused into the loads: row r of the group is token A_IDX[r]
        a_rows = tl.load(A_IDX + rows, mask=m_ok, other=0).to(tl.int64)
    else:
        a_rows = rows64
    a_ptrs = A + a_rows[:, None] * stride_am
    w = B + e.to(tl.int64) * stride_be
    b_ptrs = w + rn64[None, :] * stride_bn
    b_up = w + (rn64 + N)[None, :] * stride_bn  # the up half; the compiler drops it unless EPILOGUE is swiglu
    rk = tl.arange(0, BK)
    acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    if B_TMA:
        # The experts' weights in nn.Linear's (out, in) layout are K-contiguous: a pointer-loaded (K, N) tile of
        # them is the layout the dense GEMM lost 25% on (see ops/linear.py). Here they come through one 3-D
        # descriptor over (E, N rows [2N: gate | up], K) as (BN, BLOCK_K) boxes the MMA takes transposed;
        # boxes past an expert's rows or K read zeros. The gathered A rows stay pointer loads.
        NT = 2 * N if EPILOGUE == "swiglu" else N
        b_desc = tl.make_tensor_descriptor(B, shape=[E, NT, K], strides=[stride_be, stride_bn, 1],
                                           block_shape=[1, BN, BK])
    if SCALES == "mx":
        # MXFP8: Hopper has no block-scaled MMA. MX_MODE "dequant": each K step's fp8 tiles are dequantized in
        # registers (times 2^(code - 127) per 32 elements, exact in bf16) and multiplied as bf16; "dot_scaled": the
        # same through tl.dot_scaled (Triton's emulation); "promote": one 32-wide MX block a step, multiplied on the
        # fp8 tensor cores into a fresh fp32 tile that is scaled by its row's and column's factors and added to the
        # accumulator. W's rows come as (BN, BK) tiles, K-contiguous.
        kb_ar = tl.arange(0, BK // 32)
        sa_ptrs = A_SCALE + a_rows[:, None] * stride_as
        sb_ptrs = B_SCALE + e.to(tl.int64) * stride_bse + rn64[:, None] * stride_bsn
        bt_ptrs = w + rn64[:, None] * stride_bn
    for k0 in range(0, K, BK):
        kk = k0 + rk
        k_ok = kk < K
        kk64 = kk.to(tl.int64)
        a = tl.load(a_ptrs + kk64[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if SCALES == "mx":
            kb = k0 // 32 + kb_ar
            kb_ok = kb < K // 32
            sa = tl.load(sa_ptrs + kb[None, :], mask=m_ok[:, None] & kb_ok[None, :], other=127)
            sb = tl.load(sb_ptrs + kb[None, :], mask=n_ok[:, None] & kb_ok[None, :], other=127)
            if B_TMA:
                bt = b_desc.load([e, pid_n * BN, k0]).reshape(BN, BK)
            else:
                bt = tl.load(bt_ptrs + kk64[None, :] * stride_bk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if EPILOGUE == "swiglu":
                su = tl.load(sb_ptrs + N * stride_bsn + kb[None, :], mask=n_ok[:, None] & kb_ok[None, :], other=127)
                if B_TMA:
                    ut = b_desc.load([e, N + pid_n * BN, k0]).reshape(BN, BK)
                else:
                    ut = tl.load(bt_ptrs + N * stride_bn + kk64[None, :] * stride_bk,
                                 mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if MX_MODE == "dequant":
                a = mx_dequant(a, sa, BLOCK_M, BK, INTERPRETER_DOT)
            elif MX_MODE == "promote" and INTERPRETER_DOT:
                a = a.to(tl.float32)
            acc = _mx_dot(a, sa, bt, sb, acc, BN, BK, MX_MODE, INTERPRETER_DOT)
            if EPILOGUE == "swiglu":
                acc_up = _mx_dot(a, sa, ut, su, acc_up, BN, BK, MX_MODE, INTERPRETER_DOT)
        elif B_TMA:
            b = tl.trans(b_desc.load([e, pid_n * BN, k0]).reshape(BN, BK))
            if INTERPRETER_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            if EPILOGUE == "swiglu":  # gate columns past N read up rows here: never stored (n_ok)
                u = tl.trans(b_desc.load([e, N + pid_n * BN, k0]).reshape(BN, BK))
                if INTERPRETER_DOT:
                    u = u.to(tl.float32)
                acc_up = tl.dot(a, u, acc_up, input_precision=INPUT_PRECISION)
        else:
            b = tl.load(b_ptrs + kk64[:, None] * stride_bk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc, acc_up = gate_up_step(a, b, acc, acc_up, b_up + kk64[:, None] * stride_bk,
                                       k_ok[:, None] & n_ok[None, :], EPILOGUE == "swiglu", INTERPRETER_DOT,
                                       INPUT_PRECISION)

    if SCALES == "rowwise":  # rowwise dequantization: the token's scale times the expert's output-channel scale, in fp32
        sa = tl.load(A_SCALE + a_rows, mask=m_ok, other=0.0)[:, None]
        b_scales = B_SCALE + e.to(tl.int64) * stride_bse + rn64
        acc = acc * sa * tl.load(b_scales, mask=n_ok, other=0.0)[None, :]
        if EPILOGUE == "swiglu":
            acc_up = acc_up * sa * tl.load(b_scales + N, mask=n_ok, other=0.0)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    c_cols = rn64[None, :] * stride_cn
    z_ptrs = Z + rows64[:, None] * stride_zm + rn64[None, :] * stride_zn
    if EPILOGUE == "swiglu":
        if STORE_Z:
            tl.store(z_ptrs, acc.to(Z.dtype.element_ty), mask=mask)
            tl.store(z_ptrs + N * stride_zn, acc_up.to(Z.dtype.element_ty), mask=mask)
        acc = acc * tl.sigmoid(acc) * acc_up
    elif EPILOGUE == "swiglu_bwd":
        gate = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(z_ptrs + N * stride_zn, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        # d(routing weight) = <dout, down(h)> = <dout @ W_down, h>: this N tile's part, summed on the host.
        tl.store(AUX + rows64 * stride_aux + pid_n, tl.sum(acc * silu * up, axis=1), mask=m_ok)
        dh = acc * tl.load(SCALE + rows, mask=m_ok, other=0.0)[:, None]
        tl.store(C + rows64[:, None] * stride_cm + c_cols + N * stride_cn, (dh * silu).to(C.dtype.element_ty),
                 mask=mask)
        acc = dh * up * sig * (1.0 + gate * (1.0 - sig))
    if HAS_SCALE and EPILOGUE != "swiglu_bwd":
        acc = acc * tl.load(SCALE + rows, mask=m_ok, other=0.0)[:, None]
    if SCATTER_C:  # each row to its (token, slot) position: one writer per row, so no atomics
        c_rows = tl.load(C_IDX + rows, mask=m_ok, other=0).to(tl.int64)
    else:
        c_rows = rows64
    if Q_OUT:  # MXFP8 e4m3 per 32 columns (N % 32 == 0: a block never straddles the N edge)
        bits, code = mx_encode(acc.reshape(BLOCK_M, BN // 32, 32), 8, 3, 7, 448.0, HW_FP8_CAST)
        tl.store(C + c_rows[:, None] * stride_cm + c_cols, bits.reshape(BLOCK_M, BN), mask=mask)
        kb = pid_n * (BN // 32) + tl.arange(0, BN // 32)
        tl.store(AUX + c_rows[:, None] * stride_aux + kb[None, :], code.to(tl.uint8),
                 mask=m_ok[:, None] & (kb < N // 32)[None, :])
    else:
        tl.store(C + c_rows[:, None] * stride_cm + c_cols, acc.to(C.dtype.element_ty), mask=mask)


@autotune(_wgrad_configs(), key=["ROWS_BUCKET", "M", "N", "E"])
@triton.jit
def moe_wgrad_kernel(A, A_IDX, SCALE, stride_ar, stride_am,  # A (rows, M): row r at A_IDX[r], times SCALE[r]
                     B, B_IDX, stride_br, stride_bn,  # B (rows, N): row r at B_IDX[r] with GATHER_B
                     C, stride_ce, stride_cm, stride_cn,  # dW (E, M, N)
                     OFFS, M, N, E, ROWS_BUCKET,
                     GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, HAS_SCALE: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """dW[e] = A[rows of e]^T @ B[rows of e]: one (M, N) tile of one expert per program, reducing over that
    expert's rows (none for an empty expert, whose gradient is then written as zeros)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    e = pid // (grid_m * grid_n)
    t = pid % (grid_m * grid_n)
    pid_m, pid_n = grouped_tile(t, grid_m, grid_n, GROUP_M)
    start = tl.load(OFFS + e)
    end = tl.load(OFFS + e + 1)

    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rr = r0 + tl.arange(0, BLOCK_K)
        r_ok = rr < end
        if GATHER_A:
            a_rows = tl.load(A_IDX + rr, mask=r_ok, other=0).to(tl.int64)
        else:
            a_rows = rr.to(tl.int64)
        if GATHER_B:
            b_rows = tl.load(B_IDX + rr, mask=r_ok, other=0).to(tl.int64)
        else:
            b_rows = rr.to(tl.int64)
        # A^T's tile loaded as (M, rows) directly: the transpose is in the pointers, not a copy.
        a = tl.load(A + a_rows[None, :] * stride_ar + rm[:, None] * stride_am, mask=m_ok[:, None] & r_ok[None, :],
                    other=0.0)
        if HAS_SCALE:
            s = tl.load(SCALE + rr, mask=r_ok, other=0.0)
            a = (a.to(tl.float32) * s[None, :]).to(A.dtype.element_ty)
        b = tl.load(B + b_rows[:, None] * stride_br + rn[None, :] * stride_bn, mask=r_ok[:, None] & n_ok[None, :],
                    other=0.0)
        if INTERPRETER_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    tl.store(C + e.to(tl.int64) * stride_ce + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
             acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --- launchers ---

# Columns of the routing-weight gradient's partial sums: one per N tile of the smallest BLOCK_N a config has.
_ROWDOT_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in moe_grouped_gemm_kernel.configs)


def _grouped_gemm(a, weight, c, offs, n, *, a_idx=None, c_idx=None, scale=None, z=None, rowdot=None,
                  epilogue="none", precision=None, a_scale=None, b_scale=None, mx=False, c_scales=None):
    """c = epilogue(a[rows] @ weight[e]) for the expert groups `offs`; weight is an (E, K, N') view (N' = 2n
    for swiglu) read through its strides. fp8 a and weight take a_scale and b_scale: rowwise, one fp32 per row
    of a (as a_idx indexes it) and (E, N') contiguous along N'; with `mx`, E8M0 codes per 32 elements along K,
    (rows of a, K / 32) and (E, N', K / 32) contiguous along K. c_scales (rows, n / 32) uint8 (swiglu): h is
    stored as MXFP8, its e4m3 bits in c (float8_e4m3fn or uint8) and its codes in c_scales."""
    scales = "" if a_scale is None else "mx" if mx else "rowwise"
    q_out = c_scales is not None
    rows, e, k = c.shape[0] if c_idx is None else c_idx.shape[0], weight.shape[0], weight.shape[1]
    zz = z if z is not None else c
    # Not a borrowed argument: the autotuner zeroes AUX around its timing runs (reset_to_zero).
    aux = c_scales if q_out else rowdot if rowdot is not None else torch.empty(1, dtype=torch.float32,
                                                                                device=c.device)
    if q_out:
        c = c.view(torch.uint8)
    bucket = next_pow2(rows)
    b_tma = _b_tma(weight)
    if b_tma and weight.is_cuda:
        ensure_tma_allocator()  # descriptors made inside the kernel live in a scratch buffer Triton asks for
    if mx:  # b_scale (E, N', K / 32) as the weight's (E, K, N') view is transposed: its row stride is dim 1's
        bs_e, bs_n = b_scale.stride(0), b_scale.stride(1)
    else:
        bs_e, bs_n = (b_scale.stride(0), 1) if b_scale is not None else (0, 0)
    # MXFP8 operands given to the kernel: its K-loop modes ("upcast" does not reach here with MX operands; the
    # interpreter has no dot_scaled)
    mx_mode = "" if not mx else MX_MODE if MX_MODE in ("dequant", "promote") or (
        MX_MODE == "dot_scaled" and weight.is_cuda) else "dequant"
    min_bn = 32 if q_out else 1
    grid = lambda meta: ((cdiv(rows, meta["BLOCK_M"]) + e) * cdiv(n, max(meta["BLOCK_N"], min_bn)),)  # noqa: E731
    launch(moe_grouped_gemm_kernel, grid,
           ("gemm", bucket, n, k, e, a.dtype, c.dtype, epilogue, a_idx is not None, c_idx is not None,
            scale is not None, z is not None and epilogue == "swiglu", precision, b_tma, scales, q_out, mx_mode),
           a, a_idx if a_idx is not None else offs, a.stride(0), a.stride(1),
           weight, weight.stride(0), weight.stride(1), weight.stride(2),
           c, c_idx if c_idx is not None else offs, c.stride(0), c.stride(1),
           zz, zz.stride(0), zz.stride(-1),
           scale if scale is not None else c,
           aux, aux.stride(0),
           a_scale if scales else aux, a_scale.stride(0) if scales else 0, b_scale if scales else aux, bs_e, bs_n,
           offs, rows, n, k, e, bucket,
           EPILOGUE=epilogue, GATHER_A=a_idx is not None, SCATTER_C=c_idx is not None, HAS_SCALE=scale is not None,
           STORE_Z=z is not None and epilogue == "swiglu", INPUT_PRECISION=None if scales else precision, B_TMA=b_tma,
           SCALES=scales, Q_OUT=q_out, MX_MODE=mx_mode, E_P2=max(16, next_pow2(e)))


# How the MXFP8 path multiplies: "upcast" (operands dequantized to bf16 by their own passes, then bf16 GEMMs; see
# moe_experts_fwd) or inside the grouped GEMM's K loop, "dequant", "dot_scaled" or "promote" (see the kernel);
# KERNELKIT_MX_MODE overrides the default.
MX_MODES = ("upcast", "dequant", "dot_scaled", "promote")
MX_MODE = os.environ.get("KERNELKIT_MX_MODE", "upcast")
if MX_MODE not in MX_MODES:
    raise ValueError(f"KERNELKIT_MX_MODE must be one of {', '.join(MX_MODES)}, got {MX_MODE!r}")


# The TMA path for the experts' weights: 16-bit, K-contiguous (nn.Linear's (out, in) per expert), 16-byte aligned
# base and outer strides, on a Hopper-or-newer GPU or in the interpreter. KERNELKIT_GEMM_TMA=0 turns it off.
B_TMA = os.environ.get("KERNELKIT_GEMM_TMA", "1") != "0"


def _b_tma(weight: torch.Tensor) -> bool:
    """Whether the (E, K, N') weight view can be read through a (E, N', K) tensor descriptor."""
    if not B_TMA or weight.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn) or weight.stride(1) != 1:
        return False
    if weight.is_cuda:
        if torch.cuda.get_device_capability(weight.device)[0] < 9:
            return False
    elif not interpreting():
        return False
    esize = weight.element_size()
    e, k, n = weight.shape
    s_e, s_n = weight.stride(0), weight.stride(2)
    return (weight.data_ptr() % 16 == 0 and s_n >= k and (s_e >= n * s_n or e == 1)
            and (s_e * esize) % 16 == 0 and (s_n * esize) % 16 == 0)


def _wgrad(a, b, c, offs, *, a_idx=None, b_idx=None, scale=None, precision=None):
    """c[e] = a[rows of e]^T @ b[rows of e] for every expert; c (E, M, N) any strides."""
    e, m, n = c.shape
    rows = a.shape[0] if a_idx is None else a_idx.shape[0]
    bucket = next_pow2(rows)
    grid = lambda meta: (e * cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    launch(moe_wgrad_kernel, grid,
           ("wgrad", bucket, m, n, e, a.dtype, c.dtype, a_idx is not None, b_idx is not None, scale is not None,
            precision),
           a, a_idx if a_idx is not None else offs, scale if scale is not None else c, a.stride(0), a.stride(1),
           b, b_idx if b_idx is not None else offs, b.stride(0), b.stride(1),
           c, c.stride(0), c.stride(1), c.stride(2),
           offs, m, n, e, bucket,
           GATHER_A=a_idx is not None, GATHER_B=b_idx is not None, HAS_SCALE=scale is not None,
           INPUT_PRECISION=precision)


def _permute(experts: torch.Tensor, n_experts: int):
    """(order, offs): the flattened (token, slot) pairs sorted by expert (stable, so each expert's rows stay in
    token order), and each expert's first row (offs[e]; offs[E] = T * k). On the device: no count is read."""
    flat = experts.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    bounds = torch.arange(n_experts + 1, device=flat.device, dtype=sorted_experts.dtype)
    offs = torch.searchsorted(sorted_experts, bounds, out_int32=True)
    return order, offs


def _sum_slots(y: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """(T * k, H) rows in (token, slot) order -> (T, H): the combine, a plain reduction over the k slots."""
    return y if k == 1 else y.view(tokens, k, y.shape[1]).sum(1, dtype=torch.float32).to(y.dtype)


def moe_experts_fwd(x, weights, gate_up_weight, down_weight, experts, allow_tf32: bool = False, save: bool = False,
                    precision: str = "bf16"):
    """The expert part: x (T, H), weights (T, k) fp32 routing weights, experts (T, k) int64 expert ids.
    Returns (out (T, H), h (T*k, I) or empty, z (T*k, 2I) pre-activations or empty unless `save`, order, offs).
    "fp8": both GEMMs on float8_e4m3fn operands with rowwise scales (tokens and h rows; each expert's output
    channels), dequantized in the epilogues; h and z stay in x's dtype. "mxfp8": both GEMMs on MXFP8 operands
    (32-element blocks along K), dequantized in the main loop; the gate-up GEMM writes h already quantized (and
    z with `save`); h is then not returned (empty): the backward recomputes it from z."""
    t, hidden = x.shape
    k = experts.shape[1]
    n_exp, inter = gate_up_weight.shape[0], gate_up_weight.shape[1] // 2
    rows = t * k
    h = empty((rows, inter), dtype=x.dtype, device=x.device) if precision != "mxfp8" else x.new_empty(0)
    z = empty((rows, 2 * inter), dtype=x.dtype, device=x.device) if save else x.new_empty(0)
    y = empty((rows, hidden), dtype=x.dtype, device=x.device)
    order, offs = _permute(experts, n_exp)
    if rows == 0:
        return y.view(t, hidden), h, z, order, offs
    # An id outside [0, E) (expert parallelism's "not on this rank" sentinel, or a bug) belongs to no group: its
    # rows would stay unwritten. Checked on the device, no host sync: the error comes at the next synchronization.
    torch._assert_async(((experts >= 0) & (experts < n_exp)).all(),
                        "kernelkit.moe: an expert id is outside [0, experts) (expert-parallel sentinels are not supported)")
    dot_precision = input_precision(x.dtype, allow_tf32)
    tokens = order // k
    w_rows = weights.reshape(-1)[order].float()
    if precision == "mxfp8":
        xq, xs = mxfp8_quantize(x)
        hq = empty((rows, inter), dtype=torch.float8_e4m3fn, device=x.device)
        hs = empty((rows, inter // 32), dtype=torch.uint8, device=x.device)
        if MX_MODE == "upcast":
            # The MXFP8 operands dequantized to bf16 (exact) by memory-bound passes, the GEMMs on bf16 tensor cores:
            # the same products and fp32 sums as the in-loop modes, without redoing each tile's dequantization for
            # every tile of the other operand. h still leaves the epilogue as MXFP8.
            gud, _ = quantized_weight(gate_up_weight, "mxfp8_bf16")
            dd, _ = quantized_weight(down_weight, "mxfp8_bf16")
            _grouped_gemm(mxfp8_dequantize(xq, xs, torch.bfloat16), gud.transpose(1, 2), hq, offs, inter,
                          a_idx=tokens, z=z if save else None, epilogue="swiglu", c_scales=hs)
            _grouped_gemm(mxfp8_dequantize(hq, hs, torch.bfloat16), dd.transpose(1, 2), y, offs, hidden,
                          c_idx=order, scale=w_rows)
            return _sum_slots(y, t, k), x.new_empty(0), z, order, offs
        guq, gus = quantized_weight(gate_up_weight, "mxfp8")
        dq, ds = quantized_weight(down_weight, "mxfp8")
        _grouped_gemm(xq, guq.transpose(1, 2), hq, offs, inter, a_idx=tokens, z=z if save else None,
                      epilogue="swiglu", a_scale=xs, b_scale=gus, mx=True, c_scales=hs)
        _grouped_gemm(hq, dq.transpose(1, 2), y, offs, hidden, c_idx=order, scale=w_rows, a_scale=hs, b_scale=ds,
                      mx=True)
        return _sum_slots(y, t, k), x.new_empty(0), z, order, offs
    if precision == "fp8":
        # Quantized per call (quantize_rows: one kernel reading each row twice) for x and h, and for the weights
        # unless `keep_quantized_weights` holds them. The GEMMs run on the tensor cores' fp8 path with Triton's
        # default (fast) accumulation.
        xq, xs = quantize_rows(x)
        guq, gus = quantized_weight(gate_up_weight, "fp8")
        dq, ds = quantized_weight(down_weight, "fp8")
        _grouped_gemm(xq, guq.transpose(1, 2), h, offs, inter, a_idx=tokens, z=z if save else None,
                      epilogue="swiglu", a_scale=xs, b_scale=gus)
        hq, hs = quantize_rows(h)
        _grouped_gemm(hq, dq.transpose(1, 2), y, offs, hidden, c_idx=order, scale=w_rows, a_scale=hs, b_scale=ds)
        return _sum_slots(y, t, k), h, z, order, offs
    _grouped_gemm(x, gate_up_weight.transpose(1, 2), h, offs, inter, a_idx=tokens, z=z if save else None,
                  epilogue="swiglu", precision=dot_precision)
    _grouped_gemm(h, down_weight.transpose(1, 2), y, offs, hidden, c_idx=order, scale=w_rows,
                  precision=dot_precision)
    return _sum_slots(y, t, k), h, z, order, offs


def moe_experts_bwd(dout, x, weights, gate_up_weight, down_weight, h, z, order, offs, allow_tf32: bool = False,
                    needs=(True, True, True, True)):
    """Gradients (dx, dweights, dgate_up, ddown) of the expert part (None where `needs` says so)."""
    t, hidden = x.shape
    k = weights.shape[1]
    rows, inter = order.shape[0], gate_up_weight.shape[1] // 2
    if z.numel() != rows * 2 * inter:
        raise RuntimeError("kernelkit.moe: the forward ran without saving for a backward (no input required grad)")
    precision = input_precision(x.dtype, allow_tf32)
    tokens = order // k
    w_rows = weights.reshape(-1)[order].float()
    if h.numel() == 0 and rows:  # the MXFP8 forward kept h only quantized: recomputed from z in x's dtype
        h = (F.silu(z[:, :inter].float()) * z[:, inter:].float()).to(x.dtype)
    dx = dw = dgu = dd = None
    if rows and (needs[0] or needs[1] or needs[2]):
        dz = empty((rows, 2 * inter), dtype=x.dtype, device=x.device)
        rowdot = torch.zeros((rows, cdiv(inter, _ROWDOT_BLOCK_N)), dtype=torch.float32, device=x.device)
        _grouped_gemm(dout, down_weight, dz, offs, inter, a_idx=tokens, scale=w_rows, z=z, rowdot=rowdot,
                      epilogue="swiglu_bwd", precision=precision)
        if needs[1]:
            dw = torch.empty(rows, dtype=torch.float32, device=x.device).index_copy_(0, order, rowdot.sum(1))
            dw = dw.view(t, k).to(weights.dtype)
        if needs[0]:
            dxr = empty((rows, hidden), dtype=x.dtype, device=x.device)
            _grouped_gemm(dz, gate_up_weight, dxr, offs, hidden, c_idx=order, precision=precision)
            dx = _sum_slots(dxr, t, k)
        if needs[2]:
            dgu = empty(gate_up_weight.shape, dtype=gate_up_weight.dtype, device=x.device)
            _wgrad(dz, x, dgu, offs, b_idx=tokens, precision=precision)
    if needs[3]:
        dd = empty(down_weight.shape, dtype=down_weight.dtype, device=x.device)
        if rows:
            _wgrad(dout, h, dd, offs, a_idx=tokens, scale=w_rows, precision=precision)
        else:
            dd.zero_()
    if rows == 0:  # no pair routed: every gradient is zero
        dx = x.new_zeros(x.shape) if needs[0] else None
        dw = weights.new_zeros(weights.shape) if needs[1] else None
        dgu = gate_up_weight.new_zeros(gate_up_weight.shape) if needs[2] else None
    return dx, dw, dgu, dd


# --- torch.library custom ops (torch.compile) and the eager autograd path ---

@torch.library.custom_op("kernelkit::moe_experts", mutates_args=())
def _moe_experts_op(x: torch.Tensor, weights: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
                    experts: torch.Tensor, allow_tf32: bool, save: bool, precision: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return moe_experts_fwd(x, weights, gate_up_weight, down_weight, experts, allow_tf32, save, precision)


@_moe_experts_op.register_fake
def _(x, weights, gate_up_weight, down_weight, experts, allow_tf32, save, precision):
    rows, i2 = experts.numel(), gate_up_weight.shape[1]
    return (x.new_empty(x.shape), x.new_empty((rows, i2 // 2) if precision != "mxfp8" else (0,)), x.new_empty((rows, i2) if save else (0,)),
            experts.new_empty((rows,), dtype=torch.int64),
            experts.new_empty((gate_up_weight.shape[0] + 1,), dtype=torch.int32))


@torch.library.custom_op("kernelkit::moe_experts_bwd", mutates_args=())
def _moe_experts_bwd_op(dout: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, gate_up_weight: torch.Tensor,
                        down_weight: torch.Tensor, h: torch.Tensor, z: torch.Tensor, order: torch.Tensor,
                        offs: torch.Tensor, allow_tf32: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return moe_experts_bwd(dout, x, weights, gate_up_weight, down_weight, h, z, order, offs, allow_tf32)


@_moe_experts_bwd_op.register_fake
def _(dout, x, weights, gate_up_weight, down_weight, h, z, order, offs, allow_tf32):
    return x.new_empty(x.shape), weights.new_empty(weights.shape), gate_up_weight.new_empty(gate_up_weight.shape), \
        down_weight.new_empty(down_weight.shape)


def _setup_context(ctx, inputs, output):
    x, weights, gate_up_weight, down_weight, _experts, allow_tf32, _save, _precision = inputs
    _out, h, z, order, offs = output
    ctx.save_for_backward(x, weights, gate_up_weight, down_weight, h, z, order, offs)
    ctx.allow_tf32 = allow_tf32


def _backward(ctx, dout, *_saved_grads):
    grads = _moe_experts_bwd_op(dout, *ctx.saved_tensors, ctx.allow_tf32)
    return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None, None, None)


_moe_experts_op.register_autograd(_backward, setup_context=_setup_context)


def _double_backward(ctx, dout):
    x, weights, gate_up_weight, down_weight, *_rest, experts = ctx.saved_tensors
    return reference_vjp(experts_reference, (x, weights, gate_up_weight, down_weight, experts), (dout,), 8)


class _MoEExpertsFunction(torch.autograd.Function):
    """The eager path: the same launchers as the custom op with less per-call host overhead."""

    @staticmethod
    def forward(ctx, x, weights, gate_up_weight, down_weight, experts, allow_tf32, save, precision):
        out, h, z, order, offs = moe_experts_fwd(x, weights, gate_up_weight, down_weight, experts, allow_tf32, True,
                                                 precision)
        ctx.save_for_backward(x, weights, gate_up_weight, down_weight, h, z, order, offs, experts)
        ctx.allow_tf32 = allow_tf32
        return out

    @staticmethod
    @differentiable_backward(_double_backward, "moe")
    def backward(ctx, dout):
        *saved, _experts = ctx.saved_tensors
        grads = moe_experts_bwd(dout, *saved, ctx.allow_tf32, ctx.needs_input_grad[:4])
        return (*grads, None, None, None, None)


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, scoring: str = "softmax",
          renormalize: bool = True, *, expert_bias: Optional[torch.Tensor] = None, n_group: int = 1,
          topk_group: Optional[int] = None, routed_scaling_factor: float = 1.0):
    """(weights (T, k) fp32, experts (T, k) int64) for x (T, H): the router in torch ops (one small GEMM, an
    elementwise map and a top-k), differentiable in x and router_weight through the weights.

    DeepSeek-V3's options: `expert_bias` (E,) is added to the probabilities for the choice only (the weights are
    the unbiased probabilities of the chosen experts: auxiliary-loss-free load balancing); with `n_group` > 1 the
    experts form n_group equal groups, each scored by the sum of its two best (biased) probabilities, and only the
    `topk_group` best groups compete for the top_k; the weights are multiplied by `routed_scaling_factor` after
    the renormalization."""
    logits = F.linear(x.float(), router_weight.float())
    probs = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    return _select(probs, top_k, renormalize, expert_bias, n_group, topk_group, routed_scaling_factor)


def _select(probs, top_k, renormalize, expert_bias=None, n_group=1, topk_group=None, routed_scaling_factor=1.0):
    """route's choice and weights from the router probabilities (T, E), in their dtype."""
    choice = probs.detach() if expert_bias is None else probs.detach() + expert_bias.detach().to(probs.dtype)
    if n_group > 1:
        t, n_exp = choice.shape
        groups = choice.view(t, n_group, n_exp // n_group)
        group_scores = groups.topk(min(2, n_exp // n_group), dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = groups.masked_fill(~kept[:, :, None], -float("inf")).view(t, n_exp)
    experts = choice.topk(top_k, dim=-1).indices
    weights = probs.gather(1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, experts


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens routed to each expert (int64 (E,)), for a load-balancing loss or monitoring: a scatter-add on the
    device, no host sync (torch.bincount reads the largest id on the host)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(x: torch.Tensor, router_weight: torch.Tensor, experts: torch.Tensor,
                        scoring: str = "softmax") -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E * sum_e f_e * P_e (f_e the fraction of routed (token, slot) pairs
    that chose expert e, P_e the mean router probability of e; sigmoid scores normalized per token first),
    differentiable in x and router_weight through P; 1.0 when routing and probabilities are even. No host sync."""
    logits = F.linear(x.reshape(-1, x.shape[-1]).float(), router_weight.float())
    probs = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    if scoring != "softmax":  # sigmoid scores as shares of each token's total (DeepSeek-V3's balance loss)
        probs = probs / probs.sum(-1, keepdim=True)
    n_exp = router_weight.shape[0]
    frac = expert_counts(experts, n_exp).float() / max(experts.numel(), 1)
    return n_exp * (frac * probs.mean(0)).sum()


def _check(x, router_weight, gate_up_weight, down_weight, top_k, scoring, renormalize) -> tuple[int, int]:
    """Validate the arguments once; returns (experts, intermediate)."""
    _validate.tensor(x, "x", min_dim=1)
    for name, w in (("router_weight", router_weight), ("gate_up_weight", gate_up_weight),
                    ("down_weight", down_weight)):
        _validate.tensor(w, name)
        _validate.same_device(w, name, x, "x")
    hidden = x.shape[-1]
    if router_weight.dim() != 2 or router_weight.shape[1] != hidden or router_weight.shape[0] < 1:
        raise ValueError(f"router_weight must have shape (experts, {hidden}) to match x's last dim, "
                         f"got {tuple(router_weight.shape)}")
    n_exp = router_weight.shape[0]
    gu = gate_up_weight.shape
    if gate_up_weight.dim() != 3 or gu[0] != n_exp or gu[2] != hidden or gu[1] % 2 or gu[1] == 0:
        raise ValueError(f"gate_up_weight must have shape ({n_exp}, 2 * intermediate, {hidden}) (experts, gate rows "
                         f"then up rows, hidden: nn.Linear's (out, in) per expert), got {tuple(gu)}")
    inter = gu[1] // 2
    if down_weight.dim() != 3 or tuple(down_weight.shape) != (n_exp, hidden, inter):
        raise ValueError(f"down_weight must have shape ({n_exp}, {hidden}, {inter}) (experts, hidden, intermediate), "
                         f"got {tuple(down_weight.shape)}")
    for name, w in (("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {w.dtype} but x has {x.dtype}; cast one to the other")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= n_exp:
        raise ValueError(f"top_k must be between 1 and the number of experts ({n_exp}), got {top_k}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(map(repr, SCORINGS))}, got {scoring!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    return n_exp, inter


def _check_routing(n_exp, top_k, expert_bias, n_group, topk_group, routed_scaling_factor, x=None) -> None:
    """Validate route's DeepSeek-V3 options."""
    if expert_bias is not None:
        if not isinstance(expert_bias, torch.Tensor) or expert_bias.shape != (n_exp,) or \
                not expert_bias.is_floating_point():
            raise ValueError(f"expert_bias must be a float tensor of shape ({n_exp},) (one per expert), got "
                             f"{tuple(expert_bias.shape) if isinstance(expert_bias, torch.Tensor) else expert_bias!r}")
        if x is not None:
            _validate.same_device(expert_bias, "expert_bias", x, "x")
    if isinstance(n_group, bool) or not isinstance(n_group, int) or n_group < 1 or n_exp % n_group:
        raise ValueError(f"n_group must be a positive int dividing the number of experts ({n_exp}), got {n_group!r}")
    if n_group > 1:
        if isinstance(topk_group, bool) or not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be an int between 1 and n_group ({n_group}) when n_group > 1, got "
                             f"{topk_group!r}")
        if top_k > topk_group * (n_exp // n_group):
            raise ValueError(f"top_k ({top_k}) is more experts than topk_group ({topk_group}) groups of "
                             f"{n_exp // n_group} hold")
    elif topk_group not in (None, 1):
        raise ValueError(f"topk_group ({topk_group}) needs n_group > 1")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
        raise TypeError(f"routed_scaling_factor must be a number, got {type(routed_scaling_factor).__name__}")


def _rows(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """x as (tokens, hidden) with any strides; leading dims that no single stride can walk are copied."""
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, hidden)
    except RuntimeError:
        return _validate._copied(x).reshape(-1, hidden)


def _first(out):
    return out[0]


def moe(x: torch.Tensor, router_weight: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
        top_k: int, *, scoring: str = "softmax", renormalize: bool = True, precision: str = "bf16",
        expert_bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: Optional[int] = None,
        routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """A mixture-of-experts SwiGLU MLP: ``sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``.

    x: (..., hidden); router_weight: (experts, hidden); gate_up_weight: (experts, 2 * intermediate, hidden), gate
    rows first then up rows; down_weight: (experts, hidden, intermediate) (each expert in nn.Linear's (out, in)
    convention, as transformers' fused MoE experts store them). x and the expert weights float32, bfloat16 or
    float16 of one dtype, any strides; the router may be any float dtype. Routing: logits = x @ router_weight.T in
    fp32, probabilities by `scoring` ("softmax": Mixtral, Qwen3-MoE; "sigmoid": DeepSeek-V3), the top_k largest,
    divided by their sum if `renormalize`; DeepSeek-V3's routing with `expert_bias` (E,) (added for the choice
    only), `n_group` / `topk_group` (group-limited top-k) and `routed_scaling_factor`: see `route`. Returns
    (..., hidden) in x's dtype.

    The router runs in torch ops; the experts are grouped GEMMs over the tokens sorted by expert (gather fused into
    the loads, SwiGLU and the routing weight fused into the epilogues, fp32 accumulation), with no host sync.
    Differentiable in x, router_weight (through the routing weights; the top-k choice is not differentiable),
    gate_up_weight and down_weight; the backward saves the gate/up pre-activations instead of recomputing them.

    precision: "bf16" (the default: the GEMMs run in x's dtype, whatever it is); "fp8": the two forward GEMMs
    on float8_e4m3fn with rowwise scales (per token, per row of h, per expert output channel; see
    `quantize_rows`), dequantized in their epilogues; "mxfp8": the two forward GEMMs on MXFP8 operands (e4m3, one
    E8M0 scale per 32 elements along the reduction: `mxfp8_quantize`'s format; hidden and intermediate divisible
    by 32), dequantized in the main loop (Hopper has no block-scaled MMA: each K step is multiplied as exact bf16
    products with fp32 sums), the gate-up GEMM's SwiGLU epilogue writing h already in MXFP8 for the down GEMM.
    With either fp8 precision the backward GEMMs run in x's dtype on the saved gate/up pre-activations (a
    straight-through estimator of the quantization). Inside `keep_quantized_weights()` the weights' quantized
    copies are reused across calls while the weights are unchanged.
    """
    n_exp, _inter = _check(x, router_weight, gate_up_weight, down_weight, top_k, scoring, renormalize)
    _check_routing(n_exp, top_k, expert_bias, n_group, topk_group, routed_scaling_factor, x)
    _check_precision(precision)  # before routing; moe_experts checks the device
    hidden = x.shape[-1]
    x2 = _rows(x, hidden)
    weights, experts = route(x2, router_weight, top_k, scoring, renormalize, expert_bias=expert_bias,
                             n_group=n_group, topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)
    return moe_experts(x2, weights, gate_up_weight, down_weight, experts, precision=precision).view(x.shape)


def _check_precision(precision, x: Optional[torch.Tensor] = None, gate_up_weight: Optional[torch.Tensor] = None
                     ) -> None:
    """precision is one of PRECISIONS; with the tensors: fp8 tensor cores for "fp8", and for "mxfp8" (fp8 tensor
    cores or the interpreter) hidden and intermediate sizes in whole 32-element MX blocks."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    if precision == "bf16" or x is None:
        return
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9):
        raise TypeError(f"precision={precision!r} needs fp8 tensor cores (compute capability 8.9+); {x.device} is "
                        f"sm_{''.join(map(str, torch.cuda.get_device_capability(x.device)))}")
    if precision == "mxfp8" and gate_up_weight is not None:
        for name, size in (("hidden (x's last dim)", x.shape[-1]), ("intermediate", gate_up_weight.shape[1] // 2)):
            if size % 32:
                raise ValueError(f"precision='mxfp8' needs {name} divisible by the MX block size 32, got {size}; "
                                 f"use precision='fp8' (rowwise scales) for this layer")


def moe_experts(x: torch.Tensor, weights: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
                experts: torch.Tensor, *, precision: str = "bf16") -> torch.Tensor:
    """The expert part of `moe` for a routing computed elsewhere (a Hugging Face router, say):
    ``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``, e = experts[t, j].

    x (T, hidden); weights (T, k), any float dtype (multiplied in fp32); experts (T, k) integer ids in
    [0, E); gate_up_weight (E, 2 * intermediate, hidden), gate rows first; down_weight (E, hidden, intermediate).
    Differentiable in x, weights, gate_up_weight and down_weight. Not validated here (the caller checked the
    layouts once): `moe` validates its arguments, then routes and calls this. precision as `moe`'s."""
    _check_precision(precision, x, gate_up_weight)
    allow_tf32 = bool(torch.backends.cuda.matmul.allow_tf32) and x.dtype == torch.float32
    save = wants_grad(x, weights, gate_up_weight, down_weight)
    return dispatch(_moe_experts_op, moe_experts_fwd, _MoEExpertsFunction, 4,
                    (x, weights, gate_up_weight, down_weight, experts, allow_tf32, save, precision),
                    pick=_first)


class MoE(torch.nn.Module):
    """A mixture-of-experts SwiGLU MLP running `kernelkit.moe`. Parameters as transformers' fused MoE blocks
    (MixtralSparseMoeBlock's state_dict): ``gate.weight`` (experts, hidden), ``experts.gate_up_proj``
    (experts, 2 * intermediate, hidden), ``experts.down_proj`` (experts, hidden, intermediate); initialized as
    nn.Linear would each expert. DeepSeek-V3 routing: `expert_bias=True` adds the buffer
    ``gate.e_score_correction_bias`` (E,) (zeros; a load balancer updates it), and n_group / topk_group /
    routed_scaling_factor as `route`'s. Documented fallback: a CPU tensor outside the Triton interpreter runs
    `reference`."""

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, scoring: str = "softmax",
                 renormalize: bool = True, device=None, dtype=None, precision: str = "bf16", *,
                 expert_bias: bool = False, n_group: int = 1, topk_group: Optional[int] = None,
                 routed_scaling_factor: float = 1.0):
        super().__init__()
        _check_precision(precision)
        _check_routing(experts, top_k, None, n_group, topk_group, routed_scaling_factor)
        self.precision = precision
        self.routing = {"n_group": n_group, "topk_group": topk_group, "routed_scaling_factor": routed_scaling_factor}
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {', '.join(map(repr, SCORINGS))}, got {scoring!r}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be between 1 and experts ({experts}), got {top_k}")
        self.hidden, self.intermediate, self.num_experts, self.top_k = hidden, intermediate, experts, top_k
        self.scoring, self.renormalize = scoring, renormalize
        kw = {"device": device, "dtype": dtype}
        self.gate, self.experts = torch.nn.Module(), torch.nn.Module()  # parameter names as transformers'
        self.gate.weight = torch.nn.Parameter(torch.empty((experts, hidden), **kw))
        self.experts.gate_up_proj = torch.nn.Parameter(torch.empty((experts, 2 * intermediate, hidden), **kw))
        self.experts.down_proj = torch.nn.Parameter(torch.empty((experts, hidden, intermediate), **kw))
        if expert_bias:
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(experts, device=device,
                                                                             dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for p, fan_in in ((self.gate.weight, self.hidden), (self.experts.gate_up_proj, self.hidden),
                              (self.experts.down_proj, self.intermediate)):
                bound = 1.0 / fan_in ** 0.5  # nn.Linear's kaiming_uniform(a=sqrt(5)) bound
                p.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj, self.top_k)
        kw = {"scoring": self.scoring, "renormalize": self.renormalize, **self.routing,
              "expert_bias": getattr(self.gate, "e_score_correction_bias", None)}
        if x.device.type != "cuda" and not interpreting():
            return reference(*args, **kw)
        return moe(*args, **kw, precision=self.precision)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, experts={self.num_experts}, "
                f"top_k={self.top_k}, scoring={self.scoring!r}, renormalize={self.renormalize}")


# --- reference, cost, registry ---

def experts_reference(x, weights, gate_up_weight, down_weight, experts):
    """The expert part in plain PyTorch, one expert at a time: x (T, H), weights and experts (T, k)."""
    out = torch.zeros_like(x)
    for e in range(gate_up_weight.shape[0]):
        token, slot = torch.where(experts == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up_weight[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_weight[e])
        out = out.index_add(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out


def reference(x, router_weight, gate_up_weight, down_weight, top_k, *, scoring="softmax", renormalize=True,
              **routing):
    """Plain PyTorch: router logits in fp32 (fp64 for fp64 inputs), softmax or sigmoid, top-k, renormalized if
    asked (and route's DeepSeek-V3 options in `routing`), then every expert in a Python loop over the tokens
    routed to it. Output in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = x2.to(acc) @ router_weight.to(acc).T
    probs = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    weights, experts = _select(probs, top_k, renormalize, **routing)
    return experts_reference(x2, weights, gate_up_weight, down_weight, experts).reshape(x.shape)


def cost(x, router_weight, gate_up_weight, down_weight, top_k, *, scoring="softmax", renormalize=True,
         backward: bool = False) -> Cost:
    """The expert GEMMs: 2·T·k·(2·I·H + I·H) FLOPs forward, twice that backward (dgrad and wgrad of each); the
    router's 2·T·E·H is left out (under 1% at the bench shapes). Ideal bytes: x, the router and the expert
    weights read once, the output written once (backward: dout, x and the weights read, dx and every weight
    gradient written)."""
    hidden = x.shape[-1]
    t = x.numel() // max(hidden, 1)
    i2 = gate_up_weight.shape[1]
    inter = i2 // 2
    es = x.element_size()
    expert_bytes = (gate_up_weight.numel() + down_weight.numel()) * es
    router_bytes = router_weight.numel() * router_weight.element_size()
    flops = 2.0 * t * top_k * (i2 * hidden + inter * hidden)
    dt = "tf32" if x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else dtype_key(x.dtype)
    if backward:
        return Cost(flops=2 * flops, bytes=3 * t * hidden * es + 2 * expert_bytes + 2 * router_bytes, dtype=dt)
    return Cost(flops=flops, bytes=2 * t * hidden * es + expert_bytes + router_bytes, dtype=dt)


def make_inputs(shape, dtype, device, generator=None):
    """shape = (tokens, hidden, intermediate, experts, top_k): x (T, H) standard normal, expert weights scaled by
    1/sqrt(fan_in) (outputs of order 1), and routing margins built in: the router is the identity on x's first E
    columns (plus a small dense part), and those columns hold, per token, a random permutation of E distinct
    levels (multiples of 2/next_pow2(E), exact in bf16 and fp16 up to 256 experts). Neighbouring logits are then
    one level apart up to the dense part, whose difference is a level / 11 standard deviation: the top-k choice
    cannot flip between the kernel path and the float64 reference on rounding noise (near-ties of random logits
    would make the routings, and then the outputs, differ). With hidden < experts the router is plain random.
    Top-1 inputs route without renormalizing (Switch Transformer): a renormalized top-1 weight is identically 1, so
    the router's gradient is exactly zero and a relative error against the float64 reference's rounding residue
    would mean nothing."""
    t, hidden, inter, n_exp, top_k = shape
    kw = {"device": device, "generator": generator}
    x = torch.randn((t, hidden), **kw)
    level = 4.0 / next_pow2(n_exp)
    router = torch.randn((n_exp, hidden), **kw) * (level / 16 / hidden ** 0.5)
    if hidden >= n_exp:
        rank = torch.rand((t, n_exp), **kw).argsort(dim=1)
        x[:, :n_exp] = (2 * rank - (n_exp - 1)).float() * (level / 2)
        router[:, :n_exp] = torch.eye(n_exp, device=device)
    # The expert weights drawn in the target dtype: DeepSeek-V3's are 22.5 GB in bf16, twice that in fp32.
    gate_up = torch.randn((n_exp, 2 * inter, hidden), dtype=dtype, **kw).mul_(hidden ** -0.5)
    down = torch.randn((n_exp, hidden, inter), dtype=dtype, **kw).mul_(inter ** -0.5)
    return (x.to(dtype), router.to(dtype), gate_up, down, top_k), {"renormalize": top_k > 1}


register(OpSpec(
    name="moe", fn=moe, reference=reference, cost=cost, make_inputs=make_inputs, grad_args=(0, 1, 2, 3),
    test_shapes=[(37, 24, 20, 4, 2), (5, 16, 12, 3, 1), (9, 32, 16, 8, 8)],
    # First a medium shape: `kernelkit check` (make demo) runs bench_shapes[0] against a float64 reference on
    # the GPU, which at Mixtral's shape needs ~30 GB; then the three layers (Mixtral, Qwen3-30B-A3B,
    # DeepSeek-V3), which benchmarks/moe.py times against torch._grouped_mm.
    bench_shapes=[(2048, 1024, 1536, 16, 4), (8192, 4096, 14336, 8, 2), (8192, 2048, 768, 128, 8),
                  (8192, 7168, 2048, 256, 8)],
    # torch.compile of the per-expert loop breaks its graph at every expert's torch.where: the eager row only.
    generic_rows=("eager",), baseline="eager",
    # A broadcast router gives every expert the same logit: the top-k of exact ties is arbitrary, and the kernel
    # path and the float64 reference may pick different experts (a routing, not a kernel, difference).
    layout_skip=((1, "expanded"),),
    layout_shape=(13, 16, 12, 4, 2),
    # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: through the chain's four bf16
    # roundings (h, the expert outputs, d(gate, up), the weighted dout) that measured up to 1.05e-2 against
    # float64 at the test shapes, where torch's bf16 per-expert loop measures 4-7e-3. float16: the router's
    # gradient goes through the softmax/top-k Jacobian, which subtracts the selected experts' nearly equal
    # <dout, expert output> products, so the fp16 rounding of h (~5e-4) can grow several-fold there; with x
    # broadcast (every token the same, the errors add up coherently) it measured 7.2e-3 on the H100 in one of
    # two `check all` runs (fp32 and bf16 passed; the output and the other gradients stayed within 2e-3).
    tolerances={"bfloat16": 2e-2, "float16": 1e-2},
    doc="MoE SwiGLU MLP: torch router (softmax/sigmoid top-k), grouped-GEMM experts, forward+backward.",
))
