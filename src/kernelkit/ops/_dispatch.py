"""One way into every kernel: the dispatch triple, meta and fake inputs, and double backward.

Every public op function ends in `dispatch`, which picks one of three routes to the same launcher:

- traced (under torch.compile, or called with fake or meta tensors): the `torch.library` custom op, one
  graph node whose fake implementation gives the output shapes (meta inputs give meta outputs, as torch
  ops do);
- no autograd node needed (grad mode off, or no input requires grad): the launcher itself;
- otherwise: the op's `autograd.Function`, whose `apply` costs a few microseconds less than the custom
  op's autograd wrapper on every eager call.

Backward functions are wrapped by `differentiable_backward`: with ``create_graph=True`` the engine runs
them in grad mode, and a gradient computed by a Triton kernel would carry no graph, silently dropping the
second-order term. There they compute through PyTorch ops instead (the op's reference, or a closed form),
so second derivatives are right (and as slow as PyTorch); ops that have no such path raise.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

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
        return function.apply(*args)
    else:
        out = launcher(*args)
    return pick(out) if pick is not None else out


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
