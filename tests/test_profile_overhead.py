"""The launch-overhead finding with measured figures: the profiler's own share of the idle time, the
projection from the unprofiled idle time, and the saving CUDA graphs measured."""

from __future__ import annotations

import pytest
import torch

from kernelkit.profile.findings import measured_overhead
from kernelkit.profile.overhead import combine, measure_overhead

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
    assert all(p.grad is None for p in model.parameters())  # the measurement leaves no gradients behind
