"""What RMSNorm (ops/rms_norm/) and LayerNorm (ops/layer_norm.py) share: how their backward is laid out over
the GPU, the second stage of the weight (and bias) gradient, and the modules' input check.

Both backwards write dx row by row and reduce dweight over the rows in two stages: programs keep fp32 partial
sums in registers and write one (N,) row each to a (P, N) partial, which `column_sum` adds up over P. Rows
that fit the fused backward take `FusedBackward` (persistent programs, each over a strided set of row blocks);
wider rows take `WideBackward` (a per-row sum, then column strips over row groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ..runtime import cdiv, launch
from ..runtime.alloc import empty


@dataclass(frozen=True)
class FusedBackward:
    """How the fused backward runs rows whose block (the row width rounded up to a power of two) is at most
    `max_block_n`: `programs_per_sm` persistent programs per SM, each owning one fp32 row of the (P, N) dweight
    partial, their row loop software-pipelined `stages` deep (Triton's `tl.range(num_stages=)`: the next rows'
    loads in flight while this step reduces; None leaves the loop as written). It applies where every program
    gets `min_rows` rows or more; with fewer rows the next entry of the table does (keeping the partial, 8 bytes
    an element written and read again, small next to the rows' own traffic)."""

    max_block_n: int
    programs_per_sm: int
    stages: Optional[int] = None
    min_rows: int = 1

    def programs(self, sms: int, m: int) -> int:
        return min(m, sms * self.programs_per_sm)


def fused_backward(table: Sequence[FusedBackward], block_n: int, m: int, sms: int) -> FusedBackward:
    """The first entry of `table` that covers `block_n` and has rows enough for its programs; the last one
    past them all."""
    for entry in table:
        if block_n <= entry.max_block_n and m >= entry.min_rows * entry.programs_per_sm * sms:
            return entry
    return table[-1]


@dataclass(frozen=True)
class WideBackward:
    """How the backward runs rows over the fused backward's limit: a first kernel sums the row's products
    (x·w·dy, and w·dy for LayerNorm); a second, on a grid of `block_n`-wide column strips × row groups (about
    `programs_per_sm` programs per SM, `num_warps` warps each), writes dx of its strip `rows` rows at a time and
    keeps the strip's share of dweight in registers over its row group. x and dy are read twice (10 bytes an
    element in bf16 against 6 ideal), but every read is a plain stream.
    """

    programs_per_sm: float
    rows: int
    block_n: int
    num_warps: int

    def row_groups(self, sms: int, m: int, n: int) -> tuple[int, int, int]:
        """(strips, row groups, rows per group) for m rows of n columns: as many groups as fill the GPU at
        `programs_per_sm`, each a multiple of `rows` rows, none left empty."""
        strips = cdiv(n, self.block_n)
        groups = max(1, min(cdiv(m, self.rows), round(sms * self.programs_per_sm / strips)))
        per_group = cdiv(cdiv(m, groups), self.rows) * self.rows
        return strips, cdiv(m, per_group), per_group


@triton.jit
def dw_column_sum_kernel(PARTIAL, DW, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Second stage of dweight: sum the (P, N) fp32 partials over P, round once to the weight dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        m = (rows[:, None] < P) & (cols[None, :] < N)
        acc += tl.load(PARTIAL + rows[:, None].to(tl.int64) * N + cols[None, :], mask=m, other=0.0)
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=cols < N)


def column_sum(partial: torch.Tensor, like: torch.Tensor, sms: int) -> torch.Tensor:
    """The (N,) sum over P of a (P, N) fp32 partial, in `like`'s dtype."""
    p, n = partial.shape
    dw = empty((n,), dtype=like.dtype, device=like.device)
    # Narrow column strips so that even N = 2048 spreads over ~64+ programs. Each step of a program's loop waits
    # for its load: where strips are fewer than SMs (short rows, whose backward runs more programs, so P is
    # large), a program takes 8x the rows per step (at N = 256 and P = 1056: 5 steps, not 33).
    block_n = 32 if n <= 8192 else 128
    block_p, warps = (256, 8) if cdiv(n, block_n) < sms else (32, 4)
    launch(dw_column_sum_kernel, (cdiv(n, block_n),), None, partial, dw, p, n, BLOCK_P=block_p, BLOCK_N=block_n,
           num_warps=warps)
    return dw


def validate_trailing(x, normalized_shape, module: str) -> None:
    """The clear error for an input whose trailing dims are not the module's normalized_shape."""
    k = len(normalized_shape)
    if not isinstance(x, torch.Tensor) or x.dim() < k or tuple(x.shape[x.dim() - k:]) != tuple(normalized_shape):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{module}({tuple(normalized_shape)}) got an input of shape {got}: its last "
                         f"{k} dim(s) must be {tuple(normalized_shape)}")
