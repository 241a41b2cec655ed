"""kernelkit.linear / matmul / nn.Linear: the fused-epilogue GEMM against float64, forward and backward."""

import pytest
import torch

import kernelkit  # noqa: F401  (loads the ops)
from kernelkit.ops import _validate
from kernelkit.ops import linear as L
from kernelkit.testing.correctness import check
from kernelkit.testing.layouts import relayout

ACTS = [a for a in L.ACTIVATIONS]


def _inputs(m, k, n, dtype, device, seed=0, act=None, residual=True, lead=()):
    g = torch.Generator(device=device).manual_seed(seed)
    n_out = n // 2 if act == "swiglu" else n
    x = torch.randn((*lead, m, k), generator=g, device=device).to(dtype)
    w = (torch.randn((n, k), generator=g, device=device) / k ** 0.5).to(dtype)
    b = (0.1 * torch.randn(n, generator=g, device=device)).to(dtype)
    r = torch.randn((*lead, m, n_out), generator=g, device=device).to(dtype) if residual else None
    return x, w, b, r


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_activation_fwd_bwd_against_float64(act, dtype, device):
    # Odd M/N/K, several tiles in each direction (the interpreter's tile is 32), bias, residual and scale.
    x, w, b, r = _inputs(37, 67, 130, dtype, device, act=act)
    rep = check(L.linear, L.reference, (x, w, b, act, r), {"scale": 0.75}, grad_args=(0, 1, 2, 4))
    rep.raise_if_failed()


@pytest.mark.parametrize("m,k,n", [(1, 1, 8), (1, 16, 3), (5, 129, 33), (100, 37, 64), (64, 64, 2)])
@pytest.mark.parametrize("bias,residual,scale", [(False, False, None), (True, False, None),
                                                 (False, True, None), (False, False, -1.5), (True, True, 2.0)])
def test_shapes_and_epilogue_combinations(m, k, n, bias, residual, scale, device):
    x, w, b, r = _inputs(m, k, n, torch.float32, device, seed=m + k + n)
    args = (x, w, b if bias else None, "silu", r if residual else None)
    grads = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    # With M = 1 and N = 8, dx is one number: a sum of 8 terms under a fresh random grad_output, whose
    # cancellation can magnify fp32 rounding past 1e-5 relative (7.4e-5 seen once in CI-like runs).
    grad_tol = 1e-4 if m * n <= 8 else None
    rep = check(L.linear, L.reference, args, {"scale": scale}, grad_args=grads, grad_tol=grad_tol)
    rep.raise_if_failed()


def test_leading_dims_and_1d_input(device):
    x, w, b, r = _inputs(5, 40, 24, torch.float32, device, lead=(2, 3), act="gelu_tanh")
    check(L.linear, L.reference, (x, w, b, "gelu_tanh", r), grad_args=(0, 1, 2, 4)).raise_if_failed()
    assert L.linear(x, w, b).shape == (2, 3, 5, 24)
    check(L.linear, L.reference, (x[0, 0, 0], w, b), grad_args=(0, 1, 2)).raise_if_failed()


def test_out_dtype_and_fp16(device):
    x, w, b, r = _inputs(33, 48, 40, torch.float16, device)
    y = L.linear(x, w, b, "relu2", r, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    want = L.reference(x.double(), w.double(), b.double(), "relu2", r.double())
    torch.testing.assert_close(y.double(), want, rtol=2e-3, atol=2e-3)
    check(L.linear, L.reference, (x, w, b, "gelu", r), grad_args=(0, 1, 2, 4)).raise_if_failed()


def test_swiglu_halves(device):
    # out = silu(x @ Wg^T + bg) * (x @ Wu^T + bu): both halves of the weight and bias get their own gradient.
    x, w, b, _ = _inputs(21, 35, 2 * 19, torch.float32, device, act="swiglu", residual=False)
    wg, wu, bg, bu = w[:19], w[19:], b[:19], b[19:]
    want = torch.nn.functional.silu(x.double() @ wg.double().T + bg.double()) * (x.double() @ wu.double().T + bu.double())
    w_, b_ = w.clone().requires_grad_(), b.clone().requires_grad_()
    y = L.linear(x, w_, b_, "swiglu")
    assert y.shape == (21, 19)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    dy = torch.randn(y.shape, device=device)
    y.backward(dy)
    wd, bd = w.double().requires_grad_(), b.double().requires_grad_()
    out = torch.nn.functional.silu(x.double() @ wd[:19].T + bd[:19]) * (x.double() @ wd[19:].T + bd[19:])
    out.backward(dy.double())
    for got, ref in ((w_.grad[:19], wd.grad[:19]), (w_.grad[19:], wd.grad[19:]), (b_.grad[:19], bd.grad[:19]),
                     (b_.grad[19:], bd.grad[19:])):
        assert ref.abs().sum() > 0
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_row_padded_x_and_transposed_weight_reach_the_kernel_uncopied(device):
    x, w, b, r = _inputs(37, 64, 100, torch.float32, device)
    xp = relayout(x, "row_padded")  # NaN around it: a wrong stride reads poison
    wt = relayout(w, "transposed")  # (N, K) view of a (K, N) buffer: strides (1, N)
    assert xp.stride(0) > 64 and wt.stride() == (1, 100)
    torch.testing.assert_close(wt, w)
    before = _validate.copies
    y = L.linear(xp, wt, b, "gelu", relayout(r, "row_padded"))
    assert _validate.copies == before
    want = L.reference(x.double(), w.double(), b.double(), "gelu", r.double())
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    # Column-major x and residual, a stepped x: strides of both dims reach the kernel.
    for xl, rl in (("transposed", "transposed"), ("stepped", "stepped")):
        y = L.linear(relayout(x, xl), w, b, "gelu", relayout(r, rl))
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    assert _validate.copies == before
    # matmul(a, b) reads b (K, N) through its strides: a transposed view needs no copy either.
    bt = w.T
    torch.testing.assert_close(L.matmul(xp, bt).double(), x.double() @ bt.double(), rtol=1e-5, atol=1e-5)
    assert _validate.copies == before


def test_matmul_leading_dims(device):
    a = torch.randn(2, 7, 19, device=device)
    bm = torch.randn(19, 45, device=device)
    torch.testing.assert_close(L.matmul(a, bm).double(), a.double() @ bm.double(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="b must be a 2-D"):
        L.matmul(a, torch.randn(2, 19, 3, device=device))


def test_empty_rows(device):
    x, w, b, _ = _inputs(4, 16, 8, torch.float32, device)
    assert L.linear(x[:0], w, b).shape == (0, 8)


def test_bad_inputs_name_the_argument(device):
    x, w, b, r = _inputs(4, 16, 8, torch.float32, device)
    cases = [
        (lambda: L.linear(x, w[:, :15]), ValueError, r"weight must have shape \(out_features, 16\)"),
        (lambda: L.linear(x, w.reshape(-1)), ValueError, "weight must have shape"),
        (lambda: L.linear(x, w.to(torch.bfloat16)), TypeError, "weight has dtype"),
        (lambda: L.linear(x, w, b[:7]), ValueError, r"bias must have shape \(8,\)"),
        (lambda: L.linear(x, w, b.double()), TypeError, "bias has dtype"),
        (lambda: L.linear(x.long(), w), TypeError, "x has dtype int64"),
        (lambda: L.linear(x, w, None, "tanh"), ValueError, "activation must be one of"),
        (lambda: L.linear(x, w[:7], None, "swiglu"), ValueError, "even out_features"),
        (lambda: L.linear(x, w, None, None, r[:, :7]), ValueError, r"residual must have the output's shape \(4, 8\)"),
        (lambda: L.linear(x, w, None, "swiglu", r), ValueError, r"residual must have the output's shape \(4, 4\)"),
        (lambda: L.linear(x, w, out_dtype=torch.int32), TypeError, "out_dtype"),
        (lambda: L.linear(x, w, scale="2"), TypeError, "scale must be a number"),
        (lambda: L.linear(x, w, scale=float("nan")), ValueError, "scale must be a finite number"),
        (lambda: L.linear(x, "w"), TypeError, "weight must be a torch.Tensor"),
        (lambda: L.Linear(16, 7, activation="swiglu"), ValueError, "even out_features"),
        (lambda: L.Linear(16, 8, activation="gelu_erf"), ValueError, "activation must be one of"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()


def _count_launches(monkeypatch):
    seen = []
    real = L.launch

    def counting(kernel, grid, key, *args, **kwargs):
        seen.append(kwargs)
        return real(kernel, grid, key, *args, **kwargs)

    monkeypatch.setattr(L, "launch", counting)
    return seen


def test_nn_linear_state_dict_and_kernel(device, monkeypatch):
    seen = _count_launches(monkeypatch)
    torch.manual_seed(0)
    ref = torch.nn.Linear(24, 40).to(device)
    mod = L.Linear(24, 40, activation="silu").to(device)
    mod.load_state_dict(ref.state_dict())
    assert mod.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(3, 5, 24, device=device, requires_grad=True)
    y = mod(x)
    assert len(seen) == 1 and seen[0]["ACTIVATION"] == "silu"
    torch.testing.assert_close(y, torch.nn.functional.silu(ref(x)), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert mod.weight.grad is not None and mod.bias.grad is not None
    back = torch.nn.Linear(24, 40).to(device)
    back.load_state_dict(mod.state_dict())
    torch.testing.assert_close(back.weight, ref.weight, rtol=0, atol=0)
    nobias = L.Linear(24, 40, bias=False).to(device)
    assert nobias.bias is None and "bias" not in nobias.state_dict()
    torch.testing.assert_close(nobias(x), x @ nobias.weight.T, rtol=1e-5, atol=1e-5)
    assert "activation='silu'" in repr(mod)


@pytest.mark.parametrize("allow", [False, True])
def test_fp32_precision_follows_torch_tf32_flag(allow, device, monkeypatch):
    # The interpreter computes exactly either way, so the test checks what the kernel was told.
    seen = _count_launches(monkeypatch)
    x, w, b, _ = _inputs(8, 16, 8, torch.float32, device)
    w.requires_grad_()
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow
    try:
        L.linear(x, w, b, "gelu").sum().backward()  # the backward's recompute of z gets the same choice
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    assert [s["INPUT_PRECISION"] for s in seen] == ["tf32" if allow else "ieee"] * 2
    seen.clear()
    L.linear(x.bfloat16(), w.detach().bfloat16())
    assert seen[0]["INPUT_PRECISION"] is None  # 16-bit inputs: Triton's default tensor-core path


def test_double_backward_with_swiglu_residual_scale(device):
    x, w, b, r = _inputs(9, 20, 14, torch.float32, device, act="swiglu")
    args = [t.clone().requires_grad_() for t in (x, w, b, r)]
    ref_args = [t.double().requires_grad_() for t in (x, w, b, r)]

    def penalty(fn, a):
        y = fn(a[0], a[1], a[2], "swiglu", a[3], scale=0.5)
        gs = torch.autograd.grad((y.double() ** 2).sum(), a, create_graph=True)
        return sum((g.double() ** 2).sum() for g in gs)

    got = torch.autograd.grad(penalty(L.linear, args), args)
    want = torch.autograd.grad(penalty(L.reference, ref_args), ref_args)
    for g, wnt in zip(got, want):
        torch.testing.assert_close(g.double(), wnt, rtol=1e-4, atol=1e-4)


def test_custom_op_path(device):
    # The torch.compile route: the custom op's fake impl, and its registered autograd (recompute via the op).
    x, w, b, r = _inputs(6, 16, 12, torch.float32, device, act="gelu")
    xm = x.to("meta")
    out = L.linear(xm, w.to("meta"), b.to("meta"), "swiglu", r[:, :6].to("meta"), out_dtype=torch.bfloat16)
    assert out.device.type == "meta" and out.shape == (6, 6) and out.dtype == torch.bfloat16
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = L._linear_op(xs, ws, b, r, "gelu", 0.5, None, False)
    y.sum().backward()
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    L.reference(xd, wd, b.double(), "gelu", r.double(), scale=0.5).sum().backward()
    torch.testing.assert_close(xs.grad.double(), xd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ws.grad.double(), wd.grad, rtol=1e-5, atol=1e-5)
    got = torch.library.opcheck(L._linear_op, (xs, ws, b, r[:, :6], "swiglu", 0.5, None, False))
    assert set(got.values()) == {"SUCCESS"}, got


def test_registry_cost():
    from kernelkit.ops import registry

    spec = registry.get("linear")
    (x, w, b), kw = spec.make_inputs((64, 32, 48), torch.bfloat16, "cpu")
    c = spec.cost(x, w, b, **kw)
    assert c.flops == 2 * 64 * 32 * 48 and c.dtype == "bf16"
    assert c.bytes == 2 * (64 * 32 + 48 * 32 + 48 + 64 * 48)
    assert spec.cost(x, w, b, backward=True).flops == 4 * 64 * 32 * 48


@pytest.mark.parametrize("m,k,n", [(3, 0, 4), (3, 5, 0), (0, 5, 4)])
def test_backward_with_an_empty_dimension(m, k, n, device):
    # F.linear's backward gives empty or zero gradients here; reshape(-1, 0) of an empty tensor used to raise.
    x = torch.randn(m, k, device=device, requires_grad=True)
    w = torch.randn(n, k, device=device, requires_grad=True)
    b = torch.randn(n, device=device, requires_grad=True)
    kernelkit.linear(x, w, b).sum().backward()
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    torch.nn.functional.linear(xr, wr, br).sum().backward()
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert got.shape == want.shape and torch.equal(got.double(), want)


def test_a_scale_that_requires_grad_is_refused(device):
    # scale is a constant of the epilogue: a tensor needing a gradient would silently get none.
    x, w = torch.randn(4, 16, device=device), torch.randn(8, 16, device=device)
    s = torch.tensor(0.5, device=device, requires_grad=True)
    with pytest.raises(TypeError, match="scale is a tensor that requires grad"):
        kernelkit.linear(x, w, scale=s)
    with torch.no_grad():
        torch.testing.assert_close(kernelkit.linear(x, w, scale=s), 0.5 * x @ w.t())


def test_autocast_bf16_x_fp32_weight_matmul_and_compile(device):
    """torch.autocast: a bf16 x with an fp32 master weight and bias (it raised TypeError) computes in bf16 as
    F.linear does, with fp32 gradients for the masters; matmul follows torch.matmul; torch.compile traces the
    casts in the wrappers around the custom op (one graph)."""
    dev = "cuda" if device == "cuda" else "cpu"
    x, w, b, r = _inputs(24, 64, 40, torch.float32, device, seed=3)
    w, b = w.requires_grad_(), b.requires_grad_()
    xb = x.bfloat16()

    def run(x, w, b, r):
        with torch.autocast(dev, dtype=torch.bfloat16):
            return L.linear(x, w, b, "silu", r, scale=0.5), L.linear(x, w, b), L.matmul(x, w.t())

    with torch.autocast(dev, dtype=torch.bfloat16):
        want = torch.nn.functional.linear(xb, w, b)
        want_mm = xb @ w.t()
    got = run(xb, w, b, r)
    assert [t.dtype for t in got] == [torch.float32, torch.bfloat16, torch.bfloat16]
    assert want.dtype == want_mm.dtype == torch.bfloat16
    torch.testing.assert_close(got[0], 0.5 * torch.nn.functional.silu(want.float()) + r, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[1].float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[2].float(), want_mm.float(), rtol=2e-2, atol=2e-2)
    got[0].sum().backward()
    wr, br = (t.detach().clone().requires_grad_() for t in (w, b))
    with torch.autocast(dev, dtype=torch.bfloat16):
        (0.5 * torch.nn.functional.silu(torch.nn.functional.linear(xb, wr, br)) + r).sum().backward()
    assert w.grad.dtype == b.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, wr.grad, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(b.grad, br.grad, rtol=2e-2, atol=5e-2)
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True)(xb, w, b, r)
    for c, e in zip(compiled, got):
        assert c.dtype == e.dtype
        torch.testing.assert_close(c, e, rtol=1e-2, atol=1e-2)


def test_matmul_validates_b_as_b(device):
    # matmul's own checks: errors about b name b (linear's would name the weight, with b's shape transposed).
    a = torch.randn(5, 8, device=device)
    with pytest.raises(ValueError, match="b is on meta but a is on cpu" if device == "cpu" else "b is on meta"):
        L.matmul(a, torch.randn(8, 4, device="meta"))
    with torch.autocast("cuda" if device == "cuda" else "cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match="b has dtype int64; supported"):
            L.matmul(a, torch.ones(8, 4, dtype=torch.long, device=device))


def test_vmap_runs_the_kernel_and_grad_transforms_raise(device, monkeypatch):
    seen = _count_launches(monkeypatch)
    x, w, b, r = _inputs(6, 16, 12, torch.float32, device, seed=5, lead=(3,))
    # One weight for the batch: one GEMM over the batch folded into the rows (also with the batch dim inside x).
    y = torch.func.vmap(lambda xx, rr: L.linear(xx, w, b, "gelu", rr, scale=0.5))(x, r)
    assert len(seen) == 1
    torch.testing.assert_close(y, L.reference(x, w, b, "gelu", r, scale=0.5), rtol=1e-5, atol=1e-5)
    y = torch.func.vmap(lambda xx: L.matmul(xx, w.t()), in_dims=1)(x.transpose(0, 1))
    torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5)
    # A weight per sample: a GEMM each; autograd through the vmapped call reaches the batched weights.
    ws = torch.randn(3, 12, 16, device=device, requires_grad=True)
    seen.clear()
    y = torch.func.vmap(lambda ww, xx: L.linear(xx, ww, b, "silu"))(ws, x)
    assert len(seen) == 3
    wd = ws.detach().double().requires_grad_()
    want = torch.stack([L.reference(x[i].double(), wd[i], b.double(), "silu") for i in range(3)])
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(ws.grad.double(), wd.grad, rtol=1e-4, atol=1e-4)
    # grad-like transforms would hand the kernels wrapped tensors: a clear error instead.
    for transform in (lambda f: torch.func.grad(f)(w), lambda f: torch.func.jvp(f, (w,), (w,)),
                      lambda f: torch.func.vmap(torch.func.grad(f))(ws.detach())):
        with pytest.raises(NotImplementedError, match="does not support torch.func.grad.*torch.autograd"):
            transform(lambda ww: L.linear(x[0], ww, b).sum())
