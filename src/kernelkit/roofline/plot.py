"""Roofline plot: log-log, the memory roof and one compute roof per dtype from the ceilings, ops as points
sized by their share of the step and coloured by bound regime."""

from __future__ import annotations

from pathlib import Path

from ..hw.ceilings import Ceilings

REGIME_COLORS = {"compute": "tab:blue", "memory": "tab:red", "overhead": "tab:gray"}


def roofs(ceilings: Ceilings) -> list[tuple[str, float]]:
    """(label, TFLOP/s) per distinct matrix peak; dtypes with the same peak share a line ("bf16/fp16")."""
    by_peak: dict[float, list[str]] = {}
    for key, peak in ceilings.tflops.items():
        if peak:
            by_peak.setdefault(round(float(peak), 1), []).append(key)
    return sorted(((("/".join(keys)), peak) for peak, keys in by_peak.items()), key=lambda kv: -kv[1])


def roofline_png(points: list[dict], ceilings: Ceilings, path: str | Path, title: str = "",
                 label_top: int = 12) -> Path:
    """Write the plot to `path`.

    points: dicts with intensity (FLOP per ideal byte), tflops (achieved, or at the floor when predicted),
    share_pct, label and optionally regime. Points without FLOPs or bytes are left out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    pts = [p for p in points if p.get("intensity", 0) > 0 and p.get("tflops")]
    lines = roofs(ceilings)
    bw = ceilings.copy_gbps * 1e9
    ridge = max((peak * 1e12 / bw for _, peak in lines), default=100.0)
    xs_data = [p["intensity"] for p in pts]
    lo = min(xs_data + [ridge / 1e3]) / 2
    hi = max(xs_data + [ridge * 8]) * 2
    xs = np.logspace(np.log10(lo), np.log10(hi), 256)

    fig, ax = plt.subplots(figsize=(9, 5.8))
    styles = ["-", "--", "-.", ":", (0, (5, 1))]
    for (label, peak), style in zip(lines, styles * 3):
        ax.plot(xs, np.minimum(peak, xs * bw / 1e12), linestyle=style, lw=1.3, color="k", alpha=0.75,
                label=f"{label} roof: {peak:,.0f} TFLOP/s")
    ax.plot([], [], " ", label=f"memory roof: {ceilings.copy_gbps:,.0f} GB/s")
    for regime, color in REGIME_COLORS.items():
        sel = [p for p in pts if p.get("regime", "memory") == regime]
        if sel:
            ax.scatter([p["intensity"] for p in sel], [p["tflops"] for p in sel],
                       s=[15 + 10 * p["share_pct"] for p in sel], alpha=0.6, c=color, edgecolors="k",
                       linewidths=0.4, zorder=3)
            ax.scatter([], [], s=30, c=color, edgecolors="k", linewidths=0.4, label=f"{regime}-bound ops")
    # Points on top of each other (the same GEMM in four layers) get one label: "mm q_proj (+3)".
    spots: dict[tuple, list[dict]] = {}
    for p in sorted(pts, key=lambda p: -p["share_pct"]):
        key = (round(float(np.log10(p["intensity"])) * 40), round(float(np.log10(p["tflops"])) * 40))
        spots.setdefault(key, []).append(p)
    used: set[str] = set()
    for group in sorted(spots.values(), key=lambda g: -sum(p["share_pct"] for p in g)):
        p = group[0]
        names = list(dict.fromkeys(q["label"] for q in group))
        if len(used) >= label_top or names[0] in used:
            continue  # one label per name: the router's softmax in five shapes is labelled once
        used.add(names[0])
        text = names[0] + (f" (+{len(names) - 1})" if len(names) > 1 else "")
        ax.annotate(text, (p["intensity"], p["tflops"]), fontsize=6.5, xytext=(4, 3),
                    textcoords="offset points", zorder=4)
    ys = [p["tflops"] for p in pts] + [lo * bw / 1e12]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(max(min(ys) / 3, 1e-6), max([peak for _, peak in lines] + ys) * 2)
    ax.set_xlabel("arithmetic intensity (FLOP per ideal byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title or f"roofline on {ceilings.gpu}", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
