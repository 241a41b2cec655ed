"""RMSNorm, add+RMSNorm and LayerNorm over row widths 256..65536, side by side in one process (GPU).

    PYTHONPATH=src python benchmarks/norm_width_sweep.py --out sweep.json [--widths 256,...,65536]
        [--fp32-widths 4096,16384,32768] [--ops rms_norm,add_rms_norm,layer_norm] [--designs] [--budget-s 300]

Each width N gets M = 64M / N rows: 128 MB of bf16 input (256 MB in fp32). Rows per (op, dtype, N, mode):
kernelkit as it chooses; with --designs, at widths from 16384 up, each wide-row backward configuration in
CANDIDATES (ops/rms_norm.py `WideBackward`, set through the modules' WIDE_BWD, the fused backward's limit
lowered where it would take the row); torch eager (F.rms_norm / F.layer_norm autograd; add+RMSNorm as x + r then
F.rms_norm); torch.compile of the same (dynamic=False, one compiled function per op, recompiled per shape);
quack's rmsnorm where it imports. "bwd" times autograd.grad of the outputs through a kept graph, "fwd" the
training forward (inputs requiring grad); torch.compile's backward keeps its saved buffers (donation off) so
that one graph can be replayed. Times are triton.testing.do_bench medians (L2 flushed before each
run); GB/s counts the op's ideal bytes (its `cost(..., backward=...)`), % copy is against a device-to-device
copy of the input's size timed in the same process. Backward rows carry dx's error relative to eager on fp32
copies of the inputs.

Compiling is most of a cold run: worker processes first run every (op, dtype, N) once to fill Triton's and
Inductor's on-disk caches (their autotuning choices, made side by side, are not kept), then this process
times everything alone. The JSON at --out is rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import multiprocessing as mp
import torch
import torch.nn.functional as F
from triton.testing import do_bench

import kernelkit.ops.layer_norm as ln
import kernelkit.ops.rms_norm as rms
from kernelkit.ops.rms_norm import WideBackward

WIDTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
ELEMENTS = 64 << 20
OPS = ("rms_norm", "add_rms_norm", "layer_norm")
MODULE = {"rms_norm": rms, "add_rms_norm": rms, "layer_norm": ln}
COST = {"rms_norm": rms.cost, "add_rms_norm": rms.add_cost, "layer_norm": ln.cost}
# Column-strip configurations for the backward of wide rows (the first is kernelkit's default). The run of
# 2026-11-25 (results/h100/norm_width_sweep.json) also timed the looped "rows" design these replaced.
CANDIDATES = {
    "strips 4/SM 4w x4 b512": WideBackward(4.0, 4, 512, 4),
    "strips 8/SM 8w x4 b512": WideBackward(8.0, 4, 512, 8),
    "strips 2/SM 4w x4 b512": WideBackward(2.0, 4, 512, 4),
    "strips 4/SM 4w x2 b1024": WideBackward(4.0, 2, 1024, 4),
}
CANDIDATE_MIN_N = 16384
AUTOTUNED = (rms.rms_norm_fwd_kernel, rms.rms_norm_bwd_kernel, ln.layer_norm_fwd_kernel, ln.layer_norm_bwd_kernel)


def _inputs(op, m, n, dtype, gen):
    x = torch.randn(m, n, dtype=dtype, device=gen.device, generator=gen)
    w = 1.0 + 0.1 * torch.randn(n, dtype=dtype, device=gen.device, generator=gen)
    if op == "layer_norm":
        return x + 0.5, w, 0.1 * torch.randn(n, dtype=dtype, device=gen.device, generator=gen)
    if op == "add_rms_norm":
        return x, torch.randn(m, n, dtype=dtype, device=gen.device, generator=gen), w
    return x, w


def _kernelkit(op):
    return {"rms_norm": lambda x, w: rms.rms_norm(x, w, 1e-6),
            "add_rms_norm": lambda x, r, w: rms.add_rms_norm(x, r, w, 1e-6),
            "layer_norm": lambda x, w, b: ln.layer_norm(x, w, b, 1e-5)}[op]


def _eager_add(x, r, w):
    s = x + r
    return F.rms_norm(s, (s.shape[-1],), w, 1e-6), s


def _eager(op):
    return {"rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6), "add_rms_norm": _eager_add,
            "layer_norm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)}[op]


def _quack(op):
    if op != "rms_norm":
        return None
    try:
        from quack.rmsnorm import rmsnorm
    except Exception:  # noqa: BLE001 - quack (and its CUTLASS DSL) is optional
        return None
    return lambda x, w: rmsnorm(x, w, eps=1e-6)


@contextmanager
def forced(op, design: WideBackward | None, n: int):
    """kernelkit with one wide-row backward design, the fused backward's limit lowered below n if needed."""
    mod = MODULE[op]
    saved = mod.WIDE_BWD, mod.MAX_FUSED_BWD_N
    if design is not None:
        mod.WIDE_BWD, mod.MAX_FUSED_BWD_N = design, min(saved[1], n - 1)
    try:
        yield
    finally:
        mod.WIDE_BWD, mod.MAX_FUSED_BWD_N = saved


def _outputs(out):
    return [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]


def _impls(op, n, mode, designs: bool, compiled):
    """(name, fn, design) for every row of this op and width; design None: kernelkit's own choice."""
    kk = _kernelkit(op)
    rows = [("kernelkit", kk, None)]
    if designs and mode == "bwd" and n >= CANDIDATE_MIN_N:
        rows += [(f"kernelkit [{name}]", kk, cfg) for name, cfg in CANDIDATES.items()]
    rows += [("eager", _eager(op), None)]
    if compiled is not None:
        rows.append(("torch.compile", compiled, None))
    quack = _quack(op)
    if quack is not None:
        rows.append(("quack", quack, None))
    return rows


def _keep_graphs():
    """The backward rows replay one graph (retain_graph=True); AOTAutograd's compiled backward refuses that when
    it donates its saved buffers (on by default), so torch.compile's rows turn donation off."""
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False


def _warm(task):
    """Worker: run every implementation of one (op, dtype, N) once, filling the compile caches."""
    op, dtype_name, n, designs, elements = task
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1
    _keep_graphs()
    inductor_config.autotune_local_cache = False  # Inductor's runtime picks are made by the timing process
    for k in AUTOTUNED:  # compile every config, time none: the timing process tunes alone
        k._do_bench = lambda call, quantiles: (call(), [1.0] * len(quantiles))[1]
    dtype = getattr(torch, dtype_name)
    torch._dynamo.config.recompile_limit = 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    args = [a.requires_grad_() for a in _inputs(op, elements // n, n, dtype, gen)]
    t0 = time.time()
    errors = []
    for name, fn, design in _impls(op, n, "bwd", designs, torch.compile(_eager(op), dynamic=False)):
        if name in ("eager", "quack"):
            continue
        try:
            with forced(op, design, n):
                outs = _outputs(fn(*args))
                torch.autograd.grad(outs, args, [torch.ones_like(o) for o in outs])
        except Exception as e:  # noqa: BLE001 - the timing process reports it
            errors.append(f"{name}: {type(e).__name__}: {e}"[:200])
    torch.cuda.synchronize()
    return op, dtype_name, n, time.time() - t0, errors


def _dys(outs, dtype=None):
    """The same output gradients for every implementation: one seeded generator per output."""
    return [torch.randn(o.shape, dtype=dtype or o.dtype, device=o.device,
                        generator=torch.Generator(o.device).manual_seed(i)) for i, o in enumerate(outs)]


def _bench_ms(fn, rep, device="cuda"):
    if device == "cpu":  # a smoke test of this script under TRITON_INTERPRET=1: one wall-clock call
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def _rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--fp32-widths", default="4096,16384,32768")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--designs", action="store_true", help="also time every wide-row backward candidate")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--warm-workers", type=int, default=min(8, (os.cpu_count() or 2) // 2),
                    help="processes that fill the compile caches first (0: compile while timing)")
    ap.add_argument("--rep", type=int, default=50, help="do_bench rep (ms)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="past this, only kernelkit's own rows are timed")
    ap.add_argument("--elements", type=int, default=ELEMENTS, help="per width: M = elements / N rows")
    ap.add_argument("--device", default="cuda", help="cuda; cpu (TRITON_INTERPRET=1, tiny --elements) only for a "
                                                     "smoke test of the script itself")
    args = ap.parse_args()
    dev = args.device
    t0 = time.time()
    ops = args.ops.split(",")
    runs = [("bfloat16", int(n)) for n in sorted(map(int, args.widths.split(",")), reverse=True)]
    runs += [("float32", int(n)) for n in sorted(map(int, filter(None, args.fp32_widths.split(","))), reverse=True)]
    doc = {"config": {"elements": args.elements, "rows": "elements / N", "timing": f"do_bench median, rep={args.rep} ms, L2 flushed",
                      "candidates": {k: vars(v) for k, v in CANDIDATES.items()},
                      "default_wide_backward": {op: vars(MODULE[op].WIDE_BWD) for op in ops}},
           "rows": []}
    try:
        from kernelkit.testing.bench import env_fingerprint, git_commit

        doc["env"] = {**env_fingerprint(), "commit": git_commit(Path(__file__).parent)}
    except Exception as e:  # noqa: BLE001
        doc["env"] = {"torch": torch.__version__, "error": repr(e)}
    doc["env"]["device_name"] = torch.cuda.get_device_name() if dev == "cuda" else dev
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: out_path.write_text(json.dumps(doc, indent=1))  # noqa: E731

    if args.warm_workers > 0 and dev == "cuda":
        os.environ["KERNELKIT_TUNE_CACHE"] = "0"  # the workers' tunings (made side by side) are not kept
        tasks = [(op, dt, n, args.designs, args.elements) for dt, n in runs for op in ops]
        with ProcessPoolExecutor(args.warm_workers, mp_context=mp.get_context("spawn")) as pool:
            for op, dt, n, s, errors in pool.map(_warm, tasks):
                print(f"[{time.time() - t0:6.1f}s] warmed {op} {dt} N={n} in {s:.1f}s {errors or ''}", flush=True)
        doc["warm_s"] = time.time() - t0
        del os.environ["KERNELKIT_TUNE_CACHE"]
    for k in AUTOTUNED:  # shorter timing of each config than the autotuner's default 25 + 100 ms
        k._do_bench = lambda call, quantiles: do_bench(call, warmup=5, rep=25, quantiles=quantiles)
    torch._dynamo.config.recompile_limit = 64
    _keep_graphs()

    copy = {}
    for dt in sorted({dt for dt, _ in runs}):
        src = torch.empty(args.elements, dtype=getattr(torch, dt), device=dev).normal_()
        dst = torch.empty_like(src)
        ms = _bench_ms(lambda: dst.copy_(src), 200, dev)
        copy[dt] = 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
        del src, dst
    doc["copy_gbps"] = copy
    print(f"device-to-device copy of the input's size: {copy} GB/s (read + write)", flush=True)
    save()

    compiled = {op: None if args.no_compile else torch.compile(_eager(op), dynamic=False) for op in ops}
    gen = torch.Generator(device=dev).manual_seed(0)
    for dt, n in runs:
        dtype, m = getattr(torch, dt), args.elements // n
        for op in ops:
            inputs = [a.requires_grad_() for a in _inputs(op, m, n, dtype, gen)]
            ref_in = [a.detach().float().requires_grad_() for a in inputs]
            ref_outs = _outputs(_eager(op)(*ref_in))
            ref_dx = torch.autograd.grad(ref_outs, ref_in[0], [d.float() for d in _dys(ref_outs, dtype)])[0]
            del ref_in, ref_outs
            for mode in ("bwd", "fwd"):
                cost = COST[op](*inputs, backward=(mode == "bwd"))
                for name, fn, design in _impls(op, n, mode, args.designs, compiled[op]):
                    row = {"op": op, "dtype": dt, "N": n, "M": m, "mode": mode, "impl": name,
                           "design": vars(design) if design else None, "ideal_bytes": cost.bytes}
                    if time.time() - t0 > args.budget_s and name != "kernelkit":
                        row["skipped"] = "time budget"
                        doc["rows"].append(row)
                        continue
                    try:
                        with forced(op, design, n):
                            if mode == "fwd":
                                call = lambda fn=fn: fn(*inputs)  # noqa: E731
                            else:
                                outs = _outputs(fn(*inputs))
                                call = lambda outs=outs, dys=_dys(outs): torch.autograd.grad(  # noqa: E731
                                    outs, inputs, dys, retain_graph=True)
                                row["dx_rel_err_vs_fp32"] = _rel(call()[0], ref_dx)
                            ms = _bench_ms(call, args.rep, dev)
                        gbps = cost.bytes / (ms * 1e-3) / 1e9
                        row.update(ms=ms, gbps=gbps, pct_copy=100.0 * gbps / copy[dt])
                    except Exception as e:  # noqa: BLE001 - a failing row is reported, not fatal
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    call = outs = None
                    doc["rows"].append(row)
                    save()
                    print(f"[{time.time() - t0:6.1f}s] {op:12s} {mode} {dt:8s} N={n:5d} {name:34s} "
                          + (f"{row['gbps']:7.0f} GB/s {row['pct_copy']:5.1f}% copy"
                             + (f"  dx err {row['dx_rel_err_vs_fp32']:.1e}" if "dx_rel_err_vs_fp32" in row else "")
                             if "gbps" in row else row.get("error", row.get("skipped", ""))), flush=True)
            del inputs, ref_dx
            if dev == "cuda":
                torch.cuda.empty_cache()
    doc["total_s"] = time.time() - t0
    save()
    _summary(doc)


def _summary(doc):
    """GB/s per width: one table per (op, mode, dtype), impls as columns."""
    rows = [r for r in doc["rows"] if "gbps" in r]
    for key in sorted({(r["op"], r["mode"], r["dtype"]) for r in rows}):
        sel = [r for r in rows if (r["op"], r["mode"], r["dtype"]) == key]
        impls = list(dict.fromkeys(r["impl"] for r in sel))
        print(f"\n{' '.join(key)}: GB/s of ideal bytes (copy {doc['copy_gbps'][key[2]]:.0f})")
        print("N      " + " ".join(f"{i[:22]:>22s}" for i in impls))
        for n in sorted({r["N"] for r in sel}):
            got = {r["impl"]: r["gbps"] for r in sel if r["N"] == n}
            print(f"{n:<6d} " + " ".join(f"{got[i]:22.0f}" if i in got else f"{'':22s}" for i in impls))


if __name__ == "__main__":
    main()
