"""The launch-overhead finding with measured figures: the profiler's own share of the idle time, the
projection from the unprofiled idle time, and the saving CUDA graphs measured."""

from __future__ import annotations

import pytest
import torch

from kernelkit.hw import sustain as sustain_mod
from kernelkit.profile.findings import measured_overhead
from kernelkit.profile.overhead import combine, gpu_activity, measure_overhead, slower_in_graph

# The profiled timeline of a step (analysis.overhead's figures), 348 kernels, 20% idle under the profiler.
PROFILED = {"predicted": False, "wall_ms": 110.0, "busy_ms": 88.0, "idle_ms": 22.0, "idle_pct": 20.0,
            "kernels_per_step": 348.0, "graph_gain_ms": 21.65, "graph_gain_pct": 19.7, "bound": True}


def test_profiler_overhead_is_separated_from_the_models():
    o = combine(PROFILED, {"plain_ms": 91.5, "graph_ms": 89.8, "graph_method": "torch.cuda.graph",
                           "graph_errors": [], "steps": 5})
    assert o["profiler_ms"] == pytest.approx(18.5)
    assert o["unprofiled_idle_ms"] == pytest.approx(3.5)
    assert o["projected_gain_ms"] == pytest.approx(3.5 - 0.348)
    assert o["measured_gain_ms"] == pytest.approx(1.7)
    text = measured_overhead(o)
    assert "the profiler itself adds 18.5 ms" in text
    assert "a saving of 1.7 ms/step (2%)" in text
    assert "not worth graphs" in text


def test_a_real_saving_is_not_called_the_profilers():
    o = combine(PROFILED, {"plain_ms": 105.0, "graph_ms": 90.0, "graph_method": "torch.cuda.graph",
                           "graph_errors": [], "steps": 5})
    text = measured_overhead(o)
    assert "a saving of 15.0 ms/step (14%)" in text and "not worth" not in text


def test_no_graph_method_says_why():
    o = combine(PROFILED, {"plain_ms": 100.0, "graph_errors": ["graphed: RuntimeError: capture failed"],
                           "steps": 5})
    assert "measured_gain_ms" not in o
    assert "graphs could not be measured (graphed: RuntimeError: capture failed)" in measured_overhead(o)


def _kernel(ts, dur, name="k", cat="kernel"):
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name}


def test_gpu_activity_counts_busy_time_once_and_gaps_between():
    events = [_kernel(0, 10, "a"), _kernel(5, 10, "b"),  # overlapping: busy 15, not 20
              _kernel(20, 5, "a"), _kernel(26, 2, "set", "gpu_memset"),
              {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 100, "name": "aten::mm"},  # host events do not count
              {"ph": "i", "cat": "kernel", "ts": 50, "name": "instant"}]
    got = gpu_activity(events, reps=2)
    assert got["kernels"] == 2.0
    assert got["busy_ms"] == pytest.approx(22 / 2 / 1e3)
    assert got["gaps_ms"] == pytest.approx((28 - 22) / 2 / 1e3)
    assert got["by_name"] == {"a": pytest.approx(15 / 2 / 1e3), "b": pytest.approx(10 / 2 / 1e3),
                              "set": pytest.approx(2 / 2 / 1e3)}


def test_slower_in_graph_needs_both_an_absolute_and_a_relative_change():
    eager = {"cudnn_bprop": 4.3, "gemm": 20.0, "tiny": 0.01, "same": 1.0}
    graphed = {"cudnn_bprop": 11.6, "gemm": 20.15, "tiny": 0.09, "same": 1.0, "new": 0.5}
    got = slower_in_graph(eager, graphed)
    assert [r["kernel"] for r in got] == ["cudnn_bprop", "new"]  # gemm: +0.15 ms but <10%; tiny: under 0.1 ms
    assert got[0] == {"kernel": "cudnn_bprop", "eager_ms": 4.3, "graph_ms": 11.6}


def test_projection_from_the_light_runs_gaps_and_the_saving_split():
    # The H100 figures of the unpatched Llama-3.2-1B-shaped step (2026-11-26): 728 kernels, 2.06 ms of gaps; in
    # the graph the gaps shrink to 0.64 ms but cuDNN's attention runs longer.
    measured = {"plain_ms": 139.6, "graph_ms": 150.1, "graph_method": "torch.cuda.graph", "graph_errors": [],
                "steps": 5, "light": {"kernels": 728.0, "busy_ms": 139.06, "gaps_ms": 2.06},
                "graph_light": {"kernels": 755.0, "busy_ms": 149.88, "gaps_ms": 0.64},
                "slower_in_graph": [{"kernel": "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26",
                                     "eager_ms": 4.26, "graph_ms": 11.59}]}
    o = combine(PROFILED, measured)
    assert o["unprofiled_idle_ms"] == pytest.approx(2.06)
    assert o["projected_gain_ms"] == pytest.approx(2.06 - 0.728)
    assert o["measured_gain_ms"] == pytest.approx(-10.5)
    assert o["graph_gap_gain_ms"] == pytest.approx(1.42)
    # the kernels' own time from the timed steps less their gaps (not the profiled graph's busy time)
    assert o["graph_kernel_delta_ms"] == pytest.approx((150.1 - 0.64) - (139.6 - 2.06))
    assert o["graph_gap_gain_ms"] - o["graph_kernel_delta_ms"] == pytest.approx(o["measured_gain_ms"])
    text = measured_overhead(o)
    assert "a saving of -10.5 ms/step" in text
    assert "gaps between kernels -1.4 ms, the kernels' own time +11.9 ms inside the graph" in text
    assert "slower captured than eager: cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f... 4.3 -> 11.6 ms" in text
    assert "not worth graphs" in text


def test_sustain_runs_for_the_time_asked_then_stops(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(sustain_mod.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(sustain_mod.torch.cuda, "synchronize", lambda: None)
    calls = []

    def step(ms=90.0):
        calls.append(1)
        clock[0] += ms / 1e3
    assert sustain_mod.sustain(step, min_steps=1, seconds=1.0) == 12  # 11 x 90 ms < 1 s <= 12 x 90 ms
    calls.clear()
    assert sustain_mod.sustain(lambda: step(1.0), min_steps=1, seconds=1.0) == sustain_mod.SUSTAIN_MAX_STEPS
    assert sustain_mod.sustain(lambda: step(2000.0), min_steps=3, seconds=1.0) == 3


class _Tiny(torch.nn.Module):
    """Many tiny kernels: a step that is launch-bound on any GPU."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(40))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphs_are_measured_on_a_launch_bound_step():
    model = _Tiny().cuda()
    x = torch.randn(4, 32, device="cuda")
    got = measure_overhead(model, (x,), backward=True, steps=5)
    assert got["graph_method"] == "torch.cuda.graph", got["graph_errors"]
    assert 0 < got["graph_ms"] < got["plain_ms"]
    assert got["light"]["kernels"] >= 80 and got["light"]["gaps_ms"] > got["graph_light"]["gaps_ms"]
    assert got["slower_in_graph"] == [] or all(r["graph_ms"] > r["eager_ms"] for r in got["slower_in_graph"])
    assert all(p.grad is None for p in model.parameters())  # the measurement leaves no gradients behind
    assert got["graph_light"]["kernels"] == got["light"]["kernels"]  # the graph ran the same step (no grad adds)
