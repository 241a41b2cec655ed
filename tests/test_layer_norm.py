import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelkit.ops.layer_norm as mod
from kernelkit.ops import registry
from kernelkit.testing import check, check_spec
from kernelkit.testing.graph import compile_as_one_node
from kernelkit.runtime import prune_row_tiles, row_tile_configs

SPEC = registry.get("layer_norm")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(3, 7), (37, 1000), (5, 4097), (2, 3, 129)])
def test_matches_fp64_reference(shape, dtype, device):
    check_spec(SPEC, shape, dtype, device=device).raise_if_failed()


@pytest.mark.parametrize("has_w,has_b", [(True, False), (False, True), (False, False)])
def test_optional_weight_and_bias(has_w, has_b, device):
    x = torch.randn(9, 300, device=device) + 3.0
    w = torch.randn(300, device=device) if has_w else None
    b = torch.randn(300, device=device) if has_b else None
    grads = (0,) + ((1,) if has_w else ()) + ((2,) if has_b else ())
    check(mod.layer_norm, mod.reference, (x, w, b), grad_args=grads).raise_if_failed()


def test_single_element_rows(device):
    # N = 1: xhat is exactly 0, so y = bias, db = sum(dy), dw = 0 exactly and dx = 0 up to rounding (the
    # float64 reference leaves ~1e-14 of noise there, so those two are checked against zero: dw exactly; dx,
    # rstd * (w*dy - mean(w*dy)) with rstd = 1/sqrt(eps) ~ 316, to a few fp32 ulps of rstd * |w*dy|, which
    # the GPU's fused multiply-adds leave).
    x, w, b = torch.randn(17, 1, device=device), torch.randn(1, device=device), torch.randn(1, device=device)
    check(mod.layer_norm, mod.reference, (x, w, b), grad_args=(2,)).raise_if_failed()
    x.requires_grad_(True)
    w.requires_grad_(True)
    dy = torch.randn(17, 1, device=device)
    mod.layer_norm(x, w, b).backward(dy)
    assert not w.grad.any()
    bound = 4 * torch.finfo(torch.float32).eps * (w * dy).abs() / math.sqrt(1e-5)
    assert (x.grad.abs() <= bound).all(), (x.grad, bound)


def test_looped_kernels_and_large_mean(device, monkeypatch):
    monkeypatch.setattr(mod, "MAX_FUSED_N", 256)
    monkeypatch.setattr(mod, "LOOP_BLOCK_N", 128)
    x = torch.randn(6, 1000, device=device) + 100.0  # the variance must not cancel
    check(mod.layer_norm, mod.reference, (x, torch.randn(1000, device=device), torch.randn(1000, device=device)),
          grad_args=(0, 1, 2)).raise_if_failed()


@pytest.mark.parametrize("has_b", [True, False])
def test_fused_forward_with_looped_backward(has_b, device, monkeypatch):
    # Rows between MAX_FUSED_BWD_N and MAX_FUSED_N: fused forward, looped backward. 11 rows over the
    # interpreter's 4 programs: each program accumulates several rows into its dw/db partial rows.
    monkeypatch.setattr(mod, "MAX_FUSED_BWD_N", 256)
    monkeypatch.setattr(mod, "LOOP_BLOCK_N", 128)
    x = torch.randn(11, 1000, device=device, dtype=torch.bfloat16) - 5.0
    w = torch.randn(1000, device=device, dtype=torch.bfloat16)
    b = torch.randn(1000, device=device, dtype=torch.bfloat16) if has_b else None
    check(mod.layer_norm, mod.reference, (x, w, b), grad_args=(0, 1, 2) if has_b else (0, 1)).raise_if_failed()


def test_fused_backward_rows_fit_in_registers():
    # Every row the fused backward takes must leave it a tile of <= 32 elements a thread. With none
    # left (rows of 32768) the pruner falls back to a 16-row tile that ptxas takes minutes over.
    configs = row_tile_configs(warps=(4, 8, 16))
    for block_n in (2 ** k for k in range(4, int(math.log2(mod.MAX_FUSED_BWD_N)) + 1)):
        kept = prune_row_tiles(32)(configs, {"BLOCK_N": block_n})
        assert all(c.kwargs["ROWS"] * block_n / (c.num_warps * 32) <= 32 for c in kept), block_n


def test_fp32_parameters_with_bf16_activations(device):
    x = torch.randn(7, 200, device=device, dtype=torch.bfloat16)
    w, b = torch.randn(200, device=device), torch.randn(200, device=device)
    check(mod.layer_norm, mod.reference, (x, w, b), grad_args=(0, 1, 2)).raise_if_failed()
    w.requires_grad_(True)
    mod.layer_norm(x, w, b).sum().backward()
    assert w.grad.dtype == torch.float32


def test_non_contiguous_and_empty(device):
    x = torch.randn(40, 2 * 333, device=device)[::2, ::2]
    check(mod.layer_norm, mod.reference, (x, torch.randn(333, device=device), None), grad_args=(0, 1)).raise_if_failed()
    assert mod.layer_norm(torch.randn(0, 8, device=device)).shape == (0, 8)
    x = torch.randn(0, 8, device=device, requires_grad=True)
    w = torch.randn(8, device=device, requires_grad=True)
    mod.layer_norm(x, w).sum().backward()
    assert x.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros(8, device=device))


def test_nan_and_inf_propagate_like_torch(device):
    x = torch.randn(5, 33, device=device)
    x[1, 3], x[2, 5], x[3, 0] = float("nan"), float("inf"), -float("inf")
    w, b = torch.randn(33, device=device), torch.randn(33, device=device)
    got, want = mod.layer_norm(x, w, b), F.layer_norm(x, (33,), w, b)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    torch.testing.assert_close(got[[0, 4]], want[[0, 4]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (lambda d: (torch.ones(2, 8, device=d), None, torch.ones(7, device=d), 1e-5), "bias must have shape"),
    (lambda d: (torch.ones(2, 8, device=d), torch.ones(8, 1, device=d), None, 1e-5), "weight must have shape"),
    (lambda d: (torch.ones(2, 8, dtype=torch.int64, device=d), None, None, 1e-5), "x has dtype int64"),
    (lambda d: (torch.ones(2, 8, device=d), torch.ones(8, dtype=torch.int32, device=d), None, 1e-5),
     "weight has dtype int32"),
    (lambda d: (torch.tensor(1.0, device=d), None, None, 1e-5), "x must have at least 1 dimension"),
    (lambda d: (torch.ones(2, 8, device=d), None, torch.ones(8, device="meta"), 1e-5), "bias is on meta"),
    (lambda d: (torch.ones(2, 8, device=d), None, None, -1.0), "eps must be"),
    (lambda d: (torch.ones(2, 8, device=d), None, None, float("nan")), "eps must be"),
])
def test_bad_input_names_the_argument(bad, match, device):
    with pytest.raises((TypeError, ValueError), match=match):
        mod.layer_norm(*bad(device))


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="x is on cpu"):
        mod.layer_norm(torch.ones(2, 8))


@pytest.mark.parametrize("shape,kw", [(48, {}), ((6, 8), {}), (48, {"bias": False}),
                                      (48, {"elementwise_affine": False, "eps": 1e-3})])
def test_module_matches_torch_and_loads_its_state_dict(shape, kw, device):
    ref = torch.nn.LayerNorm(shape, **kw)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    ours = mod.LayerNorm(shape, **kw)
    ours.load_state_dict(ref.state_dict())
    assert ours.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(5, 3, *((shape,) if isinstance(shape, int) else shape)) + 2.0
    ours.to(device)
    xd, xr = x.to(device).requires_grad_(True), x.detach().clone().requires_grad_(True)
    y, want = ours(xd), ref(xr)
    torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(want)
    y.backward(dy.to(device))
    want.backward(dy)
    torch.testing.assert_close(xd.grad.cpu(), xr.grad, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_module_cpu_fallback_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # documented: a CPU tensor runs torch's forward
    ours, ref = mod.LayerNorm(16), torch.nn.LayerNorm(16)
    x = torch.randn(3, 16)
    torch.testing.assert_close(ours(x), ref(x))


def test_custom_op_schema_fake_trace_and_single_graph_node(device):
    from torch.fx.experimental.proxy_tensor import make_fx

    args = (torch.randn(3, 40, device=device), torch.randn(40, device=device), torch.randn(40, device=device), 1e-5)
    torch.library.opcheck(torch.ops.kernelkit.layer_norm.default, args, test_utils=("test_schema", "test_faketensor"))
    _, mean, rstd = torch.ops.kernelkit.layer_norm(*args)
    torch.library.opcheck(torch.ops.kernelkit.layer_norm_bwd.default,
                          (torch.randn(3, 40, device=device), *args[:3], mean, rstd),
                          test_utils=("test_schema", "test_faketensor"))
    gm = make_fx(lambda x, w, b: mod.layer_norm(x, w, b), tracing_mode="fake")(*args[:3])
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.kernelkit.layer_norm.default) == 1, calls
    x, w, b = (a.clone().requires_grad_() for a in args[:3])
    y = compile_as_one_node(mod.layer_norm, (x, w, b), "layer_norm")
    torch.testing.assert_close(y, mod.reference(x, w, b), rtol=1e-5, atol=1e-5)


def test_cost_counts_ideal_bytes():
    x, w = torch.empty(16384, 4096, dtype=torch.bfloat16), torch.empty(4096, dtype=torch.bfloat16)
    b = torch.empty(4096, dtype=torch.bfloat16)
    assert SPEC.cost(x, w, b).bytes == 2 * x.numel() * 2 + 2 * 4096 * 2
    assert SPEC.cost(x, w, b, backward=True).bytes == 3 * x.numel() * 2 + 2 * 2 * 4096 * 2
    assert SPEC.cost(x).bytes == 2 * x.numel() * 2


@settings(max_examples=6, deadline=None)
# n >= 3: with two elements both normalized values are +-1 and the true gradient is only the eps
# term, a cancellation no fp32 kernel (torch's included) reproduces to 1e-5.
@given(rows=st.integers(1, 7), n=st.integers(3, 600), dtype=st.sampled_from(["float32", "bfloat16", "float16"]))
def test_random_shapes(rows, n, dtype):
    import os

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    check_spec(SPEC, (rows, n), dtype, device=device, trials=1).raise_if_failed()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (16384, 2048), (16384, 8192), (8192, 8192), (1, 4096),
                                   (17, 12288), (5, 32768), (3, 65537)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_large_shapes(shape, dtype):
    check_spec(SPEC, shape, dtype, device="cuda", trials=2).raise_if_failed()


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = torch.compile(lambda x, w, b: mod.layer_norm(x, w, b).square().sum(), fullgraph=True)
    f(x, w, b).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (x, w, b))
