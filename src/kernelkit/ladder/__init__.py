"""The matmul optimization ladder, rung by rung, on your own GPU (`kernelkit ladder sgemm|hgemm`).

Two ladders, each a list of real kernels that compute C = A @ B (row-major, A: M x K, B: K x N):

- `sgemm` (fp32 on the CUDA cores): CUDA C in `sgemm.py`, compiled at run time through NVRTC (CuPy or
  cuda-python), from the naive one-thread-per-output kernel to warptiling with double-buffered shared memory.
- `hgemm` (bf16 on the tensor cores): Triton in `hgemm.py`, from one tile per program to a persistent kernel
  fed by TMA.

Every rung says what changed and which profiler numbers should move (`expect`); `run.py` times the rungs side
by side with cuBLAS, checks each against a float64 product first, and `signature.py` reads the Nsight Compute
counters that confirm each step landed. Read the rungs in order: that is the lesson.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

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


def rungs(kind: str) -> list[Rung]:
    """The rungs of one ladder, in order (imports the ladder's module: Triton for hgemm)."""
    if kind == "sgemm":
        from .sgemm import RUNGS
    elif kind == "hgemm":
        from .hgemm import RUNGS
    else:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return list(RUNGS)


def get(kind: str, name: str) -> Rung:
    for r in rungs(kind):
        if r.name == name:
            return r
    raise KeyError(f"no {kind} rung named {name!r}; rungs: {', '.join(r.name for r in rungs(kind))}")
