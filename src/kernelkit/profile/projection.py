"""What a kernelkit op would take in place of what runs today: measured where it can be, never assumed
silently.

A recommendation is a projection: today's time of the calls a registry op replaces, against the time
kernelkit's implementation takes for the same work. That time comes from, in order:
1. "timed": kernelkit's implementation run on this GPU at the call's shape during `profile`
   (`time_kernelkit`: device time of its kernels from torch.profiler, host time excluded, as the trace's);
2. "table": the efficiency (% of roof) kernelkit measured at the nearest shape in the results table of this
   GPU (benchmarks/results/<gpu>.csv, testing.results: the newest row of each key), applied to the floor at
   the call's shape;
3. "roofline": the assumption that the kernel reaches ROOFLINE_EFFICIENCY (90%) of the fused floor.
The report names which one each projection used; a kernel slower than what runs today is not recommended.

The shape a registry op is timed at comes from the calls it replaces (`call_shape`): the largest
floating input of the first call, its leading dims folded into the rank of the op's benchmark shapes
(`(tokens, hidden)` for norms, GLUs, softmax, cross-entropy); attention reads q, k, v of the fused
SDPA call and whether it was causal.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

from ..hw.ceilings import Ceilings
from ..ops import registry
from ..roofline.model import Cost, place
from ..testing import results
from ..testing.bench import kernel_time_ms
from .costs import attention_flops, tensors
from .trace import OpRecord

ROOFLINE_EFFICIENCY = 0.9
RESULTS = results.RESULTS  # the folder of per-GPU results tables, in a source checkout

# The kernelkit.patch switch (keyword of kernelkit.patch) that puts each registry op into a Hugging Face model.
PATCH_SWITCH = {"rms_norm": "rms_norm", "add_rms_norm": "rms_norm", "swiglu": "mlp", "geglu": "mlp", "rope": "rope", "attention": "attention",
                "cross_entropy": "cross_entropy", "linear_cross_entropy": "cross_entropy"}
SWITCHES = ("rms_norm", "mlp", "rope", "attention", "cross_entropy")


def shape_key(op: str, shape: tuple, dtype: str) -> str:
    """"attention:4x2048x16x128xTrue:bfloat16", the shape spelled as the benchmark tables spell it."""
    return f"{op}:{'x'.join(map(str, shape))}:{dtype}"


# --- the shape of the kernelkit call that replaces a group of calls ---

def _attention_shape(run: list[OpRecord]) -> tuple[tuple, str] | None:
    r = next((r for r in run if "scaled_dot_product" in r.op or "attention" in r.op), None)
    if r is None or len(r.shapes) < 3:
        return None
    backward = "backward" in r.op
    q, k, v = r.shapes[1:4] if backward else r.shapes[:3]
    if not (len(q) == len(k) == len(v) == 4):
        return None
    full = attention_flops(q, k, v, backward=backward)
    causal = bool(full and r.flops < 0.75 * full)
    b, h, s, d = q  # SDPA takes (batch, heads, seq, head_dim); kernelkit.attention (batch, seq, heads, head_dim)
    shape = (b, s, h, d, causal, k[2], k[1])
    # make_inputs' shortest spelling, as the tables name shapes: seq_k and heads_kv only where they differ
    shape = shape if k[1] != h else shape[:6] if k[2] != s else shape[:5]
    return shape, r.dtypes[1 if backward else 0]


def _leading_shape(spec, run: list[OpRecord]) -> tuple[tuple, str] | None:
    r = run[0]
    floating = [(s, d) for s, d in zip(r.shapes, r.dtypes) if d.startswith(("float", "bfloat")) and s]
    if not floating:
        return None
    shape, dtype = max(floating, key=lambda sd: math.prod(sd[0]))
    ranks = {len(s) for s in spec.bench_shapes or spec.test_shapes}
    rank = min(ranks) if len(ranks) == 1 else len(shape)
    shape = tuple(shape)
    if len(shape) > rank:
        shape = (math.prod(shape[: len(shape) - rank + 1]), *shape[len(shape) - rank + 1:])
    return (*(1,) * (rank - len(shape)), *shape), dtype


SHAPES_FROM_CALLS = {"attention": _attention_shape}


def call_shape(op: str, spec, run: list[OpRecord]) -> tuple[tuple, str] | None:
    """(shape for spec.make_inputs, dtype name) of the kernelkit call replacing `run`, or None."""
    try:
        return SHAPES_FROM_CALLS.get(op, lambda r: _leading_shape(spec, r))(run)
    except Exception:  # records of an unexpected form: no shape, the table or the roofline decides
        return None


# --- timing kernelkit on this GPU ---

def kernel_ms(fn, reps: int = 10) -> float | None:
    """Mean summed device time of the kernels one call of `fn` launches, L2 flushed before each call
    (testing.bench.kernel_time_ms)."""
    return kernel_time_ms(fn, reps)


def time_kernelkit(spec, shape: tuple, dtype: str, phases, reps: int = 10) -> dict:
    """Device time of kernelkit's implementation at `shape`: {"fwd": ms[, "bwd": ms]} per call, from the
    kernels torch.profiler records (L2 flushed before each call); {"error": why} when it cannot run.
    The forward runs with the gradient inputs requiring grad, as in a training step."""
    import torch

    try:
        args, kwargs = spec.make_inputs(shape, getattr(torch, dtype), "cuda")
        args = list(args)
        grads = [i for i in spec.grad_args if isinstance(args[i], torch.Tensor) and args[i].is_floating_point()]
        backward = "bwd" in phases and bool(grads)
        for i in grads:
            args[i] = args[i].detach().requires_grad_(backward)
        out = {}
        with torch.set_grad_enabled(backward):
            out["fwd"] = kernel_ms(lambda: spec.fn(*args, **kwargs), reps)
            if backward:
                res = [t for t in tensors(spec.fn(*args, **kwargs)) if t.requires_grad]
                gouts = [torch.randn_like(t) for t in res]
                ins = [args[i] for i in grads]
                out["bwd"] = kernel_ms(lambda: torch.autograd.grad(res, ins, gouts, retain_graph=True), reps)
        return out
    except Exception as e:  # out of memory, a shape the op refuses: say so, fall back to the table
        return {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
    finally:
        torch.cuda.empty_cache()


# --- the committed results table ---

def results_table(gpu: str, root: Path | None = RESULTS) -> Path | None:
    """The results table of this GPU, <root>/<gpu>.csv ("h100.csv" for "NVIDIA H100 80GB HBM3"), if there is one."""
    if root is None:
        return None
    path = results.table_path(gpu, root)
    return path if path.is_file() else None


@lru_cache(maxsize=8)
def _table_rows(path: str, mtime_ns: int) -> tuple:
    """kernelkit's % of roof rows, the newest of each key (end to end and kernels only)."""
    return tuple(results.latest(results.read(path), impl="kernelkit", metric=("pct_roof", "kernel_pct_roof")))


def _parse_shape(text: str) -> tuple:
    out = []
    for part in str(text).split("x"):
        out.append(part == "True" if part in ("True", "False") else int(part) if part.isdigit() else part)
    return tuple(out)


def table_efficiency(table: Path | None, op: str, shape: tuple, dtype: str, phase: str) -> tuple[float, str] | None:
    """(kernelkit's fraction of the roof, the row it comes from) at the nearest benchmarked shape: the same
    rank and flags (causal), the smallest summed log-ratio of the sizes; then the same dtype, kernel-only
    timings (the trace times today's calls by their kernels), the newest row."""
    if table is None:
        return None
    table = Path(table)
    best = None
    for r in _table_rows(str(table), table.stat().st_mtime_ns):
        if r["op"] != op or r["mode"] != phase or r["value"] <= 0:
            continue
        theirs = _parse_shape(r["shape"])
        if len(theirs) > len(shape) or len(theirs) < min(len(shape), 2):
            continue  # a shorter table shape leaves trailing arguments at their defaults (attention's GQA heads)
        flags = [(a, b) for a, b in zip(theirs, shape) if isinstance(a, bool) or isinstance(b, bool)]
        sizes = [(a, b) for a, b in zip(theirs, shape) if not (isinstance(a, bool) or isinstance(b, bool))]
        if any(a != b for a, b in flags) or not all(isinstance(a, int) and a > 0 and b > 0 for a, b in sizes):
            continue
        dist = (len(shape) - len(theirs), round(sum(abs(math.log(a / b)) for a, b in sizes), 6),
                r["dtype"] != dtype, r["metric"] != "kernel_pct_roof", -results.parse_time(r["timestamp"]).timestamp())
        if best is None or dist < best[0]:
            kind = "kernels" if r["metric"] == "kernel_pct_roof" else "end to end"
            best = (dist, r["value"] / 100.0, f"{table.name}: {op} {r['shape']} {r['dtype']} {r['mode']} ({kind}), "
                                              f"{r['timestamp'][:10]}")
    return None if best is None else (min(best[1], 1.0), best[2])


def floor_at(spec, shape: tuple, dtype: str, phase: str, ceilings: Ceilings) -> float | None:
    """The roofline floor (ms) of one kernelkit call at `shape`, from the registry's cost model."""
    import torch

    try:
        args, kwargs = spec.make_inputs(shape, getattr(torch, dtype), "meta")
        c = spec.cost(*args, **kwargs, backward=phase == "bwd")
        return place(Cost(float(c.flops), float(c.bytes), c.dtype), ceilings).floor_ms
    except Exception:
        return None


class Projector:
    """kernelkit's time for a unit of replaced calls, and which source gave it."""

    def __init__(self, ceilings: Ceilings, kernel_times: dict | None, tables: Path | None):
        self.ceilings, self.times = ceilings, kernel_times or {}
        self.table = results_table(ceilings.gpu, tables)
        self.specs = registry.all_ops()

    def ms(self, op: str, shape_dtype: tuple | None, phase: str, calls: float, fused_floor_ms: float
           ) -> tuple[float, str, str]:
        """(ms for `calls` kernelkit calls, "timed" | "table" | "roofline", the source in words)."""
        spec = self.specs.get(op)
        if shape_dtype is not None and spec is not None:
            shape, dtype = shape_dtype
            timed = self.times.get(shape_key(op, shape, dtype), {})
            if timed.get(phase):
                return timed[phase] * calls, "timed", f"timed on this GPU at {'x'.join(map(str, shape))} {dtype}"
            eff = table_efficiency(self.table, op, shape, dtype, phase)
            floor = floor_at(spec, shape, dtype, phase, self.ceilings)
            if eff is not None and floor:
                return floor / eff[0] * calls, "table", f"{eff[0]:.0%} of roof in {eff[1]}"
        return (fused_floor_ms / ROOFLINE_EFFICIENCY, "roofline",
                f"assumed {ROOFLINE_EFFICIENCY:.0%} of the fused floor (no timing, no table)")


# --- what kernelkit.patch would do to this model ---

def patch_module():
    """The kernelkit.patch package (imported here, lazily: the profiler must work without it)."""
    import importlib

    return importlib.import_module("kernelkit.patch")


def patch_coverage(model) -> dict:
    """Patch and unpatch `model` at once (no forward runs) to read what kernelkit.patch(model) replaces:
    {"family": ..., "replaced": {switch: [module classes]}, "skipped": [[what, why]]}, or {"error": why}."""
    try:
        kpatch = patch_module()
    except Exception as e:  # being written, or transformers missing: the findings say so
        return {"error": f"kernelkit.patch is not importable ({type(e).__name__}: {e})"}
    if not hasattr(model, "modules"):
        return {"error": "not an nn.Module"}
    try:
        report = kpatch.patch(model)
    except Exception as e:
        return {"error": " ".join(str(e).split())[:300]}
    kpatch.unpatch(model)
    replaced: dict[str, list[str]] = {}
    for r in report.replaced:  # by switch: the decoder layers' fused add goes with the norms
        targets = replaced.setdefault(PATCH_SWITCH.get(r.kind, r.kind), [])
        if r.target not in targets:
            targets.append(r.target)
    return {"family": report.family, "replaced": replaced, "skipped": [list(s) for s in report.skipped]}


def apply_text(op: str, klass: str, coverage: dict | None) -> str:
    """How to apply a registry op to the model: the kernelkit.patch call and its switch, or the op to call."""
    switch = PATCH_SWITCH.get(op)
    direct = f"call kernelkit.{op} in {klass}'s forward"
    if switch is None:
        return f"{direct} (kernelkit.patch does not swap {op})"
    only_off = f"switch {switch}: kernelkit.patch(model, {switch}=False) keeps the rest without it"
    if not coverage:
        return f"apply with kernelkit.patch(model) on a Hugging Face model ({only_off})"
    if coverage.get("error"):
        return f"kernelkit.patch(model) does not take this model ({coverage['error']}); {direct}"
    if switch in coverage.get("replaced", {}):
        return f"apply with kernelkit.patch(model) ({only_off})"
    why = next((w for what, w in coverage.get("skipped", []) if klass in what or switch in what), "")
    return f"kernelkit.patch(model) leaves it alone{f' ({why})' if why else ''}; {direct}"
