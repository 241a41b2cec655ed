"""One way into every kernel: the dispatch triple, meta and fake inputs, and double backward.

Every public op function ends in `dispatch`, which picks one of three routes to the same launcher:

- traced (under torch.compile, or called with fake or meta tensors): the `torch.library` custom op, one
  graph node whose fake implementation gives the output shapes (meta inputs give meta outputs, as torch
  ops do);
- no autograd node needed (grad mode off, or no input requires grad): the launcher itself;
- otherwise: the op's `autograd.Function`, whose `apply` costs a few microseconds less than the custom
  op's autograd wrapper on every eager call.

An op is declared once with `Op` (forward, fake, what to save, backward, the backward's kernel and its fake,
the differentiable double backward): it builds the custom ops, their fakes, the autograd registration and the
eager Function, and calling it is the route chooser above (one frame, as `dispatch` was).

Backward functions are wrapped by `differentiable_backward`: with ``create_graph=True`` the engine runs
them in grad mode, and a gradient computed by a Triton kernel would carry no graph, silently dropping the
second-order term. There they compute through PyTorch ops instead (the op's reference, or a closed form),
so second derivatives are right (and as slow as PyTorch); ops that have no such path raise.
"""

from __future__ import annotations

import functools
import inspect
import sys
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import torch
from torch.autograd import profiler as _autograd_profiler
from torch._subclasses.fake_tensor import FakeTensor

from . import registry

_Tensor = torch.Tensor


def traced(x) -> bool:
    """Whether a call with first tensor `x` must go through the custom op: under torch.compile, or with
    fake (tracing) or meta tensors, for which only the fake implementation can produce outputs."""
    return torch.compiler.is_compiling() or (isinstance(x, _Tensor) and (x.is_meta or isinstance(x, FakeTensor)))


def wants_grad(*tensors) -> bool:
    """Whether a call must record an autograd node: grad mode is on and an input requires grad."""
    if torch.is_grad_enabled():
        for t in tensors:
            if isinstance(t, _Tensor) and t.requires_grad:
                return True
    return False


def dispatch(custom_op: Callable, launcher: Callable, function: type, n_grad: int, args: tuple,
             pick: Callable | None = None):
    """Run one op call by the route it needs (see the module docstring).

    `args` go unchanged to all three routes; the first `n_grad` of them are the tensors that can require
    grad. The custom op and the launcher may return more than the public result (saved statistics):
    `pick` maps their return value to it; `function.apply` returns the public result itself.
    """
    first = args[0]
    if torch.compiler.is_compiling() or (isinstance(first, _Tensor) and (first.is_meta or isinstance(first, FakeTensor))):
        out = custom_op(*args)
    elif torch.is_grad_enabled() and any(isinstance(t, _Tensor) and t.requires_grad for t in args[:n_grad]):
        if _autograd_profiler._is_profiler_enabled:  # a profiler records: name the call (see profiled_call)
            return profiled_call(custom_op, function.apply, args, backward=True)
        return function.apply(*args)
    elif _autograd_profiler._is_profiler_enabled:
        out = profiled_call(custom_op, launcher, args)
    else:
        out = launcher(*args)
    return pick(out) if pick is not None else out


class Op:
    """One op, declared once; calling it runs `forward(*args)` by the route the call needs.

    - `forward(*args)`: the launcher, annotated (its signature is the custom op's schema); returns a tensor or
      a tuple of tensors (saved statistics included).
    - `fake(*args)`: outputs of the same shapes and dtypes, for tracing.
    - `setup_context(ctx, inputs, output)`: what to save (torch's own signature; `output` is all of forward's).
    - `backward(ctx, kernels, *grads)`: one gradient (or None) per argument, from the gradients of the
      `public` outputs. `kernels.fwd` / `kernels.bwd` are the custom ops under torch.compile and the plain
      launchers on the eager path, so one backward serves both.
    - `bwd(...)`, `bwd_fake(...)`: the backward's launcher (annotated) and its fake, when it has one.
    - `double_backward(ctx, *grads)`: the same gradients through differentiable PyTorch ops (the reference),
      for ``create_graph=True``; None refuses higher-order gradients.
    - `n_grad`: how many leading arguments may require grad; `public`: the index (or tuple of indices) of
      forward's outputs the op returns, None for all.
    """

    __slots__ = ("name", "custom_op", "forward", "function", "n_grad", "pick", "bwd_op")

    def __init__(self, name: str, forward: Callable, *, fake: Callable, setup_context: Optional[Callable] = None,
                 backward: Optional[Callable] = None, bwd: Optional[Callable] = None,
                 bwd_fake: Optional[Callable] = None, double_backward: Optional[Callable] = None,
                 n_grad: int = 0, public: int | tuple | None = None):
        self.name, self.forward, self.n_grad = name, forward, n_grad
        self.custom_op = torch.library.custom_op(f"kernelkit::{name}", forward, mutates_args=())
        self.custom_op.register_fake(fake)
        self.bwd_op = None
        if bwd is not None:
            self.bwd_op = torch.library.custom_op(f"kernelkit::{name}_bwd", bwd, mutates_args=())
            self.bwd_op.register_fake(bwd_fake)
        if public is None:
            self.pick = None
            select = None
        elif isinstance(public, int):
            self.pick = lambda out, i=public: out[i]
            select = (public,)
        else:
            self.pick = lambda out, idx=tuple(public): tuple(out[i] for i in idx)
            select = tuple(public)
        self.function = None
        if backward is None:
            return
        traced_kernels = SimpleNamespace(fwd=self.custom_op, bwd=self.bwd_op)
        eager_kernels = SimpleNamespace(fwd=forward, bwd=bwd)

        def compiled_backward(ctx, *grads):
            if select is not None:
                grads = tuple(grads[i] for i in select)
            return backward(ctx, traced_kernels, *grads)

        self.custom_op.register_autograd(compiled_backward, setup_context=setup_context)
        pick = self.pick

        op = self

        def fn_forward(ctx, *args):
            out = op.forward(*args)  # looked up per call, as __call__ does: one launcher to replace in a test
            setup_context(ctx, args, out)
            return out if pick is None else pick(out)

        @differentiable_backward(double_backward, name)
        def fn_backward(ctx, *grads):
            return backward(ctx, eager_kernels, *grads)

        # Built with type(): autograd names the backward node after the class ("rms_norm_function" ->
        # rms_norm_functionBackward in a graph), so each op gets its own name.
        self.function = type(f"{name}_function", (torch.autograd.Function,), {
            "__doc__": "The eager path: the op's launchers, a few microseconds less per call than the custom op.",
            "forward": staticmethod(fn_forward), "backward": staticmethod(fn_backward)})

    def __call__(self, *args):
        """`dispatch` for a declared op (see the module docstring): the same three routes."""
        first = args[0]
        if torch.compiler.is_compiling() or (isinstance(first, _Tensor) and (first.is_meta or isinstance(first, FakeTensor))):
            out = self.custom_op(*args)
        elif self.function is not None and torch.is_grad_enabled() and any(
                isinstance(t, _Tensor) and t.requires_grad for t in args[: self.n_grad]):
            if _autograd_profiler._is_profiler_enabled:
                return profiled_call(self.custom_op, self.function.apply, args, backward=True)
            return self.function.apply(*args)
        elif _autograd_profiler._is_profiler_enabled:
            out = profiled_call(self.custom_op, self.forward, args)
        else:
            out = self.forward(*args)
        return out if self.pick is None else self.pick(out)


# --- profiler ranges: kernelkit's kernels under the public op's name, while a profiler records ---

_OP_PARAMS: dict = {}  # code object of a registered public op function -> (registry name, [(param, default)])


def fp8_rows_op(name: str, forward: Callable, *, fake: Callable, setup_context: Callable, backward: Callable,
                double_backward: Callable, **kwargs) -> Op:
    """An `Op` whose forward also returns its output's fp8 rows: `forward` returns the plain op's outputs and then
    (q, scale), q float8_e4m3fn of the output's shape and scale fp32 per row (`quantize_rows` of the output, made
    in the same pass). `fake`, `setup_context`, `backward` and `double_backward` are the plain op's; q and scale
    are marked non-differentiable and their (absent) gradients dropped. `kwargs` go to `Op` (bwd, bwd_fake,
    n_grad, public: with `public`, name q and scale too)."""

    @functools.wraps(fake)
    def fake_rows(*args):
        out = fake(*args)
        y = out[0] if isinstance(out, tuple) else out
        rows = (y.new_empty(y.shape, dtype=torch.float8_e4m3fn), y.new_empty(y.shape[:-1], dtype=torch.float32))
        return (*out, *rows) if isinstance(out, tuple) else (out, *rows)

    def setup_rows(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(output[-2], output[-1])

    return Op(name, forward, fake=fake_rows, setup_context=setup_rows,
              backward=lambda ctx, kernels, *grads: backward(ctx, kernels, *grads[:-2]),
              double_backward=lambda ctx, *grads: double_backward(ctx, *grads[:-2]), **kwargs)


def _is_default(v, default) -> bool:
    if v is default:
        return True
    try:
        return type(v) is type(default) and not isinstance(v, _Tensor) and bool(v == default)
    except Exception:  # a value that does not compare to a bool
        return False


def _public_call(frame) -> tuple[str, list[str]] | None:
    """The registered public op whose frame is `frame` or up to three frames above it (`dispatch`, a private
    helper between the public function and `dispatch`), and its arguments that differ from the defaults as
    `name=value` fields (the values the function holds when it dispatches: normalized, as passed on)."""
    specs = registry._REGISTRY
    if len(_OP_PARAMS) != len(specs):  # ops register at import: rebuild when one was added
        _OP_PARAMS.clear()
        for name, spec in specs.items():
            fn = inspect.unwrap(spec.fn)
            code = getattr(fn, "__code__", None)
            if code is not None and code not in _OP_PARAMS:
                _OP_PARAMS[code] = (name, [(p.name, p.default) for p in inspect.signature(fn).parameters.values()])
    for _ in range(4):
        if frame is None:
            return None
        hit = _OP_PARAMS.get(frame.f_code)
        if hit is not None:
            name, params = hit
            local = frame.f_locals
            return name, [f"{p}={range_value(local[p])}" for p, d in params
                          if p in local and not _is_default(local[p], d)]
        frame = frame.f_back
    return None


def range_value(v) -> str:
    """One argument in a profiler range name: a tensor as its shape and dtype ("8192x4096:bfloat16", "0d:float32"
    for a 0-dim one), numbers, strings, None, dtypes and tuples of them as repr, anything else as <TypeName>."""
    if isinstance(v, _Tensor):
        return f"{'x'.join(map(str, v.shape)) or '0d'}:{str(v.dtype).replace('torch.', '')}"
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    if isinstance(v, torch.dtype):
        return repr(str(v))
    if isinstance(v, (tuple, list)) and all(x is None or isinstance(x, (bool, int, float, str)) for x in v):
        return repr(tuple(v))
    return f"<{type(v).__name__}>"


def profiled_call(custom_op: Callable, run: Callable, args: tuple, backward: bool = False):
    """`run(*args)` inside a profiler range named for the public call, which a profiler that is recording
    sees around kernelkit's Triton kernels (launched outside the dispatcher, they belong to no aten op):
    ``kernelkit::rms_norm(x=8192x4096:bfloat16, weight=4096:bfloat16, eps=1e-05)``, the op's registry name
    and the arguments that differ from the defaults (shapes, not values), so a trace reader can price the
    call with the registry's cost model. With `backward`, the autograd node of the result runs its backward
    in a range ``kernelkit::rms_norm.backward(...)``. Only called while a profiler records: the name costs a
    few microseconds to build, the ranges themselves are what `torch.profiler.record_function` costs.
    An op with its own dispatch code (not `dispatch`) calls this the same way while a profiler records:
    ``if _autograd_profiler._is_profiler_enabled: return profiled_call(op, Function.apply, args, backward=True)``."""
    found = _public_call(sys._getframe(1))  # dispatch (or an op's own dispatch code), called by the public function
    if found is not None:
        op, fields = found
    else:  # not called from a registered op: the custom op's name and the arguments as dispatched
        op = getattr(custom_op, "_name", None) or getattr(custom_op, "__name__", "op").strip("_")
        fields = [range_value(a) for a in args]
    name = f"kernelkit::{op}({', '.join(fields)})"
    with torch.profiler.record_function(name):
        out = run(*args)
    node = next((t.grad_fn for t in (out if isinstance(out, (tuple, list)) else (out,))
                 if isinstance(t, _Tensor) and t.grad_fn is not None), None) if backward else None
    if node is not None:
        rf = torch.profiler.record_function(f"kernelkit::{op}.backward({', '.join(fields)})")

        def enter(grad_outputs):
            rf.__enter__()

        def leave(grad_inputs, grad_outputs):
            rf.__exit__(None, None, None)

        node.register_prehook(enter)
        node.register_hook(leave)
    return out


def differentiable_backward(torch_backward: Callable | None, op: str):
    """Decorate an `autograd.Function.backward`: under ``create_graph=True`` (the engine then runs the
    backward in grad mode) call `torch_backward(ctx, *grads)` instead, which must compute the same
    gradients with differentiable PyTorch ops. With `torch_backward=None` that case raises."""

    def wrap(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if torch.is_grad_enabled():
                if torch_backward is None:
                    raise RuntimeError(
                        f"kernelkit.{op} has no double backward: its gradient comes from a Triton kernel and "
                        f"cannot carry a graph for create_graph=True. Use the PyTorch implementation for "
                        f"higher-order gradients.")
                return torch_backward(ctx, *grads)
            return backward(ctx, *grads)

        return wrapper

    return wrap


def reference_vjp(reference: Callable, inputs: Sequence, grads: Sequence, n_inputs: int | None = None) -> tuple:
    """Gradients of `reference(*inputs)` against `grads`, built with ``create_graph=True``.

    The double backward of an op whose Function saved its inputs: the reference is the op's plain PyTorch
    definition, so the returned gradients carry a graph through the inputs and the incoming gradients.
    Returns one entry per input (None where an input is not a tensor that requires grad), padded with
    None to `n_inputs`.
    """
    with torch.enable_grad():
        # A fresh alias per argument: one tensor passed twice (weight as bias, say) gets a gradient per
        # argument, and an input that is an output of the Function running this backward is reached
        # through its alias without re-entering that Function.
        inputs = [t.view_as(t) if isinstance(t, _Tensor) and t.requires_grad else t for t in inputs]
        wanted = [t for t in inputs if isinstance(t, _Tensor) and t.requires_grad]
        outs = reference(*inputs)
        outs = (outs,) if isinstance(outs, _Tensor) else tuple(outs)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and isinstance(o, _Tensor) and o.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True,
                                       allow_unused=True) if wanted and pairs else [None] * len(wanted))
    res = tuple(next(got) if isinstance(t, _Tensor) and t.requires_grad else None for t in inputs)
    return res + (None,) * ((n_inputs or len(res)) - len(res))
