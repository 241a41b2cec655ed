"""`_dispatch.Op`: one declaration builds the custom ops, fakes, autograd registration and the eager Function.

A toy op (a scaled square with a saved statistic, its "kernels" plain torch code that counts its calls) is
declared once and run by every route: no grad, eager autograd, torch.compile (aot_eager traces the fakes and
the compiled backward), double backward through the reference, and profiler ranges under the op's name.
"""
from typing import Optional

import pytest
import torch

from kernelkit.ops._dispatch import Op, reference_vjp

CALLS = {"fwd": 0, "bwd": 0}


def _fwd(x: torch.Tensor, w: Optional[torch.Tensor], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    CALLS["fwd"] += 1
    y = scale * x * x * (w if w is not None else 1.0)
    return y, x.sum(-1)


def _bwd(dy: torch.Tensor, x: torch.Tensor, w: Optional[torch.Tensor], scale: float
         ) -> tuple[torch.Tensor, torch.Tensor]:
    CALLS["bwd"] += 1
    wx = w if w is not None else 1.0
    dx = 2 * scale * x * dy * wx
    dw = (scale * x * x * dy).reshape(-1, x.shape[-1]).sum(0) if w is not None else x.new_empty(0)
    return dx, dw


def _reference(x, w, scale):
    return scale * x * x * (w if w is not None else 1.0)


def _setup(ctx, inputs, output):
    x, w, scale = inputs
    ctx.save_for_backward(x, w)
    ctx.scale = scale


def _backward(ctx, kernels, dy):
    x, w = ctx.saved_tensors
    dx, dw = kernels.bwd(dy, x, w, ctx.scale)
    return dx, (dw if w is not None else None), None


def _double(ctx, dy):
    x, w = ctx.saved_tensors
    return reference_vjp(_reference, (x, w, ctx.scale), (dy,))


TOY = Op("test_toy_square", _fwd, fake=lambda x, w, s: (torch.empty_like(x), x.new_empty(x.shape[:-1])),
         setup_context=_setup, backward=_backward, bwd=_bwd,
         bwd_fake=lambda dy, x, w, s: (torch.empty_like(x), w.new_empty(w.shape) if w is not None else x.new_empty(0)),
         double_backward=_double, n_grad=2, public=0)


def toy(x, w=None, scale=1.5):
    return TOY(x, w, scale)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, dtype=torch.float64, generator=g)
    w = torch.randn(5, dtype=torch.float64, generator=g)
    return x, w


def test_no_grad_runs_the_launcher_and_returns_the_public_output():
    x, w = _inputs()
    before = dict(CALLS)
    y = toy(x, w)
    assert CALLS["fwd"] == before["fwd"] + 1
    torch.testing.assert_close(y, _reference(x, w, 1.5))


def test_eager_autograd_runs_the_backward_launcher():
    x, w = (t.requires_grad_() for t in _inputs(1))
    before = CALLS["bwd"]
    dy = torch.randn(3, 5, dtype=torch.float64)
    gx, gw = torch.autograd.grad(toy(x, w), (x, w), dy)
    assert CALLS["bwd"] == before + 1
    rx, rw = torch.autograd.grad(_reference(x, w, 1.5), (x, w), dy)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    assert toy(x, w).grad_fn.__class__.__name__.startswith("test_toy_square_function")


def test_double_backward_goes_through_the_reference():
    x, w = (t.requires_grad_() for t in _inputs(2))
    (gx,) = torch.autograd.grad(toy(x, w).sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sum(), x)
    torch.testing.assert_close(ggx, 2 * 1.5 * w.detach().expand(3, 5))


def test_compiled_graph_uses_the_custom_ops_and_their_fakes():
    torch._dynamo.reset()
    x, w = (t.float().requires_grad_() for t in _inputs(3))
    compiled = torch.compile(lambda a, b: toy(a, b) * 2, backend="aot_eager", fullgraph=True)
    y = compiled(x, w)
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    rx, rw = torch.autograd.grad((_reference(x, w, 1.5) * 2).sum(), (x, w))
    torch.testing.assert_close(y, _reference(x, w, 1.5) * 2)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


def test_meta_inputs_take_the_fake():
    y = toy(torch.empty(4, 6, device="meta"), None)
    assert y.is_meta and y.shape == (4, 6)


def _double_it(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _three(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x + 1, x + 2, x + 3


def test_op_without_backward_runs_the_launcher():
    plain = Op("test_toy_plain", _double_it, fake=lambda x: torch.empty_like(x))
    x = torch.randn(3, requires_grad=True)
    # no backward declared: no Function, so the launcher runs and autograd sees torch's own ops
    torch.testing.assert_close(plain(x), x * 2)


def test_profiler_names_the_call():
    x, w = _inputs(4)
    with torch.profiler.profile() as prof:
        toy(x, w)
    names = [e.name for e in prof.events()]
    assert any("test_toy_square" in n for n in names), names


@pytest.mark.parametrize("public", [1, (0, 2)])
def test_public_outputs_select(public):
    op = Op(f"test_toy_pick_{public if isinstance(public, int) else len(public)}", _three,
            fake=lambda x: (x.clone(), x.clone(), x.clone()), public=public)
    out = op(torch.zeros(2))
    if public == 1:
        assert out.eq(2).all()
    else:
        assert out[0].eq(1).all() and out[1].eq(3).all()
