"""Layout fuzzing for every registered op: each tensor argument (activations, parameters, and the integer and
scale tensors: targets, sequence offsets, position and expert ids, quantization scales) as a row-padded,
column-major, stepped, offset, misaligned and broadcast view, against the float64 reference, forward and
backward. New ops get this for free through the registry."""

import dataclasses

import pytest
import torch

import kernelkit
from kernelkit.ops import _validate, moe, mxfp8, registry
from kernelkit.testing.layouts import LAYOUTS, check_layouts, layout_cases, layout_shapes, relayout

OPS = sorted(registry.all_ops())


def _dtype(spec):
    return "float32" if "float32" in spec.dtypes else spec.dtypes[0]


# The fuzz of moe_mxfp8, moe and attention are the suite's slowest cases in the interpreter (about 50, 45 and 36 s;
# moe_fp8 and tests/test_attention.py keep the same kernels' layouts in CI): `make test-all` runs them.
SLOW = {"moe_mxfp8", "moe", "attention"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in OPS])
def test_every_argument_in_every_layout(name, device):
    spec = registry.get(name)
    report, cases = check_layouts(spec, _dtype(spec), device)
    assert cases >= len(LAYOUTS) - 1, f"{name}: only {cases} layout cases ran"
    report.raise_if_failed()


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_relayout_keeps_values_and_changes_strides(kind, dtype):
    t = torch.randn(4, 6).mul(9).abs().to(dtype)
    moved = relayout(t, kind)
    want = t[:1].expand_as(t) if kind == "expanded" else t
    torch.testing.assert_close(moved, want, rtol=0, atol=0)
    assert moved.stride() != t.stride() or moved.storage_offset() != 0


def test_integer_vectors_are_never_broadcast():
    # A 1-D integer argument may hold offsets (cu_seqlens): a broadcast of its first value means something else.
    # Every other layout keeps its values.
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    assert relayout(cu, "expanded") is None and relayout(cu, "transposed") is None
    for kind in ("row_padded", "stepped", "offset", "misaligned"):
        moved = relayout(cu, kind)
        assert torch.equal(moved, cu) and (moved.stride() != (1,) or moved.storage_offset())


@pytest.mark.parametrize("op,argument", [("attention", "cu_seqlens"), ("rope", "position_ids"),
                                         ("cross_entropy", "args[1]"), ("linear_cross_entropy", "args[2]"),
                                         ("scaled_matmul", "args[2]"), ("scaled_matmul", "args[3]")])
def test_index_and_scale_arguments_are_fuzzed(op, argument):
    # Each op's integer or scale argument reaches the fuzz (at some layout shape) as a stepped and an offset view.
    spec = registry.get(op)
    kinds = {what.split()[1] for shape in layout_shapes(spec)
             for what, _, _ in layout_cases(spec, "float32", "cpu", shape) if what.split()[0] == argument}
    assert {"stepped", "offset"} <= kinds, f"{op}: {argument} fuzzed as {sorted(kinds)}"


def _moe_experts_inputs(shape, dtype, device, generator=None):
    """moe's inputs routed by the reference router: (x, weights (T, k) fp32, gate_up, down, experts (T, k) int64)."""
    (x, router, gate_up, down, top_k), _ = registry.get("moe").make_inputs(shape, dtype, device, generator)
    weights, experts = moe.reference_route(x.float(), router.float(), top_k)
    return (x, weights, gate_up, down, experts), {}


def _mxfp8_dequantize_inputs(shape, dtype, device, generator=None):
    """MXFP8 data and its uint8 E8M0 scales from mxfp8_quantize's inputs, by the spec's conversion."""
    (x,), _ = registry.get("mxfp8_quantize").make_inputs(shape, torch.float32, device, generator)
    return mxfp8.reference_quantize(x), {"out_dtype": dtype}


def _weighted_cross_entropy_inputs(shape, dtype, device, generator=None):
    (logits, target), _ = registry.get("cross_entropy").make_inputs(shape, dtype, device, generator)
    return (logits, target), {"weight": torch.rand(shape[1], device=device, generator=generator) + 0.5}


# Tensor arguments that the registry's make_inputs leave out, fuzzed the same way: moe_experts' routing weights
# and expert ids (x and the expert weights are fuzzed through "moe"), mxfp8_dequantize's data and E8M0 scales
# (exact: tolerance 0), cross_entropy's class weights.
MORE_ARGUMENTS = {
    "moe_experts": dataclasses.replace(
        registry.get("moe"), name="moe_experts", fn=moe.moe_experts, reference=moe.experts_reference,
        make_inputs=_moe_experts_inputs, layout_shape=(13, 16, 12, 4, 2), layout_tolerances={},
        layout_skip=tuple((i, kind) for i in (0, 2, 3) for kind in LAYOUTS)),
    "mxfp8_dequantize": dataclasses.replace(
        registry.get("mxfp8_quantize"), name="mxfp8_dequantize", fn=kernelkit.mxfp8_dequantize,
        reference=mxfp8.reference_dequantize, make_inputs=_mxfp8_dequantize_inputs, layout_shape=(5, 96)),
    "cross_entropy_weight": dataclasses.replace(
        registry.get("cross_entropy"), make_inputs=_weighted_cross_entropy_inputs,
        layout_skip=tuple((i, kind) for i in (0, 1) for kind in LAYOUTS)),
}


@pytest.mark.parametrize("name", MORE_ARGUMENTS)
def test_arguments_beyond_make_inputs(name, device):
    report, cases = check_layouts(MORE_ARGUMENTS[name], "float32", device)
    assert cases >= len(LAYOUTS) - 1, f"{name}: only {cases} layout cases ran"
    report.raise_if_failed()


def test_layouts_catch_a_kernel_that_ignores_the_row_stride(device, monkeypatch):
    # The fuzz must fail on a broken kernel: feed the RMSNorm kernel a wrong row stride for x.
    # The launcher takes the rows of x as if contiguous, whatever their stride (patched where the launcher
    # looks it up at each call: the op holds the launcher itself).
    real = _validate.rows_2d

    def broken(x, n):
        x2 = real(x, n)
        return torch.as_strided(x2, x2.shape, (n, 1))

    monkeypatch.setattr(_validate, "rows_2d", broken)
    spec = registry.get("rms_norm")
    report, _ = check_layouts(spec, "float32", device, layouts=("row_padded",))
    assert not report.ok


def test_layouts_catch_a_launcher_that_reads_an_index_tensor_as_contiguous(device, monkeypatch):
    # The fuzz must fail where a kernel reads an integer argument's storage without its strides (issue 26's
    # cu_seqlens): rope handed position_ids as if contiguous. The poison between a stepped view's elements is a
    # position outside the table, which the kernel turns into NaN.
    from kernelkit.ops import rope as mod

    real = mod.ROPE.forward

    def broken(q, k, cos=None, sin=None, position_ids=None, *args, **kwargs):
        if position_ids is not None:
            position_ids = torch.as_strided(position_ids, position_ids.shape, (position_ids.shape[1], 1))
        return real(q, k, cos, sin, position_ids, *args, **kwargs)

    monkeypatch.setattr(mod.ROPE, "forward", broken)  # the declared op's launcher, on every route
    spec = registry.get("rope")
    report, _ = check_layouts(spec, "float32", device, shape=layout_shapes(spec)[-1], layouts=("stepped",))
    assert report.failures and all(f.startswith("position_ids stepped") for f in report.failures), report.failures


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax", "cross_entropy", "swiglu"])
def test_row_padded_activations_reach_the_kernel_uncopied(op, device):
    # A row-padded activation is a layout the row kernels take natively: no copy before the launch.
    x = relayout(torch.randn(5, 37, device=device), "row_padded")
    assert x.stride(0) > x.shape[1]
    before = _validate.copies
    if op == "rms_norm":
        kernelkit.rms_norm(x, torch.randn(37, device=device))
    elif op == "layer_norm":
        kernelkit.layer_norm(x, torch.randn(37, device=device), torch.randn(37, device=device))
    elif op == "softmax":
        kernelkit.softmax(x)
    elif op == "cross_entropy":
        kernelkit.cross_entropy(x, torch.randint(0, 37, (5,), device=device))
    else:
        kernelkit.swiglu(x, relayout(torch.randn(5, 37, device=device), "row_padded"))
    assert _validate.copies == before


def test_norm_weights_in_every_user_layout(device):
    # The cases: a stepped slice, a column of a 2-D parameter, an offset view, a broadcast.
    x = torch.randn(4, 64, device=device)
    p = torch.randn(64, 3, device=device)
    for w in (torch.randn(128, device=device)[::2], p[:, 1], torch.randn(70, device=device)[5:69],
              torch.randn(1, device=device).expand(64)):
        want = torch.nn.functional.rms_norm(x.double(), (64,), w.double(), 1e-6)
        torch.testing.assert_close(kernelkit.rms_norm(x, w).double(), want, rtol=1e-5, atol=1e-5)
        want = torch.nn.functional.layer_norm(x.double(), (64,), w.double(), w.double(), 1e-5)
        torch.testing.assert_close(kernelkit.layer_norm(x, w, w).double(), want, rtol=1e-5, atol=1e-5)
        y, s = kernelkit.add_rms_norm(x, x, w)
        torch.testing.assert_close(y.double(), torch.nn.functional.rms_norm(2 * x.double(), (64,), w.double(), 1e-6),
                                   rtol=1e-5, atol=1e-5)


def test_rope_with_q_or_k_broadcast(device):
    # The cases: one batch's q broadcast over the batch, and k shared by all heads (MQA), stride 0.
    from kernelkit.ops.rope import reference

    q = torch.randn(1, 5, 4, 16, device=device).expand(3, 5, 4, 16)
    k = torch.randn(3, 5, 1, 16, device=device).expand(3, 5, 4, 16)
    angle = torch.rand(3, 5, 16, device=device) * 6
    for layout in ("bshd", "bhsd"):
        qq, kk = (q, k) if layout == "bshd" else (q.transpose(1, 2), k.transpose(1, 2))
        got = kernelkit.rope(qq, kk, angle.cos(), angle.sin(), layout=layout)
        want = reference(qq, kk, angle.cos(), angle.sin(), layout=layout)
        for g, w in zip(got, want):
            assert g.stride(-1) == 1 and g.is_contiguous() or g.transpose(1, 2).is_contiguous()
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_layout_tolerance_overrides_one_case():
    # A spec's layout_tolerances loosen only the named case and dtype: an op 1e-3 off for an expanded first
    # argument fails the float32 fuzz, and passes it with an override for "args[0] expanded".
    import dataclasses

    base = registry.get("softmax")

    def off_when_expanded(x, *a, **kw):
        out = base.fn(x, *a, **kw)
        return out * 1.001 if 0 in x.stride() else out

    spec = dataclasses.replace(base, fn=off_when_expanded)
    rep, _ = check_layouts(spec, "float32", "cpu")
    assert any("args[0] expanded" in f for f in rep.failures) and all("args[0] expanded" in f for f in rep.failures)
    loose = dataclasses.replace(spec, layout_tolerances={"args[0] expanded": {"float32": 1e-2}})
    rep, _ = check_layouts(loose, "float32", "cpu")
    assert not rep.failures, rep.failures


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "rms_norm", "add_rms_norm", "layer_norm"])
def test_every_layout_on_cooperative_rows(name, device, monkeypatch):
    # The cooperative rows (ops/_coop.py) take rows past 32768 columns on a GPU: with the thresholds shrunk, the
    # layout shape's rows split over several programs, so every layout reaches them (phased on the interpreter).
    import kernelkit.ops.layer_norm as ln
    import kernelkit.ops.rms_norm as rms
    import kernelkit.ops.softmax as sm
    from kernelkit.ops import _coop

    for mod in (sm, rms, ln):
        for const in ("MAX_FUSED_N", "MAX_FUSED_BWD_N", "COOP_CHUNK", "COOP_BWD_CHUNK", "COOP_BWD_CHUNK_FP32"):
            if hasattr(mod, const):
                monkeypatch.setattr(mod, const, 64)
    monkeypatch.setattr(ln, "COOP_DTYPES", (torch.float32, torch.bfloat16, torch.float16))
    ran = []
    real = _coop.launch_rows
    monkeypatch.setattr(_coop, "launch_rows", lambda k, *a, **kw: ran.append(k.fn.__name__) or real(k, *a, **kw))
    spec = registry.get(name)
    report, cases = check_layouts(spec, _dtype(spec), device, shape=(2, 3, 129))  # 3 chunks a row, the last of 1
    assert cases >= len(LAYOUTS) - 1, f"{name}: only {cases} layout cases ran"
    report.raise_if_failed()
    assert any("fwd_coop" in k for k in ran) and any("bwd_coop" in k for k in ran), sorted(set(ran))
