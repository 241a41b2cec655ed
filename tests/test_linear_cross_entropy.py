import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import kernelkit.ops.linear_cross_entropy as lce
from kernelkit.ops import _validate, registry
from kernelkit.ops.linear_cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy, reference
from kernelkit.testing import check, check_spec, rel_error
from kernelkit.testing.graph import compile_as_one_node
from kernelkit.runtime.alloc import poisoned_outputs

SPEC = registry.get("linear_cross_entropy")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
FEATURES = {
    "plain": {},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-3},
    "softcap": {"softcap": 3.0},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "all": {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 4.0, "reduction": "sum", "ignore_index": 3},
    "all-none": {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 4.0, "reduction": "none", "ignore_index": 3},
}


def _inputs(t, h, v, device, dtype=torch.float32, ignore_index=-100, bias=False, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    (x, w, tgt), _ = SPEC.make_inputs((t, h, v), dtype, device, gen)
    tgt[tgt == -100] = ignore_index
    b = (0.5 * torch.randn(v, device=device, generator=gen)).to(dtype) if bias else None
    return x, w, tgt, b


def _check(x, w, t, b=None, **kw):
    """The harness: fp64 reference, poisoned outputs, a random grad_output, run twice."""
    args, grad_args = (x, w, t) + ((b,) if b is not None else ()), (0, 1) + ((3,) if b is not None else ())
    return check(lambda *a: linear_cross_entropy(*a, **kw), lambda *a: reference(*a, **kw), args,
                 grad_args=grad_args, tol=TOL[x.dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SPEC.test_shapes)
def test_matches_fp64_reference(shape, dtype, device):
    check_spec(SPEC, shape, dtype, device=device, trials=1).raise_if_failed()


# Every feature in fp32; bf16 for the plain path and everything at once (the interpreter is slow).
CASES = [(f, torch.float32) for f in FEATURES] + [(f, torch.bfloat16) for f in ("plain", "all", "all-none")]


@pytest.mark.parametrize("feature,dtype", CASES)
def test_each_feature_over_several_chunks(feature, dtype, device):
    # T = 29 in chunks of 8: three full chunks and a 5-row tail; H and V not powers of two.
    kw = FEATURES[feature]
    x, w, t, b = _inputs(29, 24, 257, device, dtype, ignore_index=kw.get("ignore_index", -100), bias=True)
    _check(x, w, t, b, chunk_size=8, **kw).raise_if_failed()


def _weighted_fp64(x, w, t, b, cw, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0):
    """torch's weighted cross-entropy in float64, written out: 'mean' is sum(w_y * loss) / sum(w_y) over the
    non-ignored tokens; z-loss (z * lse², as kernelkit adds it) weighted by w_y like the rest of the token's loss."""
    logits = F.linear(*(a.double() if a is not None else None for a in (x, w, b)))
    loss = F.cross_entropy(logits, t, weight=cw.double(), ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    valid = t != ignore_index
    w_y = torch.where(valid, cw.double()[t.clamp(0, cw.numel() - 1)], 0.0)
    loss = loss + torch.where(valid, z_loss * torch.logsumexp(logits, -1).square() * w_y, 0.0)
    if reduction == "none":
        return loss
    return loss.sum() / w_y.sum() if reduction == "mean" else loss.sum()


WEIGHTED = [("mean", {}), ("mean", {"label_smoothing": 0.1, "z_loss": 1e-2}), ("sum", {"label_smoothing": 0.1}),
            ("none", {"z_loss": 1e-2}), ("none", {"label_smoothing": 0.2, "softcap": 4.0})]


# Every case in fp32; bf16 and fp16 (dlogits carry FP16_GRAD_SCALE) with 'mean' and 'none' (the interpreter is slow).
WEIGHTED_CASES = [(c, torch.float32) for c in range(len(WEIGHTED))] + \
    [(c, dt) for dt in (torch.bfloat16, torch.float16) for c in (1, 3)]


@pytest.mark.parametrize("case,dtype", WEIGHTED_CASES)
def test_class_weights_match_torch(case, dtype, device):
    # ce_weight: F.cross_entropy's weight, under Liger's name. T = 29 in chunks of 8, a fifth of the tokens ignored.
    reduction, kw = WEIGHTED[case]
    x, w, t, b = _inputs(29, 24, 257, device, dtype, ignore_index=5, bias=True)
    t[::5] = 5
    cw = torch.rand(257, device=device) * 2 + 0.1
    params = [a.requires_grad_() for a in (x, w, b)]
    loss = linear_cross_entropy(x, w, t, b, ce_weight=cw, ignore_index=5, reduction=reduction, chunk_size=8, **kw)
    dy = torch.randn(loss.shape, device=device) if reduction == "none" else torch.tensor(1.7, device=device)
    got = torch.autograd.grad(loss, params, dy)
    xr, wr, br = refs = [a.detach().double().requires_grad_() for a in params]
    if "softcap" in kw:  # the written-out formula has no softcap: the module's reference does
        ref = reference(xr, wr, t, br, ce_weight=cw.double(), ignore_index=5, reduction=reduction, **kw)
    else:
        ref = _weighted_fp64(xr, wr, t, br, cw, ignore_index=5, reduction=reduction, **kw)
    want = torch.autograd.grad(ref, refs, dy.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert loss.dtype == torch.float32 and rel_error(loss, ref) < max(tol, 1e-5), rel_error(loss, ref)
    for name, g, r in zip(("dhidden", "dweight", "dbias"), got, want):
        assert g.dtype == dtype and rel_error(g, r) < tol, (name, rel_error(g, r))
    # The harness too: poisoned outputs, its own random grad_output, run twice.
    if dtype == torch.float32:
        _check(x, w, t, b, ce_weight=cw, ignore_index=5, reduction=reduction, chunk_size=8, **kw).raise_if_failed()


def test_class_weights_change_the_loss_and_the_module_keeps_them(device):
    # Uniform weights c give the unweighted loss ('mean' divides c out); a weight on one class moves it.
    x, w, t, _ = _inputs(19, 16, 60, device)
    plain = linear_cross_entropy(x, w, t, chunk_size=6)
    torch.testing.assert_close(linear_cross_entropy(x, w, t, ce_weight=torch.full((60,), 3.0, device=device),
                                                    chunk_size=6), plain, rtol=1e-6, atol=0)
    cw = torch.ones(60, device=device)
    cw[t[0]] = 5.0
    assert not torch.allclose(linear_cross_entropy(x, w, t, ce_weight=cw), plain)
    mod = LinearCrossEntropyLoss(ce_weight=cw.cpu(), chunk_size=6).to(device)
    assert mod.ce_weight.device == x.device and "ce_weight" in mod.state_dict() and not list(mod.parameters())
    torch.testing.assert_close(mod(x, w, t), reference(x, w, t, ce_weight=cw), rtol=1e-5, atol=1e-6)


def test_dweight_accumulation_paths(device, monkeypatch):
    # bf16 dweight over 12 chunks: the running sum in the gradient itself (a rounding per chunk) or in fp32.
    made, errors = [], {}
    real = lce._Grads.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        made.append(self.dw32 is not None)

    monkeypatch.setattr(lce._Grads, "__init__", spy)
    x, w, t, _ = _inputs(60, 40, 300, device, torch.bfloat16)
    w.requires_grad_()
    wr = w.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(reference(x.double(), wr, t), wr)
    for limit in (100, 4):  # 12 chunks: within the limit (bf16 sum), then past it (fp32 sum)
        monkeypatch.setattr(lce, "MAX_LOWP_DWEIGHT_CHUNKS", limit)
        made.clear()
        (got,) = torch.autograd.grad(linear_cross_entropy(x, w, t, chunk_size=5), w)
        assert made == [limit == 4] and got.dtype == torch.bfloat16
        errors[limit] = rel_error(got, want)
    assert errors[4] < errors[100] < 1e-2, errors


@pytest.mark.parametrize("reduction", [pytest.param("mean", marks=pytest.mark.slow), "none"])
def test_float16_dlogits_do_not_underflow(reduction, device):
    # A softmax probability times a small per-token gradient is below fp16's smallest subnormal (6e-8): at
    # V = 3000 and grad_output 1e-4 every non-target dlogit was 0 and dhidden's error 4.4e-2 (on the H100 the
    # same at 8192 tokens with 'mean': 1.9e-2). fp16's dlogits carry 2^11 and fp32 GEMM outputs take it back.
    g = torch.Generator(device=device).manual_seed(3)
    x = (torch.randn(256, 64, generator=g, device=device) * 0.05).half()
    w = torch.randn(3000, 64, generator=g, device=device).half().requires_grad_()
    t = torch.randint(0, 3000, (256,), generator=g, device=device)
    x.requires_grad_()
    grad = torch.full((256,), 1e-4, device=device) if reduction == "none" else torch.tensor(2e-2, device=device)
    linear_cross_entropy(x, w, t, reduction=reduction, chunk_size=100).backward(grad)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    reference(xr, wr, t, reduction=reduction).backward(grad.double())
    assert rel_error(x.grad, xr.grad) < 2e-3, rel_error(x.grad, xr.grad)
    assert rel_error(w.grad, wr.grad) < 2e-2, rel_error(w.grad, wr.grad)  # dweight ~1e-6: fp16 subnormals


def test_chunk_rows_from_the_memory_budget(monkeypatch):
    # The bench shape: 2048 rows x 128256 x 2 bytes = 501 MiB under the 512 MiB budget: 4 even chunks.
    assert lce.chunk_rows(8192, 128256, 2) == 2048
    assert lce.chunk_rows(8192, 128256, 4) == 1024
    assert lce.chunk_rows(100, 128256, 2) == 100  # fits: one chunk
    assert lce.chunk_rows(8200, 128256, 2) == 2050  # 4 even chunks (2176 aligned rows would pass the 2092-row cap)
    assert lce.chunk_rows(6000, 128256, 2) == 2048  # 3 chunks of 2000 rows, aligned up to 2048
    assert lce.chunk_rows(8192, 128256, 2, chunk_size=300) == 300
    assert lce.chunk_rows(10, 128256, 2, chunk_size=300) == 10
    monkeypatch.setattr(lce, "MAX_CHUNK_BYTES", 10 * 257 * 4)
    assert lce.chunk_rows(67, 257, 4) == 10


class _Record(TorchDispatchMode):
    """Every aten op, and the sizes of the tensors allocated by those that return new ones (mutating ops,
    out= variants included, write into tensors allocated before, views allocate nothing; Triton kernels write
    through pointers)."""

    def __init__(self):
        super().__init__()
        self.ops, self.numels = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func)
        if not func._schema.is_mutable and not func.is_view:
            for o in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(o, torch.Tensor):
                    self.numels.append(o.numel())
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_full_logits_are_never_allocated(reduction, device, monkeypatch):
    t_, h, v = 101, 8, 300
    monkeypatch.setattr(lce, "MAX_CHUNK_BYTES", 24 * v * 4)  # 24 rows a chunk by default
    x, w, t, b = _inputs(t_, h, v, device, bias=True)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    # A first call tunes the kernels on the GPU (Triton's benchmark allocates its own L2-flush buffer).
    linear_cross_entropy(x, w, t, b, reduction=reduction).sum().backward()
    x.grad = w.grad = b.grad = None
    with _Record() as rec:
        loss = linear_cross_entropy(x, w, t, b, reduction=reduction)
        loss.backward(torch.ones_like(loss))
    # The largest tensor allocated is one chunk's logits (5 chunks of 21 rows under the 24-row cap), not (T, V).
    assert lce.chunk_rows(t_, v, 4) == 21
    assert max(rec.numels) == 21 * v < t_ * v
    xr, wr, br = (a.detach().double().requires_grad_() for a in (x, w, b))
    ref = reference(xr, wr, t, br, reduction=reduction)
    ref.backward(torch.ones_like(ref))
    assert rel_error(loss, ref) < 1e-5
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert rel_error(got, want) < 1e-5


def _gemms(ops):
    return sum(op in (torch.ops.aten.mm.out, torch.ops.aten.addmm.out, torch.ops.aten.addmm_.default,
                      torch.ops.aten.mm.default, torch.ops.aten.addmm.default) for op in ops)


@pytest.mark.parametrize("grads", ["none", "hidden", "weight", "both"])
def test_gradient_gemms_run_only_when_needed(grads, device):
    x, w, t, _ = _inputs(20, 8, 64, device)
    x.requires_grad_(grads in ("hidden", "both"))
    w.requires_grad_(grads in ("weight", "both"))
    with _Record() as rec:
        loss = linear_cross_entropy(x, w, t, chunk_size=6)  # 4 chunks
    assert _gemms(rec.ops) == 4 * (1 + (grads in ("hidden", "both")) + (grads in ("weight", "both")))
    with torch.no_grad(), _Record() as rec:
        linear_cross_entropy(x, w, t, chunk_size=6)
    assert _gemms(rec.ops) == 4
    if grads != "none":
        loss.backward()
        assert (x.grad is not None) == (grads in ("hidden", "both"))
        assert (w.grad is not None) == (grads in ("weight", "both"))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_backward_is_a_scale_and_survives_retain_graph(reduction, device):
    x, w, t, b = _inputs(23, 16, 129, device, torch.bfloat16, bias=True)
    params = [a.requires_grad_() for a in (x, w, b)]
    loss = linear_cross_entropy(x, w, t, b, reduction=reduction, chunk_size=8)
    refs = [a.detach().double().requires_grad_() for a in params]
    ref = reference(refs[0], refs[1], t, refs[2], reduction=reduction)
    handed_out = []
    for g in (1.0, 2.5, -0.75):  # 1: the saved buffers as they are; then divided out into fresh buffers
        dy = torch.tensor(g, device=device)
        got = torch.autograd.grad(loss, params, dy, retain_graph=True)
        want = torch.autograd.grad(ref, refs, dy.double(), retain_graph=True)
        for a, e in zip(got, want):
            assert rel_error(a, e) < 1e-2, g
        handed_out += [(a, a.clone()) for a in got]
    for got, snapshot in handed_out:  # a later backward never rewrites a gradient handed out before
        assert torch.equal(got, snapshot)


def test_grad_output_scales_in_place_on_first_backward(device):
    x, w, t, _ = _inputs(20, 12, 70, device)
    x.requires_grad_(), w.requires_grad_()
    (linear_cross_entropy(x, w, t, chunk_size=7) * 3.0).backward()
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (reference(xr, wr, t) * 3.0).backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad.double(), wr.grad, rtol=1e-5, atol=1e-7)


def test_eager_backward_scales_the_saved_gradients_in_place(device):
    # The eager backward scales the gradients the forward computed in place: nothing gradient-sized is allocated
    # (a compiled graph is functional and multiplies them into new tensors).
    x, w, t, b = _inputs(20, 12, 70, device, bias=True)
    params = [a.requires_grad_() for a in (x, w, b)]
    loss = linear_cross_entropy(x, w, t, b, chunk_size=7)
    with _Record() as rec:
        got = torch.autograd.grad(loss * 3.0, params)
    assert max(rec.numels, default=0) <= 1, rec.numels
    refs = [a.detach().double().requires_grad_() for a in params]
    want = torch.autograd.grad(reference(*refs[:2], t, refs[2]) * 3.0, refs)
    for a, e in zip(got, want):
        assert rel_error(a, e) < 1e-5


def test_loss_is_fp32_for_bf16_inputs(device):
    x, w, t, _ = _inputs(9, 16, 90, device, torch.bfloat16)
    for red in ("mean", "sum", "none"):
        assert linear_cross_entropy(x, w, t, reduction=red).dtype == torch.float32


def test_autocast_runs_the_gemms_in_the_autocast_dtype(device):
    # bf16 activations and fp32 master weights, as under bf16 autocast: cast like F.linear, not refused.
    x, w, t, _ = _inputs(10, 16, 40, device)
    x16, w32 = x.to(torch.bfloat16).requires_grad_(), w.clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        loss = linear_cross_entropy(x16, w32, t, chunk_size=4)
    loss.backward()
    assert loss.dtype == torch.float32 and w32.grad.dtype == torch.float32 and x16.grad.dtype == torch.bfloat16
    wr = w32.detach().to(torch.bfloat16).double().requires_grad_()
    ref = reference(x16.detach().double(), wr, t)
    ref.backward()
    assert rel_error(loss, ref) < 1e-2 and rel_error(w32.grad, wr.grad) < 1e-2


def test_leading_dims_and_none_shape(device):
    x, w, t, _ = _inputs(2 * 7, 24, 101, device)
    x3, t3 = x.view(2, 7, 24), t.view(2, 7)
    _check(x3, w, t3, chunk_size=5).raise_if_failed()
    out = linear_cross_entropy(x3, w, t3, reduction="none", chunk_size=5)
    assert out.shape == (2, 7)
    _check(x3, w, t3, chunk_size=5, reduction="none").raise_if_failed()


def test_row_padded_hidden_and_int32_targets(device):
    _, w, t, _ = _inputs(23, 20, 77, device)
    big = torch.randn(23, 32, device=device)
    x = big[:, 5:25]  # row stride 32: a row-padded view
    assert not x.is_contiguous()
    _check(x, w, t.to(torch.int32), chunk_size=7, label_smoothing=0.1).raise_if_failed()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ignored_tokens_and_all_ignored(reduction, device):
    x, w, t, _ = _inputs(19, 16, 60, device, ignore_index=7)
    t[::3] = 7
    _check(x, w, t, chunk_size=6, ignore_index=7, reduction=reduction).raise_if_failed()
    # Every token ignored: 'mean' is 0/0 = NaN like torch; the gradients are zero.
    t = torch.full((19,), -100, device=device)
    x.requires_grad_(), w.requires_grad_()
    out = linear_cross_entropy(x, w, t, reduction=reduction, chunk_size=6)
    want = reference(x.detach(), w.detach(), t, reduction=reduction)
    torch.testing.assert_close(out, want, equal_nan=True)
    assert out.isnan().all() if reduction == "mean" else (out == 0).all()
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_tokens(reduction, device):
    x = torch.zeros(0, 8, device=device, requires_grad=True)
    w = torch.randn(10, 8, device=device, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long, device=device)
    with poisoned_outputs():  # buffers start as NaN: dweight must be written even though no chunk runs
        out = linear_cross_entropy(x, w, t, reduction=reduction)
        out.sum().backward()
    want = reference(x.detach(), w.detach(), t, reduction=reduction)
    assert out.shape == want.shape and torch.equal(out.isnan(), want.isnan())
    assert torch.equal(w.grad, torch.zeros_like(w))


def _bad_inputs(device):
    x, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    return [
        (dict(hidden=torch.ones(4, 8, dtype=torch.int64)), TypeError, "hidden has dtype int64"),
        (dict(hidden=x.to(torch.bfloat16)), TypeError, "hidden is bfloat16 but weight is float32"),
        (dict(weight=torch.randn(10, 7)), ValueError, "hidden's last dim is 8 but weight is"),
        (dict(weight=torch.randn(80)), ValueError, "weight must be 2-D"),
        (dict(bias=torch.randn(9)), ValueError, r"bias must have shape \(10,\)"),
        (dict(bias=torch.randn(10, dtype=torch.float64)), TypeError, "bias has dtype float64"),
        (dict(bias=torch.randn(10).to(torch.bfloat16)), TypeError, "bias is bfloat16 but weight is float32"),
        (dict(target=t.float()), TypeError, "target has dtype float32"),
        (dict(target=torch.zeros(5, dtype=torch.long)), ValueError, r"target must have shape \(4,\)"),
        (dict(target=[0, 1, 2, 3]), TypeError, "target must be a torch.Tensor"),
        (dict(target=torch.tensor([0, 1, 10, 2])), ValueError, "class index 10 outside"),
        (dict(target=torch.tensor([0, -1, 2, -100])), ValueError, "class index -1 outside"),
        (dict(label_smoothing=1.5), ValueError, "label_smoothing must be"),
        (dict(reduction="avg"), ValueError, "reduction must be one of"),
        (dict(softcap=0.0), ValueError, "softcap must be"),
        (dict(z_loss=-1.0), ValueError, "z_loss must be"),
        (dict(ignore_index=1.0), TypeError, "ignore_index must be an int"),
        (dict(chunk_size=0), ValueError, "chunk_size must be"),
        (dict(hidden=torch.randn(4, 0), weight=torch.randn(10, 0)), ValueError, r"last dim \(H, the features"),
        (dict(hidden=torch.randn(0, 0), weight=torch.randn(10, 0), target=torch.zeros(0, dtype=torch.long)),
         ValueError, "pass hidden states with H >= 1"),
        (dict(ce_weight=torch.ones(9)), ValueError, r"ce_weight must have shape \(10,\)"),
        (dict(ce_weight=torch.ones(10, dtype=torch.int64)), TypeError, "ce_weight has dtype int64"),
        (dict(ce_weight=[1.0] * 10), TypeError, "ce_weight must be a torch.Tensor"),
        (dict(ce_weight=torch.ones(10, requires_grad=True)), ValueError, "class weights get no gradient"),
    ]


@pytest.mark.parametrize("case", range(24))
def test_bad_input_names_the_argument(case, device):
    bad, exc, match = _bad_inputs(device)[case]
    args = dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 8), target=torch.zeros(4, dtype=torch.long))
    args.update(bad)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    h, w, t = args.pop("hidden"), args.pop("weight"), args.pop("target")
    if device != "cpu" and "class index" in match:
        # Documented: on the GPU an out-of-range class gives that token a NaN loss (checking costs a sync).
        assert linear_cross_entropy(h, w, t, **args).isnan().all()
        return
    with pytest.raises(exc, match=match):
        linear_cross_entropy(h, w, t, **args)


def test_out_of_range_target_on_gpu_path_gives_nan_row(device, monkeypatch):
    # What the GPU does without the CPU-only check (shared with cross_entropy): NaN for that token, nothing
    # read out of bounds, the other tokens untouched.
    monkeypatch.setattr(_validate, "target_values", lambda *a: None)
    x, w, t, _ = _inputs(7, 8, 30, device)
    t[1], t[4] = 30, -7
    got = linear_cross_entropy(x, w, t, reduction="none", chunk_size=3)
    ok = t.clone()
    ok[1] = ok[4] = 0
    want = reference(x.double(), w.double(), ok, reduction="none")
    assert got[1].isnan() and got[4].isnan()
    keep = [0, 2, 3, 5, 6]
    assert rel_error(got[keep], want[keep]) < 1e-5


def test_devices_must_match(device):
    x, w, t, _ = _inputs(4, 8, 10, device)
    other = "meta" if x.device.type == "cpu" else "cpu"
    with pytest.raises(ValueError, match=f"weight is on {other}"):
        linear_cross_entropy(x, w.to(other), t)
    with pytest.raises(ValueError, match=f"target is on {other}"):
        linear_cross_entropy(x, w, t.to(other))
    with pytest.raises(ValueError, match=f"ce_weight is on {other}"):
        linear_cross_entropy(x, w, t, ce_weight=torch.ones(10, device=other))


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="hidden is on cpu"):
        linear_cross_entropy(torch.ones(2, 8), torch.ones(3, 8), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_create_graph_raises_naming_the_op(reduction, device):
    x, w, t, _ = _inputs(9, 8, 20, device)
    x.requires_grad_(), w.requires_grad_()
    loss = linear_cross_entropy(x, w, t, reduction=reduction).sum()
    with pytest.raises(RuntimeError, match="kernelkit.linear_cross_entropy has no double backward"):
        torch.autograd.grad(loss, (x, w), create_graph=True)


def test_module(device, monkeypatch):
    x, w, t, b = _inputs(11, 16, 50, device, bias=True)
    mod = LinearCrossEntropyLoss(ignore_index=-100, label_smoothing=0.1, z_loss=1e-3, softcap=5.0, chunk_size=6)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    torch.testing.assert_close(mod(x, w, t, b), linear_cross_entropy(x, w, t, b, chunk_size=6, **kw))
    torch.testing.assert_close(mod(x, w, t, b), reference(x, w, t, b, **kw), rtol=1e-5, atol=1e-6)
    assert "softcap=5.0" in repr(mod) and not list(mod.parameters())
    with pytest.raises(ValueError, match="reduction must be one of"):
        LinearCrossEntropyLoss(reduction="avg")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU without the interpreter: the PyTorch reference
    torch.testing.assert_close(mod(x.cpu(), w.cpu(), t.cpu(), b.cpu()), reference(x, w, t, b, **kw).cpu())


def test_custom_ops_and_compile_without_graph_breaks(device):
    x, w, t, b = _inputs(13, 8, 40, device, bias=True)
    cw = torch.rand(40, device=device) + 0.5
    cases = (("mean", (True, True, True), None), ("none", (False, False, False), cw), ("sum", (False, True, False), cw))
    for dtype in (torch.float32, torch.bfloat16):  # the fake's fp32 loss and lse are told apart in bf16
        for red, need, ce_weight in cases:
            torch.library.opcheck(torch.ops.kernelkit.linear_cross_entropy.default,
                                  (*(a.to(dtype) for a in (x, w)), t, b.to(dtype), ce_weight, -100, 0.1, 1e-3, 4.0, red,
                                   6, *need), test_utils=("test_schema", "test_faketensor"))
    lse = torch.logsumexp(x @ w.t() + b, -1)
    for ce_weight in (None, cw):
        torch.library.opcheck(torch.ops.kernelkit.linear_cross_entropy_bwd.default,
                              (torch.randn(13, device=device), x, w, t, b, ce_weight, lse, -100, 0.1, 0.0, None, 6, True,
                               True, True), test_utils=("test_schema", "test_faketensor"))
    for red, ce_weight in (("mean", None), ("none", None), ("mean", cw)):
        args = [a.detach().requires_grad_() for a in (x, w)]
        out = compile_as_one_node(lambda h, ww: linear_cross_entropy(h, ww, t, b, ce_weight=ce_weight, reduction=red,
                                                                     chunk_size=6), args, "linear_cross_entropy")
        torch.testing.assert_close(out, reference(x, w, t, b, ce_weight=ce_weight, reduction=red), rtol=1e-5,
                                   atol=1e-6)


def test_compiled_gradients_match(device):
    x, w, t, _ = _inputs(11, 8, 30, device)
    cw = torch.rand(30, device=device) + 0.5
    for red, ce_weight in (("mean", None), ("none", None), ("mean", cw), ("none", cw)):
        args = [a.detach().requires_grad_() for a in (x, w)]
        f = torch.compile(lambda h, ww: linear_cross_entropy(h, ww, t, ce_weight=ce_weight, reduction=red,
                                                             chunk_size=4),
                          backend=lambda gm, _: gm.forward, fullgraph=True)
        g = torch.linspace(-1, 2, 11, device=device) if red == "none" else torch.tensor(1.5, device=device)
        f(*args).backward(g)
        refs = [a.detach().double().requires_grad_() for a in (x, w)]
        reference(*refs, t, ce_weight=ce_weight, reduction=red).backward(g.double())
        for a, r in zip(args, refs):
            assert rel_error(a.grad, r.grad) < 1e-5


def test_cost_counts_the_three_gemms():
    x, w = torch.empty(8192, 4096, dtype=torch.bfloat16), torch.empty(128256, 4096, dtype=torch.bfloat16)
    t = torch.empty(8192, dtype=torch.long)
    fwd, bwd = SPEC.cost(x, w, t), SPEC.cost(x, w, t, backward=True)
    thv = 8192 * 4096 * 128256
    assert fwd.flops == 2 * thv and fwd.flops + bwd.flops == 6 * thv
    inputs = (8192 + 128256) * 4096 * 2
    assert fwd.bytes == inputs + 8192 * 8 and bwd.bytes == 2 * inputs
    assert fwd.dtype == "bf16"


@pytest.mark.gpu
@pytest.mark.parametrize("fp32_sum", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_chunks_and_dweight_paths(reduction, fp32_sum, monkeypatch):
    # 1000 tokens in 4 chunks; the fp32 running sum goes through cuBLAS's bf16 -> fp32 addmm(out_dtype=).
    monkeypatch.setattr(lce, "MAX_LOWP_DWEIGHT_CHUNKS", 0 if fp32_sum else 100)
    x, w, t, b = _inputs(1000, 512, 32000, "cuda", torch.bfloat16, bias=True)
    _check(x, w, t, b, chunk_size=256, reduction=reduction, label_smoothing=0.1, z_loss=1e-4).raise_if_failed()


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_compile_fullgraph(reduction):
    x, w, t, _ = _inputs(512, 256, 32000, "cuda", torch.bfloat16)
    args = [x.detach().requires_grad_(), w.detach().requires_grad_()]
    f = torch.compile(lambda h, ww: linear_cross_entropy(h, ww, t, reduction=reduction).sum() * 2, fullgraph=True)
    f(*args).backward()
    refs = [a.detach().double().requires_grad_() for a in (x, w)]
    (reference(*refs, t, reduction=reduction).sum() * 2).backward()
    for a, r in zip(args, refs):
        assert rel_error(a.grad, r.grad) < 1e-2
