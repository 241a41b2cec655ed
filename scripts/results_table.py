"""Markdown from a GPU's results table (kernelkit.testing.results), the newest row of each key:

    python scripts/results_table.py benchmarks/results/h100.csv --op rms_norm        # one table per op and dtype
    python scripts/results_table.py benchmarks/results/h100.csv --geomean --min-ms 0.01

A table has one row per (shape, mode): each implementation's GB/s (TFLOP/s for an op whose kernelkit rows lie
above the GPU's ridge point), kernelkit's % of the roof and its speedup over each competitor, and the
kernels-only GB/s where the run recorded them."""

import argparse
import math
import sys
from collections import defaultdict

from kernelkit.hw import lookup
from kernelkit.roofline.model import dtype_key
from kernelkit.testing import results


def _by_group(rows: list[dict]) -> dict:
    """{(shape, mode): {impl: {metric: value}}} in the table's order."""
    groups = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        groups[(r["shape"], r["mode"])][r["impl"]][r["metric"]] = r["value"]
    return groups


def throughput(rows: list[dict], metric: str | None = None) -> str:
    """gbps, or tflops where a kernelkit row's FLOPs per byte exceed the ridge point of the GPU's datasheet."""
    if metric:
        return metric
    spec = lookup(rows[0]["gpu"]) if rows else None
    ridge = spec.ridge_point(dtype_key(rows[0]["dtype"])) if spec else None
    for by in _by_group(rows).values():
        kk = by.get("kernelkit", {})
        if ridge and kk.get("gbps") and kk.get("tflops") and kk["tflops"] * 1e3 / kk["gbps"] > ridge:
            return "tflops"
    return "gbps"


def table(rows: list[dict], metric: str | None = None) -> str:
    """The markdown table of one op and dtype (rows already the newest of each key)."""
    metric = throughput(rows, metric)
    unit = {"tflops": "TFLOP/s", "gbps": "GB/s"}[metric]
    groups = _by_group(rows)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    others = [i for i in impls if i != "kernelkit"]
    kt = any("kernel_gbps" in m for by in groups.values() for m in by.values())
    head = ["shape", "mode"] + [f"{i} {unit}" for i in impls] + ["kernelkit % roof"] + [f"vs {i}" for i in others]
    if kt:  # GPU-side figures (profiler kernel time, host excluded), same impl order
        head.append("kernel-only GB/s (" + " / ".join(impls) + ")")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (shape, mode), by in groups.items():
        kk = by.get("kernelkit", {})
        cells = [shape, mode]
        for i in impls:
            v = by.get(i, {}).get(metric)
            cells.append("—" if v is None else f"{v:.0f}" if metric == "gbps" else f"{v:.1f}")
        cells.append(f"{kk['pct_roof']:.1f}" if "pct_roof" in kk else "—")
        for i in others:
            a, b = kk.get("ms"), by.get(i, {}).get("ms")
            cells.append(f"{b / a:.2f}x" if a and b else "—")
        if kt:
            cells.append(" / ".join(f"{by[i]['kernel_gbps']:.0f}" if "kernel_gbps" in by.get(i, {}) else "—"
                                    for i in impls))
        out.append("| " + " | ".join(cells) + " |")
    days = sorted({r["timestamp"][:10] for r in rows})
    commits = sorted({r["commit"] for r in rows if r["commit"]})
    note = (f"\n{rows[0]['gpu']}, torch {rows[0]['torch']}, Triton {rows[0]['triton']}; measured "
            f"{' to '.join(dict.fromkeys((days[0], days[-1])))} at {', '.join(commits) or 'no commit'}; "
            "`do_bench` median, L2 flushed; ideal bytes.")
    return "\n".join(out) + "\n" + note


def geomeans(rows: list[dict], min_ms: float = 0.09) -> str:
    """kernelkit's geomean speedup over each competitor, across ops, shapes and modes, counting only rows where
    kernelkit's time is at least `min_ms` (smaller ones measure host overhead)."""
    ratios = defaultdict(list)
    by = defaultdict(dict)
    for r in rows:
        if r["metric"] == "ms":
            by[(r["op"], r["shape"], r["dtype"], r["mode"])][r["impl"]] = r["value"]
    for group in by.values():
        kk = group.get("kernelkit")
        if not kk or kk < min_ms:
            continue
        for impl, ms in group.items():
            if impl != "kernelkit" and ms:
                ratios[impl].append(ms / kk)
    return "\n".join(f"vs {impl}: geomean {math.exp(sum(map(math.log, v)) / len(v)):.3f}x over {len(v)} rows"
                     for impl, v in sorted(ratios.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a results table, e.g. benchmarks/results/h100.csv")
    ap.add_argument("--op", action="append", help="only this op (repeatable); default: every op in the table")
    ap.add_argument("--metric", choices=("gbps", "tflops"), help="throughput column (default: by the ridge point)")
    ap.add_argument("--geomean", action="store_true", help="print kernelkit's geomean speedups instead of tables")
    ap.add_argument("--min-ms", type=float, default=0.09, help="--geomean: skip rows where kernelkit is faster")
    a = ap.parse_args(argv)
    rows = results.latest(results.read(a.table), **({"op": tuple(a.op)} if a.op else {}))
    if not rows:
        print(f"{a.table}: no rows{' of ' + ', '.join(a.op) if a.op else ''}", file=sys.stderr)
        return 1
    if a.geomean:
        print(geomeans(rows, a.min_ms))
        return 0
    for op, dtype in dict.fromkeys((r["op"], r["dtype"]) for r in rows):
        print(f"### {op} ({dtype})\n")
        print(table([r for r in rows if (r["op"], r["dtype"]) == (op, dtype)], a.metric) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
