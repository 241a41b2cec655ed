"""Roofline plot: log-log, one ceiling per dtype, ops as points sized by their share of the step."""

from __future__ import annotations

from pathlib import Path

from ..hw.ceilings import Ceilings


def roofline_png(points: list[dict], ceilings: Ceilings, path: str | Path, title: str = "", label_top: int = 12) -> Path:
    """points: dicts with intensity (FLOP/B), tflops (achieved, or the floor's when predicted), share_pct, label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    pts = [p for p in points if p["intensity"] > 0 and p["tflops"]]
    lo = min([p["intensity"] for p in pts] + [1e-2]) / 2
    xs = np.logspace(np.log10(lo), 4, 200)
    bw = ceilings.copy_gbps * 1e9
    for key, style in (("bf16", "-"), ("fp8", "--"), ("tf32", "-."), ("fp32", ":")):
        peak = ceilings.tflops.get(key)
        if peak:
            ax.plot(xs, np.minimum(peak, xs * bw / 1e12), style, lw=1.2, label=f"{key} roof ({peak:.0f} TF)")
    if pts:
        ax.scatter([p["intensity"] for p in pts], [p["tflops"] for p in pts],
                   s=[20 + 8 * p["share_pct"] for p in pts], alpha=0.6, c="tab:red", edgecolors="k", linewidths=0.4)
        for p in sorted(pts, key=lambda p: -p["share_pct"])[:label_top]:
            ax.annotate(p["label"], (p["intensity"], p["tflops"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / ideal byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title or f"roofline on {ceilings.gpu}")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
