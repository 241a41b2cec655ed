"""kernelkit profile on the CPU: cost models against hand counts, the analysis on a saved trace, the Kineto
trace reader on a synthetic trace, module paths forward and backward, predicted mode end to end, the CLI."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from kernelkit.commands.cli import app
from kernelkit.hw import DATASHEETS, Ceilings
from kernelkit.profile import Thresholds, Trace, analyze, profile
from kernelkit.profile.analysis import _busy_us, true_bytes
from kernelkit.profile.costs import op_cost
from kernelkit.profile.examples import build_example
from kernelkit.profile.kineto import attribute
from kernelkit.profile.report import to_html, write_reports
from kernelkit.profile.trace import OpRecord, _TensorIds, predict, profiled_steps

H100 = Ceilings.from_spec(DATASHEETS["h100-sxm"])
FIXTURE = Path(__file__).parent / "fixtures" / "profile_trace.json"


class _Costs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen.setdefault(func._schema.name, op_cost(func, args, kwargs or {}, out))
        return out


def test_cost_models_matmuls_and_attention():
    a, b, bias = torch.randn(64, 128), torch.randn(128, 32), torch.randn(32)
    q, kv = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 24, 8)  # GQA: 4 query heads over 2 kv heads
    with _Costs() as m:
        a @ b
        torch.addmm(bias, a, b)
        torch.bmm(torch.randn(3, 5, 7), torch.randn(3, 7, 11))
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    s = m.seen
    assert s["aten::mm"].flops == 2 * 64 * 128 * 32
    assert s["aten::mm"].bytes == 4 * (64 * 128 + 128 * 32 + 64 * 32)
    assert s["aten::addmm"].flops == 2 * 64 * 128 * 32
    assert s["aten::addmm"].bytes == 4 * (32 + 64 * 128 + 128 * 32 + 64 * 32)
    assert s["aten::bmm"].flops == 2 * 3 * 5 * 7 * 11 and s["aten::bmm"].bytes == 4 * 3 * (5 * 7 + 7 * 11 + 5 * 11)
    assert s["aten::mm"].dtype in ("fp32", "tf32")
    sdpa = next(v for k, v in s.items() if "scaled_dot_product" in k)
    # QK^T and PV over 4 heads, causal: half the square
    assert sdpa.flops == 2 * (2 * 2 * 4 * 16 * 24 * 8) / 2


def test_attention_flops_match_torch_and_take_gqa_shapes():
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    from kernelkit.profile.costs import attention_flops

    q, k, v = (2, 8, 100, 64), (2, 8, 77, 64), (2, 8, 77, 32)
    assert attention_flops(q, k, v) == sdpa_flop_count(q, k, v)
    assert attention_flops(q, k, v, backward=True) == sdpa_backward_flop_count(q[:-1] + (32,), q, k, v)
    # GQA (2 K/V heads under 8 query heads), which torch's formula refuses: the query heads' work
    assert attention_flops(q, (2, 2, 77, 64), (2, 2, 77, 32), causal=True) == sdpa_flop_count(q, k, v) / 2
    with pytest.raises(ValueError, match="do not fit"):
        attention_flops(q, (2, 2, 77, 32), v)


def test_cost_models_norms_softmax_and_elementwise():
    x, w, bb = torch.randn(16, 256), torch.randn(256), torch.randn(256)
    with _Costs() as m:
        F.layer_norm(x, (256,), w, bb)
        torch.softmax(x, -1)
        x + x  # one tensor read once
        x * w  # w broadcast: its 256 elements are read once, not 16 times
        x.expand(3, 16, 256) + 1.0  # a stride-0 input counts its storage once
        y = x.clone()
        y.add_(x)  # in place: reads y and x, writes y
        y.fill_(1.0)  # writes only
    s = m.seen
    n = 16 * 256
    ln = s["aten::native_layer_norm"]
    assert ln.flops == 7 * n  # the registry's count for layer_norm
    assert ln.bytes == 4 * (n + 256 + 256) + 4 * (n + 16 + 16)  # x, w, b in; y, mean, rstd out
    assert s["aten::_softmax"].flops == 5 * n and s["aten::_softmax"].bytes == 2 * 4 * n
    assert s["aten::add.Tensor" if "aten::add.Tensor" in s else "aten::add"].bytes == 2 * 4 * n
    assert s["aten::mul"].bytes == 4 * (n + 256 + n) and s["aten::mul"].flops == n
    assert s["aten::add_"].bytes == 3 * 4 * n
    assert s["aten::fill_"].bytes == 4 * n


def test_cost_of_an_expanded_input():
    x = torch.randn(16, 256)
    with _Costs() as m:
        x.expand(3, 16, 256).mul(2.0)
    assert m.seen["aten::mul"].bytes == 4 * 16 * 256 + 4 * 3 * 16 * 256


def _fixture_report(**th):
    # tables=None: no benchmark tables, so projections take the roofline assumption (90% of the fused floor)
    return analyze(Trace.load(FIXTURE), H100, Thresholds(**th) if th else None, tables=None)


def test_analysis_on_a_saved_trace():
    rep = _fixture_report()
    assert rep.measured and rep.steps == 2
    assert rep.gpu_ms == pytest.approx(7.148) and rep.attributed_pct == pytest.approx(100 * 7.048 / 7.148)
    by = {(r.op, r.module, r.shapes): r for r in rep.rows}
    gemm = by[("aten::mm", "mlp.up_proj:Linear", "8192x8192 8192x8192")]
    assert gemm.regime == "compute" and gemm.pct_roof == pytest.approx(100 * 2 * 8192**3 / 989.4e12 / 1.3e-3, rel=1e-6)
    assert gemm.verdict.startswith("leave") and gemm.room is False  # 85% of the roof: no room
    assert gemm.tflops == pytest.approx(2 * 8192**3 / 1.3e-3 / 1e12)

    soft = by[("aten::_softmax", "attn:Attention", "16384x4096")]
    assert soft.regime == "memory" and soft.room is False and soft.recommendation == "softmax"
    assert soft.saving_ms == 0.0  # already faster than a kernel at 90% of the roof
    pow_row = by[("aten::pow", "norm:LlamaRMSNorm", "16384x4096")]
    assert pow_row.regime == "memory" and pow_row.verdict.startswith("KERNEL: room yes, hot yes, stable yes")
    assert pow_row.recommendation == "rms_norm" and pow_row.recommended_via == "module"
    assert pow_row.gbps == pytest.approx(2 * 16384 * 4096 * 2 / 150e-6 / 1e9)
    assert by[("aten::rsqrt", "norm:LlamaRMSNorm", "16384x1")].regime == "overhead"
    tiny = by[("aten::add", "loop:Tiny", "16")]
    assert tiny.regime == "overhead" and tiny.calls == 30 and "launch-bound" in tiny.verdict
    router = [r for r in rep.rows if r.module == "router:Router"]
    assert len(router) == 5 and all(r.distinct_shapes == 5 and r.hot and r.room and not r.stable for r in router)
    assert all(r.verdict.startswith("leave") for r in router)  # fails only (c), stable shape
    bwd = by[("aten::_softmax_backward_data", "attn:Attention", "16384x4096 16384x4096")]
    assert bwd.phase == "bwd" and bwd.recommendation == "softmax"  # the registry names the forward op

    kernels = {(k["kernel"], k["in"]): k for k in rep.kernels}
    norm = kernels[("rms_norm", "LlamaRMSNorm")]
    n = 16384 * 4096 * 2
    assert norm["today_ms"] == pytest.approx(0.523) and norm["instances"] == 1
    assert norm["fused_floor_ms"] == pytest.approx((2 * n + 8192) / 3350e9 * 1e3)
    assert norm["saving_ms"] == pytest.approx(0.523 - norm["fused_floor_ms"] / 0.9)
    glu = kernels[("swiglu", "MLP")]
    assert glu["via"] == "pattern" and glu["replaces"] == "silu+mul"
    assert glu["fused_floor_ms"] == pytest.approx(3 * n / 3350e9 * 1e3)  # g, u in; h out
    assert kernels[("softmax", "Router")]["distinct_shapes"] == 5

    chain = next(c for c in rep.chains if "aten::pow" in c["ops"])
    assert chain["n"] == 5 and chain["bytes_fused"] == 2 * n + 8192 and chain["covered_by"] == ["rms_norm"]
    glu_chain = next(c for c in rep.chains if "aten::silu" in c["ops"])
    assert glu_chain["recommendation"] == "swiglu"
    adds = next(c for c in rep.chains if c["modules"] == ["loop:Tiny"])
    assert adds["n"] == 30 and adds["bytes_fused"] == 128  # t0 in, t30 out: the rest stays on chip

    o = rep.overhead
    assert o["bound"] and o["kernels_per_step"] == 45.5
    assert o["busy_ms"] == pytest.approx(7.048) and 10 < o["idle_pct"] < 12
    assert o["graph_gain_ms"] == pytest.approx(o["idle_ms"] - 45.5e-3)
    assert rep.unattributed[0]["ms"] == pytest.approx(0.1)
    text = "\n".join(rep.findings)
    assert "kernelkit.rms_norm replaces LlamaRMSNorm" in text and "5 distinct shapes" in text
    assert "CUDA graphs" in text and "reduce-overhead" in text
    assert "fusible chain of 5" not in text  # the rms_norm finding already covers it


def test_thresholds_change_the_verdicts():
    assert not any(r.verdict.startswith("KERNEL") for r in _fixture_report(hot_pct=50).rows)
    loose = _fixture_report(max_shapes=5, room=1.1)
    assert all(r.verdict.startswith("KERNEL") for r in loose.rows if r.module == "router:Router")
    assert not _fixture_report(overhead_pct=50).overhead["bound"]


def test_trace_json_round_trip(tmp_path):
    tr = Trace.load(FIXTURE)
    again = Trace.load(tr.save(tmp_path / "t.json"))
    assert again.records == tr.records and again.device_us == tr.device_us
    assert analyze(again, H100).to_json() == analyze(tr, H100).to_json()
    with pytest.raises(ValueError, match="not a kernelkit trace"):
        Trace.from_json({"format": "something else"})


def test_analysis_of_plain_records_without_a_timeline():
    recs = [OpRecord("aten::add", "m:Tiny", "fwd", 0, ((16,),), ("float32",), 16, 128, "fp32",
                     kernels=[[i * 10.0, i * 10.0 + 2]]) for i in range(100)]
    rep = analyze(recs, H100, Thresholds(overhead_pct=10))
    assert rep.measured and rep.overhead["idle_pct"] == pytest.approx(100 * (1 - 200 / 992), rel=1e-6)
    assert any("CUDA graphs" in f for f in rep.findings)


def test_a_row_above_the_measured_ceiling_says_so():
    # Against a memory roof of 3300 GB/s (the best of copy, add, sum; the copy alone 3000) and 800 TF/s: aten::add of
    # 4x2048x2048 bf16 (100 MB, partly in L2 after the op that wrote it) at 3400 GB/s reads 103%, an LM-head input
    # gradient at 856 TF/s 107%; rows at 101% and 95% carry no note.
    c = Ceilings(gpu="Fake GPU", fingerprint={"source": "measured"}, copy_gbps=3000.0, tflops={"bf16": 800.0},
                 launch_us=4.0, mem_gbps=3300.0)
    n, gemm = 4 * 2048 * 2048, 2 * 8192 * 2048 * 32000

    def r(op, module, flops, nbytes, ms):
        return OpRecord(op, module, "fwd", 0, ((4, 2048, 2048),), ("bfloat16",), flops, nbytes, "bf16",
                        kernels=[[0.0, ms * 1e3]])

    recs = [r("aten::add", "a:Add", n, 6 * n, 6 * n / 3400e9 * 1e3),
            r("aten::mul", "b:Mul", n, 6 * n, 6 * n / 3333e9 * 1e3),
            r("aten::silu", "c:Silu", n, 4 * n, 4 * n / 3135e9 * 1e3),
            r("aten::mm", "lm_head:Linear", gemm, 1e8, gemm / 856e12 * 1e3)]
    rows = {row.op: row for row in analyze(recs, c, tables=None).rows}
    assert rows["aten::add"].pct_roof == pytest.approx(100 * 3400 / 3300)
    assert rows["aten::mm"].pct_roof == pytest.approx(100 * 856 / 800)
    note = "above the measured ceiling: L2-resident inputs or clocks above the ceiling's"
    for op in ("aten::add", "aten::mm"):
        assert rows[op].verdict.endswith(note) and rows[op].verdict.split(":")[0] in ("KERNEL", "leave"), rows[op]
    for op in ("aten::mul", "aten::silu"):  # 101% and 95%
        assert rows[op].pct_roof < 102 and "ceiling" not in rows[op].verdict, rows[op]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 20)), min_size=1, max_size=12))
def test_busy_time_is_the_union_of_intervals(spans):
    kernels = [(float(s), float(s + d)) for s, d in spans]
    covered = {t for s, e in kernels for t in range(int(s), int(e))}
    assert _busy_us(kernels) == len(covered)


def _x(name, ts, dur, cat="user_annotation", tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1 if cat != "kernel" else 0, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def test_kineto_attribution_on_a_synthetic_trace():
    ev = [
        _x("kkstep::0", 0, 1000),
        _x("kkop::0", 10, 20), _x("aten::mm", 11, 18, "cpu_op", **{"External id": 5}),
        _x("cudaLaunchKernel", 15, 3, "cuda_runtime", correlation=100, **{"External id": 5}),
        _x("sm90_gemm", 40, 300, "kernel", tid=7, correlation=100, **{"External id": 5}),
        # the backward's thread, a Triton kernel launched through the driver API
        _x("kkop::1", 50, 20, tid=2), _x("cuLaunchKernelEx", 55, 3, "cuda_driver", tid=2, correlation=101),
        _x("triton_red", 345, 50, "kernel", tid=7, correlation=101),
        # no launch event: tied by External id to the innermost op
        _x("kkop::2", 80, 10), _x("aten::add", 81, 5, "cpu_op", **{"External id": 9}),
        _x("elementwise", 400, 5, "kernel", tid=7, correlation=555, **{"External id": 9}),
        # launched outside every kkop range: unattributed, named by its op
        _x("aten::copy_", 95, 5, "cpu_op", **{"External id": 12}),
        _x("cudaMemcpyAsync", 96, 2, "cuda_runtime", correlation=102, **{"External id": 12}),
        _x("Memcpy DtoD", 410, 10, "gpu_memcpy", tid=7, correlation=102, **{"External id": 12}),
        _x("kkop::0", 40, 300, "gpu_user_annotation", tid=7),  # GPU-side copy of the range: ignored
        _x("warm_up", 5000, 5, "kernel", tid=7, correlation=999),  # outside every step
        _x("kkstep::1", 2000, 500),
        _x("kkop::3", 2010, 10), _x("cudaLaunchKernel", 2012, 2, "cuda_runtime", correlation=103),
        _x("k3", 2100, 7, "kernel", tid=7, correlation=103),
        {"ph": "s", "id": 100, "pid": 1, "tid": 1, "ts": 15, "cat": "ac2g", "name": "ac2g"},
    ]
    att = attribute(ev)
    assert dict(att.per_op) == {0: [(40, 340)], 1: [(345, 395)], 2: [(400, 405)], 3: [(2100, 2107)]}
    assert dict(att.unattributed) == {"aten::copy_ / Memcpy DtoD": 10}
    assert [len(s["kernels"]) for s in att.steps] == [4, 1] and att.steps[0]["last_end_us"] == 420


def test_op_ranges_match_the_records(tmp_path):
    """Each `kkop::<i>` range of an instrumented step holds the aten op of record i (on the CPU profiler)."""
    from torch.profiler import ProfilerActivity

    model, inputs = build_example("llama", device="cpu", tiny=True)
    prof, records, ran = profiled_steps(model, inputs, 1, True, True, [ProfilerActivity.CPU], lambda: None)
    assert ran and records and all(r is not None for r in records)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    ev = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    ranges = {int(e["name"].split("::")[1]): e for e in ev if e["name"].startswith("kkop::")}
    assert sorted(ranges) == list(range(len(records)))
    ops = [e for e in ev if e.get("cat") == "cpu_op"]
    for i in range(0, len(records), 7):
        r = ranges[i]
        inside = {(e["name"], e["tid"]) for e in ops
                  if r["ts"] <= e["ts"] <= r["ts"] + r["dur"] and e["tid"] == r["tid"]}
        assert (records[i].op, r["tid"]) in inside, (i, records[i].op)
    assert {r.phase for r in records} == {"fwd", "bwd"}


def test_module_paths_forward_and_backward():
    model, inputs = build_example("llama", device="cpu", tiny=True)
    tr = predict(model, inputs)
    recs = tr.records
    assert all(p.grad is None for p in model.parameters())  # predicted mode leaves no gradients behind
    flash = [r for r in recs if "flash_attention" in r.op]
    assert [r.phase for r in flash] == ["fwd", "fwd", "bwd", "bwd"]
    assert all(r.module.endswith(":Attention") for r in flash)
    assert not any(r.op in ("aten::bmm", "aten::_softmax") for r in recs)  # no math decomposition of attention
    bwd = [r for r in recs if r.phase == "bwd"]
    assert {r.module for r in bwd if r.op == "aten::mm"} >= {"lm_head:Linear", "layers.0.mlp.down_proj:Linear"}
    norm_bwd = [r for r in bwd if r.module == "layers.1.post_attention_layernorm:LlamaRMSNorm"]
    assert {"aten::mul", "aten::sum", "aten::pow"} <= {r.op for r in norm_bwd}
    assert next(r for r in bwd if r.op == "aten::silu_backward").module == "layers.1.mlp:MLP"
    assert next(r for r in bwd if r.op == "aten::nll_loss_backward").module == "<model>:TinyLlama"


def test_views_share_their_base_identity():
    class M(torch.nn.Module):
        def forward(self, x, w):
            y = (x * w).view(-1, 8)  # a view of a tensor the chain produced
            return (y + 1.0).relu().sum()

    x, w = torch.randn(4, 16), torch.randn(16)
    recs = [r for r in predict(M(), (x, w), backward=False).records if r.op in ("aten::mul", "aten::add", "aten::relu")]
    assert len(recs) == 3
    assert true_bytes(recs) == 4 * (64 + 16) + 4 * 64  # x, w in; relu's output out


def test_tensor_identity_survives_address_reuse():
    ids = _TensorIds()
    a = torch.empty(1024)
    first = ids(a)
    assert ids(a) == first
    del a
    b = torch.empty(1024)  # the allocator may hand back the same address: identity must still differ
    assert ids(b) != first


@pytest.mark.parametrize("name,head_dim,heads,layers,vocab", [("hf-llama3-8b", 128, 32, 2, 128256),
                                                              ("hf-llama3.2-1b", 64, 32, 4, 128256)])
def test_hf_examples_have_the_named_models_shapes(name, head_dim, heads, layers, vocab):
    # Issue 28 profiles the patch at both head dims: 8B's layers at 128, Llama-3.2-1B's at 64.
    model, inputs = build_example(name, device="meta", tiny=False)
    c = model.config
    assert (c.hidden_size // c.num_attention_heads, c.num_attention_heads, c.num_hidden_layers, c.vocab_size) == \
        (head_dim, heads, layers, vocab)
    assert inputs["input_ids"].shape[1] == 2048 and inputs["labels"].shape == inputs["input_ids"].shape


def test_predicted_mode_end_to_end_on_the_example(tmp_path):
    model, inputs = build_example("llama", device="meta", tiny=False)
    rep = profile(model, inputs, gpu="h100")
    assert not rep.measured and rep.gpu.startswith("NVIDIA H100") and rep.attributed_pct is None
    assert all(r.ms is None and r.room is None for r in rep.rows)
    ops = {r.op for r in rep.rows}
    assert {"aten::mm", "aten::embedding", "aten::_scaled_dot_product_flash_attention",
            "aten::_scaled_dot_product_flash_attention_backward"} <= ops
    top = rep.rows[0]
    assert top.op == "aten::mm" and top.module.startswith("lm_head") and top.regime == "compute"
    kernels = {k["kernel"]: k for k in rep.kernels}
    assert kernels["rms_norm"]["instances"] == 9 and kernels["rms_norm"]["phases"] == "fwd+bwd"
    assert kernels["rms_norm"]["fused_floor_ms"] < kernels["rms_norm"]["floor_sum_ms"] / 3  # eager fp32 upcasts
    assert "cross_entropy" in kernels and kernels["swiglu"]["instances"] == 4
    assert rep.chains and rep.overhead["predicted"]
    assert any(f.startswith("kernelkit.rms_norm") for f in rep.findings)
    paths = write_reports(rep, H100, tmp_path, trace=rep.trace)
    doc = json.loads(paths["json"].read_text())
    assert doc["measured"] is False and len(doc["rows"]) == len(rep.rows) and doc["kernels"]
    assert Trace.load(paths["trace"]).records[0].op == rep.trace.records[0].op
    page = paths["html"].read_text()
    assert paths["png"].stat().st_size > 5000 and "data:image/png;base64," in page
    assert "http://" not in page.replace("data:", "") and "<script" not in page and "<link" not in page
    assert "PREDICTED" in page and "<table>" in page


def test_html_escapes_names():
    rep = _fixture_report()
    rep.rows[0].module = "<b>evil</b>:Linear"
    assert "<b>evil</b>" not in to_html(rep, None)


def test_cli_example_predicted(tmp_path):
    res = CliRunner().invoke(app, ["profile", "--example", "llama", "--gpu", "h100", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "PREDICTED" in res.output and "report written" in res.output
    assert {p.name for p in tmp_path.iterdir()} == {"profile.json", "trace.json", "roofline.png", "report.html"}


def test_cli_target_json_only(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("import torch\n\ndef make():\n    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),"
                 " torch.nn.Linear(64, 8))\n    return m, torch.randn(16, 32)\n")
    out = tmp_path / "r"
    res = CliRunner().invoke(app, ["profile", f"{f}:make", "--gpu", "a100", "--json-only", "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "profile.json").read_text())
    assert doc["gpu"].startswith("NVIDIA A100") and {r["module"] for r in doc["rows"]} >= {"0:Linear", "2:Linear"}
    assert not (out / "report.html").exists() and "profile.json" in res.output


@pytest.mark.parametrize("body,func,expect", [
    ("import torch\n\ndef make():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 5),)\n", "make",
     ["running the model from", ":make failed", "RuntimeError", "mat1 and mat2"]),
    ("def make():\n    raise KeyError('no weights here')\n", "make",
     ["make() failed while building", "KeyError", "no weights"]),
    ("def make(:\n", "make", ["importing", "failed", "SyntaxError"]),
    ("def make():\n    return 3\n", "make", ["must return (model, inputs)", "int"]),
    ("def make():\n    return 3, 4\n", "nope", ["has no function 'nope'"]),
])
def test_cli_reports_a_failing_model_in_one_paragraph(tmp_path, body, func, expect):
    f = tmp_path / "broken.py"
    f.write_text(body)
    res = CliRunner().invoke(app, ["profile", f"{f}:{func}", "--gpu", "h100", "--out", str(tmp_path / "r")])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "Traceback" not in text and str(f) in text
    for e in expect:
        assert e in text, (e, text)


def test_cli_rejects_bad_arguments(tmp_path):
    runner = CliRunner()
    assert runner.invoke(app, ["profile"]).exit_code == 2
    res = runner.invoke(app, ["profile", "--example", "llama", "--gpu", "tpu9"])
    assert res.exit_code == 2 and "not in the datasheet table" in " ".join(res.output.split())
    res = runner.invoke(app, ["profile", "--example", "gpt5", "--gpu", "h100"])
    assert res.exit_code == 2 and "unknown example" in res.output
    res = runner.invoke(app, ["profile", str(tmp_path / "missing.py:make"), "--gpu", "h100"])
    assert res.exit_code == 2 and "no such file" in res.output


def test_measure_wiring_on_the_cpu(monkeypatch):
    """measure() end to end without a GPU: each aten op inside a `kkop::` range (every op, in the plain
    run) gets a fake kernel as long as its CPU time, launched from its own thread."""
    from kernelkit.profile import kineto
    from kernelkit.profile.trace import measure

    real = kineto.attribute

    def fake_attribute(events):
        spans = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("kkop::")]
        extra = []
        for i, e in enumerate(x for x in events if x.get("ph") == "X" and x.get("cat") == "cpu_op"):
            inside = any(s["tid"] == e["tid"] and s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in spans)
            if spans and not inside:
                continue
            extra.append({**e, "cat": "cuda_runtime", "name": "cudaLaunchKernel", "args": {"correlation": 10**6 + i}})
            extra.append({"ph": "X", "cat": "kernel", "name": f"k_{e['name']}", "pid": 0, "tid": 7, "ts": e["ts"],
                          "dur": max(e["dur"], 0.5), "args": {"correlation": 10**6 + i}})
        return real(events + extra)

    monkeypatch.setattr(kineto, "attribute", fake_attribute)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    model, inputs = build_example("llama", device="cpu", tiny=True)
    tr = measure(model, inputs, steps=2, warmup=1)
    assert tr.measured and tr.steps == 2 and tr.backward and len(tr.timeline) == 2
    assert {r.step for r in tr.records} == {0, 1} and {r.phase for r in tr.records} == {"fwd", "bwd"}
    assert sum(bool(r.kernels) for r in tr.records) > 0.9 * len(tr.records)
    rep = analyze(tr, H100)
    assert rep.attributed_pct > 90 and rep.overhead["kernels_per_step"] > 0
    assert all(p.grad is None for p in model.parameters())
