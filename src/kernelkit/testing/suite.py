"""The side-by-side benchmark suite of a registered op: kernelkit vs eager vs torch.compile vs anchors.

`kernelkit bench <op>` calls `run_suite`; every op gets the same treatment from its registry entry.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..hw.ceilings import Ceilings
from ..ops.registry import OpSpec
from .bench import Row, compare, rotating, rotation_count
from .correctness import as_dtype


def _tensors(args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _outputs(out) -> list[torch.Tensor]:
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]


def _call(impl: Callable, args, kwargs, mode: str) -> Callable[[], Any]:
    """A zero-argument callable that runs one forward, or one backward through a saved graph."""
    if mode == "fwd":
        return lambda: impl(*args, **kwargs)
    outs = _outputs(impl(*args, **kwargs))
    # A scalar output is a loss: its backward gets 1, exactly what `loss.backward()` passes.
    dys = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outs]
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if mode == "bwd":
        return lambda: torch.autograd.grad(outs, inputs, dys, retain_graph=True)

    def fwd_bwd():
        o = _outputs(impl(*args, **kwargs))
        return torch.autograd.grad(o, inputs, dys)

    return fwd_bwd


def _relative_error(spec: OpSpec, args, kwargs) -> float | None:
    """max |kernelkit - eager| / max |eager| over the first outputs, with the tuned configs the timing used:
    a benchmark of a wrong kernel shows up as a large figure next to its speed."""
    eager = spec.eager or spec.reference
    try:
        with torch.no_grad():
            got, want = spec.fn(*args, **kwargs), eager(*args, **kwargs)
        got = got if isinstance(got, torch.Tensor) else got[0]
        want = want if isinstance(want, torch.Tensor) else want[0]
        if not got.is_floating_point():
            return None
        got, want = got.double(), want.double()
        return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    except Exception:  # noqa: BLE001 - the timing rows stand on their own
        return None


def implementations(spec: OpSpec, compile: bool = True) -> dict[str, Callable | Exception]:
    eager = spec.eager or spec.reference
    impls: dict[str, Callable | Exception] = {"kernelkit": spec.fn}
    if "eager" in spec.generic_rows:
        impls["eager"] = eager
    if compile and "torch.compile" in spec.generic_rows:
        impls["torch.compile"] = torch.compile(eager, dynamic=False)
    for name, load in spec.competitors.items():
        try:
            f = load()
        except Exception as e:  # noqa: BLE001 - a broken competitor is reported, not fatal
            f = e
        if f is not None:
            impls[name] = f
    return impls


def run_suite(spec: OpSpec, ceilings: Ceilings, shapes: list[tuple] | None = None, dtype="bfloat16",
              modes: tuple[str, ...] = ("fwd", "bwd"), compile: bool = True, latency: bool = True,
              baseline: str | None = None, seed: int = 0, kernel_time: bool = False) -> list[Row]:
    dtype = as_dtype(dtype)
    baseline = baseline or spec.baseline
    # Each (shape, requires_grad) is a new graph for dynamo: let it compile them all rather than
    # silently falling back to eager after the default limit of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 512)
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    impls = implementations(spec, compile)
    runs = [(s, False) for s in (shapes if shapes is not None else spec.bench_shapes)]
    if latency:
        runs += [(s, True) for s in spec.latency_shapes]
    rows: list[Row] = []
    for shape, tiny in runs:
        args0, kwargs = spec.make_inputs(shape, dtype, "cuda", gen)
        in_bytes = sum(t.numel() * t.element_size() for t in _tensors(args0))
        copies = [args0] + [spec.make_inputs(shape, dtype, "cuda", gen)[0]
                            for _ in range(rotation_count(in_bytes, ceilings.l2_bytes) - 1)]
        for mode in modes:
            # Decode-size shapes are inference: forward only (and autograd does not replay in a CUDA graph).
            if mode != "fwd" and (not spec.grad_args or tiny):
                continue
            cost = spec.cost(*args0, backward=(mode == "bwd"), **kwargs)
            if mode == "fwd+bwd":
                cost = spec.cost(*args0, **kwargs) + spec.cost(*args0, backward=True, **kwargs)
            calls: dict[str, Callable | Exception] = {}
            for name, impl in impls.items():
                if isinstance(impl, Exception):
                    calls[name] = impl
                    continue
                try:
                    bound = []
                    for a in copies:
                        a = [t.detach().requires_grad_(i in spec.grad_args and mode != "fwd")
                             if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                             for i, t in enumerate(a)]
                        bound.append(_call(impl, a, kwargs, mode))
                    calls[name] = rotating(bound)
                except Exception as e:  # noqa: BLE001
                    calls[name] = e
            label = "x".join(map(str, shape))
            new = compare(spec.name, label, str(dtype).replace("torch.", ""), mode, calls, cost, ceilings,
                            baseline=baseline if baseline in calls else "kernelkit", cuda_graph=tiny,
                            kernel_time=kernel_time and not tiny)
            if mode == "fwd":
                err = _relative_error(spec, args0, kwargs)
                for r in new:
                    if r.impl == "kernelkit":
                        r.max_err = err
            rows += new
            del calls
        del copies, args0
        torch.cuda.empty_cache()
    return rows
