"""From op records to findings: one row per (op, module, shapes) with its roofline placement and the
three-condition verdict, fusible memory-bound chains between matmuls, and launch-gap overhead.

The three conditions for writing a kernel: (a) room above the floor, measured time at least
`room` x the roofline floor; (b) hot, at least `hot_pct` % of the step; (c) stable shape, at most
`max_shapes` distinct shapes of the op at that module across the profiled steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..hw.ceilings import Ceilings
from ..roofline.model import Cost, place
from .costs import is_matmul
from .trace import OpRecord

# A registry kernel is assumed to reach this fraction of the roof when projecting time saved.
KERNEL_EFFICIENCY = 0.9


@dataclass
class Thresholds:
    room: float = 1.5  # measured / floor at least this
    hot_pct: float = 2.0  # share of step time at least this (%)
    max_shapes: int = 4  # distinct shapes across steps at most this
    overhead_pct: float = 10.0  # idle share of the step above which launch overhead is a finding


@dataclass
class Row:
    op: str
    module: str
    shapes: str
    dtypes: str
    calls: float  # per step
    ms: float | None  # per step, all calls; None when predicted
    share_pct: float
    flops: float  # per call
    bytes: float  # per call
    intensity: float
    floor_ms: float  # per step, all calls
    regime: str
    tflops: float | None
    gbps: float | None
    pct_roof: float | None
    headroom_ms: float | None
    distinct_shapes: int
    verdict: str
    recommendation: str = ""
    saving_ms: float | None = None


@dataclass
class Report:
    gpu: str
    measured: bool
    steps: int
    step_ms: float  # measured GPU time per step (or the sum of floors when predicted)
    attributed_pct: float | None  # per-op kernel time / measured step GPU time
    rows: list[Row]
    chains: list[dict] = field(default_factory=list)
    overhead: dict = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    thresholds: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _recommend(op: str, module: str) -> str:
    from ..ops import registry

    klass = module.rsplit(":", 1)[-1] if ":" in module else ""
    hits = registry.replacing(op) + (registry.replacing(klass) if klass else [])
    return hits[0].name if hits else ""


def analyze(records: list[OpRecord], ceilings: Ceilings, steps: int, measured: bool,
            thresholds: Thresholds | None = None, spans: list[tuple[float, float]] | None = None,
            step_ms: float | None = None) -> Report:
    th = thresholds or Thresholds()
    groups: dict[tuple, list[OpRecord]] = {}
    shapes_seen: dict[tuple, set] = {}
    for r in records:
        groups.setdefault((r.op, r.module, r.shapes, r.dtypes), []).append(r)
        shapes_seen.setdefault((r.op, r.module), set()).add(r.shapes)

    rows = []
    for (op, module, shapes, dtypes), rs in groups.items():
        calls = len(rs) / steps
        one = Cost(rs[0].flops, rs[0].bytes, rs[0].dtype_key)
        per_call_ms = sum(r.ms or 0.0 for r in rs) / len(rs) if measured else None
        p = place(one, ceilings, per_call_ms)
        ms = per_call_ms * calls if measured else None
        rows.append(Row(op=op, module=module, shapes=" ".join("x".join(map(str, s)) for s in shapes),
                        dtypes=",".join(dtypes), calls=calls, ms=ms, share_pct=0.0, flops=one.flops, bytes=one.bytes,
                        intensity=one.arithmetic_intensity if one.bytes else 0.0, floor_ms=p.floor_ms * calls,
                        regime=p.regime, tflops=p.achieved_tflops, gbps=p.achieved_gbps, pct_roof=p.pct_of_roof,
                        headroom_ms=(ms - p.floor_ms * calls) if measured else None,
                        distinct_shapes=len(shapes_seen[(op, module)]), verdict=""))
    total = sum(r.ms for r in rows) if measured else sum(r.floor_ms for r in rows)
    for r in rows:
        t = r.ms if measured else r.floor_ms
        r.share_pct = 100.0 * t / total if total else 0.0
        hot = r.share_pct >= th.hot_pct
        stable = r.distinct_shapes <= th.max_shapes
        room = (r.ms >= th.room * r.floor_ms) if measured else None
        parts = [f"room {'yes' if room else 'no'}" if room is not None else "room ? (predicted)",
                 f"hot {'yes' if hot else 'no'}", f"stable {'yes' if stable else 'no'}"]
        worth = hot and stable and (room is None or room) and r.regime != "overhead"
        r.verdict = ("KERNEL" if worth and measured else "candidate" if worth else "leave") + ": " + ", ".join(parts)
        r.recommendation = _recommend(r.op, r.module)
        if r.recommendation and measured:
            r.saving_ms = max(0.0, r.ms - r.floor_ms / KERNEL_EFFICIENCY)
    rows.sort(key=lambda r: -(r.ms if measured else r.floor_ms))

    step = step_ms if (measured and step_ms) else total
    rep = Report(gpu=ceilings.gpu, measured=measured, steps=steps, step_ms=step,
                 attributed_pct=(100.0 * total / step_ms) if measured and step_ms else None, rows=rows,
                 thresholds=asdict(th))
    rep.chains = fusible_chains([r for r in records if r.step == 0], ceilings, steps_ms=None if not measured else 1)
    rep.overhead = overhead(spans, step_ms, steps, th, ceilings, n_ops=len(records) / steps) if measured else \
        predicted_overhead(records, ceilings, steps, total)
    rep.findings = _findings(rep, th)
    return rep


def fusible_chains(step_records: list[OpRecord], ceilings: Ceilings, steps_ms=None, min_len: int = 2) -> list[dict]:
    """Runs of consecutive memory-bound ops between matmuls, each with today's time (or floor) and the
    floor of doing it as one kernel: only the chain's true inputs and outputs cross HBM.

    True inputs: tensors read by the chain that no op of the chain produced; true outputs: tensors the
    chain produced that no later op of the chain consumed (tensor identity by storage, offset, shape).
    """
    chains, run = [], []

    def close():
        if len(run) >= min_len:
            produced = {k for r in run for k in r.out_keys}
            consumed = {k for r in run for k in r.in_keys}
            # Each distinct tensor once, however many ops of the chain read it.
            true_in = sum({k: b for r in run for k, b in zip(r.in_keys, r.in_sizes) if k not in produced}.values())
            true_out = sum({k: b for r in run for k, b in zip(r.out_keys, r.out_sizes) if k not in consumed}.values())
            fused = (true_in + true_out) / (ceilings.copy_gbps * 1e9) * 1e3
            today_floor = sum(r.bytes for r in run) / (ceilings.copy_gbps * 1e9) * 1e3
            today = sum(r.ms for r in run) if all(r.ms is not None for r in run) else None
            chains.append({"ops": [r.op for r in run], "module": run[0].module, "n": len(run),
                           "today_ms": today, "today_floor_ms": today_floor, "fused_floor_ms": fused,
                           "bytes_today": sum(r.bytes for r in run), "bytes_fused": true_in + true_out})
        run.clear()

    for r in step_records:
        if is_matmul(r.op) or r.bytes == 0 or not hasattr(r, "in_keys"):
            close()
        else:
            run.append(r)
    close()
    chains.sort(key=lambda c: -((c["today_ms"] if c["today_ms"] is not None else c["today_floor_ms"]) - c["fused_floor_ms"]))
    return chains


def overhead(spans, step_ms, steps, th: Thresholds, ceilings: Ceilings, n_ops: float) -> dict:
    """GPU idle share between kernels, from the kernels' own timestamps."""
    if not spans or not step_ms:
        return {}
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window = (spans[-1][1] - spans[0][0]) if spans else 0.0
    window = max(window, max(e for _, e in spans) - spans[0][0])
    idle_pct = 100.0 * (1.0 - busy / window) if window else 0.0
    idle_ms = (window - busy) / 1e3 / steps
    return {"idle_pct": idle_pct, "idle_ms_per_step": idle_ms, "kernels_per_step": len(spans) / steps,
            "launch_us": ceilings.launch_us, "bound": idle_pct >= th.overhead_pct}


def predicted_overhead(records, ceilings: Ceilings, steps: int, floor_total_ms: float) -> dict:
    launches = len(records) / steps
    launch_ms = launches * ceilings.launch_us / 1e3
    pct = 100.0 * launch_ms / (launch_ms + floor_total_ms) if floor_total_ms else 0.0
    return {"predicted": True, "kernels_per_step": launches, "launch_ms_per_step": launch_ms,
            "launch_pct_of_floor_plus_launches": pct, "bound": pct >= Thresholds().overhead_pct}


def _findings(rep: Report, th: Thresholds) -> list[str]:
    out = []
    unit = "ms" if rep.measured else "ms (floor)"
    for r in rep.rows[:40]:
        if r.verdict.startswith(("KERNEL", "candidate")) and r.recommendation:
            gain = f", projected saving {r.saving_ms:.3f} ms/step" if r.saving_ms is not None else ""
            out.append(f"{r.op} in {r.module or '<top>'} ({r.shapes}): {r.share_pct:.1f}% of the step, "
                       f"{r.regime}-bound -> kernelkit.{r.recommendation}{gain}")
    for c in rep.chains[:5]:
        today = c["today_ms"] if c["today_ms"] is not None else c["today_floor_ms"]
        if today > 1.2 * c["fused_floor_ms"]:
            out.append(f"fusible chain of {c['n']} memory-bound ops in {c['module'] or '<top>'} "
                       f"({' -> '.join(o.replace('aten::', '') for o in c['ops'][:6])}{' ...' if c['n'] > 6 else ''}): "
                       f"{today:.3f} {unit} today, {c['fused_floor_ms']:.3f} ms fused floor")
    o = rep.overhead
    if o.get("bound"):
        if o.get("predicted"):
            out.append(f"overhead: {o['kernels_per_step']:.0f} launches/step x {rep.overhead.get('launch_ms_per_step', 0) / max(o['kernels_per_step'], 1) * 1e3:.1f} us "
                       f"= {o['launch_pct_of_floor_plus_launches']:.0f}% of the predicted step: use CUDA graphs or "
                       f"torch.compile(mode='reduce-overhead')")
        else:
            out.append(f"overhead: the GPU idles {o['idle_pct']:.0f}% of the step between kernels "
                       f"({o['idle_ms_per_step']:.3f} ms/step): CUDA graphs or torch.compile(mode='reduce-overhead') "
                       f"would recover up to that")
    return out
