import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelkit.ops.softmax as mod
from kernelkit.ops import registry
from kernelkit.testing import check, check_spec
from kernelkit.testing.graph import compile_as_one_node

SOFTMAX, LOG_SOFTMAX = registry.get("softmax"), registry.get("log_softmax")


@pytest.mark.parametrize("spec", [SOFTMAX, LOG_SOFTMAX], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (37, 1000), (5, 4097), (2, 3, 129)])
def test_matches_fp64_reference(spec, shape, dtype, device):
    check_spec(spec, shape, dtype, device=device).raise_if_failed()


@pytest.mark.parametrize("spec", [SOFTMAX, LOG_SOFTMAX], ids=lambda s: s.name)
def test_online_kernel_for_long_rows(spec, device, monkeypatch):
    monkeypatch.setattr(mod, "MAX_FUSED_N", 256)
    monkeypatch.setattr(mod, "LOOP_BLOCK_N", 128)
    for shape in [(4, 1000), (3, 129), (2, 257)]:
        check_spec(spec, shape, "float32", device=device, trials=1).raise_if_failed()


@pytest.mark.parametrize("log", [False, True])
def test_scale_and_non_contiguous(log, device):
    base = torch.randn(30, 2 * 301, device=device)
    x = base[::3, ::2]
    fn = mod.log_softmax if log else mod.softmax
    ref = mod.log_reference if log else mod.reference
    check(lambda x: fn(x, 0.125), lambda x: ref(x, 0.125), (x,), grad_args=(0,)).raise_if_failed()


@pytest.mark.parametrize("fused", [True, False])
def test_negative_scale(fused, device, monkeypatch):
    # Masked tail lanes must stay out of the max and sum whatever the sign of the scale.
    if not fused:
        monkeypatch.setattr(mod, "MAX_FUSED_N", 64)
        monkeypatch.setattr(mod, "LOOP_BLOCK_N", 64)
    x = torch.randn(5, 301, device=device)
    for fn, ref in ((mod.softmax, mod.reference), (mod.log_softmax, mod.log_reference)):
        check(lambda x: fn(x, -0.7), lambda x: ref(x, -0.7), (x,), grad_args=(0,)).raise_if_failed()


def test_masked_minus_inf_entries_like_torch(device):
    x = torch.randn(4, 50, device=device)
    x[:, 10:20] = float("-inf")  # an attention mask
    torch.testing.assert_close(mod.softmax(x), torch.softmax(x, -1))
    torch.testing.assert_close(mod.log_softmax(x), torch.log_softmax(x, -1))


def test_nan_and_all_minus_inf_rows_propagate_like_torch(device, monkeypatch):
    x = torch.randn(3, 40, device=device)
    x[0, 5] = float("nan")
    x[1, :] = float("-inf")
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(mod, "MAX_FUSED_N", 16)
            monkeypatch.setattr(mod, "LOOP_BLOCK_N", 16)
        got, want = mod.softmax(x), torch.softmax(x, -1)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        torch.testing.assert_close(got[2], want[2])


def test_empty_and_bad_input(device):
    assert mod.softmax(torch.randn(0, 8, device=device)).shape == (0, 8)
    with pytest.raises(TypeError, match="x has dtype int64"):
        mod.softmax(torch.ones(2, 3, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="scale must be"):
        mod.softmax(torch.ones(2, 3, device=device), scale=torch.tensor(2.0))


def test_custom_op_schema_and_single_graph_node(device):
    torch.library.opcheck(torch.ops.kernelkit.softmax.default, (torch.randn(3, 40, device=device), 0.5, True),
                          test_utils=("test_schema", "test_faketensor"))
    x = torch.randn(3, 40, device=device, requires_grad=True)
    y = compile_as_one_node(lambda x: mod.softmax(x, 2.0), (x,), "softmax")
    torch.testing.assert_close(y, torch.softmax(2.0 * x, -1))


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 7), n=st.integers(1, 600), log=st.booleans(),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]))
def test_random_shapes(rows, n, log, dtype):
    import os

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    spec = LOG_SOFTMAX if log else SOFTMAX
    if n < 64 and dtype != "float32":
        # With a handful of classes one probability is near 1 and the gradient y * (dy - sum(dy * y))
        # cancels to a small difference of the stored 16-bit y (torch's backward stores the same y):
        # only the forward is held to the 16-bit tolerance there.
        x = spec.make_inputs((rows, n), torch.float32, device)[0][0].to(getattr(torch, dtype))
        check(spec.fn, spec.reference, (x,)).raise_if_failed()
        return
    check_spec(spec, (rows, n), dtype, device=device, trials=1).raise_if_failed()


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [SOFTMAX, LOG_SOFTMAX], ids=lambda s: s.name)
@pytest.mark.parametrize("shape", [(16384, 4096), (1024, 32768), (7, 393217), (1, 4096)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_large_shapes(spec, shape, dtype):
    check_spec(spec, shape, dtype, device="cuda", trials=2).raise_if_failed()
