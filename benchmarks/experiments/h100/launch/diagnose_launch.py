"""Where does a small op's time go: CPU launch overhead per layer of the call stack, and each config's
kernel time. Prints a table; used to tune the launchers (see benchmarks/NOTES.md)."""

import sys
import time

import torch
import triton
from triton.testing import do_bench

import kernelkit
from kernelkit.ops import rms_norm as rn


def cpu_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    cpu = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return cpu


def main():
    dt = torch.bfloat16
    for m, n in [(4096, 4096), (16384, 4096), (8192, 8192)]:
        x = torch.randn(m, n, device="cuda", dtype=dt)
        w = torch.randn(n, device="cuda", dtype=dt)
        xg = x.clone().requires_grad_()
        wg = w.clone().requires_grad_()
        y, rstd, _ = rn.rms_norm_fwd(x, w, 1e-6)
        dy = torch.randn_like(x)
        out = kernelkit.rms_norm(xg, wg)
        print(f"--- {m}x{n}")
        jit0 = rn.rms_norm_fwd_kernel.fn
        bn0 = triton.next_power_of_2(n)
        for name, fn in [("raw jit launch", lambda: jit0[(m // 2,)](x, x, y, w, y, rstd, n, n, n, n, m, n, 1e-6, 0.0, HAS_WEIGHT=True, HAS_RESIDUAL=False,
                                                               BLOCK_N=bn0, ROWS=2, num_warps=8)),
                         ("launcher fwd", lambda: rn.rms_norm_fwd(x, w, 1e-6)),
                         ("custom op fwd", lambda: rn._rms_norm_op(x, w, 1e-6, 0.0)),
                         ("public fwd", lambda: kernelkit.rms_norm(x, w)),
                         ("public fwd (grad)", lambda: kernelkit.rms_norm(xg, wg)),
                         ("launcher bwd", lambda: rn.rms_norm_bwd(dy, x, w, rstd)),
                         ("autograd bwd", lambda: torch.autograd.grad(out, (xg, wg), dy, retain_graph=True))]:
            print(f"{name:20s} cpu {cpu_us(fn):7.1f} us   gpu(do_bench) {do_bench(fn, return_mode='median') * 1e3:8.1f} us")
        # every forward config, launched directly
        jit = rn.rms_norm_fwd_kernel.fn
        bn = triton.next_power_of_2(n)
        res = []
        for rows in (1, 2, 4, 8):
            for nw in (4, 8, 16, 32):
                f = lambda: jit[(triton.cdiv(m, rows),)](x, x, y, w, y, rstd, n, n, n, n, m, n, 1e-6, 0.0, HAS_WEIGHT=True, HAS_RESIDUAL=False,
                                                        BLOCK_N=bn, ROWS=rows, num_warps=nw)
                try:
                    res.append((do_bench(f, return_mode="median") * 1e3, rows, nw))
                except Exception as e:
                    print("cfg fail", rows, nw, e)
        res.sort()
        gb = 2 * m * n * 2 / 1e9
        print("fwd best configs (us, ROWS, warps, GB/s):", [(round(t, 1), r, w_, round(gb / (t * 1e-6))) for t, r, w_ in res[:5]])
        print("autotuned fwd pick:", rn.rms_norm_fwd_kernel.best_config if hasattr(rn.rms_norm_fwd_kernel, "best_config") else "?")
        jb = rn.rms_norm_bwd_kernel.fn
        dx = torch.empty_like(x)
        res = []
        sms = 132
        for per_sm in (1, 2, 4, 8):
            programs = min(m, sms * per_sm)
            part = torch.empty(programs, n, device="cuda", dtype=torch.float32)
            for rows in (1, 2, 4):
                for nw in (4, 8, 16):
                    f = lambda: jb[(programs,)](dy, x, w, rstd, dy, dx, part, n, n, n, n, m, n, 0.0, HAS_WEIGHT=True, HAS_DS=False,
                                               BLOCK_N=bn, ROWS=rows, num_warps=nw)
                    try:
                        res.append((do_bench(f, return_mode="median") * 1e3, per_sm, rows, nw))
                    except Exception as e:
                        print("cfg fail", rows, nw, e)
        res.sort()
        gb = 3 * m * n * 2 / 1e9
        print("bwd best (us, programs/SM, ROWS, warps, GB/s):", [(round(t, 1), p, r, w_, round(gb / (t * 1e-6))) for t, p, r, w_ in res[:6]])
        print("bwd worst:", [(round(t, 1), p, r, w_) for t, p, r, w_ in res[-3:]])
        print("autotuned bwd pick:", getattr(rn.rms_norm_bwd_kernel, "best_config", "?"))
        part = torch.empty(528, n, device="cuda", dtype=torch.float32)
        print(f"partial.sum(0) over (528, {n}) fp32: {do_bench(lambda: part.sum(0), return_mode='median') * 1e3:.1f} us")
        sys.stdout.flush()


def profile_launcher():
    import cProfile
    import pstats

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    rn.rms_norm_fwd(x, w, 1e-6)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(500):
        rn.rms_norm_fwd(x, w, 1e-6)
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
    profile_launcher()
