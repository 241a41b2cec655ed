"""Layout fuzzing: every tensor argument of every registered op in every layout a user can pass.

A kernel indexes memory through pointers and strides, so the same values in another layout are another
test: a row-padded activation (a slice of a wider tensor, so the row stride exceeds the row length), a
column-major view, a stepped slice, a view with a storage offset (16-byte aligned or not), a broadcast
(stride-0) view, a weight taken as a column of a 2-D parameter. The memory around each view that the
view does not cover is poisoned (NaN, or an out-of-range integer), so a kernel that reads with the wrong
stride or past the view gets a wrong, usually non-finite, result instead of a lucky one.

Integer arguments (class targets, sequence offsets, position and expert ids) and scale tensors take the same
layouts: a launcher validates their values through the view, so a kernel that reads them by index from the
raw storage computes with values nobody checked. An op whose index arguments exist only at some shapes
(attention's cu_seqlens with packed sequences, rope's position_ids with a cos/sin table) lists those shapes
in its `layout_shape`, and each is fuzzed.

`layout_cases(spec, ...)` yields (description, args, kwargs) for each argument × layout, and
`check_layouts` runs the correctness harness (float64 reference, forward and backward) on each.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .correctness import CheckReport, as_dtype, check

LAYOUTS = ("row_padded", "transposed", "stepped", "offset", "misaligned", "expanded")


def _poisoned(shape, like: torch.Tensor) -> torch.Tensor:
    t = torch.empty(shape, dtype=like.dtype, device=like.device)
    if t.is_floating_point():
        return t.fill_(float("nan")) if t.element_size() > 1 else t.view(torch.uint8).fill_(0x7F).view(t.dtype)
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(1 << 30 if t.dtype in (torch.int32, torch.int64) else -1)


def relayout(t: torch.Tensor, kind: str) -> torch.Tensor | None:
    """`t`'s values (for 'expanded': its first slice along dim 0, broadcast) in layout `kind`, or None
    where the layout does not apply to a tensor of this shape."""
    if t.dim() == 0 or t.numel() == 0:
        return None
    n = t.shape[-1]
    if kind == "row_padded":
        if t.dim() == 1:  # a weight taken as a column of a (n, 3) parameter: stride 3
            base = _poisoned((n, 3), t)
            out = base[:, 1]
        else:
            base = _poisoned((*t.shape[:-1], n + 5), t)
            out = base[..., 2:2 + n]
    elif kind == "transposed":
        if t.dim() < 2:
            return None
        base = _poisoned((*t.shape[:-2], t.shape[-1], t.shape[-2]), t)
        out = base.transpose(-1, -2)
    elif kind == "stepped":
        base = _poisoned((*t.shape[:-1], 2 * n), t)
        out = base[..., ::2]
    elif kind in ("offset", "misaligned"):
        # A storage offset of 16 bytes keeps 16-byte alignment; one element (or 8 bytes for 1-byte
        # types) breaks it, which vectorized loads and TMA descriptors care about.
        esize = t.element_size()
        k = max(1, 16 // esize) if kind == "offset" else (1 if esize > 1 else 8)
        if kind == "misaligned" and (k * esize) % 16 == 0:
            return None
        base = _poisoned((t.numel() + 2 * k,), t)
        out = base[k:k + t.numel()].view(t.shape)
    elif kind == "expanded":
        # Broadcast values along a real dim 0. Integers only as rows of ids (position or expert ids of one
        # sequence or token for all): a 1-D integer argument may hold offsets, whose repetition would change
        # what the op means (cumulative sequence lengths, say).
        if t.shape[0] < 2 or not t.is_floating_point() and t.dim() < 2:
            return None
        return t[:1].clone().expand(t.shape)
    else:
        raise ValueError(f"unknown layout {kind!r}; known: {', '.join(LAYOUTS)}")
    out.copy_(t)
    return out


def layout_shapes(spec) -> list[tuple]:
    """The shapes the fuzz runs: the op's layout shape (a list of them where some arguments exist only at some
    shapes), or its smallest test shape with every size above 1 (a layout of a size-1 dim is no layout)."""
    if isinstance(spec.layout_shape, list):
        return list(spec.layout_shape)
    if spec.layout_shape is not None:
        return [spec.layout_shape]
    shapes = [s for s in spec.test_shapes if all(isinstance(d, bool) or not isinstance(d, int) or d > 1 for d in s)]
    return [min(shapes or spec.test_shapes, key=lambda s: sum(d for d in s if isinstance(d, int)))]


def layout_shape(spec) -> tuple:
    """The first of `layout_shapes`: the one shape where an op's inputs are wanted in no layout in particular."""
    return layout_shapes(spec)[0]


def _tensor_keys(args, kwargs) -> set:
    return {i for i, a in enumerate(args) if isinstance(a, torch.Tensor)} | \
        {k for k, a in kwargs.items() if isinstance(a, torch.Tensor)}


def layout_cases(spec, dtype, device, shape=None, layouts=LAYOUTS, seed: int = 0, skip=frozenset()
                 ) -> Iterator[tuple[str, list, dict]]:
    """(what, args, kwargs) for every tensor argument of `spec`'s inputs in every layout that applies, but those
    whose position or keyword is in `skip`."""
    dtype = as_dtype(dtype)
    shape = shape or layout_shape(spec)
    gen = torch.Generator(device=device).manual_seed(seed)
    args, kwargs = spec.make_inputs(shape, dtype, device, gen)
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor) or i in skip:
            continue
        for kind in layouts:
            moved = relayout(a, kind) if (i, kind) not in spec.layout_skip else None
            if moved is None:
                continue
            new = list(args)
            new[i] = moved
            yield f"args[{i}] {kind} {tuple(moved.stride())}+{moved.storage_offset()}", new, dict(kwargs)
    for name, a in kwargs.items():
        if not isinstance(a, torch.Tensor) or name in skip:
            continue
        for kind in layouts:
            moved = relayout(a, kind)
            if moved is not None:
                yield f"{name} {kind} {tuple(moved.stride())}+{moved.storage_offset()}", list(args), {**kwargs,
                                                                                                       name: moved}


def check_layouts(spec, dtype, device, shape=None, layouts=LAYOUTS) -> tuple[CheckReport, int]:
    """Run `check` (float64 reference, poisoned outputs, gradients of `spec.grad_args`) on every layout
    case of `spec`, at `shape` or at each of `layout_shapes(spec)`: every tensor argument at the first, and
    at each further shape the tensor arguments the first has not (cu_seqlens, say: the interpreter's time goes
    where the layouts are new). Returns the merged report (failures prefixed by the case, and by the shape
    after the first) and the number of cases."""
    dtype = as_dtype(dtype)
    merged, count = CheckReport(), 0
    name = str(dtype).replace("torch.", "")
    tol = spec.tolerances.get(name)
    shapes = [shape] if shape is not None else layout_shapes(spec)
    seen: set = set()
    for i, at in enumerate(shapes):
        if i == 1:
            seen = _tensor_keys(*spec.make_inputs(shapes[0], dtype, device, torch.Generator(device=device)))
        for what, args, kwargs in layout_cases(spec, dtype, device, at, layouts, skip=seen):
            count += 1
            case_tol = next((by_dtype[name] for prefix, by_dtype in spec.layout_tolerances.items()
                             if what.startswith(prefix + " ") and name in by_dtype), tol)
            rep = check(spec.fn, spec.reference, args, kwargs, grad_args=spec.grad_args, tol=case_tol,
                        run_twice=False)
            what = f"{what} at {at}" if i else what
            for k, v in rep.errors.items():
                merged.errors[f"{what}: {k}"] = v
            merged.failures += [f"{what}: {f}" for f in rep.failures]
    return merged, count
