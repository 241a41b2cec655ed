import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelkit.ops.gemm.mx as gemm_mx
import kernelkit.ops.mxfp8 as mx
from kernelkit.ops import registry
from kernelkit.ops.mxfp8 import mxfp8_dequantize, mxfp8_quantize, reference_dequantize, reference_quantize
from kernelkit.testing import check_spec
from kernelkit.testing.graph import compile_as_one_node

SPEC = registry.get("mxfp8_quantize")
ELEMS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(out, ref):
    """Bit-identical except that any NaN matches any NaN: the NaN a GPU produces (0x7FFFFFFF, bf16 0x7FFF)
    is not the one torch's CPU path writes (0x7FC00000, 0x7FC0), and the spec fixes only that it is NaN."""
    out, ref = out.cpu(), ref.cpu()
    nan = torch.isnan(ref)
    return torch.equal(torch.isnan(out), nan) and torch.equal(_bits(out)[~nan], _bits(ref)[~nan])


def assert_bit_exact(x, elem_dtype):
    data, scales = mxfp8_quantize(x, elem_dtype)
    ref_data, ref_scales = reference_quantize(x.cpu(), elem_dtype)
    assert data.dtype == elem_dtype and scales.dtype == torch.uint8
    assert data.shape == x.shape and scales.shape == (*x.shape[:-1], x.shape[-1] // 32)
    assert torch.equal(scales.cpu(), ref_scales), "scales differ from the spec reference"
    assert torch.equal(_bits(data).cpu(), _bits(ref_data)), "elements differ from the spec reference"
    return data, scales


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(3, 32), (37, 96), (5, 4096), (2, 3, 160)])
def test_matches_reference_exactly(shape, dtype, device):
    # Registered spec: fresh inputs, poisoned outputs, run-twice; tolerance 0.
    check_spec(SPEC, shape, dtype, device=device).raise_if_failed()


@pytest.mark.parametrize("elem_dtype", ELEMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bits_match_reference(elem_dtype, dtype, device):
    (x,), _ = SPEC.make_inputs((19, 224), dtype, device)
    assert_bit_exact(x, elem_dtype)


def _fp8_grid(elem_dtype):
    """Every finite FP8 value, every midpoint between neighbours (the ties) and points just off them."""
    vals = torch.arange(256, dtype=torch.uint8).view(elem_dtype).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    return torch.cat([vals, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20)])


@pytest.mark.parametrize("elem_dtype", ELEMS)
def test_elements_round_to_nearest_even_and_saturate(elem_dtype, device):
    # Each block carries an anchor whose amax gives scale 2^0, so elements are the raw values: compare
    # against torch's own round-to-nearest-even cast, and values past max normal must clamp to it.
    emax, _, _, max_normal = mx.ELEM_FORMATS[elem_dtype]
    anchor = 1.5 * 2.0 ** emax
    vals = torch.cat([_fp8_grid(elem_dtype), torch.tensor([1.03, 1.07, 1.12]) * max_normal])
    vals = torch.cat([vals, -vals, torch.tensor([0.0, -0.0])])
    vals = torch.cat([vals, torch.zeros((-len(vals)) % 31)]).reshape(-1, 31)
    x = torch.cat([torch.full((len(vals), 1), anchor), vals], dim=1).reshape(-1, 64)
    data, scales = assert_bit_exact(x.to(device), elem_dtype)
    assert (scales == 127).all()
    want = x.clamp(-max_normal, max_normal).to(elem_dtype)
    assert torch.equal(data.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("elem_dtype", ELEMS)
def test_special_blocks(elem_dtype, device):
    emax = mx.ELEM_FORMATS[elem_dtype][0]
    x = torch.randn(8, 64)
    x[0, :32] = 0.0  # amax 0: minimum scale, zero elements
    x[1, :32] = -0.0
    x[2, 3] = float("nan")  # NaN anywhere: NaN scale, all elements NaN
    x[3, 40] = float("-inf")  # Inf: the scale exponent overflows E8M0 -> NaN scale
    x[4, :32] = 1e-42  # fp32 subnormals: shared exponent clamps to -127
    x[5, :32] = 2.0 ** 20  # amax a power of two ...
    x[6, :32] = 2.0 ** 20 * (1 - 2 ** -24)  # ... and the float just below it
    x[7, :32] = torch.finfo(torch.float32).max
    data, scales = assert_bit_exact(x.to(device), elem_dtype)
    s, d = scales.cpu(), data.cpu().view(torch.uint8)
    assert s[0, 0] == 0 and (d[0, :32] == 0).all() and s[1, 0] == 0 and (d[1, :32] == 0x80).all()
    assert s[2, 0] == 255 and (d[2, :32] == 0x7F).all() and s[2, 1] != 255
    assert s[3, 1] == 255 and (d[3, 32:] == 0x7F).all()
    assert s[4, 0] == 0
    assert s[5, 0] == 127 + 20 - emax and s[6, 0] == 127 + 19 - emax
    assert s[7, 0] == 127 + 127 - emax
    out = mxfp8_dequantize(data, scales, torch.float32).cpu()
    assert torch.isnan(out[2, :32]).all() and torch.isnan(out[3, 32:]).all() and not torch.isnan(out[2, 32:]).any()
    assert (out[0, :32] == 0).all() and torch.equal(out[5, :32], x[5, :32])


@pytest.mark.parametrize("elem_dtype", ELEMS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_bit_exact_and_round_trip_error(elem_dtype, out_dtype, device):
    (x,), _ = SPEC.make_inputs((33, 320), torch.float32, device)
    data, scales = mxfp8_quantize(x, elem_dtype)
    out = mxfp8_dequantize(data, scales, out_dtype)
    assert out.dtype == out_dtype and out.shape == x.shape
    assert torch.equal(_bits(out).cpu(), _bits(reference_dequantize(data.cpu(), scales.cpu(), out_dtype)))
    # Error bound from the format: half an ulp (2^-(m+1) relative) for normals, half the subnormal step
    # (2^(1 - bias - m) X / 2) below; values past max normal × X are clamped to it.
    emax, m, bias, max_normal = mx.ELEM_FORMATS[elem_dtype]
    X = torch.exp2(scales.cpu().float() - 127).repeat_interleave(32, dim=-1)
    xc = x.cpu().clamp(-max_normal * X, max_normal * X)
    err = (out.cpu().float() - xc).abs()
    bound = (torch.maximum(xc.abs() * 2.0 ** -(m + 1), X * 2.0 ** (-bias - m))
             + 2 * xc.abs() * torch.finfo(out_dtype).eps + (2.0 ** -24 if out_dtype == torch.float16 else 0.0))
    assert (err <= bound).all()
    rel = (out.cpu().float() - x.cpu()).norm() / x.cpu().norm()
    assert rel < {torch.float8_e4m3fn: 0.04, torch.float8_e5m2: 0.08}[elem_dtype]


def test_non_contiguous_and_batched_inputs(device):
    base = torch.randn(6, 40, 2 * 96, device=device)
    assert_bit_exact(base[::2, :, :96], torch.float8_e4m3fn)  # strided rows, unit stride along K
    assert_bit_exact(base[:, :, ::2], torch.float8_e5m2)  # strided K: copied first
    assert_bit_exact(base.transpose(0, 1)[..., :64], torch.float8_e4m3fn)


def test_empty_inputs(device):
    data, scales = mxfp8_quantize(torch.randn(0, 64, device=device))
    assert data.shape == (0, 64) and scales.shape == (0, 2)
    assert mxfp8_dequantize(data, scales).shape == (0, 64)


@pytest.mark.parametrize("call,match", [
    (lambda d: mxfp8_quantize(torch.randn(4, 48, device=d)), "divisible by the MX block size 32"),
    (lambda d: mxfp8_quantize(torch.ones(4, 32, dtype=torch.int32, device=d)), "x has dtype int32"),
    (lambda d: mxfp8_quantize(torch.randn(4, 32, device=d), torch.int8), "elem_dtype must be"),
    (lambda d: mxfp8_dequantize(torch.randn(4, 32, device=d), torch.zeros(4, 1, dtype=torch.uint8, device=d)),
     "data has dtype float32"),
    (lambda d: mxfp8_dequantize(torch.zeros(4, 64, device=d).to(torch.float8_e4m3fn),
                                torch.zeros(4, 1, dtype=torch.uint8, device=d)), "scales must have shape"),
    (lambda d: mxfp8_dequantize(torch.zeros(4, 32, device=d).to(torch.float8_e4m3fn),
                                torch.zeros(4, 1, dtype=torch.int32, device=d)), "scales has dtype"),
    (lambda d: mxfp8_dequantize(torch.zeros(4, 32, device=d).to(torch.float8_e4m3fn),
                                torch.zeros(4, 1, dtype=torch.uint8, device=d), torch.int8), "out_dtype must be"),
])
def test_bad_input_names_the_argument(call, match, device):
    with pytest.raises((TypeError, ValueError), match=match):
        call(device)


def test_custom_ops_schema_fake_and_single_graph_node(device):
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(3, 2, 64, device=device, dtype=torch.bfloat16)
    for elem in ELEMS:
        torch.library.opcheck(torch.ops.kernelkit.mxfp8_quantize.default, (x, elem),
                              test_utils=("test_schema", "test_faketensor"))
        data, scales = mxfp8_quantize(x, elem)
        # test_schema compares the fp8 input before and after the call with torch.allclose, which torch
        # implements for fp8 on no device (2.11 CUDA, 2.13 CPU): the dequantize's schema is checked by fake only.
        torch.library.opcheck(torch.ops.kernelkit.mxfp8_dequantize.default, (data, scales, torch.float16),
                              test_utils=("test_faketensor",))
    gm = make_fx(lambda x: torch.ops.kernelkit.mxfp8_dequantize(
        *torch.ops.kernelkit.mxfp8_quantize(x, torch.float8_e4m3fn), torch.bfloat16), tracing_mode="fake")(x)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "getitem" not in str(n.target)]
    assert targets == ["kernelkit.mxfp8_quantize.default", "kernelkit.mxfp8_dequantize.default"]
    out = compile_as_one_node(lambda x: mxfp8_dequantize(*mxfp8_quantize(x)), (x,), "mxfp8_quantize")
    assert torch.equal(out, mxfp8_dequantize(*mxfp8_quantize(x)))


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 40), log2_range=st.integers(0, 60),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), elem=st.sampled_from(ELEMS))
def test_random_shapes(rows, blocks, log2_range, dtype, elem):
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    spread = torch.randint(-log2_range, log2_range + 1, (rows, 32 * blocks)).float()
    x = torch.randn(rows, 32 * blocks) * torch.exp2(spread)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    assert_bit_exact(x.to(dtype).to(device), elem)


def test_cost_counts_ideal_bytes():
    x = torch.empty(16384, 4096, dtype=torch.bfloat16, device="meta")
    n = x.numel()
    assert SPEC.cost(x).bytes == 2 * n + n + n / 32
    assert SPEC.grad_args == () and SPEC.eager is reference_quantize


@pytest.mark.gpu
@pytest.mark.parametrize("hw_cast", [True, False])
@pytest.mark.parametrize("elem_dtype", ELEMS)
@pytest.mark.parametrize("shape", [(16384, 4096), (8192, 8192), (16384, 14336), (7, 4128), (1, 32)])
def test_gpu_large_shapes_bit_exact(shape, elem_dtype, hw_cast, monkeypatch):
    # Both element paths on the GPU: the hardware FP8 convert and the kernel's own encoder.
    monkeypatch.setattr(gemm_mx, "hw_cast", lambda: hw_cast)
    (x,), _ = SPEC.make_inputs(shape, torch.bfloat16, "cuda")
    x[0, 0] = float("nan")
    data, scales = mxfp8_quantize(x, elem_dtype)
    ref_data, ref_scales = reference_quantize(x, elem_dtype)
    bad_s = (scales != ref_scales).nonzero()[:4].tolist()
    assert not bad_s, f"scales differ at {bad_s}: {[(scales[tuple(i)].item(), ref_scales[tuple(i)].item()) for i in bad_s]}"
    d, rd = data.view(torch.uint8), ref_data.view(torch.uint8)
    bad = (d != rd).nonzero()[:4].tolist()
    assert not bad, f"elements differ at {bad}: {[(x[tuple(i)].item(), d[tuple(i)].item(), rd[tuple(i)].item()) for i in bad]}"
    for out_dtype in (torch.bfloat16, torch.float32):
        out = mxfp8_dequantize(data, scales, out_dtype)
        ref = reference_dequantize(data, scales, out_dtype)
        assert same_bits(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("hw_cast", [True, False])
def test_gpu_subnormal_scales_and_elements(hw_cast, monkeypatch):
    # Scale code 0 is the fp32 subnormal 2^-127: no flush-to-zero may creep into either kernel.
    monkeypatch.setattr(gemm_mx, "hw_cast", lambda: hw_cast)
    for elem in ELEMS:
        x = torch.cat([_fp8_grid(elem)[:500] * 2.0 ** -127, torch.zeros(12)]).reshape(-1, 32).cuda()
        data, scales = assert_bit_exact(x, elem)
        out = mxfp8_dequantize(data, scales, torch.float32)
        assert torch.equal(_bits(out).cpu(), _bits(reference_dequantize(data.cpu(), scales.cpu(), torch.float32)))


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(lambda x: mxfp8_dequantize(*mxfp8_quantize(x)), fullgraph=True)
    torch.testing.assert_close(f(x), mxfp8_dequantize(*mxfp8_quantize(x)), rtol=0, atol=0)
