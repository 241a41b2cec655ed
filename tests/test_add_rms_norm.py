import pytest
import torch

import kernelkit.ops.rms_norm as mod
from kernelkit.ops import registry
from kernelkit.testing import check_spec
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


def test_summed_is_rounded_before_the_norm_like_unfused_code(device):
    x = torch.randn(5, 300, device=device, dtype=torch.bfloat16)
    r = torch.randn(5, 300, device=device, dtype=torch.bfloat16)
    w = torch.randn(300, device=device, dtype=torch.bfloat16)
    y, s = mod.add_rms_norm(x, r, w)
    if device == "cuda":
        assert torch.equal(s, x + r)
    else:  # Triton's interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest
        torch.testing.assert_close(s, x + r, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(y, mod.reference(x + r, w), rtol=1e-2, atol=1e-2)


def test_only_one_output_used_and_no_weight(device):
    x = torch.randn(4, 65, device=device, requires_grad=True)
    r = torch.randn(4, 65, device=device, requires_grad=True)
    y, _ = mod.add_rms_norm(x, r)
    y.sum().backward()  # no gradient flows into summed
    xr, rr = x.detach().double().requires_grad_(), r.detach().double().requires_grad_()
    mod.reference(xr + rr).sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.grad, x.grad)


def test_bad_input(device):
    with pytest.raises(ValueError, match="residual must match"):
        mod.add_rms_norm(torch.randn(2, 8, device=device), torch.randn(2, 9, device=device))
    with pytest.raises(TypeError, match="residual has dtype"):
        mod.add_rms_norm(torch.randn(2, 8, device=device), torch.ones(2, 8, dtype=torch.int32, device=device))


def test_custom_op_schema_and_compile(device):
    args = (torch.randn(3, 40, device=device), torch.randn(3, 40, device=device), torch.randn(40, device=device),
            1e-6, 0.0)
    torch.library.opcheck(torch.ops.kernelkit.add_rms_norm.default, args, test_utils=("test_schema", "test_faketensor"))
    x = torch.randn(3, 40, device=device, requires_grad=True)
    r = torch.randn(3, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=True)
    y, s = compile_as_one_node(mod.add_rms_norm, (x, r, w), "add_rms_norm")
    torch.testing.assert_close(s, x + r)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 4096), (3, 65537)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_large_shapes(shape, dtype):
    check_spec(SPEC, shape, dtype, device="cuda", trials=2).raise_if_failed()
