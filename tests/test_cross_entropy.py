import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelkit.ops.cross_entropy as ce
from kernelkit.ops import registry
from kernelkit.ops.cross_entropy import cross_entropy, reference
from kernelkit.testing import check, check_spec, rel_error

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


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_and_all_ignored(reduction, device):
    x = torch.randn(0, 64, device=device, requires_grad=True)
    out = cross_entropy(x, torch.zeros(0, dtype=torch.long, device=device), reduction=reduction)
    want = F.cross_entropy(x.detach(), torch.zeros(0, dtype=torch.long), reduction=reduction)
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
    monkeypatch.setattr(ce, "_check_target_values", lambda *a: None)
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
])
def test_bad_input_names_the_argument(bad, match, device):
    x = bad.pop("x", torch.ones(4, 8)).to(device)
    t = bad.pop("t", torch.zeros(4, dtype=torch.long)).to(device)
    with pytest.raises((TypeError, ValueError), match=match):
        cross_entropy(x, t, **bad)


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="logits is on cpu"):
        cross_entropy(torch.ones(2, 8), torch.zeros(2, dtype=torch.long))


def test_module_matches_torch(device):
    ref = torch.nn.CrossEntropyLoss(ignore_index=3, label_smoothing=0.1)
    ours = ce.CrossEntropyLoss(ignore_index=3, label_smoothing=0.1)
    ours.load_state_dict(ref.state_dict())
    x, t = _inputs(17, 45, device)
    torch.testing.assert_close(ours(x, t).cpu(), ref(x.cpu(), t.cpu()), rtol=1e-5, atol=1e-6)


def test_custom_op_is_registered_and_compiles_without_graph_breaks(device):
    x, t = _inputs(5, 40, device)
    for gif in (False, True):
        torch.library.opcheck(torch.ops.kernelkit.cross_entropy.default, (x, t, -100, 0.1, 1e-3, 4.0, "mean", gif),
                              test_utils=("test_schema", "test_faketensor"))
    lse = torch.logsumexp(x, -1)
    torch.library.opcheck(torch.ops.kernelkit.cross_entropy_bwd.default,
                          (torch.tensor(2.0, device=device), x, t, lse, -100, 0.1, 1e-3, 4.0, "mean", False),
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
def test_gpu_matches_torch_at_bench_shape():
    x, t = _inputs(8192, 128256, "cuda", dtype=torch.bfloat16)
    x.requires_grad_()
    loss = cross_entropy(x, t)
    loss.backward()
    xr = x.detach().float().requires_grad_()
    want = F.cross_entropy(xr, t)
    want.backward()
    torch.testing.assert_close(loss.float(), want, rtol=1e-2, atol=1e-3)
    assert rel_error(x.grad, xr.grad) < 1e-2


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
