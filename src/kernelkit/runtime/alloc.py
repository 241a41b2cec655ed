"""Output allocation that the correctness harness can poison.

Launchers allocate their outputs through `empty`/`empty_like`. Inside `poisoned_outputs()` those
buffers start as NaN (floats) or all-ones bits (integers), so an element the kernel forgot to
write shows up as a failure instead of passing on whatever memory happened to hold.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_state = threading.local()


def enabled() -> bool:
    return getattr(_state, "on", False)


@contextlib.contextmanager
def poisoned_outputs(on: bool = True):
    prev = enabled()
    _state.on = on
    try:
        yield
    finally:
        _state.on = prev


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(-1)
    return t


def empty(*shape, dtype, device) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype, device=device)
    return _poison(t) if enabled() else t


def empty_like(x: torch.Tensor, dtype=None) -> torch.Tensor:
    t = torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)
    return _poison(t) if enabled() else t
