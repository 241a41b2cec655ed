import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelkit.ops.cross_entropy as ce
from kernelkit.ops import _validate, registry
from kernelkit.ops.cross_entropy import cross_entropy, reference
from kernelkit.testing import check, check_spec, rel_error
from kernelkit.runtime import cdiv

SPEC = registry.get("cross_entropy")
FEATURES = {
    "plain": {},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-3},
    "softcap": {"softcap": 5.0},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "all": {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 3.0, "reduction": "sum", "ignore_index": 3},
}


def _inputs(n, v, device, dtype=torch.float32, ignore_index=-100, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    (x, t), _ = SPEC.make_inputs((n, v), dtype, device, gen)
    t[t == -100] = ignore_index
    return x, t


def _check(x, t, grad_args=(0,), **kw):
    return check(lambda a, b: cross_entropy(a, b, **kw), lambda a, b: reference(a, b, **kw), (x, t),
                 grad_args=grad_args)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", SPEC.test_shapes)
def test_matches_fp64_reference(shape, dtype, device):
    check_spec(SPEC, shape, dtype, device=device, trials=1).raise_if_failed()


@pytest.mark.parametrize("v", [1, 1000])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature(feature, v, device):
    kw = FEATURES[feature]
    x, t = _inputs(23, v, device, ignore_index=kw.get("ignore_index", -100))
    _check(x, t, **kw).raise_if_failed()


@pytest.mark.parametrize("grad_in_forward", [True, False])
@pytest.mark.parametrize("feature", ["plain", "all", "none"])
def test_chunked_path(feature, grad_in_forward, device, monkeypatch):
    # Shrink the chunk so V = 4097 takes 9 chunks: the online rescale and a one-element tail chunk run.
    monkeypatch.setattr(ce, "MAX_BLOCK_V", 512)
    kw = dict(FEATURES[feature], grad_in_forward=grad_in_forward)
    x, t = _inputs(7, 4097, device, dtype=torch.bfloat16, ignore_index=kw.get("ignore_index", -100))
    _check(x, t, **kw).raise_if_failed()


def test_z_loss_is_returned_for_logging(device):
    x, t = _inputs(37, 100, device)
    kw = dict(z_loss=1e-2, return_z_loss=True)
    rep = check(lambda a, b: cross_entropy(a, b, **kw), lambda a, b: reference(a, b, **kw), (x, t), grad_args=(0,))
    rep.raise_if_failed()
    assert set(rep.errors) == {"out[0]", "out[1]", "grad[0]"}
    loss, z = cross_entropy(x.requires_grad_(), t, **kw)
    assert loss.requires_grad and not z.requires_grad


def test_first_chunk_all_neg_inf(device, monkeypatch):
    # Masked vocab padding at the start of the row: the running max stays -inf for a whole chunk.
    monkeypatch.setattr(ce, "MAX_BLOCK_V", 16)
    x, t = _inputs(5, 70, device)
    x[:, :20] = float("-inf")
    t = torch.randint(20, 70, (5,), device=device)
    _check(x, t).raise_if_failed()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_backward_is_a_scale_and_survives_retain_graph(reduction, device):
    x, t = _inputs(37, 300, device, dtype=torch.bfloat16)
    x.requires_grad_()
    loss = cross_entropy(x, t, reduction=reduction, grad_in_forward=True)
    xr = x.detach().double().requires_grad_()
    ref = reference(xr, t, reduction=reduction)
    handed_out = []
    for g in (2.5, -0.75, 1.0):  # in place first, then divided out into fresh buffers
        # 'none' gets a stride-0 grad_output, as from loss.sum().backward().
        dy = torch.tensor(g, dtype=loss.dtype, device=device).expand(loss.shape)
        (got,) = torch.autograd.grad(loss, x, dy, retain_graph=True)
        (want,) = torch.autograd.grad(ref, xr, dy.double(), retain_graph=True)
        assert rel_error(got, want) < 1e-2, g
        handed_out.append((got, got.clone()))
    for got, snapshot in handed_out:  # a later backward never rewrites a gradient handed out before
        assert torch.equal(got, snapshot)


def test_loss_backward_leaves_the_saved_gradient_untouched(device):
    # grad_output == 1: the backward hands over the dlogits buffer written by the forward.
    x, t = _inputs(9, 200, device)
    x.requires_grad_()
    cross_entropy(x, t).backward()
    xr = x.detach().double().requires_grad_()
    reference(xr, t).backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-7)


def test_eager_backward_scales_the_saved_dlogits_in_place(device, monkeypatch):
    # Eager, grad_in_forward: the backward scales the forward's dlogits in place and hands that buffer over, no
    # (N, V) allocation (a compiled graph is functional: its backward op scales into a new buffer).
    x, t = _inputs(9, 200, device)
    x.requires_grad_()
    loss = cross_entropy(x, t, grad_in_forward=True)
    shapes, real = [], ce.empty
    monkeypatch.setattr(ce, "empty", lambda shape, **kw: (shapes.append(tuple(shape)), real(shape, **kw))[1])
    (got,) = torch.autograd.grad(loss * 2.5, x)
    assert (9, 200) not in shapes, shapes
    xr = x.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(reference(xr, t) * 2.5, xr)
    assert rel_error(got, want) < 1e-5


def test_grad_in_forward_matches_recompute(device):
    x, t = _inputs(37, 513, device, dtype=torch.float16)
    grads = []
    for gif in (True, False):
        xx = x.detach().requires_grad_()
        (cross_entropy(xx, t, label_smoothing=0.1, z_loss=1e-3, grad_in_forward=gif) * 0.5).backward()
        grads.append(xx.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=2e-3, atol=1e-6)


def test_non_contiguous_and_int32_targets(device):
    base = torch.randn(40, 2 * 333, device=device) * 2
    x = base[::2, ::2]  # strided rows and columns
    t = torch.randint(0, 333, (40,), device=device, dtype=torch.int32)[::2]
    _check(x, t, label_smoothing=0.1).raise_if_failed()


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("kw", [{}, {"reduction": "sum"}, {"reduction": "none"},
                                {"z_loss": 1e-2, "return_z_loss": True, "label_smoothing": 0.1}])
def test_loss_is_fp32_whatever_the_logits_dtype(kw, device):
    # HF's loss is fp32; a bf16 mean (12.625 for a fp32 12.6037) is off by bf16's rounding, ~4e-3.
    x, t = _inputs(64, 300, device, dtype=torch.bfloat16)
    got, want = _flat(cross_entropy(x, t, **kw)), _flat(reference(x.double(), t, **kw))
    assert [g.dtype for g in got] == [torch.float32] * len(got)
    assert [r.dtype for r in _flat(reference(x, t, **kw))] == [torch.float32] * len(got)
    for g, w in zip(got, want):
        assert rel_error(g, w) < 1e-5
    x.requires_grad_()
    assert _flat(cross_entropy(x, t, **kw))[0].dtype == torch.float32


@pytest.mark.parametrize("grad_in_forward", [True, False])
@pytest.mark.parametrize("kw", [{"reduction": r, "label_smoothing": ls} for r in ("mean", "sum", "none")
                                for ls in (0.0, 0.3)], ids=lambda kw: f"{kw['reduction']}-ls{kw['label_smoothing']}")
def test_class_weights_match_torch_in_float64(kw, grad_in_forward, device):
    x, t = _inputs(23, 37, device, ignore_index=5)
    w = torch.rand(37, generator=torch.Generator().manual_seed(1)).to(device) * 2
    w[[0, 9]] = 0.0
    _check_against = lambda a, b: F.cross_entropy(a, b, weight=w.double(), ignore_index=5, **kw)  # noqa: E731
    check(lambda a, b: cross_entropy(a, b, weight=w, ignore_index=5, grad_in_forward=grad_in_forward, **kw),
          _check_against, (x, t), grad_args=(0,)).raise_if_failed()


@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_class_weights_with_every_feature_chunked(grad_in_forward, device, monkeypatch):
    monkeypatch.setattr(ce, "MAX_BLOCK_V", 256)
    x, t = _inputs(7, 1100, device, dtype=torch.bfloat16, ignore_index=3)
    w = (torch.rand(1100, generator=torch.Generator().manual_seed(2)) + 0.5).to(device, torch.bfloat16)
    kw = dict(FEATURES["all"], reduction="mean", weight=w, grad_in_forward=grad_in_forward, return_z_loss=True)
    _check(x, t, **kw).raise_if_failed()
    # The z part is weighted like the rest of the token's loss; int32 targets index the weights alike.
    torch.testing.assert_close(cross_entropy(x, t.int(), **kw), reference(x, t, **kw), rtol=1e-5, atol=1e-6)


def test_no_gradient_for_weight_as_in_torch(device):
    x, t = _inputs(4, 8, device)
    x.requires_grad_()
    loss = cross_entropy(x, t, weight=torch.ones(8, device=device, requires_grad=True))
    with pytest.raises(NotImplementedError, match="no gradient for `weight`"):
        loss.backward()


def test_options_are_keyword_only(device):
    # F.cross_entropy(input, target, weight, ...): a positional third argument must not become ignore_index.
    x, t = _inputs(4, 8, device)
    for third in (torch.ones(8, device=device), 3):
        with pytest.raises(TypeError, match="positional"):
            cross_entropy(x, t, third)
        with pytest.raises(TypeError, match="positional"):
            reference(x, t, third)


def _logits_layout(name, n, v, device):
    """(view, native): logits of shape (n, v) in the named layout, every element outside the view
    poisoned (NaN and 1e30 alternately), and whether the kernels must take it without a copy."""
    gen = torch.Generator(device=device).manual_seed(3)
    vals = 2 * torch.randn(n, v, device=device, generator=gen)
    poison = torch.tensor([float("nan"), 1e30], device=device)
    if name == "transposed_back":  # column-major: the last dim is not unit-stride
        return vals.t().contiguous().t(), False
    if name == "expanded":
        return vals[:1].expand(n, v), True
    rows, cols, off = {"row_padded": (n, v + 5, 0), "row_stepped": (2 * n, v, 0), "offset": (n, v, 1),
                       "col_stepped": (n, 2 * v, 0)}[name]
    base = poison.repeat(cdiv(rows * cols + off, 2))[:rows * cols + off]
    grid = base[off:].view(rows, cols)
    view = {"row_padded": grid[:, :v], "row_stepped": grid[::2], "offset": grid, "col_stepped": grid[:, ::2]}[name]
    view.copy_(vals)
    return view, name != "col_stepped"


@pytest.mark.parametrize("path", ["no_grad", "grad_in_forward", "recompute"])
@pytest.mark.parametrize("layout", ["row_padded", "row_stepped", "offset", "expanded", "transposed_back",
                                    "col_stepped"])
def test_logits_layouts_read_natively_or_copied(layout, path, device):
    x, native = _logits_layout(layout, 6, 40, device)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, ignore_index=2)  # smoothing sums every logit of a row
    if path != "no_grad":
        kw["grad_in_forward"] = path == "grad_in_forward"
    t = torch.tensor([1, 2, 39, 0, 17, 2], device=device)
    before = _validate.copies
    _check(x, t, grad_args=() if path == "no_grad" else (0,), **kw).raise_if_failed()
    assert (_validate.copies == before) == native, f"{layout}: {_validate.copies - before} layout copies"


@pytest.mark.parametrize("layout", ["stepped", "offset", "expanded"])
def test_target_layouts(layout, device):
    x, _ = _inputs(6, 30, device)
    base = torch.randint(0, 30, (13,), device=device, dtype=torch.int32)
    t = {"stepped": base[::2][:6], "offset": base[7:], "expanded": base[4:5].expand(6)}[layout]
    for gif in (True, False):
        _check(x, t, label_smoothing=0.1, grad_in_forward=gif).raise_if_failed()
        _check(x, t, label_smoothing=0.1, grad_in_forward=gif, reduction="none").raise_if_failed()


def test_double_backward_differentiates_the_reference(device):
    # once_differentiable handed back a gradient with no graph when grad_output did not require grad
    # (loss.backward(create_graph=True)): the second-order term was silently zero.
    x, t = _inputs(6, 30, device)
    kw = dict(label_smoothing=0.1, z_loss=1e-2, softcap=4.0, weight=torch.rand(30, device=device) + 0.5)
    xx = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(cross_entropy(xx, t, grad_in_forward=False, **kw), xx, create_graph=True)
    assert g.requires_grad
    u = torch.randn_like(x)
    (hu,) = torch.autograd.grad((g * u).sum(), xx)
    xr = x.double().requires_grad_()
    (gr,) = torch.autograd.grad(reference(xr, t, **kw), xr, create_graph=True)
    (hur,) = torch.autograd.grad((gr * u.double()).sum(), xr)
    assert rel_error(g, gr) < 1e-5 and rel_error(hu, hur) < 1e-5


def test_double_backward_with_grad_in_forward_raises(device):
    x, t = _inputs(6, 30, device)
    x.requires_grad_()
    loss = cross_entropy(x, t, grad_in_forward=True)
    with pytest.raises(RuntimeError, match="kernelkit.cross_entropy has no double backward"):
        torch.autograd.grad(loss, x, create_graph=True)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_meta_inputs_give_meta_outputs(requires_grad, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # no kernel runs, on any device
    x = torch.empty(5, 11, device="meta", dtype=torch.bfloat16, requires_grad=requires_grad)
    t = torch.empty(5, dtype=torch.long, device="meta")
    w = torch.empty(11, device="meta")
    for reduction, shape in (("mean", ()), ("none", (5,))):
        out = cross_entropy(x, t, weight=w, reduction=reduction)
        assert out.is_meta and out.shape == shape and out.dtype == torch.float32
        assert out.requires_grad == requires_grad
    assert ce.CrossEntropyLoss(weight=w)(x, t).is_meta
    with pytest.raises(ValueError, match="target must have shape"):
        cross_entropy(x, t[:3])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_and_all_ignored(reduction, device):
    x = torch.randn(0, 64, device=device, requires_grad=True)
    out = cross_entropy(x, torch.zeros(0, dtype=torch.long, device=device), reduction=reduction)
    want = F.cross_entropy(x.detach(), torch.zeros(0, dtype=torch.long, device=device), reduction=reduction)
    assert out.shape == want.shape and torch.equal(out.isnan(), want.isnan())
    # Every token ignored: 'mean' is 0/0 = NaN like torch; the gradient is zero.
    x = torch.randn(4, 64, device=device, requires_grad=True)
    t = torch.full((4,), -100, device=device)
    out = cross_entropy(x, t, reduction=reduction)
    want = F.cross_entropy(x.detach(), t, reduction=reduction)
    torch.testing.assert_close(out, want, equal_nan=True)
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_nan_propagates_like_torch(device):
    x, t = _inputs(6, 50, device)
    t[2] = 4
    x[2, 7] = float("nan")
    got, want = cross_entropy(x, t, reduction="none"), reference(x, t, reduction="none")
    assert torch.equal(got.isnan(), want.isnan()) and got[2].isnan()
    torch.testing.assert_close(got[[0, 1, 3, 4, 5]], want[[0, 1, 3, 4, 5]])
    assert cross_entropy(x, t).isnan()


def test_out_of_range_target_on_gpu_path_gives_nan_row(device, monkeypatch):
    # What the GPU does without the CPU-only check: that token's loss is NaN, nothing is read out of bounds.
    monkeypatch.setattr(_validate, "target_values", lambda *a: None)
    x, t = _inputs(5, 30, device)
    t[1], t[3] = 30, -7
    got = cross_entropy(x, t, reduction="none")
    assert got[1].isnan() and got[3].isnan() and torch.isfinite(got[[0, 2, 4]]).all()


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.ones(4, 8, dtype=torch.int64)), "logits has dtype int64"),
    (dict(x=torch.ones(2, 4, 8)), "logits must be 2-D"),
    (dict(t=torch.zeros(4)), "target has dtype float32"),
    (dict(t=torch.zeros(5, dtype=torch.long)), r"target must have shape \(4,\)"),
    (dict(t=torch.tensor([0, 1, 8, 2])), "class index 8 outside"),
    (dict(t=torch.tensor([0, -1, 2, -100])), "class index -1 outside"),
    (dict(label_smoothing=1.5), "label_smoothing must be"),
    (dict(reduction="avg"), "reduction must be one of"),
    (dict(softcap=0.0), "softcap must be"),
    (dict(z_loss=-1.0), "z_loss must be"),
    (dict(ignore_index=1.0), "ignore_index must be an int"),
    (dict(weight=torch.ones(7)), r"weight must have shape \(8,\), one weight per class"),
    (dict(weight=torch.ones(8, dtype=torch.long)), "weight has dtype int64"),
])
def test_bad_input_names_the_argument(bad, match, device):
    if "class index" in match and device == "cuda":
        pytest.skip("checked where it is free, on CPU tensors (test_gpu_out_of_range_target_gives_nan)")
    bad = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in bad.items()}
    x = bad.pop("x", torch.ones(4, 8)).to(device)
    t = bad.pop("t", torch.zeros(4, dtype=torch.long)).to(device)
    with pytest.raises((TypeError, ValueError), match=match):
        cross_entropy(x, t, **bad)


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="logits is on cpu"):
        cross_entropy(torch.ones(2, 8), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("weighted", [False, True])
def test_module_runs_the_kernel_and_matches_torch(weighted, device, monkeypatch):
    launched = []
    real = ce.launch
    monkeypatch.setattr(ce, "launch", lambda kernel, *a, **k: (launched.append(kernel), real(kernel, *a, **k))[1])
    w = torch.rand(45, device=device) + 0.5 if weighted else None
    ref = torch.nn.CrossEntropyLoss(weight=w, ignore_index=3, label_smoothing=0.1)
    ours = ce.CrossEntropyLoss(weight=w, ignore_index=3, label_smoothing=0.1)
    ours.load_state_dict(ref.state_dict())
    x, t = _inputs(17, 45, device, ignore_index=3)
    x.requires_grad_()
    got = ours(x, t)
    got.backward()
    assert launched.count(ce.cross_entropy_fwd_kernel) == 1, "the module did not run the kernel"
    xr = x.detach().double().requires_grad_()
    ref.double()(xr, t).backward()
    torch.testing.assert_close(got.double(), ref(xr, t).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-7)


def test_custom_op_is_registered_and_compiles_without_graph_breaks(device):
    x, t = _inputs(5, 40, device)
    for gif in (False, True):
        for w in (None, torch.rand(40, device=device)):
            args = (x, t, w, -100, 0.1, 1e-3, 4.0, "mean", gif)
            torch.library.opcheck(torch.ops.kernelkit.cross_entropy.default, args,
                                  test_utils=("test_schema", "test_faketensor"))
    lse = torch.logsumexp(x, -1)
    torch.library.opcheck(torch.ops.kernelkit.cross_entropy_bwd.default,
                          (torch.tensor(2.0, device=device), x, t, lse, None, -100, 0.1, 1e-3, 4.0, "mean", False),
                          test_utils=("test_schema", "test_faketensor"))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for gif in (None, True):
        graphs.clear()
        xx = x.detach().requires_grad_()
        f = torch.compile(lambda a, b: cross_entropy(a, b, softcap=4.0, grad_in_forward=gif), backend=backend,
                          fullgraph=True)
        loss = f(xx, t)
        torch.testing.assert_close(loss, reference(x, t, softcap=4.0), rtol=1e-5, atol=1e-6)
        (loss * 3).backward()  # autograd through the custom op's registered backward
        xr = x.double().requires_grad_()
        (reference(xr, t, softcap=4.0) * 3).backward()
        torch.testing.assert_close(xx.grad.double(), xr.grad, rtol=1e-5, atol=1e-7)
        assert len(graphs) == 1 and any("kernelkit.cross_entropy" in str(n.target) for n in graphs[0].graph.nodes)


def test_fake_trace_is_one_node(device):
    from torch.fx.experimental.proxy_tensor import make_fx

    x, t = _inputs(6, 33, device)
    gm = make_fx(lambda a, b: cross_entropy(a, b, label_smoothing=0.1), tracing_mode="fake")(x, t)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function" and "getitem" not in str(n.target)]
    assert ops == [torch.ops.kernelkit.cross_entropy.default], ops


@settings(max_examples=6, deadline=None)
@given(rows=st.integers(1, 9), v=st.integers(1, 600), dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
       feature=st.sampled_from(sorted(FEATURES)), gif=st.booleans())
def test_random_shapes(rows, v, dtype, feature, gif):
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    kw = dict(FEATURES[feature], grad_in_forward=gif)
    x, t = _inputs(rows, v, device, dtype=getattr(torch, dtype), ignore_index=kw.get("ignore_index", -100))
    _check(x, t, **kw).raise_if_failed()


def test_cost_counts_ideal_bytes():
    x, t = torch.empty(8192, 128256, dtype=torch.bfloat16), torch.empty(8192, dtype=torch.long)
    assert SPEC.cost(x, t).bytes == 8192 * 128256 * 2 + 8192 * 8
    assert SPEC.cost(x, t, backward=True).bytes == 2 * 8192 * 128256 * 2 + 8192 * 8


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 128256), (4096, 32000), (64, 256000), (3, 131073), (1, 50)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_large_shapes(shape, dtype):
    check_spec(SPEC, shape, dtype, device="cuda", trials=1).raise_if_failed()


@pytest.mark.gpu
@pytest.mark.parametrize("feature", list(FEATURES))
def test_gpu_features_at_llm_vocab(feature):
    kw = FEATURES[feature]
    x, t = _inputs(512, 128256, "cuda", dtype=torch.bfloat16, ignore_index=kw.get("ignore_index", -100))
    _check(x, t, **kw).raise_if_failed()


@pytest.mark.gpu
@pytest.mark.parametrize("grad_in_forward", [True, False])
def test_gpu_class_weights_at_llm_vocab(grad_in_forward):
    x, t = _inputs(512, 128256, "cuda", dtype=torch.bfloat16)
    w = torch.rand(128256, device="cuda") + 0.5
    _check(x, t, weight=w, label_smoothing=0.1, z_loss=1e-4, grad_in_forward=grad_in_forward).raise_if_failed()


@pytest.mark.gpu
@pytest.mark.alone  # 8192 x 128256 logits, their fp32 copy and gradients: ~20 GB
def test_gpu_matches_torch_at_bench_shape():
    x, t = _inputs(8192, 128256, "cuda", dtype=torch.bfloat16)
    x.requires_grad_()
    loss = cross_entropy(x, t)
    loss.backward()
    xr = x.detach().float().requires_grad_()
    want = F.cross_entropy(xr, t)
    want.backward()
    torch.testing.assert_close(loss.float(), want, rtol=1e-2, atol=1e-3)
    assert float((x.grad.float() - xr.grad).norm() / xr.grad.norm()) < 1e-2  # fp32: a float64 copy is 8 GB


@pytest.mark.gpu
def test_gpu_out_of_range_target_gives_nan():
    x, t = _inputs(16, 1000, "cuda")
    t[3] = 5000
    assert cross_entropy(x, t, reduction="none")[3].isnan()


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    x, t = _inputs(256, 32000, "cuda", dtype=torch.bfloat16)
    x.requires_grad_()
    f = torch.compile(lambda a, b: cross_entropy(a, b, z_loss=1e-4), fullgraph=True)
    f(x, t).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
