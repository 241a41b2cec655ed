"""The profiler's outputs: a rich table and findings in the terminal, JSON, a roofline PNG and one
self-contained HTML page (the PNG inlined as base64, no external assets)."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from ..hw.ceilings import Ceilings
from ..roofline.plot import roofline_png
from .analysis import Report, Row
from .compare import calls_text
from .trace import Trace


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _verdict_marks(r: Row) -> str:
    """'KERNEL R+ H+ S+': R room above the floor, H hot, S stable shape."""
    m = {True: "+", False: "-", None: "?"}
    return f"{r.verdict.split(':')[0]} R{m[r.room]} H{m[r.hot]} S{m[r.stable]}"


def _module(r: Row, width: int = 28) -> str:
    path = r.module.split(":")[0] if r.module else "<top>"
    path = path if len(path) <= width else "…" + path[-width + 1:]
    return f"{path}{' (bw)' if r.phase == 'bwd' else ''}"


def _achieved(r: Row) -> str:
    """The rate that bounds the op: TFLOP/s when compute-bound, GB/s otherwise."""
    if r.tflops is None:
        return "-"
    return f"{r.tflops:.0f} TF/s" if r.regime == "compute" else f"{r.gbps:.0f} GB/s"


def _mode(rep: Report) -> str:
    return "measured" if rep.measured else "PREDICTED from the datasheet (no GPU timing)"


def _summary(rep: Report) -> str:
    if rep.measured:
        s = (f"step {rep.step_ms:.3f} ms wall, {rep.gpu_ms:.3f} ms of GPU kernels"
             + (f", {rep.attributed_pct:.1f}% attributed to ops" if rep.attributed_pct is not None else ""))
    else:
        s = f"summed roofline floors {rep.gpu_ms:.3f} ms per step"
    c = rep.ceilings
    peaks = ", ".join(f"{k} {v:.0f}" for k, v in (c.get("tflops") or {}).items() if v)
    return (f"{s}; {rep.steps} step(s). Ceilings ({c.get('source', '')}): {c.get('mem_gbps') or c.get('copy_gbps', 0):.0f} GB/s, "
            f"{peaks} TFLOP/s, launch {c.get('launch_us', 0):.1f} us")


def _kernelkit_cell(r: Row) -> str:
    """What kernelkit does for this row: runs it already, replaces it, or would be slower."""
    if r.op.startswith("kernelkit::"):
        return "(running)"
    if r.recommendation and r.recommended is False:
        return f"({r.recommendation}: slower)"
    return r.recommendation


def print_report(rep: Report, console=None, top: int = 25, title: str = "") -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    t = Table(title=f"kernelkit profile on {rep.gpu}: {_mode(rep)}{f', {title}' if title else ''}",
              caption=_summary(rep), title_justify="left")
    right = {"calls", "ms", "floor ms", "%", "AI", "achieved", "% roof"}
    for col in ("op", "module", "shapes", "calls", "ms" if rep.measured else "floor ms", "%", "AI", "achieved",
                "% roof", "bound", "verdict", "kernelkit"):
        t.add_column(col, justify="right" if col in right else "left", no_wrap=True, overflow="ellipsis",
                     max_width={"op": 26, "module": 30, "shapes": 26}.get(col))
    for r in rep.rows[:top]:
        t.add_row(escape(r.op.replace("aten::", "")), escape(_module(r)), escape(r.shapes), f"{r.calls:g}",
                  _f(r.ms if rep.measured else r.floor_ms, ".3f"), f"{r.share_pct:.1f}", _f(r.intensity, ".1f"),
                  _achieved(r), _f(r.pct_roof, ".0f"), r.regime, _verdict_marks(r), escape(_kernelkit_cell(r)))
    console.print(t)
    if len(rep.rows) > top:
        console.print(f"({len(rep.rows) - top} more rows in the JSON and HTML reports)")
    console.print("verdict: R room above the floor, H hot, S stable shape (+ yes, - no, ? not measurable)")
    for n in rep.notes:
        console.print(f"[yellow]note:[/] {escape(n)}")
    if rep.communication:
        print_communication(rep.communication, console)
    console.print("[bold]findings[/]" if rep.findings else "no findings above the thresholds")
    for f in rep.findings:
        console.print(f"[bold]-[/] {escape(f)}")


def print_communication(c: dict, console) -> None:
    """The NCCL kernels of a step per collective: time, exposed time, size, bus bandwidth and % of the link."""
    from rich.table import Table

    link = f"link ceiling {c['link_busbw_gbps']:.0f} GB/s" if c.get("link_busbw_gbps") else "no link ceiling"
    t = Table(title=f"communication per step: {c['comm_ms']:.2f} ms of NCCL kernels, {c['exposed_ms']:.2f} ms "
                    f"exposed ({c['exposed_pct']:.1f}% of the step); {link}", title_justify="left")
    for col in ("collective", "calls", "ms", "exposed ms", "median MiB", "busbw GB/s", "% link"):
        t.add_column(col, justify="left" if col == "collective" else "right")
    for r in c["collectives"]:
        med = None if r["median_bytes"] is None else r["median_bytes"] / 2**20
        t.add_row(r["collective"], f"{r['calls']:g}", f"{r['ms']:.3f}", f"{r['exposed_ms']:.3f}", _f(med, ".1f"),
                  _f(r["busbw_gbps"], ".1f"), _f(r["pct_of_link"], ".0f"))
    console.print(t)


def patch_table_rows(comp: dict) -> list[dict]:
    """One row per kernelkit.patch switch and the total: projected and measured saving, step before/after."""
    out = []
    for r in [*comp.get("rows", []), comp.get("total", {}), comp.get("fp8") or {}]:
        if not r:
            continue
        out.append({"switch": r["switch"], "findings": "; ".join(r.get("findings", [])) or "-",
                    "projected_ms": r.get("projected_ms"), "projection": r.get("projection", ""),
                    "measured_ms": r.get("measured_ms"), "step_before_ms": r.get("step_before_ms"),
                    "step_after_ms": r.get("step_after_ms"), "gpu_before_ms": r.get("gpu_before_ms"),
                    "gpu_after_ms": r.get("gpu_after_ms"), "fallbacks": r.get("fallbacks", 0),
                    "fallback_reasons": "; ".join(f"{why} ({calls_text(n)})"
                                                  for why, n in r.get("fallback_reasons", [])),
                    "call": r.get("call", "")})
    return out


def print_patch_comparison(comp: dict, console=None) -> None:
    """`profile --patch`: each switch's projected saving against the one measured under kernelkit.patch."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    t = Table(title=f"kernelkit.patch: projected against measured ({comp.get('family', '')} family)",
              title_justify="left", caption="saving = kernel time of the modules the switch changed, before - after; "
                                            "step = wall time per step (GPU kernel time in brackets)")
    for col, right in (("switch", False), ("finding", False), ("projected ms/step", True),
                       ("measured saving ms/step", True), ("step ms before -> after", True), ("fallbacks", True)):
        t.add_column(col, justify="right" if right else "left", overflow="fold",
                     max_width=60 if col == "finding" else None)
    for r in patch_table_rows(comp):
        proj = _f(r["projected_ms"], ".3f") + (f" ({r['projection']})" if r["projection"] else "")
        step = (f"{_f(r['step_before_ms'], '.2f')} -> {_f(r['step_after_ms'], '.2f')} "
                f"({_f(r['gpu_before_ms'], '.2f')} -> {_f(r['gpu_after_ms'], '.2f')})")
        t.add_row(escape(r["switch"]), escape(r["findings"]), proj, _f(r["measured_ms"], ".3f"), step,
                  str(r["fallbacks"] or ""), style="bold" if r["switch"] == "all" else None)
    console.print(t)
    # Why calls fell back: under the whole patch, then any other reason seen with a switch alone.
    total = comp.get("total") or {}
    seen = {why for why, _ in total.get("fallback_reasons", [])}
    lines = [(why, n, "") for why, n in total.get("fallback_reasons", [])]
    for r in comp.get("rows", []):
        lines += [(f"{r['switch']}: {why}", n, f" with only {r['switch']}") for why, n in r.get("fallback_reasons", [])
                  if f"{r['switch']}: {why}" not in seen]
    for why, n, alone in lines:
        console.print(f"[yellow]fallback:[/] kernelkit.patch ran the model's own code{alone} ({calls_text(n)}): "
                      f"{escape(why)}", highlight=False)
    for what, why in comp.get("skipped", []):
        console.print(f"kernelkit.patch left {escape(str(what))} alone: {escape(str(why))}")
    for kind, shape, text in comp.get("choices", []):
        console.print(f"kernelkit.patch chose for {escape(kind)} at {escape(shape)}: {escape(text)}", highlight=False)


def _points(rep: Report) -> list[dict]:
    pts = []
    for r in rep.rows:
        if rep.measured:
            tflops = r.tflops
        else:  # at the floor
            tflops = r.flops * r.calls / (r.floor_ms * 1e-3) / 1e12 if r.floor_ms else 0.0
        where = r.module.split(":")[0].split(".")[-1]
        label = f"{r.op.replace('aten::', '')} {where}{' bw' if r.phase == 'bwd' else ''}"
        pts.append({"intensity": r.intensity, "tflops": tflops, "share_pct": r.share_pct, "label": label,
                    "regime": r.regime})
    return pts


def write_reports(rep: Report, ceilings: Ceilings, out: str | Path, trace: Trace | None = None,
                  json_only: bool = False, suffix: str = "") -> dict[str, Path]:
    """profile.json, roofline.png, report.html (and trace.json, the records, to analyze again) in `out`; each
    name with `suffix` before its extension (under torchrun: "-rank<r>")."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"profile{suffix}.json"}
    paths["json"].write_text(json.dumps(rep.to_json(), indent=1, default=str))
    if trace is not None:
        paths["trace"] = trace.save(out / f"trace{suffix}.json")
    if json_only:
        return paths
    paths["png"] = roofline_png(_points(rep), ceilings, out / f"roofline{suffix}.png",
                                title=f"{'measured' if rep.measured else 'predicted (ops at their floor)'} "
                                      f"roofline, {ceilings.gpu}")
    paths["html"] = out / f"report{suffix}.html"
    paths["html"].write_text(to_html(rep, paths["png"]))
    return paths


def _table(rows: list[dict], cols: list[str]) -> str:
    def cell(v):
        if isinstance(v, float):
            v = format(v, ".4g")
        elif isinstance(v, list):
            v = " -> ".join(str(x).replace("aten::", "") for x in v)
        return f"<td>{html.escape('-' if v is None else str(v))}</td>"

    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(cell(r.get(c)) for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def to_html(rep: Report, png: Path | None) -> str:
    doc = rep.to_json()
    img = (f'<img src="data:image/png;base64,{base64.b64encode(Path(png).read_bytes()).decode()}" alt="roofline" '
           f'style="max-width:960px">') if png else ""
    findings = "".join(f"<li>{html.escape(f)}</li>" for f in rep.findings) or "<li>nothing above the thresholds</li>"
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in rep.notes)
    ms = "ms" if rep.measured else "floor_ms"
    op_cols = ["op", "module", "phase", "shapes", "dtypes", "calls", ms, "share_pct", "intensity", "tflops", "gbps",
               "pct_roof", "regime", "headroom_ms", "distinct_shapes", "verdict", "recommendation", "recommended",
               "saving_ms"]
    if not rep.measured:
        op_cols = [c for c in op_cols if c not in ("tflops", "gbps", "pct_roof", "headroom_ms", "saving_ms")]
    sections = [f"<h2>Findings</h2><ul>{findings}</ul>", img]
    if doc.get("patch"):
        sections.append("<h2>Under kernelkit.patch: projected against measured</h2>" + _table(
            patch_table_rows(doc["patch"]), ["switch", "findings", "projected_ms", "projection", "measured_ms",
                                             "step_before_ms", "step_after_ms", "gpu_before_ms", "gpu_after_ms",
                                             "fallbacks", "fallback_reasons", "call"]))
    if doc["kernels"]:
        sections.append("<h2>kernelkit kernels for these ops</h2>" + _table(doc["kernels"], [
            "kernel", "replaces", "via", "in", "instances", "phases", "calls", "distinct_shapes", "today_ms",
            "floor_sum_ms", "fused_floor_ms", "kernelkit_ms", "projection", "projection_source", "saving_ms",
            "saving_pct", "recommended"]))
    if doc["chains"]:
        sections.append("<h2>Fusible chains</h2>" + _table(doc["chains"][:20], [
            "phase", "modules", "ops", "today_ms", "floor_sum_ms", "fused_floor_ms", "bytes_today", "bytes_fused",
            "saving_ms", "saving_pct", "recommendation"]))
    if doc["overhead"]:
        sections.append("<h2>Launch overhead</h2>" + _table([doc["overhead"]], list(doc["overhead"])))
    sections.append(f"<h2>Ops ({len(rep.rows)} rows)</h2>" + _table(doc["rows"], op_cols))
    if doc["unattributed"]:
        sections.append("<h2>GPU time outside recorded ops</h2>"
                        + _table(doc["unattributed"], ["what", "ms", "share_pct"]))
    settings = {**doc["thresholds"], **doc["assumptions"]}
    sections.append("<h2>Thresholds and assumptions</h2>" + _table([settings], list(settings)))
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>kernelkit profile: {html.escape(rep.gpu)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}
table{{border-collapse:collapse;font-size:12px;margin:.5em 0 1.5em}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right;vertical-align:top}}th{{background:#f3f3f3}}
td:nth-child(-n+4){{text-align:left}}h2{{font-size:1.1em;margin-top:1.5em}}</style></head>
<body><h1>kernelkit profile: {html.escape(rep.gpu)}</h1>
<p><b>{html.escape(_mode(rep))}</b>. {html.escape(_summary(rep))}.</p>
{f"<ul>{notes}</ul>" if notes else ""}
{''.join(sections)}
<p>Verdict: room above the floor (measured &ge; room &times; floor), hot (&ge; hot_pct % of the step), stable shape
(&le; max_shapes distinct shapes). kernelkit's time for each replacement: {html.escape(rep.assumptions.get(
'projection', ''))} (the kernels table names the source of each).</p>
</body></html>"""
