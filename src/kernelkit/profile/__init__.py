"""Measure first: a model's ops on the roofline of the GPU's measured ceilings, with a verdict per op."""

from __future__ import annotations

import torch

from ..hw.ceilings import ceilings_for
from .analysis import Report, Thresholds, analyze
from .trace import measure, predict


def profile(model: torch.nn.Module, inputs: tuple, steps: int = 3, warmup: int = 1, backward: bool = True,
            gpu: str | None = None, thresholds: Thresholds | None = None) -> Report:
    """Profile `model(*inputs)` (and its backward) and place each op on the roofline.

    On a CUDA GPU (and `gpu=None`) times are measured with torch.profiler over `steps` steps against the
    measured ceilings. With `gpu="h100"` (or no GPU) nothing is timed: each op's floor is predicted
    from that datasheet and the cost models, and the report says so.
    """
    ceilings, measured = ceilings_for(gpu)
    if measured:
        records, spans, step_ms = measure(model, inputs, steps=steps, warmup=warmup, backward=backward)
        return analyze(records, ceilings, steps, True, thresholds, spans=spans, step_ms=step_ms)
    records = predict(model, inputs, backward=backward)
    return analyze(records, ceilings, 1, False, thresholds)


__all__ = ["profile", "Report", "Thresholds"]
