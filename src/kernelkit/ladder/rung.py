"""What a rung of the ladder is (`Rung`), what it runs (`Launch`), and the operand check every hgemm rung
shares: the floor under the rung modules, so they never import the package that lists them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

KINDS = ("sgemm", "hgemm")


@dataclass
class Launch:
    """One rung bound to its tensors: `run()` writes A @ B into C; `params` is the configuration it runs
    (tile sizes, stages...), recorded in the results and handed to the profiled re-run."""

    run: Callable[[], None]
    params: dict = field(default_factory=dict)


def _any_shape(m: int, n: int, k: int) -> Optional[str]:
    return None


@dataclass(frozen=True)
class Rung:
    name: str
    what_changed: str  # one line for the table
    expect: str  # the profiler signature that shows the step landed
    kernel: str  # the kernel's name as the profiler lists it
    # (a, b, c, params=None) -> Launch; params=None: the rung's own choice (it may time a few configs first)
    build: Callable[..., Launch]
    # why this rung cannot run an M x N x K problem, or None when it can
    needs: Callable[[int, int, int], Optional[str]] = _any_shape


def check_bf16_operands(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """a (M, K) @ b (K, N) -> c (M, N), all 2-D bfloat16: the hgemm rungs' operands."""
    for t, name in ((a, "a"), (b, "b"), (c, "c")):
        if t.dtype != torch.bfloat16 or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D bfloat16 tensor, got {t.dtype} with {t.dim()} dims")
    if a.shape[1] != b.shape[0] or tuple(c.shape) != (a.shape[0], b.shape[1]):
        raise ValueError(f"shapes do not chain: a {tuple(a.shape)} @ b {tuple(b.shape)} -> c {tuple(c.shape)}")
