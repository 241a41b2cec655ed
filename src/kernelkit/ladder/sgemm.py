"""The fp32 ladder: SGEMM on the CUDA cores, C = A @ B, row-major, in CUDA C compiled at run time.

Each rung is a short CUDA source (read it: the comments are the lesson), its #define parameters and its launch
geometry. The sources are compiled when first used, through NVRTC (`nvrtc.py`: CuPy or cuda-python): no build
step, and no --use_fast_math.

Shapes: the first three rungs guard every access and take any M, N, K. From `blocktile_1d` on, a block owns a
BM x BN tile of C and steps through K by BK: those rungs need M % BM == N % BN == K % BK == 0 (and say so through
`needs`), which keeps the lessons free of edge cases. Indices are 32-bit: fine below 2^31 elements per matrix.

Peak fp32 on an H100 SXM: 132 SMs x 128 FMA lanes x 2 FLOPs x ~1.98 GHz = ~67 TFLOP/s; cuBLAS's SGEMM (no TF32)
reaches ~51. Each rung removes the bottleneck the previous one's profile shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from . import nvrtc
from .rung import Launch, Rung

NAIVE = r"""
// Rung 1. One thread per element of C: the dot product of a row of A and a column of B.
// threadIdx.x walks the ROWS of C, so the 32 threads of a warp read A at 32 addresses K floats apart
// (32 sectors for one load instruction) and all read the same element of B (a broadcast, 1 sector).
// Nothing is reused on chip: every product re-reads its operands from L2 or DRAM.
extern "C" __global__ void sgemm_naive(const float* A, const float* B, float* C, int M, int N, int K) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    const int col = blockIdx.y * blockDim.y + threadIdx.y;
    if (row >= M || col >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += A[row * K + k] * B[k * N + col];
    C[row * N + col] = acc;
}
"""

COALESCED = r"""
// Rung 2. The same arithmetic; only the thread-to-output map changes. threadIdx.x now walks COLUMNS:
// a warp reads 32 consecutive floats of a row of B (128 bytes: 4 sectors, the minimum) and one element
// of A (broadcast), and writes 32 consecutive floats of C. Same instructions, a fraction of the traffic.
extern "C" __global__ void sgemm_coalesced(const float* A, const float* B, float* C, int M, int N, int K) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    const int row = blockIdx.y * blockDim.y + threadIdx.y;
    if (row >= M || col >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += A[row * K + k] * B[k * N + col];
    C[row * N + col] = acc;
}
"""

SMEM = r"""
// Rung 3. Shared-memory tiling. A block of TILE x TILE threads stages a TILE x TILE tile of A and one of B
// in shared memory, then every thread reads TILE values from each: each element fetched from global
// memory now serves TILE products instead of one. Two barriers per step: the first so nobody reads a tile
// before it is complete, the second so nobody overwrites it while others still read it.
// The inner loop is now one FMA per two shared loads: shared memory, not DRAM, is the next limit.
extern "C" __global__ void sgemm_smem(const float* A, const float* B, float* C, int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        As[ty][tx] = (row < M && k0 + tx < K) ? A[row * K + k0 + tx] : 0.0f;  // zeros past the edges
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(k0 + ty) * N + col] : 0.0f;
        __syncthreads();
        for (int k = 0; k < TILE; ++k) acc += As[ty][k] * Bs[k][tx];  // As: broadcast; Bs: 32 banks
        __syncthreads();
    }
    if (row < M && col < N) C[row * N + col] = acc;
}
"""

BLOCKTILE_1D = r"""
// Rung 4. 1-D blocktiling: each thread computes TM outputs down a column of a BM x BN block tile.
// The B value it reads from shared memory is reused TM times from a register, so the inner loop does
// TM FMAs for TM + 1 shared loads instead of 1 for 2. More work per thread, fewer threads per output.
extern "C" __global__ void __launch_bounds__((BM / TM) * BN)
sgemm_blocktile_1d(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                   int M, int N, int K) {
    static_assert(BM * BK == (BM / TM) * BN && BK * BN == (BM / TM) * BN, "one element of each tile per thread");
    __shared__ float As[BM][BK];
    __shared__ float Bs[BK][BN];
    const int tid = threadIdx.x;
    const int tcol = tid % BN, trow = tid / BN;  // outputs: column tcol, rows trow*TM .. trow*TM+TM-1
    A += blockIdx.y * BM * K;  // this block's rows of A, columns of B, tile of C
    B += blockIdx.x * BN;
    C += blockIdx.y * BM * N + blockIdx.x * BN;
    float acc[TM] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
        As[tid / BK][tid % BK] = A[(tid / BK) * K + tid % BK];
        Bs[tid / BN][tid % BN] = B[(tid / BN) * N + tid % BN];
        __syncthreads();
        A += BK;
        B += BK * N;
        #pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float b = Bs[k][tcol];  // one shared load, reused TM times
            #pragma unroll
            for (int i = 0; i < TM; ++i) acc[i] += As[trow * TM + i][k] * b;  // As: a warp shares trow: broadcast
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < TM; ++i) C[(trow * TM + i) * N + tcol] = acc[i];
}
"""

BLOCKTILE_2D = r"""
// Rung 5. 2-D blocktiling: each thread computes a TM x TN patch of C from TM values of A and TN of B held
// in registers: TM + TN shared loads feed TM * TN FMAs (16 for 64 here). The tiles are loaded by a strided
// loop since they now hold more elements than the block has threads.
// The B fragment is read at TN-float strides across the warp: 4-way shared bank conflicts (the profile shows).
extern "C" __global__ void __launch_bounds__((BM / TM) * (BN / TN))
sgemm_blocktile_2d(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                   int M, int N, int K) {
    constexpr int THREADS = (BM / TM) * (BN / TN);
    __shared__ float As[BM][BK];
    __shared__ float Bs[BK][BN];
    const int tid = threadIdx.x;
    const int trow = tid / (BN / TN), tcol = tid % (BN / TN);
    A += blockIdx.y * BM * K;
    B += blockIdx.x * BN;
    C += blockIdx.y * BM * N + blockIdx.x * BN;
    float acc[TM][TN] = {};
    float a_frag[TM], b_frag[TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int i = tid; i < BM * BK; i += THREADS) As[i / BK][i % BK] = A[(i / BK) * K + i % BK];
        for (int i = tid; i < BK * BN; i += THREADS) Bs[i / BN][i % BN] = B[(i / BN) * N + i % BN];
        __syncthreads();
        A += BK;
        B += BK * N;
        #pragma unroll
        for (int k = 0; k < BK; ++k) {
            #pragma unroll
            for (int m = 0; m < TM; ++m) a_frag[m] = As[trow * TM + m][k];
            #pragma unroll
            for (int n = 0; n < TN; ++n) b_frag[n] = Bs[k][tcol * TN + n];
            #pragma unroll
            for (int m = 0; m < TM; ++m)
                #pragma unroll
                for (int n = 0; n < TN; ++n) acc[m][n] += a_frag[m] * b_frag[n];
        }
        __syncthreads();
    }
    #pragma unroll
    for (int m = 0; m < TM; ++m)
        #pragma unroll
        for (int n = 0; n < TN; ++n) C[(trow * TM + m) * N + tcol * TN + n] = acc[m][n];
}
"""

VECTORIZED = r"""
// Rung 6. Vectorized: 16-byte loads and stores (float4) everywhere. Global loads move 512 bytes per warp
// instruction instead of 128, a quarter of the load instructions. A is stored TRANSPOSED in shared memory
// (As[k][m]) so a thread's TM values of A are contiguous and load as float4 (LDS.128) too; the transposing
// scalar stores cost some store bank conflicts, far fewer accesses than the loads they save.
// Needs K % 4 == N % 4 == 0 and 16-byte aligned rows (implied by the tile multiples).
extern "C" __global__ void __launch_bounds__((BM / TM) * (BN / TN))
KERNEL_NAME(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    constexpr int THREADS = (BM / TM) * (BN / TN);
    static_assert(BK % 4 == 0 && TM % 4 == 0 && TN % 4 == 0, "float4 granules");
    __shared__ __align__(16) float As[BK][BM];
    __shared__ __align__(16) float Bs[BK][BN];
    const int tid = threadIdx.x;
    const int trow = tid / (BN / TN), tcol = tid % (BN / TN);
    A += blockIdx.y * BM * K;
    B += blockIdx.x * BN;
    C += blockIdx.y * BM * N + blockIdx.x * BN;
    float acc[TM][TN] = {};
    float a_frag[TM], b_frag[TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int i = tid; i < BM * BK / 4; i += THREADS) {
            const int r = i / (BK / 4), c = (i % (BK / 4)) * 4;
            const float4 v = *reinterpret_cast<const float4*>(&A[r * K + c]);
            As[c + 0][r] = v.x;  // the transpose
            As[c + 1][r] = v.y;
            As[c + 2][r] = v.z;
            As[c + 3][r] = v.w;
        }
        for (int i = tid; i < BK * BN / 4; i += THREADS) {
            const int r = i / (BN / 4), c = (i % (BN / 4)) * 4;
            *reinterpret_cast<float4*>(&Bs[r][c]) = *reinterpret_cast<const float4*>(&B[r * N + c]);
        }
        __syncthreads();
        A += BK;
        B += BK * N;
        #pragma unroll
        for (int k = 0; k < BK; ++k) {
            #pragma unroll
            for (int m = 0; m < TM; m += 4) {
                const float4 v = *reinterpret_cast<const float4*>(&As[k][trow * TM + m]);
                a_frag[m] = v.x; a_frag[m + 1] = v.y; a_frag[m + 2] = v.z; a_frag[m + 3] = v.w;
            }
            #pragma unroll
            for (int n = 0; n < TN; n += 4) {
                const float4 v = *reinterpret_cast<const float4*>(&Bs[k][tcol * TN + n]);
                b_frag[n] = v.x; b_frag[n + 1] = v.y; b_frag[n + 2] = v.z; b_frag[n + 3] = v.w;
            }
            #pragma unroll
            for (int m = 0; m < TM; ++m)
                #pragma unroll
                for (int n = 0; n < TN; ++n) acc[m][n] += a_frag[m] * b_frag[n];
        }
        __syncthreads();
    }
    #pragma unroll
    for (int m = 0; m < TM; ++m)
        #pragma unroll
        for (int n = 0; n < TN; n += 4)
            *reinterpret_cast<float4*>(&C[(trow * TM + m) * N + tcol * TN + n]) =
                make_float4(acc[m][n], acc[m][n + 1], acc[m][n + 2], acc[m][n + 3]);
}
"""

# Warptiling and double buffering share the warp-level index math: a block tile BM x BN is split among warps
# (warp tiles WM x WN), a warp tile into WMITER x WNITER sub-tiles, and each of a warp's 32 lanes owns a TM x TN
# patch of every sub-tile.
_WARP_MATH = r"""
#define WARP 32
#define WMITER ((WM * WN) / (WARP * TM * TN * WNITER))
#define WSUBM (WM / WMITER)
#define WSUBN (WN / WNITER)
"""

WARPTILING = _WARP_MATH + r"""
// Rung 8. Warptiling: a level between block and thread. Each warp owns a WM x WN warp tile; its 32 lanes
// sweep WMITER x WNITER sub-tiles, each lane a TM x TN patch of each. Neighbouring lanes read neighbouring
// float4s of the B fragment (no bank conflicts: 4 lanes x 16 B contiguous, the 8 lane rows broadcast), the
// warp's shared reads stay within a small window, and a thread's registers hold WMITER*TM x WNITER*TN
// accumulators: more independent FMAs to hide latency with, from fewer threads (THREADS = 4 warps here).
extern "C" __global__ void __launch_bounds__(THREADS)
sgemm_warptiling(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K) {
    static_assert((BM / WM) * (BN / WN) * WARP == THREADS, "one warp per warp tile");
    static_assert((WSUBM / TM) * (WSUBN / TN) == WARP, "the 32 lanes tile one warp sub-tile");
    __shared__ __align__(16) float As[BK][BM];
    __shared__ __align__(16) float Bs[BK][BN];
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    const int warp_row = warp / (BN / WN), warp_col = warp % (BN / WN);
    const int lane_row = lane / (WSUBN / TN), lane_col = lane % (WSUBN / TN);
    A += blockIdx.y * BM * K;
    B += blockIdx.x * BN;
    C += (blockIdx.y * BM + warp_row * WM) * N + blockIdx.x * BN + warp_col * WN;
    float acc[WMITER * TM][WNITER * TN] = {};
    float a_frag[WMITER * TM], b_frag[WNITER * TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        #pragma unroll
        for (int i = tid; i < BM * BK / 4; i += THREADS) {
            const int r = i / (BK / 4), c = (i % (BK / 4)) * 4;
            const float4 v = *reinterpret_cast<const float4*>(&A[r * K + c]);
            As[c + 0][r] = v.x; As[c + 1][r] = v.y; As[c + 2][r] = v.z; As[c + 3][r] = v.w;
        }
        #pragma unroll
        for (int i = tid; i < BK * BN / 4; i += THREADS) {
            const int r = i / (BN / 4), c = (i % (BN / 4)) * 4;
            *reinterpret_cast<float4*>(&Bs[r][c]) = *reinterpret_cast<const float4*>(&B[r * N + c]);
        }
        __syncthreads();
        A += BK;
        B += BK * N;
        #pragma unroll
        for (int k = 0; k < BK; ++k) {
            #pragma unroll
            for (int wm = 0; wm < WMITER; ++wm)
                #pragma unroll
                for (int m = 0; m < TM; m += 4) {
                    const float4 v = *reinterpret_cast<const float4*>(
                        &As[k][warp_row * WM + wm * WSUBM + lane_row * TM + m]);
                    float* f = &a_frag[wm * TM + m];
                    f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
                }
            #pragma unroll
            for (int wn = 0; wn < WNITER; ++wn)
                #pragma unroll
                for (int n = 0; n < TN; n += 4) {
                    const float4 v = *reinterpret_cast<const float4*>(
                        &Bs[k][warp_col * WN + wn * WSUBN + lane_col * TN + n]);
                    float* f = &b_frag[wn * TN + n];
                    f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
                }
            #pragma unroll
            for (int m = 0; m < WMITER * TM; ++m)
                #pragma unroll
                for (int n = 0; n < WNITER * TN; ++n) acc[m][n] += a_frag[m] * b_frag[n];
        }
        __syncthreads();
    }
    #pragma unroll
    for (int wm = 0; wm < WMITER; ++wm)
        #pragma unroll
        for (int m = 0; m < TM; ++m)
            #pragma unroll
            for (int wn = 0; wn < WNITER; ++wn)
                #pragma unroll
                for (int n = 0; n < TN; n += 4) {
                    const float* a = &acc[wm * TM + m][wn * TN + n];
                    const int row = wm * WSUBM + lane_row * TM + m, col = wn * WSUBN + lane_col * TN + n;
                    *reinterpret_cast<float4*>(&C[row * N + col]) = make_float4(a[0], a[1], a[2], a[3]);
                }
}
"""

DOUBLE_BUFFERED = _WARP_MATH + r"""
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1  // blocks per SM that ptxas must fit in the registers (__launch_bounds__' second argument)
#endif
#define A_LOADS (BM * BK / 4 / THREADS)  // float4s of the A tile each thread loads
#define B_LOADS (BK * BN / 4 / THREADS)
#define A_PAD 4  // floats of padding after each row of the transposed A tile (see store_tiles)

// Rung 9. Double buffering: warptiling with two shared-memory buffers. While the warps run the FMAs of
// tile t from one buffer, the global loads of tile t+1 are already in flight into registers (a_stage,
// b_stage); after the FMAs they go to the other buffer. Memory latency hides behind arithmetic, and one
// barrier per tile suffices: a buffer is rewritten only after the barrier that ends its last reading.
__device__ __forceinline__ void load_tiles(const float* A, const float* B, int K, int N, int tid,
                                           float4 (&a)[A_LOADS], float4 (&b)[B_LOADS]) {
    #pragma unroll
    for (int i = 0; i < A_LOADS; ++i) {
        const int idx = tid + i * THREADS, r = idx / (BK / 4), c = (idx % (BK / 4)) * 4;
        a[i] = *reinterpret_cast<const float4*>(&A[r * K + c]);
    }
    #pragma unroll
    for (int i = 0; i < B_LOADS; ++i) {
        const int idx = tid + i * THREADS, r = idx / (BN / 4), c = (idx % (BN / 4)) * 4;
        b[i] = *reinterpret_cast<const float4*>(&B[r * N + c]);
    }
}

// The transposing stores of A: a warp's 32 lanes hold float4s of 32 / (BK / 4) rows of A and write them down
// columns of As. Unpadded (BM a multiple of 32 floats), the lanes holding k = 0..3 and those holding k = 4..7
// hit the same banks: every scalar store a 2-way conflict at BK = 8 (4-way at BK = 16, the warptiling rung's
// 5e7 store conflicts). A_PAD = 4 floats shifts each row of As by 4 banks, so k and k + 4 land 16 banks apart:
// no conflict at BK = 8, 2-way at BK = 16. Rows stay 16-byte aligned for the float4 reads of the fragments.
__device__ __forceinline__ void store_tiles(float (&As)[BK][BM + A_PAD], float (&Bs)[BK][BN], int tid,
                                            const float4 (&a)[A_LOADS], const float4 (&b)[B_LOADS]) {
    #pragma unroll
    for (int i = 0; i < A_LOADS; ++i) {
        const int idx = tid + i * THREADS, r = idx / (BK / 4), c = (idx % (BK / 4)) * 4;
        As[c + 0][r] = a[i].x; As[c + 1][r] = a[i].y; As[c + 2][r] = a[i].z; As[c + 3][r] = a[i].w;
    }
    #pragma unroll
    for (int i = 0; i < B_LOADS; ++i) {
        const int idx = tid + i * THREADS, r = idx / (BN / 4), c = (idx % (BN / 4)) * 4;
        *reinterpret_cast<float4*>(&Bs[r][c]) = b[i];
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
sgemm_double_buffered(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                      int M, int N, int K) {
    static_assert((BM / WM) * (BN / WN) * WARP == THREADS, "one warp per warp tile");
    static_assert((WSUBM / TM) * (WSUBN / TN) == WARP, "the 32 lanes tile one warp sub-tile");
    static_assert(A_LOADS * THREADS * 4 == BM * BK && B_LOADS * THREADS * 4 == BK * BN, "whole float4s per thread");
    static_assert(2 * BK * (BM + A_PAD + BN) * 4 <= 48 * 1024, "static shared memory: 48 KB at most");
    __shared__ __align__(16) float As[2][BK][BM + A_PAD];
    __shared__ __align__(16) float Bs[2][BK][BN];
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;
    const int warp_row = warp / (BN / WN), warp_col = warp % (BN / WN);
    const int lane_row = lane / (WSUBN / TN), lane_col = lane % (WSUBN / TN);
    A += blockIdx.y * BM * K;
    B += blockIdx.x * BN;
    C += (blockIdx.y * BM + warp_row * WM) * N + blockIdx.x * BN + warp_col * WN;
    float4 a_stage[A_LOADS], b_stage[B_LOADS];
    float acc[WMITER * TM][WNITER * TN] = {};
    float a_frag[WMITER * TM], b_frag[WNITER * TN];

    load_tiles(A, B, K, N, tid, a_stage, b_stage);  // the prologue: tile 0 into buffer 0
    store_tiles(As[0], Bs[0], tid, a_stage, b_stage);
    __syncthreads();
    const int tiles = K / BK;
    for (int t = 0; t < tiles; ++t) {
        const int cur = t & 1;
        if (t + 1 < tiles) load_tiles(A + (t + 1) * BK, B + (t + 1) * BK * N, K, N, tid, a_stage, b_stage);
        #pragma unroll
        for (int k = 0; k < BK; ++k) {
            #pragma unroll
            for (int wm = 0; wm < WMITER; ++wm)
                #pragma unroll
                for (int m = 0; m < TM; m += 4) {
                    const float4 v = *reinterpret_cast<const float4*>(
                        &As[cur][k][warp_row * WM + wm * WSUBM + lane_row * TM + m]);
                    float* f = &a_frag[wm * TM + m];
                    f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
                }
            #pragma unroll
            for (int wn = 0; wn < WNITER; ++wn)
                #pragma unroll
                for (int n = 0; n < TN; n += 4) {
                    const float4 v = *reinterpret_cast<const float4*>(
                        &Bs[cur][k][warp_col * WN + wn * WSUBN + lane_col * TN + n]);
                    float* f = &b_frag[wn * TN + n];
                    f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
                }
            #pragma unroll
            for (int m = 0; m < WMITER * TM; ++m)
                #pragma unroll
                for (int n = 0; n < WNITER * TN; ++n) acc[m][n] += a_frag[m] * b_frag[n];
        }
        if (t + 1 < tiles) store_tiles(As[cur ^ 1], Bs[cur ^ 1], tid, a_stage, b_stage);
        __syncthreads();
    }
    #pragma unroll
    for (int wm = 0; wm < WMITER; ++wm)
        #pragma unroll
        for (int m = 0; m < TM; ++m)
            #pragma unroll
            for (int wn = 0; wn < WNITER; ++wn)
                #pragma unroll
                for (int n = 0; n < TN; n += 4) {
                    const float* a = &acc[wm * TM + m][wn * TN + n];
                    const int row = wm * WSUBM + lane_row * TM + m, col = wn * WSUBN + lane_col * TN + n;
                    *reinterpret_cast<float4*>(&C[row * N + col]) = make_float4(a[0], a[1], a[2], a[3]);
                }
}
"""


# --- rungs: source, parameters, launch geometry ---

def _tile_2d(p: dict) -> tuple:  # one thread per TM x TN patch of a BM x BN block tile
    return ((p["BM"] // p["TM"]) * (p["BN"] // p["TN"]), 1, 1)


@dataclass(frozen=True)
class CudaRung:
    name: str
    what_changed: str
    expect: str
    source: str
    kernel: str
    params: dict  # the #defines the source reads (the first configuration when `sweep` is set)
    block: Callable[[dict], tuple]
    grid: Callable[[dict, int, int], tuple]  # (params, M, N) -> blocks
    tiled: bool = True  # needs M % BM == N % BN == K % BK == 0
    sweep: tuple = ()  # more parameter sets to time; the rung keeps the fastest

    def code(self, params: dict) -> str:
        """The CUDA source as compiled: the parameters as #defines, then the rung's source."""
        defines = {"KERNEL_NAME": self.kernel, **params}
        return "".join(f"#define {k} {v}\n" for k, v in defines.items()) + self.source

    def configs(self) -> list[dict]:
        return [self.params, *self.sweep]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_GUARDED = dict(block=lambda p: (32, 32, 1), tiled=False)
# Warp tiles: 4 warps of 64 x 64 in a 128 x 128 block tile; each lane 8 x 4 outputs in each of 4 sub-tiles.
_W = {"THREADS": 128, "BM": 128, "BN": 128, "BK": 16, "WM": 64, "WN": 64, "WNITER": 4, "TM": 8, "TN": 4}

CUDA_RUNGS = [
    CudaRung("naive", "one thread per output; a warp walks down a column of C",
             "global loads ~16 sectors/request (A: 32 rows per warp, B: a broadcast); top stall lg_throttle or "
             "long_scoreboard; FMA pipe near 0",
             NAIVE, "sgemm_naive", {}, grid=lambda p, m, n: (_cdiv(m, 32), _cdiv(n, 32), 1), **_GUARDED),
    CudaRung("coalesced", "a warp walks along a row of C: consecutive threads, consecutive addresses",
             "global loads ~2.5 sectors/request (B: 4, A: broadcast 1), stores 4; still long_scoreboard-bound",
             COALESCED, "sgemm_coalesced", {}, grid=lambda p, m, n: (_cdiv(n, 32), _cdiv(m, 32), 1), **_GUARDED),
    CudaRung("smem", "32x32 tiles of A and B staged in shared memory, each global read reused 32 times",
             "DRAM throughput falls; no shared bank conflicts (As broadcast, Bs across the 32 banks); top stall "
             "mio_throttle or barrier: the shared-memory pipe is the limit now",
             SMEM, "sgemm_smem", {"TILE": 32}, block=lambda p: (p["TILE"], p["TILE"], 1),
             grid=lambda p, m, n: (_cdiv(n, p["TILE"]), _cdiv(m, p["TILE"]), 1), tiled=False),
    CudaRung("blocktile_1d", "each thread computes 8 outputs down a column (64x64 block tile)",
             "registers per thread up, shared loads per FMA down (9 per 8); FMA pipe rises; stall shifts from "
             "mio_throttle toward long_scoreboard and barrier",
             BLOCKTILE_1D, "sgemm_blocktile_1d", {"BM": 64, "BN": 64, "BK": 8, "TM": 8},
             block=lambda p: ((p["BM"] // p["TM"]) * p["BN"], 1, 1),
             grid=lambda p, m, n: (n // p["BN"], m // p["BM"], 1)),
    CudaRung("blocktile_2d", "each thread computes an 8x8 patch from registers (128x128 block tile)",
             "~128 registers per thread, lower occupancy; 16 shared loads per 64 FMAs; 4-way bank conflicts on "
             "the B fragment reads (l1tex data bank conflicts, ld)",
             BLOCKTILE_2D, "sgemm_blocktile_2d", {"BM": 128, "BN": 128, "BK": 8, "TM": 8, "TN": 8},
             block=_tile_2d, grid=lambda p, m, n: (n // p["BN"], m // p["BM"], 1)),
    CudaRung("vectorized", "float4 global and shared accesses; A transposed in shared memory",
             "global loads 16 sectors/request (512 B per warp instruction: a quarter of the instructions); "
             "a quarter of the shared load instructions; store bank conflicts from the transpose",
             VECTORIZED, "sgemm_vectorized", {"BM": 128, "BN": 128, "BK": 8, "TM": 8, "TN": 8},
             block=_tile_2d, grid=lambda p, m, n: (n // p["BN"], m // p["BM"], 1)),
    # Rung 7 writes no new CUDA: the vectorized source is compiled once per parameter set (#define prefixes, one
    # NVRTC module each), every set is timed on this GPU at this shape, and the fastest is kept. Which tile wins
    # depends on the SM count (how many blocks fill the waves), registers and shared memory per SM.
    CudaRung("autotuned", "the vectorized kernel at the fastest of 6 tile shapes, timed on this GPU",
             "compare registers/thread and achieved occupancy with the vectorized rung: the winner trades them "
             "differently on each GPU",
             VECTORIZED, "sgemm_autotuned", {"BM": 128, "BN": 128, "BK": 16, "TM": 8, "TN": 8},
             block=_tile_2d, grid=lambda p, m, n: (n // p["BN"], m // p["BM"], 1),
             sweep=({"BM": 128, "BN": 128, "BK": 8, "TM": 8, "TN": 8},
                    {"BM": 64, "BN": 128, "BK": 16, "TM": 8, "TN": 8},
                    {"BM": 128, "BN": 64, "BK": 16, "TM": 8, "TN": 8},
                    {"BM": 128, "BN": 256, "BK": 16, "TM": 8, "TN": 8},
                    {"BM": 256, "BN": 128, "BK": 16, "TM": 8, "TN": 8})),
    CudaRung("warptiling", "warps own 64x64 warp tiles; each lane 8x16 outputs over 4 sub-tiles; 4 warps/block",
             "no shared load bank conflicts; FMA pipe utilization up; top stall moves toward math_pipe_throttle "
             "or wait (the FMA pipe is the limit: good)",
             WARPTILING, "sgemm_warptiling", _W,
             block=lambda p: (p["THREADS"], 1, 1), grid=lambda p, m, n: (n // p["BN"], m // p["BM"], 1)),
    CudaRung("double_buffered", "two shared buffers: the next tile's loads fly while the FMAs run; 1 barrier "
                                "per tile; A's rows padded (no store bank conflicts); best of 10 warp-tile shapes",
             "barrier and long_scoreboard stalls fall; shared store bank conflicts ~0 at BK=8 (warptiling: 5e7); FMA "
             "pipe utilization the highest of the ladder (the ceiling for this design); DRAM throughput low",
             DOUBLE_BUFFERED, "sgemm_double_buffered", _W,
             block=lambda p: (p["THREADS"], 1, 1), grid=lambda p, m, n: (n // p["BN"], m // p["BM"], 1),
             # On the H100 at 4096^3 the sweep's first entry won before A was padded (45.5 TF/s, 87.5% of cuBLAS):
             # 127 registers, 2 blocks of 8 warps per SM, FMA pipe 71%; cuBLAS: FMA 80% at 254 registers, 8 warps
             # per SM. The other entries trade differently: a lane's 8x8 outputs as one patch (TN=8), or warps of
             # 32x64; 8x16 outputs per lane (6 shared loads per 128 FMAs instead of 4 per 64) in 128x256 or 256x128
             # tiles of 8 warps, or 128x128 of 4 warps (2 blocks per SM); 128x64 tiles in 4 blocks of 4 warps (a
             # barrier waits for 4 warps, not 8). MIN_BLOCKS caps the registers so that many blocks fit
             # (65536 / (THREADS x MIN_BLOCKS)); nvcc -Xptxas -v shows no spills for any entry (the test checks).
             sweep=(dict(_W, THREADS=256, BK=8, WN=32, WNITER=2, MIN_BLOCKS=2),  # 128 registers: 2 blocks per SM
                    dict(_W, THREADS=256, BK=8, WN=32, WNITER=1, TN=8, MIN_BLOCKS=2),
                    dict(_W, THREADS=256, BK=8, WM=32, WN=64, WNITER=2, MIN_BLOCKS=2),
                    dict(_W, THREADS=256, WN=32, WNITER=2),
                    dict(_W, THREADS=256, BN=256, BK=8),
                    dict(_W, THREADS=256, BM=256, BK=8),
                    dict(_W, BK=8),
                    dict(_W, BN=64, BK=8, WN=32, WNITER=2, MIN_BLOCKS=4),
                    dict(_W, BM=64, WM=32, WNITER=2, MIN_BLOCKS=3))),
]


def shape_problem(rung: CudaRung, params: dict, m: int, n: int, k: int) -> Optional[str]:
    """Why `rung` at `params` cannot run M x N x K, or None."""
    if max(m * k, k * n, m * n) >= 2**31:
        return "32-bit indices: each matrix must have fewer than 2^31 elements"
    if rung.tiled and (m % params["BM"] or n % params["BN"] or k % params["BK"]):
        return f"needs M % {params['BM']} == N % {params['BN']} == K % {params['BK']} == 0"
    return None


# --- binding a rung to its tensors ---

def _bind(rung: CudaRung, params: dict, a, b, c) -> Callable[[], None]:
    m, k = a.shape
    n = b.shape[1]
    bind = nvrtc.binder(rung.code(params), rung.kernel, a.device.index or 0)
    return bind(rung.grid(params, m, n), rung.block(params), a, b, c, m, n, k)


def _check_operands(a, b, c) -> None:
    import torch

    for t, name in ((a, "a"), (b, "b"), (c, "c")):
        if t.dtype != torch.float32 or not t.is_cuda or not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be a contiguous, 16-byte aligned float32 CUDA tensor")
    if a.shape[1] != b.shape[0] or tuple(c.shape) != (a.shape[0], b.shape[1]):
        raise ValueError(f"shapes do not chain: a {tuple(a.shape)} @ b {tuple(b.shape)} -> c {tuple(c.shape)}")


_best: dict = {}  # (rung, M, N, K, device) -> the fastest parameters of a rung with a sweep


def build(rung: CudaRung, a, b, c, params: Optional[dict] = None) -> Launch:
    """Compile (once) and bind `rung` to a (M, K), b (K, N), c (M, N). With params=None a rung with a sweep times
    each of its configurations that fit the shape on these tensors and keeps the fastest."""
    _check_operands(a, b, c)
    m, k = a.shape
    n = b.shape[1]
    if params is None:
        fits = [p for p in rung.configs() if shape_problem(rung, p, m, n, k) is None]
        if len(fits) > 1:
            key = (rung.name, m, n, k, a.device.index)
            if key not in _best:
                from triton.testing import do_bench

                _best[key] = min(fits, key=lambda p: do_bench(_bind(rung, p, a, b, c), warmup=5, rep=20))
            params = _best[key]
        else:
            params = fits[0] if fits else rung.params
    problem = shape_problem(rung, params, m, n, k)
    if problem:
        raise ValueError(f"sgemm {rung.name}: {problem} (got M={m}, N={n}, K={k})")
    return Launch(_bind(rung, params, a, b, c), dict(params))


def _as_rung(r: CudaRung) -> Rung:
    def needs(m, n, k):
        problems = [shape_problem(r, p, m, n, k) for p in r.configs()]
        return None if any(p is None for p in problems) else problems[0]

    return Rung(r.name, r.what_changed, r.expect, r.kernel,
                build=lambda a, b, c, params=None: build(r, a, b, c, params), needs=needs)


RUNGS = [_as_rung(r) for r in CUDA_RUNGS]
