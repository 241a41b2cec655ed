"""The findings of a report in words: what to change, what it saves, and the call that applies it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .comms import comm_findings
from .projection import PATCH_SWITCH, apply_text

if TYPE_CHECKING:
    from .analysis import Report, Thresholds


def _short_ops(ops, n=6) -> str:
    names = [o.replace("aten::", "") for o in ops]
    return " -> ".join(names[:n]) + (f" ... ({len(names)} ops)" if len(names) > n else "")


def kernel_finding(k: dict, measured: bool, max_shapes: int, coverage: dict | None) -> str:
    """One registry kernel: recommended with its saving and how to apply it, or not, and why."""
    today = f"{k['today_ms']:.3f} ms" if measured else f"{k['floor_sum_ms']:.3f} ms of floors"
    where = "" if k["via"] == "module" else f" in {k['in']}"
    unstable = f", {k['distinct_shapes']} distinct shapes" if k["distinct_shapes"] > max_shapes else ""
    what = f"{k['replaces']}{where} ({k['instances']} instance(s), {k['phases']}{unstable})"
    kk = f"kernelkit {k['kernelkit_ms']:.3f} ms ({k['projection_source']}; fused floor {k['fused_floor_ms']:.3f} ms)"
    if not k["recommended"]:
        switch = PATCH_SWITCH.get(k["kernel"])
        keep = f"; with kernelkit.patch keep it off: kernelkit.patch(model, {switch}=False)" if switch else ""
        return (f"kernelkit.{k['kernel']} would not save time in place of {what}: {today} today against {kk}; "
                f"not recommended{keep}")
    pred = "" if measured else " (predicted: at least, since eager time is taken at its floor)"
    return (f"kernelkit.{k['kernel']} replaces {what}: {today} today -> {kk}; projected saving "
            f"{k['saving_ms']:.3f} ms/step ({k['saving_pct']:.1f}%){pred}. "
            f"{apply_text(k['kernel'], k['in'], coverage)}")


def findings(rep: "Report", th: "Thresholds") -> list[str]:
    out = []
    for k in rep.kernels:
        hot = k["share_pct"] >= th.hot_pct
        if (k["recommended"] and (k["saving_pct"] >= th.chain_pct or hot)) or (not k["recommended"] and hot):
            out.append(kernel_finding(k, rep.measured, th.max_shapes, rep.patch_coverage))
    for r in rep.rows:
        if r.verdict.startswith(("KERNEL", "candidate")) and not r.recommendation:
            if not rep.measured and r.regime == "compute":
                continue  # a library GEMM at its predicted floor says nothing; summarized below
            at = f" at {r.pct_roof:.0f}% of roof" if r.pct_roof is not None else ""
            whose = ("kernelkit's own kernel has room left" if r.op.startswith("kernelkit::")
                     else "kernelkit has no kernel for it")
            out.append(f"{r.verdict.split(':')[0]}: {r.op} in {r.module or '<top>'} [{r.phase}] ({r.shapes}), "
                       f"{r.share_pct:.1f}% of the step, {r.regime}-bound{at}; {whose}")
            if sum(f.startswith(("KERNEL", "candidate")) for f in out) >= 8:
                break
    if not rep.measured:
        mm = sum(r.share_pct for r in rep.rows if r.regime == "compute")
        out.append(f"compute-bound ops (matmuls, attention) are {mm:.0f}% of the predicted step at their floor; "
                   f"only a measurement on the GPU shows how far below the roof they run")
    for c in [c for c in rep.chains if not c["covered_by"]][:5]:
        if c["saving_pct"] >= th.chain_pct:
            mods = [m.split(":")[0] or "<top>" for m in c["modules"]]
            where = mods[0] if len(mods) == 1 else f"{mods[0]} .. {mods[-1]}"
            today = f"{c['today_ms']:.3f} ms today" if rep.measured else f"{c['floor_sum_ms']:.3f} ms of floors"
            rec = f"; kernelkit.{c['recommendation']} fuses it" if c["recommendation"] else ""
            out.append(f"fusible chain of {c['n']} memory-bound ops [{c['phase']}] in {where} "
                       f"({_short_ops(c['ops'])}): {today}, fused floor "
                       f"{c['fused_floor_ms']:.3f} ms ({c['bytes_fused'] / 1e6:.1f} of "
                       f"{c['bytes_today'] / 1e6:.1f} MB); "
                       f"saving {c['saving_ms']:.3f} ms/step{rec}")
    o = rep.overhead
    if o.get("bound") and "plain_ms" in o:
        out.append(measured_overhead(o))
    elif o.get("bound"):
        what = "launch floors take" if o["predicted"] else "the GPU idles between kernels for"
        out.append(f"launch overhead: {what} {o['idle_pct']:.0f}% of the step "
                   f"({o['kernels_per_step']:.0f} kernels/step); "
                   f"CUDA graphs or torch.compile(mode='reduce-overhead') would recover about "
                   f"{o['graph_gain_ms']:.3f} ms/step ({o['graph_gain_pct']:.0f}%)")
    out += comm_findings(rep.communication, th.chain_pct)
    un = sum(u["share_pct"] for u in rep.unattributed)
    if un >= 5.0:
        out.append(f"{un:.0f}% of GPU time ran outside any recorded op (top: {rep.unattributed[0]['what']})")
    return out


def _kernel_name(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def measured_overhead(o: dict) -> str:
    """The overhead finding in words, once `overhead.combine` has put the measured figures in."""
    text = (f"launch overhead: under the profiler the GPU idles between kernels for {o['idle_pct']:.0f}% of the "
            f"step ({o['kernels_per_step']:.0f} kernels/step, {o['wall_ms']:.1f} ms profiled); without it the step "
            f"takes {o['plain_ms']:.1f} ms, so the profiler itself adds {o['profiler_ms']:.1f} ms and the model's "
            f"own idle time is {o['unprofiled_idle_ms']:.1f} ms ({o['unprofiled_idle_pct']:.0f}%): CUDA graphs "
            f"would recover about {o['projected_gain_ms']:.1f} ms/step")
    if "measured_gain_ms" in o:
        text += (f"; measured with {o['graph_method']}: {o['graph_ms']:.1f} ms, a saving of "
                 f"{o['measured_gain_ms']:.1f} ms/step ({o['measured_gain_pct']:.0f}%)")
        if "graph_kernel_delta_ms" in o:
            text += (f" (gaps between kernels {-o['graph_gap_gain_ms']:+.1f} ms, the kernels' own time "
                     f"{o['graph_kernel_delta_ms']:+.1f} ms inside the graph")
            slow = o.get("slower_in_graph") or []
            if slow:
                text += "; slower captured than eager: " + ", ".join(
                    f"{_kernel_name(r['kernel'])} {r['eager_ms']:.1f} -> {r['graph_ms']:.1f} ms" for r in slow)
            text += ")"
        if o["measured_gain_pct"] < 5.0:
            text += " - not worth graphs for this step"
            if o.get("profiler_ms", 0.0) > max(o.get("unprofiled_idle_ms", 0.0), 0.5):
                text += "; the idle time the profiler shows is mostly its own"
    else:
        text += "; graphs could not be measured (" + "; ".join(o.get("graph_errors", [])) + ")"
    return text
