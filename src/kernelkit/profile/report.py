"""The profiler's outputs: a rich table and findings in the terminal, JSON, a roofline PNG and one
self-contained HTML page."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from ..hw.ceilings import Ceilings
from ..roofline.plot import roofline_png
from .analysis import Report


def _f(v, spec):
    return "-" if v is None else format(v, spec)


def _short(verdict: str) -> str:
    """'candidate: room ? (predicted), hot yes, stable yes' -> 'candidate R? H+ S+'."""
    head, _, rest = verdict.partition(": ")
    marks = {"yes": "+", "no": "-"}
    parts = [p.split()[0][0].upper() + (marks.get(p.split()[1], "?")) for p in rest.split(", ") if p]
    return f"{head} {' '.join(parts)}"


def print_report(rep: Report, console=None, top: int = 25) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    mode = "measured" if rep.measured else "PREDICTED from the datasheet (no GPU timing)"
    t = Table(title=f"kernelkit profile on {rep.gpu}: {mode}; step {rep.step_ms:.3f} ms"
                    + (f", attributed {rep.attributed_pct:.1f}%" if rep.attributed_pct else ""))
    for col in ("op", "module", "shapes", "ms" if rep.measured else "floor ms", "%", "AI", "TF/s", "GB/s",
                "% roof", "bound", "verdict", "kernelkit"):
        t.add_column(col, overflow="fold", max_width=22 if col in ("module", "shapes") else None)
    for r in rep.rows[:top]:
        t.add_row(r.op.replace("aten::", ""), r.module.split(":")[0].removeprefix("layers."), r.shapes,
                  _f(r.ms if rep.measured else r.floor_ms, ".3f"), f"{r.share_pct:.1f}", _f(r.intensity, ".0f"),
                  _f(r.tflops, ".0f"), _f(r.gbps, ".0f"), _f(r.pct_roof, ".0f"), r.regime[:3], _short(r.verdict),
                  r.recommendation)
    console.print(t)
    console.print("verdict: R room above the floor, H hot, S stable shape (+ yes, - no, ? not measurable)")
    for f in rep.findings:
        console.print(f"[bold]-[/] {f}")


def write_reports(rep: Report, ceilings: Ceilings, out: str | Path) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "profile.json", "png": out / "roofline.png", "html": out / "report.html"}
    paths["json"].write_text(json.dumps(rep.to_json(), indent=1, default=str))
    points = [{"intensity": r.intensity, "share_pct": r.share_pct,
               "tflops": r.tflops if rep.measured else (r.flops * r.calls / (r.floor_ms * 1e-3) / 1e12 if r.floor_ms else 0),
               "label": f"{r.op.replace('aten::', '')} {r.module.split(':')[0].split('.')[-1]}"} for r in rep.rows]
    roofline_png(points, ceilings, paths["png"],
                 title=f"{'measured' if rep.measured else 'predicted'} roofline, {ceilings.gpu}")
    paths["html"].write_text(_html(rep, paths["png"]))
    return paths


def _html(rep: Report, png: Path) -> str:
    img = base64.b64encode(png.read_bytes()).decode()
    cols = ["op", "module", "shapes", "calls", "ms" if rep.measured else "floor_ms", "share_pct", "intensity",
            "tflops", "gbps", "pct_roof", "regime", "verdict", "recommendation", "saving_ms"]
    head = "".join(f"<th>{c}</th>" for c in cols)
    body = []
    for r in rep.rows:
        cells = []
        for c in cols:
            v = getattr(r, c)
            cells.append(f"<td>{html.escape(format(v, '.4g') if isinstance(v, float) else str(v if v is not None else '-'))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    findings = "".join(f"<li>{html.escape(f)}</li>" for f in rep.findings) or "<li>nothing above the thresholds</li>"
    mode = "measured" if rep.measured else "predicted from the datasheet: no GPU timing"
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>kernelkit profile</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}td:nth-child(-n+3){{text-align:left}}</style></head>
<body><h1>kernelkit profile: {html.escape(rep.gpu)}</h1>
<p>{mode}; {rep.steps} step(s); step {rep.step_ms:.3f} ms{f"; per-op attribution {rep.attributed_pct:.1f}% of GPU time" if rep.attributed_pct else ""}.
Thresholds: {html.escape(json.dumps(rep.thresholds))}</p>
<h2>Findings</h2><ul>{findings}</ul>
<img src="data:image/png;base64,{img}" alt="roofline" style="max-width:900px">
<h2>Ops</h2><table><tr>{head}</tr>{''.join(body)}</table></body></html>"""
