"""The fp8 Linears' input quantization done once (issue 30 item 2), measured on the GPU.

    PYTHONPATH=src python benchmarks/fp8_fusion.py --out fp8_fusion.json [--part norm|swiglu|dy|step|all] [--steps 5]

(a) `norm`: RMSNorm writing its output's e4m3 rows in its pass (`rms_norm_fp8`) against the pair it replaces
    (`rms_norm`, then `quantize_rows` of its output), `rms_norm` alone (the bf16 path's norm), and torch.compile of
    the torch definitions of the pair (inductor fuses what it can); forward only, triton.testing.do_bench medians
    (L2 flushed), GB/s of the ideal bytes of the fused op (x and w read once, y, q and the row scales written once)
    and % of the copy ceiling (measured with --measure-ceiling, else the datasheet's).
(b) `swiglu`: SwiGLU writing its output's e4m3 rows (`swiglu_fp8`, the down projection's operand) against
    `swiglu` then `quantize_rows`, `swiglu` alone and torch.compile of the torch pair; ideal bytes: gate and up
    read, h, q and the row scales written.
(c) `dy`: an fp8 Linear's output gradient quantized both ways (`quantize_rows_and_cols_t`: two reads of dy) against
    `quantize_rows` then `quantize_cols_t` (four reads) and torch.compile of the two references; ideal bytes: dy
    read once, both e4m3 copies and their scales written.
(d) `lmhead`: the fused LM head and loss (`linear_cross_entropy`), forward + backward, at the 8B step's (8192 tokens x
    4096 -> 128256) and the 1B step's (16384 x 2048 -> 128256) shapes: precision="fp8" with dlogits' e4m3 rows
    written by the cross-entropy kernel (KERNELKIT_FP8_CE_FUSE=1) and with a quantize_rows pass (=0), precision
    "bf16", and torch.compile of F.linear + F.cross_entropy in bf16; do_bench medians, TFLOP/s of the three GEMMs
    (6 T H V), and the quantization kernels' ms per call (torch.profiler).
(e) `step`: the Llama-3-8B-shaped training step of `kernelkit bench model` (2 layers, 4 x 2048 tokens), patched
    with precision="fp8", eager and + torch.compile, with the sharing, the fused norm and SwiGLU and dy's two-read
    quantization (KERNELKIT_FP8_FUSE=1, KERNELKIT_FP8_DY_ONE_READ=1)
    and without (=0): ms per step, kernels per step and the quantization kernels' ms (torch.profiler over two
    steps), peak memory and the loss. Every switch is forced to kernelkit (KERNELKIT_PATCH_CHOICE=kernelkit) so
    that the rows differ only in the fusion; --choice auto measures the per-shape choices as `bench model` does.
    Each row runs in a process of its own (testing/model_bench.py).

Progress is printed as it goes; the JSON is rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NORM_SHAPES = ((8192, 4096), (16384, 4096), (16384, 2048))  # tokens x hidden: the 8B and 1B steps' norms
SWIGLU_SHAPES = ((8192, 14336), (16384, 8192))  # tokens x MLP width: the 8B and 1B steps' SwiGLUs
LMHEAD_SHAPES = ((8192, 4096, 128256), (16384, 2048, 128256))  # tokens x hidden -> vocabulary: the 8B and 1B steps
DY_SHAPES = ((8192, 4096), (8192, 1024), (8192, 14336), (16384, 2048), (16384, 8192))  # tokens x out features
STEP_ROWS = (("kernelkit-fp8", "1"), ("kernelkit-fp8", "0"), ("kernelkit-fp8+compile", "1"),
             ("kernelkit-fp8+compile", "0"))


def _env():
    import torch

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()}


def _copy_ceiling(measure_ceiling: bool):
    import torch
    from kernelkit.hw.ceilings import ceilings_for
    from kernelkit.hw.specs import lookup

    if measure_ceiling:
        return ceilings_for()[0].copy_gbps, "measured copy"
    spec = lookup(torch.cuda.get_device_name())
    return (spec.mem_gbps if spec else float("nan")), "datasheet HBM"


def _time_paths(row: dict, paths: dict, fused: str, pair: str, progress) -> dict:
    """do_bench medians of each path into row (ms, GB/s of the fused op's ideal bytes, % of the ceiling)."""
    from triton.testing import do_bench

    row.update(ms={}, gbps={}, pct_of_ceiling={})
    for name, fn in paths.items():
        ms = do_bench(fn, return_mode="median")
        row["ms"][name] = ms
        row["gbps"][name] = row["ideal_bytes"] / ms / 1e6  # the fused op's ideal bytes over each path's time
        row["pct_of_ceiling"][name] = 100.0 * row["gbps"][name] / row["ceiling_gbps"]
    row["fused_speedup_vs_pair"] = row["ms"][pair] / row["ms"][fused]
    progress("  " + ", ".join(f"{k} {v * 1e3:.0f} us ({row['gbps'][k]:.0f} GB/s, "
                              f"{row['pct_of_ceiling'][k]:.0f}%)" for k, v in row["ms"].items())
             + f"; fused {row['fused_speedup_vs_pair']:.2f}x the pair; bit-exact {row['bit_exact_vs_quantize_rows']}")
    return row


def _exact(q, s, ref):
    import torch

    return bool(torch.equal(q.view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(s, ref[1]))


def bench_norm(shapes, measure_ceiling: bool, progress) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernelkit.ops.gemm.fp8 import quantize_rows, quantize_rows_reference
    from kernelkit.ops.rms_norm import rms_norm_fp8_fwd, rms_norm_fwd

    copy_gbps, source = _copy_ceiling(measure_ceiling)

    def torch_pair(x, w, eps):
        return quantize_rows_reference(F.rms_norm(x, (x.shape[-1],), w, eps))

    compiled = torch.compile(torch_pair)
    rows = []
    for m, n in shapes:
        progress(f"norm {m}x{n}")
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = 1.0 + 0.1 * torch.randn(n, device="cuda", dtype=torch.bfloat16)
        eps = 1e-5
        y, _, q, s = rms_norm_fp8_fwd(x, w, eps)
        paths = {
            "rms_norm_fp8 (fused)": lambda: rms_norm_fp8_fwd(x, w, eps),
            "rms_norm + quantize_rows": lambda: quantize_rows(rms_norm_fwd(x, w, eps)[0]),
            "rms_norm alone (bf16 path)": lambda: rms_norm_fwd(x, w, eps),
            "torch.compile(F.rms_norm + quantize)": lambda: compiled(x, w, eps),
        }
        row = {"tokens": m, "hidden": n, "dtype": "bfloat16", "bit_exact_vs_quantize_rows": _exact(q, s, quantize_rows(y)),
               "ideal_bytes": m * n * (2 + 2 + 1) + n * 2 + m * 4,  # x in; y, q, scales out; w
               "ceiling_gbps": copy_gbps, "ceiling": source}
        rows.append(_time_paths(row, paths, "rms_norm_fp8 (fused)", "rms_norm + quantize_rows", progress))
    return rows


def bench_swiglu(shapes, measure_ceiling: bool, progress) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernelkit.ops.gemm.fp8 import quantize_rows, quantize_rows_reference
    from kernelkit.ops.glu import swiglu_fp8_fwd, swiglu_fwd

    copy_gbps, source = _copy_ceiling(measure_ceiling)
    compiled = torch.compile(lambda g, u: quantize_rows_reference(F.silu(g) * u))
    rows = []
    for m, n in shapes:
        progress(f"swiglu {m}x{n}")
        g, u = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        h, q, s = swiglu_fp8_fwd(g, u)
        paths = {
            "swiglu_fp8 (fused)": lambda: swiglu_fp8_fwd(g, u),
            "swiglu + quantize_rows": lambda: quantize_rows(swiglu_fwd(g, u)),
            "swiglu alone (bf16 path)": lambda: swiglu_fwd(g, u),
            "torch.compile(silu * up + quantize)": lambda: compiled(g, u),
        }
        row = {"tokens": m, "width": n, "dtype": "bfloat16",
               "bit_exact_vs_quantize_rows": _exact(q, s, quantize_rows(h)) and bool(torch.equal(h, swiglu_fwd(g, u))),
               "ideal_bytes": m * n * (2 + 2 + 2 + 1) + m * 4,  # gate, up in; h, q, scales out
               "ceiling_gbps": copy_gbps, "ceiling": source}
        rows.append(_time_paths(row, paths, "swiglu_fp8 (fused)", "swiglu + quantize_rows", progress))
    return rows


def bench_dy(shapes, measure_ceiling: bool, progress) -> list[dict]:
    import torch

    from kernelkit.ops.gemm.fp8 import (quantize_cols_t, quantize_cols_t_reference, quantize_rows,
                                        quantize_rows_and_cols_t, quantize_rows_reference)

    copy_gbps, source = _copy_ceiling(measure_ceiling)
    compiled = torch.compile(lambda t: (quantize_rows_reference(t), quantize_cols_t_reference(t)))
    rows = []
    for m, n in shapes:
        progress(f"dy {m}x{n}")
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        (qr, sr), (qc, sc) = quantize_rows_and_cols_t(dy)
        paths = {
            "rows_and_cols_t (two reads)": lambda: quantize_rows_and_cols_t(dy),
            "quantize_rows + quantize_cols_t": lambda: (quantize_rows(dy), quantize_cols_t(dy)),
            "torch.compile of the references": lambda: compiled(dy),
        }
        row = {"tokens": m, "out_features": n, "dtype": "bfloat16",
               "bit_exact_vs_quantize_rows": _exact(qr, sr, quantize_rows(dy)) and _exact(qc, sc, quantize_cols_t(dy)),
               "ideal_bytes": m * n * (2 + 1 + 1) + (m + n) * 4, "ceiling_gbps": copy_gbps, "ceiling": source}
        rows.append(_time_paths(row, paths, "rows_and_cols_t (two reads)", "quantize_rows + quantize_cols_t",
                                progress))
    return rows


def bench_lmhead(shapes, progress) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile
    from triton.testing import do_bench

    from kernelkit.ops.linear_cross_entropy import linear_cross_entropy

    compiled = torch.compile(lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t))
    rows = []
    for t, h, v in shapes:
        progress(f"lmhead {t}x{h}->{v}")
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) / h ** 0.5).requires_grad_()
        tgt = torch.randint(0, v, (t,), device="cuda", generator=g)

        def run(fn):
            def go():
                x.grad = w.grad = None
                fn().backward()
            return go

        paths = {
            "fp8, dlogits quantized in the CE kernel": ("1", run(lambda: linear_cross_entropy(x, w, tgt, precision="fp8"))),
            "fp8, quantize_rows pass": ("0", run(lambda: linear_cross_entropy(x, w, tgt, precision="fp8"))),
            "bf16 (kernelkit)": ("1", run(lambda: linear_cross_entropy(x, w, tgt))),
            "torch.compile (bf16 GEMMs, fp32 loss)": ("1", run(lambda: compiled(x, w, tgt))),
        }
        row = {"tokens": t, "hidden": h, "vocab": v, "ms": {}, "tflops": {}, "quantize_ms": {}, "loss": {},
               "dhidden_rel_vs_bf16": {}}
        for name, (fuse, fn) in paths.items():
            os.environ["KERNELKIT_FP8_CE_FUSE"] = fuse
            try:
                fn()
                torch.cuda.synchronize()
                ms = do_bench(fn, return_mode="median", rep=300)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fn()
                    torch.cuda.synchronize()
                qms = sum(e.device_time_total for e in prof.key_averages() if "quantize" in e.key) / 1e3
                row["ms"][name], row["quantize_ms"][name] = ms, qms
                row["tflops"][name] = 6 * t * h * v / ms / 1e9
                x.grad = None
                loss = (linear_cross_entropy(x, w, tgt, precision="fp8") if name.startswith("fp8")
                        else linear_cross_entropy(x, w, tgt) if "kernelkit" in name else compiled(x, w, tgt))
                loss.backward()
                row["loss"][name] = loss.item()
                row.setdefault("_dh", {})[name] = x.grad.float().clone()
                progress(f"  {name}: {ms:.2f} ms ({row['tflops'][name]:.0f} TFLOP/s), quantization {qms:.2f} ms, "
                         f"loss {row['loss'][name]:.5f}")
            except Exception as e:  # noqa: BLE001  (a row that fails is reported, the others still run)
                row["ms"][name] = None
                row.setdefault("errors", {})[name] = repr(e)[-500:]
                progress(f"  {name}: failed: {e!r}"[:400])
        os.environ.pop("KERNELKIT_FP8_CE_FUSE", None)
        dh = row.pop("_dh", {})
        base = dh.get("bf16 (kernelkit)")
        if base is not None:
            for name, d in dh.items():
                row["dhidden_rel_vs_bf16"][name] = float((d - base).norm() / base.norm())
        a, b = row["ms"].get("fp8, dlogits quantized in the CE kernel"), row["ms"].get("fp8, quantize_rows pass")
        if a and b:
            row["fused_speedup_vs_unfused"] = b / a
            progress(f"  fused {b / a:.3f}x the quantize_rows pass; dhidden vs bf16: "
                     + ", ".join(f"{k[:24]} {v:.4f}" for k, v in row["dhidden_rel_vs_bf16"].items()))
        rows.append(row)
        del x, w, tgt
        torch.cuda.empty_cache()
    return rows


def bench_step(args, progress, save) -> list[dict]:
    rows = []
    for variant, fuse in STEP_ROWS:
        if args.no_compile and "compile" in variant:
            continue
        progress(f"step {variant} KERNELKIT_FP8_FUSE={fuse} ...")
        env = dict(os.environ, KERNELKIT_FP8_FUSE=fuse, KERNELKIT_FP8_DY_ONE_READ=fuse, KERNELKIT_PATCH_CHOICE=args.choice)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp, "row.json")
            cmd = [sys.executable, "-m", "kernelkit.testing.model_bench", "--variant", variant, "--example",
                   args.example, "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq),
                   "--steps", str(args.steps), "--json", str(out), "--kernels"]
            t0 = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            row = json.loads(out.read_text()) if proc.returncode == 0 else {"error": (proc.stderr or proc.stdout)[-1500:]}
        row.update(variant=variant, fp8_fuse=fuse, choice=args.choice, wall_s=time.time() - t0)
        k = row.get("kernels") or {}
        row["quantize_ms_per_step"] = (k.get("families_ms") or {}).get("fp8 quantization")
        rows.append(row)
        if "error" in row:
            progress(f"  failed: {row['error'][-300:]}")
        else:
            progress(f"  {row['step_ms']:.1f} ms/step, {k.get('kernels_per_step', float('nan')):.0f} kernels/step, "
                     f"quantization {row['quantize_ms_per_step'] or 0:.2f} ms/step, peak {row['peak_gib']:.1f} GiB, "
                     f"loss {row['loss']:.4f}")
        save(rows)
    for r in rows:  # each fused row against its unfused twin
        twin = next((t for t in rows if t["variant"] == r["variant"] and t["fp8_fuse"] == "0" and "step_ms" in t), None)
        if r["fp8_fuse"] == "1" and twin and "step_ms" in r:
            r["speedup_vs_unfused"] = twin["step_ms"] / r["step_ms"]
            r["kernels_saved_per_step"] = twin["kernels"]["kernels_per_step"] - r["kernels"]["kernels_per_step"]
            r["loss_rel_diff_vs_unfused"] = abs(r["loss"] - twin["loss"]) / abs(twin["loss"])
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp8_fusion.json")
    ap.add_argument("--part", choices=("norm", "swiglu", "dy", "lmhead", "step", "all"), default="all")
    ap.add_argument("--measure-ceiling", action="store_true", help="measure the copy ceiling (cached per GPU)")
    ap.add_argument("--example", default="llama")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--choice", choices=("kernelkit", "auto"), default="kernelkit")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows of the step")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per step row")
    args = ap.parse_args()
    doc = {"env": _env(), "args": vars(args)}

    def save(part=None, rows=None):
        if part:
            doc[part] = rows
        Path(args.out).write_text(json.dumps(doc, indent=1))

    def progress(msg):
        print(msg, flush=True)

    if args.part in ("norm", "all"):
        save("norm", bench_norm(NORM_SHAPES, args.measure_ceiling, progress))
    if args.part in ("swiglu", "all"):
        save("swiglu", bench_swiglu(SWIGLU_SHAPES, args.measure_ceiling, progress))
    if args.part in ("dy", "all"):
        save("dy", bench_dy(DY_SHAPES, args.measure_ceiling, progress))
    if args.part in ("lmhead", "all"):
        save("lmhead", bench_lmhead(LMHEAD_SHAPES, progress))
    if args.part in ("step", "all"):
        bench_step(args, progress, lambda rows: save("step", rows))
    save()
    progress(f"wrote {args.out}")


if __name__ == "__main__":
    main()
