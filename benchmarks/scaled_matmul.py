"""kernelkit.scaled_matmul (fp8 GEMM, tensorwise / rowwise / DeepSeek-V3 block scales) against cuBLAS, side by side
in one process (GPU).

    PYTHONPATH=src python benchmarks/scaled_matmul.py --out sm.json [--quick] [--extra fast,pointers,rowmajor]
    PYTHONPATH=src python benchmarks/scaled_matmul.py --scale-forms --out forms.json [--extra fast]

Rows per shape (M, K, N), float8_e4m3fn operands (a row-major, b = w.t() column-major), bf16 output, no bias:
  torch.mm bf16                the same GEMM in bf16 on cuBLAS, for reference
  torch._scaled_mm tensorwise  cuBLAS fp8, one scale per operand           (use_fast_accum=False, torch's default)
  torch._scaled_mm rowwise     cuBLAS fp8, (M, 1) and (1, N) scales
  torch._scaled_mm blockwise   cuBLAS fp8, 1x128 / 128x128 scales (where this torch and cuBLAS have it)
  kernelkit tensorwise / rowwise / blockwise   the same calls through kernelkit.scaled_matmul
--extra adds: fast (both libraries with use_fast_accum=True, tensorwise and rowwise), pointers (kernelkit with TMA
off: masked pointer loads), rowmajor (kernelkit blockwise with scale_a row-major (M, K/128) instead of
column-major; column-major, unit stride along M, is what cuBLAS and DeepGEMM take and loads coalesced).

Each row: triton.testing.do_bench median (L2 flushed before every run: do_bench's default), TFLOP/s of the
2·M·N·K FLOPs, % of the datasheet fp8 dense peak, the ratio to torch._scaled_mm of the same recipe (blockwise:
to torch's tensorwise, the target being >= 0.9x, and to torch's blockwise where it runs), and the error of the
output against the float64 product of the dequantized operands on 256 sampled rows: max |err| / max |ref| and
the relative norm. Autotuning (the first call of each kernelkit row) is excluded from the timings and reported
as tune_s. Results go to --out as JSON, rewritten after every row.

--scale-forms times one tensorwise scale in each spelling that means it: 0-dim (torch.tensor(1.0), as torch's docs
write it), (1,) and (1, 1), beside rowwise, through kernelkit and torch._scaled_mm, at 4096^3 and Llama-3-8B's
MLP GEMMs (8192 tokens: 4096 -> 14336 and 14336 -> 4096). The tensorwise forms share operands and scale values.
Each row adds: the kernel kernelkit launched (gluon: the warp-specialized precise kernel; triton: its Triton
kernel, with the autotuner's key), whether the output has the same bits as the 0-dim form's, host_us (median CPU
time for one call to return, queue empty: the launch path's host cost) and back_to_back_us (wall time per call
of calls issued back to back, one sync at the end, no L2 flush: above the GPU time when the call is host-bound).
Two rounds, the second in reverse order, so that a slow first measurement shows as one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

import kernelkit
from kernelkit.hw import lookup
from kernelkit.ops import scaled_matmul as S
from kernelkit.runtime import chosen_configs

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096)]
QUICK = [(4096, 4096, 4096), (8192, 4096, 14336)]
# (a's quantization block, w's) per recipe: 0 is the whole dim; w is (N, K) and b = w.t().
RECIPES = {"tensorwise": ((0, 0), (0, 0)), "rowwise": ((1, 0), (1, 0)), "blockwise": ((1, 128), (128, 128))}
SAMPLE_ROWS = 256
# --scale-forms: each spelling of a tensorwise scale (its shape; None: rowwise instead), and the shapes (M, K, N).
SCALE_FORMS = {"0-dim": (), "(1,)": (1,), "(1, 1)": (1, 1), "rowwise": None}
FORM_SHAPES = [(4096, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096)]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_ms(fn, rep, device):
    """do_bench's median (L2 flushed) on the GPU; on the CPU (a smoke test of the script) a plain median."""
    if device == "cuda":
        return do_bench(fn, rep=rep, return_mode="median")
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def tflops(m, k, n, ms):
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def operands(m, k, n, recipe, gen):
    """x (M, K) ~ N(0, 1) and w (N, K) ~ N(0, 1/K), quantized per recipe: (a, b, scale_a, scale_b)."""
    x = torch.randn(m, k, device=gen.device, generator=gen)
    w = torch.randn(n, k, device=gen.device, generator=gen) / k ** 0.5
    a_block, w_block = RECIPES[recipe]
    a, sa = S.quantize(x, a_block)
    wq, sw = S.quantize(w, w_block)
    if recipe == "tensorwise":
        sa, sw = sa.reshape(()), sw.reshape(())
    elif recipe == "blockwise":
        sa = sa.t().contiguous().t()  # (M, K/128) with unit stride along M
    return a, wq.t(), sa, sw.t()


def errors(out, a, b, sa, sb, rows):
    """(max |err| / max |ref|, relative norm) of out[rows] against the float64 dequantized product."""
    sa_rows = sa[rows] if sa.dim() == 2 and sa.shape[0] == a.shape[0] else sa
    want = S.reference(a[rows].double(), b.double(), sa_rows, sb)
    got = out[rows].double()
    return (float((got - want).abs().max() / want.abs().max()), float((got - want).norm() / want.norm()))


def torch_blockwise(a, b, sa, sb):
    """torch._scaled_mm with 1x128 / 128x128 scales, in the first scale layouts this torch and cuBLAS take; a
    callable that raises why not where none works."""
    last = None
    for sa_try, sb_try in ((sa, sb), (sa.contiguous(), sb.contiguous()), (sa, sb.contiguous()),
                           (sa.contiguous(), sb.t().contiguous().t())):
        fn = lambda sa_try=sa_try, sb_try=sb_try: torch._scaled_mm(a, b, sa_try, sb_try,  # noqa: E731
                                                                   out_dtype=torch.bfloat16)
        try:
            fn()
            return fn
        except (RuntimeError, ValueError) as e:  # torch raises either for a recipe or layout it lacks
            last = e

    def unavailable():
        raise last

    return unavailable


def case(m, k, n, extras, rep, peak, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(0)
    rows = torch.randperm(m, device=device, generator=gen)[:SAMPLE_ROWS]
    ops = {r: operands(m, k, n, r, gen) for r in RECIPES}
    x16 = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    w16 = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen)

    plan = [("torch.mm bf16", None, lambda: torch.mm(x16, w16.t()))]
    for recipe in ("tensorwise", "rowwise"):
        a, b, sa, sb = ops[recipe]
        plan.append((f"torch._scaled_mm {recipe}", recipe,
                     lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)))
    plan.append(("torch._scaled_mm blockwise", "blockwise", torch_blockwise(*ops["blockwise"])))
    for recipe in RECIPES:
        a, b, sa, sb = ops[recipe]
        plan.append((f"kernelkit {recipe}", recipe,
                     lambda a=a, b=b, sa=sa, sb=sb: kernelkit.scaled_matmul(a, b, sa, sb)))
    if "fast" in extras:
        for recipe in ("tensorwise", "rowwise"):
            a, b, sa, sb = ops[recipe]
            plan.append((f"torch._scaled_mm {recipe} fast", recipe, lambda a=a, b=b, sa=sa, sb=sb: torch._scaled_mm(
                a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)))
            plan.append((f"kernelkit {recipe} fast", recipe, lambda a=a, b=b, sa=sa, sb=sb: kernelkit.scaled_matmul(
                a, b, sa, sb, use_fast_accum=True)))
    if "pointers" in extras:
        def no_tma(fn):
            def run():
                S.USE_TMA = False
                try:
                    return fn()
                finally:
                    S.USE_TMA = None
            return run

        for recipe in RECIPES:
            a, b, sa, sb = ops[recipe]
            plan.append((f"kernelkit {recipe} pointers", recipe,
                         no_tma(lambda a=a, b=b, sa=sa, sb=sb: kernelkit.scaled_matmul(a, b, sa, sb))))
    if "rowmajor" in extras:
        a, b, sa, sb = ops["blockwise"]
        sa_rm = sa.contiguous()
        plan.append(("kernelkit blockwise scale_a row-major", "blockwise",
                     lambda: kernelkit.scaled_matmul(a, b, sa_rm, sb)))

    out_rows = []
    for name, recipe, fn in plan:
        row = {"shape": [m, k, n], "impl": name, "recipe": recipe}
        try:
            sync()
            t = time.perf_counter()
            out = fn()  # kernelkit: autotunes here; torch: warms up
            sync()
            row["tune_s"] = round(time.perf_counter() - t, 2)
            if recipe is not None:
                row["max_rel_err"], row["norm_rel_err"] = errors(out, *ops[recipe], rows)
            del out
            ms = bench_ms(fn, rep, device)
            row.update(ms=ms, tflops=tflops(m, k, n, ms))
            if peak:
                row["pct_fp8_peak"] = 100.0 * row["tflops"] / peak
        except Exception as e:  # noqa: BLE001 - a row that fails says why instead of ending the run
            row["error"] = f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
        out_rows.append(row)
        yield row
    # Ratios, once every row of the shape has its time.
    ms = {r["impl"]: r["ms"] for r in out_rows if "ms" in r}
    for r in out_rows:
        if "ms" not in r or not r["impl"].startswith("kernelkit"):
            continue
        fast = " fast" if r["impl"].endswith(" fast") else ""
        anchors = {"tensorwise": [f"torch._scaled_mm tensorwise{fast}"],
                   "rowwise": [f"torch._scaled_mm rowwise{fast}"],
                   "blockwise": ["torch._scaled_mm tensorwise", "torch._scaled_mm blockwise", "kernelkit tensorwise"]}
        for anchor in anchors[r["recipe"]]:
            if anchor in ms:
                r[f"x_{anchor.replace(' ', '_')}"] = ms[anchor] / r["ms"]


def which_launch(fn):
    """(fn(), what kernelkit launched for it): "gluon fp8_precise_kernel", "triton scaled_matmul_kernel <autotune
    key>", or "cuBLAS" where kernelkit launched nothing (torch's rows)."""
    seen = []
    real_launch, real_precise = S.launch, S._precise.launch_precise if S._precise is not None else None

    def launch(kernel, grid, key, *args, **kwargs):
        seen.append(f"triton scaled_matmul_kernel {key!r}")
        return real_launch(kernel, grid, key, *args, **kwargs)

    def precise(*args, **kwargs):
        seen.append("gluon fp8_precise_kernel")
        return real_precise(*args, **kwargs)

    S.launch = launch
    if real_precise is not None:
        S._precise.launch_precise = precise
    try:
        out = fn()
    finally:
        S.launch = real_launch
        if real_precise is not None:
            S._precise.launch_precise = real_precise
    return out, "; ".join(seen) or "cuBLAS"


def host_us(fn, calls=30):
    """Median CPU time for one call to return, each issued onto an empty queue: the launch path's host cost."""
    times = []
    for _ in range(calls):
        sync()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    sync()
    return 1e6 * statistics.median(times)


def back_to_back_us(fn, ms):
    """Wall time per call of ~50 ms of calls issued back to back, one sync at the end (no L2 flush): the larger of
    the GPU time and the host time per call."""
    calls = max(10, min(500, int(50 / max(ms, 1e-3))))
    sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return 1e6 * (time.perf_counter() - t) / calls


def forms_case(m, k, n, extras, rep, peak, device="cuda", rounds=2):
    """Rows of --scale-forms for one shape (see the module docstring)."""
    gen = torch.Generator(device=device).manual_seed(0)
    rows = torch.randperm(m, device=device, generator=gen)[:SAMPLE_ROWS]
    a, b, sa, sb = operands(m, k, n, "tensorwise", gen)
    ops = {form: (a, b, sa.reshape(shape), sb.reshape(shape)) for form, shape in SCALE_FORMS.items()
           if shape is not None}
    ops["rowwise"] = operands(m, k, n, "rowwise", gen)

    def call(impl, form, fast):
        a_, b_, sa_, sb_ = ops[form]
        if impl == "kernelkit":
            return lambda: kernelkit.scaled_matmul(a_, b_, sa_, sb_, use_fast_accum=fast)
        return lambda: torch._scaled_mm(a_, b_, sa_, sb_, out_dtype=torch.bfloat16, use_fast_accum=fast)

    # 0-dim first: the other forms' outputs are compared with its.
    plan = [(impl, form, fast, call(impl, form, fast)) for fast in ((False, True) if "fast" in extras else (False,))
            for form in SCALE_FORMS for impl in ("torch._scaled_mm", "kernelkit")]
    zero_dim = {}  # (impl, fast) -> the 0-dim form's output
    out_rows = []
    for rnd in range(1, rounds + 1):
        for impl, form, fast, fn in plan if rnd % 2 else plan[::-1]:
            label = f"{impl} {form}{' fast' if fast else ''} r{rnd}"
            row = {"shape": [m, k, n], "impl": impl, "form": form, "use_fast_accum": fast, "round": rnd,
                   "recipe": "rowwise" if form == "rowwise" else "tensorwise", "label": label}
            try:
                sync()
                t = time.perf_counter()
                out, row["launch"] = which_launch(fn)  # kernelkit's first call autotunes / compiles here
                sync()
                row["tune_s"] = round(time.perf_counter() - t, 2)
                if rnd == 1:
                    row["max_rel_err"], row["norm_rel_err"] = errors(out, *ops[form], rows)
                    if form == "0-dim":
                        zero_dim[impl, fast] = out
                    elif form != "rowwise" and (impl, fast) in zero_dim:
                        row["same_bits_as_0dim"] = bool(torch.equal(out, zero_dim[impl, fast]))
                del out
                ms = bench_ms(fn, rep, device)
                row.update(ms=ms, tflops=tflops(m, k, n, ms), host_us=host_us(fn),
                           back_to_back_us=back_to_back_us(fn, ms))
                if peak:
                    row["pct_fp8_peak"] = 100.0 * row["tflops"] / peak
            except Exception as e:  # noqa: BLE001 - a row that fails says why instead of ending the run
                row["error"] = f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
            out_rows.append(row)
            yield row
    zero_dim.clear()
    ms = {(r["impl"], r["form"], r["use_fast_accum"], r["round"]): r["ms"] for r in out_rows if "ms" in r}
    for r in out_rows:
        if r["impl"] == "kernelkit" and "ms" in r:
            torch_ms = ms.get(("torch._scaled_mm", r["form"], r["use_fast_accum"], r["round"]))
            if torch_ms is not None:
                r["x_torch._scaled_mm_same_form"] = torch_ms / r["ms"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="scaled_matmul.json")
    ap.add_argument("--quick", action="store_true", help="4096³ and 8192x4096x14336 only")
    ap.add_argument("--extra", default="", help="comma-separated optional rows: fast, pointers, rowmajor")
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    ap.add_argument("--shapes", default="", help="comma-separated MxKxN instead of the default shapes")
    ap.add_argument("--device", default="cuda", help="cuda; cpu (TRITON_INTERPRET=1) only to smoke-test the script")
    ap.add_argument("--scale-forms", action="store_true",
                    help="tensorwise scales as 0-dim, (1,) and (1, 1) beside rowwise, kernelkit and torch side by side")
    ap.add_argument("--rounds", type=int, default=2, help="--scale-forms: rounds (even ones in reverse order)")
    args = ap.parse_args()
    extras = set(filter(None, args.extra.split(",")))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    spec = lookup(device_name)
    peak = spec.tflops.get("fp8") if spec else None
    meta = {"gpu": device_name, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "fp8_peak_tflops_datasheet": peak, "operands": "float8_e4m3fn",
            "out_dtype": "bfloat16", "timing": f"triton.testing.do_bench median, rep={args.rep} ms, L2 flushed",
            "error": f"vs float64 dequantized product on {SAMPLE_ROWS} sampled rows"}
    doc = {"meta": meta, "rows": []}
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else (
        FORM_SHAPES[:1] if args.scale_forms and args.quick else FORM_SHAPES if args.scale_forms
        else QUICK if args.quick else SHAPES)
    if args.scale_forms:
        meta["mode"] = "scale-forms"
        meta["host_timing"] = "host_us: median CPU time of one call on an empty queue; back_to_back_us: wall per call"
    t0 = time.time()
    for i, (m, k, n) in enumerate(shapes, 1):
        print(f"[{i}/{len(shapes)}] M={m} K={k} N={n}", flush=True)
        rows = []
        timed = (forms_case(m, k, n, extras, args.rep, peak, args.device, args.rounds) if args.scale_forms
                 else case(m, k, n, extras, args.rep, peak, args.device))
        for row in timed:
            rows.append(row)
            doc["rows"].append(row)
            if "ms" in row:
                err = (f" | err max {row['max_rel_err']:.1e} norm {row['norm_rel_err']:.1e}"
                       if "max_rel_err" in row else "")
                pct = f" ({row['pct_fp8_peak']:.0f}% fp8 peak)" if "pct_fp8_peak" in row else ""
                host = (f" | host {row['host_us']:.0f} us, back to back {row['back_to_back_us']:.0f} us"
                        if "host_us" in row else "")
                launch = f" | {row['launch'][:40]}" if "launch" in row else ""
                print(f"    {row.get('label', row['impl']):40s} {row['ms']:8.3f} ms {row['tflops']:7.0f} TF/s{pct} | "
                      f"first call {row['tune_s']} s{err}{host}{launch}", flush=True)
            else:
                print(f"    {row.get('label', row['impl']):40s} {row['error']}", flush=True)
            Path(args.out).write_text(json.dumps(doc, indent=1))
        for row in rows:  # ratios are set once the shape's rows are all timed
            ratios = " ".join(f"{k_[2:]} {v:.2f}x" for k_, v in row.items() if k_.startswith("x_"))
            if ratios:
                print(f"    {row.get('label', row['impl']):40s} {ratios}", flush=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    meta["elapsed_s"] = round(time.time() - t0, 1)
    meta["tuned_configs"] = chosen_configs()
    Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
