"""How the norms' backward is laid out (ops/_norm_common.py): rows wider than the fused kernels hold take
`WideBackward` (a per-row sum, then column strips), forced at small widths by lowering MAX_FUSED_BWD_N; the
fused backward's programs per SM and pipelining (`FusedBackward` tables); the dweight column sum. Results
against float64 autograd of the references, outputs poisoned."""

import dataclasses

import pytest
import torch

import kernelkit.ops.layer_norm as ln
import kernelkit.ops.rms_norm as mod
from kernelkit.ops import _norm_common as common
from kernelkit.ops import registry
from kernelkit.runtime import num_sms
from kernelkit.testing import check, check_spec
from kernelkit.runtime.alloc import poisoned_outputs
from tests.conftest import INTERPRET

# Narrow strips, so that 300-odd columns take several of them (a ragged last one), and 13 rows that leave row
# groups of unequal sizes. With the interpreter's 4 "SMs": 11 groups asked for, 7 of 2 rows kept; 3 asked
# for, 2 of 8 rows (4-row steps) kept; one group holding every row.
DESIGNS = {
    "many-groups": common.WideBackward(8.0, 1, 128, 4),
    "uneven-groups": common.WideBackward(2.25, 4, 128, 4),
    "one-group": common.WideBackward(0.1, 1, 32, 4),
}


@pytest.fixture(params=list(DESIGNS) + ["cooperative"])
def wide(request, monkeypatch):
    """Forces the wide backward for rows over 256 columns, with one strips configuration; or the cooperative rows
    (ops/_coop.py) of RMSNorm and LayerNorm, forward and backward, in chunks of 128 columns."""
    coop = request.param == "cooperative"
    design = common.WideBackward(4.0, 4, 128, 4) if coop else DESIGNS[request.param]
    monkeypatch.setattr(ln, "COOP_DTYPES", (torch.float32, torch.bfloat16, torch.float16))  # the kernels in every dtype, whatever the routing
    for module in (mod, ln):
        monkeypatch.setattr(module, "COOP", coop)
        if coop:
            monkeypatch.setattr(module, "MAX_FUSED_N", 256)
            monkeypatch.setattr(module, "COOP_CHUNK", 128)
            monkeypatch.setattr(module, "COOP_BWD_CHUNK", 128)
    if coop:
        monkeypatch.setattr(mod, "COOP_BWD_CHUNK_FP32", 192)  # fp32 rows: three chunks, the last short
    monkeypatch.setattr(mod, "MAX_FUSED_BWD_N", 256)
    monkeypatch.setattr(mod, "LOOP_BLOCK_N", 128)
    monkeypatch.setattr(mod, "WIDE_BWD", design)
    monkeypatch.setattr(ln, "MAX_FUSED_BWD_N", 256)
    monkeypatch.setattr(ln, "LOOP_BLOCK_N", 128)
    monkeypatch.setattr(ln, "WIDE_BWD", design)
    return design


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
    _, rstd = mod.rms_norm_fwd(x, w, 1e-5, 1.0)
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
    _, rstd = mod.rms_norm_fwd(s, w, 1e-6)
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


def _launches(monkeypatch, module):
    """(kernel name, grid, keyword arguments) of every launch by `module`'s launchers, in order."""
    seen, real = [], module.launch

    def record(kernel, grid, *args, **kwargs):
        seen.append((getattr(kernel, "base_fn", getattr(kernel, "fn", kernel)).__name__, grid, kwargs))
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(module, "launch", record)
    return seen


@pytest.mark.parametrize("op,dtype,fused", [("add_rms_norm", "float32", False), ("add_rms_norm", "bfloat16", True),
                                            ("rms_norm", "float32", True)])
def test_fp32_with_dsummed_leaves_the_fused_backward_earlier(op, dtype, fused, device, monkeypatch):
    # Measured on the H100: fp32 add+RMSNorm spills out of the fused backward at 16384 columns, bf16 and
    # plain RMSNorm do not. Scaled down: rows of 300 between the two limits.
    monkeypatch.setattr(mod, "MAX_FUSED_BWD_N_FP32_DS", 256)
    monkeypatch.setattr(mod, "COOP", False)
    monkeypatch.setattr(ln, "COOP", False)
    launches = _launches(monkeypatch, mod)
    check_spec(registry.get(op), (5, 300), dtype, device=device, trials=1).raise_if_failed()
    names = [name for name, _, _ in launches]
    assert ("rms_norm_bwd_kernel" in names) == fused, names
    assert ("rms_norm_bwd_strip_kernel" in names) != fused, names


def test_wide_rows_take_cooperative_rows_by_default(device, monkeypatch):
    # The cooperative rows forward (past MAX_FUSED_N) and backward (past the fused limit), in both norms.
    from kernelkit.ops import _coop

    for module in (mod, ln):
        monkeypatch.setattr(module, "MAX_FUSED_BWD_N", 256)
        monkeypatch.setattr(module, "MAX_FUSED_N", 256)
    launches = _launches(monkeypatch, _coop)
    x, w = torch.randn(3, 300, device=device, requires_grad=True), torch.randn(300, device=device, requires_grad=True)
    mod.rms_norm(x, w).sum().backward()
    ln.layer_norm(x, w).sum().backward()
    names = {name for name, _, _ in launches}
    assert names == {"rms_norm_fwd_coop_kernel", "rms_norm_bwd_coop_kernel", "layer_norm_fwd_coop_kernel",
                     "layer_norm_bwd_coop_kernel"}, names
    # LayerNorm's 16-bit rows keep the looped forward and the strips (measured faster on the H100)
    launches.clear()
    ln_launches = _launches(monkeypatch, ln)
    xb = x.detach().bfloat16().requires_grad_()
    ln.layer_norm(xb, w.detach().bfloat16()).sum().backward()
    assert not launches and {"layer_norm_fwd_looped_kernel", "layer_norm_bwd_strip_kernel"} <= {
        name for name, _, _ in ln_launches}, ln_launches


def test_fused_backward_table_takes_the_first_entry_with_rows_enough():
    table = (common.FusedBackward(1024, 8, min_rows=32), common.FusedBackward(2048, 2), common.FusedBackward(8192, 1))
    assert common.fused_backward(table, 256, 8 * 4 * 32, 4) is table[0]
    assert common.fused_backward(table, 256, 8 * 4 * 32 - 1, 4) is table[1]  # too few rows for 8 per SM
    assert common.fused_backward(table, 2048, 10 ** 6, 4) is table[1]
    assert common.fused_backward(table, 4096, 10 ** 6, 4) is table[2]
    assert common.fused_backward(table, 65536, 10 ** 6, 4) is table[2]  # past them all: the last
    assert table[0].programs(4, 10 ** 6) == 32 and table[0].programs(4, 5) == 5


FUSED_KERNEL = {"rms_norm": (mod, "rms_norm_bwd_kernel"), "add_rms_norm": (mod, "rms_norm_bwd_kernel"),
                "layer_norm": (ln, "layer_norm_bwd_kernel")}


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("more_rows", [True, False])
def test_short_rows_run_more_programs_per_sm_where_each_gets_its_rows(op, more_rows, device, monkeypatch):
    # The module's own table, with its rows-per-program floor scaled from 32 to 1 so that the interpreter's
    # 4 "SMs" reach it at 32 rows of 64 columns: 8 programs per SM from there, the 2 of the next entry below.
    # Either way the dweight partial has one row per program and sums to the reference's gradient.
    module, kernel = FUSED_KERNEL[op]
    first, second = module.FUSED_BWD[:2]
    assert first.max_block_n >= 64 and first.min_rows > 1 and first.programs_per_sm > second.programs_per_sm
    monkeypatch.setattr(module, "FUSED_BWD", (dataclasses.replace(first, min_rows=1), *module.FUSED_BWD[1:]))
    sms = num_sms(torch.device(device))
    rows = first.programs_per_sm * sms - (0 if more_rows else 1)
    gen = torch.Generator(device=device).manual_seed(rows)
    x, dy = (torch.randn(rows, 64, device=device, generator=gen) for _ in range(2))
    w = torch.randn(64, device=device, generator=gen)
    launches = _launches(monkeypatch, module)
    if op == "rms_norm":
        _, rstd = mod.rms_norm_fwd(x, w, 1e-6)
        with poisoned_outputs():
            dx, dw = mod.rms_norm_bwd(dy, x, w, rstd)
        want = _fp64_grads(mod.reference, (x, w), dy, (0, 1))
    else:
        _, mean, rstd = ln.layer_norm_fwd(x, w, None, 1e-5)
        with poisoned_outputs():
            dx, dw, _ = ln.layer_norm_bwd(dy, x, w, None, mean, rstd)
        want = _fp64_grads(ln.reference, (x, w), dy, (0, 1))
    _close(dx, want[0], 1e-5, "dx")
    _close(dw, want[1], 1e-5, "dw")
    grids = [grid for name, grid, _ in launches if name == kernel]
    assert grids == [((first if more_rows else second).programs_per_sm * sms,)], grids


@pytest.mark.parametrize("op,stages", [("add_rms_norm", 2), ("rms_norm", None), ("layer_norm", None)])
def test_only_the_backward_with_dsummed_pipelines_its_row_loop(op, stages, device, monkeypatch):
    # add+RMSNorm's fused backward reads a third stream (dsummed) after the row sum: its loop is pipelined.
    module, kernel = FUSED_KERNEL[op]
    launches = _launches(monkeypatch, module)
    check_spec(registry.get(op), (37, 1000), "bfloat16", device=device, trials=1).raise_if_failed()
    got = [kw["STAGES"] for name, _, kw in launches if name == kernel]
    assert got and all(st == stages for st in got), got


@pytest.mark.parametrize("p,n,sms,block_p", [(1000, 40, 132, 256), (300, 300, 4, 32), (300, 300, 132, 256),
                                             (7, 1, 132, 256)])
def test_column_sum_over_many_partial_rows(p, n, sms, block_p, device, monkeypatch):
    # Fewer column strips than SMs (the many-program partials of short rows): 256 partial rows a step. The SM
    # count is given, not the device's, so the choice is the same on every machine.
    gen = torch.Generator(device=device).manual_seed(p + n)
    partial = torch.randn(p, n, device=device, generator=gen)
    like = torch.empty(n, device=device)
    launches = _launches(monkeypatch, common)
    with poisoned_outputs():
        got = common.column_sum(partial, like, sms)
    assert got.shape == (n,)
    torch.testing.assert_close(got.double(), partial.double().sum(0), rtol=1e-5, atol=1e-5)
    assert [kw["BLOCK_P"] for _, _, kw in launches] == [block_p]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(40000, 256), (36000, 1000), (4096, 8192), (3000, 2048)])
def test_gpu_fused_designs_at_real_sizes(shape):
    # 8 programs per SM (rows enough), the pipelined loop of add+RMSNorm, and the fallbacks, compiled for the GPU.
    for op in ("rms_norm", "add_rms_norm", "layer_norm"):
        check_spec(registry.get(op), shape, "bfloat16", device="cuda", trials=1).raise_if_failed()


@pytest.mark.gpu
@pytest.mark.parametrize("design", [common.WideBackward(4.0, 4, 512, 4), common.WideBackward(8.0, 4, 512, 8),
                                    common.WideBackward(1.0, 2, 1024, 4)], ids=["default", "8-warps", "wide-strips"])
@pytest.mark.parametrize("shape,dtype", [((37, 32768), "bfloat16"), ((300, 20000), "float32"), ((3, 65537), "bfloat16")])
def test_gpu_designs_at_real_widths(design, shape, dtype, monkeypatch):
    monkeypatch.setattr(mod, "COOP", False)
    monkeypatch.setattr(ln, "COOP", False)
    monkeypatch.setattr(mod, "WIDE_BWD", design)
    monkeypatch.setattr(ln, "WIDE_BWD", design)
    for op in ("rms_norm", "add_rms_norm", "layer_norm"):
        check_spec(registry.get(op), shape, dtype, device="cuda", trials=1).raise_if_failed()


@pytest.mark.skipif(not INTERPRET, reason="records launches through the Triton interpreter")
def test_cooperative_kernels_compile_for_sm90(monkeypatch):
    # The interpreter runs the phased launches (PHASE 1, 2); the GPU runs PHASE 0, compiled here for sm_90.
    from kernelkit.testing import compile_check

    monkeypatch.setattr(ln, "COOP_DTYPES", (torch.float32, torch.bfloat16, torch.float16))
    for module in (mod, ln):
        monkeypatch.setattr(module, "MAX_FUSED_BWD_N", 256)
        monkeypatch.setattr(module, "MAX_FUSED_N", 256)
        monkeypatch.setattr(module, "COOP_CHUNK", 128)
        monkeypatch.setattr(module, "COOP_BWD_CHUNK", 128)
    records = []
    with compile_check.record_launches(records):
        for op in ("add_rms_norm", "rms_norm", "layer_norm"):
            check_spec(registry.get(op), (3, 300), "bfloat16", device="cpu", trials=1).raise_if_failed()
    records = [r for r in records if "coop" in r["kernel"]]
    for r in records:
        r["args"]["PHASE"]["value"] = 0
    records = compile_check.unique(records)
    assert {r["kernel"].split(":")[1] for r in records} == {"rms_norm_fwd_coop_kernel", "rms_norm_bwd_coop_kernel",
                                                            "layer_norm_fwd_coop_kernel", "layer_norm_bwd_coop_kernel"}
    failures = compile_check.compile_in_subprocess(records)
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [(8192, 4096), (4096, 2048), (16384, 8192)])
@pytest.mark.parametrize("shape,dtype", [((37, 32768), "bfloat16"), ((300, 20000), "float32"), ((3, 65537), "bfloat16"),
                                         ((1024, 131072), "bfloat16"), ((2, 1000003), "float32")])
def test_gpu_cooperative_rows_at_real_widths(chunks, shape, dtype, monkeypatch):
    monkeypatch.setattr(ln, "COOP_DTYPES", (torch.float32, torch.bfloat16, torch.float16))
    for module in (mod, ln):
        monkeypatch.setattr(module, "COOP_CHUNK", chunks[0])
        monkeypatch.setattr(module, "COOP_BWD_CHUNK", chunks[1])
    monkeypatch.setattr(mod, "COOP_BWD_CHUNK_FP32", chunks[1])
    for op in ("rms_norm", "add_rms_norm", "layer_norm"):
        check_spec(registry.get(op), shape, dtype, device="cuda", trials=1).raise_if_failed()
