"""The Gluon precise fp8 kernel (kernelkit/ops/scaled_matmul_precise.py) on the GPU: checked against float64 and
torch._scaled_mm at odd shapes, then timed next to torch._scaled_mm (precise and fast) and kernelkit's Triton
kernel, per pipeline depth.
Usage: python3 benchmarks/experiments/h100/scaled_matmul/fp8_gluon_bench.py [--out FILE.json]"""

import argparse
import json

import torch
from triton.testing import do_bench

from kernelkit.testing.bench import env_fingerprint
from kernelkit.ops import scaled_matmul as S
from kernelkit.ops import scaled_matmul_precise as P
from kernelkit.tune import num_sms


def operands(m, k, n, rowwise, gen):
    """e4m3 a (M, K) and b = w.t() with rowwise ((M, 1), (1, N)) or tensorwise (0-d) scales (scaled_matmul's
    quantizer)."""
    block = (1, 0) if rowwise else (0, 0)
    a, sa = S.quantize(torch.randn(m, k, device="cuda", generator=gen), block)
    w, sw = S.quantize(torch.randn(n, k, device="cuda", generator=gen), block)
    return (a, w.t(), sa, sw.t()) if rowwise else (a, w.t(), sa.reshape(()), sw.reshape(()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = num_sms(torch.device("cuda"))
    rows, failures = [], 0
    for m, k, n, rowwise, bias, out_dtype in ((1, 128, 64, False, False, torch.float32),
                                              (37, 272, 200, True, True, torch.bfloat16),
                                              (300, 400, 136, True, False, torch.float32),
                                              (257, 4112, 392, False, True, torch.float16),
                                              (128, 16384, 256, True, False, torch.float32),
                                              (1000, 1536, 1032, True, True, torch.bfloat16)):
        a, b, sa, sb = operands(m, k, n, rowwise, gen)
        bvec = torch.randn(n, device="cuda", generator=gen) if bias else None
        out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
        P.launch_precise(a, b, out, sa, sb, bvec, (int(rowwise), sa.stride(0) if rowwise else 0, 0, False),
                         (int(rowwise), sb.stride(1) if rowwise else 0, 0, False), sms)
        exact = (a.double() * sa.double()) @ (b.double() * sb.double())
        if bias:
            exact += bvec.double()
        try:  # torch's own error bounds ours (it may refuse some scale / output combinations)
            ref = torch._scaled_mm(a, b, sa, sb, bias=bvec.to(out_dtype) if bias else None, out_dtype=out_dtype)
            err_torch = ((ref.double() - exact).norm() / exact.norm()).item()
        except Exception:  # noqa: BLE001
            err_torch = None
        err = ((out.double() - exact).norm() / exact.norm()).item()
        rounding = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}[out_dtype]
        ok = bool(torch.isfinite(out).all()) and err <= max(2 * (err_torch or 0), 3e-4 + rounding)
        failures += not ok
        rows.append({"what": "check", "shape": [m, k, n], "rowwise": rowwise, "bias": bias, "out": str(out_dtype),
                     "rel_err": err, "torch_rel_err": err_torch, "ok": ok})
        print(rows[-1], flush=True)
    for m, k, n in ((4096, 4096, 4096), (8192, 4096, 14336)):
        a, b, sa, sb = operands(m, k, n, False, gen)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        tf = lambda ms: 2 * m * n * k / ms / 1e9  # noqa: E731
        impls = {"torch precise": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16),
                 "torch fast": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True),
                 "kernelkit triton precise": lambda: S.scaled_matmul_fwd(a, b, sa, sb)}
        for stages in (3, 4, 5):
            impls[f"gluon precise, {stages} stages"] = (
                lambda st=stages: P.launch_precise(a, b, out, sa, sb, None, (0, 0, 0, False), (0, 0, 0, False), sms,
                                                   stages=st))
        for name, fn in impls.items():
            try:
                fn()
                ms = do_bench(fn, rep=200, return_mode="median")
                rows.append({"what": "speed", "shape": [m, k, n], "impl": name, "tflops": tf(ms)})
            except Exception as e:  # noqa: BLE001
                rows.append({"what": "speed", "shape": [m, k, n], "impl": name, "error": str(e)[:300]})
            print(rows[-1], flush=True)
    # Block scales through kernelkit.scaled_matmul (the Gluon kernel): which part of the per-K-tile scaling costs.
    m, k, n = 8192, 4096, 14336
    kb = k // 128
    a, b, sa_t, sb_t = operands(m, k, n, False, gen)
    out_ms = {}
    scale_sets = {
        "tensorwise": (sa_t, sb_t),
        "1x128 (col-major) + 128x128": (torch.rand(kb, m, device="cuda").t() + 0.5, torch.rand(kb, n // 128, device="cuda") + 0.5),
        "1x128 (row-major) + 128x128": (torch.rand(m, kb, device="cuda") + 0.5, torch.rand(kb, n // 128, device="cuda") + 0.5),
        "128x128 + 128x128": (torch.rand(m // 128, kb, device="cuda") + 0.5, torch.rand(kb, n // 128, device="cuda") + 0.5),
        "1x128 + 128x1": (torch.rand(kb, m, device="cuda").t() + 0.5, torch.rand(kb, n, device="cuda") + 0.5),
    }
    for name, (sa, sb) in scale_sets.items():
        fn = lambda: S.scaled_matmul(a, b, sa, sb)  # noqa: E731
        fn()
        ms = do_bench(fn, rep=200, return_mode="median")
        rows.append({"what": "block scales", "shape": [m, k, n], "impl": name, "tflops": 2 * m * n * k / ms / 1e9})
        print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env_fingerprint(), "rows": rows}, f, indent=1)
    print("checks failed:", failures)


if __name__ == "__main__":
    main()
