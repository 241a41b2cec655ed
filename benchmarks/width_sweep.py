"""Memory-bound ops over row widths at a fixed input size, side by side in one process (GPU), and their plots.

    PYTHONPATH=src python benchmarks/width_sweep.py --out sweep.json [--ops softmax,rms_norm,...]
        [--widths 1024,...,393216] [--dtypes bfloat16,float32] [--elements 67108864] [--modes fwd,bwd]
        [--compile] [--budget-s 420]
    python benchmarks/width_sweep.py --plot sweep.json --plot-dir docs/img   # on any machine, from the JSON
    python benchmarks/width_sweep.py --table sweep.json [sweep2.json ...]     # the markdown table of docs/

Each width N gets M = elements / N rows (64M elements: 128 MB of bf16 input, 256 MB of fp32). Every row is
`kernelkit bench`'s own measurement (testing/suite.run_suite: triton.testing.do_bench median, L2 flushed, inputs
rotated): kernelkit, torch eager, quack where `quack-kernels` imports, Liger where it imports, and torch.compile
with --compile (off by default: it recompiles per width, minutes of a GPU call). GB/s counts the op's ideal bytes
(its `cost`); "copy" is the device-to-device copy bandwidth `kernelkit doctor` measured in the same process. The
JSON is rewritten after every (op, dtype, width); --budget-s stops starting new widths past that many seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEFAULT_OPS = "softmax,log_softmax,rms_norm,add_rms_norm,layer_norm,cross_entropy,swiglu"
DEFAULT_WIDTHS = "256,1024,4096,16384,32768,65536,131072,262144,393216"


def _sweep(args) -> None:
    import torch

    from kernelkit.hw import measure_ceilings
    from kernelkit.ops import registry
    from kernelkit.testing.suite import run_suite
    from kernelkit.hw.ceilings import device_fingerprint

    import importlib

    for item in args.set:
        name, value = item.split("=", 1)
        module, const = name.rsplit(".", 1)
        mod = importlib.import_module(f"kernelkit.ops.{module}")
        getattr(mod, const)  # an unknown name is an error, not a silent new attribute
        setattr(mod, const, type(getattr(mod, const))(value) if not isinstance(getattr(mod, const), bool)
                else value.lower() in ("1", "true"))
    ceilings = measure_ceilings()
    out = {"config": {"elements": args.elements, "rows": "elements / N", "modes": args.modes, "set": args.set,
                      "timing": "kernelkit bench's run_suite: do_bench median, L2 flushed"},
           "env": {"gpu": ceilings.gpu, "torch": torch.__version__, "fingerprint": device_fingerprint()},
           "copy_gbps": ceilings.copy_gbps, "rows": []}
    start = time.time()
    widths = [int(w) for w in args.widths.split(",")]
    for op in args.ops.split(","):
        spec = registry.get(op)
        for dtype in args.dtypes.split(","):
            for n in widths:
                if time.time() - start > args.budget_s:
                    print(f"budget of {args.budget_s} s spent: stopping before {op} {dtype} N={n}", flush=True)
                    out["stopped_early"] = True
                    Path(args.out).write_text(json.dumps(out, indent=1))
                    return
                m = max(1, args.elements // n)
                t0 = time.time()
                try:
                    rows = run_suite(spec, ceilings, shapes=[(m, n)], dtype=dtype, modes=tuple(args.modes.split(",")),
                                     compile=args.compile, latency=False)
                except Exception as e:  # noqa: BLE001 - one failing width is recorded, the sweep goes on
                    out["rows"].append({"op": op, "dtype": dtype, "N": n, "M": m, "error": repr(e)[:300]})
                    print(f"{op} {dtype} N={n}: {e!r}"[:300], flush=True)
                    continue
                for r in rows:
                    out["rows"].append({"op": op, "dtype": dtype, "N": n, "M": m, "mode": r.mode, "impl": r.impl,
                                        "ms": r.ms, "gbps": r.gbps, "pct_copy": r.pct_roof, "error": r.error,
                                        "max_err": r.max_err})
                best = {(r.mode, r.impl): r.gbps for r in rows if r.gbps}
                print(f"[{time.time() - start:5.0f} s] {op} {dtype} {m}x{n} ({time.time() - t0:.0f} s): " + ", ".join(
                    f"{mode}/{impl} {g:.0f}" for (mode, impl), g in sorted(best.items())), flush=True)
                Path(args.out).write_text(json.dumps(out, indent=1))
    out["total_s"] = time.time() - start
    Path(args.out).write_text(json.dumps(out, indent=1))


def _plot(path: str, plot_dir: str) -> list[Path]:
    """One figure per (op, dtype): GB/s against row width, a line per implementation and mode, copy on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(path).read_text())
    copy = data["copy_gbps"]
    groups: dict = {}
    for r in data["rows"]:
        if r.get("gbps"):
            groups.setdefault((r["op"], r["dtype"]), {}).setdefault((r["impl"], r["mode"]), []).append((r["N"], r["gbps"]))
    written = []
    for (op, dtype), lines in sorted(groups.items()):
        modes = sorted({mode for _, mode in lines})
        fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            ax.axhline(copy, color="black", linestyle="--", linewidth=1, label=f"copy {copy:.0f}")
            for (impl, m), pts in sorted(lines.items()):
                if m != mode:
                    continue
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl,
                        linewidth=2.5 if impl == "kernelkit" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("row width N (M = elements / N)")
            ax.set_ylabel("GB/s (ideal bytes)")
            ax.set_title(f"{op} {dtype} {mode}")
            ax.set_ylim(0, copy * 1.15)
            ax.legend(fontsize=7)
        fig.suptitle(f"{data['env']['gpu']}, {data['config']['elements'] / 2**20:.0f}M elements per input")
        fig.tight_layout()
        dest = Path(plot_dir) / f"width-{op}-{dtype}.png"
        dest.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(dest, dpi=90)
        plt.close(fig)
        written.append(dest)
    return written


def _table(paths: list[str]) -> str:
    """Markdown: per (op, dtype, mode, N) kernelkit's GB/s and % of copy, quack's and the ratio, the best other."""
    lines = ["| op | dtype | mode | N | kernelkit GB/s | % copy | quack GB/s | kernelkit / quack | best other |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        data = json.loads(Path(path).read_text())
        cells: dict = {}
        for r in data["rows"]:
            if r.get("gbps"):
                cells.setdefault((r["op"], r["dtype"], r["mode"], r["N"]), {})[r["impl"]] = (r["gbps"], r["pct_copy"])
        for (op, dtype, mode, n), impls in cells.items():
            kk = impls.get("kernelkit")
            if kk is None:
                continue
            q = impls.get("quack")
            others = {k: v for k, v in impls.items() if k not in ("kernelkit", "quack")}
            best = max(others.items(), key=lambda kv: kv[1][0]) if others else None
            lines.append(
                f"| {op} | {dtype} | {mode} | {n} | {kk[0]:.0f} | {kk[1]:.0f}% | "
                + (f"{q[0]:.0f} | **{kk[0] / q[0]:.2f}** |" if q else "— | — |")
                + (f" {best[0]} {best[1][0]:.0f} |" if best else " — |"))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="width_sweep.json")
    ap.add_argument("--ops", default=DEFAULT_OPS)
    ap.add_argument("--widths", default=DEFAULT_WIDTHS)
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--elements", type=int, default=64 * 2**20)
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="override an op module's routing constant, e.g. layer_norm.COOP_CHUNK=4096 (recorded)")
    ap.add_argument("--plot", help="a sweep JSON to plot instead of measuring")
    ap.add_argument("--plot-dir", default="docs/img")
    ap.add_argument("--table", nargs="+", help="sweep JSONs to print as one markdown table")
    args = ap.parse_args()
    if args.table:
        print(_table(args.table))
        return
    if args.plot:
        for p in _plot(args.plot, args.plot_dir):
            print(p)
        return
    _sweep(args)


if __name__ == "__main__":
    main()
