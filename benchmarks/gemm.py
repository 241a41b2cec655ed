"""kernelkit's GEMM (kernelkit.matmul / kernelkit.linear with fused epilogues) against cuBLAS, side by side in
one process (GPU).

    PYTHONPATH=src python benchmarks/gemm.py --out gemm.json [--quick]

Rows per shape (M, K, N), bf16 inputs, fp32 accumulation, bf16 output:
  matmul            kernelkit.matmul(a, b)                     vs torch.mm (cuBLAS) and torch.compile(torch.mm)
  linear+bias+gelu  kernelkit.linear(x, w, b, "gelu")          vs F.gelu(F.linear(x, w, b)) and its torch.compile
  +residual         kernelkit.linear(x, w, b, "gelu", residual) vs F.gelu(F.linear(x, w, b)) + r and its compile
Each: triton.testing.do_bench median (L2 flushed before every run: do_bench's default), TFLOP/s of the 2·M·N·K
GEMM FLOPs, the ratio to the cuBLAS/eager row of the same shape, and the max relative error of kernelkit's
output against the eager result (both bf16 rounding of an fp32-accumulated product). Autotuning (the first
call at each shape) is excluded from the timings and reported as its own column. Results go to --out as
JSON, rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import kernelkit

SQUARES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 16384)]
LLM = [(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096), (8192, 4096, 128256)]
EPILOGUE = [(8192, 4096, 4096), (8192, 4096, 14336)]


def tflops(m, k, n, ms):
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def max_rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def timed(fn, rep):
    return do_bench(fn, rep=rep, return_mode="median")


def case(kind, m, k, n, rep):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    b = 0.1 * torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
    wt = w.t()  # matmul's b: (K, N) through strides, as a model's x @ W.T
    if kind == "matmul":
        ours = lambda: kernelkit.matmul(x, wt)  # noqa: E731
        eager = lambda: torch.mm(x, wt)  # noqa: E731
    elif kind == "linear+bias+gelu":
        ours = lambda: kernelkit.linear(x, w, b, "gelu")  # noqa: E731
        eager = lambda: F.gelu(F.linear(x, w, b))  # noqa: E731
    else:
        ours = lambda: kernelkit.linear(x, w, b, "gelu", residual=r)  # noqa: E731
        eager = lambda: F.gelu(F.linear(x, w, b)) + r  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(eager)
    t = time.perf_counter()
    got = ours()
    torch.cuda.synchronize()
    tune_s = time.perf_counter() - t
    want = eager()
    err = max_rel(got, want)
    del got, want
    row = {"kind": kind, "shape": [m, k, n], "tune_s": round(tune_s, 2), "max_rel_err_vs_eager": err}
    for name, fn in (("kernelkit", ours), ("eager", eager), ("torch.compile", compiled)):
        try:
            fn()
            ms = timed(fn, rep)
            row[name] = {"ms": ms, "tflops": tflops(m, k, n, ms)}
        except Exception as e:  # noqa: BLE001 - a row that fails says why instead of ending the run
            row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    base = row["eager"].get("ms")
    for name in ("kernelkit", "torch.compile"):
        if "ms" in row[name] and base:
            row[name]["x_eager"] = base / row[name]["ms"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gemm.json")
    ap.add_argument("--quick", action="store_true", help="4096³ and two LLM shapes only")
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    a = ap.parse_args()
    plan = [("matmul", s) for s in (SQUARES[:1] + LLM[:2] if a.quick else SQUARES + LLM)]
    plan += [(kind, s) for kind in ("linear+bias+gelu", "linear+bias+gelu+residual")
             for s in (EPILOGUE[:1] if a.quick else EPILOGUE)]
    # An idle H100 sits at ~345 MHz and ramps up under load: the first timed row read 582 TF/s at 4096^3 after
    # idling and 728 in a warm run. Two seconds of GEMMs first, so every row (and the tuning) sees full clocks.
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + 2.0
    while time.perf_counter() < end:
        for _ in range(20):
            warm @ warm
        torch.cuda.synchronize()
    del warm
    rows = []
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "dtype": "bfloat16"}
    for i, (kind, (m, k, n)) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {kind} M={m} K={k} N={n} ...", flush=True)
        row = case(kind, m, k, n, a.rep)
        rows.append(row)
        parts = [f"{name} " + (f"{row[name]['tflops']:.0f} TF/s" if "tflops" in row[name] else row[name]["error"])
                 for name in ("kernelkit", "eager", "torch.compile")]
        ratio = row["kernelkit"].get("x_eager")
        print(f"    {' | '.join(parts)} | kernelkit/eager {ratio:.2f}x | tune {row['tune_s']} s | "
              f"err {row['max_rel_err_vs_eager']:.1e}" if ratio else "    " + " | ".join(parts), flush=True)
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
