import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelkit
from kernelkit.ops import registry
from kernelkit.ops.rms_norm import reference
from kernelkit.testing import check, check_spec
from kernelkit.testing.graph import compile_as_one_node

SPEC = registry.get("rms_norm")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(3, 7), (37, 1000), (5, 4097), (2, 3, 129)])
def test_matches_fp64_reference(shape, dtype, device):
    check_spec(SPEC, shape, dtype, device=device).raise_if_failed()


def test_single_element_rows(device):
    # N = 1: the gradient is a cancellation of two equal terms, so only the forward is compared.
    x = torch.randn(17, 1, device=device)
    check(kernelkit.rms_norm, reference, (x, torch.rand(1, device=device) + 0.5)).raise_if_failed()


@pytest.mark.parametrize("offset,has_weight", [(1.0, True), (0.0, False)])
def test_offset_and_no_weight(offset, has_weight, device):
    x = torch.randn(9, 300, device=device, dtype=torch.bfloat16)
    w = torch.randn(300, device=device, dtype=torch.bfloat16) * 0.1 if has_weight else None
    check(lambda x, w: kernelkit.rms_norm(x, w, 1e-5, offset), lambda x, w: reference(x, w, 1e-5, offset),
          (x, w), grad_args=(0, 1) if has_weight else (0,)).raise_if_failed()


@pytest.mark.parametrize("looped", [False, True])
def test_eps_is_added_to_the_mean_square(looped, device, monkeypatch):
    # Activations of ~1e-3 have a mean square of ~1e-6, far below eps = 1e-2: eps sets the scale of y, so an eps
    # dropped, scaled or added twice (in the fused or the looped kernel) is off by a factor, not a rounding.
    import kernelkit.ops.rms_norm as mod

    if looped:
        monkeypatch.setattr(mod, "MAX_FUSED_N", 256)
        monkeypatch.setattr(mod, "LOOP_BLOCK_N", 128)
    x = torch.randn(7, 300, device=device) * 1e-3
    w = 1.0 + 0.1 * torch.randn(300, device=device)
    check(lambda x, w: kernelkit.rms_norm(x, w, 1e-2), lambda x, w: reference(x, w, 1e-2), (x, w),
          grad_args=(0, 1)).raise_if_failed()
    # Where mean(x²) is about eps, both terms matter: y is x / sqrt(2 eps), not x / sqrt(eps).
    x = torch.randn(7, 300, device=device) * 0.1
    check(lambda x, w: kernelkit.rms_norm(x, w, 1e-2), lambda x, w: reference(x, w, 1e-2), (x, w),
          grad_args=(0, 1)).raise_if_failed()


def test_looped_kernel_long_rows(device, monkeypatch):
    # Force the looped kernels at a small size so the interpreter can run them quickly.
    import kernelkit.ops.rms_norm as mod

    monkeypatch.setattr(mod, "MAX_FUSED_N", 256)
    monkeypatch.setattr(mod, "LOOP_BLOCK_N", 128)
    x = torch.randn(6, 1000, device=device)
    check(kernelkit.rms_norm, reference, (x, torch.randn(1000, device=device)), grad_args=(0, 1)).raise_if_failed()


def test_non_contiguous_input(device):
    base = torch.randn(40, 2 * 333, device=device)
    x = base[::2, ::2]  # strided rows and columns
    check(kernelkit.rms_norm, reference, (x, torch.randn(333, device=device)), grad_args=(0, 1)).raise_if_failed()


def test_empty_input(device):
    x = torch.randn(0, 64, device=device)
    assert kernelkit.rms_norm(x, torch.ones(64, device=device)).shape == (0, 64)


def test_nan_and_inf_propagate_like_torch(device):
    x = torch.randn(4, 33, device=device)
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    w = torch.randn(33, device=device)
    got, want = kernelkit.rms_norm(x, w), reference(x, w)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.allclose(got[[0, 3]], want[[0, 3]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad,match", [
    (lambda d: (torch.ones(4, 8, dtype=torch.int64, device=d), None), "x has dtype int64"),
    (lambda d: (torch.ones(4, 8, device=d), torch.ones(7, device=d)), "weight must have shape"),
    (lambda d: (torch.ones(4, 8, device=d), torch.ones(8, dtype=torch.int32, device=d)), "weight has dtype"),
])
def test_bad_input_names_the_argument(bad, match, device):
    x, w = bad(device)
    with pytest.raises((TypeError, ValueError), match=match):
        kernelkit.rms_norm(x, w)


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="x is on cpu"):
        kernelkit.rms_norm(torch.ones(2, 8), None)


def test_module_is_state_dict_compatible(device):
    ref = torch.nn.RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        ref.weight.normal_()
    ours = kernelkit.nn.RMSNorm(48, eps=1e-5)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, 48)
    torch.testing.assert_close(ours.to(device)(x.to(device)).cpu(), ref(x), rtol=1e-5, atol=1e-5)


def test_custom_op_is_registered_and_compiles_without_graph_breaks(device):
    args = (torch.randn(3, 40, device=device), torch.randn(40, device=device), 1e-6, 0.0)
    torch.library.opcheck(torch.ops.kernelkit.rms_norm.default, args, test_utils=("test_schema", "test_faketensor"))
    _, rstd = torch.ops.kernelkit.rms_norm(*args)
    torch.library.opcheck(torch.ops.kernelkit.rms_norm_bwd.default,
                          (torch.randn(3, 40, device=device), args[0], args[1], rstd, 0.0, None),
                          test_utils=("test_schema", "test_faketensor"))
    x = torch.randn(3, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=True)
    y = compile_as_one_node(lambda x, w: kernelkit.rms_norm(x, w), (x, w), "rms_norm")
    torch.testing.assert_close(y, reference(x, w), rtol=1e-5, atol=1e-5)


BWD_OP = {"rms_norm": "kernelkit.rms_norm_bwd", "add_rms_norm": "kernelkit.add_rms_norm_bwd",
          "layer_norm": "kernelkit.layer_norm_bwd"}


@pytest.mark.parametrize("op", list(BWD_OP))
def test_declared_ops_gradients_eager_and_compiled(op, device):
    """Each norm is declared once (ops/_dispatch.Op): eager autograd runs its Function, torch.compile's backward
    graph its backward op. Both give the float64 reference's gradients of every differentiable argument."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    spec = registry.get(op)
    args, kwargs = spec.make_inputs((5, 37), torch.float32, device, torch.Generator(device=device).manual_seed(3))
    ref = [a.double().requires_grad_() for a in args]
    outs = spec.reference(*ref, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gouts = [torch.randn(o.shape, dtype=torch.float64, device=device) for o in outs]
    want = torch.autograd.grad(outs, ref, gouts)
    backward_nodes = []

    def bw_compiler(gm, _):
        backward_nodes.extend(n for n in gm.graph.nodes if BWD_OP[op] in str(n.target))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: spec.fn(*a, **kwargs), fullgraph=True, backend=aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=bw_compiler))
    for route in (lambda *a: spec.fn(*a, **kwargs), compiled):
        inputs = [a.clone().requires_grad_() for a in args]
        got = route(*inputs)
        got = got if isinstance(got, tuple) else (got,)
        if route is not compiled:
            assert type(got[0].grad_fn).__name__.startswith(f"{op}_function"), type(got[0].grad_fn)
        grads = torch.autograd.grad(got, inputs, [g.float() for g in gouts])
        for g, w in zip(grads, want):
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)
    assert len(backward_nodes) == 1, backward_nodes


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 9), n=st.integers(2, 700), dtype=st.sampled_from(["float32", "bfloat16", "float16"]))
def test_random_shapes(rows, n, dtype):
    import os

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    check_spec(SPEC, (rows, n), dtype, device=device, trials=1).raise_if_failed()


def test_cost_counts_ideal_bytes():
    x, w = torch.empty(16384, 4096, dtype=torch.bfloat16), torch.empty(4096, dtype=torch.bfloat16)
    assert SPEC.cost(x, w).bytes == 2 * 16384 * 4096 * 2 + 4096 * 2
    assert SPEC.cost(x, w, backward=True).bytes == 3 * 16384 * 4096 * 2 + 2 * 4096 * 2
    assert math.isclose(SPEC.cost(x, w).arithmetic_intensity, 4 * x.numel() / SPEC.cost(x, w).bytes)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (16384, 8192), (7, 65537), (3, 131072), (1, 4096)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_large_shapes(shape, dtype):
    check_spec(SPEC, shape, dtype, device="cuda", trials=2).raise_if_failed()


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = torch.compile(lambda x, w: kernelkit.rms_norm(x, w).square().sum(), fullgraph=True)
    f(x, w).backward()
    assert x.grad is not None and w.grad is not None and torch.isfinite(x.grad).all()
