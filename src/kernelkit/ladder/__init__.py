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

from . import hgemm, sgemm
from .rung import KINDS, Launch, Rung

__all__ = ["KINDS", "Launch", "Rung", "rungs", "get"]

_RUNGS = {"sgemm": sgemm.RUNGS, "hgemm": hgemm.RUNGS}


def rungs(kind: str) -> list[Rung]:
    """The rungs of one ladder, in order."""
    if kind not in _RUNGS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return list(_RUNGS[kind])


def get(kind: str, name: str) -> Rung:
    for r in rungs(kind):
        if r.name == name:
            return r
    raise KeyError(f"no {kind} rung named {name!r}; rungs: {', '.join(r.name for r in rungs(kind))}")
