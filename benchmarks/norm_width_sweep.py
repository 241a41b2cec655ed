"""RMSNorm, add+RMSNorm and LayerNorm over row widths 256..65536, side by side in one process (GPU).

    PYTHONPATH=src python benchmarks/norm_width_sweep.py --out sweep.json [--widths 256,...,65536]
        [--fp32-widths 4096,16384,32768] [--ops rms_norm,add_rms_norm,layer_norm] [--designs wide,fused]
        [--modes bwd,fwd] [--rounds 3] [--no-eager] [--budget-s 300]

Each width N gets M = 64M / N rows: 128 MB of bf16 input (256 MB in fp32); widths run in the order given. Rows
per (op, dtype, N, mode): kernelkit as it chooses; with --designs, backward candidates, each a set of the op
module's routing constants (records of ops/_norm_common.py): "wide" times each column-strip configuration
(`WideBackward`, through WIDE_BWD, the fused backward's limit lowered where it would take the row) from 16384
columns up; "fused" times, where the fused backward takes the row, its programs per SM with and without a
pipelined row loop (`FusedBackward`, through FUSED_BWD / FUSED_BWD_DS), and for add+RMSNorm from 4096 columns
the strips instead. Then torch eager (F.rms_norm / F.layer_norm autograd; add+RMSNorm as x + r then F.rms_norm);
torch.compile of the same (dynamic=False, one compiled function per op, recompiled per shape); quack's rmsnorm
where it imports. "bwd" times autograd.grad of the outputs through a kept graph, "fwd" the training forward
(inputs requiring grad); torch.compile's backward keeps its saved buffers (donation off) so that one graph can
be replayed.

Times are triton.testing.do_bench medians (L2 flushed before each run). With --rounds R every row is timed R
times, every other round in reverse order, and reports the median (all in "ms_rounds"): in the run of
2026-11-25 (benchmarks/experiments/h100/2026-11-25-norm-bwd-candidates) one design timed twice in a row differed
by up to 2.5x, most often on the first row of an (op, N). Every timing of a kernelkit row tunes its backward
anew (the tuning cache is off): the tile picked is in "tuned", the autotuner's time of every tile (the kernel
alone, µs) in "tile_us". GB/s counts the op's ideal bytes (its `cost(..., backward=...)`), % copy is against a
device-to-device copy of the input's size timed in the same process. Backward rows carry dx's error relative to
eager on fp32 copies of the inputs.

Compiling is most of a cold run: worker processes first run every (op, dtype, N, implementation) once to fill
Triton's and Inductor's on-disk caches (their autotuning choices, made side by side, are not kept), then this
process times everything alone. The JSON at --out is rewritten after every (op, dtype, N, mode).
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
from kernelkit.ops._norm_common import FusedBackward, WideBackward
from kernelkit.runtime import chosen_configs, forget, next_pow2

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
BWD_KERNELS = (rms.rms_norm_bwd_kernel, ln.layer_norm_bwd_kernel)


def _fused_limit(op, dtype):
    mod = MODULE[op]
    limit = min(mod.MAX_FUSED_N, mod.MAX_FUSED_BWD_N)
    if op == "add_rms_norm" and dtype == torch.float32:
        limit = min(limit, mod.MAX_FUSED_BWD_N_FP32_DS)
    return limit


def fused_candidates(op, n, dtype):
    """(name, module overrides) of the fused backward's candidates at this width: programs per SM x a pipelined
    row loop or not, and for add+RMSNorm from 4096 columns the strips instead."""
    if n > _fused_limit(op, dtype):
        return []
    table = "FUSED_BWD_DS" if op == "add_rms_norm" else "FUSED_BWD"
    per_sm = (2, 4, 8) if next_pow2(n) <= 1024 else (1, 2)
    out = [(f"fused {p}/SM{' pipe' + str(st) if st else ''}", {table: (FusedBackward(1 << 20, p, st),)})
           for p in per_sm for st in (None, 2)]
    if op == "add_rms_norm" and n >= 4096:
        out.append(("strips", {"MAX_FUSED_BWD_N": n - 1}))
    return out


def wide_candidates(op, n):
    if n < CANDIDATE_MIN_N:
        return []
    mod = MODULE[op]
    return [(name, {"WIDE_BWD": cfg, "MAX_FUSED_BWD_N": min(mod.MAX_FUSED_BWD_N, n - 1)})
            for name, cfg in CANDIDATES.items()]


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
def forced(op, overrides: dict | None):
    """kernelkit with some of its op module's routing constants replaced; the backward kernels re-tune."""
    mod = MODULE[op]
    saved = {k: getattr(mod, k) for k in overrides or {}}
    for k in BWD_KERNELS:
        forget(k)
    for k, v in (overrides or {}).items():
        setattr(mod, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(mod, k, v)


def _outputs(out):
    return [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]


def _impls(op, n, dtype, mode, designs, compiled, eager=True):
    """(name, fn, overrides) for every row of this op and width; overrides None: kernelkit's own choice."""
    kk = _kernelkit(op)
    rows = [("kernelkit", kk, None)]
    if mode == "bwd":
        cands = (wide_candidates(op, n) if "wide" in designs else []) + (
            fused_candidates(op, n, dtype) if "fused" in designs else [])
        rows += [(f"kernelkit [{name}]", kk, over) for name, over in cands]
    if eager:
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


def _compiled_impls(op, n, dtype, designs, compiled):
    """The backward rows whose kernels compile (kernelkit's, its candidates', torch.compile's)."""
    return [r for r in _impls(op, n, dtype, "bwd", designs, compiled) if r[0] not in ("eager", "quack")]


def _warm(task):
    """Worker: run one implementation of one (op, dtype, N) once, filling the compile caches."""
    op, dtype_name, n, designs, elements, index = task
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
    name, fn, over = _compiled_impls(op, n, dtype, designs, torch.compile(_eager(op), dynamic=False))[index]
    errors = []
    try:
        with forced(op, over):
            outs = _outputs(fn(*args))
            torch.autograd.grad(outs, args, [torch.ones_like(o) for o in outs])
    except Exception as e:  # noqa: BLE001 - the timing process reports it
        errors.append(f"{name}: {type(e).__name__}: {e}"[:200])
    torch.cuda.synchronize()
    return op, dtype_name, n, name, time.time() - t0, errors


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
    ap.add_argument("--designs", default="", help="backward candidates to time as well: wide, fused (comma list)")
    ap.add_argument("--modes", default="bwd,fwd")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--warm-workers", type=int, default=min(8, (os.cpu_count() or 2) // 2),
                    help="processes that fill the compile caches first (0: compile while timing)")
    ap.add_argument("--rep", type=int, default=50, help="do_bench rep (ms)")
    ap.add_argument("--tune-rep", type=int, default=25, help="do_bench rep (ms) of each config the autotuner times")
    ap.add_argument("--rounds", type=int, default=1, help="time every row this many times, in alternating order; "
                                                         "a row's ms is the median")
    ap.add_argument("--budget-s", type=float, default=300.0, help="past this, only kernelkit's own rows are timed")
    ap.add_argument("--elements", type=int, default=ELEMENTS, help="per width: M = elements / N rows")
    ap.add_argument("--device", default="cuda", help="cuda; cpu (TRITON_INTERPRET=1, tiny --elements) only for a "
                                                     "smoke test of the script itself")
    args = ap.parse_args()
    dev = args.device
    t0 = time.time()
    ops = args.ops.split(",")
    designs = set(filter(None, args.designs.split(",")))
    modes = args.modes.split(",")
    os.environ["KERNELKIT_TUNE_CACHE"] = "0"  # every kernelkit row tunes here, for its own candidate
    runs = [("bfloat16", int(n)) for n in args.widths.split(",")]
    runs += [("float32", int(n)) for n in filter(None, args.fp32_widths.split(","))]
    doc = {"config": {"elements": args.elements, "rows": "elements / N", "timing": f"do_bench median, rep={args.rep} ms, L2 flushed",
                      "designs": sorted(designs), "wide_candidates": {k: vars(v) for k, v in CANDIDATES.items()},
                      "default_wide_backward": {op: vars(MODULE[op].WIDE_BWD) for op in ops},
                      "default_fused_backward": {op: [vars(e) for e in getattr(
                          MODULE[op], "FUSED_BWD_DS" if op == "add_rms_norm" else "FUSED_BWD")] for op in ops}},
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
        # One task per (op, dtype, N, implementation): the candidates' compiles spread over the workers.
        tasks = [(op, dt, n, designs, args.elements, i) for dt, n in runs for op in ops
                 for i in range(len(_compiled_impls(op, n, getattr(torch, dt), designs, _eager(op))))]
        with ProcessPoolExecutor(args.warm_workers, mp_context=mp.get_context("spawn")) as pool:
            for op, dt, n, name, s, errors in pool.map(_warm, tasks):
                print(f"[{time.time() - t0:6.1f}s] warmed {op} {dt} N={n} {name} in {s:.1f}s {errors or ''}",
                      flush=True)
        doc["warm_s"] = time.time() - t0
    for k in AUTOTUNED:  # shorter timing of each config than the autotuner's default 25 + 100 ms
        k._do_bench = lambda call, quantiles: do_bench(call, warmup=5, rep=args.tune_rep, quantiles=quantiles)
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
            for mode in modes:
                cost = COST[op](*inputs, backward=(mode == "bwd"))
                impls = _impls(op, n, dtype, mode, designs, compiled[op], not args.no_eager)
                rows = {name: {"op": op, "dtype": dt, "N": n, "M": m, "mode": mode, "impl": name,
                               "design": {k: _jsonable(v) for k, v in over.items()} if over else None,
                               "ideal_bytes": cost.bytes} for name, _, over in impls}
                for r in range(args.rounds):  # every other round backwards: no design always runs first
                    for name, fn, over in impls if r % 2 == 0 else impls[::-1]:
                        row = rows[name]
                        if time.time() - t0 > args.budget_s and name != "kernelkit":
                            row.setdefault("skipped", "time budget")
                            continue
                        try:
                            ms = _time_row(row, name, fn, over, op, mode, inputs, ref_dx, args.rep, dev)
                            row.setdefault("ms_rounds", []).append(ms)
                        except Exception as e:  # noqa: BLE001 - a failing row is reported, not fatal
                            row["error"] = f"{type(e).__name__}: {e}"[:300]
                            continue
                        print(f"[{time.time() - t0:6.1f}s] {op:12s} {mode} {dt:8s} N={n:5d} {name:40s} "
                              f"{cost.bytes / (ms * 1e-3) / 1e9:7.0f} GB/s ({ms * 1e3:.1f} us)"
                              + (f"  dx err {row['dx_rel_err_vs_fp32']:.1e}" if "dx_rel_err_vs_fp32" in row else ""),
                              flush=True)
                for row in rows.values():
                    if row.get("ms_rounds"):
                        ms = sorted(row["ms_rounds"])[(len(row["ms_rounds"]) - 1) // 2]  # the lower median
                        gbps = cost.bytes / (ms * 1e-3) / 1e9
                        row.update(ms=ms, gbps=gbps, pct_copy=100.0 * gbps / copy[dt])
                    doc["rows"].append(row)
                save()
            del inputs, ref_dx
            if dev == "cuda":
                torch.cuda.empty_cache()
    doc["total_s"] = time.time() - t0
    save()
    _summary(doc)


def _time_row(row, name, fn, over, op, mode, inputs, ref_dx, rep, dev) -> float:
    """One timing of one implementation (kernelkit's rows tune their backward anew each time: the pick, and the
    autotuner's timing of every tile, go into the row)."""
    with forced(op, over) if name.startswith("kernelkit") else _nothing():
        if mode == "fwd":
            return _bench_ms(lambda: fn(*inputs), rep, dev)
        outs = _outputs(fn(*inputs))
        dys = _dys(outs)
        call = lambda: torch.autograd.grad(outs, inputs, dys, retain_graph=True)  # noqa: E731
        row["dx_rel_err_vs_fp32"] = _rel(call()[0], ref_dx)
        if name.startswith("kernelkit"):
            row.setdefault("tuned", []).append([c["config"] for c in chosen_configs() if "_bwd_kernel" in c["kernel"]])
            row.setdefault("tile_us", []).append({str(c): round(1e3 * t[0], 1) for k in BWD_KERNELS
                                                  for c, t in (getattr(k, "configs_timings", None) or {}).items()})
            for k in BWD_KERNELS:
                k.configs_timings = None
        return _bench_ms(call, rep, dev)


@contextmanager
def _nothing():
    yield


def _jsonable(v):
    if isinstance(v, tuple):
        return [_jsonable(e) for e in v]
    return vars(v) if hasattr(v, "__dataclass_fields__") else v


def _summary(doc):
    """GB/s per width: one table per (op, mode, dtype), an implementation (or candidate) a line."""
    rows = [r for r in doc["rows"] if "gbps" in r]
    for key in sorted({(r["op"], r["mode"], r["dtype"]) for r in rows}):
        sel = [r for r in rows if (r["op"], r["mode"], r["dtype"]) == key]
        widths = list(dict.fromkeys(r["N"] for r in sel))
        print(f"\n{' '.join(key)}: GB/s of ideal bytes (copy {doc['copy_gbps'][key[2]]:.0f})")
        print(f"{'':40s} " + " ".join(f"{n:>7d}" for n in widths))
        for impl in dict.fromkeys(r["impl"] for r in sel):
            got = {r["N"]: r["gbps"] for r in sel if r["impl"] == impl}
            print(f"{impl[:40]:40s} " + " ".join(f"{got[n]:7.0f}" if n in got else f"{'':7s}" for n in widths))


if __name__ == "__main__":
    main()
