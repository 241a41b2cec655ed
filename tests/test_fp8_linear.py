"""fp8_linear (forward and both backward GEMMs in e4m3, rowwise scales) and kernelkit.patch(model,
precision="fp8"). Each GEMM is checked against float64 of its own quantized operands (exact up to the
output's rounding), and against float64 of the unquantized ones (fp8's own error, a few percent)."""

from __future__ import annotations

import copy

import pytest
import torch

from kernelkit.ops.fp8_linear import fp8_linear, unsupported
from kernelkit.ops.gemm.fp8 import quantize_cols_t_reference, quantize_rows_reference
from kernelkit.runtime import interpreting

needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                                   reason="kernel tests need a GPU or TRITON_INTERPRET=1")


def _deq_rows(t):
    q, s = quantize_rows_reference(t)
    return q.double() * s.double()[:, None]


def _deq_cols(t):  # the column quantization of t, back in t's layout
    q, s = quantize_cols_t_reference(t)
    return (q.double() * s.double()[:, None]).T


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_each_gemm_against_float64(device, dtype, bias):
    g = torch.Generator().manual_seed(0)
    T, K, N = 40, 48, 32  # tokens not a multiple of 16
    x = torch.randn(2, T // 2, K, generator=g).to(device, dtype).requires_grad_()
    w = (0.1 * torch.randn(N, K, generator=g)).to(device, dtype).requires_grad_()
    b = torch.randn(N, generator=g).to(device, dtype).requires_grad_() if bias else None
    y = fp8_linear(x, w, b)
    assert y.shape == (2, T // 2, N) and y.dtype == dtype
    dy = torch.randn(y.shape, generator=g).to(device, dtype)
    y.backward(dy)
    x2, dy2 = x.detach().reshape(-1, K), dy.reshape(-1, N)
    bias64 = b.detach().double() if bias else 0.0
    # against the quantized operands: only the output's rounding (and fp32 accumulation) is left
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert _rel(y.detach().reshape(-1, N), _deq_rows(x2) @ _deq_rows(w.detach()).T + bias64) < tol
    assert _rel(x.grad.reshape(-1, K), _deq_rows(dy2) @ _deq_cols(w.detach())) < tol
    assert _rel(w.grad, _deq_cols(dy2).T @ _deq_cols(x2)) < tol
    # against float64 of the unquantized operands: fp8's own error
    xd, wd, dyd = x2.double(), w.detach().double(), dy2.double()
    assert _rel(y.detach().reshape(-1, N), xd @ wd.T + bias64) < 0.06
    assert _rel(x.grad.reshape(-1, K), dyd @ wd) < 0.06
    assert _rel(w.grad, dyd.T @ xd) < 0.06
    if bias:
        assert _rel(b.grad, dyd.sum(0)) < 1e-2


def test_what_fp8_cannot_take():
    w = torch.zeros(32, 48, dtype=torch.bfloat16)
    assert "float32" in unsupported(torch.zeros(2, 48), w.float())
    assert "multiples of 16" in unsupported(torch.zeros(2, 40, dtype=torch.bfloat16), torch.zeros(32, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="features"):
        fp8_linear(torch.zeros(2, 40, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="bias must be"):
        fp8_linear(torch.zeros(2, 48, dtype=torch.bfloat16), w, torch.zeros(31, dtype=torch.bfloat16))


@needs_kernels
def test_patch_precision_fp8_trains_close_to_bf16(device):
    pytest.importorskip("transformers")
    from kernelkit.patch import patch
    from tests.test_patch import batch, tiny_model

    model = tiny_model("llama", dtype=torch.bfloat16, device=device, layers=1)
    ref = copy.deepcopy(model)
    report = patch(model, precision="fp8", rms_norm=False, mlp=False, rope=False, attention=False,
                   cross_entropy=False)
    assert report.count("fp8") == 7  # q, k, v, o, gate, up, down
    model.train(), ref.train()
    ids, labels = (t.to(device) for t in batch())
    got, want = model(ids, labels=labels).loss, ref(ids, labels=labels).loss
    got.backward(), want.backward()
    assert abs(got.item() - want.item()) < 0.03 * abs(want.item())
    w, w_ref = model.model.layers[0].mlp.down_proj.weight.grad, ref.model.layers[0].mlp.down_proj.weight.grad
    assert _rel(w, w_ref.double()) < 0.2  # fp8 error compounds through the layer (each GEMM alone: above)
    assert report.fallback_count("fp8") == 0
    assert model.lm_head.forward.__func__ is torch.nn.Linear.forward  # the LM head stays in bf16


@needs_kernels
def test_patch_fp8_keeps_layers_it_cannot_take(device):
    pytest.importorskip("transformers")
    from kernelkit.patch import patch
    from tests.test_patch import batch, tiny_model

    model = tiny_model("llama", dtype=torch.bfloat16, device=device, layers=1, intermediate_size=72)
    report = patch(model, precision="fp8", rms_norm=False, mlp=False, rope=False, attention=False,
                   cross_entropy=False)
    model(batch()[0].to(device))
    reasons = [r for (k, r) in report.fallbacks if k == "fp8"]
    assert reasons == ["in/out features 64/72 are not multiples of 16", "in/out features 72/64 are not multiples of 16"] \
        or sorted(reasons) == sorted(["in/out features 64/72 are not multiples of 16",
                                      "in/out features 72/64 are not multiples of 16"])


def test_bad_precision_is_refused():
    pytest.importorskip("transformers")
    from kernelkit.patch import patch
    from tests.test_patch import tiny_model

    with pytest.raises(ValueError, match=r"precision='fp4' is not one of 'bf16', 'fp8'"):
        patch(tiny_model("llama", layers=1), precision="fp4")


@needs_kernels
def test_quantized_weights_are_kept_until_the_weight_changes(device, monkeypatch):
    """With a QuantizedWeight the weight is quantized once per change, not per call (gradient accumulation),
    and the results equal the uncached path's; an in-place write (an optimizer step) invalidates the copies."""
    import kernelkit.ops.fp8_linear as mod

    calls = {"rows": 0, "cols": 0}
    rows, cols = mod.quantize_rows, mod.quantize_cols_t

    def counting(kind, fn):
        def wrapped(t):
            if t.shape == (32, 48):
                calls[kind] += 1
            return fn(t)
        return wrapped

    monkeypatch.setattr(mod, "quantize_rows", counting("rows", rows))
    monkeypatch.setattr(mod, "quantize_cols_t", counting("cols", cols))
    g = torch.Generator().manual_seed(1)
    w = (0.1 * torch.randn(32, 48, generator=g)).to(device, torch.bfloat16).requires_grad_()
    xs = [torch.randn(16, 48, generator=g).to(device, torch.bfloat16) for _ in range(3)]
    cache = mod.QuantizedWeight()
    kept = [fp8_linear(x.requires_grad_(), w, cache=cache) for x in xs]
    for y in kept:
        y.sum().backward()
    assert calls == {"rows": 1, "cols": 1}  # three micro-batches, one quantization of each kind
    grad_kept = w.grad.clone()
    w.grad = None
    for x in xs:
        fp8_linear(x, w).sum().backward()
    assert torch.equal(w.grad, grad_kept)  # the kept copies are the ones a fresh quantization gives
    with torch.no_grad():
        w.mul_(1.5)  # an optimizer step
    before = dict(calls)
    y_after = fp8_linear(xs[0], w, cache=cache)
    assert calls["rows"] == before["rows"] + 1
    assert torch.equal(y_after, fp8_linear(xs[0], w))
    with pytest.raises(TypeError, match="QuantizedWeight"):
        fp8_linear(xs[0], w, cache={})


def test_bench_model_precision_fp8_puts_fp8_rows_next_to_bf16():
    from kernelkit.testing.model_bench import VARIANTS, fp8_variants

    got = fp8_variants(("eager", "kernelkit", "kernelkit+compile"))
    assert got == ("eager", "kernelkit", "kernelkit-fp8", "torchao-fp8", "kernelkit+compile", "kernelkit-fp8+compile",
                   "torchao-fp8+compile")
    assert set(got) <= set(VARIANTS)
    assert fp8_variants(("kernelkit", "kernelkit-fp8")) == ("kernelkit", "kernelkit-fp8", "torchao-fp8")


# --- the LM head in fp8: linear_cross_entropy(precision="fp8") and patch(precision="fp8", fp8_lm_head=...) ---

@needs_kernels
@pytest.mark.parametrize("dtype,reduction,split", [(torch.bfloat16, "mean", False), (torch.float16, "sum", False),
                                                   (torch.bfloat16, "mean", True)])
def test_fp8_lm_head_against_float64_of_its_quantized_operands(dtype, reduction, split, device, monkeypatch):
    from kernelkit.ops import linear_cross_entropy as lce
    from kernelkit.ops.linear_cross_entropy import linear_cross_entropy

    if split:  # each chunk's dlogits quantized and multiplied in FP8_DH_SPLIT parts (at 16-row chunks: 8 + 8)
        monkeypatch.setattr(lce, "ROW_ALIGN", 4)

    g = torch.Generator().manual_seed(3)
    t, h, v = 40, 32, 272  # chunks of 16: two full and a tail of 8
    x = torch.randn(t, h, generator=g).to(dtype).to(device).requires_grad_()
    w = (0.2 * torch.randn(v, h, generator=g)).to(dtype).to(device).requires_grad_()
    b = (0.3 * torch.randn(v, generator=g)).to(dtype).to(device).requires_grad_()
    tgt = torch.randint(0, v, (t,), generator=g).to(device)
    tgt[5] = -100
    loss = linear_cross_entropy(x, w, tgt, b, reduction=reduction, chunk_size=16, precision="fp8")
    loss.backward()
    # float64 of the quantized operands, rounded where the kernels round: logits and dlogits to dtype
    logits = (_deq_rows(x.detach()) @ _deq_rows(w.detach()).T + b.detach().double()).to(dtype).double()
    keep = tgt != -100
    lp = logits.log_softmax(-1)
    want = -lp[keep, tgt[keep]].sum() / (keep.sum() if reduction == "mean" else 1)
    dl = lp.exp()
    dl[keep, tgt[keep]] -= 1
    dl[~keep] = 0
    dl = (dl / (keep.sum() if reduction == "mean" else 1)).to(dtype)
    dh = _deq_rows(dl) @ _deq_cols(w.detach())
    dw = dl.double().T @ x.detach().double()
    assert abs(loss.item() - want.item()) < 2e-3 * abs(want.item())
    assert _rel(x.grad, dh) < 1.5e-2
    assert _rel(w.grad, dw) < 1.5e-2
    assert _rel(b.grad, dl.double().sum(0)) < 1e-2
    # and fp8's own error against the unquantized float64 loss: a few percent at most
    exact = torch.nn.functional.cross_entropy(x.detach().double() @ w.detach().double().T + b.detach().double(),
                                              tgt, reduction=reduction)
    assert abs(loss.item() - exact.item()) < 0.02 * abs(exact.item())


@needs_kernels
@pytest.mark.parametrize("dtype,weighted", [(torch.bfloat16, False), (torch.float16, True)])
def test_fp8_lm_head_dlogits_quantized_by_the_cross_entropy_kernel(dtype, weighted, device, monkeypatch):
    """The e4m3 dlogits rows and scales the cross-entropy kernel writes (KERNELKIT_FP8_CE_FUSE) against float64 of
    the same logits: each row's scale is its amax / 448 (rounded to the dtype), so the target's entry maps to
    ~448; an ignored row is all zeros with the smallest-normal scale; a NaN row stays NaN. And the unfused path
    (quantize_rows on the bf16 dlogits) is what runs with the switch off, or with label smoothing."""
    from kernelkit.ops import linear_cross_entropy as lce

    got, logits_seen = [], []
    add, ce = lce._Grads.add_dhidden_fp8, lce._ce_forward

    def spy_add(self, dq, ds, start):
        got.append((start, dq.float().cpu(), ds.cpu()))
        return add(self, dq, ds, start)

    def spy_ce(logits, *args, **kw):  # the logits each launch reads, before it overwrites them with dlogits
        logits_seen.append(logits.detach().double().cpu())
        return ce(logits, *args, **kw)

    monkeypatch.setattr(lce._Grads, "add_dhidden_fp8", spy_add)
    monkeypatch.setattr(lce, "_ce_forward", spy_ce)
    monkeypatch.setattr(lce, "ROW_ALIGN", 4)  # 16-row chunks in two parts of 8
    g = torch.Generator().manual_seed(5)
    t, h, v = 37, 32, 400
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    x[3] *= 8  # a near-certain row: its amax (1 - p_t) is small, and must stay exact
    w = (0.3 * torch.randn(v, h, generator=g)).to(dtype).to(device)
    tgt = torch.randint(0, v, (t,), generator=g).to(device)
    tgt[3] = (x[3].float() @ w.float().T).argmax()
    tgt[5] = -100
    cw = (0.5 + torch.rand(v, generator=g)).to(device) if weighted else None
    x[11] = float("nan")
    count = (tgt != -100).sum().item() if not weighted else cw[tgt[tgt != -100]].sum().item()
    lce.linear_cross_entropy_fwd(x, w, tgt, None, cw, -100, 0.0, 0.0, None, "mean", 16, True, True, False,
                                 fp8=True)
    assert len(got) == len(logits_seen) == 5  # three chunks (16, 16, 5 rows): two parts of 8, two, one (under 2 x 4)
    tiny = torch.finfo(dtype).tiny
    for (start, q, s), lg in zip(got, logits_seen):
        rows = torch.arange(start, start + q.shape[0])
        ref = lg.softmax(-1)
        tr = tgt[rows].cpu()
        ok = tr != -100
        ref[ok, tr[ok]] -= 1
        ref[~ok] = 0
        f = cw.cpu()[tr.clamp_min(0)].double() if weighted else 1.0
        # fp16's dlogits carry 2^11 instead of 1 / count (FP16_GRAD_SCALE; the count is applied after the GEMMs)
        f = f * (lce.FP16_GRAD_SCALE if dtype == torch.float16 else 1.0 / count)
        ref = ref * (f[:, None] if weighted else f)
        amax = ref.abs().amax(-1)
        for i, r in enumerate(rows.tolist()):
            if r == 11:
                assert torch.isnan(s[i]).item()
            elif not ok[i]:
                assert s[i].item() == tiny and (q[i] == 0).all()
            else:
                want = torch.tensor(max(amax[i].item() / 448, tiny)).to(dtype).double().item()
                assert abs(s[i].item() - want) <= 1e-2 * want, (r, s[i].item(), want)
                assert 440 <= q[i].abs().max().item() <= 448
                deq = q[i].double() * s[i].double()
                assert ((deq - ref[i]).norm() / ref[i].norm()).item() < 0.04
    # the unfused path: with the switch off, and with label smoothing (its amax is not known up front)
    for env, smoothing in (("0", 0.0), ("1", 0.1)):
        monkeypatch.setenv("KERNELKIT_FP8_CE_FUSE", env)
        got.clear()
        logits_seen.clear()
        lce.linear_cross_entropy_fwd(x, w, tgt, None, cw, -100, smoothing, 0.0, None, "mean", 16, True, True, False,
                                     fp8=True)
        assert len(got) == 5 and len(logits_seen) == 3  # one launch a chunk, then quantize_rows part by part


def test_fp8_lm_head_refuses_what_it_cannot_take():
    from kernelkit.ops.linear_cross_entropy import fp8_unsupported, linear_cross_entropy

    bf = dict(dtype=torch.bfloat16)
    x, w, t = torch.zeros(4, 32, **bf), torch.zeros(48, 32, **bf), torch.zeros(4, dtype=torch.long)
    assert "float32" in fp8_unsupported(x.float(), w.float(), "mean")
    assert "multiples of 16" in fp8_unsupported(torch.zeros(4, 40, **bf), torch.zeros(48, 40, **bf), "mean")
    assert "reduction='none'" in fp8_unsupported(x, w, "none")
    with pytest.raises(ValueError, match="precision='fp16' is not one of 'bf16', 'fp8'"):
        linear_cross_entropy(x, w, t, precision="fp16")
    if interpreting():
        with pytest.raises(ValueError, match="precision='fp8' cannot take this call: reduction='none'"):
            linear_cross_entropy(x, w, t, reduction="none", precision="fp8")


@needs_kernels
@pytest.mark.parametrize("lm_head", [True, False])
def test_patch_fp8_runs_the_lm_head_in_fp8_unless_told_not_to(lm_head, device, monkeypatch):
    pytest.importorskip("transformers")
    import kernelkit.ops.linear_cross_entropy as lce
    from kernelkit.patch import patch
    from tests.test_patch import batch, tiny_model

    calls = []
    real = lce._fp8_gemm
    monkeypatch.setattr(lce, "_fp8_gemm", lambda *a: calls.append(a[0].shape) or real(*a))
    model = tiny_model("llama", dtype=torch.bfloat16, device=device, layers=1)
    ref = copy.deepcopy(model)
    report = patch(model, precision="fp8", fp8_lm_head=lm_head, rms_norm=False, mlp=False, rope=False,
                   attention=False, cross_entropy="kernelkit")
    model.train(), ref.train()
    ids, labels = (t.to(device) for t in batch())
    got, want = model(ids, labels=labels).loss, ref(ids, labels=labels).loss
    got.backward(), want.backward()
    assert abs(got.item() - want.item()) < 0.03 * abs(want.item())
    assert _rel(model.lm_head.weight.grad, ref.lm_head.weight.grad.double()) < 0.2  # fp8 layers below it too
    assert bool(calls) == lm_head  # the logits and dhidden GEMMs went through the fp8 GEMM, or none did
    assert ("dhidden GEMMs run in fp8" in str(report.notes)) == lm_head
    with pytest.raises(ValueError, match="fp8_lm_head"):
        patch(tiny_model("llama", layers=1), precision="fp8", fp8_lm_head="yes")
