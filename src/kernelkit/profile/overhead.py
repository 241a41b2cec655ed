"""The launch-overhead advice, measured: the step without the profiler, and with CUDA graphs.

The profiler's timeline shows where the GPU idles between kernels, but the profiler widens those gaps itself
(it records every launch on the host). So where the timeline says the step is overhead-bound,
`measure_overhead` first runs the step for a second (`hw.sustain`: the GPU settles at the clock its power cap
sustains, as in a training loop), then times the same step three ways, each the median of several steps:
- **plain**: no profiler;
- **light**: a few steps under torch.profiler recording only the GPU's activity (no CPU events, no dispatch
  recorder): the kernels' busy time, the gaps between them, and each kernel's time by name;
- **graphed**: one CUDA graph replaying the whole step, captured with `torch.cuda.graph`, timed, then a few
  replays under the same light profiler (CUPTI records a graph's kernels). Where the model does not allow capture
  (a host synchronisation, an allocation the graph cannot own), it falls back to
  `torch.compile(mode="reduce-overhead")`, which cuts the step into graphs around its breaks.

The projection is the light run's gaps less GRAPH_GAP_US per kernel (what a graph keeps between kernels; about
1-1.7 us measured on the H100). `combine` sets it beside the measured saving (plain - graphed) and splits that
saving into the gaps the graph removed and the change of the kernels' own time inside the graph. Two things no
launch-overhead projection foresees show up there: a kernel that runs slower captured (cuDNN's attention ran
2.7x longer in a graph than eager on the H100, torch 2.11: the finding names such kernels), and a GPU at its
power cap, where the idle gaps a graph removes were paid back in clock.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Callable

import torch

from ..hw.sustain import sustain
from . import kineto
from .analysis import GRAPH_GAP_US
from .trace import _export, _run_step, _zero_grad

# A kernel (by name) counts as slower inside the graph from this much more time per step, and this share.
SLOWER_MS, SLOWER_SHARE = 0.1, 0.1


def _median_ms(fn: Callable[[], object], steps: int) -> float:
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gpu_activity(events: list[dict], reps: int) -> dict:
    """Per repetition: kernels, busy ms (union of the GPU's kernel, memcpy and memset intervals), gaps ms between
    them (first start to last end, less busy), and ms by kernel name."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", ""))
                   for e in events if e.get("ph") == "X" and e.get("cat") in kineto.DEVICE_CATS)
    busy, end, by_name = 0.0, None, defaultdict(float)
    for s, e, name in spans:
        by_name[name] += (e - s) / reps / 1e3
        busy += max(e - max(s, end if end is not None else s), 0.0)
        end = e if end is None else max(end, e)
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    return {"kernels": len(spans) / reps, "busy_ms": busy / reps / 1e3, "gaps_ms": (span - busy) / reps / 1e3,
            "by_name": dict(by_name)}


def _light_profile(fn: Callable[[], object], reps: int = 3) -> dict:
    """`gpu_activity` of `reps` calls of `fn` under torch.profiler with CUDA activity only."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):  # synchronized as the plain timing is: the gap before a step's first kernel counts
            fn()
            torch.cuda.synchronize()
    return gpu_activity(_export(prof), reps)


def slower_in_graph(eager: dict, graphed: dict, top: int = 3) -> list[dict]:
    """Kernels (by name) that took SLOWER_MS and SLOWER_SHARE more time per step inside the graph, most first."""
    out = []
    for name, g in graphed.items():
        e = eager.get(name, 0.0)
        if g - e >= SLOWER_MS and g - e >= SLOWER_SHARE * e:
            out.append({"kernel": name, "eager_ms": e, "graph_ms": g})
    return sorted(out, key=lambda r: r["eager_ms"] - r["graph_ms"])[:top]


def _graphed(model, inputs, backward: bool, steps: int) -> tuple[float, str, dict]:
    """(ms per step replaying one CUDA graph of the step, "torch.cuda.graph", the replay's GPU activity).
    Raises where it cannot capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
        for _ in range(2):
            _run_step(model, inputs, backward)
    torch.cuda.current_stream().wait_stream(side)
    # Gradients from the warm-up would turn the captured backward's writes into accumulations (one more kernel
    # per parameter, ~3 ms at Llama-3-8B shapes): capture the step as the plain one runs it, from no gradients.
    _zero_grad(model)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            _run_step(model, inputs, backward)
        graph.replay()
        ms = _median_ms(graph.replay, steps)
        return ms, "torch.cuda.graph", _light_profile(graph.replay)
    finally:
        del graph
        _zero_grad(model)


def _compiled(model, inputs, backward: bool, steps: int) -> tuple[float, str, dict]:
    compiled = torch.compile(model, mode="reduce-overhead")
    t0 = time.perf_counter()
    for _ in range(3):  # compile, record, then replays
        _run_step(compiled, inputs, backward)
        _zero_grad(model)
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0

    def step():
        _run_step(compiled, inputs, backward)
        _zero_grad(model)
    return (_median_ms(step, steps), f"torch.compile(mode='reduce-overhead') (compiled in {warm:.0f} s)",
            _light_profile(step))


def measure_overhead(model, inputs, backward: bool = True, steps: int = 5,
                     progress: Callable[[str], None] | None = None) -> dict:
    """Plain and graphed ms per step, the method that graphed it, why a method failed, the GPU activity of both
    (`light`, `graph_light`: kernels, busy and gap ms per step) and the kernels slower inside the graph. JSON-able."""
    say = progress or (lambda text: None)

    def plain():
        _run_step(model, inputs, backward)
        _zero_grad(model)

    say("timing the step without the profiler")
    sustain(plain)
    out: dict = {"plain_ms": _median_ms(plain, steps), "steps": steps, "graph_errors": []}
    eager = _light_profile(plain)
    by_name = eager.pop("by_name")
    out["light"] = eager
    for method in (_graphed, _compiled):
        say("timing the step " + ("in one CUDA graph" if method is _graphed
                                  else "under torch.compile(mode='reduce-overhead')"))
        try:
            out["graph_ms"], out["graph_method"], graphed = method(model, inputs, backward, steps)
            named = graphed.pop("by_name")  # torch.compile's kernels are its own: compare names only in one graph
            out["slower_in_graph"] = slower_in_graph(by_name, named) if method is _graphed else []
            out["graph_light"] = graphed
            break
        except Exception as e:  # the model does not allow this method: say why, try the next
            out["graph_errors"].append(f"{method.__name__.strip('_')}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            torch.cuda.synchronize()
    _zero_grad(model)
    return out


def combine(profiled: dict, measured: dict) -> dict:
    """The timeline's overhead figures (analysis.overhead) with the measured ones: what the profiler added, the
    step's own idle time, the projection from its gaps, and the measured saving split into gaps and kernel time."""
    o = dict(profiled)
    plain = measured.get("plain_ms")
    o.update({k: v for k, v in measured.items() if k != "steps"})
    if plain is None:
        return o
    light, kernels = measured.get("light"), o.get("kernels_per_step", 0.0)
    o["profiler_ms"] = o.get("wall_ms", plain) - plain  # what the profiler added to the step's wall time
    if light:  # the step's own gaps, at the sustained clock, with no host-side recording
        idle, kernels = light["gaps_ms"], light["kernels"]
    else:  # older callers: the timeline's busy time
        idle = max(plain - o.get("busy_ms", 0.0), 0.0)
    o["unprofiled_idle_ms"] = idle
    o["unprofiled_idle_pct"] = 100.0 * idle / plain if plain else 0.0
    o["projected_gain_ms"] = max(idle - kernels * GRAPH_GAP_US / 1e3, 0.0)
    if "graph_ms" in measured:
        o["measured_gain_ms"] = plain - measured["graph_ms"]
        o["measured_gain_pct"] = 100.0 * o["measured_gain_ms"] / plain if plain else 0.0
        graphed = measured.get("graph_light")
        if light and graphed:
            # measured saving = gaps removed - what the kernels themselves took longer. The kernels' time is each
            # timed step less its profiled gaps: under the profiler a graph's kernels run longer (CUPTI records
            # each node: +5 ms over 400 kernels on the H100), so its busy time there overstates them.
            o["graph_gap_gain_ms"] = light["gaps_ms"] - graphed["gaps_ms"]
            o["graph_kernel_delta_ms"] = ((measured["graph_ms"] - graphed["gaps_ms"])
                                          - (plain - light["gaps_ms"]))
    return o
