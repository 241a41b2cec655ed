"""The profiler closes the loop with kernelkit.patch (CPU): kernelkit's own calls attributed through their
`kernelkit::` ranges, projections from measured speed (a slower kernel is never recommended), gathered and
shape-only reads in the cost model, label placement on the roofline plot, recommendations naming the
kernelkit.patch call, and `profile --patch`'s comparison on synthetic runs."""

import inspect
import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kernelkit.commands.cli import app
from kernelkit.hw import DATASHEETS, Ceilings
from kernelkit.profile import Thresholds, Trace, analyze
from kernelkit.profile.compare import changed_ms, patch_comparison
from kernelkit.profile.costs import attention_flops, kernelkit_cost, parse_range
from kernelkit.profile.kineto import attribute
from kernelkit.profile.projection import (PATCH_SWITCH, SWITCHES, apply_text, call_shape, results_table, shape_key,
                                          table_efficiency)
from kernelkit.profile.report import _kernelkit_cell, print_patch_comparison, to_html
from kernelkit.profile.trace import OpRecord, profiled_steps
from kernelkit.roofline.plot import _overlaps, place_labels, roofline_png
from kernelkit.testing import results
from tests.conftest import INTERPRET

H100 = Ceilings.from_spec(DATASHEETS["h100-sxm"])
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="runs kernelkit's kernels: TRITON_INTERPRET=1")


def rec(op, module, phase, shapes, dtypes, flops, nbytes, ms, step=0, dkey="bf16", **kw):
    return OpRecord(op, module, phase, step, tuple(map(tuple, shapes)), tuple(dtypes), float(flops), float(nbytes),
                    dkey, kernels=[[0.0, ms * 1e3]] if ms is not None else None, **kw)


# --- kernelkit's own calls: named ranges, records, kernels ---

def test_range_names_parse_back():
    call = parse_range("kernelkit::attention.backward(q=4x2048x16x128:bfloat16, k=4x2048x4x128:bfloat16, "
                       "v=4x2048x4x128:bfloat16, causal=True, window=None, reduction='a, b', sizes=(1, 2), "
                       "out=<Foo>, s=0d:float32)")
    assert call.op == "attention" and call.backward
    assert call.kwargs["q"].shape == (4, 2048, 16, 128) and call.kwargs["q"].dtype == "bfloat16"
    assert call.kwargs["causal"] is True and call.kwargs["window"] is None and call.kwargs["reduction"] == "a, b"
    assert call.kwargs["sizes"] == (1, 2) and call.kwargs["out"] == "<Foo>" and call.kwargs["s"].shape == ()
    assert parse_range("kkop::3") is None and parse_range("aten::mm") is None
    fwd = parse_range("kernelkit::rms_norm(x=8192x4096:bfloat16, weight=4096:bfloat16, eps=1e-05)")
    cost, how = kernelkit_cost(fwd)
    n = 8192 * 4096
    assert how == "registry" and cost.bytes == 2 * n * 2 + 4096 * 2 and cost.flops == 4 * n
    bwd, _ = kernelkit_cost(parse_range("kernelkit::rms_norm.backward(x=8192x4096:bfloat16, weight=4096:bfloat16)"))
    assert bwd.bytes == 3 * n * 2 + 2 * 4096 * 2
    other, how = kernelkit_cost(parse_range("kernelkit::not_an_op(a=16x8:float32, b=8:float32)"))
    assert how == "generic" and other.bytes == 4 * (128 + 8) + 4 * 128


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(64))

    def forward(self, x):
        import kernelkit

        return kernelkit.rms_norm(x, self.weight, eps=1e-5)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = _Norm()
        self.up = torch.nn.Linear(64, 128)

    def forward(self, x):
        import kernelkit

        g, u = self.up(self.norm(x)).chunk(2, -1)
        return kernelkit.swiglu(g, u).sum()


@needs_interpreter
def test_kernelkit_calls_are_records_with_module_cost_and_range(tmp_path):
    """Under the profiler, each kernelkit call is one record (its own aten calls muted) with the module it runs
    in, forward and backward, the registry's cost at its shapes, and a `kkop::` range inside its kernelkit range."""
    from torch.profiler import ProfilerActivity

    from kernelkit.ops.rms_norm import cost as rms_cost

    prof, records, ran = profiled_steps(_Block(), (torch.randn(8, 64),), 1, True, True, [ProfilerActivity.CPU],
                                        lambda: None)
    kk = [(i, r) for i, r in enumerate(records) if r.op.startswith("kernelkit::")]
    assert [(r.op, r.module, r.phase) for _, r in kk] == [
        ("kernelkit::rms_norm", "norm:_Norm", "fwd"), ("kernelkit::swiglu", "<model>:_Block", "fwd"),
        ("kernelkit::swiglu", "<model>:_Block", "bwd"), ("kernelkit::rms_norm", "norm:_Norm", "bwd")]
    norm = kk[0][1]
    assert norm.shapes == ((8, 64), (64,)) and norm.dtypes == ("float32", "float32")
    want = rms_cost(torch.empty(8, 64), torch.empty(64))
    assert (norm.flops, norm.bytes) == (want.flops, want.bytes)
    assert kk[3][1].bytes == rms_cost(torch.empty(8, 64), torch.empty(64), backward=True).bytes
    assert not any(r.op in ("aten::empty", "aten::zeros") or r.op.startswith("profiler::") for r in records)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    ev = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    named = [e for e in ev if e["name"].startswith("kernelkit::")]
    assert [e["name"].split("(")[0] for e in named] == ["kernelkit::rms_norm", "kernelkit::swiglu",
                                                       "kernelkit::swiglu.backward", "kernelkit::rms_norm.backward"]
    for (i, _), outer in zip(kk, named):
        inner = next(e for e in ev if e["name"] == f"kkop::{i}")
        assert outer["tid"] == inner["tid"] and outer["ts"] <= inner["ts"] <= outer["ts"] + outer["dur"]


class _Head(torch.nn.Module):
    def __init__(self, reduction):
        super().__init__()
        self.weight = torch.nn.Parameter(0.1 * torch.randn(100, 16))
        self.reduction = reduction

    def forward(self, x, t):
        import kernelkit

        loss = kernelkit.linear_cross_entropy(x, self.weight, t, reduction=self.reduction)
        return loss if loss.dim() == 0 else loss.sum()


@needs_interpreter
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_loss_that_computes_its_gradients_in_the_forward_is_charged_there(reduction):
    """linear_cross_entropy computes dhidden and dweight during its forward (the backward scales them): the
    profile puts all three GEMMs' cost on the forward record and none on the backward's. reduction='none'
    recomputes in its backward, and keeps the split."""
    from torch.profiler import ProfilerActivity

    from kernelkit.ops.linear_cross_entropy import cost as lce_cost

    x, t = torch.randn(12, 16, requires_grad=True), torch.randint(0, 100, (12,))
    _, records, _ = profiled_steps(_Head(reduction), (x, t), 1, True, True, [ProfilerActivity.CPU], lambda: None)
    kk = [r for r in records if r.op == "kernelkit::linear_cross_entropy"]
    assert [r.phase for r in kk] == ["fwd", "bwd"]
    args = (torch.empty(12, 16), torch.empty(100, 16), torch.empty(12, dtype=torch.long))
    fwd, bwd = lce_cost(*args), lce_cost(*args, backward=True)
    if reduction == "none":
        assert (kk[0].flops, kk[1].flops) == (fwd.flops, bwd.flops)
    else:
        assert kk[0].flops == fwd.flops + bwd.flops == 6 * 12 * 16 * 100 and kk[0].bytes == fwd.bytes + bwd.bytes
        assert (kk[1].flops, kk[1].bytes) == (0.0, 0.0)


def test_no_ranges_without_a_profiler(monkeypatch):
    """The eager path pays one boolean check: nothing is named or hooked when no profiler records."""
    from kernelkit.ops import _dispatch

    called = []
    monkeypatch.setattr(_dispatch, "profiled_call", lambda *a, **k: called.append(a))
    out = _dispatch.dispatch(None, lambda x: x + 1, None, 0, (torch.ones(2),))
    assert called == [] and out.tolist() == [2.0, 2.0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        _dispatch.dispatch(None, lambda x: x + 1, None, 0, (torch.ones(2),))
    assert len(called) == 1


def _x(name, ts, dur, cat="user_annotation", tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1 if cat != "kernel" else 0, "tid": tid, "ts": ts,
            "dur": dur, "args": args}


def test_kineto_charges_triton_kernels_to_their_kernelkit_call():
    ev = [
        _x("kkstep::0", 0, 1000),
        _x("kernelkit::rms_norm(x=8192x4096:bfloat16, weight=4096:bfloat16)", 10, 50),
        _x("kkop::0", 11, 48),
        _x("aten::empty", 12, 2, "cpu_op", **{"External id": 3}),  # the launcher's own allocation
        _x("cuLaunchKernelEx", 20, 3, "cuda_driver", correlation=200),
        _x("rms_norm_fwd_kernel", 100, 90, "kernel", tid=7, correlation=200),
        _x("aten::zero_", 30, 5, "cpu_op", **{"External id": 4}),  # a partial-sum buffer zeroed inside the call
        _x("cudaMemsetAsync", 31, 2, "cuda_runtime", correlation=201, **{"External id": 4}),
        _x("Memset (Device)", 200, 4, "gpu_memset", tid=7, correlation=201, **{"External id": 4}),
        # the backward's range on the autograd thread
        _x("kernelkit::rms_norm.backward(x=8192x4096:bfloat16, weight=4096:bfloat16)", 300, 60, tid=2),
        _x("kkop::1", 301, 58, tid=2), _x("cuLaunchKernelEx", 310, 3, "cuda_driver", tid=2, correlation=202),
        _x("rms_norm_bwd_kernel", 400, 150, "kernel", tid=7, correlation=202),
    ]
    att = attribute(ev)
    assert dict(att.per_op) == {0: [(100, 190), (200, 204)], 1: [(400, 550)]} and not att.unattributed


def test_kernelkit_rows_have_module_roof_and_verdict_and_nothing_replaces_them():
    n = 8192 * 4096
    recs = []
    for step in range(2):
        recs += [rec("kernelkit::rms_norm", "model.layers.0.input_layernorm:LlamaRMSNorm", "fwd",
                     [(8, 1024, 4096), (4096,)], ["bfloat16"] * 2, 4 * n, 2 * 2 * n + 8192, 0.060, step),
                 rec("kernelkit::rms_norm", "model.layers.0.input_layernorm:LlamaRMSNorm", "bwd",
                     [(8, 1024, 4096), (4096,)], ["bfloat16"] * 2, 8 * n, 3 * 2 * n + 16384, 0.090, step),
                 rec("aten::mm", "model.layers.0.mlp.up_proj:Linear", "fwd", [(8192, 4096), (4096, 4096)],
                     ["bfloat16"] * 2, 2 * 8192 * 4096 * 4096, 3 * 2 * n, 0.4, step)]
    rep = analyze(Trace(recs, steps=2, measured=True), H100, tables=None)
    kk = [r for r in rep.rows if r.op == "kernelkit::rms_norm"]
    assert {r.phase for r in kk} == {"fwd", "bwd"} and all(r.module.endswith(":LlamaRMSNorm") for r in kk)
    fwd = next(r for r in kk if r.phase == "fwd")
    assert fwd.regime == "memory" and fwd.pct_roof == pytest.approx(100 * (4 * n + 8192) / 3350e9 / 60e-6, rel=1e-6)
    assert fwd.verdict and fwd.recommendation == "" and _kernelkit_cell(fwd) == "(running)"
    assert rep.kernels == [] and not any("kernelkit::" in op for c in rep.chains for op in c["ops"])


# --- projections from measured speed ---

def _attention_trace(kernel_times: dict | None = None, today_fwd=1.0, today_bwd=2.5) -> Trace:
    q, kv = (4, 16, 2048, 128), (4, 4, 2048, 128)
    fl = attention_flops(q, kv, kv, causal=True)
    b = 2 * (2 * math.prod(q) + 2 * math.prod(kv))
    recs = []
    for layer in range(2):
        mod = f"model.layers.{layer}.self_attn:LlamaAttention"
        recs += [rec("aten::_scaled_dot_product_cudnn_attention", mod, "fwd", [q, kv, kv], ["bfloat16"] * 3, fl, b,
                     today_fwd),
                 rec("aten::_scaled_dot_product_cudnn_attention_backward", mod, "bwd", [q, q, kv, kv, q],
                     ["bfloat16"] * 5, 2.5 * fl, 2 * b, today_bwd)]
    return Trace(recs, steps=1, measured=True, kernel_times=kernel_times or {})


def test_attention_call_shape_comes_from_the_sdpa_call():
    tr = _attention_trace()
    from kernelkit.ops import registry

    spec = registry.get("attention")
    assert call_shape("attention", spec, tr.records[:1]) == ((4, 2048, 16, 128, True, 2048, 4), "bfloat16")
    assert call_shape("attention", spec, tr.records[1:2]) == ((4, 2048, 16, 128, True, 2048, 4), "bfloat16")
    from kernelkit.profile.analysis import kernel_calls

    assert kernel_calls(tr) == {("attention", (4, 2048, 16, 128, True, 2048, 4), "bfloat16"): {"fwd", "bwd"}}


def test_a_slower_kernel_is_not_recommended():
    key = shape_key("attention", (4, 2048, 16, 128, True, 2048, 4), "bfloat16")
    rep = analyze(_attention_trace({key: {"fwd": 1.3, "bwd": 3.0}}), H100, tables=None)
    (k,) = rep.kernels
    assert k["projection"] == "timed" and not k["recommended"]
    assert k["kernelkit_ms"] == pytest.approx(2 * (1.3 + 3.0)) and k["saving_ms"] == pytest.approx(-2 * 0.8)
    rows = [r for r in rep.rows if "attention" in r.op]
    assert all(r.recommended is False and _kernelkit_cell(r) == "(attention: slower)" for r in rows)
    text = "\n".join(rep.findings)
    assert "kernelkit.attention would not save time" in text and "not recommended" in text
    assert "kernelkit.patch(model, attention=False)" in text and "projected saving" not in text


def test_a_faster_kernel_is_recommended_with_its_measured_saving():
    key = shape_key("attention", (4, 2048, 16, 128, True, 2048, 4), "bfloat16")
    rep = analyze(_attention_trace({key: {"fwd": 0.8, "bwd": 2.0}}), H100, tables=None)
    (k,) = rep.kernels
    assert k["recommended"] and k["saving_ms"] == pytest.approx(2 * (3.5 - 2.8))
    assert "timed on this GPU at 4x2048x16x128xTruex2048x4 bfloat16" in k["projection_source"]
    finding = next(f for f in rep.findings if f.startswith("kernelkit.attention replaces"))
    assert f"projected saving {k['saving_ms']:.3f} ms/step" in finding and "kernelkit.patch(model)" in finding
    assert "attention=False" in finding  # the switch that leaves it out


def _pct_rows(shapes_pct: dict, impl="kernelkit", metric="pct_roof", timestamp="2026-11-23T08:44:41Z") -> list[dict]:
    """Results-table rows (testing.results) of % of roof for attention at {(batch, seq): pct}, causal or not, fwd
    and bwd."""
    return [{"op": "attention", "impl": impl, "shape": f"{b}x{s}x16x128x{c}", "dtype": "bfloat16", "mode": m,
             "metric": metric, "value": pct, "unit": "%", "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0",
             "triton": "3.6.0", "commit": "cc58d02", "timestamp": timestamp}
            for (b, s), pct in shapes_pct.items() for c in (True, False) for m in ("fwd", "bwd")]


def test_projection_falls_back_to_the_table_then_to_the_roofline(tmp_path):
    table = tmp_path / "h100.csv"
    results.append(table, _pct_rows({(8, 2048): 50.0, (1, 16384): 70.0})
                   + _pct_rows({(8, 2048): 80.0, (1, 16384): 80.0}, impl="sdpa-cudnn"))
    assert results_table(H100.gpu, tmp_path) == table and results_table("NVIDIA L40S", tmp_path) is None
    eff = table_efficiency(table, "attention", (4, 2048, 16, 128, True, 2048, 4), "bfloat16", "fwd")
    assert eff == (0.5, "h100.csv: attention 8x2048x16x128xTrue bfloat16 fwd (end to end), 2026-11-23")
    # cuDNN at about 70% of the roof (0.10 ms forward, 0.25 ms backward); kernelkit at 50% in the table
    rep = analyze(_attention_trace(today_fwd=0.10, today_bwd=0.25), H100, tables=tmp_path)
    (k,) = rep.kernels
    assert k["projection"] == "table" and "50% of roof in h100.csv: attention 8x2048" in k["projection_source"]
    floor = 4 * 16 * 128 * 4 * (2048 * 2049 / 2) / 989.4e12 * 1e3
    assert k["kernelkit_ms"] == pytest.approx(2 * 3.5 * floor / 0.5, rel=1e-3) and not k["recommended"]
    rep = analyze(_attention_trace(), H100, tables=None)
    assert rep.kernels[0]["projection"] == "roofline" and "assumed 90%" in rep.kernels[0]["projection_source"]


def test_table_projection_takes_the_newest_row_and_kernel_time_first(tmp_path):
    table = tmp_path / "h100.csv"
    shape = (4, 2048, 16, 128, True, 2048, 4)
    results.append(table, _pct_rows({(8, 2048): 60.0}, timestamp="2026-11-24T10:00:00Z"))
    results.append(table, _pct_rows({(8, 2048): 40.0}, timestamp="2026-11-23T10:00:00Z"))  # older, appended later
    assert table_efficiency(table, "attention", shape, "bfloat16", "fwd")[0] == 0.6
    results.append(table, _pct_rows({(8, 2048): 75.0}, timestamp="2026-11-25T10:00:00+00:00"))
    eff = table_efficiency(table, "attention", shape, "bfloat16", "bwd")
    assert eff == (0.75, "h100.csv: attention 8x2048x16x128xTrue bfloat16 bwd (end to end), 2026-11-25")
    # kernel-only timing at the same shape wins over a newer end-to-end row; a nearer shape over both
    results.append(table, _pct_rows({(8, 2048): 90.0}, metric="kernel_pct_roof", timestamp="2026-11-20T10:00:00Z"))
    assert table_efficiency(table, "attention", shape, "bfloat16", "fwd") == (
        0.9, "h100.csv: attention 8x2048x16x128xTrue bfloat16 fwd (kernels), 2026-11-20")
    results.append(table, _pct_rows({(4, 2048): 30.0}, timestamp="2026-11-19T10:00:00Z"))
    assert table_efficiency(table, "attention", shape, "bfloat16", "fwd")[0] == 0.3


def test_files_beside_the_table_do_not_change_a_projection(tmp_path):
    results.append(tmp_path / "h100.csv", _pct_rows({(8, 2048): 50.0}))
    before = analyze(_attention_trace(today_fwd=0.10, today_bwd=0.25), H100, tables=tmp_path).kernels
    # an experiment committed beside it, in the old per-op JSON form, with a shorter name and another figure
    rows = [{"op": "attention", "shape": "4x2048x16x128xTrue", "dtype": "bfloat16", "mode": m, "impl": "kernelkit",
             "ms": 1.0, "pct_roof": 99.0, "kernel_ms": 0.5} for m in ("fwd", "bwd")]
    for folder in (tmp_path / "h100", tmp_path / "h100" / "kernel-time", tmp_path):
        folder.mkdir(exist_ok=True)
        (folder / "a.json").write_text(json.dumps({"env": {"time": "2026-11-26T00:00:00Z"}, "rows": rows}))
    (tmp_path / "h100-experiment.csv").write_text((tmp_path / "h100.csv").read_text().replace(",50,", ",99,"))
    after = analyze(_attention_trace(today_fwd=0.10, today_bwd=0.25), H100, tables=tmp_path).kernels
    assert after == before and before[0]["projection"] == "table" and "50% of roof" in before[0]["projection_source"]


def test_predicted_mode_says_where_each_projection_comes_from():
    from kernelkit.profile import profile
    from kernelkit.profile.examples import build_example

    model, inputs = build_example("llama", device="meta", tiny=False)
    rep = profile(model, inputs, gpu="h100")
    kernels = {k["kernel"]: k for k in rep.kernels}
    assert kernels["rms_norm"]["recommended"] and kernels["rms_norm"]["projection"] == "table"
    assert "of roof in h100.csv: rms_norm " in kernels["rms_norm"]["projection_source"]  # the committed table
    assert not kernels["attention"]["recommended"]  # at its floor flash attention beats any kernel below the roof
    assert rep.assumptions["projection"].startswith("kernelkit timed on this GPU")
    text = "\n".join(rep.findings)
    assert "kernelkit.rms_norm replaces LlamaRMSNorm" in text and "kernelkit.patch(model" in text


# --- cost attribution: fills, gathers ---

from .test_profile import _Costs  # noqa: E402  (records each aten op's cost)


def test_fills_and_gathers_count_the_bytes_they_touch():
    n, v, d = 64, 1000, 32
    logits = torch.randn(n, v, requires_grad=True)
    target = torch.randint(0, v, (n,))
    table = torch.randn(v, d)
    ids = torch.randint(0, v, (4, 16))
    with _Costs() as m:
        F.nll_loss(F.log_softmax(logits, -1), target).backward()
        F.embedding(ids, table)
    with _Costs() as fills:
        torch.ones_like(logits)
    s = m.seen
    # nll_loss_backward zero-fills the gradient and scatters one value per row: its input is read for its shape
    assert s["aten::nll_loss_backward"].bytes == 4 + 8 * n + 4 + 4 * n * v  # grad_out, target, total_weight; dx
    assert s["aten::nll_loss_forward"].bytes == 4 * n + 8 * n + 4 + 4  # one logit per row, target; loss, weight
    assert s["aten::embedding"].bytes == 4 * 64 * d + 8 * 64 + 4 * 64 * d  # the rows it picks, not the table
    assert fills.seen["aten::ones_like"].bytes == 4 * n * v  # written only


def test_rows_above_the_roof_are_reported_not_clamped():
    recs = [rec("aten::mm", "lm_head:Linear", "fwd", [(8192, 2048), (2048, 32000)], ["bfloat16"] * 2,
                2 * 8192 * 2048 * 32000, 6.9e8, 0.95)]
    rep = analyze(recs, H100, tables=None)
    assert rep.rows[0].pct_roof > 105
    assert any("above 102% of the roof" in n and "aten::mm in lm_head:Linear" in n for n in rep.notes)


# --- plot labels ---

@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 800), st.floats(0, 500), st.floats(10, 120), st.floats(6, 12)),
                min_size=1, max_size=30))
def test_placed_labels_never_overlap_and_stay_inside(spec):
    anchors = [(x, y) for x, y, _, _ in spec]
    sizes = [(w, h) for _, _, w, h in spec]
    avoid = [(700.0, 0.0, 800.0, 80.0)]  # a legend
    offsets = place_labels(anchors, sizes, (0.0, 0.0, 800.0, 500.0), avoid)
    boxes = [(x + o[0], y + o[1], x + o[0] + w, y + o[1] + h)
             for (x, y), (w, h), o in zip(anchors, sizes, offsets) if o is not None]
    assert all(0 <= b[0] and b[2] <= 800 and 0 <= b[1] and b[3] <= 500 for b in boxes)
    assert not any(_overlaps(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert not any(_overlaps(b, avoid[0]) for b in boxes)
    x, y = anchors[0]
    assert offsets[0] is not None or not (150 <= x <= 550 and 150 <= y <= 350)  # the first label, in the open, fits


def test_roofline_plot_with_a_crowd_of_points(tmp_path):
    pts = [{"intensity": 0.25 * (1 + 0.002 * i), "tflops": 0.8 * (1 + 0.002 * i), "share_pct": 3.0,
            "label": f"mul layers.{i}", "regime": "memory"} for i in range(40)]
    pts += [{"intensity": 1500.0, "tflops": 700.0 + i, "share_pct": 4.0, "label": f"mm l{i}", "regime": "compute"}
            for i in range(8)]
    assert roofline_png(pts, H100, tmp_path / "r.png").stat().st_size > 5000


# --- recommendations name the call that applies them ---

def test_recommendations_name_the_kernelkit_patch_call():
    assert apply_text("rms_norm", "LlamaRMSNorm", {"replaced": {"rms_norm": ["LlamaRMSNorm"]}}) == (
        "apply with kernelkit.patch(model) (switch rms_norm: kernelkit.patch(model, rms_norm=False) keeps the "
        "rest without it)")
    assert "switch mlp" in apply_text("swiglu", "LlamaMLP", {"replaced": {"mlp": ["LlamaMLP"]}})
    assert "on a Hugging Face model" in apply_text("attention", "Attention", {})
    no = apply_text("rms_norm", "MyNorm", {"error": "kernelkit.patch has no row for model_type None"})
    assert "does not take this model" in no and "call kernelkit.rms_norm in MyNorm's forward" in no
    left = apply_text("swiglu", "MLP", {"replaced": {"rms_norm": ["LlamaRMSNorm"]},
                                        "skipped": [["MLP", "activation GELU has no kernelkit glu"]]})
    assert "leaves it alone (activation GELU" in left
    assert "kernelkit.patch does not swap layer_norm" in apply_text("layer_norm", "LayerNorm", {})


def test_patch_switches_match_kernelkit_patch():
    kpatch = pytest.importorskip("kernelkit.patch")
    params = inspect.signature(kpatch.patch).parameters
    assert set(SWITCHES) <= set(params) and set(PATCH_SWITCH.values()) <= set(SWITCHES)


def test_patch_coverage_of_a_hugging_face_model():
    pytest.importorskip("transformers")
    from kernelkit.profile.examples import build_example
    from kernelkit.profile.projection import patch_coverage

    model, _ = build_example("hf-llama", device="meta", tiny=True)
    cov = patch_coverage(model)
    assert cov["family"] == "llama" and set(cov["replaced"]) == set(SWITCHES), cov
    assert "forward" not in vars(model.model.norm)  # unpatched again
    plain = patch_coverage(torch.nn.Linear(2, 2))
    assert "error" in plain


# --- profile --patch ---

class _FakePatch:
    """kernelkit.patch's interface over a model whose runs `_fake_measure` makes up."""

    def __init__(self):
        from kernelkit.patch.report import PatchReport

        self.report_cls, self.on = PatchReport, None

    def patch(self, model, **switches):
        self.on = {s for s in SWITCHES if switches.get(s, True)}
        self.precision = switches.get("precision", "bf16")
        rep = self.report_cls(model="M", family="llama")
        for kind, target in (("rms_norm", "LlamaRMSNorm"), ("attention", "LlamaAttention")):
            if kind in self.on:
                rep.add(kind, target, f"kernelkit {kind}", 2)
        if self.precision == "fp8":
            rep.add("fp8", "nn.Linear in decoder layers", "kernelkit.fp8_linear", 2)
            rep.fell_back("fp8", "in/out features 72/64 are not multiples of 16")
        return rep

    def unpatch(self, model):
        self.on = None


def _run(on: set, noise=0.0) -> Trace:
    n = 8 * 1024 * 4096
    recs = []
    for layer in range(2):
        norm = f"model.layers.{layer}.input_layernorm:LlamaRMSNorm"
        if "rms_norm" in on:
            recs.append(rec("kernelkit::rms_norm", norm, "fwd", [(8, 1024, 4096), (4096,)], ["bfloat16"] * 2,
                            4 * n, 4 * n, 0.030))
        else:
            recs += [rec(op, norm, "fwd", [(8, 1024, 4096)], ["float32"], n, 8 * n, 0.050, dkey="fp32")
                     for op in ("aten::pow", "aten::mean", "aten::mul")]
        tr = _attention_trace(today_fwd=1.0, today_bwd=2.5).records[2 * layer: 2 * layer + 2]
        if "attention" in on:
            tr = [rec("kernelkit::attention", r.module, r.phase, r.shapes[:3], r.dtypes[:3], r.flops, r.bytes,
                      1.2 if r.phase == "fwd" else 2.8) for r in tr]
        recs += tr
        recs.append(rec("aten::mm", f"model.layers.{layer}.mlp.up_proj:Linear", "fwd", [(8192, 4096), (4096, 4096)],
                        ["bfloat16"] * 2, 2 * 8192 * 4096 ** 2, 1e8, 0.4 + noise))
    return Trace(recs, steps=1, measured=True, device_us=1e3 * sum(r.ms for r in recs))


def test_changed_ms_reads_only_the_groups_the_patch_touched():
    t0, t1, modules = changed_ms(_run(set()), _run({"rms_norm"}, noise=0.05))
    assert (t0, t1) == (pytest.approx(2 * 0.150), pytest.approx(2 * 0.030))
    assert modules == ["model.layers.0.input_layernorm", "model.layers.1.input_layernorm"]
    after = _run({"rms_norm"})
    after.unattributed = {"_LinearCrossEntropyFunction / cross_entropy_fwd_kernel": 100.0}  # us, in one step
    assert changed_ms(_run(set()), after)[1] == pytest.approx(2 * 0.030 + 0.1)  # outside every record: still time


def test_patch_comparison_sets_each_projection_against_its_measured_saving(monkeypatch):
    from kernelkit.profile import compare

    fake = _FakePatch()
    monkeypatch.setattr(compare, "patch_module", lambda: fake)
    key = shape_key("attention", (4, 2048, 16, 128, True, 2048, 4), "bfloat16")
    before_trace = _run(set())
    before_trace.kernel_times = {key: {"fwd": 1.3, "bwd": 3.0}}
    before = analyze(before_trace, H100, tables=None)
    before.trace = before_trace
    comp, after = patch_comparison(object(), (), H100, before, Thresholds(),
                                   measure=lambda m, i, **kw: _run(fake.on, noise=0.01))
    rows = {r["switch"]: r for r in comp["rows"]}
    assert set(rows) == {"rms_norm", "attention"}
    assert rows["rms_norm"]["measured_ms"] == pytest.approx(2 * (0.150 - 0.030))
    assert rows["rms_norm"]["projected_ms"] == pytest.approx(next(k["saving_ms"] for k in before.kernels
                                                                  if k["kernel"] == "rms_norm"))
    assert rows["attention"]["measured_ms"] == pytest.approx(2 * (3.5 - 4.0))
    assert rows["attention"]["projected_ms"] == pytest.approx(-2 * 0.8)
    assert "(not recommended)" in rows["attention"]["findings"][0]
    assert rows["attention"]["call"] == "kernelkit.patch(model, rms_norm=False, mlp=False, rope=False, " \
                                        "cross_entropy=False)"
    total = comp["total"]
    assert total["measured_ms"] == pytest.approx(2 * 0.12 - 1.0)
    assert total["step_before_ms"] == pytest.approx(before.step_ms) and total["step_after_ms"] == after.step_ms
    assert any(r.op == "kernelkit::rms_norm" for r in after.rows) and fake.on is None
    from rich.console import Console

    console = Console(width=240, record=True)
    print_patch_comparison(comp, console)
    out = console.export_text()
    assert "projected against measured" in out and "rms_norm" in out and "all" in out
    before.patch = comp
    assert "Under kernelkit.patch" in to_html(before, None)


def test_cli_patch_needs_a_gpu(tmp_path):
    res = CliRunner().invoke(app, ["profile", "--example", "llama", "--patch", "--gpu", "h100",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 2 and "needs a CUDA GPU" in " ".join(res.output.split())


def test_cli_predicts_the_hugging_face_example(tmp_path):
    pytest.importorskip("transformers")
    res = CliRunner().invoke(app, ["profile", "--example", "hf-llama", "--gpu", "h100", "--json-only",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "profile.json").read_text())
    assert doc["patch_coverage"]["family"] == "llama"
    kernels = {k["kernel"]: k for k in doc["kernels"]}
    assert kernels["rms_norm"]["in"] == "LlamaRMSNorm" and kernels["rms_norm"]["recommended"]
    assert any("apply with kernelkit.patch(model) (switch rms_norm" in f for f in doc["findings"])


def test_cli_patch_wiring(tmp_path, monkeypatch):
    """`profile --example llama --patch` end to end with the GPU parts faked: the example becomes the Hugging
    Face one, the comparison table is printed and saved, the patched run's report goes to patched/."""
    pytest.importorskip("transformers")
    from kernelkit.hw import ceilings
    from kernelkit.profile import analysis, compare, projection, trace

    fake = _FakePatch()
    monkeypatch.setattr(ceilings, "ceilings_for", lambda gpu=None: (H100, True))
    monkeypatch.setattr(compare, "patch_module", lambda: fake)
    monkeypatch.setattr(projection, "patch_module", lambda: fake)
    monkeypatch.setattr(analysis, "time_calls", lambda tr, reps=10: {})
    monkeypatch.setattr(trace, "measure", lambda model, inputs, **kw: _run(fake.on or set()))
    res = CliRunner().invoke(app, ["profile", "--example", "llama", "--patch", "--out", str(tmp_path)],
                             terminal_width=240)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "as transformers' LlamaForCausalLM" in text and "projected against measured" in text
    assert "under kernelkit.patch(model)" in text
    doc = json.loads((tmp_path / "profile.json").read_text())
    assert {r["switch"] for r in doc["patch"]["rows"]} == {"rms_norm", "attention"}
    assert doc["patch_coverage"]["family"] == "llama"
    patched = json.loads((tmp_path / "patched" / "profile.json").read_text())
    assert any(r["op"] == "kernelkit::rms_norm" for r in patched["rows"])
    assert (tmp_path / "patched" / "report.html").exists()


def test_patch_comparison_with_fp8_sets_the_fp8_run_against_the_bf16_patch(monkeypatch):
    from rich.console import Console

    from kernelkit.profile import compare

    fake = _FakePatch()
    monkeypatch.setattr(compare, "patch_module", lambda: fake)
    before_trace = _run(set())
    before = analyze(before_trace, H100, tables=None)
    before.trace = before_trace
    # the fp8 run: the same kernels, the up_proj GEMMs 0.3 ms faster each (two layers)
    measure = lambda m, i, **kw: _run(fake.on, noise=-0.3 if fake.precision == "fp8" else 0.0)  # noqa: E731
    comp, after = patch_comparison(object(), (), H100, before, Thresholds(), measure=measure, precision="fp8")
    row = comp["fp8"]
    assert row["call"] == "kernelkit.patch(model, precision='fp8')"
    assert row["measured_ms"] == pytest.approx(2 * 0.3) and row["step_before_ms"] == after.step_ms
    assert row["gpu_after_ms"] == pytest.approx(after.gpu_ms - 0.6)
    assert row["fallbacks"] == 1 and "multiples of 16" in row["fallback_reasons"][0][0]
    assert "2 decoder Linear(s) in fp8" in row["findings"][0]
    console = Console(width=240, record=True)
    print_patch_comparison(comp, console)
    out = console.export_text()
    fp8_line = next(line for line in out.splitlines() if line.lstrip("│ ").startswith("fp8"))
    assert "0.600" in fp8_line and "decoder Linear(s) in fp8" in fp8_line, out
    assert patch_comparison(object(), (), H100, before, Thresholds(), measure=measure)[0]["fp8"] is None


def test_cli_precision_fp8_needs_patch(tmp_path):
    res = CliRunner().invoke(app, ["profile", "--example", "llama", "--gpu", "h100", "--precision", "fp8",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 2 and "add --patch" in res.output
    res = CliRunner().invoke(app, ["profile", "--example", "llama", "--gpu", "h100", "--precision", "fp4",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 2 and "one of 'bf16', 'fp8'" in res.output
