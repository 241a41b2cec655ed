"""Timing at the clock a training loop runs at.

A GPU that has idled runs its first second of work at boost clock; a training loop runs at the clock its power cap
sustains (an H100 SXM at 700 W: 1.5-1.9 GHz on a GEMM-heavy step, not 1.98). Timed at boost, kernels look 5-10%
shorter than in the loop, and a step whose host keeps up at the sustained clock looks host-bound (docs/profile.md,
"Launch overhead, measured"). So whatever times a model step (the profile, its overhead measurement, `bench
model`) warms up with `sustain` first.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

SUSTAIN_S = 1.0
SUSTAIN_MAX_STEPS = 50


def sustain(step: Callable[[], object], min_steps: int = 1, seconds: float | None = None) -> int:
    """Run `step` at least `min_steps` times and until `seconds` (SUSTAIN_S) of GPU work have passed (at most
    SUSTAIN_MAX_STEPS steps), then synchronize; returns how many steps ran."""
    seconds = SUSTAIN_S if seconds is None else seconds
    t0, n = time.perf_counter(), 0
    while n < min_steps or (time.perf_counter() - t0 < seconds and n < SUSTAIN_MAX_STEPS):
        step()
        n += 1
        if n >= min_steps:
            torch.cuda.synchronize()  # time the GPU's work, not how far the host ran ahead
    torch.cuda.synchronize()
    return n
