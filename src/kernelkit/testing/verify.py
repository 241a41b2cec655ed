"""Verify any candidate kernel against a reference module: the checks to run before trusting a speedup.

`check_module(candidate, reference, make_inputs)` runs every check below and returns a `VerifyReport`,
one `Finding` (check, result, detail) per check. `kernelkit check CANDIDATE.py --reference REF.py`
builds the pair from files in the KernelBench convention (`problem_files.load_problem`) and prints the report.

Each check closes one way a kernel can look right without being right:
- correctness: fresh random inputs every trial, against the reference run in float64 where it accepts
  float64 (floating inputs and the module cast), else in its own dtype; the report says which, and the
  precision the candidate achieved against the tolerance of its output dtype.
- poisoned memory: the candidate runs first on new inputs, with the allocator's free memory filled with
  0xFF bytes (NaN in every float dtype), so an output it never writes (torch.empty, skipped rows) holds
  poison instead of a stale result of the reference.
- input scales: inputs x1e-3, x100, +50, and with ±inf/NaN (NaN/Inf positions must match the reference's).
- sizes: batch 1, batch + 3 (odd) and an odd last dim, where the reference accepts them.
- caching: new inputs, and the same tensors refilled with new values, must give new results.
- determinism: identical calls; bitwise differences within tolerance are a warning, beyond it a failure.
- pending work (GPU): outputs read on the current stream right after the call returns, with no
  synchronization of other streams, must already be complete.
- output structure, aliasing, input mutation: over every call above, the candidate returns what the reference
  returns (the same structure: a tensor where it returns a tensor, not a 1-tuple holding one; a tuple or list,
  the two alike, of as many where it returns one; None where it returns None; `correctness.structure_mismatch`),
  no output shares memory with an input or with an earlier call's output, and no input changes.
- timing (GPU): do_bench (L2 flushed) of the candidate, the reference eager and torch.compile(reference).
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from .correctness import (TOLERANCES, CheckReport, _bitwise_equal, compare, leaves, rel_error, rounded_like_backend,
                          structure, structure_mismatch)
from ..runtime.alloc import poisoned_outputs
from .bench import time_ms

PASS, FAIL, WARN, SKIP, INFO = "pass", "fail", "warn", "skip", "info"
CHECKS = ("correctness", "poisoned memory", "input scales", "sizes", "caching", "determinism", "pending work",
          "output structure", "aliasing", "input mutation", "timing")


@dataclass
class Finding:
    check: str
    result: str  # pass, fail, warn (does not fail the report), skip, info
    detail: str


@dataclass
class VerifyReport:
    findings: list[Finding] = field(default_factory=list)
    device: str = "cpu"
    reference_precision: str = ""  # "float64", or the reference's own dtype and why
    errors: dict[str, float] = field(default_factory=dict)  # check -> worst relative error seen
    timings_ms: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def failed(self) -> list[str]:
        return [f.check for f in self.findings if f.result == FAIL]

    def finding(self, check: str) -> Finding:
        return next(f for f in self.findings if f.check == check)

    def to_json(self) -> dict:
        return {"ok": self.ok, "failed": self.failed, **asdict(self)}


# --- memory poisoning ---

def poison_free_memory(device: torch.device, sizes: Sequence[int] = ()) -> None:
    """Fill the memory the next allocations will get with 0xFF bytes, then free it again.

    An uninitialized output (torch.empty that the kernel never writes, or writes only in part) holds
    whatever the allocator's free block held last: in a harness that ran the reference just before, often
    the reference's own answer, and the check passes. After this, it holds 0xFF bytes: NaN in every float
    dtype, -1 in integers, so the comparison sees non-finite values where the reference is finite.

    CUDA: every free block of the caching allocator is taken (largest first: a request gets the smallest
    free block that fits, so asking for a block's exact size takes that block) and filled; `sizes` (the
    reference's output sizes, in bytes) are then allocated and filled too, so blocks of exactly those sizes
    are cached and poisoned even when none was free. CPU: there is no cache to walk; freshly freed chunks of
    `sizes` bytes are what malloc hands out next for the same size, so a few are filled and freed (best
    effort; memory that comes back from the OS is zero, which fails the comparison anyway).
    """
    held, free = [], []
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(index).cuda_stream  # the pool the candidate's allocations draw from
        free = [b["size"] for seg in torch.cuda.memory_snapshot()
                if seg.get("device", index) == index and seg.get("stream", stream) == stream
                for b in seg["blocks"] if b["state"] == "inactive"]
    try:
        for n in sorted(free, reverse=True) + [n for n in sizes if n for _ in range(3)]:
            held.append(torch.empty(n, dtype=torch.uint8, device=device).fill_(0xFF))
    except torch.OutOfMemoryError:  # poison what fits; the rest of memory stays as it was
        pass
    del held


# --- helpers over flat lists of inputs and outputs ---

def _copies(xs: Sequence) -> list:
    return [x.detach().clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x) for x in xs]


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _storage_range(a), _storage_range(b)
    return a0 < b1 and b0 < a1


def exception_line(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _first_tensor(xs: Sequence) -> torch.Tensor | None:
    return next((x for x in xs if isinstance(x, torch.Tensor)), None)


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    """x with +inf, -inf and NaN at the start, the middle and the end (different rows of a 2-D input)."""
    x = x.clone()
    flat = x.view(-1) if x.is_contiguous() else None
    if flat is None or flat.numel() < 3:
        return x
    for pos, v in zip((0, flat.numel() // 2, flat.numel() - 1), (math.inf, -math.inf, math.nan)):
        flat[pos] = v
    return x


class _Session:
    """The candidate, the reference and what every call has shown so far."""

    def __init__(self, candidate: Callable, reference: Callable, make_inputs: Callable[[], Sequence],
                 device: torch.device, seed: int, rtol: float | None, atol: float | None):
        self.candidate_fn, self.reference_native = candidate, reference
        self.make_inputs, self.device, self.seed, self.rtol, self.atol = make_inputs, device, seed, rtol, atol
        self.calls = 0
        self.mutations: list[str] = []
        self.aliases: list[str] = []
        self.structures: list[str] = []  # calls whose return had another structure than the reference's
        self.last_outputs: list = []  # kept alive, so a buffer handed out again shows as shared storage
        self.worst: dict[str, float] = {}
        self.timings: dict[str, float] = {}

        probe = self.inputs(0)
        mine = _copies(probe)
        try:
            with torch.no_grad():
                self.native_out = reference(*mine)
            self.native = leaves(self.native_out)  # kept alive: a freed reference output is what torch.empty reuses
        except Exception as e:
            raise ValueError(f"the reference raised on its own inputs: {exception_line(e)}") from e
        self.poison_sizes = sorted({o.untyped_storage().nbytes() for o in self.native if isinstance(o, torch.Tensor)})
        self.reference_aliases = any(_shares_memory(o, x) for o in self.native if isinstance(o, torch.Tensor)
                                     for x in mine if isinstance(x, torch.Tensor))
        # The reference in float64 (module and floating inputs cast) where it accepts it; else in its own dtype.
        self.reference_fn, self.precision = reference, None
        try:
            ref64 = copy.deepcopy(reference).double() if isinstance(reference, torch.nn.Module) else reference
            with torch.no_grad():
                out = leaves(ref64(*[self._to64(x) for x in probe]))
            if not any(isinstance(o, torch.Tensor) and o.dtype == torch.float64 for o in out):
                raise TypeError("it returned no float64 output")
            self.reference_fn, self.precision = ref64, "float64"
        except Exception as e:
            dts = sorted({_dtype_name(o.dtype) for o in self.native if isinstance(o, torch.Tensor)})
            self.precision = f"{'/'.join(dts) or 'its own dtype'} (the reference refused float64: {exception_line(e)})"
        self.in64 = self.precision == "float64"

    @staticmethod
    def _to64(x):
        if isinstance(x, torch.Tensor):
            return x.detach().double() if x.is_floating_point() else x.detach().clone()
        return copy.deepcopy(x)

    def inputs(self, k: int) -> list:
        """Fresh random inputs number k (seeded: a report can be reproduced), on the device."""
        torch.manual_seed(self.seed * 1_000_003 + 7919 * k + 1)
        return [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in self.make_inputs()]

    def reference(self, xs: Sequence) -> list:
        """The reference's outputs on copies of xs (float64 where it accepts it)."""
        with torch.no_grad():
            return leaves(self.reference_fn(*[self._to64(x) if self.in64 else _copies([x])[0] for x in xs]))

    def candidate(self, xs: list, what: str, early_copy: bool = False):
        """One candidate call on xs, with free memory poisoned before it; records mutated inputs and outputs
        that share memory with an input or with the previous call's outputs. With early_copy, also returns
        copies of the outputs taken on the current stream the moment the call returned."""
        before = _copies(xs)
        poison_free_memory(self.device, self.poison_sizes)
        with torch.no_grad(), poisoned_outputs():
            returned = self.candidate_fn(*xs)
        if problem := structure_mismatch(returned, self.native_out):
            self.structures.append(f"{what}: {problem}")
        outs = leaves(returned)
        early = [o.clone() if isinstance(o, torch.Tensor) else o for o in outs] if early_copy else None
        self.calls += 1
        for i, (x, x0) in enumerate(zip(xs, before)):
            if isinstance(x, torch.Tensor) and not (x.shape == x0.shape and _bitwise_equal(x, x0)):
                n = int((x != x0).sum()) if x.shape == x0.shape else x0.numel()
                self.mutations.append(f"{what}: input {i} changed ({n} of {x0.numel()} elements)")
        for j, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                continue
            if not self.reference_aliases:
                self.aliases += [f"{what}: output {j} shares memory with input {i}"
                                 for i, x in enumerate(xs) if isinstance(x, torch.Tensor) and _shares_memory(o, x)]
            self.aliases += [f"{what}: output {j} shares memory with output {k} of the call before"
                             for k, p in enumerate(self.last_outputs) if isinstance(p, torch.Tensor)
                             and _shares_memory(o, p)]
        self.last_outputs = outs
        return (outs, early) if early_copy else outs

    def tolerance(self, out: torch.Tensor) -> float:
        if not out.is_floating_point():
            return 0.0
        return self.rtol if self.rtol is not None else TOLERANCES.get(out.dtype, TOLERANCES[torch.float32])

    def agree(self, outs: list, refs: list, check: str) -> str | None:
        """The first way outs differ from refs beyond tolerance (None when they agree); records the worst error."""
        if len(outs) != len(refs):
            return f"{len(outs)} outputs, the reference returns {len(refs)}"
        for j, (o, r) in enumerate(zip(outs, refs)):
            what = f"out[{j}]" if len(outs) > 1 else "out"
            if not isinstance(r, torch.Tensor):
                if r is not None and o != r:
                    return f"{what} is {o!r}, the reference's is {r!r}"
                continue
            if not isinstance(o, torch.Tensor):
                return f"{what} is a {type(o).__name__}, the reference returns a tensor"
            rep = CheckReport()  # shapes and NaN/Inf positions, as the op harness compares them
            compare(o, r, math.inf, what, rep)
            if rep.failures:
                return rep.failures[0]
            err, tol = rep.errors[what], self.tolerance(o)
            self.worst[check] = max(err, self.worst.get(check, 0.0))
            # What the output dtype cannot represent is not the candidate's error (see correctness.compare).
            floor = rel_error(rounded_like_backend(r.to(o.device), o.dtype), r) if o.is_floating_point() else 0.0
            if not (err <= tol + floor or self._within_atol(o, r, tol)):
                return f"{what}: relative error {err:.2g} > tolerance {tol:.2g} ({_dtype_name(o.dtype)})"
        return None

    def _within_atol(self, o: torch.Tensor, r: torch.Tensor, tol: float) -> bool:
        if self.atol is None:
            return False
        a, e = o.detach().double(), r.detach().to(o.device).double()
        finite = torch.isfinite(e)
        return bool(((a - e).abs()[finite] <= self.atol + tol * e.abs()[finite]).all())


# --- the checks: each returns one Finding ---

def _correctness(s: _Session, trials: int) -> Finding:
    want = [o.dtype if isinstance(o, torch.Tensor) else None for o in s.native]
    tols = set()
    for t in range(trials):
        xs = s.inputs(1 + t)
        refs = s.reference(xs)
        try:
            outs = s.candidate(xs, f"correctness trial {t}")
        except Exception as e:
            return Finding("correctness", FAIL, f"trial {t}: the candidate raised {exception_line(e)}")
        problem = s.agree(outs, refs, "correctness")
        if problem is None:
            bad = [f"out[{j}] is {_dtype_name(o.dtype)}, the reference's {_dtype_name(w)}"
                   for j, (o, w) in enumerate(zip(outs, want)) if isinstance(o, torch.Tensor) and w and o.dtype != w]
            problem = bad[0] if bad else None
        if problem:
            return Finding("correctness", FAIL, f"trial {t} of {trials}: {problem} (vs the {s.precision} reference)")
        tols |= {f"{s.tolerance(o):.0e} for {_dtype_name(o.dtype)}" for o in outs if isinstance(o, torch.Tensor)}
    worst = s.worst.get("correctness", 0.0)
    digits = f", ~{-math.log10(worst):.1f} correct digits" if worst > 0 else ", bitwise equal"
    return Finding("correctness", PASS, f"{trials} trial{'s' if trials > 1 else ''} on fresh random inputs vs the "
                                        f"{s.precision} reference: worst rel. error {worst:.1e}{digits} "
                                        f"(tolerance {', '.join(sorted(tols))})")


def _poisoned_memory(s: _Session) -> Finding:
    xs = s.inputs(200)
    before = _copies(xs)
    try:
        outs = s.candidate(xs, "poisoned memory")  # before the reference has run on these inputs
    except Exception as e:
        return Finding("poisoned memory", FAIL, f"the candidate raised {exception_line(e)}")
    problem = s.agree(outs, s.reference(before), "poisoned memory")
    if problem and "non-finite" in problem:
        return Finding("poisoned memory", FAIL, f"{problem}: the candidate ran first, with free memory filled with "
                                                f"NaN, and left part of its output unwritten")
    if problem:
        return Finding("poisoned memory", FAIL, f"{problem} (the candidate run first, free memory filled with NaN)")
    where = "the caching allocator's free blocks" if s.device.type == "cuda" else "freed chunks (best effort on CPU)"
    return Finding("poisoned memory", PASS, f"{where} filled with NaN (0xFF) before every call, the candidate run "
                                            f"before the reference: every output element written")


_SCALES: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
    ("x1e-3", lambda x: x * 1e-3), ("x100", lambda x: x * 100), ("+50", lambda x: x + 50)]


def _against_reference(s: _Session, check: str, variants, label: Callable[[str], str] = str):
    """The candidate against the reference on each (name, inputs): (problems, skipped, tried), a variant the
    reference itself rejects being skipped (the candidate is not asked what the reference cannot say)."""
    problems, skipped, tried = [], [], []
    for name, xs in variants:
        try:
            refs = s.reference(xs)
        except Exception as e:
            skipped.append(f"{name} (the reference raised {exception_line(e)})")
            continue
        tried.append(name)
        try:
            with warnings.catch_warnings():  # numpy's overflow/invalid warnings, from Triton's interpreter
                warnings.simplefilter("ignore", RuntimeWarning)
                outs = s.candidate(xs, label(name))
            problem = s.agree(outs, refs, check)
        except Exception as e:
            problem = f"the candidate raised {exception_line(e)}"
        if problem:
            problems.append(f"{name}: {problem}")
    return problems, skipped, tried


def _input_scales(s: _Session) -> Finding:
    cases = [(name, fn, False) for name, fn in _SCALES] + [("±inf/NaN", _with_specials, True)]
    floating = [i for i, x in enumerate(s.inputs(300)) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not floating:
        return Finding("input scales", SKIP, "no floating-point input to scale")

    def variants():  # lazily: each set is made right before its calls, as seeded inputs are
        for k, (name, fn, first_only) in enumerate(cases):
            xs = s.inputs(300 + k)
            for i in floating[:1] if first_only else floating:
                xs[i] = fn(xs[i])
            yield name, xs

    problems, skipped, tried = _against_reference(s, "input scales", variants(), lambda name: f"inputs {name}")
    note = f"; skipped {', '.join(skipped)}" if skipped else ""
    if problems:
        return Finding("input scales", FAIL, "; ".join(problems) + note)
    if not tried:
        return Finding("input scales", SKIP, note[2:])
    worst = s.worst.get("input scales", 0.0)
    return Finding("input scales", PASS, f"inputs {', '.join(tried)}: worst rel. error {worst:.1e}, "
                                         f"NaN/Inf where the reference has them{note}")


def _resized(s: _Session, k: int, dim: int, size: int) -> list:
    """Fresh inputs with dim `dim` of every input that shares the first input's size there set to `size`."""
    base = s.inputs(k)
    first = _first_tensor(base)
    n = first.shape[dim]
    sets = [base] + [s.inputs(k + 1 + j) for j in range(math.ceil(size / n) - 1)]
    out = []
    for i, x in enumerate(base):
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[dim] == n:
            x = torch.cat([st[i] for st in sets], dim).narrow(dim, 0, size).contiguous()
        out.append(x)
    return out


def _sizes(s: _Session) -> Finding:
    first = _first_tensor(s.inputs(0))
    if first is None or first.dim() == 0:
        return Finding("sizes", SKIP, "the first input is not a tensor with a leading dimension")
    b = first.shape[0]
    cases = [(f"batch {n}", 0, n) for n in dict.fromkeys((1, b + 3)) if n != b]
    if first.dim() >= 2:
        n = first.shape[-1]
        cases.append((f"last dim {n + 1 if n % 2 == 0 else n + 2}", -1, n + 1 if n % 2 == 0 else n + 2))
    variants = ((name, _resized(s, 400 + 10 * k, dim, size)) for k, (name, dim, size) in enumerate(cases))
    problems, skipped, tried = _against_reference(s, "sizes", variants)
    note = f"; skipped {', '.join(skipped)}" if skipped else ""
    if problems:
        return Finding("sizes", FAIL, "; ".join(problems) + note)
    if not tried:
        return Finding("sizes", SKIP, f"the reference accepts no other size{note}")
    return Finding("sizes", PASS, f"{', '.join(tried)} (was {tuple(first.shape)}): match the reference{note}")


def _same_outputs(outs: list, others: list) -> bool:
    return all(not isinstance(o, torch.Tensor) or (o.shape == p.shape and _bitwise_equal(o, p))
               for o, p in zip(outs, others))


def _caching(s: _Session) -> Finding:
    a, b = s.inputs(500), s.inputs(501)
    ref_a, ref_b = s.reference(a), s.reference(b)
    changes = not _same_outputs(ref_b, ref_a)
    stale = "it returned its result for the earlier inputs A"
    try:
        out_a = _copies(s.candidate(a, "inputs A"))
        a_right = s.agree(out_a, ref_a, "caching") is None  # "A's result" is worth saying only if it was right
        out_b = s.candidate(_copies(b), "new inputs B")
        problem = s.agree(out_b, ref_b, "caching")
        if problem:
            why = stale if changes and a_right and _same_outputs(out_b, out_a) else problem
            return Finding("caching", FAIL, f"new input tensors B: {why}")
        for x, y in zip(a, b):  # the same tensors (same data_ptr) refilled with B's values
            if isinstance(x, torch.Tensor):
                x.copy_(y)
        out_b2 = s.candidate(a, "A's tensors refilled with B")
    except Exception as e:
        return Finding("caching", FAIL, f"the candidate raised {exception_line(e)}")
    problem = s.agree(out_b2, ref_b, "caching")
    if problem:
        why = f"{stale} (a cache keyed on the tensors, not their values)" \
            if changes and a_right and _same_outputs(out_b2, out_a) else problem
        return Finding("caching", FAIL, f"A's tensors refilled in place with B's values: {why}")
    same = "" if changes else " (the reference gives the same for both)"
    return Finding("caching", PASS, f"inputs A then B, as new tensors and as A's tensors refilled in place: "
                                    f"B's results match the reference{same}")


def _determinism(s: _Session, calls: int = 3) -> Finding:
    xs = s.inputs(600)
    try:
        runs = [_copies(s.candidate(_copies(xs), f"identical call {c}")) for c in range(calls)]
    except Exception as e:
        return Finding("determinism", FAIL, f"the candidate raised {exception_line(e)}")
    worst, tol, differ = 0.0, math.inf, 0
    for run in runs[1:]:
        for o, p in zip(run, runs[0]):
            if isinstance(o, torch.Tensor) and not (o.shape == p.shape and _bitwise_equal(o, p)):
                differ += 1
                rep = CheckReport()  # NaN/Inf in other places, or another shape, is beyond any tolerance
                compare(o, p, math.inf, "out", rep)
                worst = max(worst, math.inf if rep.failures else rep.errors["out"])
                tol = min(tol, s.tolerance(o))
    if not differ:
        return Finding("determinism", PASS, f"{calls} identical calls: bitwise identical outputs")
    how = "NaN/Inf in different places" if worst == math.inf else f"rel. difference up to {worst:.1e}"
    what = f"{calls} identical calls: outputs differ bitwise ({how}"
    if worst > tol:
        return Finding("determinism", FAIL, f"{what}, beyond the tolerance {tol:.0e})")
    return Finding("determinism", WARN, f"{what}, within tolerance: e.g. atomics or a split reduction's order)")


def _pending_work(s: _Session) -> Finding:
    if s.device.type != "cuda":
        return Finding("pending work", SKIP, "GPU only (work left running on another stream)")
    xs = s.inputs(700)
    refs = s.reference(xs)
    try:
        outs, early = s.candidate(xs, "pending work", early_copy=True)
    except Exception as e:
        return Finding("pending work", FAIL, f"the candidate raised {exception_line(e)}")
    # The early copies ran on the current stream right behind the call; wait for that stream alone (an event
    # recorded on it), not the device, so work the candidate left running on another stream is still pending.
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    problem_early = s.agree(early, refs, "pending work")
    torch.cuda.synchronize()
    problem_late = s.agree(outs, refs, "pending work")
    if problem_early and not problem_late:
        return Finding("pending work", FAIL, f"read on the current stream as the call returned: {problem_early}; "
                                             f"right after a device synchronize it is correct: the candidate left "
                                             f"work running on another stream")
    if problem_early:
        late = "the same" if problem_late == problem_early else problem_late
        return Finding("pending work", FAIL, f"read as the call returned: {problem_early}; after a device synchronize: {late}")
    return Finding("pending work", PASS, "outputs complete on the current stream when the call returns")


def _timing(s: _Session, pending: Finding) -> Finding:
    if s.device.type != "cuda":
        return Finding("timing", SKIP, "GPU only (do_bench with L2 flushed, vs eager and torch.compile)")
    if pending.result == FAIL:  # events on the current stream would time the launch, not the work
        return Finding("timing", SKIP, "not timed: the candidate returns before its work is done (pending work)")
    xs = s.inputs(800)
    times, notes = {}, []
    with torch.no_grad():
        times["candidate"] = time_ms(lambda: s.candidate_fn(*xs))
        times["reference eager"] = time_ms(lambda: s.reference_native(*xs))
        try:
            compiled = torch.compile(s.reference_native)
            compiled(*xs)
            times["reference torch.compile"] = time_ms(lambda: compiled(*xs))
        except Exception as e:
            notes.append(f"torch.compile(reference) failed: {exception_line(e)}")
    s.timings = times
    c = times["candidate"]
    parts = [f"candidate {c:.4g} ms"] + [f"{k} {v:.4g} ms ({v / c:.2f}x)" for k, v in times.items() if k != "candidate"]
    return Finding("timing", INFO, "; ".join(parts + notes) + " (median, L2 flushed; Nx = candidate speedup)")


def _output_structure(s: _Session) -> Finding:
    if not s.calls:
        return Finding("output structure", SKIP, "the candidate returned from no call")
    if s.structures:
        return Finding("output structure", FAIL, f"in {len(s.structures)} of {s.calls} calls; first: "
                                                 f"{s.structures[0]}: return what the reference returns")
    return Finding("output structure", PASS, f"{s.calls} calls: the reference's structure, "
                                             f"{structure(s.native_out)}")


def _aliasing(s: _Session) -> Finding:
    if s.aliases:
        return Finding("aliasing", FAIL, f"in {len(s.aliases)} of {s.calls} calls; first: {s.aliases[0]}")
    allowed = " (the reference's output is a view of its input, so the candidate's may be too)" \
        if s.reference_aliases else ""
    return Finding("aliasing", PASS, f"{s.calls} calls: no output shares memory with an input or the previous "
                                     f"call's output{allowed}")


def _input_mutation(s: _Session) -> Finding:
    if s.mutations:
        return Finding("input mutation", FAIL, f"in {len(s.mutations)} of {s.calls} calls; first: {s.mutations[0]}")
    return Finding("input mutation", PASS, f"{s.calls} calls: inputs bitwise unchanged")


def check_module(candidate: Callable, reference: Callable, make_inputs: Callable[[], Sequence], *,
                 device: str | torch.device | None = None, trials: int = 3, rtol: float | None = None,
                 atol: float | None = None, seed: int = 0, timing: bool = True,
                 progress: Callable[[str], Any] | None = None) -> VerifyReport:
    """Verify `candidate(*inputs)` against `reference(*inputs)` on inputs from `make_inputs()`.

    candidate, reference: nn.Modules (moved to `device`) or plain callables taking the inputs positionally;
    outputs a tensor or a tuple/list of them. The candidate must return the reference's structure (the
    "output structure" check): a tensor where the reference returns a tensor, so ``(out,)`` for ``out``
    fails; a tuple or list (the two alike) of the same length where it returns a tuple or list; None where
    it returns None; tensors of the same shapes ("correctness" also compares their dtypes). make_inputs:
    returns a fresh list of inputs from the global RNG (KernelBench's get_inputs), called once per case
    after seeding, so every trial has new values. device: where inputs go (default: the first input's
    device). rtol replaces the output dtype's relative-norm tolerance (TOLERANCES: 1e-5 for float32); with
    atol, an output within |out - ref| <= atol + rtol|ref| everywhere passes too. Returns a `VerifyReport`
    with one `Finding` per check in `CHECKS`.
    """
    if trials < 1:
        raise ValueError(f"trials={trials}: check_module needs trials >= 1")
    if device is None:
        with torch.random.fork_rng(devices=[]):
            first = _first_tensor(list(make_inputs()))
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    for m in (candidate, reference):
        if isinstance(m, torch.nn.Module):
            m.to(device)
    # Inputs are drawn from the global RNG, seeded per case: fork it so the caller's stream of numbers is untouched.
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        return _run_checks(_Session(candidate, reference, make_inputs, device, seed, rtol, atol), trials, timing,
                           progress)


def _run_checks(s: _Session, trials: int, timing: bool, progress: Callable[[str], Any] | None) -> VerifyReport:
    report = VerifyReport(device=str(s.device), reference_precision=s.precision)
    steps = [("correctness", lambda: _correctness(s, trials)), ("poisoned memory", lambda: _poisoned_memory(s)),
             ("input scales", lambda: _input_scales(s)), ("sizes", lambda: _sizes(s)),
             ("caching", lambda: _caching(s)), ("determinism", lambda: _determinism(s)),
             ("pending work", lambda: _pending_work(s)), ("output structure", lambda: _output_structure(s)),
             ("aliasing", lambda: _aliasing(s)),
             ("input mutation", lambda: _input_mutation(s)),
             ("timing", lambda: _timing(s, report.finding("pending work")) if timing
              else Finding("timing", SKIP, "not asked for"))]
    for name, run in steps:
        if progress:
            progress(name)
        report.findings.append(run())
    report.errors = dict(s.worst)
    report.timings_ms = dict(s.timings)
    return report

