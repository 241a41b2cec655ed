"""Markdown tables from committed benchmark JSON: `python scripts/results_table.py benchmarks/results/h100/rms_norm.json`.

One row per (shape, mode): each implementation's GB/s (or TFLOP/s for compute-bound ops), kernelkit's
% of the measured roof, and kernelkit's speedup over each competitor."""

import json
import sys
from collections import defaultdict


def table(path: str) -> str:
    doc = json.load(open(path))
    rows = doc["rows"]
    metric = "tflops" if any(r["regime"] == "compute" for r in rows if r["impl"] == "kernelkit") else "gbps"
    unit = "TFLOP/s" if metric == "tflops" else "GB/s"
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    groups = defaultdict(dict)
    for r in rows:
        groups[(r["shape"], r["mode"])][r["impl"]] = r
    others = [i for i in impls if i != "kernelkit"]
    kt = any(r.get("kernel_gbps") for r in rows)
    head = ["shape", "mode"] + [f"{i} {unit}" for i in impls] + ["kernelkit % roof"] + [f"vs {i}" for i in others]
    if kt:  # GPU-side figures (profiler kernel time, host excluded), same impl order
        head.append("kernel-only GB/s (" + " / ".join(impls) + ")")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (shape, mode), by in groups.items():
        kk = by.get("kernelkit", {})
        cells = [shape, mode]
        for i in impls:
            v = by.get(i, {}).get(metric)
            cells.append(f"{v:.0f}" if v is not None and metric == "gbps" else (f"{v:.1f}" if v is not None else "—"))
        cells.append(f"{kk['pct_roof']:.1f}" if kk.get("pct_roof") else "—")
        for i in others:
            a, b = kk.get("ms"), by.get(i, {}).get("ms")
            cells.append(f"{b / a:.2f}x" if a and b else "—")
        if kt:
            cells.append(" / ".join(f"{by[i]['kernel_gbps']:.0f}" if by.get(i, {}).get("kernel_gbps") else "—"
                                    for i in impls))
        out.append("| " + " | ".join(cells) + " |")
    env = doc["env"]
    note = (f"\n{env.get('gpu')}, driver {env.get('driver')}, torch {env.get('torch')}, Triton {env.get('triton')}"
            f"{', Liger-Kernel ' + env['liger_kernel'] if 'liger_kernel' in env else ''}; measured copy ceiling "
            f"{env.get('ceilings', {}).get('copy_gbps', 0):.0f} GB/s; `do_bench` median, L2 flushed; ideal bytes.")
    return "\n".join(out) + "\n" + note


def geomeans(paths: list[str], min_ms: float = 0.09) -> str:
    """kernelkit's geomean speedup over each competitor, across ops, shapes and modes, counting only
    rows where kernelkit's GPU time is at least `min_ms` (smaller ones measure host overhead)."""
    import math

    ratios = defaultdict(list)
    for path in paths:
        rows = json.load(open(path))["rows"]
        by = defaultdict(dict)
        for r in rows:
            by[(r["shape"], r["mode"])][r["impl"]] = r
        for group in by.values():
            kk = group.get("kernelkit", {}).get("ms")
            if not kk or kk < min_ms:
                continue
            for impl, r in group.items():
                if impl != "kernelkit" and r.get("ms"):
                    ratios[impl].append(r["ms"] / kk)
    return "\n".join(f"vs {impl}: geomean {math.exp(sum(map(math.log, v)) / len(v)):.3f}x over {len(v)} rows"
                     for impl, v in sorted(ratios.items()))


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--geomean":  # --geomean [--min-ms 0.01] FILES...
        min_ms = 0.09
        if len(args) > 2 and args[1] == "--min-ms":
            min_ms, args = float(args[2]), args[2:]
        print(geomeans(args[1:], min_ms))
    else:
        for p in args:
            print(table(p))
