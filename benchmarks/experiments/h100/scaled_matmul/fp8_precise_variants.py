"""Why is kernelkit's precise fp8 GEMM (use_fast_accum=False) at 0.67-0.78x torch._scaled_mm? Ways of promoting
the tensor cores' partial sums to fp32, side by side in one process on the GPU, each with its error over a
long K and its speed at two shapes, next to torch._scaled_mm in both modes.

Hopper's fp8 MMA accumulates in fewer bits than fp32 (DeepSeek-V3: ~14), so a precise GEMM adds each K tile's
partial product to an fp32 accumulator on the CUDA cores. The variants differ in how, and how often:
  fast        tl.dot(a, b, acc): the tensor cores accumulate across all of K (the reference for speed)
  tile        acc += tl.dot(a, b) * scale: a promotion per 128-deep K tile (kernelkit's current kernel)
  imprecise   tl.dot(a, b, acc, max_num_imprecise_acc=P): Triton's own split accumulation, promoted every P of K
  pair        two K tiles chained on the tensor cores, then promoted: every 256 of K (half the adds)
  lagged      the tile's product is added one iteration late, so the add can overlap the next tile's MMA
Each runs persistent with 1 or 2 programs per SM (2: one program's adds under the other's MMAs).

Usage: python3 benchmarks/experiments/h100/scaled_matmul/fp8_precise_variants.py [--out FILE.json] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

from kernelkit.testing.bench import env_fingerprint
from kernelkit.ops import scaled_matmul as S
from kernelkit.ops._gemm import grouped_tile
from kernelkit.tune import ensure_tma_allocator, interpreting


@triton.jit
def fp8_variant_kernel(A, B, C, SA, SB, M, N, K, stride_am, stride_bn, stride_cm,
                       NUM_PROGRAMS, VARIANT: tl.constexpr, PROMOTE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(B, shape=[N, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, BLOCK_N])
    sa = tl.load(SA)
    sb = tl.load(SB)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = grouped_tile(tile, grid_m, grid_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if VARIANT == "pair":
            for k0 in range(0, K, 2 * BLOCK_K):  # the second tile past K reads TMA's zeros
                p = tl.dot(a_desc.load([m0, k0]), b_desc.load([n0, k0]).T)
                p = tl.dot(a_desc.load([m0, k0 + BLOCK_K]), b_desc.load([n0, k0 + BLOCK_K]).T, p)
                acc += p * sa
        elif VARIANT == "lagged":
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                new = tl.dot(a_desc.load([m0, k0]), b_desc.load([n0, k0]).T)
                acc += part * sa
                part = new
            acc += part * sa
        else:
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([m0, k0])
                b = b_desc.load([n0, k0]).T
                if VARIANT == "fast":
                    acc = tl.dot(a, b, acc)
                elif VARIANT == "imprecise":
                    acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE)
                else:  # "tile"
                    acc += tl.dot(a, b) * sa
        if VARIANT == "fast" or VARIANT == "imprecise":
            acc = acc * (sa * sb)
        else:
            acc = acc * sb
        c_desc.store([m0, n0], acc.to(C.dtype.element_ty))


VARIANTS = [("fast", 0), ("tile", 0), ("imprecise", 128), ("imprecise", 64), ("pair", 0), ("lagged", 0)]
TILES = [(128, 256, 128, 3, 8), (128, 128, 128, 4, 8), (128, 128, 128, 3, 8), (64, 256, 128, 4, 8),
         (64, 128, 128, 4, 4), (128, 128, 128, 4, 4)]


def quantize(x: torch.Tensor):
    """Tensorwise e4m3 (scaled_matmul's quantizer), the scale as a 0-d tensor."""
    q, scale = S.quantize(x, (0, 0))
    return q, scale.reshape(())


def run_variant(a, w, sa, sb, out, variant, promote, tile, per_sm, sms):
    bm, bn, bk, stages, warps = tile
    m, k = a.shape
    n = w.shape[0]
    programs = min(per_sm * sms, triton.cdiv(m, bm) * triton.cdiv(n, bn))
    return fp8_variant_kernel[(programs,)](a, w, out, sa, sb, m, n, k, a.stride(0), w.stride(0), out.stride(0),
                                           NUM_PROGRAMS=programs, VARIANT=variant, PROMOTE=promote, BLOCK_M=bm,
                                           BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_stages=stages, num_warps=warps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="one shape, fewer tiles")
    args = ap.parse_args()
    dev = "cpu" if interpreting() else "cuda"
    if dev == "cuda":
        ensure_tma_allocator()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
    else:
        sms = 2
    from triton.testing import do_bench
    rows = []
    # Precision over a long K (as tests/test_scaled_matmul.py's check): error against float64.
    if dev == "cuda":
        long_shapes = [(128, 16384, 256)]
        shapes = [(4096, 4096, 4096), (8192, 4096, 14336)] if not args.quick else [(4096, 4096, 4096)]
        tiles = TILES if not args.quick else TILES[:3]
    else:
        long_shapes = [(32, 512, 48)]
        shapes = []
        tiles = [(32, 32, 128, 2, 4)]
    g = torch.Generator(device=dev).manual_seed(0)
    for m, k, n in long_shapes:
        a, sa = quantize(torch.randn(m, k, generator=g, device=dev))
        w, sb = quantize(torch.randn(n, k, generator=g, device=dev))
        exact = (a.double() * sa.double()) @ (w.double() * sb.double()).t()
        out = torch.empty(m, n, device=dev, dtype=torch.float32)
        for fast in (False, True):
            if dev == "cuda":
                try:
                    ref = torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.float32, use_fast_accum=fast)
                    err = ((ref.double() - exact).norm() / exact.norm()).item()
                except Exception as e:
                    err = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                rows.append({"what": "precision", "impl": f"torch._scaled_mm fast={fast}", "shape": [m, k, n],
                             "rel_err": err})
                print(rows[-1], flush=True)
        for (variant, promote), tile in itertools.product(VARIANTS, tiles[1:2] or tiles[:1]):
            row = {"what": "precision", "impl": f"{variant}{promote or ''}", "shape": [m, k, n], "tile": list(tile)}
            try:
                out.fill_(float("nan"))
                run_variant(a, w, sa, sb, out, variant, promote, tile, 1, sms)
                row["rel_err"] = ((out.double() - exact).norm() / exact.norm()).item()
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.append(row)
            print(row, flush=True)
    for m, k, n in shapes:
        a, sa = quantize(torch.randn(m, k, device=dev))
        w, sb = quantize(torch.randn(n, k, device=dev))
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        tf = lambda ms: 2 * m * n * k / ms / 1e9  # noqa: E731
        ref = torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16)
        for fast in (False, True):
            ms = do_bench(lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast),
                          rep=200, return_mode="median")
            rows.append({"what": "speed", "impl": f"torch._scaled_mm fast={fast}", "shape": [m, k, n], "tflops": tf(ms)})
            print(rows[-1], flush=True)
        for (variant, promote), tile, per_sm in itertools.product(VARIANTS, tiles, (1, 2)):
            row = {"what": "speed", "impl": f"{variant}{promote or ''}", "shape": [m, k, n], "tile": list(tile),
                   "per_sm": per_sm}
            try:
                out.fill_(float("nan"))
                compiled = run_variant(a, w, sa, sb, out, variant, promote, tile, per_sm, sms)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = do_bench(lambda: run_variant(a, w, sa, sb, out, variant, promote, tile, per_sm, sms), rep=100,
                              return_mode="median")
                row.update(tflops=tf(ms), regs=compiled.n_regs, spills=compiled.n_spills, err_vs_torch=err)
            except Exception as e:  # out of shared memory or registers
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.append(row)
            print(row, flush=True)
    best = {}
    for r in rows:
        if r["what"] == "speed" and "tflops" in r and r.get("err_vs_torch", 0) < 1e-2:
            key = (tuple(r["shape"]), r["impl"])
            if key not in best or r["tflops"] > best[key]["tflops"]:
                best[key] = r
    print("\nbest per variant (TFLOP/s):")
    for (shape, impl), r in sorted(best.items()):
        print(f"  {shape} {impl:28s} {r['tflops']:7.0f}  {r.get('tile', '')} x{r.get('per_sm', '')}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env_fingerprint(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
