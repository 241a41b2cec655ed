"""The launch-overhead advice, measured: the step without the profiler, and with CUDA graphs.

The profiler's timeline shows where the GPU idles between kernels, but the profiler widens those gaps itself
(it records every launch on the host). So where the timeline says the step is overhead-bound,
`measure_overhead` times the same step three ways, each the median of several steps after warm-up:
- **plain**: no profiler. `plain - GPU busy time` is the idle time the model really has.
- **graphed**: one CUDA graph replaying the whole step, captured with `torch.cuda.graph`. Where the model
  does not allow capture (a host synchronisation, an allocation the graph cannot own), it falls back to
  `torch.compile(mode="reduce-overhead")`, which cuts the step into graphs around its breaks.
- **profiled**: the timeline's own wall time, for comparison.

The finding then says how much of the idle time the profiler added, projects the saving from the
unprofiled idle time, and sets that projection beside the measured saving. The projection is the idle time
less 1 us per kernel, which even a graph keeps between kernels.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from .analysis import GRAPH_GAP_US
from .trace import _run_step, _zero_grad


def _median_ms(fn: Callable[[], object], steps: int) -> float:
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _graphed(model, inputs, backward: bool, steps: int) -> tuple[float, str]:
    """(ms per step replaying one CUDA graph of the step, "torch.cuda.graph"). Raises where it cannot capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
        for _ in range(2):
            _run_step(model, inputs, backward)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            _run_step(model, inputs, backward)
        graph.replay()
        return _median_ms(graph.replay, steps), "torch.cuda.graph"
    finally:
        del graph
        _zero_grad(model)


def _compiled(model, inputs, backward: bool, steps: int) -> tuple[float, str]:
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
    return _median_ms(step, steps), f"torch.compile(mode='reduce-overhead') (compiled in {warm:.0f} s)"


def measure_overhead(model, inputs, backward: bool = True, steps: int = 5,
                     progress: Callable[[str], None] | None = None) -> dict:
    """Plain and graphed ms per step, the method that graphed it, and why a method failed. JSON-able."""
    say = progress or (lambda text: None)

    def plain():
        _run_step(model, inputs, backward)
        _zero_grad(model)

    say("timing the step without the profiler")
    plain()
    out: dict = {"plain_ms": _median_ms(plain, steps), "steps": steps, "graph_errors": []}
    for method in (_graphed, _compiled):
        say("timing the step " + ("in one CUDA graph" if method is _graphed
                                  else "under torch.compile(mode='reduce-overhead')"))
        try:
            out["graph_ms"], out["graph_method"] = method(model, inputs, backward, steps)
            break
        except Exception as e:  # the model does not allow this method: say why, try the next
            out["graph_errors"].append(f"{method.__name__.strip('_')}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            torch.cuda.synchronize()
    _zero_grad(model)
    return out


def combine(profiled: dict, measured: dict) -> dict:
    """The timeline's overhead figures (analysis.overhead) with the measured ones: how much of the profiled
    idle time the profiler added, the projection from the unprofiled idle time, and the measured saving."""
    o = dict(profiled)
    plain = measured.get("plain_ms")
    o.update({k: v for k, v in measured.items() if k != "steps"})
    if plain is None:
        return o
    busy, kernels = o.get("busy_ms", 0.0), o.get("kernels_per_step", 0.0)
    idle = max(plain - busy, 0.0)
    o["profiler_ms"] = o.get("wall_ms", plain) - plain  # what the profiler added to the step's wall time
    o["unprofiled_idle_ms"] = idle
    o["unprofiled_idle_pct"] = 100.0 * idle / plain if plain else 0.0
    o["projected_gain_ms"] = max(idle - kernels * GRAPH_GAP_US / 1e3, 0.0)
    if "graph_ms" in measured:
        o["measured_gain_ms"] = plain - measured["graph_ms"]
        o["measured_gain_pct"] = 100.0 * o["measured_gain_ms"] / plain if plain else 0.0
    return o
