"""The backward of rows wider than the fused kernels hold (ops/rms_norm.py `WideBackward`: a per-row sum,
then column strips), forced at small widths by lowering MAX_FUSED_BWD_N, against float64 autograd of the
references, outputs poisoned."""

import pytest
import torch

import kernelkit.ops.layer_norm as ln
import kernelkit.ops.rms_norm as mod
from kernelkit.ops import registry
from kernelkit.testing import check, check_spec
from kernelkit.testing.poison import poisoned_outputs

# Narrow strips, so that 300-odd columns take several of them (a ragged last one), and 13 rows that leave row
# groups of unequal sizes. With the interpreter's 4 "SMs": 11 groups asked for, 7 of 2 rows kept; 3 asked
# for, 2 of 8 rows (4-row steps) kept; one group holding every row.
DESIGNS = {
    "many-groups": mod.WideBackward(8.0, 1, 128, 4),
    "uneven-groups": mod.WideBackward(2.25, 4, 128, 4),
    "one-group": mod.WideBackward(0.1, 1, 32, 4),
}


@pytest.fixture(params=list(DESIGNS))
def wide(request, monkeypatch):
    """Forces the wide backward for rows over 256 columns, with one strips configuration."""
    monkeypatch.setattr(mod, "MAX_FUSED_BWD_N", 256)
    monkeypatch.setattr(mod, "LOOP_BLOCK_N", 128)
    monkeypatch.setattr(mod, "WIDE_BWD", DESIGNS[request.param])
    monkeypatch.setattr(ln, "MAX_FUSED_BWD_N", 256)
    monkeypatch.setattr(ln, "LOOP_BLOCK_N", 128)
    monkeypatch.setattr(ln, "WIDE_BWD", DESIGNS[request.param])
    return DESIGNS[request.param]


def _strided(rows, n, device, dtype, gen, pad=37):
    """(rows, n) with a row stride of n + pad: the kernels must take the row stride, not assume n."""
    return torch.randn(rows, n + pad, device=device, dtype=dtype, generator=gen)[:, :n]


def _fp64_grads(reference, args, dy, grad_args):
    ref = [a.detach().double().requires_grad_(i in grad_args) if isinstance(a, torch.Tensor) else a
           for i, a in enumerate(args)]
    out = reference(*ref)
    out = out[0] if isinstance(out, tuple) else out
    return torch.autograd.grad(out, [ref[i] for i in grad_args], dy.double())


def _close(got, want, tol, what):
    assert torch.isfinite(got).all(), f"{what}: non-finite (unwritten?) elements"
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def test_rms_norm(wide, device):
    check_spec(registry.get("rms_norm"), (13, 301), "bfloat16", device=device, trials=1).raise_if_failed()


@pytest.mark.parametrize("has_weight", [True, False])
def test_rms_norm_strided_rows_weight_offset(wide, has_weight, device):
    gen = torch.Generator(device=device).manual_seed(1)
    x, dy = _strided(13, 301, device, torch.float32, gen), _strided(13, 301, device, torch.float32, gen)
    w = torch.randn(301, device=device, generator=gen) if has_weight else None
    _, rstd, _ = mod.rms_norm_fwd(x, w, 1e-5, 1.0)
    with poisoned_outputs():
        dx, dw = mod.rms_norm_bwd(dy, x, w, rstd, 1.0)
    grads = _fp64_grads(lambda x, w: mod.reference(x, w, 1e-5, 1.0), (x, w), dy, (0, 1) if has_weight else (0,))
    _close(dx, grads[0], 1e-5, "dx")
    if has_weight:
        _close(dw, grads[1], 1e-5, "dw")
    else:
        assert dw.numel() == 0


def test_rms_norm_one_row(wide, device):
    # One row: a single row group owns the whole partial.
    x, w = torch.randn(1, 1000, device=device), torch.randn(1000, device=device)
    check(mod.rms_norm, mod.reference, (x, w), grad_args=(0, 1)).raise_if_failed()


def test_add_rms_norm_with_residual_gradient(wide, device):
    # Both outputs carry a gradient: dx includes dsummed (HAS_DS).
    check_spec(registry.get("add_rms_norm"), (13, 301), "bfloat16", device=device, trials=1).raise_if_failed()


def test_add_rms_norm_strided_dsummed(wide, device):
    gen = torch.Generator(device=device).manual_seed(2)
    s, dy, ds = (_strided(11, 299, device, torch.float32, gen) for _ in range(3))
    w = torch.randn(299, device=device, generator=gen)
    _, rstd, _ = mod.rms_norm_fwd(s, w, 1e-6)
    with poisoned_outputs():
        dx, dw = mod.rms_norm_bwd(dy, s, w, rstd, 0.0, ds)
    gx, gw = _fp64_grads(mod.reference, (s, w), dy, (0, 1))
    _close(dx, gx + ds.double(), 1e-5, "dx")
    _close(dw, gw, 1e-5, "dw")


def test_layer_norm(wide, device):
    check_spec(registry.get("layer_norm"), (13, 301), "bfloat16", device=device, trials=1).raise_if_failed()


@pytest.mark.parametrize("has_w,has_b", [(True, True), (True, False), (False, True), (False, False)])
def test_layer_norm_strided_rows_large_mean(wide, has_w, has_b, device):
    gen = torch.Generator(device=device).manual_seed(3)
    x = _strided(13, 301, device, torch.float32, gen) + 50.0  # xhat must be rebuilt from the centred row
    dy = _strided(13, 301, device, torch.float32, gen)
    w = torch.randn(301, device=device, generator=gen) if has_w else None
    b = torch.randn(301, device=device, generator=gen) if has_b else None
    _, mean, rstd = ln.layer_norm_fwd(x, w, b, 1e-5)
    with poisoned_outputs():
        dx, dw, db = ln.layer_norm_bwd(dy, x, w, b, mean, rstd)
    grad_args = (0,) + ((1,) if has_w else ()) + ((2,) if has_b else ())
    grads = dict(zip(grad_args, _fp64_grads(ln.reference, (x, w, b), dy, grad_args)))
    _close(dx, grads[0], 1e-5, "dx")
    for i, got, name in ((1, dw, "dw"), (2, db, "db")):
        if i in grads:
            _close(got, grads[i], 1e-5, name)
        else:
            assert got.numel() == 0, name


def _launched(monkeypatch, module):
    """Names of the kernels module's launchers start, in order."""
    names, real = [], module.launch

    def record(kernel, *args, **kwargs):
        names.append(getattr(kernel, "base_fn", getattr(kernel, "fn", kernel)).__name__)
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(module, "launch", record)
    return names


@pytest.mark.parametrize("op,dtype,fused", [("add_rms_norm", "float32", False), ("add_rms_norm", "bfloat16", True),
                                            ("rms_norm", "float32", True)])
def test_fp32_with_dsummed_leaves_the_fused_backward_earlier(op, dtype, fused, device, monkeypatch):
    # Measured on the H100: fp32 add+RMSNorm spills out of the fused backward at 16384 columns, bf16 and
    # plain RMSNorm do not. Scaled down: rows of 300 between the two limits.
    monkeypatch.setattr(mod, "MAX_FUSED_BWD_N_FP32_DS", 256)
    names = _launched(monkeypatch, mod)
    check_spec(registry.get(op), (5, 300), dtype, device=device, trials=1).raise_if_failed()
    assert ("rms_norm_bwd_kernel" in names) == fused, names
    assert ("rms_norm_bwd_strip_kernel" in names) != fused, names


def test_wide_rows_take_the_strips_design_by_default(device, monkeypatch):
    monkeypatch.setattr(mod, "MAX_FUSED_BWD_N", 256)
    monkeypatch.setattr(ln, "MAX_FUSED_BWD_N", 256)
    rms_names, ln_names = _launched(monkeypatch, mod), _launched(monkeypatch, ln)
    x, w = torch.randn(3, 300, device=device, requires_grad=True), torch.randn(300, device=device, requires_grad=True)
    mod.rms_norm(x, w).sum().backward()
    ln.layer_norm(x, w).sum().backward()
    assert "rms_norm_bwd_strip_kernel" in rms_names, rms_names
    assert "layer_norm_bwd_strip_kernel" in ln_names, ln_names


@pytest.mark.gpu
@pytest.mark.parametrize("design", [mod.WideBackward(4.0, 4, 512, 4), mod.WideBackward(8.0, 4, 512, 8),
                                    mod.WideBackward(1.0, 2, 1024, 4)], ids=["default", "8-warps", "wide-strips"])
@pytest.mark.parametrize("shape,dtype", [((37, 32768), "bfloat16"), ((300, 20000), "float32"), ((3, 65537), "bfloat16")])
def test_gpu_designs_at_real_widths(design, shape, dtype, monkeypatch):
    monkeypatch.setattr(mod, "WIDE_BWD", design)
    monkeypatch.setattr(ln, "WIDE_BWD", design)
    for op in ("rms_norm", "add_rms_norm", "layer_norm"):
        check_spec(registry.get(op), shape, dtype, device="cuda", trials=1).raise_if_failed()
