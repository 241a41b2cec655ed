import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelkit.ops.glu as mod
from kernelkit.ops import registry
from kernelkit.testing import check, check_spec
from kernelkit.testing.graph import compile_as_one_node

SWIGLU, GEGLU = registry.get("swiglu"), registry.get("geglu")


@pytest.mark.parametrize("spec", [SWIGLU, GEGLU], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (37, 1000), (2, 3, 129)])
def test_separate_gate_up(spec, shape, dtype, device):
    check_spec(spec, shape, dtype, device=device).raise_if_failed()


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_geglu_approximations(approximate, device):
    g, u = torch.randn(17, 301, device=device), torch.randn(17, 301, device=device)
    check(lambda g, u: mod.geglu(g, u, approximate), lambda g, u: mod.geglu_reference(g, u, approximate),
          (g, u), grad_args=(0, 1)).raise_if_failed()


@pytest.mark.parametrize("fn,ref", [(mod.swiglu, mod.swiglu_reference), (mod.geglu, mod.geglu_reference)])
def test_concatenated_gate_up(fn, ref, device):
    gu = torch.randn(2, 19, 2 * 333, device=device, dtype=torch.bfloat16)
    check(lambda gu: fn(gu), lambda gu: ref(gu), (gu,), grad_args=(0,)).raise_if_failed()


def test_non_contiguous_rows(device):
    g = torch.randn(40, 600, device=device)[::2, 100:400]
    u = torch.randn(20, 300, device=device)
    check(mod.swiglu, mod.swiglu_reference, (g, u), grad_args=(0, 1)).raise_if_failed()


def test_nan_inf_like_torch(device):
    g, u = torch.randn(3, 20, device=device), torch.randn(3, 20, device=device)
    g[0, 1], u[1, 2], g[2, 3] = float("nan"), float("inf"), float("inf")
    got, want = mod.swiglu(g, u), torch.nn.functional.silu(g) * u
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want))


def test_bad_input(device):
    with pytest.raises(ValueError, match="up must have gate's shape"):
        mod.swiglu(torch.randn(2, 4, device=device), torch.randn(2, 5, device=device))
    with pytest.raises(ValueError, match="last dim must be even"):
        mod.swiglu(torch.randn(2, 5, device=device))
    with pytest.raises(TypeError, match="up has dtype"):
        mod.swiglu(torch.randn(2, 4, device=device), torch.randn(2, 4, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match="approximate must be"):
        mod.geglu(torch.randn(2, 4, device=device), approximate="fast")
    assert mod.swiglu(torch.randn(0, 4, device=device), torch.randn(0, 4, device=device)).shape == (0, 4)


def test_custom_op_schema_and_single_graph_node(device):
    torch.library.opcheck(torch.ops.kernelkit.glu.default, (torch.randn(3, 40, device=device), None, 0),
                          test_utils=("test_schema", "test_faketensor"))
    g = torch.randn(3, 40, device=device, requires_grad=True)
    u = torch.randn(3, 40, device=device, requires_grad=True)
    y = compile_as_one_node(mod.swiglu, (g, u), "glu")
    torch.testing.assert_close(y, mod.swiglu_reference(g, u))


@settings(max_examples=6, deadline=None)
@given(rows=st.integers(1, 5), h=st.integers(1, 700), gelu=st.booleans())
def test_random_shapes(rows, h, gelu):
    import os

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    check_spec(GEGLU if gelu else SWIGLU, (rows, h), "bfloat16", device=device, trials=1).raise_if_failed()


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [SWIGLU, GEGLU], ids=lambda s: s.name)
@pytest.mark.parametrize("shape", [(8192, 14336), (3, 5000)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_large_shapes(spec, shape, dtype):
    check_spec(spec, shape, dtype, device="cuda", trials=2).raise_if_failed()
