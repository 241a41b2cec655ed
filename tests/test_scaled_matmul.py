"""kernelkit.scaled_matmul: fp8 GEMM with tensorwise, rowwise and 1x128 / 128x128 block scales against float64."""

import pytest
import torch
import triton

import kernelkit
from kernelkit.ops import registry
from kernelkit.ops import scaled_matmul as S
from kernelkit.testing.correctness import check
from kernelkit.testing.layouts import check_layouts, relayout
from tests.conftest import INTERPRET

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SPEC = registry.get("scaled_matmul")
TOL = {torch.float32: 1e-5 if INTERPRET else 1e-3, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# (a's quantization block, w's) per recipe; w is (N, K), b = w.t(). 0: the whole dim.
RECIPES = {"tensorwise": ((0, 0), (0, 0)), "rowwise": ((1, 0), (1, 0)), "1x128,128x128": ((1, 128), (128, 128)),
           "1x128,128x1": ((1, 128), (1, 128)), "128x128,128x1": ((128, 128), (1, 128)),
           "128x128,128x128": ((128, 128), (128, 128)),
           "rowwise,tensorwise": ((1, 0), (0, 0)), "1x128,tensorwise": ((1, 128), (0, 0))}


def _quantized(m, k, n, recipe, dtypes=(E4M3, E4M3), device="cpu", seed=0, spread=6):
    """(a, b, scale_a, scale_b): x (M, K) and w (N, K) with per-block magnitudes 2^[-spread, spread] (so
    block scales differ by up to 2^(2 spread)), quantized per `recipe`; b = wq.t() is column-major."""
    g = torch.Generator(device=device).manual_seed(seed)
    a_block, w_block = RECIPES[recipe]

    def source(rows, cols, block):
        x = torch.randn((rows, cols), generator=g, device=device)
        br, bc = block[0] or rows, block[1] or cols
        e = torch.randint(-spread, spread + 1, (-(-rows // br), -(-cols // bc)), generator=g, device=device)
        return x * torch.exp2(e.float()).repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]

    aq, sa = S.quantize(source(m, k, a_block), a_block, dtypes[0])
    wq, sw = S.quantize(source(n, k, w_block), w_block, dtypes[1])
    if a_block == (0, 0):
        sa = sa.reshape(())
    if w_block == (0, 0):
        sw = sw.reshape(1)  # torch takes () and (1,) alike
    return aq, wq.t(), sa, sw.t() if sw.dim() == 2 else sw


def _expand(scale, rows, cols, block):
    """scale broadcast to (rows, cols) for one scale per `block` (0: the whole dim), written independently
    of the op's own shape inference."""
    br, bc = block[0] or rows, block[1] or cols
    s = scale.double().reshape(-(-rows // br), -(-cols // bc))
    return s.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def _want(a, b, sa, sb, recipe, bias=None):
    """The float64 product of the dequantized operands: the reference, from the recipe (not the shapes)."""
    a_block, w_block = RECIPES[recipe]
    (m, k), n = a.shape, b.shape[1]
    sb_nk = sb.t() if sb.dim() == 2 else sb  # back to w's (N, K) orientation
    out = (a.double() * _expand(sa, m, k, a_block)) @ (b.t().double() * _expand(sb_nk, n, k, w_block)).t()
    return out + bias.double() if bias is not None else out


def _run(a, b, sa, sb, recipe, bias=None, out_dtype=torch.bfloat16, **kw):
    """check(): poisoned output, run twice; against the recipe's float64 product."""
    want = _want(a, b, sa, sb, recipe, bias)
    rep = check(lambda *args: S.scaled_matmul(*args, out_dtype=out_dtype, **kw), lambda *args: want,
                (a, b, sa, sb, bias), tol=TOL[out_dtype])
    rep.raise_if_failed()
    return rep


MIXED = [(r, d) for r in ("tensorwise", "rowwise", "1x128,128x128") for d in ((E5M2, E5M2), (E4M3, E5M2))]


@pytest.mark.parametrize("recipe,dtypes", [(r, (E4M3, E4M3)) for r in RECIPES] + MIXED,
                         ids=lambda v: "x".join(str(d)[12:] for d in v) if isinstance(v, tuple) else v)
def test_every_recipe_against_float64(recipe, dtypes, device):
    # Odd sizes: K = 200 ends in a partial 128-block, M and N span several tiles and a partial one.
    a, b, sa, sb = _quantized(37, 200, 45, recipe, dtypes, device)
    _run(a, b, sa, sb, recipe, out_dtype=torch.float32)


@pytest.mark.parametrize("m,k,n", [(1, 200, 45), (37, 1, 45), (1, 1, 1), (5, 129, 33), (70, 300, 3), (130, 64, 140)])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "1x128,128x128", "128x128,128x1"])
def test_odd_shapes(m, k, n, recipe, device):
    a, b, sa, sb = _quantized(m, k, n, recipe, device=device, seed=m + k + n)
    _run(a, b, sa, sb, recipe, out_dtype=torch.float32)


@pytest.mark.parametrize("out_dtype,bias_dtype", [(torch.float32, None), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("fast", [False, True])
def test_bias_out_dtypes_and_fast_accum(out_dtype, bias_dtype, fast, device):
    a, b, sa, sb = _quantized(37, 200, 45, "rowwise", device=device, spread=0)
    bias = None if bias_dtype is None else torch.randn(45, device=device).to(bias_dtype)
    _run(a, b, sa, sb, "rowwise", bias, out_dtype, use_fast_accum=fast)
    out = S.scaled_matmul(a, b, sa, sb, bias, out_dtype, use_fast_accum=fast)
    assert out.dtype == out_dtype and out.shape == (37, 45)


@pytest.mark.parametrize("layout", ["col_major", "row_major", "row_padded", "a_col_major", "scales_transposed"])
def test_operand_layouts_read_through_strides(layout, device):
    # torch._scaled_mm takes only row-major a and column-major b; here every layout reads as it is.
    a, b, sa, sb = _quantized(37, 200, 45, "1x128,128x128", device=device)
    if layout == "row_major":
        b = b.contiguous()
    elif layout == "row_padded":
        a, b = relayout(a, "row_padded"), relayout(b.contiguous(), "row_padded")
    elif layout == "a_col_major":
        a = a.t().contiguous().t()
    elif layout == "scales_transposed":  # scale_a unit-stride along M: DeepGEMM's and cuBLAS's layout
        sa, sb = sa.t().contiguous().t(), sb.contiguous()
    _run(a, b, sa, sb, "1x128,128x128")


@pytest.mark.parametrize("b_layout", ["col_major", "row_major"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "1x128,128x128"])
def test_tma_descriptor_path(b_layout, recipe, device, monkeypatch):
    # The sm_90 path loads tiles through TMA descriptors; the interpreter runs it when forced. Aligned sizes
    # (descriptor strides are multiples of 16 bytes); M, N and K still end in partial tiles.
    a, b, sa, sb = _quantized(40, 208, 48, recipe, device=device)
    if b_layout == "row_major":
        b = b.contiguous()
    monkeypatch.setattr(S, "USE_TMA", True)
    assert S._tma_layout(a, b) == (True, b_layout == "col_major")
    _run(a, b, sa, sb, recipe)
    # Unaligned layouts fall back to pointers even when TMA is asked for.
    assert not S._tma_layout(relayout(a, "misaligned"), b)[0]
    a2, b2, _, _ = _quantized(40, 200, 48, recipe, device=device)
    assert not S._tma_layout(a2, b2)[0]  # a's rows 200 bytes apart
    assert not S._tma_layout(a, b[:, :36].contiguous())[0]  # a row-major b's rows 36 bytes apart


def test_block_scales_apply_per_128_block(device):
    # Each 128-block of K (and of M or N) gets a scale 2^6 to 2^24 apart from its neighbours, on all-ones
    # operands: scales applied per block of any other size, or with rows and columns mixed up, land far off.
    k = 2 * 128 + 40
    kb = 3
    for recipe, m, n in (("1x128,128x128", 33, 200), ("128x128,128x1", 130, 24)):
        a = torch.ones(m, k, device=device).to(E4M3)
        b = torch.ones(n, k, device=device).to(E4M3).t()
        steps = torch.tensor([0.0, 12, -12, 6, -6], device=device)
        if recipe == "1x128,128x128":
            sa = torch.exp2(steps[torch.arange(m * kb, device=device) % 5].reshape(m, kb))
            sb = torch.exp2(steps[torch.arange(kb * 2, device=device) % 4].reshape(kb, 2))
        else:
            sa = torch.exp2(steps[torch.arange(2 * kb, device=device) % 5].reshape(2, kb))
            sb = torch.exp2(steps[torch.arange(kb * n, device=device) % 5].reshape(kb, n))
        _run(a, b, sa, sb, recipe, out_dtype=torch.float32)


@pytest.mark.skipif(not INTERPRET, reason="sets the interpreter's tile")
@pytest.mark.parametrize("k", [100, 200])
def test_scale_blocks_smaller_than_the_tile(k, device, monkeypatch):
    # GPU tiles reach 256 rows or columns, more than a 128x128 scale block: the scales then change inside the
    # tile, in the epilogue (K <= 128: one K block) and in the K loop.
    big = triton.Config({"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 1}, num_warps=4)
    monkeypatch.setattr(S.scaled_matmul_kernel, "configs", [big])
    a, b, sa, sb = _quantized(300, k, 270, "128x128,128x128", device=device)
    _run(a, b, sa, sb, "128x128,128x128", out_dtype=torch.float32)


def test_empty_and_zero_k(device):
    a, b, sa, sb = _quantized(5, 64, 7, "rowwise", device=device)
    assert S.scaled_matmul(a[:0], b, sa[:0], sb).shape == (0, 7)
    assert S.scaled_matmul(a, b[:, :0], sa, sb[:, :0]).shape == (5, 0)
    bias = torch.randn(7, device=device)
    out = S.scaled_matmul(a[:, :0], b[:0], sa, sb, bias, torch.float32)
    torch.testing.assert_close(out, bias.expand(5, 7))
    assert (S.scaled_matmul(a[:, :0], b[:0], sa, sb) == 0).all()


def _bad(device):
    a, b, sa, sb = _quantized(8, 256, 16, "1x128,128x128", device=device)
    return a, b, sa, sb


@pytest.mark.parametrize("change,exc,match", [
    (lambda a, b, sa, sb: (a.float(), b, sa, sb), TypeError, "a has dtype float32; supported: float8_e4m3fn"),
    (lambda a, b, sa, sb: (a, b.to(torch.bfloat16), sa, sb), TypeError, "b has dtype bfloat16"),
    (lambda a, b, sa, sb: (a, b[:128], sa, sb), ValueError, r"b must have shape \(256, N\)"),
    (lambda a, b, sa, sb: (a[None], b, sa, sb), ValueError, "a must be 2-D"),
    (lambda a, b, sa, sb: (a, b, sa.double(), sb), TypeError, "scale_a has dtype float64; supported: float32"),
    (lambda a, b, sa, sb: (a, b, sa, sb.half()), TypeError, "scale_b has dtype float16"),
    (lambda a, b, sa, sb: (a, b, sa[:, :1].repeat(1, 3), sb), ValueError,
     r"scale_a must have shape .*\(8, 1\) \(rowwise\), \(8, 2\) \(1x128 blocks\) or \(1, 2\).*got \(8, 3\)"),
    (lambda a, b, sa, sb: (a, b, sa, sb.t()), ValueError,
     r"scale_b must have shape .*\(1, 16\) \(one per column\), \(2, 16\) \(128x1 blocks\) or \(2, 1\).*got \(1, 2\)"),
    (lambda a, b, sa, sb: (a, b, sa[:, 0], sb), ValueError, r"scale_a must have shape.*got \(8,\)"),
    (lambda a, b, sa, sb: (a, b, sa.new_ones(1, 1, 1), sb), ValueError, r"scale_a must have shape.*got \(1, 1, 1\)"),
])
def test_bad_inputs_name_the_argument(change, exc, match, device):
    args = change(*_bad(device))
    with pytest.raises(exc, match=match):
        S.scaled_matmul(*args)


def test_bad_options_and_grad(device):
    a, b, sa, sb = _bad(device)
    with pytest.raises(ValueError, match=r"bias must have shape \(16,\)"):
        S.scaled_matmul(a, b, sa, sb, torch.zeros(15, device=device))
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        S.scaled_matmul(a, b, sa, sb, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="use_fast_accum must be a bool"):
        S.scaled_matmul(a, b, sa, sb, use_fast_accum=1)
    with pytest.raises(ValueError, match="scale_a requires grad, but kernelkit.scaled_matmul has no backward"):
        S.scaled_matmul(a, b, sa.requires_grad_(), sb)
    with torch.no_grad():  # without grad mode the result is plain inference
        assert not S.scaled_matmul(a, b, sa, sb).requires_grad


def test_meta_and_public_api():
    a, b, sa, sb = _quantized(37, 200, 45, "1x128,128x128")
    out = kernelkit.scaled_matmul(*(t.to("meta") for t in (a, b, sa, sb)), out_dtype=torch.float16)
    assert out.device.type == "meta" and out.shape == (37, 45) and out.dtype == torch.float16


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_layout_fuzz_of_the_epilogue_recipes(recipe, device):
    # tests/test_layouts.py fuzzes the registry's layout shape (block scales); here the other two recipes.
    report, cases = check_layouts(SPEC, "float32", device, shape=(19, 136, 21, recipe))
    assert cases >= 15
    report.raise_if_failed()


@pytest.mark.skipif(not INTERPRET, reason="records launches through the Triton interpreter")
def test_hopper_tiles_and_tma_compile_for_sm90(device, monkeypatch):
    # The interpreter runs 32x32x64 pointer tiles; the H100 runs 128-wide tiles through TMA descriptors.
    # Compile those (each recipe, both b layouts) for sm_90 through Triton's real compiler.
    from kernelkit.testing import compile_check

    monkeypatch.setattr(S, "USE_TMA", True)
    records = []
    with compile_check.record_launches(records):
        for recipe, fast in (("tensorwise", True), ("rowwise", False), ("1x128,128x128", False)):
            a, b, sa, sb = _quantized(64, 256, 64, recipe, device=device)
            S.scaled_matmul(a, b, sa, sb, torch.zeros(64, device=device), use_fast_accum=fast)
        S.scaled_matmul(a, b.contiguous(), sa, sb)
    for r, (bm, bn, warps) in zip(records, ((128, 256, 8), (128, 128, 8), (128, 128, 8), (64, 128, 4))):
        assert r["args"]["USE_TMA"]["value"]
        r["args"].update(BLOCK_M={"value": bm}, BLOCK_N={"value": bn}, BLOCK_K={"value": 128}, GROUP_M={"value": 8})
        r["options"] = {"num_warps": warps, "num_stages": 3}
    failures = compile_check.compile_in_subprocess(records)
    assert not failures, "\n".join(failures)


# --- one tensorwise scale, spelled () (torch.tensor(1.0), as torch's docs write it), (1,) or (1, 1) ---

TENSORWISE_FORMS = {"()": (), "(1,)": (1,), "(1, 1)": (1, 1)}


def _tensorwise_forms(device):
    """a, b and {form: (scale_a, scale_b)}: the same scale values in each spelling; sizes TMA-aligned (40 x 208 x
    48: descriptor strides of 16 bytes) with partial tiles."""
    a, b, sa, sb = _quantized(40, 208, 48, "tensorwise", device=device)
    return a, b, {name: (sa.reshape(shape), sb.reshape(shape)) for name, shape in TENSORWISE_FORMS.items()}


@pytest.mark.skipif(not INTERPRET, reason="records launches through the Triton interpreter")
@pytest.mark.parametrize("fast", [False, True])
def test_every_tensorwise_scale_form_launches_alike(fast, device, monkeypatch):
    # The 2026-11-25 audit timed a 0-dim scale at 0.55x torch._scaled_mm at 4096^3, rowwise at 1.01x. Each spelling
    # must launch the same kernel with the same arguments, tile configuration and autotuning key (the GPU tunes per
    # key), and give the same bits; a rowwise scale launches differently, so the comparison can tell.
    from kernelkit.testing import compile_check

    monkeypatch.setattr(S, "USE_TMA", True)
    keys = []
    real_launch = S.launch
    monkeypatch.setattr(S, "launch", lambda kernel, grid, key, *args, **kw: (
        keys.append(key), real_launch(kernel, grid, key, *args, **kw))[1])
    a, b, forms = _tensorwise_forms(device)
    ra, rb, rsa, rsb = _quantized(40, 208, 48, "rowwise", device=device)
    launches, outs = {}, {}
    for name, (x, w, sa, sb) in [*((n, (a, b, *f)) for n, f in forms.items()), ("rowwise", (ra, rb, rsa, rsb))]:
        records = []
        with compile_check.record_launches(records):
            outs[name] = S.scaled_matmul(x, w, sa, sb, out_dtype=torch.float32, use_fast_accum=fast)
        assert [r["kernel"] for r in records] == ["kernelkit.ops.scaled_matmul:scaled_matmul_kernel"]
        launches[name] = (records, keys[-1])
    args = launches["()"][0][0]["args"]
    assert args["A_GROUP"]["value"] == args["B_GROUP"]["value"] == 0 and args["USE_TMA"]["value"]
    assert launches["(1,)"] == launches["()"] and launches["(1, 1)"] == launches["()"]
    assert launches["rowwise"] != launches["()"]
    for name, (sa, sb) in forms.items():
        assert torch.equal(outs[name], outs["()"]), name
        _run(a, b, sa, sb, "tensorwise", out_dtype=torch.float32, use_fast_accum=fast)


def test_every_tensorwise_scale_form_takes_the_gluon_kernel_in_precise_mode(device, monkeypatch):
    # On Hopper precise calls go to the warp-specialized Gluon kernel (0.90-0.96x torch._scaled_mm; the Triton
    # kernel 0.67-0.76x). The choice is host code: with the Hopper check faked, every spelling must reach it with
    # the same scaling arguments and never the Triton kernel.
    if S._precise is None:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(S, "USE_TMA", True)
    monkeypatch.setattr(S._precise, "supports", lambda a, b, out_dtype: True)
    calls = []
    monkeypatch.setattr(S._precise, "launch_precise", lambda a, b, out, sa, sb, bias, a_scaling, b_scaling, programs:
                        calls.append((a_scaling, b_scaling)))
    monkeypatch.setattr(S, "launch", lambda *args, **kw: pytest.fail("the Triton kernel was launched"))
    a, b, forms = _tensorwise_forms(device)
    for sa, sb in forms.values():
        S.scaled_matmul(a, b, sa, sb)
    assert calls == [((0, 0, 0, False), (0, 0, 0, False))] * 3


# --- GPU only: against cuBLAS, specials, and the tensor cores' accumulation ---

def _cuda_fp8():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm_89+")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "1x128,128x128"])
@pytest.mark.parametrize("fast", [False, True])
def test_matches_torch_scaled_mm(recipe, fast):
    _cuda_fp8()
    a, b, sa, sb = _quantized(256, 1024, 384, recipe, device="cuda")
    bias = torch.randn(384, device="cuda").to(torch.bfloat16)
    try:
        want = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=fast)
    except (RuntimeError, ValueError) as e:  # this torch / cuBLAS lacks the recipe (blocks: cuBLAS 12.9+, sm_90)
        pytest.skip(f"torch._scaled_mm: {str(e)[:200]}")
    got = S.scaled_matmul(a, b, sa, sb, bias, use_fast_accum=fast)
    exact = _want(a, b, sa, sb, recipe, bias)
    err_ours = ((got.double() - exact).norm() / exact.norm()).item()
    err_torch = ((want.double() - exact).norm() / exact.norm()).item()
    assert err_ours <= max(2 * err_torch, 4e-3), (err_ours, err_torch)


@pytest.mark.gpu
def test_precise_accumulation_over_long_k():
    # Hopper's fp8 MMA sums in fewer bits than fp32: use_fast_accum=False adds each K tile's partial
    # product in fp32, so its error must stay near fp32 rounding over K = 16384; fast accumulation may not.
    _cuda_fp8()
    a, b, sa, sb = _quantized(128, 16384, 256, "rowwise", device="cuda", spread=0)
    exact = _want(a, b, sa, sb, "rowwise")
    errs = {}
    for fast in (False, True):
        got = S.scaled_matmul(a, b, sa, sb, out_dtype=torch.float32, use_fast_accum=fast)
        errs[fast] = ((got.double() - exact).norm() / exact.norm()).item()
    assert errs[False] < 5e-4, errs
    assert errs[False] <= errs[True] * 1.5 + 1e-6, errs


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "1x128,128x128"])
def test_nan_and_inf_propagate(recipe):
    # The interpreter decodes fp8 NaN/Inf as finite numbers; the tensor cores do not.
    _cuda_fp8()
    a, b, sa, sb = _quantized(64, 256, 64, recipe, (E5M2, E4M3), device="cuda")
    a = a.clone()
    a.view(torch.uint8)[3, 5] = 0x7F  # e5m2 NaN
    a.view(torch.uint8)[7, 9] = 0x7C  # e5m2 +Inf
    out = S.scaled_matmul(a, b, sa, sb, out_dtype=torch.float32)
    assert torch.isnan(out[3]).all()
    assert (torch.isinf(out[7]) | (b[9] == 0)).all() and not torch.isinf(out[7]).logical_and(b[9] == 0).any()
    rest = torch.ones(64, dtype=torch.bool, device="cuda")
    rest[[3, 7]] = False
    assert torch.isfinite(out[rest]).all()


@pytest.mark.gpu
def test_tma_and_pointer_paths_agree(monkeypatch):
    _cuda_fp8()
    a, b, sa, sb = _quantized(512, 1024, 768, "1x128,128x128", device="cuda")
    outs = []
    monkeypatch.setattr(S, "GLUON_PRECISE", False)  # the Triton kernel's two load paths (Gluon: its own test)
    for tma in (True, False):
        monkeypatch.setattr(S, "USE_TMA", tma)
        outs.append(S.scaled_matmul(a, b, sa, sb, out_dtype=torch.float32))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_numpy_flag_and_number_scales_follow_torch_scaled_mm(device):
    # torch._scaled_mm's contract: use_fast_accum a bool (numpy's bool is one, as a flag read from an array),
    # scales float32 tensors; Python and numpy numbers are refused by it too, with the fix in the message.
    np = pytest.importorskip("numpy")
    a, b, sa, sb = _quantized(8, 64, 16, "rowwise", device=device)
    for flag in (True, False):
        got = S.scaled_matmul(a, b, sa, sb, out_dtype=torch.float32, use_fast_accum=np.bool_(flag))
        torch.testing.assert_close(got, S.scaled_matmul(a, b, sa, sb, out_dtype=torch.float32, use_fast_accum=flag))
    for v, kind in ((np.float32(1.0), "numpy.float32"), (1.0, "float")):
        with pytest.raises(TypeError, match=rf"scale_b must be a float32 torch.Tensor .*got {kind}: pass torch.tensor"):
            S.scaled_matmul(a, b, sa, v)


@pytest.mark.parametrize("m,k,n", [(8, 64, 16), (1, 128, 16)])
def test_scale_shape_error_lists_each_shape_once(m, k, n, device):
    # With K <= 128 one block spans K: (M, 1) is both rowwise and 1x128 blocks, and listed once.
    a, b, sa, sb = _quantized(m, k, n, "rowwise", device=device)
    with pytest.raises(ValueError) as err:
        S.scaled_matmul(a, b, sa.repeat(1, 3), sb)
    msg = str(err.value)
    assert f"({m}, 1) (rowwise / 1x128 blocks" in msg and msg.count(f"({m}, 1)") == 1, msg
    with pytest.raises(ValueError) as err:
        S.scaled_matmul(a, b, sa, sb.repeat(2, 1))
    msg = str(err.value)
    assert f"(1, {n}) (one per column / 128x1 blocks)" in msg and msg.count(f"(1, {n})") == 1, msg


_GLUON_COMPILE = r"""
import json, sys
import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from kernelkit.ops.gemm import precise as P
from kernelkit.runtime.gluon import GL_DTYPES
from kernelkit.testing.compile_check import compile_gluon
out_dtype, a_group, b_group, k_blocked = getattr(torch, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
m, n, k = 256, 256, 512
def desc(t, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)
args = {"a_desc": desc(torch.empty(m, k, dtype=torch.float8_e4m3fn), [P.BLOCK_M // 2, P.BLOCK_K]),
        "b_desc": desc(torch.empty(n, k, dtype=torch.float8_e5m2), [P.BLOCK_N, P.BLOCK_K]),
        "c_desc": desc(torch.empty(m, n, dtype=out_dtype), [P.BLOCK_M // 2, P.BLOCK_N]),
        "SCALE_A": torch.empty(m, 1), "SCALE_B": torch.empty(1), "BIAS": torch.empty(n, dtype=torch.bfloat16),
        "M": m, "N": n, "K": k, "stride_sam": 3, "stride_sak": 7, "stride_sbn": 0, "stride_sbk": 2, "stride_bias": 5}
const = {"A_GROUP": a_group, "B_GROUP": b_group, "K_BLOCKED": k_blocked, "HAS_BIAS": k_blocked, "STAGES": P.STAGES, "GROUP_M": P.GROUP_M, "CONSUMER_REGS": P.CONSUMER_REGS,
         "PRODUCER_REGS": P.PRODUCER_REGS}
got = compile_gluon(P.fp8_precise_kernel, args, const)
print(json.dumps({"shared": got["shared"], "ptxas": got["ptxas"], "rc": got["ptxas_rc"]}))
"""


@pytest.mark.parametrize("out_dtype,a_group,b_group,k_blocked", [
    ("float32", 0, 0, False), ("bfloat16", 1, 1, False),  # tensorwise, rowwise: scaled in the epilogue
    ("bfloat16", 1, 128, True), ("float32", 1, 1, True), ("float32", 128, 1, True)])  # DeepSeek-V3's, 128x1
def test_gluon_precise_kernel_compiles_for_sm90(out_dtype, a_group, b_group, k_blocked):
    # The Gluon kernel cannot run in the interpreter: CI builds it for the H100 (Triton's compiler, then ptxas)
    # and checks what the design depends on: it fits in shared memory, no spills, and no C7514 (ptxas
    # serializing the MMAs because something reads an accumulator before its wait).
    import json

    from kernelkit.testing import compile_check

    run = compile_check.run_uninterpreted(_GLUON_COMPILE, (out_dtype, a_group, b_group, int(k_blocked)), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0, got["ptxas"]
    assert got["shared"] <= 232448, got["shared"]
    assert "0 bytes spill stores" in got["ptxas"] and "C7514" not in got["ptxas"], got["ptxas"]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise,tensorwise", "1x128,128x128", "1x128,128x1",
                                    "128x128,128x128", "1x128,tensorwise"])
@pytest.mark.parametrize("m,k,n", [(1, 128, 64), (37, 272, 200), (300, 4112, 392), (1000, 1536, 1032)])
def test_gluon_precise_path_is_taken_and_matches(recipe, m, k, n, monkeypatch):
    # Precise mode (and every block-scaled call) goes to the Gluon kernel on Hopper; it must agree with the
    # Triton kernel (same promotion interval: both add each 128-deep K tile's product in fp32) and float64.
    _cuda_fp8()
    if torch.cuda.get_device_capability()[0] != 9 or S._precise is None:
        pytest.skip("the Gluon kernel is for Hopper")
    a, b, sa, sb = _quantized(m, k, n, recipe, (E4M3, E5M2), device="cuda", seed=m)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = S._precise.launch_precise
    monkeypatch.setattr(S._precise, "launch_precise", lambda *args, **kw: (calls.append(1), real(*args, **kw))[1])
    outs = {}
    for gluon in (True, False):
        monkeypatch.setattr(S, "GLUON_PRECISE", gluon)
        outs[gluon] = S.scaled_matmul(a, b, sa, sb, bias, out_dtype=torch.float32)
    assert len(calls) == 1
    want = _want(a, b, sa, sb, recipe, bias)
    assert torch.isfinite(outs[True]).all()
    assert ((outs[True].double() - want).norm() / want.norm()).item() < 5e-4  # fp8 MMA sums within a K tile
    assert ((outs[True] - outs[False]).norm() / outs[False].norm()).item() < 1e-5
