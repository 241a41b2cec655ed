"""Cooperative rows: one row split over a group of programs that keep their chunk on chip and exchange the row's
statistics, so that a row too long for one program is still read once and written once.

A launch runs `groups × splits` programs. Program p works on chunk `p % splits` of rows `p // splits`,
`p // splits + groups`, ... : it loads its chunk into registers, reduces it to one or two fp32 numbers (a max and
a sum, a sum of squares, a dot), publishes them, waits until the group's other programs have published theirs for
the same row, combines them and writes its chunk of the output from the registers. Nothing is read twice.

The exchange goes through global memory: each group has a counter and two banks of partials (even and odd steps
of its row loop, so that a program already one row ahead never overwrites partials a slower one still reads). A
program stores its partials, passes a CTA barrier, adds one to the counter (acq_rel, GPU scope) and spins on the
counter (atomic reads) until the whole group has arrived for this step; the partials are then read with volatile
loads. Polling with plain volatile loads instead (one atomic after) measured 1.4-1.9x slower on the H100. Programs
that wait on each other must all be resident at once: the launcher sizes the grid to the kernel's occupancy
(registers, shared memory and warps of the compiled kernel against the SM's) and launches it as a CUDA cooperative
grid, which the driver refuses (an error, not a hang) when the grid would not fit.

Triton's interpreter runs programs one after another, so a program waiting for a later one would wait forever.
There the same kernel runs in two phases instead (`PHASE` 1 then 2): the first launch only publishes every row's
partials (one bank per row), the second reads them and writes the output. The arithmetic, chunking and masking are
the cooperative kernel's own; only the wait differs. Tests may ask for the phases on the GPU too (`phased=True`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import cdiv, interpreting, launch, next_pow2, num_sms

# Chunk lengths are multiples of this many elements: aligned vector loads at every chunk start.
ALIGN = 64


@triton.jit
def coop_chunk(pid, N, CHUNK, SPLITS: tl.constexpr, BLOCK_C: tl.constexpr):
    """(slot, split index, columns, column mask) of program `pid`: chunk `pid % SPLITS` of its group's rows."""
    slot = pid // SPLITS
    g = pid - slot * SPLITS
    lo = g * CHUNK
    offs = tl.arange(0, BLOCK_C)
    cols = lo + offs
    return slot, g, cols, (offs < CHUNK) & (cols < N)


@triton.jit
def coop_row(P, row, stride, cols, ok, M):
    """This program's chunk of row `row` of P in P's dtype (nothing read past the last row): the prefetch the
    cooperative kernels issue for their next row before an exchange."""
    return tl.load(P + row.to(tl.int64) * stride + cols, mask=ok & (row < M), other=0.0)


@triton.jit
def coop_exchange(WS, CNT, slot, row, g, step, a, b, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                  PHASE: tl.constexpr):
    """Publish this program's (a, b) for `row` and return every split's (a, b) of that row as two [BLOCK_S]
    vectors (lanes past SPLITS hold 0) and their mask.

    PHASE 0 (cooperative): bank `2 * slot + step % 2`, then wait until the group's SPLITS programs have all
    arrived for `step` (the counter reaches (step + 1) * SPLITS). PHASE 1 publishes to bank `row` and returns;
    PHASE 2 reads bank `row` (written by a PHASE 1 launch) without publishing.
    """
    if PHASE == 0:
        bank = slot * 2 + step % 2
    else:
        bank = row
    base = WS + bank.to(tl.int64) * (2 * SPLITS)
    if PHASE != 2:
        tl.store(base + g, a)
        tl.store(base + SPLITS + g, b)
    if PHASE == 0:
        tl.debug_barrier()  # every thread's stores before the arrival
        tl.atomic_add(CNT + slot, 1)
        target = (step + 1) * SPLITS
        seen = tl.atomic_add(CNT + slot, 0)
        while seen < target:
            seen = tl.atomic_add(CNT + slot, 0)
        tl.debug_barrier()
    idx = tl.arange(0, BLOCK_S)
    ok = idx < SPLITS
    av = tl.load(base + idx, mask=ok, other=0.0, volatile=True)
    bv = tl.load(base + SPLITS + idx, mask=ok, other=0.0, volatile=True)
    return av, bv, ok


def split_row(n: int, max_chunk: int) -> tuple[int, int]:
    """(splits, chunk): the fewest chunks of at most `max_chunk` columns (rounded up to ALIGN) covering n."""
    if max_chunk < ALIGN or max_chunk % ALIGN:
        raise ValueError(f"max_chunk must be a positive multiple of {ALIGN}, got {max_chunk}")
    splits = cdiv(n, max_chunk)
    chunk = cdiv(cdiv(n, splits), ALIGN) * ALIGN
    return cdiv(n, chunk), chunk


def _occupancy(compiled, props) -> int:
    """Programs of a compiled kernel one SM holds: the least of what registers, shared memory and warps allow."""
    warps = compiled.metadata.num_warps
    regs_per_warp = cdiv(max(compiled.n_regs, 1) * 32, 256) * 256  # allocated per warp, 256 at a time
    by_regs = (props.regs_per_multiprocessor // regs_per_warp) // warps
    by_warps = (props.max_threads_per_multi_processor // 32) // warps
    shared = compiled.metadata.shared + 1024  # the driver reserves 1 KB per block
    by_smem = props.shared_memory_per_multiprocessor // shared
    return max(0, min(by_regs, by_warps, by_smem, 32))


_RESIDENT: dict = {}


def _spec_of(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, int) and not isinstance(a, bool):
        return (a % 16 == 0, a == 1)
    return type(a)


def _key(kernel, device, args, kwargs):
    return (kernel, device.index, tuple(sorted(kwargs.items())), tuple(_spec_of(a) for a in args))


def resident(kernel, device: torch.device, args: tuple, kwargs: dict) -> int:
    """Programs of `kernel` (a plain triton.jit) compiled for these arguments that one SM holds at once. Compiles
    the kernel (once per specialization) to read its registers and shared memory."""
    spec = _key(kernel, device, args, kwargs)
    hit = _RESIDENT.get(spec)
    if hit is None:
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
        compiled._init_handles()
        hit = _RESIDENT[spec] = _occupancy(compiled, torch.cuda.get_device_properties(device))
    return hit


def launch_rows(kernel, m: int, n: int, max_chunk: int, args: tuple, kwargs: dict, device: torch.device,
                per_sm: int = 2, phased: bool = False) -> bool:
    """Run cooperative `kernel` over m rows of n columns, each row split into chunks of at most `max_chunk`.

    The kernel's signature starts (WS, CNT, M, N, CHUNK, *args) and takes SPLITS, BLOCK_C, BLOCK_S and PHASE as
    constexprs (set here) besides `kwargs`. At most `per_sm` programs per SM (fewer where the compiled kernel
    does not fit that many). Returns False, launching nothing, where one row needs more programs than the GPU
    holds at once: the caller takes another path. On the interpreter, the CPU, or with `phased`, it runs as two
    launches (module docstring). `args` may be a function of the number of groups (for outputs sized by it, a
    per-group partial say) returning the tuple."""
    splits, chunk = split_row(n, max_chunk)
    args_of = args if callable(args) else (lambda groups: args)
    consts = dict(kwargs, SPLITS=splits, BLOCK_C=next_pow2(chunk), BLOCK_S=next_pow2(splits))
    if phased or interpreting() or device.type != "cuda":
        groups = min(m, 2)  # two groups: the row stride is exercised
        ws = torch.empty(m * 2 * splits, dtype=torch.float32, device=device)
        cnt = torch.zeros(1, dtype=torch.int32, device=device)
        args = args_of(groups)
        for phase in (1, 2):
            launch(kernel, (groups * splits,), None, ws, cnt, m, n, chunk, *args, PHASE=phase, **consts)
        return True
    coop = dict(consts, PHASE=0, launch_cooperative_grid=True)
    cnt = torch.zeros(per_sm * num_sms(device), dtype=torch.int32, device=device)
    key_args = (cnt, cnt, m, n, chunk, *args_of(1))
    per_sm = min(per_sm, resident(kernel, device, key_args, coop))
    while per_sm >= 1:
        groups = min(m, (per_sm * num_sms(device)) // splits)
        if groups < 1:
            return False
        ws = torch.empty(groups * 4 * splits, dtype=torch.float32, device=device)
        try:
            launch(kernel, (groups * splits,), None, ws, cnt[:groups], m, n, chunk, *args_of(groups), **coop)
            return True
        except RuntimeError as e:
            # The driver refuses a cooperative grid that would not be resident at once (nothing ran): the
            # occupancy estimate was high (measured on the H100 at 4 programs of 4 warps per SM). One fewer per SM,
            # remembered for this specialization.
            if "cooperative launch" not in str(e):
                raise
            per_sm -= 1
            _RESIDENT[_key(kernel, device, key_args, coop)] = per_sm
    return False
