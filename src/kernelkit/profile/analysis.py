"""From op records to findings: one row per (op, module, phase, shapes) with its roofline placement and
the three-condition verdict, registry kernels with their projected saving, fusible memory-bound chains
between matmuls, and launch-gap overhead.

The three conditions for writing a kernel: (a) room above the floor, measured time at least `room` x
the roofline floor; (b) hot, at least `hot_pct` % of the step's GPU time; (c) stable shape, at most
`max_shapes` distinct shapes of the op at that module across the profiled steps.

Projections, stated so they can be argued with:
- a registry kernel's time in place of the calls it replaces comes from kernelkit timed on this GPU at
  their shape, else from the committed benchmark tables' % of roof at the nearest shape, else from the
  assumption that it reaches KERNEL_EFFICIENCY (90%) of the fused floor (the true inputs and outputs of
  the calls it replaces); each projection names its source (projection.py). A kernel that would not save
  time is not recommended;
- inside a CUDA graph a kernel still costs GRAPH_GAP_US (1 us) of gap: graphs recover idle - kernels x 1 us.

kernelkit's own calls (`kernelkit::<op>` records of a patched model) are rows like any other, with their
module, % of roof and verdict; nothing is recommended in their place.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

from pathlib import Path

from ..hw.ceilings import Ceilings
from ..ops import registry
from ..roofline.model import Cost, place
from .comms import communication
from .costs import is_comm, is_matmul
from .findings import findings
from .projection import RESULTS, ROOFLINE_EFFICIENCY, Projector, call_shape, shape_key, time_kernelkit
from .trace import OpRecord, Trace

KERNEL_EFFICIENCY = ROOFLINE_EFFICIENCY
GRAPH_GAP_US = 1.0
# Rows measured faster than this % of the roof are reported as such (a note in the verdict and the report's notes),
# never clamped: the ceilings are the best of sweeps (hw/ceilings.py), so a row above them ran on L2-resident
# inputs or at clocks above the ceiling's.
ABOVE_ROOF_PCT = 102.0
ABOVE_ROOF_NOTE = "above the measured ceiling: L2-resident inputs or clocks above the ceiling's"


@dataclass
class Thresholds:
    room: float = 1.5  # (a) measured / floor at least this
    hot_pct: float = 2.0  # (b) share of the step's GPU time at least this (%)
    max_shapes: int = 4  # (c) distinct shapes across steps at most this
    overhead_pct: float = 10.0  # GPU idle share of the step above which launch overhead is a finding
    chain_pct: float = 1.0  # a fusible chain is a finding when fusing saves at least this % of the step


@dataclass
class Row:
    op: str
    module: str
    phase: str
    shapes: str
    dtypes: str
    calls: float  # per step
    ms: float | None  # per step, all calls; None when predicted
    share_pct: float  # of the step's GPU kernel time (of the summed floors when predicted)
    flops: float  # per call
    bytes: float  # per call
    intensity: float
    floor_ms: float  # per step, all calls
    regime: str  # memory, compute or overhead
    tflops: float | None
    gbps: float | None
    pct_roof: float | None
    headroom_ms: float | None  # ms - floor_ms
    distinct_shapes: int
    room: bool | None
    hot: bool
    stable: bool
    verdict: str  # "KERNEL: ...", "candidate: ..." (predicted, room unknown) or "leave: ..."
    recommendation: str = ""  # registry op that replaces this call
    recommended_via: str = ""  # "op" or "module" (the module class is what the registry replaces)
    saving_ms: float | None = None  # per step, for recommendations through the op itself
    recommended: bool | None = None  # False: kernelkit's op would be slower here than what runs today


@dataclass
class Report:
    gpu: str
    measured: bool
    steps: int
    step_ms: float  # wall time per step (summed floors when predicted)
    gpu_ms: float  # GPU kernel time per step (summed floors when predicted)
    attributed_pct: float | None  # kernel time charged to op rows / all kernel time of the steps
    rows: list[Row]
    kernels: list[dict] = field(default_factory=list)  # registry kernels for groups of calls, with savings
    chains: list[dict] = field(default_factory=list)
    overhead: dict = field(default_factory=dict)
    unattributed: list[dict] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    thresholds: dict = field(default_factory=dict)
    ceilings: dict = field(default_factory=dict)
    assumptions: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    patch_coverage: dict = field(default_factory=dict)  # what kernelkit.patch(model) replaces (or why not)
    patch: dict = field(default_factory=dict)  # `profile --patch`: measured savings against the projections
    # NCCL time, exposed time and bus bandwidth per collective (comms.communication); {} without collectives
    communication: dict = field(default_factory=dict)
    distributed: dict = field(default_factory=dict)  # rank, world_size, backend, fsdp (Trace.distributed)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("trace", None)
        return d


def _cost(r: OpRecord) -> Cost:
    return Cost(r.flops, r.bytes, r.dtype_key)


def _fmt_shapes(shapes) -> str:
    return " ".join("x".join(map(str, s)) if s else "()" for s in shapes)


def _forward_names(op: str) -> list[str]:
    """Names the registry may list for an op: itself and, for a backward op, its forward."""
    names = [op]
    for suffix in ("_backward_data", "_backward"):
        if op.endswith(suffix):
            base = op[: -len(suffix)]
            names += [base, base + "_forward"]
            break
    return names


class _Registry:
    """The op registry as the profiler reads it: which kernelkit op replaces a call."""

    def __init__(self):
        self.specs = registry.all_ops()
        self.by_key: dict[str, list[str]] = defaultdict(list)
        for name, spec in self.specs.items():
            for key in spec.replaces:
                self.by_key[key].append(name)

    def candidates(self, r: OpRecord) -> tuple[list[str], str]:
        if r.op.startswith("kernelkit::"):
            return [], "op"  # kernelkit runs it already
        via_op = [s for n in _forward_names(r.op) for s in self.by_key.get(n, [])]
        if via_op:
            return list(dict.fromkeys(via_op)), "op"
        klass = r.module.rsplit(":", 1)[-1] if ":" in r.module else ""
        return list(self.by_key.get(klass, [])), "module"

    def names_of(self, r: OpRecord) -> set[str]:
        """Everything a record can stand for in a registry key such as "aten::add+aten::rms_norm"."""
        klass = r.module.rsplit(":", 1)[-1] if ":" in r.module else ""
        names = set(_forward_names(r.op)) | ({klass} if klass else set())
        for spec in self.by_key.get(klass, []):
            names |= set(self.specs[spec].replaces)
        return names

    def dataflow_runs(self, recs: list[OpRecord]) -> list[tuple[str, list[OpRecord]]]:
        """Calls matching a registry key of aten ops such as "aten::silu+aten::mul", linked by data: each
        consumes the previous one's output, whatever ran in between (SwiGLU's up_proj matmul, say)."""
        producer = {}
        for r in recs:
            for k in r.out_keys:
                producer[k] = r
        out = []
        for key, specs in self.by_key.items():
            parts = key.split("+")
            if len(parts) < 2 or not all(p.startswith("aten::") for p in parts):
                continue
            for r in recs:
                if r.op != parts[-1]:
                    continue
                run, cur = [r], r
                for part in reversed(parts[:-1]):
                    prev = next((producer[k] for k in cur.in_keys if k in producer and producer[k].op == part
                                 and producer[k].phase == cur.phase), None)
                    if prev is None:
                        break
                    run.insert(0, prev)
                    cur = prev
                if len(run) == len(parts):
                    out.append((specs[0], run))
        return out

    def chain_match(self, run: list[OpRecord]) -> str:
        names = [self.names_of(r) for r in run]
        for key, specs in self.by_key.items():
            if "+" not in key:
                continue
            i = 0
            for part in key.split("+"):
                while i < len(names) and part not in names[i]:
                    i += 1
                if i == len(names):
                    break
                i += 1
            else:
                return specs[0]
        return ""


def _registry() -> _Registry | None:
    try:
        return _Registry()
    except Exception:  # the analysis of a saved trace must not depend on the kernels importing
        return None


def true_bytes(run: list[OpRecord]) -> float:
    """Bytes that cross HBM when `run` is one kernel: tensors read that the run did not produce, and
    tensors produced that the run does not consume again (each once, at the largest view seen)."""
    produced = {k for r in run for k in r.out_keys}
    consumed = {k for r in run for k in r.in_keys}
    ins, outs = {}, {}
    for r in run:
        for k, b in zip(r.in_keys, r.in_sizes):
            if k not in produced:
                ins[k] = max(ins.get(k, 0), b)
        for k, b in zip(r.out_keys, r.out_sizes):
            if k not in consumed:
                outs[k] = max(outs.get(k, 0), b)
    return float(sum(ins.values()) + sum(outs.values()))


def _fused_floor_ms(run: list[OpRecord], ceilings: Ceilings) -> tuple[float, float]:
    nbytes = true_bytes(run)
    p = place(Cost(sum(r.flops for r in run), nbytes, run[0].dtype_key), ceilings)
    return p.floor_ms, nbytes


def _per_step(records: list[OpRecord], steps: int) -> list[list[OpRecord]]:
    out = [[] for _ in range(steps)]
    for r in records:
        if 0 <= r.step < steps:
            out[r.step].append(r)
    return out


def analyze(trace: Trace | list[OpRecord], ceilings: Ceilings, thresholds: Thresholds | None = None,
            tables: Path | None = RESULTS) -> Report:
    """Rows, registry kernels, chains, overhead and findings of a trace against the given ceilings.

    Projections use the trace's kernelkit timings, else the benchmark tables under `tables` (the folder
    of per-GPU result folders; None: none), else the roofline assumption."""
    if not isinstance(trace, Trace):
        recs = list(trace)
        trace = Trace(records=recs, steps=max((r.step for r in recs), default=0) + 1,
                      measured=any(r.kernels is not None for r in recs))
    th = thresholds or Thresholds()
    steps, measured = max(trace.steps, 1), trace.measured
    records = [r for r in trace.records if r is not None]
    reg = _registry()

    groups: dict[tuple, list[OpRecord]] = defaultdict(list)
    shapes_seen: dict[tuple, set] = defaultdict(set)
    for r in records:
        groups[(r.op, r.module, r.phase, r.shapes, r.dtypes)].append(r)
        shapes_seen[(r.op, r.module, r.phase)].add((r.shapes, r.dtypes))

    rows = []
    for (op, module, phase, shapes, dtypes), rs in groups.items():
        calls = len(rs) / steps
        one = Cost(sum(r.flops for r in rs) / len(rs), sum(r.bytes for r in rs) / len(rs), rs[0].dtype_key)
        per_call = sum(r.ms or 0.0 for r in rs) / len(rs) if measured else None
        p = place(one, ceilings, per_call)
        ms = per_call * calls if measured else None
        rows.append(Row(op=op, module=module, phase=phase, shapes=_fmt_shapes(shapes), dtypes=",".join(dtypes),
                        calls=calls, ms=ms, share_pct=0.0, flops=one.flops, bytes=one.bytes,
                        intensity=one.flops / one.bytes if one.bytes else 0.0, floor_ms=p.floor_ms * calls,
                        regime=p.regime, tflops=p.achieved_tflops, gbps=p.achieved_gbps, pct_roof=p.pct_of_roof,
                        headroom_ms=(ms - p.floor_ms * calls) if measured else None,
                        distinct_shapes=len(shapes_seen[(op, module, phase)]), room=None, hot=False, stable=True,
                        verdict=""))

    attributed_ms = sum(r.ms for r in rows) if measured else 0.0
    if measured:
        gpu_ms = (trace.device_us / steps / 1e3) if trace.device_us else attributed_ms
    else:
        gpu_ms = sum(r.floor_ms for r in rows)
    for r in rows:
        t = r.ms if measured else r.floor_ms
        r.share_pct = 100.0 * t / gpu_ms if gpu_ms else 0.0
        r.hot = r.share_pct >= th.hot_pct
        r.stable = r.distinct_shapes <= th.max_shapes
        r.room = (r.ms >= th.room * r.floor_ms) if measured else None
        if is_comm(r.op):  # a collective: its kernels wait on the link and other ranks, not on this GPU's roof
            r.regime, r.room, r.verdict = "communication", None, "leave: communication (see the findings)"
            continue
        worth = r.hot and r.stable and r.room is not False and r.regime != "overhead"
        word = ("KERNEL" if measured else "candidate") if worth else "leave"
        why = [f"room {'yes' if r.room else 'no'}" if measured else "room ? (predicted)",
               f"hot {'yes' if r.hot else 'no'}", f"stable {'yes' if r.stable else 'no'}"]
        if r.regime == "overhead":
            why.append("launch-bound")
        if r.pct_roof is not None and r.pct_roof > ABOVE_ROOF_PCT:
            why.append(ABOVE_ROOF_NOTE)
        r.verdict = f"{word}: {', '.join(why)}"
    rows.sort(key=lambda r: -(r.ms if measured else r.floor_ms))

    timeline = trace.timeline or _timeline_from(records, steps)
    step_ms = (sum(t["wall_us"] for t in timeline) / len(timeline) / 1e3) if (measured and timeline) else gpu_ms
    rep = Report(gpu=ceilings.gpu, measured=measured, steps=steps, step_ms=step_ms, gpu_ms=gpu_ms,
                 attributed_pct=(100.0 * attributed_ms / gpu_ms) if measured and gpu_ms else None, rows=rows,
                 thresholds=asdict(th), ceilings={"gpu": ceilings.gpu, "mem_gbps": ceilings.mem_gbps,
                                                  "copy_gbps": ceilings.copy_gbps,
                                                  "tflops": ceilings.tflops, "launch_us": ceilings.launch_us,
                                                  "source": ceilings.fingerprint.get("source", "measured")},
                 assumptions={"kernel_efficiency": KERNEL_EFFICIENCY, "graph_gap_us": GRAPH_GAP_US,
                              "share_of": "GPU kernel time" if measured else "summed roofline floors",
                              "projection": "kernelkit timed on this GPU, else the benchmark tables, else "
                                            f"{KERNEL_EFFICIENCY:.0%} of the fused floor"},
                 notes=list(trace.notes), patch_coverage=dict(trace.patch))
    above = [r for r in rows if r.pct_roof is not None and r.pct_roof > ABOVE_ROOF_PCT]
    if above:
        top = max(above, key=lambda r: r.pct_roof)
        rep.notes.append(f"{len(above)} row(s) measure above {ABOVE_ROOF_PCT:.0f}% of the roof (most: {top.op} in "
                         f"{top.module or '<top>'} [{top.phase}] at {top.pct_roof:.0f}%): the ceiling understates "
                         f"what this GPU does at that shape (cache reuse, a faster GEMM than the ceiling's), or the "
                         f"cost model overstates the op's work")
    per_step = _per_step(records, steps)
    assign = assign_registry(per_step, reg) if reg is not None else {}
    projector = Projector(ceilings, trace.kernel_times, tables) if reg is not None else None
    rep.kernels = registry_kernels(per_step, assign, ceilings, rows, measured, gpu_ms, projector)
    rep.chains = fusible_chains(per_step, ceilings, reg, measured, gpu_ms, assign)
    rep.overhead = overhead(timeline, th, ceilings) if measured else predicted_overhead(rows, ceilings, th)
    rep.distributed = {k: v for k, v in trace.distributed.items() if k != "link"}
    rep.communication = communication(trace.timeline, trace.distributed) if measured else {}
    for what, us in sorted(trace.unattributed.items(), key=lambda kv: -kv[1])[:10]:
        ms = us / steps / 1e3
        rep.unattributed.append({"what": what, "ms": ms, "share_pct": 100.0 * ms / gpu_ms if gpu_ms else 0.0})
    rep.findings = findings(rep, th)
    return rep


def _call_shapes(per_step, assign: dict, specs: dict) -> dict[tuple, tuple | None]:
    """(registry op, module) -> (shape, dtype) of the kernelkit call replacing its calls, read off the first
    step's forward calls (the backward's when there is no forward)."""
    runs: dict[tuple, dict[str, list[OpRecord]]] = defaultdict(lambda: defaultdict(list))
    for r in per_step[0] if per_step else []:
        if id(r) in assign:
            runs[(assign[id(r)][0], r.module)][r.phase].append(r)
    return {key: call_shape(key[0], specs.get(key[0]), by.get("fwd") or by.get("bwd"))
            for key, by in runs.items() if key[0] in specs}


def _calls_in(run: list[OpRecord], spec, via: str) -> int:
    """kernelkit calls replacing `run`: one per module instance and phase, or, where the registry op
    replaces an aten op itself, as many as the most frequent of the ops it replaces."""
    if via != "op" or spec is None:
        return 1
    count = defaultdict(int)
    for r in run:
        names = [n for n in _forward_names(r.op) if n in spec.replaces]
        if names:
            count[names[0]] += 1
    return max(count.values(), default=1)


def kernel_calls(trace: Trace) -> dict[tuple, set]:
    """(registry op, shape, dtype) -> phases: the kernelkit calls that would replace the trace's calls, to
    time on the GPU (time_calls)."""
    reg = _registry()
    if reg is None:
        return {}
    per_step = _per_step([r for r in trace.records if r is not None], max(trace.steps, 1))
    assign = assign_registry(per_step, reg)
    out: dict[tuple, set] = defaultdict(set)
    for (op, module), sd in _call_shapes(per_step, assign, reg.specs).items():
        if sd is not None:
            out[(op, sd[0], sd[1])] |= {r.phase for r in per_step[0] if assign.get(id(r), ("",))[0] == op
                                        and r.module == module}
    return dict(out)


def time_calls(trace: Trace, reps: int = 10) -> dict:
    """Time kernelkit on this GPU at every (op, shape, dtype) the trace's registry candidates would call it with
    (projection.time_kernelkit), keyed by projection.shape_key."""
    reg = _registry()
    out = {}
    for (op, shape, dtype), phases in kernel_calls(trace).items():
        out[shape_key(op, shape, dtype)] = time_kernelkit(reg.specs[op], shape, dtype, phases, reps)
    return out


def assign_registry(per_step, reg: _Registry) -> dict[int, tuple[str, str]]:
    """id(record) -> (registry op, via): "op" (it replaces the aten op or its forward), "module" (the
    module class), "pattern" (a "+" key matched along the data flow). In one (module, phase) context a
    call goes to the candidate that covers most calls there (cross_entropy over log_softmax, say)."""
    assign: dict[int, tuple[str, str]] = {}
    for recs in per_step:
        ctx: dict[tuple, list[OpRecord]] = defaultdict(list)
        for r in recs:
            ctx[(r.module, r.phase)].append(r)
        for rs in ctx.values():
            cands = {id(r): reg.candidates(r) for r in rs}
            count = defaultdict(int)
            for c, _ in cands.values():
                for spec in c:
                    count[spec] += 1
            for r in rs:
                c, via = cands[id(r)]
                if c:
                    assign[id(r)] = (max(c, key=lambda spec: count[spec]), via)
        for spec, run in reg.dataflow_runs(recs):
            if not any(id(r) in assign for r in run):
                for r in run:
                    assign[id(r)] = (spec, "pattern")
    return assign


def registry_kernels(per_step, assign: dict, ceilings: Ceilings, rows: list[Row], measured: bool,
                     gpu_ms: float, projector: Projector | None = None) -> list[dict]:
    """Calls a registry op replaces, per (registry op, module class): their time today against kernelkit's
    time for the same work (`Projector`: timed, from the tables, or at 90% of the fused floor) and the floor
    of the fused calls that replace them (one per module instance and phase: its true inputs and outputs).
    `recommended` is False where kernelkit would not save time."""
    steps = len(per_step)
    specs = projector.specs if projector is not None else {}
    shapes = _call_shapes(per_step, assign, specs) if specs else {}
    agg: dict[tuple, dict] = {}
    for recs in per_step:
        units: dict[tuple, list[OpRecord]] = defaultdict(list)
        for r in recs:
            if id(r) in assign:
                units[assign[id(r)] + (r.module, r.phase)].append(r)
        for (spec, via, module, phase), run in units.items():
            klass = module.rsplit(":", 1)[-1] if module else "<top>"
            a = agg.setdefault((spec, via, klass), {
                "kernel": spec, "replaces": {}, "via": via, "in": klass, "instances": set(), "calls": 0.0,
                "phases": set(), "shapes": defaultdict(set), "today_ms": 0.0 if measured else None,
                "floor_sum_ms": 0.0, "fused_floor_ms": 0.0, "kernelkit_ms": 0.0, "sources": {}})
            a["replaces"].update(dict.fromkeys(r.op.split("::")[-1] for r in run))
            a["instances"].add(module)
            a["phases"].add(phase)
            for r in run:
                a["shapes"][(r.op, r.module, r.phase)].add((r.shapes, r.dtypes))
            a["calls"] += len(run) / steps
            if measured:
                a["today_ms"] += sum(r.ms or 0.0 for r in run) / steps
            a["floor_sum_ms"] += sum(place(_cost(r), ceilings).floor_ms for r in run) / steps
            fused = _fused_floor_ms(run, ceilings)[0]
            a["fused_floor_ms"] += fused / steps
            if projector is not None:
                ms, kind, source = projector.ms(spec, shapes.get((spec, module)), phase,
                                                _calls_in(run, specs.get(spec), via), fused)
            else:
                ms, kind = fused / KERNEL_EFFICIENCY, "roofline"
                source = f"assumed {KERNEL_EFFICIENCY:.0%} of the fused floor"
            a["kernelkit_ms"] += ms / steps
            a["sources"].setdefault(kind, f"{phase}: {source}")
    out = []
    for a in agg.values():
        a["instances"], a["phases"] = len(a["instances"]), "+".join(sorted(a["phases"], reverse=True))
        a["distinct_shapes"] = max(len(v) for v in a.pop("shapes").values())
        ops = list(a["replaces"])
        a["replaces"] = a["in"] if a["via"] == "module" else ("+" if a["via"] == "pattern" else ", ").join(ops)
        base = a["today_ms"] if measured else a["floor_sum_ms"]
        sources = a.pop("sources")
        a["projection"] = "+".join(sorted(sources))
        a["projection_source"] = "; ".join(sources.values())
        a["saving_ms"] = base - a["kernelkit_ms"]
        a["recommended"] = a["saving_ms"] > 0
        a["share_pct"] = 100.0 * base / gpu_ms if gpu_ms else 0.0
        a["saving_pct"] = 100.0 * a["saving_ms"] / gpu_ms if gpu_ms else 0.0
        out.append(a)

    entries = {(a["kernel"], a["via"], a["in"]): a for a in out}
    by_row = {(r.op, r.module, r.phase, _fmt_shapes(r.shapes), ",".join(r.dtypes)): assign[id(r)]
              for recs in per_step for r in recs if id(r) in assign}
    for row in rows:
        hit = by_row.get((row.op, row.module, row.phase, row.shapes, row.dtypes))
        if hit:
            row.recommendation, row.recommended_via = hit
            entry = entries.get(hit + (row.module.rsplit(":", 1)[-1] if row.module else "<top>",))
            row.recommended = entry["recommended"] if entry else None
            if measured and hit[1] == "op" and entry and entry["kernelkit_ms"] > 0:
                efficiency = entry["fused_floor_ms"] / entry["kernelkit_ms"]
                row.saving_ms = max(0.0, row.ms - row.floor_ms / efficiency) if efficiency > 0 else 0.0
    return sorted(out, key=lambda a: -a["saving_ms"])


def fusible_chains(per_step, ceilings: Ceilings, reg: _Registry | None, measured: bool, gpu_ms: float,
                   assign: dict | None = None, min_len: int = 2) -> list[dict]:
    """Runs of consecutive memory-bound calls between matmuls, each with today's time (the summed floors
    when predicted) and the floor of doing it as one kernel: only the chain's true inputs and outputs
    cross HBM (tensors produced and consumed inside the chain stay on chip)."""
    first = per_step[0] if per_step else []
    same_layout = all(len(s) == len(first) and all(a.op == b.op for a, b in zip(s, first)) for s in per_step)
    chains, run = [], []

    def close():
        if len(run) >= min_len:
            fused, nbytes = _fused_floor_ms([r for _, r in run], ceilings)
            today_bytes = sum(r.bytes for _, r in run)
            if nbytes < today_bytes:
                floor_sum = sum(place(_cost(r), ceilings).floor_ms for _, r in run)
                today = None
                if measured:
                    steps = per_step if same_layout else [first]
                    today = sum((s[i].ms or 0.0) for s in steps for i, _ in run) / len(steps)
                base = today if measured else floor_sum
                saving = max(0.0, base - fused / KERNEL_EFFICIENCY)
                recs = [r for _, r in run]
                chains.append({
                    "ops": [r.op for r in recs], "n": len(recs), "phase": recs[0].phase,
                    "modules": list(dict.fromkeys(r.module for r in recs)),
                    "today_ms": today, "floor_sum_ms": floor_sum, "fused_floor_ms": fused,
                    "bytes_today": today_bytes, "bytes_fused": nbytes, "saving_ms": saving,
                    "saving_pct": 100.0 * saving / gpu_ms if gpu_ms else 0.0,
                    "recommendation": reg.chain_match(recs) if reg else "",
                    # the registry op(s) that already replace every call of the chain (reported there)
                    "covered_by": sorted({assign[id(r)][0] for r in recs}) if assign and all(
                        id(r) in assign for r in recs) else []})
        run.clear()

    for i, r in enumerate(first):
        if (r.kernels is not None and not r.kernels) or r.bytes == 0:
            continue  # ran on the CPU or moved nothing: neither part of a chain nor a break in one
        # FSDP2's copies in and out of its flat buffers (fsdp::all_gather_copy_in) belong to its collectives
        if is_matmul(r.op) or is_comm(r.op) or r.op.startswith(("kernelkit::", "fsdp::")) or \
                place(_cost(r), ceilings).regime == "compute":
            close()
            continue
        if run and run[-1][1].phase != r.phase:
            close()
        run.append((i, r))
    close()
    return sorted(chains, key=lambda c: -c["saving_ms"])


def _timeline_from(records: list[OpRecord], steps: int) -> list[dict]:
    """Per-step kernel intervals from the records themselves (a saved trace without a separate run)."""
    out = []
    for s in range(steps):
        ks = sorted(tuple(k) for r in records if r.step == s and r.kernels for k in r.kernels)
        if ks:
            out.append({"wall_us": max(e for _, e in ks) - ks[0][0], "kernels": ks})
    return out


def _busy_us(kernels) -> float:
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(tuple(k) for k in kernels):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + (cur_e - cur_s if cur_e is not None else 0.0)


def overhead(timeline: list[dict], th: Thresholds, ceilings: Ceilings) -> dict:
    """GPU idle share of the step's wall time (step start to last kernel end), from kernel timestamps."""
    if not timeline:
        return {}
    n = len(timeline)
    wall = sum(t["wall_us"] for t in timeline) / n
    busy = sum(_busy_us(t["kernels"]) for t in timeline) / n
    kernels = sum(len(t["kernels"]) for t in timeline) / n
    idle = max(wall - busy, 0.0)
    gain = max(idle - kernels * GRAPH_GAP_US, 0.0)
    idle_pct = 100.0 * idle / wall if wall else 0.0
    return {"predicted": False, "wall_ms": wall / 1e3, "busy_ms": busy / 1e3, "idle_ms": idle / 1e3,
            "idle_pct": idle_pct, "kernels_per_step": kernels, "graph_gain_ms": gain / 1e3,
            "graph_gain_pct": 100.0 * gain / wall if wall else 0.0, "bound": idle_pct >= th.overhead_pct}


def predicted_overhead(rows: list[Row], ceilings: Ceilings, th: Thresholds) -> dict:
    """Each launch costs at least the launch floor: the share of the predicted step that floor adds
    over the roofline floors is what CUDA graphs would take back."""
    launch_ms = ceilings.launch_us / 1e3
    floors = sum(r.floor_ms for r in rows)
    kernels = sum(r.calls for r in rows)
    with_launch = sum(r.calls * max(r.floor_ms / r.calls, launch_ms) for r in rows if r.calls)
    pct = 100.0 * (with_launch - floors) / with_launch if with_launch else 0.0
    gain = max(with_launch - floors - kernels * GRAPH_GAP_US / 1e3, 0.0)
    return {"predicted": True, "kernels_per_step": kernels, "launch_us": ceilings.launch_us,
            "floor_ms": floors, "with_launch_floor_ms": with_launch, "idle_pct": pct, "graph_gain_ms": gain,
            "graph_gain_pct": 100.0 * gain / with_launch if with_launch else 0.0, "bound": pct >= th.overhead_pct}
