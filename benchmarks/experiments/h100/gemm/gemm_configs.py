"""Diagnose kernelkit.linear's GEMM on the GPU: every config of its autotune list launched directly (registers,
spills, TFLOP/s), the config the autotuner picks, the ladder's hgemm rungs with the same tiles, and cuBLAS,
side by side at a few bf16 shapes. Usage: python3 benchmarks/experiments/h100/gemm/gemm_configs.py [--out FILE.json]"""

import argparse
import json

import torch
import triton
from triton.testing import do_bench

import kernelkit
from kernelkit.testing.bench import env_fingerprint
from kernelkit.ops import linear as L


def tflops(m, n, k, ms):
    return 2 * m * n * k / ms / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    rows = []
    ap.add_argument("--pointer", action="store_true", help="also sweep the pointer kernel's configs")
    ap.add_argument("--shapes", default="4096x4096x4096,8192x4096x14336", help="comma-separated MxKxN")
    ap.add_argument("--group-m", default="8", help="comma-separated GROUP_M values for the TMA configs")
    ap.add_argument("--kmajor-only", action="store_true", help="TMA path: nn.Linear's weight layout only")
    args = ap.parse_args()
    group_ms = [int(g) for g in args.group_m.split(",")]
    for m, k, n in (tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref = x @ w.t()
        cublas = do_bench(lambda: torch.mm(x, w.t(), out=out), rep=200)
        rows.append({"shape": [m, k, n], "what": "cublas", "tflops": tflops(m, n, k, cublas)})
        print(f"{m}x{k}x{n} cuBLAS {tflops(m, n, k, cublas):.0f} TF/s", flush=True)
        w_kn = w.t().contiguous().t()  # the same values with W^T (K, N) row-major: N contiguous, not K
        for cfg, wl in [(c, wl) for c in L.linear_fwd_kernel.configs[1:] for wl in ("nn.Linear (N, K)", "(K, N)")
                        if args.pointer]:
            kw = dict(cfg.kwargs)
            grid = (triton.cdiv(m, kw["BLOCK_M"]) * triton.cdiv(n, kw["BLOCK_N"]),)
            ww = w if wl.startswith("nn") else w_kn
            if ww is w_kn and kw["BLOCK_M"] * kw["BLOCK_N"] < 128 * 128:
                continue

            def run():
                return L.linear_fwd_kernel.fn[grid](
                    x, ww, out, x, x, x.stride(0), x.stride(1), ww.stride(1), ww.stride(0), out.stride(0),
                    out.stride(1), 0, 0, 0, m, n, k, triton.next_power_of_2(m), 1.0, ACTIVATION=None,
                    HAS_BIAS=False, HAS_RESIDUAL=False, HAS_SCALE=False, INPUT_PRECISION=None,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, **kw)
            try:
                compiled = run()
                ms = do_bench(run, rep=200)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row = {"shape": [m, k, n], "what": "linear", "weight": wl, "config": str(cfg), "tflops": tflops(m, n, k, ms),
                       "regs": compiled.n_regs, "spills": compiled.n_spills, "err": err}
            except Exception as e:  # out of shared memory, etc.
                row = {"shape": [m, k, n], "what": "linear", "weight": wl, "config": str(cfg), "error": str(e)[:200]}
            rows.append(row)
            print(row, flush=True)
        # The TMA path (linear_tma_kernel): persistent, descriptors; both weight layouts.
        from kernelkit.tune import ensure_tma_allocator, num_sms
        ensure_tma_allocator()
        sms = num_sms(x.device)
        # Plus warp-specialized variants (tl.range(..., warp_specialize=True): Triton 3.6 runs a Hopper pass for it).
        extra = [triton.Config({**c.kwargs, "WARP_SPECIALIZE": True}, num_warps=c.num_warps, num_stages=c.num_stages)
                 for c in L.linear_tma_kernel.configs[1:5]]
        layouts = ("nn.Linear (N, K)",) if args.kmajor_only else ("nn.Linear (N, K)", "(K, N)")
        for cfg, wl, group_m in [(c, wl, gm) for c in L.linear_tma_kernel.configs[1:] + extra
                                 for wl in layouts for gm in group_ms]:
            kw = {**cfg.kwargs, "GROUP_M": group_m}
            kmajor = wl.startswith("nn")
            ww = w if kmajor else w_kn
            grid = (min(sms, triton.cdiv(m, kw["BLOCK_M"]) * triton.cdiv(n, kw["BLOCK_N"])),)

            def trun():
                return L.linear_tma_kernel.fn[grid](
                    x, ww, out, x, x, x.stride(0), ww.stride(0) if kmajor else ww.stride(1), out.stride(0),
                    0, 0, 0, m, n, k, triton.next_power_of_2(m), 1.0, NUM_SMS=sms, B_KMAJOR=kmajor,
                    ACTIVATION=None, HAS_BIAS=False, HAS_RESIDUAL=False, HAS_SCALE=False, INPUT_PRECISION=None,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, **kw)
            try:
                out.fill_(float("nan"))
                compiled = trun()
                ms = do_bench(trun, rep=200)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row = {"shape": [m, k, n], "what": "linear TMA", "weight": wl, "config": str(cfg), "group_m": group_m,
                       "tflops": tflops(m, n, k, ms), "regs": compiled.n_regs, "spills": compiled.n_spills, "err": err}
            except Exception as e:  # out of shared memory, etc.
                row = {"shape": [m, k, n], "what": "linear TMA", "weight": wl, "config": str(cfg), "group_m": group_m, "error": str(e)[:200]}
            rows.append(row)
            print(row, flush=True)
        y = kernelkit.matmul(x, w.t())  # through the autotuner
        ms = do_bench(lambda: kernelkit.matmul(x, w.t()), rep=200)
        best = getattr(L.linear_tma_kernel, "best_config", None) or getattr(L.linear_fwd_kernel, "best_config", None)
        rows.append({"shape": [m, k, n], "what": "kernelkit.matmul (autotuned)", "tflops": tflops(m, n, k, ms),
                     "best_config": str(best), "err": ((y.float() - ref.float()).norm() / ref.float().norm()).item()})
        print(rows[-1], flush=True)
        c = torch.empty_like(out)
        from kernelkit.ladder import hgemm
        for name, p, b in (("ladder wide_tiles, B (K, N) row-major", hgemm._WIDE, w.t().contiguous()),
                           ("ladder wide_tiles, B = nn.Linear weight.t()", hgemm._WIDE, w.t())):
            meta = {q: p[q] for q in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
            grid = (triton.cdiv(m, p["BLOCK_M"]) * triton.cdiv(n, p["BLOCK_N"]),)

            def lrun():
                return hgemm.hgemm_kernel[grid](x, b, c, m, n, k, x.stride(0), x.stride(1), b.stride(0), b.stride(1),
                                                c.stride(0), c.stride(1), num_warps=p["num_warps"],
                                                num_stages=p["num_stages"], **meta)
            compiled = lrun()
            ms = do_bench(lrun, rep=200)
            rows.append({"shape": [m, k, n], "what": name, "config": str(p), "tflops": tflops(m, n, k, ms),
                         "regs": compiled.n_regs, "spills": compiled.n_spills})
            print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env_fingerprint(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
