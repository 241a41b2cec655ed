"""Measure first: a model's ops on the roofline of the GPU's measured ceilings, with a verdict per op."""

from __future__ import annotations

import torch

from ..hw.ceilings import ceilings_for
from .analysis import Report, Thresholds, analyze, time_calls
from .projection import patch_coverage
from .trace import OpRecord, Trace, measure, predict


def profile(model: torch.nn.Module, inputs, steps: int = 3, warmup: int = 1, backward: bool = True,
            gpu: str | None = None, thresholds: Thresholds | None = None, time_kernels: bool = True) -> Report:
    """Profile `model(*inputs)` and its backward, and place each op on the roofline.

    `inputs` is a tuple of positional arguments (a dict is passed as keyword arguments); the model
    returns a loss (or a tensor, summed, or an output with `.loss`). On a CUDA GPU with `gpu=None`,
    `steps` steps after `warmup` are measured with torch.profiler against the measured ceilings
    (hw.ceilings_for, cached per device), and, with `time_kernels`, kernelkit's implementation of each op
    it could replace is timed at the model's shapes, so projected savings are measured ones. With
    `gpu="h100"` (or no GPU) nothing is timed: one step runs where the model lives (CPU or meta device)
    and each op's floor is predicted from that datasheet; projections use the committed benchmark tables.
    The Report's `.trace` holds the records, to save (`rep.trace.save(path)`) and analyze again.
    """
    ceilings, measured = ceilings_for(gpu)
    trace = measure(model, inputs, steps=steps, warmup=warmup, backward=backward) if measured else \
        predict(model, inputs, backward=backward)
    trace.patch = patch_coverage(model)
    if measured and time_kernels:
        trace.kernel_times = time_calls(trace)
    rep = analyze(trace, ceilings, thresholds)
    rep.trace = trace
    return rep


__all__ = ["profile", "analyze", "Report", "Thresholds", "Trace", "OpRecord"]
