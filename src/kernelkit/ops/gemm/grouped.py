"""The MoE layer's Triton kernels and their launchers: the grouped GEMM over experts (gather, SwiGLU, routing
weight, scatter, rowwise fp8 and MXFP8 operands, the MXFP8-writing epilogue) and the per-expert wgrad.
ops/moe/ composes them into the layer (see its docstring for the data flow).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch
import triton
import triton.language as tl

from ... import switches
from ...runtime import autotune, cdiv, ensure_tma_allocator, launch, next_pow2, num_sms, tma_device
from .fp8 import HW_FP8_CAST, mx_dequant, quantize_segments_t
from .tiles import GEMM_TMA, INTERPRETER_DOT, gate_up_step, grouped_tile, tile_configs
from .mx import e8m0_to_fp32, mx_encode


def _gemm_configs() -> list:
    # The first config is the interpreter's: 16-row tiles split the test shapes' experts (5-20 rows each) into
    # several tiles with ragged tails. The rest are Hopper GEMM tiles as in ops/linear/, plus 16/32-row tiles for
    # few tokens per expert (decode, or 256 experts), where a 128-row tile would be mostly padding.
    return tile_configs(((16, 16, 16, 2, 4), (128, 128, 64, 3, 8), (128, 128, 64, 4, 4), (128, 256, 64, 3, 8),
                         (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4), (64, 256, 64, 3, 8),
                         (32, 128, 64, 4, 4), (16, 128, 128, 4, 4), (128, 128, 128, 3, 8), (64, 128, 128, 4, 4)))


def _prune_gemm(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    # The SwiGLU epilogues keep two fp32 accumulators (gate and up): 128x256 of each spills registers.
    if args.get("EPILOGUE") == "swiglu":
        return [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128]
    return configs


def _wgrad_configs() -> list:
    return tile_configs(((16, 16, 16, 2, 4), (128, 128, 64, 3, 8), (128, 128, 32, 4, 8), (64, 128, 64, 4, 4),
                         (128, 64, 64, 4, 4), (64, 64, 64, 4, 4), (128, 256, 64, 3, 8)))


@triton.jit
def _tile_map(OFFS, E, E_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """The row tiles of every expert from the E + 1 row offsets: (es, start, end, n_tiles, tiles_end) as E_P2
    vectors (tiles_end: the prefix sum of n_tiles).

    Computed in the kernel rather than on the host: the tile counts depend on BLOCK_M, which is autotuned, and
    E <= 256 offsets are one vector load and a prefix sum."""
    es = tl.arange(0, E_P2)
    real = es < E
    start = tl.load(OFFS + es, mask=real, other=0)
    end = tl.load(OFFS + es + 1, mask=real, other=0)
    n_tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    return es, start, end, n_tiles, tl.cumsum(n_tiles, 0)


@triton.jit
def _tile_expert(tile, es, start, end, n_tiles, tiles_end, BLOCK_M: tl.constexpr):
    """(expert, first row, expert's end row) of row tile `tile` in _tile_map's map; expert >= E past the last
    real tile. A branch-free search: the expert is the number of experts whose tiles end at or before `tile`
    (an empty expert owns no tile and is skipped)."""
    e = tl.sum((tiles_end <= tile).to(tl.int32), 0)
    mine = es == e
    first_tile = tl.sum(tl.where(mine, tiles_end - n_tiles, 0), 0)
    row0 = tl.sum(tl.where(mine, start, 0), 0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(mine, end, 0), 0)
    return e, row0, row_end


@triton.jit
def _epilogue(acc, acc_up, rows, rows64, m_ok, a_rows, rn64, n_ok, pid_n, e, C, C_IDX, stride_cm, stride_cn,
              Z, stride_zm, stride_zn, H, stride_hm, SCALE, AUX, stride_aux, A_SCALE, B_SCALE, stride_bse, N,
              EPILOGUE: tl.constexpr, SCATTER_C: tl.constexpr, HAS_SCALE: tl.constexpr, STORE_Z: tl.constexpr,
              STORE_H: tl.constexpr, SCALES: tl.constexpr, Q_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr):
    """The grouped GEMMs' shared epilogue on one (BLOCK_M, BN) fp32 tile (and its up half for swiglu): rowwise
    dequantization, SwiGLU / its backward, the routing weight, the row scatter and the store (MXFP8 with Q_OUT).
    rows: the tile's rows in the sorted order (m_ok: inside its expert); a_rows: where A's rows (and their rowwise
    scales) were read."""
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
        # In two column halves: the whole tile's gate, up, sigmoid and products at once spill registers (128-wide
        # tiles ran at 40% of the forward GEMM's speed: benchmarks/experiments/h100/moe/moe_dgrad_ab.json).
        HALF: tl.constexpr = BN // 2
        left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        w = tl.load(SCALE + rows, mask=m_ok, other=0.0)[:, None]
        cols = pid_n * BN + tl.arange(0, HALF).to(tl.int64)
        part = _swiglu_bwd_half(left, w, rows64, cols, m_ok, N, Z, stride_zm, stride_zn, C, stride_cm, stride_cn,
                                H, stride_hm, STORE_H)
        part += _swiglu_bwd_half(right, w, rows64, cols + HALF, m_ok, N, Z, stride_zm, stride_zn, C, stride_cm,
                                 stride_cn, H, stride_hm, STORE_H)
        # d(routing weight) = <dout, down(h)> = <dout @ W_down, h>: this N tile's part, summed on the host.
        tl.store(AUX + rows64 * stride_aux + pid_n, part, mask=m_ok)
    if EPILOGUE != "swiglu_bwd":  # (its stores are in _swiglu_bwd_half)
        if HAS_SCALE:
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


@triton.jit
def _swiglu_bwd_half(g, w, rows64, cols, m_ok, N, Z, stride_zm, stride_zn, C, stride_cm, stride_cn, H, stride_hm,
                     STORE_H: tl.constexpr):
    """SwiGLU's backward on columns `cols` of a tile: g = dout @ W_down (unscaled), w the routing weight per row.
    Stores d(gate) and d(up) into C's two halves (and h with STORE_H); returns the rows' <g, h> over these columns."""
    n_ok = cols < N
    mask = m_ok[:, None] & n_ok[None, :]
    z_ptrs = Z + rows64[:, None] * stride_zm + cols[None, :] * stride_zn
    gate = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(z_ptrs + N * stride_zn, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    part = tl.sum(g * silu * up, axis=1)
    if STORE_H:  # h again, for the down weight's gradient (the forward did not keep it)
        tl.store(H + rows64[:, None] * stride_hm + cols[None, :], (silu * up).to(H.dtype.element_ty), mask=mask)
    dh = g * w
    c_ptrs = C + rows64[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs + N * stride_cn, (dh * silu).to(C.dtype.element_ty), mask=mask)
    tl.store(c_ptrs, (dh * up * sig * (1.0 + gate * (1.0 - sig))).to(C.dtype.element_ty), mask=mask)
    return part


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


_UNTUNED = {"tune": False}  # a mode the autotuner does not key on (the same tile serves both values)
SIZES = ["ROWS_BUCKET", "N", "K", "E"]  # what the autotuner keys on besides the modes


@dataclass(frozen=True)
class _GroupedModes:
    """The constexpr modes both grouped kernels take, named as the kernels name them. A launch passes
    `constexprs` as its keywords and `key` in its launch key, and the kernel's autotune key is `tuned_fields()`:
    all three read off one record, so they cannot disagree (tests/test_moe_modes.py checks the fields against
    the kernels' signatures)."""
    EPILOGUE: str = "none"  # "none", "swiglu", "swiglu_bwd" (see moe_grouped_gemm_kernel)
    GATHER_A: bool = False  # A's rows read through A_IDX
    SCATTER_C: bool = False  # C's rows written through C_IDX
    HAS_SCALE: bool = field(default=False, metadata=_UNTUNED)  # the routing weight per row
    STORE_Z: bool = field(default=False, metadata=_UNTUNED)  # swiglu: keep the gate/up pre-activations
    STORE_H: bool = field(default=False, metadata=_UNTUNED)  # swiglu_bwd: store h recomputed
    INPUT_PRECISION: Optional[str] = field(default=None, metadata=_UNTUNED)  # tl.dot's (None with SCALES)
    SCALES: str = ""  # "", "rowwise" (fp8) or "mx" (MXFP8)
    Q_OUT: bool = False  # swiglu: h written as MXFP8

    @classmethod
    def tuned_fields(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.metadata.get("tune", True)]

    @property
    def key(self) -> tuple:
        return tuple(self.__dict__.values())

    @property
    def constexprs(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class GroupedMode(_GroupedModes):
    """moe_grouped_gemm_kernel's modes (the pointer kernel)."""
    B_TMA: bool = False  # the weights through a tensor descriptor (tma_weight)
    MX_MODE: str = ""  # MXFP8 operands' K-loop mode ("" without them; see MX_MODES)


@dataclass(frozen=True)
class GroupedTmaMode(_GroupedModes):
    """moe_grouped_tma_kernel's modes (the persistent Hopper kernel)."""
    B_KMAJOR: bool = False  # the weights' (E, K, N') view K-contiguous (nn.Linear's layout)
    NUM_SMS: int = 1  # programs: one per SM


@autotune(_gemm_configs(), key=SIZES + GroupedMode.tuned_fields(),
          prune_configs_by={"early_config_prune": _prune_gemm}, reset_to_zero=["AUX"])
@triton.jit
def moe_grouped_gemm_kernel(A, A_IDX, stride_am, stride_ak,  # A (rows, K); row r read at A_IDX[r] with GATHER_A
                            B, stride_be, stride_bk, stride_bn,  # expert e's weight read as (K, N) [(K, 2N): swiglu]
                            C, C_IDX, stride_cm, stride_cn,  # C (rows, N) [(rows, 2N): swiglu_bwd]; row r at C_IDX[r]
                            Z, stride_zm, stride_zn,  # gate | up pre-activations (rows, 2N)
                            H, stride_hm,  # swiglu_bwd with STORE_H: h = silu(gate) * up recomputed (rows, N)
                            SCALE,  # routing weight per row (HAS_SCALE)
                            AUX, stride_aux,  # swiglu_bwd: (rows, N tiles) partial sums of dh * h; Q_OUT: C's scales
                            A_SCALE, stride_as, B_SCALE, stride_bse, stride_bsn,  # SCALES: A's and B's (see below)
                            OFFS, ROWS, N, K, E, ROWS_BUCKET,  # expert e owns rows [OFFS[e], OFFS[e + 1])
                            EPILOGUE: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr,
                            HAS_SCALE: tl.constexpr, STORE_Z: tl.constexpr, STORE_H: tl.constexpr,
                            INPUT_PRECISION: tl.constexpr,
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
    es, start, end, n_tiles, tiles_end = _tile_map(OFFS, E, E_P2, BLOCK_M)
    e, row0, row_end = _tile_expert(pid_m, es, start, end, n_tiles, tiles_end, BLOCK_M)
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
        # them is the layout the dense GEMM lost 25% on (see ops/linear/). Here they come through one 3-D
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

    _epilogue(acc, acc_up, rows, rows64, m_ok, a_rows, rn64, n_ok, pid_n, e, C, C_IDX, stride_cm, stride_cn,
              Z, stride_zm, stride_zn, H, stride_hm, SCALE, AUX, stride_aux, A_SCALE, B_SCALE, stride_bse, N,
              EPILOGUE, SCATTER_C, HAS_SCALE, STORE_Z, STORE_H, SCALES, Q_OUT, BLOCK_M, BN)


def _tma_gemm_configs() -> list:
    # The interpreter's first (16-row boxes split the test shapes' experts into ragged tiles), then Hopper tiles:
    # 128x128 with swiglu is the dense TMA GEMM's best 128x256 tile (gate and up: two accumulators), 128x256 without
    # it; 64-row tiles for few rows per expert; 128-wide K steps for fp8.
    return tile_configs(((16, 16, 16, 2, 4), (128, 128, 64, 4, 8), (128, 128, 64, 3, 8), (128, 256, 64, 3, 8),
                         (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (64, 256, 64, 3, 8), (128, 64, 64, 4, 4),
                         (64, 64, 64, 4, 4), (128, 128, 128, 3, 8), (128, 256, 128, 3, 8)))


@autotune(_tma_gemm_configs(), key=SIZES + GroupedTmaMode.tuned_fields(),
          prune_configs_by={"early_config_prune": _prune_gemm}, reset_to_zero=["AUX"])
@triton.jit
def moe_grouped_tma_kernel(A, A_IDX, stride_am, stride_ak,  # A (rows, K); row r at A_IDX[r] with GATHER_A
                           B, stride_be, stride_bk, stride_bn,  # expert e's weight as (K, N'); one of bk, bn is 1
                           C, C_IDX, stride_cm, stride_cn, Z, stride_zm, stride_zn, H, stride_hm, SCALE, AUX, stride_aux,
                           A_SCALE, B_SCALE, stride_bse,  # SCALES "rowwise": one fp32 per A row, (E, N') per channel
                           OFFS, ROWS, N, K, E, ROWS_BUCKET, NUM_SMS: tl.constexpr, B_KMAJOR: tl.constexpr,
                           EPILOGUE: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr,
                           HAS_SCALE: tl.constexpr, STORE_Z: tl.constexpr, STORE_H: tl.constexpr,
                           INPUT_PRECISION: tl.constexpr, SCALES: tl.constexpr,
                           Q_OUT: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """moe_grouped_gemm_kernel's Hopper path (same epilogues): persistent, one program per SM walking the real
    (expert row tile, column tile) pairs in grouped order, so no program is launched for an empty or short expert.
    The weights through one 3-D tensor descriptor, (E, N', K) (B_KMAJOR: nn.Linear's layout, the forward) or
    (E, K, N') (the dgrads), boxes past an expert's K or N' reading zeros. A's rows come sorted by expert through
    a 2-D descriptor over all rows (a tile that crosses its expert's end reads the next expert's rows, computed but
    not stored: m_ok), or with GATHER_A through pointer loads of the rows A_IDX names.
    Measured on the H100 (benchmarks/experiments/h100/moe/moe_persistent_ab*.json): one tile per program over the
    upper-bound grid, a flattened tile loop, and the tile map as a table searched with scalar loads were all as
    fast or slower than this."""
    BK: tl.constexpr = 32 if SCALES != "" and BLOCK_K < 32 else BLOCK_K
    BN: tl.constexpr = 32 if Q_OUT and BLOCK_N < 32 else BLOCK_N
    NT = 2 * N if EPILOGUE == "swiglu" else N
    if not GATHER_A:
        a_desc = tl.make_tensor_descriptor(A, shape=[ROWS, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BK])
    if B_KMAJOR:
        b_desc = tl.make_tensor_descriptor(B, shape=[E, NT, K], strides=[stride_be, stride_bn, 1],
                                           block_shape=[1, BN, BK])
    else:
        b_desc = tl.make_tensor_descriptor(B, shape=[E, K, NT], strides=[stride_be, stride_bk, 1],
                                           block_shape=[1, BK, BN])
    es, start, end, n_tiles, tiles_end = _tile_map(OFFS, E, E_P2, BLOCK_M)  # once per program
    grid_m = tl.sum(n_tiles, 0)
    grid_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_SMS):
        pid_m, pid_n = grouped_tile(tile, grid_m, grid_n, GROUP_M)
        e, row0, row_end = _tile_expert(pid_m, es, start, end, n_tiles, tiles_end, BLOCK_M)
        rows = row0 + tl.arange(0, BLOCK_M)
        m_ok = rows < row_end
        rows64 = rows.to(tl.int64)
        if GATHER_A:  # the permutation in the loads (pointer loads; the weights still through TMA)
            a_rows = tl.load(A_IDX + rows, mask=m_ok, other=0).to(tl.int64)
            a_ptrs = A + a_rows[:, None] * stride_am + tl.arange(0, BK)[None, :] * stride_ak
        else:
            a_rows = rows64
        acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
        # (e < E always: the guard is the loop form that was measured, as fast as or faster than range(k_steps))
        for ks in range(tl.where(e < E, k_steps, 0)):
            if GATHER_A:
                a = tl.load(a_ptrs + ks * BK * stride_ak, mask=m_ok[:, None] & (ks * BK + tl.arange(0, BK) < K)[None, :],
                            other=0.0)
            else:
                a = a_desc.load([row0, ks * BK])
            if B_KMAJOR:
                b = tl.trans(b_desc.load([e, pid_n * BN, ks * BK]).reshape(BN, BK))
            else:
                b = b_desc.load([e, ks * BK, pid_n * BN]).reshape(BK, BN)
            if INTERPRETER_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            if EPILOGUE == "swiglu":  # the up half: rows (columns) [N, 2N) of the weight
                if B_KMAJOR:
                    u = tl.trans(b_desc.load([e, N + pid_n * BN, ks * BK]).reshape(BN, BK))
                else:
                    u = b_desc.load([e, ks * BK, N + pid_n * BN]).reshape(BK, BN)
                if INTERPRETER_DOT:
                    u = u.to(tl.float32)
                acc_up = tl.dot(a, u, acc_up, input_precision=INPUT_PRECISION)
        rn64 = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        _epilogue(acc, acc_up, rows, rows64, m_ok, a_rows, rn64, rn64 < N, pid_n, e, C, C_IDX, stride_cm,
                  stride_cn, Z, stride_zm, stride_zn, H, stride_hm, SCALE, AUX, stride_aux, A_SCALE, B_SCALE, stride_bse, N,
                  EPILOGUE, SCATTER_C, HAS_SCALE, STORE_Z, STORE_H, SCALES, Q_OUT, BLOCK_M, BN)


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


def _wgrad_fp8_configs() -> list:
    # The interpreter's first (an fp8 dot takes K >= 32 a step); then Hopper tiles with 128-deep fp8 K steps. Every
    # BLOCK_K divides the segments' padding (fp8.SEGMENT_PAD).
    return tile_configs(((16, 16, 32, 2, 4), (128, 128, 128, 3, 8), (128, 256, 128, 3, 8), (128, 128, 128, 4, 4),
                         (64, 128, 128, 4, 4), (128, 64, 128, 4, 4), (128, 128, 64, 4, 8)))


@autotune(_wgrad_fp8_configs(), key=["ROWS_BUCKET", "M", "N", "E"])
@triton.jit
def moe_wgrad_fp8_kernel(A, SA, stride_a,  # A^T (M, W) e4m3, K-contiguous; SA (E, M) fp32
                         B, SB, stride_b,  # B^T (N, W) e4m3, K-contiguous; SB (E, N) fp32
                         C, stride_ce, stride_cm, stride_cn,  # dW (E, M, N)
                         POFFS, M, N, E, ROWS_BUCKET,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """dW[e] = (A^T[:, seg e] @ B^T[:, seg e]^T) * SA[e, m] * SB[e, n]: the weight gradient on fp8 operands that
    quantize_segments_t wrote, each expert's rows a padded, zero-filled segment [POFFS[e], POFFS[e + 1]) of whole
    K steps (so the loads need no row mask and stay 16-byte vectors). One (M, N) tile of one expert per program;
    an empty expert's gradient is written as zeros."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    e = pid // (grid_m * grid_n)
    pid_m, pid_n = grouped_tile(pid % (grid_m * grid_n), grid_m, grid_n, GROUP_M)
    pstart = tl.multiple_of(tl.load(POFFS + e), 16)
    steps = (tl.load(POFFS + e + 1) - pstart) // BLOCK_K
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = rm < M
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + rm[:, None] * stride_a + pstart + rk[None, :]
    b_ptrs = B + rn[:, None] * stride_b + pstart + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(steps):
        a = tl.load(a_ptrs + i * BLOCK_K, mask=m_ok[:, None], other=0.0)
        b = tl.load(b_ptrs + i * BLOCK_K, mask=n_ok[:, None], other=0.0)
        if INTERPRETER_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
    e64 = e.to(tl.int64)
    sa = tl.load(SA + e64 * M + rm, mask=m_ok, other=0.0)
    sb = tl.load(SB + e64 * N + rn, mask=n_ok, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    tl.store(C + e64 * stride_ce + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# --- launchers ---

# Columns of the routing-weight gradient's partial sums: one per N tile of the smallest BLOCK_N a config has.
ROWDOT_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in moe_grouped_gemm_kernel.configs)


def grouped_gemm(a, weight, c, offs, n, *, a_idx=None, c_idx=None, scale=None, z=None, rowdot=None,
                  epilogue="none", precision=None, a_scale=None, b_scale=None, mx=False, c_scales=None, h_out=None):
    """c = epilogue(a[rows] @ weight[e]) for the expert groups `offs`; weight is an (E, K, N') view (N' = 2n
    for swiglu) read through its strides. fp8 a and weight take a_scale and b_scale: rowwise, one fp32 per row
    of a (as a_idx indexes it) and (E, N') contiguous along N'; with `mx`, E8M0 codes per 32 elements along K,
    (rows of a, K / 32) and (E, N', K / 32) contiguous along K. c_scales (rows, n / 32) uint8 (swiglu): h is
    stored as MXFP8, its e4m3 bits in c (float8_e4m3fn or uint8) and its codes in c_scales. h_out (rows, n)
    (swiglu_bwd): h = silu(gate) * up recomputed from z, stored for the down weight's gradient."""
    scales = "" if a_scale is None else "mx" if mx else "rowwise"
    q_out = c_scales is not None
    store_z = z is not None and epilogue == "swiglu"
    rows, e, k = c.shape[0] if c_idx is None else c_idx.shape[0], weight.shape[0], weight.shape[1]
    zz = z if z is not None else c
    hh = h_out if h_out is not None else c
    # Not a borrowed argument: the autotuner zeroes AUX around its timing runs (reset_to_zero).
    aux = c_scales if q_out else rowdot if rowdot is not None else torch.empty(1, dtype=torch.float32,
                                                                                device=c.device)
    if q_out:
        c = c.view(torch.uint8)
    bucket = next_pow2(rows)
    b_kmajor = _persistent(a, weight, a_idx, scales, rows, n if epilogue == "swiglu" else 0)
    if b_kmajor is not None:
        n_out = 2 * n if epilogue == "swiglu" else n
        gather = a_idx is not None and (TMA_GATHER == "loads" or TMA_GATHER == "auto" and n_out < COPY_GATHER_MIN_N)
        if a_idx is not None and not gather:  # gathered by a copy: the GEMM's rows are contiguous TMA boxes
            a = a.index_select(0, a_idx)
            a_scale = a_scale.index_select(0, a_idx) if scales else None
        if weight.is_cuda:
            ensure_tma_allocator()
        sms = num_sms(c.device)
        bs_e = b_scale.stride(0) if scales else 0
        grid = lambda meta: (min(sms, (cdiv(rows, meta["BLOCK_M"]) + e)  # noqa: E731
                                 * cdiv(n, max(meta["BLOCK_N"], 32 if q_out else 1))),)
        mode = GroupedTmaMode(EPILOGUE=epilogue, GATHER_A=gather, SCATTER_C=c_idx is not None,
                              HAS_SCALE=scale is not None, STORE_Z=store_z, STORE_H=h_out is not None,
                              INPUT_PRECISION=None if scales else precision,
                              SCALES=scales, Q_OUT=q_out, B_KMAJOR=b_kmajor, NUM_SMS=sms)
        launch(moe_grouped_tma_kernel, grid, ("gemm_tma", bucket, n, k, e, a.dtype, c.dtype, *mode.key),
               a, a_idx if gather else offs, a.stride(0), a.stride(1), weight, weight.stride(0), weight.stride(1),
               weight.stride(2),
               c, c_idx if c_idx is not None else offs, c.stride(0), c.stride(1),
               zz, zz.stride(0), zz.stride(-1), hh, hh.stride(0), scale if scale is not None else c, aux, aux.stride(0),
               a_scale if scales else aux, b_scale if scales else aux, bs_e,
               offs, rows, n, k, e, bucket, **mode.constexprs, E_P2=max(16, next_pow2(e)))
        return
    b_tma = tma_weight(weight)
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
    mode = GroupedMode(EPILOGUE=epilogue, GATHER_A=a_idx is not None, SCATTER_C=c_idx is not None,
                       HAS_SCALE=scale is not None, STORE_Z=store_z, STORE_H=h_out is not None,
                       INPUT_PRECISION=None if scales else precision, SCALES=scales, Q_OUT=q_out, B_TMA=b_tma,
                       MX_MODE=mx_mode)
    launch(moe_grouped_gemm_kernel, grid, ("gemm", bucket, n, k, e, a.dtype, c.dtype, *mode.key),
           a, a_idx if a_idx is not None else offs, a.stride(0), a.stride(1),
           weight, weight.stride(0), weight.stride(1), weight.stride(2),
           c, c_idx if c_idx is not None else offs, c.stride(0), c.stride(1),
           zz, zz.stride(0), zz.stride(-1), hh, hh.stride(0),
           scale if scale is not None else c,
           aux, aux.stride(0),
           a_scale if scales else aux, a_scale.stride(0) if scales else 0, b_scale if scales else aux, bs_e, bs_n,
           offs, rows, n, k, e, bucket, **mode.constexprs, E_P2=max(16, next_pow2(e)))


# How the MXFP8 path multiplies: "upcast" (operands dequantized to bf16 by their own passes, then bf16 GEMMs; see
# moe_experts_fwd) or inside the grouped GEMM's K loop, "dequant", "dot_scaled" or "promote" (see the kernel);
# KERNELKIT_MX_MODE overrides the default.
MX_MODES = switches.SWITCHES["KERNELKIT_MX_MODE"].choices
MX_MODE = switches.value("KERNELKIT_MX_MODE")


# The TMA path for the experts' weights: 16-bit, K-contiguous (nn.Linear's (out, in) per expert), 16-byte aligned
# base and outer strides, on a Hopper-or-newer GPU or in the interpreter. KERNELKIT_GEMM_TMA=0 turns it off
# (tiles.GEMM_TMA).


def _aligned(t: torch.Tensor, *strides: int) -> bool:
    """A 16-byte aligned base and strides (in elements of t): what a tensor descriptor takes."""
    return t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in strides)


def tma_weight(weight: torch.Tensor) -> bool:
    """Whether the (E, K, N') weight view can be read through a (E, N', K) tensor descriptor."""
    if not GEMM_TMA or weight.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn) or weight.stride(1) != 1:
        return False
    if not tma_device(weight):
        return False
    e, k, n = weight.shape
    s_e, s_n = weight.stride(0), weight.stride(2)
    return s_n >= k and (s_e >= n * s_n or e == 1) and _aligned(weight, s_e, s_n)


# The persistent TMA kernel for bf16 / fp16 / rowwise-fp8 grouped GEMMs on Hopper (x's rows gathered by a copy
# first); KERNELKIT_MOE_PERSISTENT=0 keeps the pointer kernel with the gather fused into its loads.
PERSISTENT = switches.on("KERNELKIT_MOE_PERSISTENT")
# How its rows of x (and of dout) are gathered: "auto" copies them first (index_select) for wide outputs, where the
# copy is a small share of the GEMM and TMA boxes beat pointer loads, and gathers in the loads otherwise (the copy
# would cost 5-13%); measured on the H100 (moe_persistent_ab2.json), gate-up TFLOP/s copy / in-load:
# Mixtral 640-650 / 584-614, Qwen3 444-461 / 503-523, DeepSeek-V3 450-465 / 463-476. "copy" and "loads" force one.
TMA_GATHER = switches.value("KERNELKIT_MOE_GATHER")
COPY_GATHER_MIN_N = 8192  # "auto": output columns (gate and up together) from which the rows are copied


def _persistent(a, weight, a_idx, scales, rows, up_offset=0) -> "bool | None":
    """B_KMAJOR for moe_grouped_tma_kernel (True: the (E, K, N') weight view is K-contiguous, nn.Linear's layout;
    False: N'-contiguous), or None where it does not apply: MXFP8 operands, 32-bit or unaligned operands, a GPU
    before Hopper, the CPU without the interpreter."""
    if not (PERSISTENT and GEMM_TMA) or scales == "mx" or a.dtype != weight.dtype:
        return None
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        return None
    if a_idx is None and a.stride(1) != 1 and a.shape[1] > 1:  # (a gathered copy is contiguous)
        return None
    if not tma_device(weight):
        return None
    k = weight.shape[1]
    if a_idx is None and a.shape[0] != rows:
        return None
    # A's rows: a gathered copy is contiguous (K elements a row); else a's own row stride
    if not (_aligned(a, k) if a_idx is not None else _aligned(a, a.stride(0))):
        return None
    if tma_weight(weight):
        return True
    s_e, s_k, s_n = weight.stride()
    e, _, n = weight.shape
    # (fp8 MMAs take B K-major; a box's first column must sit on 16 bytes: the up half's boxes start at column n)
    if a.dtype == torch.float8_e4m3fn or s_n != 1 or not _aligned(weight, s_e, s_k, up_offset):
        return None
    return False if s_k >= n and (s_e >= k * s_k or e == 1) else None


def wgrad_fp8(a, b, c, offs, *, a_idx=None, b_idx=None, scale=None):
    """c[e] = a[rows of e]^T @ b[rows of e] on fp8 operands: a's and b's rows (gathered by a_idx / b_idx, a's
    times `scale` per row) quantized per expert and column by quantize_segments_t (the transposed quantization
    along the tokens), the products dequantized in the epilogue. c (E, M, N) any strides."""
    aq, sa, poffs = quantize_segments_t(a, offs, a_idx, scale)
    bq, sb, _ = quantize_segments_t(b, offs, b_idx, poffs=poffs)
    _wgrad_fp8_gemm(aq, sa, bq, sb, poffs, c, a.shape[0] if a_idx is None else a_idx.shape[0])


def _wgrad_fp8_gemm(aq, sa, bq, sb, poffs, c, rows):
    """wgrad_fp8's GEMM on operands quantize_segments_t made (rows: the unpadded row count, for the tuning key)."""
    e, m, n = c.shape
    bucket = next_pow2(rows)
    grid = lambda meta: (e * cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    launch(moe_wgrad_fp8_kernel, grid, ("wgrad_fp8", bucket, m, n, e, c.dtype),
           aq, sa, aq.stride(0), bq, sb, bq.stride(0), c, c.stride(0), c.stride(1), c.stride(2),
           poffs, m, n, e, bucket)


def wgrad(a, b, c, offs, *, a_idx=None, b_idx=None, scale=None, precision=None):
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
