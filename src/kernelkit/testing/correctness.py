"""Correctness harness: float64 reference, fresh random inputs, poisoned outputs, gradients, races.

Every op test and `kernelkit check` go through `check`. Errors are relative norms against a float64
reference, ‖out − ref‖ / ‖ref‖ over the positions where the reference is finite; positions where
the reference is NaN or ±Inf must be NaN or the same ±Inf in the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..runtime import interpreting
from ..runtime.alloc import poisoned_outputs

# Relative norm error allowed against the float64 reference, by the dtype the op computes in.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "float64": torch.float64}


def as_dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    try:
        return DTYPES[str(d).replace("torch.", "")]
    except KeyError:
        raise ValueError(f"dtype={d!r} is not one of {sorted(DTYPES)}") from None


@dataclass
class CheckReport:
    errors: dict[str, float] = field(default_factory=dict)  # name -> relative error
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def raise_if_failed(self) -> None:
        if self.failures:
            raise AssertionError("; ".join(self.failures))


def leaves(out) -> list:
    """The tensors (and Nones, and other values) a call returned, in order, nested tuples and lists walked."""
    if isinstance(out, (tuple, list)):
        return [leaf for o in out for leaf in leaves(o)]
    return [out]


def _kind(x) -> str:
    if isinstance(x, torch.Tensor):
        return "tensor"
    if x is None:
        return "None"
    return "tuple/list" if isinstance(x, (tuple, list)) else type(x).__name__


def structure(out) -> str:
    """A return value's structure as the output rule sees it: ``tensor``, ``None``, ``(tensor, None)`` for a
    tuple or list of two (the two written alike), ``(tensor,)`` for one of one; any other value by its type."""
    if isinstance(out, (tuple, list)):
        inner = ", ".join(structure(o) for o in out)
        return f"({inner},)" if len(out) == 1 else f"({inner})"
    return _kind(out)


def _says(x) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} {structure(x)}"
    return "None" if x is None else f"a {_kind(x)}"


def structure_mismatch(out, ref, what: str = "out") -> str | None:
    """The output rule: `out` has `ref`'s structure. A tensor where the reference returns a tensor (a 1-tuple
    holding one is not a tensor), a tuple or list of the same length where it returns a tuple or list (the two
    alike: callers index and unpack both the same way), None where it returns None, and so on for each element.
    Returns the first difference, naming its position (``out[1]``), or None. Two plain values (3 and 3.0) are
    left to the comparison of values, and tensors' shapes and dtypes to the callers."""
    if isinstance(out, (tuple, list)) and isinstance(ref, (tuple, list)):
        if len(out) != len(ref):
            return f"{what} is {_says(out)}, the reference's is {_says(ref)}"
        return next((p for p in (structure_mismatch(o, r, f"{what}[{i}]") for i, (o, r) in enumerate(zip(out, ref)))
                     if p), None)
    kinds = {_kind(out), _kind(ref)}
    if len(kinds) == 1 or not kinds & {"tensor", "None", "tuple/list"}:
        return None
    return f"{what} is {_says(out)}, the reference's is {_says(ref)}"


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    # On the actual's device: moving a 1e8-element pair to the CPU costs more than the kernel under test.
    a, e = actual.detach().double(), expected.detach().to(actual.device).double()
    finite = torch.isfinite(e)
    diff = (a[finite] - e[finite]).norm().item()
    scale = e[finite].norm().item()
    return diff / scale if scale > 0 else diff


def rounded_like_backend(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x stored in dtype the way the kernels' backend stores it. The GPU rounds to nearest even, as torch
    does; Triton 3.6's interpreter truncates fp32 -> bf16 (round toward zero), up to twice the error."""
    if dtype == torch.bfloat16 and x.device.type == "cpu" and interpreting():
        bits = x.float().view(torch.int32) & -0x10000  # keep sign, exponent and the top 7 mantissa bits
        return bits.view(torch.float32).to(dtype)
    return x.to(dtype)


def compare(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str, report: CheckReport) -> None:
    if actual.shape != expected.shape:
        report.failures.append(f"{what}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
        return
    ref = expected.detach().to(actual.device)
    a, e = actual.detach().double(), ref.double()
    nonfinite = ~torch.isfinite(e)
    # Where the reference is finite the output must be too (this is what catches unwritten,
    # NaN-poisoned elements); where it is NaN/Inf the output must match it.
    bad_new = (~torch.isfinite(a) & ~nonfinite).sum().item()
    if bad_new:
        report.failures.append(f"{what}: {bad_new} non-finite elements where the reference is finite "
                               f"(unwritten output or overflow)")
    if nonfinite.any():
        same = (torch.isnan(a) & torch.isnan(e)) | (a == e)
        mism = (nonfinite & ~same).sum().item()
        if mism:
            report.failures.append(f"{what}: {mism} NaN/Inf elements differ from the reference")
    err = rel_error(a, e)
    report.errors[what] = err
    # What the output dtype cannot hold is not the kernel's error: the reference rounded once to that
    # dtype (underflow to subnormals and zero included, e.g. a mean-reduced fp16 gradient of a 128k
    # vocabulary) sets a floor that the tolerance comes on top of. Zero when the dtype holds it exactly.
    floor = rel_error(rounded_like_backend(ref, actual.dtype), e) if actual.is_floating_point() else 0.0
    if not err <= tol + floor:
        extra = f" + {floor:.3g} that {str(actual.dtype)[6:]} cannot represent" if floor > tol / 10 else ""
        report.failures.append(f"{what}: relative error {err:.3g} > tolerance {tol:.3g}{extra}")


def to_reference(x):
    """A float64, CPU-independent copy of an input for the reference (grad-enabled if x was)."""
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().double().requires_grad_(x.requires_grad)
    return x


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def check(fn: Callable, reference: Callable, args: Sequence, kwargs: dict | None = None, *,
          grad_args: Sequence[int] = (), tol: float | None = None, grad_tol: float | None = None,
          run_twice: bool = True, generator: torch.Generator | None = None) -> CheckReport:
    """Check one call of `fn(*args, **kwargs)` against `reference` evaluated in float64.

    The outputs must have the reference's structure (`structure_mismatch`) and are allocated poisoned;
    gradients of `args[i]` for i in `grad_args` are compared with the reference's autograd under the same
    random output gradient; with `run_twice`, a second identical call must give bitwise-identical outputs
    (a differing result means a race).
    """
    kwargs = kwargs or {}
    report = CheckReport()
    dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), torch.float32)
    tol = tol if tol is not None else TOLERANCES[dtype]
    grad_tol = grad_tol if grad_tol is not None else tol

    args = [a.detach().requires_grad_(i in grad_args) if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a for i, a in enumerate(args)]
    ref_args = [to_reference(a) for a in args]
    with poisoned_outputs():
        out = fn(*args, **kwargs)
    ref = reference(*ref_args, **kwargs)
    problem = structure_mismatch(out, ref)
    if problem:
        report.failures.append(f"output structure: {problem}")
        return report
    out, ref = leaves(out), leaves(ref)
    for i, (o, r) in enumerate(zip(out, ref)):
        if r is None:
            continue
        compare(o, r, tol, f"out[{i}]" if len(out) > 1 else "out", report)

    if grad_args:
        pairs = [(o, r) for o, r in zip(out, ref)
                 if isinstance(r, torch.Tensor) and r.requires_grad and o is not None and o.requires_grad]
        dys = [torch.randn(o.shape, dtype=o.dtype, device=o.device, generator=generator) for o, _ in pairs]
        inputs = [args[i] for i in grad_args]
        with poisoned_outputs():
            grads = torch.autograd.grad([o for o, _ in pairs], inputs, dys, allow_unused=True, retain_graph=True)
        ref_grads = torch.autograd.grad([r for _, r in pairs], [ref_args[i] for i in grad_args],
                                        [d.double() for d in dys], allow_unused=True)
        for i, g, rg in zip(grad_args, grads, ref_grads):
            if rg is None:
                continue
            if g is None:
                report.failures.append(f"grad of args[{i}] is None but the reference has one")
                continue
            compare(g, rg, grad_tol, f"grad[{i}]", report)

    if run_twice:
        again = leaves(fn(*args, **kwargs))
        for i, (o, o2) in enumerate(zip(out, again)):
            if isinstance(o, torch.Tensor) and not _bitwise_equal(o.detach(), o2.detach()):
                report.failures.append(f"out[{i}] differs between two identical calls (race?)")
    return report


def quick_shapes(spec) -> list[tuple]:
    """`kernelkit check --quick`: one small test shape per kernel path of the op, so each path is compiled and
    checked once. A shape's flags (bools, strings, a tuple of packed lengths: attention's causal, scaled_matmul's
    'rowwise', rope's 'positions') and, where it has flags, its length (trailing sizes such as a kv length)
    name its path; of a path's shapes, the one with the fewest sizes of 1 (they skip the masking of a ragged
    edge), then the smallest, is taken. Shapes without flags are one path: their 2-D or 3-D form is the same kernel."""
    paths: dict[tuple, list[tuple]] = {}
    for shape in spec.test_shapes:
        flags = tuple(type(d).__name__ if isinstance(d, tuple) else d for d in shape
                      if isinstance(d, (bool, str, tuple)))
        paths.setdefault((len(shape), flags) if flags else (), []).append(shape)

    def rank(shape):
        sizes = [d for d in shape if isinstance(d, int) and not isinstance(d, bool)]
        return sum(d == 1 for d in sizes), sum(sizes)

    return [min(shapes, key=rank) for shapes in paths.values()]


def check_spec(spec, shape, dtype, device: str = "cuda", trials: int = 2, seed: int = 0, **kw) -> CheckReport:
    """`check` a registered op on fresh random inputs from its `make_inputs`, `trials` times."""
    if trials < 1:  # a check that ran no trial has seen nothing, so it must not report ok
        raise ValueError(f"trials={trials}: check_spec needs trials >= 1")
    dtype = as_dtype(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    merged = CheckReport()
    tol = spec.tolerances.get(str(dtype).replace("torch.", ""))
    for t in range(trials):
        args, kwargs = spec.make_inputs(shape, dtype, device, gen)
        rep = check(spec.fn, spec.reference, args, kwargs, grad_args=spec.grad_args, tol=tol,
                    run_twice=spec.deterministic and t == 0, generator=gen, **kw)
        for k, v in rep.errors.items():
            merged.errors[k] = max(v, merged.errors.get(k, 0.0))
        merged.failures += [f"trial {t}: {f}" for f in rep.failures]
    return merged
