"""Layout fuzzing for every registered op: each tensor argument (activations and parameters) as a
row-padded, column-major, stepped, offset, misaligned and broadcast view, against the float64 reference,
forward and backward. New ops get this for free through the registry."""

import pytest
import torch

import kernelkit
from kernelkit.ops import _validate, registry
from kernelkit.testing.layouts import LAYOUTS, check_layouts, relayout

OPS = sorted(registry.all_ops())


def _dtype(spec):
    return "float32" if "float32" in spec.dtypes else spec.dtypes[0]


@pytest.mark.parametrize("name", OPS)
def test_every_argument_in_every_layout(name, device):
    spec = registry.get(name)
    report, cases = check_layouts(spec, _dtype(spec), device)
    assert cases >= len(LAYOUTS) - 1, f"{name}: only {cases} layout cases ran"
    report.raise_if_failed()


@pytest.mark.parametrize("kind", LAYOUTS)
def test_relayout_keeps_values_and_changes_strides(kind):
    t = torch.randn(4, 6)
    moved = relayout(t, kind)
    want = t[:1].expand_as(t) if kind == "expanded" else t
    torch.testing.assert_close(moved, want, rtol=0, atol=0)
    assert moved.stride() != t.stride() or moved.storage_offset() != 0


def test_layouts_catch_a_kernel_that_ignores_the_row_stride(device, monkeypatch):
    # The fuzz must fail on a broken kernel: feed the RMSNorm kernel a wrong row stride for x.
    from kernelkit.ops import rms_norm as mod

    real = mod.rms_norm_fwd

    def broken(x, weight, eps, offset=0.0, residual=None):
        n = x.shape[-1]
        x2 = x.reshape(-1, n) if x.dim() != 2 else x
        y, rstd, s = real(torch.as_strided(x2, x2.shape, (n, 1)), weight, eps, offset, residual)
        return y.view(x.shape), rstd.view(x.shape[:-1]), s

    monkeypatch.setattr(mod, "rms_norm_fwd", broken)
    spec = registry.get("rms_norm")
    report, _ = check_layouts(spec, "float32", device, layouts=("row_padded",))
    assert not report.ok


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
