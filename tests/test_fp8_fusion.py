"""The fp8 Linears' input quantization, done once: `rms_norm_fp8` (RMSNorm writing its output's e4m3 rows in the same
pass, bit for bit `quantize_rows` of its output), `SharedInputs` (Linears reading one tensor share its rows and
columns; the invalidation rules), and kernelkit.patch(precision="fp8") with and without them (KERNELKIT_FP8_FUSE):
the same loss and gradients, bit for bit, with fewer quantizations."""

from __future__ import annotations

import copy
import gc
import sys
import weakref

import pytest
import torch

from kernelkit.ops import fp8_linear as F8
from kernelkit.ops import glu as GLU
from kernelkit.ops import rms_norm as RN
from kernelkit.ops.fp8_linear import SharedInputs, fp8_linear
from kernelkit.ops.gemm.fp8 import quantize_rows_reference
from kernelkit.runtime.alloc import poisoned_outputs


def _same_fp8(q, s, qr, sr):
    """(q, s) and (qr, sr) bit for bit: the scales (NaN where NaN), the e4m3 bytes (NaN where NaN)."""
    torch.testing.assert_close(s, sr, rtol=0, atol=0, equal_nan=True)
    nan = torch.isnan(qr.float())
    assert torch.equal(torch.isnan(q.float()), nan)
    assert torch.equal(q.view(torch.uint8)[~nan], qr.view(torch.uint8)[~nan])


def _same_rows(q, s, t):
    """q, s are quantize_rows(t) bit for bit (its definition)."""
    assert q.shape == t.shape and q.dtype == torch.float8_e4m3fn and s.shape == t.shape[:-1]
    _same_fp8(q, s, *quantize_rows_reference(t))


def _inputs(shape, dtype, layout):
    """x of `shape` with a zero row and a NaN row, as given (`contiguous`), a row-strided offset view into a larger
    buffer (`offset`), or with its rows scattered (`transposed`: non-unit last stride, copied by the launcher)."""
    n = shape[-1]
    x = (torch.randn(shape) * 30).to(dtype)
    rows = x.view(-1, n)
    rows[0] = 0
    if rows.shape[0] > 2:
        rows[rows.shape[0] // 2, n // 2] = float("nan")
    if layout == "offset":
        buf = torch.full((rows.shape[0] + 1, n + 5), float("nan"), dtype=dtype)
        buf[1:, 3:3 + n] = rows
        return buf[1:, 3:3 + n].view(*shape) if len(shape) == 2 else buf[1:, 3:3 + n].reshape(shape)
    if layout == "transposed":
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (3, 7), (37, 1000), (2, 3, 129), (5, 4097)])
@pytest.mark.parametrize("layout", ["contiguous", "offset", "transposed"])
def test_rms_norm_fp8_rows_are_quantize_rows_of_its_output(device, dtype, shape, layout):
    if layout != "contiguous" and (shape[-1] > 1000 or shape[0] > 5 or dtype == torch.float16):
        pytest.skip("layouts: the short rows in bf16 and fp32 are enough")
    if shape == (37, 1000) and dtype != torch.bfloat16:
        pytest.skip("the many-row tile: bf16 is enough (the interpreter is slow)")
    x = _inputs(shape, dtype, layout).to(device)
    w = (1.0 + 0.3 * torch.randn(shape[-1])).to(dtype).to(device)
    with poisoned_outputs():
        y, q, s = RN.rms_norm_fp8(x, w, 1e-5)
    torch.testing.assert_close(y, RN.rms_norm(x, w, 1e-5), rtol=0, atol=0, equal_nan=True)  # y as rms_norm's
    _same_rows(q, s, y)


def test_rms_norm_fp8_past_one_program_quantizes_separately(device, monkeypatch):
    # Rows wider than MAX_FUSED_N take the looped norm, then quantize_rows: the same contract.
    monkeypatch.setattr(RN, "MAX_FUSED_N", 64)
    monkeypatch.setattr(RN, "LOOP_BLOCK_N", 32)
    x = _inputs((5, 129), torch.bfloat16, "contiguous").to(device)
    y, q, s = RN.rms_norm_fp8(x, None, 1e-6, 1.0)
    _same_rows(q, s, y)
    y0, q0, s0 = RN.rms_norm_fp8(x[:0], None)
    assert y0.shape == q0.shape == (0, 129) and s0.shape == (0,)


def test_rms_norm_fp8_backward_is_rms_norms(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 48, generator=g).to(device, torch.bfloat16)
    w = (1.0 + 0.1 * torch.randn(48, generator=g)).to(device, torch.bfloat16)
    dy = torch.randn(2, 5, 48, generator=g).to(device, torch.bfloat16)
    grads = []
    for fn in (lambda a, b: RN.rms_norm_fp8(a, b)[0], RN.rms_norm):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        y, = [fn(a, b)]
        y.backward(dy)
        grads.append((y.detach(), a.grad, b.grad))
    for got, want in zip(*grads):
        assert torch.equal(got, want)
    a = x.clone().requires_grad_()
    y, q, s = RN.rms_norm_fp8(a, w)
    assert y.requires_grad and not q.requires_grad and not s.requires_grad


# --- swiglu_fp8: SwiGLU writing its output's fp8 rows (the down projection's operand) ---

def _gate_up(shape, dtype, layout, seed=0):
    """(gate, up) with a zero row and a NaN, as two tensors (`separate`), one (..., 2H) tensor (`fused`, up None),
    or two row-strided offset views into a NaN-filled buffer (`offset`)."""
    g = torch.Generator().manual_seed(seed)
    gate, up = ((torch.randn(shape, generator=g) * 4).to(dtype) for _ in range(2))
    gate.view(-1, shape[-1])[0] = 0
    if gate.numel() // shape[-1] > 2:
        up.view(-1, shape[-1])[1, shape[-1] // 2] = float("nan")
    if layout == "fused":
        return torch.cat([gate, up], dim=-1), None
    if layout == "offset":
        n, rows = shape[-1], gate.numel() // shape[-1]
        buf = torch.full((rows, 2 * n + 7), float("nan"), dtype=dtype)
        buf[:, 1:1 + n], buf[:, 2 + n:2 + 2 * n] = gate.reshape(rows, n), up.reshape(rows, n)
        return buf[:, 1:1 + n].reshape(shape), buf[:, 2 + n:2 + 2 * n].reshape(shape)
    return gate, up


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (3, 7), (37, 1000), (2, 3, 129)])
@pytest.mark.parametrize("layout", ["separate", "fused", "offset"])
def test_swiglu_fp8_rows_are_quantize_rows_of_its_output(device, dtype, shape, layout):
    if layout != "separate" and (shape[-1] > 200 or dtype == torch.float16):
        pytest.skip("layouts: the short rows in bf16 and fp32 are enough")
    if shape == (37, 1000) and dtype != torch.bfloat16:
        pytest.skip("the many-row case: bf16 is enough (the interpreter is slow)")
    gate, up = (t.to(device) if t is not None else None for t in _gate_up(shape, dtype, layout))
    with poisoned_outputs():
        h, q, s = GLU.swiglu_fp8(gate, up)
    torch.testing.assert_close(h, GLU.swiglu(gate, up), rtol=0, atol=0, equal_nan=True)  # h as swiglu's
    assert h.shape == (*shape[:-1], shape[-1])
    _same_rows(q, s, h)


def test_swiglu_fp8_past_one_program_quantizes_separately(device, monkeypatch):
    monkeypatch.setattr(GLU, "FP8_MAX_N", 64)
    gate, up = (t.to(device) for t in _gate_up((5, 129), torch.bfloat16, "separate"))
    h, q, s = GLU.swiglu_fp8(gate, up)
    torch.testing.assert_close(h, GLU.swiglu(gate, up), rtol=0, atol=0, equal_nan=True)
    _same_rows(q, s, h)
    h0, q0, s0 = GLU.swiglu_fp8(gate[:0], up[:0])
    assert h0.shape == q0.shape == (0, 129) and s0.shape == (0,)
    with pytest.raises(ValueError, match="up must have gate's shape"):
        GLU.swiglu_fp8(gate, up[:, :128])


def test_swiglu_fp8_backward_is_swiglus(device):
    g = torch.Generator().manual_seed(3)
    gate, up, dh = (torch.randn(2, 5, 48, generator=g).to(device, torch.bfloat16) for _ in range(3))
    grads = []
    for fn in (lambda a, b: GLU.swiglu_fp8(a, b)[0], GLU.swiglu):
        a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
        h = fn(a, b)
        h.backward(dh)
        grads.append((h.detach(), a.grad, b.grad))
    for got, want in zip(*grads):
        assert torch.equal(got, want)
    h, q, s = GLU.swiglu_fp8(gate.clone().requires_grad_(), up)
    assert h.requires_grad and not q.requires_grad and not s.requires_grad


def test_swiglu_fp8_compiles_for_sm90(device):
    from tests.conftest import INTERPRET
    from kernelkit.testing import compile_check

    if not INTERPRET:
        pytest.skip("records launches through the Triton interpreter")
    records = []
    with compile_check.record_launches(records):
        for dtype, n in ((torch.bfloat16, 8192), (torch.bfloat16, 14336), (torch.float16, 100)):
            GLU.swiglu_fp8(torch.randn(2, n).to(dtype), torch.randn(2, n).to(dtype))
    records = [r for r in compile_check.unique(records) if r["kernel"].endswith("swiglu_fp8_kernel")]
    assert len(records) == 3
    assert not compile_check.compile_in_subprocess(records)


# --- SharedInputs: one tensor read by several fp8 Linears ---

@pytest.fixture
def counted(monkeypatch):
    """quantize_rows / quantize_cols_t calls on activations (T = 12 rows; the weights have 32 or 48)."""
    calls = {"rows": 0, "cols": 0}
    for name, kind in (("quantize_rows", "rows"), ("quantize_cols_t", "cols")):
        real = getattr(F8, name)

        def wrapped(t, real=real, kind=kind):
            calls[kind] += t.shape[0] == 12
            return real(t)

        monkeypatch.setattr(F8, name, wrapped)
    _count_both(monkeypatch, calls, lambda t: t.shape[0] == 12)
    return calls


def _count_both(monkeypatch, calls, counts):
    """quantize_rows_and_cols_t (dy both ways from two reads) counts as one of each."""
    real = F8.quantize_rows_and_cols_t

    def both(t):
        calls["rows"] += counts(t)
        calls["cols"] += counts(t)
        return real(t)

    monkeypatch.setattr(F8, "quantize_rows_and_cols_t", both)


def _linears(device, n_out=(32, 48, 32)):
    g = torch.Generator().manual_seed(2)
    return [(0.1 * torch.randn(n, 48, generator=g)).to(device, torch.bfloat16).requires_grad_() for n in n_out]


def _run(x, ws, shared, dys):
    ys = [fp8_linear(x, w, None, None, shared) for w in ws]
    torch.autograd.backward(ys, dys)
    return [y.detach() for y in ys]


def test_three_readers_quantize_once_and_compute_what_each_alone_does(device, counted):
    ws = _linears(device)
    x = torch.randn(12, 48).to(device, torch.bfloat16).requires_grad_()
    dys = [torch.randn(12, w.shape[0]).to(device, torch.bfloat16) for w in ws]
    want = _run(x, ws, None, dys)
    want_grads = [x.grad.clone()] + [w.grad.clone() for w in ws]
    assert counted == {"rows": 3 + 3, "cols": 3 + 3}  # x and dy per Linear, each way
    x.grad = None
    for w in ws:
        w.grad = None
    counted.update(rows=0, cols=0)
    shared = SharedInputs()
    got = _run(x, ws, shared, dys)
    assert counted == {"rows": 1 + 3, "cols": 1 + 3}  # x once; dy per Linear
    for a, b in zip(got + [x.grad] + [w.grad for w in ws], want + want_grads):
        assert torch.equal(a, b)
    assert shared._kept is None  # the backward dropped the last input


def test_one_reader_keeps_nothing_past_its_backward(device, counted):
    w, = _linears(device, (32,))
    x = torch.randn(12, 48).to(device, torch.bfloat16).requires_grad_()
    shared = SharedInputs()
    y = fp8_linear(x, w, None, None, shared)
    entry = shared._kept[2]
    assert entry.rows is not None and entry.readers == 1
    y.backward(torch.ones_like(y))
    assert shared._kept is None and entry.rows is None and entry.cols is None
    assert counted == {"rows": 2, "cols": 2}
    want = torch.empty_like(w.grad).copy_(w.grad)
    w.grad = None
    fp8_linear(x, w).backward(torch.ones_like(y))
    assert torch.equal(w.grad, want)


def test_an_in_place_write_between_readers_quantizes_again(device, counted):
    ws = _linears(device, (32, 32))
    x = torch.randn(12, 48).to(device, torch.bfloat16)
    shared = SharedInputs()
    with torch.no_grad():
        fp8_linear(x, ws[0], None, None, shared)
        x.mul_(2.0)  # moves the version counter
        got = fp8_linear(x, ws[1], None, None, shared)
    assert counted["rows"] == 2
    assert torch.equal(got, fp8_linear(x, ws[1]))


def test_views_hit_only_where_they_read_the_same_bytes(device, counted):
    w, = _linears(device, (32,))
    buf = torch.randn(13, 48).to(device, torch.bfloat16)
    shared = SharedInputs()
    with torch.no_grad():
        first = buf[:12]  # kept while this view lives (held weakly)
        fp8_linear(first, w, None, None, shared)
        fp8_linear(buf.narrow(0, 0, 12), w, None, None, shared)  # the same bytes, another view object: a hit
        assert counted["rows"] == 1
        fp8_linear(buf[:12].view(3, 4, 48), w, None, None, shared)  # a (3, 4, 48) view: a key of its own
        assert counted["rows"] == 2
        got = fp8_linear(buf[1:], w, None, None, shared)  # offset by a row: a miss
        assert counted["rows"] == 3
        assert torch.equal(got, fp8_linear(buf[1:], w))


def test_the_kept_rows_die_with_their_input_and_its_storage_is_a_miss(device, counted):
    # The kept tensor is held weakly: once its readers drop it, its fp8 rows are freed with it (no fp8 copy outlives
    # the activation), and a new tensor on the same storage address quantizes afresh instead of taking stale rows.
    w, = _linears(device, (32,))
    shared = SharedInputs()
    x = torch.randn(12, 48).to(device, torch.bfloat16)
    ref = weakref.ref(x)
    with torch.no_grad():
        want_old = fp8_linear(x, w, None, None, shared)
    entry = shared._kept[2]
    assert entry.rows is not None
    del x
    gc.collect()
    assert ref() is None and shared._kept is None and entry.rows is None
    for _ in range(8):  # the caching allocator (CUDA) or malloc (CPU) hands the freed block out again, mostly
        fresh = torch.randn(12, 48).to(device, torch.bfloat16)
        with torch.no_grad():
            got = fp8_linear(fresh, w, None, None, shared)
        assert torch.equal(got, fp8_linear(fresh, w)) and not torch.equal(got, want_old)
    assert counted["rows"] == 1 + 8 * 2


def test_a_kept_input_read_again_while_alive_is_a_hit(device, counted):
    w, = _linears(device, (32,))
    shared = SharedInputs()
    x = torch.randn(12, 48).to(device, torch.bfloat16)
    with torch.no_grad():
        fp8_linear(x, w, None, None, shared)
        gc.collect()
        fp8_linear(x, w, None, None, shared)
    assert counted["rows"] == 1


def test_bypassed_under_compile_and_for_inference_tensors(device, monkeypatch):
    shared = SharedInputs()
    with torch.inference_mode():
        x = torch.randn(12, 48).to(device, torch.bfloat16)
        assert shared.entry(x) is None
    y = torch.randn(12, 48).to(device, torch.bfloat16)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert shared.entry(y) is None
    shared.offer(y, *quantize_rows_reference(y))
    assert shared._kept is None
    with pytest.raises(TypeError, match="SharedInputs"):
        fp8_linear(y, _linears(device, (32,))[0], shared={})


def test_a_kept_graph_backs_up_twice(device):
    ws = _linears(device, (32, 32))
    x = torch.randn(12, 48).to(device, torch.bfloat16).requires_grad_()
    shared = SharedInputs()
    ys = [fp8_linear(x, w, None, None, shared) for w in ws]
    loss = sum(y.float().square().sum() for y in ys)
    first = torch.autograd.grad(loss, ws, retain_graph=True)
    second = torch.autograd.grad(loss, ws)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert copy.deepcopy(shared)._kept is None


# --- kernelkit.patch(model, precision="fp8") with and without the sharing and the norm's fp8 rows ---

def _patched_step(monkeypatch, device, fuse: str, family="llama"):
    from kernelkit.patch import patch
    from tests.test_patch import batch, tiny_model

    modules = sys.modules["kernelkit.patch.modules"]
    monkeypatch.setenv("KERNELKIT_FP8_FUSE", fuse)
    monkeypatch.setenv("KERNELKIT_PATCH_CHOICE", "kernelkit")  # the undo below drops conftest's setting too
    calls = {"rows": 0, "cols": 0, "norm_fp8": 0, "swiglu_fp8": 0}
    for mod, name, kind in ((F8, "quantize_rows", "rows"), (F8, "quantize_cols_t", "cols"),
                            (modules, "rms_norm_fp8", "norm_fp8"), (modules.glu, "swiglu_fp8", "swiglu_fp8")):
        real = getattr(mod, name)

        def wrapped(t, *a, real=real, kind=kind, **k):
            calls[kind] += kind.endswith("_fp8") or t.shape[0] == 16  # activations and gradients: 2 x 8 tokens
            return real(t, *a, **k)

        monkeypatch.setattr(mod, name, wrapped)
    _count_both(monkeypatch, calls, lambda t: t.shape[0] == 16)
    model = tiny_model(family, dtype=torch.bfloat16, device=device, layers=1)
    report = patch(model, precision="fp8", rms_norm="kernelkit", mlp="kernelkit", rope=False, attention=False,
                   cross_entropy=False)
    model.train()
    ids, labels = (t.to(device) for t in batch())
    loss = model(ids, labels=labels).loss
    loss.backward()
    monkeypatch.undo()  # a second call would count into this one's dict through its wrappers
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, calls, report, model


@pytest.mark.slow  # 32 s in the interpreter (CI budget); the GPU suite and `-m slow` run it
def test_patched_model_same_loss_and_grads_with_fewer_quantizations(device, monkeypatch):
    pytest.importorskip("transformers")
    loss, grads, calls, report, model = _patched_step(monkeypatch, device, "1")
    loss0, grads0, calls0, report0, _ = _patched_step(monkeypatch, device, "0")
    if device == "cpu":  # the interpreter: one config per kernel, so the norm's y is the same bits fused or not
        assert torch.equal(loss, loss0)
        assert all(torch.equal(grads[n], grads0[n]) for n in grads0)
    else:  # the fused norm is tuned apart: its y may differ in the last bit, moving a few fp8 values
        assert abs(loss.item() - loss0.item()) <= 1e-3 * abs(loss0.item())
        assert all((grads[n] - grads0[n]).float().norm() <= 2e-2 * grads0[n].float().norm() + 1e-6 for n in grads0)
    # per layer: 7 Linears. Unfused, each quantizes its x and dy rows, and its dy and x columns.
    assert calls0 == {"rows": 14, "cols": 14, "norm_fp8": 0, "swiglu_fp8": 0}
    # fused: the two norms write q/k/v's and gate/up's rows, the SwiGLU down's; o quantizes its own. x columns: one
    # per input.
    assert calls == {"rows": 7 + 1, "cols": 7 + 4, "norm_fp8": 2, "swiglu_fp8": 1}
    layer = model.model.layers[0]
    assert layer.input_layernorm._kernelkit.fp8_read and layer.post_attention_layernorm._kernelkit.fp8_read
    assert layer.mlp._kernelkit.fp8_read
    assert "quantize it once" in str(report.notes) and "KERNELKIT_FP8_FUSE=0" in str(report0.notes)
    assert model.model.norm._kernelkit.fp8_shared is None  # the final norm feeds the LM head, not the layers'


@pytest.mark.slow  # 23 s in the interpreter (CI budget); the GPU suite and `-m slow` run it
def test_norms_that_feed_no_linear_stop_writing_fp8(device, monkeypatch):
    # Qwen3's q_norm / k_norm (per head, after q and k) write rows on their first call that no Linear reads: they
    # stop; the norm before q/k/v keeps writing.
    pytest.importorskip("transformers")
    _, _, calls, _, model = _patched_step(monkeypatch, device, "1", "qwen3")
    layer = model.model.layers[0]
    assert calls["norm_fp8"] == 4
    assert layer.self_attn.q_norm._kernelkit.fp8_read is False and layer.self_attn.k_norm._kernelkit.fp8_read is False
    assert layer.input_layernorm._kernelkit.fp8_read


@pytest.mark.slow  # 31 s in the interpreter (CI budget); the GPU suite and `-m slow` run it
def test_trials_do_not_disturb_the_sharing(device, monkeypatch):
    """With measured choices, the first call at a shape runs a trial (the MLP's runs its fp8 Linears on random
    inputs): the trial's calls must not replace the norm's kept rows."""
    pytest.importorskip("transformers")
    from kernelkit.patch import choose

    ran = []

    def measure(trial):  # run both paths once, then say kernelkit won
        ran.append(trial)
        choose._run(trial.kernelkit, trial.wrt, {}, "kernelkit")
        return 1.0, 2.0

    choose.forget()
    monkeypatch.setattr(choose, "_file", lambda: None)
    monkeypatch.setattr(choose, "can_measure", lambda: True)
    monkeypatch.setattr(choose, "measure", measure)
    monkeypatch.setenv("KERNELKIT_PATCH_CHOICE", "auto")
    from kernelkit.patch import patch
    from tests.test_patch import batch, tiny_model

    model = tiny_model("llama", dtype=torch.bfloat16, device=device, layers=1)
    patch(model, precision="fp8", rms_norm=True, mlp=True, rope=False, attention=False, cross_entropy=False)
    model.train()
    model(batch()[0].to(device), labels=batch()[1].to(device)).loss.backward()
    choose.forget()
    layer = model.model.layers[0]
    assert ran and layer.input_layernorm._kernelkit.fp8_read and layer.post_attention_layernorm._kernelkit.fp8_read


def test_rms_norm_fp8_compiles_for_sm90(device):
    from tests.conftest import INTERPRET
    from kernelkit.testing import compile_check

    if not INTERPRET:
        pytest.skip("records launches through the Triton interpreter")
    records = []
    with compile_check.record_launches(records):
        for dtype in (torch.bfloat16, torch.float32):
            RN.rms_norm_fp8(torch.randn(4, 4096).to(dtype), torch.ones(4096, dtype=dtype))
    records = [r for r in compile_check.unique(records) if r["kernel"].endswith("rms_norm_fwd_kernel")]
    assert records and all(r["args"]["QUANT"]["value"] for r in records)
    assert not compile_check.compile_in_subprocess(records)


# --- on the GPU ---

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(8192, 4096), (37, 4111), (3, 40000)])
def test_gpu_rms_norm_fp8_matches_the_quantize_rows_kernel(shape, dtype):
    # The GPU's converts (round to nearest even) against the quantize_rows kernel and its definition, bit for bit:
    # the 8B step's norm, a row off every power of two, and a row past MAX_FUSED_N (the separate quantizer).
    from kernelkit.ops.gemm.fp8 import quantize_rows

    x = _inputs(shape, dtype, "contiguous").cuda()
    w = (1.0 + 0.3 * torch.randn(shape[-1])).to(dtype).cuda()
    with poisoned_outputs():
        y, q, s = RN.rms_norm_fp8(x, w, 1e-5)
    _same_fp8(q, s, *quantize_rows(y))  # the kernel's bits
    _same_rows(q, s, y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(16384, 8192), (37, 14336), (3, 4111), (2, 20000)])
def test_gpu_swiglu_fp8_matches_the_quantize_rows_kernel(shape, dtype):
    # The 1B and 8B MLP widths, a row off every power of two, and one past FP8_MAX_N (the separate quantizer).
    from kernelkit.ops.gemm.fp8 import quantize_rows

    gate, up = (t.cuda() for t in _gate_up(shape, dtype, "separate"))
    with poisoned_outputs():
        h, q, s = GLU.swiglu_fp8(gate, up)
    assert torch.equal(h.view(torch.int16), GLU.swiglu(gate, up).view(torch.int16))
    _same_fp8(q, s, *quantize_rows(h))  # the kernel's bits
    _same_rows(q, s, h)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(16384, 8192), (8192, 14336), (8192, 1024), (37, 4111), (4111, 65)])
def test_gpu_rows_and_cols_t_match_the_separate_kernels(shape, dtype):
    from kernelkit.ops.gemm.fp8 import quantize_cols_t, quantize_rows

    t = _inputs(shape, dtype, "contiguous").cuda()
    with poisoned_outputs():
        (qr, sr), (qc, sc) = F8.quantize_rows_and_cols_t(t)
    _same_fp8(qr, sr, *quantize_rows(t))
    _same_fp8(qc, sc, *quantize_cols_t(t))


@pytest.mark.gpu
def test_gpu_patched_llama_fused_agrees_with_unfused(monkeypatch):
    test_patched_model_same_loss_and_grads_with_fewer_quantizations("cuda", monkeypatch)


# --- dy quantized both ways from two reads (quantize_rows_and_cols_t) ---

# (70, 130) in fp16 / fp32 runs 8 s each in the interpreter: left to `make test-all` and the GPU (CI's 15 minutes)
_LONG = pytest.mark.slow


@pytest.mark.parametrize("dtype,shape", [(d, s) for d in (torch.bfloat16, torch.float16, torch.float32)
                                         for s in ((1, 1), (3, 7), (129, 65))]
                         + [(torch.bfloat16, (70, 130)),
                            pytest.param(torch.float16, (70, 130), marks=_LONG),
                            pytest.param(torch.float32, (70, 130), marks=_LONG)])
def test_rows_and_cols_t_are_both_quantizations_bit_for_bit(device, dtype, shape):
    from kernelkit.ops.gemm.fp8 import quantize_cols_t_reference

    if dtype != torch.bfloat16 and shape[0] > 100:
        pytest.skip("the many-row case: bf16 is enough (the interpreter is slow)")
    t = _inputs(shape, dtype, "contiguous").to(device)
    if shape[1] > 2:
        t[1 % shape[0], 2] = float("nan")  # a NaN spreads to its row and its column
    views = [t] + ([_inputs(shape, dtype, "offset").to(device)] if shape[0] > 1 else [])
    for x in views:
        with poisoned_outputs():
            (qr, sr), (qc, sc) = F8.quantize_rows_and_cols_t(x)
        _same_rows(qr, sr, x)
        assert qc.shape == (shape[1], shape[0]) and qc.is_contiguous()
        _same_fp8(qc, sc, *quantize_cols_t_reference(x))
    with pytest.raises(ValueError, match="2-D"):
        F8.quantize_rows_and_cols_t(t.view(1, *t.shape))


@pytest.mark.parametrize("shape", [(3, 7), (200, 70)])
def test_rows_and_cols_t_wide_tile_is_bit_for_bit(device, monkeypatch, shape):
    """The 128 x 64 tile that dy takes from 2048 columns up, at small widths (ragged in both dims)."""
    from kernelkit.ops.gemm.fp8 import quantize_cols_t_reference

    from kernelkit.ops.gemm import fp8 as G

    monkeypatch.setattr(G, "ROWS_COLS_WIDE_FROM", 1)
    t = _inputs(shape, torch.bfloat16, "offset").to(device)
    with poisoned_outputs():
        (qr, sr), (qc, sc) = F8.quantize_rows_and_cols_t(t)
    _same_rows(qr, sr, t)
    _same_fp8(qc, sc, *quantize_cols_t_reference(t))


def test_the_backward_with_dy_read_twice_or_four_times_is_the_same(device, monkeypatch, counted):
    ws = _linears(device, (32, 48))
    x = torch.randn(12, 48).to(device, torch.bfloat16).requires_grad_()
    dys = [torch.randn(12, w.shape[0]).to(device, torch.bfloat16) for w in ws]
    got = []
    for one_read in (True, False):
        monkeypatch.setattr(F8, "DY_ONE_READ", one_read)
        x.grad = None
        for w in ws:
            w.grad = None
        _run(x, ws, None, dys)
        got.append([x.grad.clone()] + [w.grad.clone() for w in ws])
    assert all(torch.equal(a, b) for a, b in zip(*got))


# --- what the backward keeps: x's fp8 columns, not x ---

def _saved(y):
    return y.grad_fn.next_functions[0][0].saved_tensors  # under the output's view: the fp8 Linear's node

def test_the_forward_keeps_x_columns_in_fp8_not_x(device, counted):
    w, = _linears(device, (32,))
    x = torch.randn(12, 48).to(device, torch.bfloat16).requires_grad_()
    y = fp8_linear(x, w)
    saved = _saved(y)
    assert counted["cols"] == 1  # made in the forward
    assert [t.dtype for t in saved] == [torch.bfloat16, torch.float8_e4m3fn, torch.float32]
    assert saved[0] is w or saved[0].shape == w.shape  # the weight (bf16), then x's columns and their scales
    assert saved[1].shape == (48, 12) and saved[2].shape == (48,)
    y.backward(torch.ones_like(y))
    assert counted["cols"] == 2  # dy's columns in the backward, not x's again
    frozen = w.detach()
    counted.update(rows=0, cols=0)
    z = fp8_linear(x, frozen)  # no weight gradient: no columns made or kept
    assert counted["cols"] == 0 and [t.dtype for t in _saved(z)] == [torch.bfloat16]
    z.backward(torch.ones_like(z))
    assert x.grad is not None and counted["cols"] == 0


def test_rows_and_cols_t_kernels_compile_for_sm90():
    # The interpreter runs them with encoded fp8 bits; CI builds them for the H100 (hardware converts, atomics).
    from kernelkit.ops.gemm import fp8 as G
    from kernelkit.testing import compile_check

    i32 = lambda v: {"value": v, "type": "i32"}  # noqa: E731
    records = []
    for dt, (block_r, block_c, warps) in (("bf16", G.ROWS_COLS_TILE_WIDE), ("fp16", G.ROWS_COLS_TILE_NARROW)):
        tile = {"R": i32(16384), "C": i32(8192), "stride_r": i32(8192), "BLOCK_R": {"value": block_r},
                "BLOCK_C": {"value": block_c}}
        records += [{"kernel": "kernelkit.ops.gemm.fp8:amax_rows_cols_kernel",
                     "args": {"X": {"ptr": dt}, "RA": {"ptr": "i32"}, "CA": {"ptr": "i32"}, **tile},
                     "options": {"num_warps": warps}},
                    {"kernel": "kernelkit.ops.gemm.fp8:quantize_rows_cols_t_kernel",
                     "args": {"X": {"ptr": dt}, "RA": {"ptr": "i32"}, "CA": {"ptr": "i32"}, "QR": {"ptr": "u8"},
                              "SR": {"ptr": "fp32"}, "QC": {"ptr": "u8"}, "SC": {"ptr": "fp32"}, **tile,
                              "tiny": {"value": 1e-38, "type": "fp32"}},
                     "options": {"num_warps": warps}}]
    assert not compile_check.compile_in_subprocess(records)
