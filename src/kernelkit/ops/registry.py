"""The op registry: what kernelkit can run, how to check it, how to time it, and what it replaces.

Each op module calls `register(OpSpec(...))` at import. The profiler's recommendations, the patcher,
`kernelkit check` and `kernelkit bench` read this table, so adding an op never means editing them.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..roofline.model import Cost

# make_inputs(shape, dtype, device, generator) -> (args, kwargs): fresh random inputs for one call.
MakeInputs = Callable[..., tuple[tuple, dict]]


@dataclass
class OpSpec:
    name: str
    fn: Callable  # the kernelkit implementation: fn(*args, **kwargs)
    reference: Callable  # plain PyTorch definition with the same signature; also the "eager" row
    cost: Callable[..., Cost]  # cost(*args, backward=False, **kwargs) -> Cost
    make_inputs: MakeInputs
    grad_args: tuple[int, ...] = ()  # positions in args whose gradients are checked and timed
    test_shapes: list[tuple] = field(default_factory=list)  # small shapes for the interpreter
    bench_shapes: list[tuple] = field(default_factory=list)  # LLM shapes for the GPU suite
    latency_shapes: list[tuple] = field(default_factory=list)  # decode sizes, timed with CUDA graphs
    dtypes: tuple = ("float32", "bfloat16", "float16")
    # name -> loader returning a callable with fn's signature, or None when it is not installed
    competitors: dict[str, Callable[[], Callable | None]] = field(default_factory=dict)
    replaces: tuple[str, ...] = ()  # aten ops ("aten::rms_norm") and module classes ("LlamaRMSNorm")
    deterministic: bool = True  # run-twice check demands bitwise-equal results
    # Whether a call's forward computes the input gradients and its backward only scales them by grad_output
    # (linear_cross_entropy): grads_in_forward(*args, **kwargs) of the call as the profiler sees it, or None. A
    # profile then charges cost(backward=True) to the forward's record, and nothing to the backward's.
    grads_in_forward: Callable[..., bool] | None = None
    # Reference outputs with reduced precision need per-dtype tolerance overrides.
    tolerances: dict[str, float] = field(default_factory=dict)
    # What the "eager" and "torch.compile" rows of a benchmark run (reference when None), which of
    # those generic rows to include, and the row speedups are quoted against.
    eager: Callable | None = None
    generic_rows: tuple[str, ...] = ("eager", "torch.compile")
    baseline: str = "torch.compile"
    doc: str = ""
    # (argument position, layout) pairs the layout fuzz (testing/layouts.py) leaves out, each with a reason
    # where the spec sets it: e.g. a broadcast LM-head weight makes every class alike, so the reference
    # gradient of the hidden states is exactly zero and a relative error against it means nothing.
    layout_skip: tuple[tuple[int, str], ...] = ()
    # Per-layout tolerance overrides, each with its reason where the spec sets it: the case's description prefix
    # ("args[0] expanded") -> {dtype name: tolerance}.
    layout_tolerances: dict[str, dict[str, float]] = field(default_factory=dict)
    # The shape the layout fuzz uses (default: the smallest test shape with every size above 1), or a list of shapes
    # where some arguments exist only at some of them (attention's cu_seqlens with packed sequences).
    layout_shape: tuple | list[tuple] | None = None


_REGISTRY: dict[str, OpSpec] = {}
_loaded = False
load_errors: dict[str, str] = {}  # op module -> why it failed to import (also warned about)


def register(spec: OpSpec) -> OpSpec:
    _REGISTRY[spec.name] = spec
    return spec


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    # every public module of this package (ops/), found beside this file: no import of the package itself
    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if mod.name != "registry" and not mod.name.startswith("_"):
            try:
                importlib.import_module(f"{__package__}.{mod.name}")
            except Exception as e:  # one broken op must not take the others down; say so loudly
                load_errors[mod.name] = f"{type(e).__name__}: {e}"
                warnings.warn(f"kernelkit op module {mod.name!r} failed to import: {load_errors[mod.name]}",
                              stacklevel=2)
    _loaded = True


def get(name: str) -> OpSpec:
    _load_all()
    if name not in _REGISTRY:
        raise KeyError(f"no op named {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def all_ops() -> dict[str, OpSpec]:
    _load_all()
    return dict(_REGISTRY)


def replacing(target: str) -> list[OpSpec]:
    """Ops that can replace an aten op or module class name (as the profiler sees it)."""
    _load_all()
    return [s for s in _REGISTRY.values() if target in s.replaces]


def optional_import(module: str, attr: str) -> Callable[[], Any]:
    """Loader for a competitor that may not be installed (Liger-Kernel, say)."""

    def load():
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            return None

    return load
