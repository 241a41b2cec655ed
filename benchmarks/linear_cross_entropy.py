"""Fused LM head + cross-entropy, forward + backward, side by side in one process (GPU).

    PYTHONPATH=src python benchmarks/linear_cross_entropy.py --out results.json [--sweep 1024:bf16,4096,2048:fp32]

Rows: kernelkit.linear_cross_entropy (default chunking, and a chunk-size sweep), Liger's fused linear
cross-entropy (if importable), eager ``F.linear`` + ``F.cross_entropy`` with the logits materialized
(upcast to fp32 as HF does, and plain bf16), and torch.compile of the fp32 eager version. Each row:
do_bench median (L2 flushed before every run by do_bench's default), TFLOP/s of the 6·T·H·V GEMM FLOPs,
% of the measured bf16 GEMM peak, peak memory beyond the inputs (torch.cuda.max_memory_allocated
during one forward + backward, the returned gradients included), and errors of loss, dhidden and
dweight against an fp32 computation on the same bf16 inputs. A floor row times the three cuBLAS GEMMs
alone on materialized logits. Results go to --out as JSON, written after every row.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import kernelkit.ops.linear_cross_entropy as lce
from kernelkit.ops.linear_cross_entropy import linear_cross_entropy, make_inputs

GIB = float(1 << 30)


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def peak_extra_gib(fn):
    """Peak allocated memory of one call beyond what was allocated before it (its results included)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / GIB


def gemm_peak_tflops(n=8192, device="cuda"):
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, rep=300, return_mode="median")
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def kernel_split(fn, reps=3):
    """Device time of one call by kernel family (torch.profiler), in ms."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    split = {}
    for ev in prof.key_averages():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.key.lower()
        fam = ("cross_entropy" if "cross_entropy" in name else "grad_scale" if "grad_scale" in name
               else "gemm" if any(k in name for k in ("gemm", "nvjet", "cutlass", "sm90", "xmma", "cublas"))
               else "other")
        split[fam] = split.get(fam, 0.0) + ev.device_time_total / 1e3 / reps
    return split


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--V", type=int, default=128256)
    ap.add_argument("--sweep", default="1024:bf16,512:bf16,1536:bf16,4096,2048:fp32",
                    help="chunk sizes (rows) to time besides the default, each optionally :bf16 or :fp32 to force "
                         "where dweight's running sum lives (default: the op's policy); '' for none")
    ap.add_argument("--rep", type=int, default=1000, help="do_bench rep (ms)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip the remaining optional rows past this")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke test of the script itself")
    args = ap.parse_args()
    t0 = time.time()
    T, H, V = args.T, args.H, args.V
    gen = torch.Generator(device=args.device).manual_seed(0)
    (h, w, t), _ = make_inputs((T, H, V), torch.bfloat16, args.device, gen)
    h.requires_grad_(), w.requires_grad_()
    flops = 6.0 * T * H * V
    doc = {"config": {"T": T, "H": H, "V": V, "dtype": "bfloat16", "ignored_share": float((t == -100).float().mean()),
                      "MAX_CHUNK_BYTES": lce.MAX_CHUNK_BYTES, "default_chunk_rows": lce.chunk_rows(T, V, 2),
                      "MAX_LOWP_DWEIGHT_CHUNKS": lce.MAX_LOWP_DWEIGHT_CHUNKS,
                      "timing": f"triton.testing.do_bench median, rep={args.rep} ms, L2 flushed"},
           "rows": []}
    try:
        from kernelkit.testing.bench import env_fingerprint

        doc["env"] = env_fingerprint()
    except Exception as e:  # noqa: BLE001
        doc["env"] = {"torch": torch.__version__, "error": repr(e)}
    doc["env"]["device_name"] = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out_path.write_text(json.dumps(doc, indent=1))

    peak = gemm_peak_tflops(device=args.device)
    doc["gemm_peak_tflops_bf16_8192"] = peak
    save()

    # fp32 reference on the same bf16 values: loss and gradients.
    hr, wr = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref_loss = F.cross_entropy(F.linear(hr, wr), t)
    ref_dh, ref_dw = torch.autograd.grad(ref_loss, (hr, wr))
    ref_loss = ref_loss.detach()
    del hr, wr
    torch.cuda.empty_cache()

    def fwd_bwd(loss_fn):
        def step():
            loss = loss_fn()
            return (loss.detach(), *torch.autograd.grad(loss, (h, w)))
        return step

    def kk(chunk=None, dw_sum=None):
        def loss_fn():
            saved = lce.MAX_LOWP_DWEIGHT_CHUNKS
            if dw_sum is not None:
                lce.MAX_LOWP_DWEIGHT_CHUNKS = 0 if dw_sum == "fp32" else 1 << 30
            try:
                return linear_cross_entropy(h, w, t, chunk_size=chunk)
            finally:
                lce.MAX_LOWP_DWEIGHT_CHUNKS = saved
        return loss_fn

    impls = {"kernelkit": kk()}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

        impls["liger"] = lambda: liger(h, w, t)
    except Exception as e:  # noqa: BLE001
        liger, doc["liger_error"] = None, repr(e)
    eager32 = lambda: F.cross_entropy(F.linear(h, w).float(), t)  # noqa: E731
    impls["eager (fp32 upcast, HF)"] = eager32
    impls["eager (bf16 CE)"] = lambda: F.cross_entropy(F.linear(h, w), t)
    for item in filter(None, args.sweep.split(",")):
        rows, _, dw_sum = item.partition(":")
        impls[f"kernelkit chunk={rows}" + (f" {dw_sum}-dW-sum" if dw_sum else "")] = kk(int(rows), dw_sum or None)
    if not args.no_compile:
        compiled = torch.compile(lambda a, b, c: F.cross_entropy(F.linear(a, b).float(), c))
        impls["torch.compile (fp32 upcast)"] = lambda: compiled(h, w, t)
    optional = [n for n in impls if n.startswith(("kernelkit chunk", "torch.compile"))]

    for name, loss_fn in impls.items():
        if time.time() - t0 > args.budget_s and name in optional:
            doc["rows"].append({"impl": name, "skipped": "time budget"})
            continue
        row = {"impl": name, "mode": "fwd+bwd"}
        try:
            step = fwd_bwd(loss_fn)
            loss, dh, dw = step()  # warm-up: autotune, compile
            row.update(loss_rel_err=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                       dh_rel_err=rel(dh, ref_dh), dw_rel_err=rel(dw, ref_dw), loss_dtype=str(loss.dtype)[6:])
            del loss, dh, dw
            row["peak_extra_gib"] = peak_extra_gib(step)
            ms = do_bench(step, rep=args.rep, return_mode="median")
            row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
            row["pct_gemm_peak"] = 100.0 * row["tflops"] / peak
        except Exception as e:  # noqa: BLE001 - a failing row is reported, not fatal
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
        save()

    # Forward only (no gradient): the logits GEMM and the loss, on inputs that do not require grad.
    hd, wd = h.detach(), w.detach()
    fwd_only = {"kernelkit": lambda: linear_cross_entropy(hd, wd, t),
                "eager (fp32 upcast, HF)": lambda: F.cross_entropy(F.linear(hd, wd).float(), t)}
    if "liger" in impls:
        fwd_only["liger"] = lambda: liger(hd, wd, t)
    with torch.no_grad():
        for name, fn in fwd_only.items():
            try:
                ms = do_bench(fn, rep=args.rep // 2, return_mode="median")
                row = {"impl": name, "mode": "fwd (no grad)", "ms": ms,
                       "tflops": 2.0 * T * H * V / (ms * 1e-3) / 1e12, "peak_extra_gib": peak_extra_gib(fn)}
            except Exception as e:  # noqa: BLE001
                row = {"impl": name, "mode": "fwd (no grad)", "error": repr(e)[:300]}
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
        save()

        # The floor of any 3-GEMM method: the GEMMs alone, on materialized logits.
        def gemms():
            logits = hd @ wd.t()
            return logits @ wd, logits.t() @ hd

        ms = do_bench(gemms, rep=args.rep // 2, return_mode="median")
        tflops = flops / (ms * 1e-3) / 1e12
        doc["rows"].append({"impl": "3 cuBLAS GEMMs alone (floor)", "mode": "fwd+bwd", "ms": ms, "tflops": tflops,
                            "pct_gemm_peak": 100.0 * tflops / peak})
    try:
        doc["kernelkit_kernel_split_ms"] = kernel_split(fwd_bwd(impls["kernelkit"]))
    except Exception as e:  # noqa: BLE001
        doc["kernelkit_kernel_split_ms"] = {"error": repr(e)[:300]}
    doc["elapsed_s"] = time.time() - t0
    save()

    base = {r["impl"]: r for r in doc["rows"] if r.get("mode") == "fwd+bwd" and r.get("ms")}
    print(f"\nT={T} H={H} V={V} bf16, fwd+bwd; bf16 GEMM peak measured {peak:.0f} TFLOP/s")
    print(f"{'impl':34s} {'mode':14s} {'ms':>8s} {'TFLOP/s':>8s} {'%peak':>6s} {'peak GiB':>9s} "
          f"{'vs liger':>8s} {'dW err':>8s}")
    for r in doc["rows"]:
        if not r.get("ms"):
            print(f"{r['impl']:34s} {r.get('error', r.get('skipped', ''))[:80]}")
            continue
        vs = base["liger"]["ms"] / r["ms"] if "liger" in base and r.get("mode") == "fwd+bwd" else math.nan
        print(f"{r['impl']:34s} {r['mode']:14s} {r['ms']:8.2f} {r['tflops']:8.1f} "
              f"{r.get('pct_gemm_peak', math.nan):6.1f} {r.get('peak_extra_gib', math.nan):9.3f} {vs:8.2f} "
              f"{r.get('dw_rel_err', math.nan):8.1e}")
    print("kernelkit kernel split (ms):", doc["kernelkit_kernel_split_ms"])


if __name__ == "__main__":
    main()
