import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelkit
import kernelkit.ops.rms_norm as mod
from kernelkit.ops import registry
from kernelkit.testing import check, check_spec
from kernelkit.testing.graph import compile_as_one_node

SPEC = registry.get("add_rms_norm")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(3, 7), (37, 1000), (2, 3, 129)])
def test_matches_fp64_reference(shape, dtype, device):
    check_spec(SPEC, shape, dtype, device=device).raise_if_failed()


def test_looped_kernels(device, monkeypatch):
    monkeypatch.setattr(mod, "MAX_FUSED_N", 256)
    monkeypatch.setattr(mod, "LOOP_BLOCK_N", 128)
    check_spec(SPEC, (6, 1000), "float32", device=device, trials=1).raise_if_failed()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_summed_is_rounded_before_the_norm_like_unfused_code(seed, device):
    gen = torch.Generator(device=device).manual_seed(seed)
    x, r = (torch.randn(5, 300, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    w = torch.randn(300, device=device, dtype=torch.bfloat16, generator=gen)
    y, s = mod.add_rms_norm(x, r, w)
    if device == "cuda":
        assert torch.equal(s, x + r)
        ulps = 1  # fp32 summation order may move the one rounding of y by an ulp
    else:  # Triton's interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest
        torch.testing.assert_close(s, x + r, rtol=2 ** -7, atol=0)
        ulps = 2
    # normed is the norm of the rounded sum: compare with the reference applied to summed itself.
    torch.testing.assert_close(y, mod.reference(s, w), rtol=ulps * 2 ** -7, atol=1e-5)


def test_only_one_output_used_and_no_weight(device):
    x = torch.randn(4, 65, device=device, requires_grad=True)
    r = torch.randn(4, 65, device=device, requires_grad=True)
    y, _ = mod.add_rms_norm(x, r)
    y.sum().backward()  # no gradient flows into summed
    xr, rr = x.detach().double().requires_grad_(), r.detach().double().requires_grad_()
    mod.reference(xr + rr).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.grad, x.grad)


def test_only_the_residual_stream_used(device):
    # A last block whose normed output is dropped: dx = dresidual = dsummed exactly.
    x = torch.randn(4, 65, device=device, requires_grad=True)
    r = torch.randn(4, 65, device=device, requires_grad=True)
    w = torch.randn(65, device=device, requires_grad=True)
    ds = torch.randn(4, 65, device=device)
    _, s = mod.add_rms_norm(x, r, w)
    s.backward(ds)
    assert torch.equal(x.grad, ds) and torch.equal(r.grad, ds)
    assert w.grad is None or not w.grad.any()


def test_gemma_offset_and_eps(device):
    x, r = torch.randn(9, 300, device=device), torch.randn(9, 300, device=device)
    w = 0.1 * torch.randn(300, device=device)
    check(lambda x, r, w: mod.add_rms_norm(x, r, w, 1e-5, 1.0),
          lambda x, r, w: mod.add_reference(x, r, w, 1e-5, 1.0), (x, r, w), grad_args=(0, 1, 2)).raise_if_failed()


def test_gradients_accumulate_separately_into_x_and_residual(device):
    # The backward returns one tensor for both inputs; autograd must not alias the two .grad fields.
    x = torch.randn(3, 40, device=device, requires_grad=True)
    r = torch.randn(3, 40, device=device, requires_grad=True)
    for _ in range(2):
        y, s = mod.add_rms_norm(x, r)
        (y.sum() + s.sum()).backward()
    assert x.grad.data_ptr() != r.grad.data_ptr()
    torch.testing.assert_close(x.grad, r.grad)


def test_non_contiguous_and_empty(device):
    x = torch.randn(40, 2 * 333, device=device)[::2, ::2]
    r = torch.randn(333, 20, device=device).t()
    check(mod.add_rms_norm, mod.add_reference, (x, r, torch.randn(333, device=device)),
          grad_args=(0, 1, 2)).raise_if_failed()
    y, s = mod.add_rms_norm(torch.randn(0, 8, device=device), torch.randn(0, 8, device=device))
    assert y.shape == s.shape == (0, 8)


def test_nan_and_inf_propagate_like_unfused_code(device):
    x, r = torch.randn(4, 33, device=device), torch.randn(4, 33, device=device)
    x[1, 3], r[2, 5] = float("nan"), float("inf")
    w = torch.randn(33, device=device)
    (y, s), (want_y, want_s) = mod.add_rms_norm(x, r, w), mod.add_reference(x, r, w)
    assert torch.equal(torch.isnan(s), torch.isnan(want_s)) and torch.equal(torch.isinf(s), torch.isinf(want_s))
    assert torch.equal(torch.isnan(y), torch.isnan(want_y))
    torch.testing.assert_close(y[[0, 3]], want_y[[0, 3]], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args,match", [
    (lambda d: (torch.randn(2, 8, device=d), torch.randn(2, 9, device=d)), "residual must match"),
    (lambda d: (torch.randn(2, 8, device=d), torch.randn(2, 8, device=d, dtype=torch.float16)), "residual must match"),
    (lambda d: (torch.randn(2, 8, device=d), torch.ones(2, 8, dtype=torch.int32, device=d)), "residual has dtype"),
    (lambda d: (torch.randn(2, 8, device=d), torch.randn(2, 8, device="meta")), "residual is on meta"),
    (lambda d: (torch.randn(2, 8, device=d), [[0.0] * 8] * 2), "residual must be a torch.Tensor"),
    (lambda d: (torch.randn(2, 8, device=d), torch.randn(2, 8, device=d), torch.randn(9, device=d)),
     "weight must have shape"),
    (lambda d: (torch.randn(2, 8, device=d), torch.randn(2, 8, device=d), None, -1e-6), "eps must be"),
])
def test_bad_input_names_the_argument(args, match, device):
    with pytest.raises((TypeError, ValueError), match=match):
        mod.add_rms_norm(*args(device))


def test_custom_op_schema_fake_trace_and_compile(device):
    from torch.fx.experimental.proxy_tensor import make_fx

    args = (torch.randn(3, 40, device=device), torch.randn(3, 40, device=device), torch.randn(40, device=device),
            1e-6, 0.0)
    torch.library.opcheck(torch.ops.kernelkit.add_rms_norm.default, args, test_utils=("test_schema", "test_faketensor"))
    _, rstd, s = torch.ops.kernelkit.add_rms_norm(*args)
    torch.library.opcheck(torch.ops.kernelkit.add_rms_norm_bwd.default,
                          (torch.randn(3, 40, device=device), s, args[2], rstd, 0.0, torch.randn(3, 40, device=device)),
                          test_utils=("test_schema", "test_faketensor"))
    gm = make_fx(lambda x, r, w: torch.ops.kernelkit.add_rms_norm(x, r, w, 1e-6, 0.0), tracing_mode="fake")(*args[:3])
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.kernelkit.add_rms_norm.default) == 1, calls
    x, r, w = (a.clone().requires_grad_() for a in args[:3])
    y, s = compile_as_one_node(mod.add_rms_norm, (x, r, w), "add_rms_norm")
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, mod.reference(x + r, w), rtol=1e-5, atol=1e-5)


def test_exported_at_top_level():
    assert kernelkit.add_rms_norm is mod.add_rms_norm


def test_cost_counts_ideal_bytes():
    x = torch.empty(16384, 4096, dtype=torch.bfloat16)
    w = torch.empty(4096, dtype=torch.bfloat16)
    # forward: read x, residual, w; write normed, summed. backward: read dy, dsummed, summed, w; write dx, dw.
    assert SPEC.cost(x, x, w).bytes == 4 * x.numel() * 2 + 4096 * 2
    assert SPEC.cost(x, x, w, backward=True).bytes == 4 * x.numel() * 2 + 2 * 4096 * 2


@settings(max_examples=6, deadline=None)
@given(rows=st.integers(1, 7), n=st.integers(2, 600), dtype=st.sampled_from(["float32", "bfloat16", "float16"]))
def test_random_shapes(rows, n, dtype):
    import os

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    check_spec(SPEC, (rows, n), dtype, device=device, trials=1).raise_if_failed()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 4096), (8192, 8192), (1, 4096), (3, 65537)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_large_shapes(shape, dtype):
    check_spec(SPEC, shape, dtype, device="cuda", trials=2).raise_if_failed()


@pytest.mark.gpu
def test_gpu_liger_competitor_gives_our_outputs_in_our_order():
    pytest.importorskip("liger_kernel")
    liger = SPEC.competitors["liger"]()
    args, kw = SPEC.make_inputs((64, 4096), torch.bfloat16, "cuda")
    x0, r0 = args[0].clone(), args[1].clone()
    (y, s), (ly, ls) = SPEC.fn(*args, **kw), liger(*args, **kw)
    assert torch.equal(args[0], x0) and torch.equal(args[1], r0)  # in_place=False leaves the inputs alone
    assert torch.equal(s, ls)
    torch.testing.assert_close(y, ly, rtol=1e-2, atol=1e-2)
