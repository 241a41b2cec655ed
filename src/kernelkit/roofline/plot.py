"""Roofline plot: log-log, the memory roof and one compute roof per dtype from the ceilings, ops as points
sized by their share of the step and coloured by bound regime."""

from __future__ import annotations

from pathlib import Path

from ..hw.ceilings import Ceilings

DPI = 120
REGIME_COLORS = {"compute": "tab:blue", "memory": "tab:red", "overhead": "tab:gray"}


def roofs(ceilings: Ceilings) -> list[tuple[str, float]]:
    """(label, TFLOP/s) per distinct matrix peak; dtypes with the same peak share a line ("bf16/fp16")."""
    by_peak: dict[float, list[str]] = {}
    for key, peak in ceilings.tflops.items():
        if peak:
            by_peak.setdefault(round(float(peak), 1), []).append(key)
    return sorted(((("/".join(keys)), peak) for peak, keys in by_peak.items()), key=lambda kv: -kv[1])


Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in display pixels


def _overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def place_labels(anchors: list[tuple[float, float]], sizes: list[tuple[float, float]], bounds: Box,
                 avoid: list[Box] = (), gap: float = 4.0, rings: int = 4) -> list[tuple[float, float] | None]:
    """Greedy label placement in display pixels, most important label first: for each anchor, the first
    position around it (right above, right below, left above, left below, then the same one ring further
    out) whose box stays inside `bounds` and overlaps neither a label placed before nor a box in `avoid`
    (the points). Returns each label's lower-left corner offset from its anchor, or None where none fits
    (the label is left out: the tables list every row)."""
    placed: list[Box] = []
    out: list[tuple[float, float] | None] = []
    for (x, y), (w, h) in zip(anchors, sizes):
        spot = None
        for ring in range(rings):
            d = gap + ring * (h + gap)
            for dx, dy in ((d, d * 0.5), (d, -h - d * 0.5), (-w - d, d * 0.5), (-w - d, -h - d * 0.5),
                           (-w / 2, d + h * 0.25), (-w / 2, -h - d - h * 0.25)):
                box = (x + dx, y + dy, x + dx + w, y + dy + h)
                inside = bounds[0] <= box[0] and box[2] <= bounds[2] and bounds[1] <= box[1] and box[3] <= bounds[3]
                if inside and not any(_overlaps(box, b) for b in placed) and not any(_overlaps(box, b) for b in avoid):
                    spot = (dx, dy)
                    placed.append(box)
                    break
            if spot is not None:
                break
        out.append(spot)
    return out


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
    bw = ceilings.mem_gbps * 1e9
    ridge = max((peak * 1e12 / bw for _, peak in lines), default=100.0)
    xs_data = [p["intensity"] for p in pts]
    lo = min(xs_data + [ridge / 1e3]) / 2
    hi = max(xs_data + [ridge * 8]) * 2
    xs = np.logspace(np.log10(lo), np.log10(hi), 256)

    fig, ax = plt.subplots(figsize=(9, 5.8), dpi=DPI)  # the labels are placed in pixels at the saved dpi
    styles = ["-", "--", "-.", ":", (0, (5, 1))]
    for (label, peak), style in zip(lines, styles * 3):
        ax.plot(xs, np.minimum(peak, xs * bw / 1e12), linestyle=style, lw=1.3, color="k", alpha=0.75,
                label=f"{label} roof: {peak:,.0f} TFLOP/s")
    ax.plot([], [], " ", label=f"memory roof: {ceilings.mem_gbps:,.0f} GB/s")
    for regime, color in REGIME_COLORS.items():
        sel = [p for p in pts if p.get("regime", "memory") == regime]
        if sel:
            ax.scatter([p["intensity"] for p in sel], [p["tflops"] for p in sel],
                       s=[15 + 10 * p["share_pct"] for p in sel], alpha=0.6, c=color, edgecolors="k",
                       linewidths=0.4, zorder=3)
            ax.scatter([], [], s=30, c=color, edgecolors="k", linewidths=0.4, label=f"{regime}-bound ops")
    ys = [p["tflops"] for p in pts] + [lo * bw / 1e12]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(max(min(ys) / 3, 1e-6), max([peak for _, peak in lines] + ys) * 2)
    ax.set_xlabel("arithmetic intensity (FLOP per ideal byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title or f"roofline on {ceilings.gpu}", fontsize=10)
    legend = ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    _label_points(fig, ax, pts, legend, label_top)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _label_points(fig, ax, pts: list[dict], legend, label_top: int) -> None:
    """Label the `label_top` points with the most time, where a label fits: points on top of each other
    (the same GEMM in four layers) get one label, "mm q_proj (+3)"; one label per name (the router's
    softmax in five shapes is labelled once); no label covers another, a point or the legend."""
    import numpy as np

    spots: dict[tuple, list[dict]] = {}
    for p in sorted(pts, key=lambda p: -p["share_pct"]):
        key = (round(float(np.log10(p["intensity"])) * 40), round(float(np.log10(p["tflops"])) * 40))
        spots.setdefault(key, []).append(p)
    chosen, used = [], set()
    for group in sorted(spots.values(), key=lambda g: -sum(p["share_pct"] for p in g)):
        names = list(dict.fromkeys(q["label"] for q in group))
        if len(chosen) >= label_top or names[0] in used:
            continue
        used.add(names[0])
        chosen.append((group[0], names[0] + (f" (+{len(names) - 1})" if len(names) > 1 else "")))
    if not chosen:
        return
    renderer = fig.canvas.get_renderer()
    to_px = ax.transData.transform
    anchors = [tuple(to_px((p["intensity"], p["tflops"]))) for p, _ in chosen]
    sizes = []
    for _, text in chosen:
        t = ax.text(0, 0, text, fontsize=6.5)
        bb = t.get_window_extent(renderer)
        sizes.append((bb.width, bb.height))
        t.remove()
    frame = ax.get_window_extent(renderer)
    avoid = [tuple(legend.get_window_extent(renderer).extents)] if legend is not None else []
    for p in pts:
        x, y = to_px((p["intensity"], p["tflops"]))
        avoid.append((x - 3, y - 3, x + 3, y + 3))
    offsets = place_labels(anchors, sizes, tuple(frame.extents), avoid)
    for (p, text), off, (w, h) in zip(chosen, offsets, sizes):
        if off is None:
            continue
        near_x = 0.0 if off[0] <= 0 <= off[0] + w else min(abs(off[0]), abs(off[0] + w))
        near_y = 0.0 if off[1] <= 0 <= off[1] + h else min(abs(off[1]), abs(off[1] + h))
        far = max(near_x, near_y) > 8  # pushed out a ring: a leader line says whose label it is
        ax.annotate(text, (p["intensity"], p["tflops"]), fontsize=6.5, xytext=off, textcoords="offset pixels",
                    ha="left", va="bottom", zorder=4,
                    arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "0.4"} if far else None)
