"""`kernelkit profile --patch`: the loop closed. The model is profiled as it is, then with kernelkit.patch on
the same instance (everything, then each switch alone; unpatched after each run), and every projection is
set against the time the patch actually saved.

A switch's measured saving is read where the patch changed something: the (module, phase) groups whose
calls differ between the two runs (other ops or other shapes), their kernel time before minus after.
Groups the patch did not touch (the GEMMs of the projections, the embedding) are left out, so their
run-to-run noise does not blur a saving of a fraction of a millisecond; a patch that moves work between
modules (the fused linear cross-entropy takes the LM head's GEMMs into the loss) changes both groups and
counts both. Kernel time outside every record (a kernelkit op that opens no range) counts on both sides.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Callable

from ..hw.ceilings import Ceilings
from .analysis import Report, Thresholds, analyze
from .projection import PATCH_SWITCH, SWITCHES, patch_module
from . import trace as _trace
from .trace import Trace


def _groups(trace: Trace) -> dict[tuple, tuple[Counter, float]]:
    """(module, phase) -> (the calls it makes per step as a multiset of (op, shapes), kernel ms per step)."""
    steps = max(trace.steps, 1)
    calls: dict[tuple, Counter] = defaultdict(Counter)
    ms: dict[tuple, float] = defaultdict(float)
    for r in trace.records:
        if r is None:
            continue
        calls[(r.module, r.phase)][(r.op, r.shapes)] += 1
        ms[(r.module, r.phase)] += (r.ms or 0.0) / steps
    return {k: (calls[k], ms[k]) for k in calls}


def _unattributed_ms(trace: Trace) -> float:
    return sum(trace.unattributed.values()) / max(trace.steps, 1) / 1e3


def changed_ms(before: Trace, after: Trace) -> tuple[float, float, list[str]]:
    """(kernel ms per step before, after, the modules) over the (module, phase) groups whose calls differ,
    plus the kernel time no record holds (a kernel launched outside every range is still time spent)."""
    a, b = _groups(before), _groups(after)
    changed = [k for k in a.keys() | b.keys() if a.get(k, (None,))[0] != b.get(k, (None,))[0]]
    t0 = sum(a[k][1] for k in changed if k in a) + _unattributed_ms(before)
    t1 = sum(b[k][1] for k in changed if k in b) + _unattributed_ms(after)
    return t0, t1, sorted({k[0].split(":")[0] or "<top>" for k in changed})


def fallbacks(report) -> list[tuple[str, str, int]]:
    """(kind, reason, calls) of every call a kernelkit.patch report counts as run by the model's own code."""
    return [(kind, reason, n) for (kind, reason), n in sorted(report.fallbacks.items())]


def calls_text(n: int) -> str:
    return f"{n} call{'s' if n != 1 else ''}" if n else "under torch.compile"


def patch_comparison(model, inputs, ceilings: Ceilings, before: Report, thresholds: Thresholds | None = None,
                     steps: int = 3, warmup: int = 1, backward: bool = True,
                     measure: Callable | None = None, progress: Callable[[str], None] | None = None,
                     precision: str = "bf16") -> tuple[dict, Report]:
    """Profile `model` under kernelkit.patch (all switches, then each switch alone) and compare with `before`
    (the unpatched report, whose `.trace` holds its records). Returns (comparison, the report of the fully
    patched run, where kernelkit's own calls are rows). The comparison (JSON-able) has `rows`, one per switch
    the patch replaced something for, and `total`: projected and measured saving per step, and the step's
    wall and GPU time before and after, and the calls that fell back to the model's own code with the reason
    (also notes of the patched report): the profiler's own hooks never cause one. precision="fp8" adds a run under
    kernelkit.patch(model, precision="fp8") and its row, `fp8`, set against the bf16 patch: the step's wall and
    GPU kernel time per step, the fp8 decisions and the calls fp8 could not take."""
    measure = measure or _trace.measure
    step = progress or (lambda label: None)
    kpatch = patch_module()

    def run(label: str, **switches):
        step(label)
        report = kpatch.patch(model, **switches)
        try:
            trace = measure(model, inputs, steps=steps, warmup=warmup, backward=backward)
        finally:
            kpatch.unpatch(model)
        rep = analyze(trace, ceilings, thresholds)
        rep.trace = trace
        return report, trace, rep

    full_patch, full_trace, after = run("kernelkit.patch(model)")
    after.notes[:0] = [f"kernelkit.patch ran the model's own code for {kind} ({calls_text(n)}): {reason}"
                       for kind, reason, n in fallbacks(full_patch)]
    kinds = [s for s in SWITCHES if full_patch.count(s)]
    rows = []
    for kind in kinds:
        found = [k for k in before.kernels if PATCH_SWITCH.get(k["kernel"]) == kind]
        if len(kinds) > 1:
            alone, trace, rep = run(f"kernelkit.patch(model) with only {kind}", **{s: s == kind for s in SWITCHES})
        else:
            alone, trace, rep = full_patch, full_trace, after
        t0, t1, modules = changed_ms(before.trace, trace)
        rows.append({
            "switch": kind,
            "call": f"kernelkit.patch(model, {', '.join(f'{s}=False' for s in SWITCHES if s != kind)})",
            "findings": [f"kernelkit.{k['kernel']} replaces {k['replaces']}" + ("" if k["via"] == "module" else
                                                                                 f" in {k['in']}")
                         + ("" if k["recommended"] else " (not recommended)") for k in found],
            "projected_ms": sum(k["saving_ms"] for k in found) if found else None,
            "projection": "+".join(sorted({k["projection"] for k in found})),
            "measured_ms": t0 - t1, "changed_before_ms": t0, "changed_after_ms": t1, "modules": modules,
            "step_before_ms": before.step_ms, "step_after_ms": rep.step_ms,
            "gpu_before_ms": before.gpu_ms, "gpu_after_ms": rep.gpu_ms,
            "fallbacks": alone.fallback_count(kind),
            "fallback_reasons": [[r, n] for k, r, n in fallbacks(alone) if k == kind],
        })
    t0, t1, modules = changed_ms(before.trace, full_trace)
    projected = [k["saving_ms"] for k in before.kernels if PATCH_SWITCH.get(k["kernel"]) in kinds]
    total = {"switch": "all", "call": "kernelkit.patch(model)", "projected_ms": sum(projected) if projected else None,
             "measured_ms": t0 - t1, "changed_before_ms": t0, "changed_after_ms": t1, "modules": modules,
             "step_before_ms": before.step_ms, "step_after_ms": after.step_ms,
             "gpu_before_ms": before.gpu_ms, "gpu_after_ms": after.gpu_ms,
             "fallbacks": full_patch.fallback_count(),
             "fallback_reasons": [[f"{k}: {r}", n] for k, r, n in fallbacks(full_patch)]}
    kk_ms = sum(r.ms or 0.0 for r in after.rows if r.op.startswith("kernelkit::"))
    fp8 = _fp8_row(run, after) if precision == "fp8" else None
    return {"fp8": fp8[0] if fp8 else None, "family": full_patch.family, "replaced": [[r.kind, r.target, r.count] for r in full_patch.replaced],
            "skipped": [list(s) for s in full_patch.skipped], "rows": rows, "total": total,
            # which path each switch runs per shape (kernelkit or the model's own, measured): a switch whose
            # kernel measured slower than the model's code saves nothing here by design
            "choices": [[c.kind, c.shape, c.describe()] for c in getattr(full_patch, "choices", {}).values()]
            + (fp8[1] if fp8 else []),
            "kernelkit_rows_ms": kk_ms if after.measured else None, "after_attributed_pct": after.attributed_pct,
            "after_unattributed_ms": sum(u["ms"] for u in after.unattributed)}, after


def _fp8_row(run: Callable, bf16: Report) -> tuple[dict, list]:
    """The fp8 run against the bf16 patch's (`bf16`): (its comparison row, its fp8 decisions). Its saving is the
    GPU kernel time per step, bf16 - fp8: fp8_linear's kernels are not kernelkit op rows, so the changed-module
    arithmetic of the switches does not apply."""
    patched, _trace, rep = run("kernelkit.patch(model, precision='fp8')", precision="fp8")
    saving = None if bf16.gpu_ms is None or rep.gpu_ms is None else bf16.gpu_ms - rep.gpu_ms
    row = {"switch": "fp8", "call": "kernelkit.patch(model, precision='fp8')",
           "findings": [f"against kernelkit.patch(model): {patched.count('fp8')} decoder Linear(s) in fp8 where "
                        f"measured faster; the LM head in the fused loss"],
           "projected_ms": None, "projection": "", "measured_ms": saving,
           "step_before_ms": bf16.step_ms, "step_after_ms": rep.step_ms,
           "gpu_before_ms": bf16.gpu_ms, "gpu_after_ms": rep.gpu_ms,
           "fallbacks": patched.fallback_count("fp8"),
           "fallback_reasons": [[r, n] for k, r, n in fallbacks(patched) if k.startswith("fp8")]}
    choices = [[c.kind, c.shape, c.describe()] for c in getattr(patched, "choices", {}).values() if c.kind == "fp8"]
    return row, choices
