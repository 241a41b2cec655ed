import json

import pytest
import torch
from typer.testing import CliRunner

from kernelkit.cli import app
from kernelkit.hw import DATASHEETS, Ceilings
from kernelkit.profile import Thresholds, profile
from kernelkit.profile.analysis import analyze
from kernelkit.profile.costs import op_cost
from kernelkit.profile.examples import build_example
from kernelkit.profile.trace import OpRecord
from torch.utils._python_dispatch import TorchDispatchMode

H100 = Ceilings.from_spec(DATASHEETS["h100-sxm"])


class _Costs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen[func._schema.name] = op_cost(func, args, kwargs or {}, out)
        return out


def test_cost_models_match_hand_counts():
    a, b, bias = torch.randn(64, 128), torch.randn(128, 32), torch.randn(32)
    q = torch.randn(2, 4, 16, 8)
    x = torch.randn(16, 256)
    with _Costs() as m:
        a @ b
        torch.addmm(bias, a, b)
        torch.bmm(torch.randn(3, 5, 7), torch.randn(3, 7, 11))
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.nn.functional.layer_norm(x, (256,))
        x + x
    s = m.seen
    assert s["aten::mm"].flops == 2 * 64 * 128 * 32 and s["aten::mm"].bytes == 4 * (64 * 128 + 128 * 32 + 64 * 32)
    assert s["aten::addmm"].flops == 2 * 64 * 128 * 32 and s["aten::addmm"].bytes == 4 * (32 + 64 * 128 + 128 * 32 + 64 * 32)
    assert s["aten::bmm"].flops == 2 * 3 * 5 * 7 * 11
    sdpa = next(v for k, v in s.items() if "scaled_dot_product" in k)
    assert sdpa.flops == 4 * 2 * 4 * 16 * 16 * 8 / 2
    ln = next(v for k, v in s.items() if "layer_norm" in k)
    assert ln.bytes >= 2 * 16 * 256 * 4  # x read, y written (+ mean/rstd outputs)
    # x + x reads one tensor once and writes one
    assert s["aten::add"].bytes == 2 * 16 * 256 * 4 and s["aten::add"].flops == 16 * 256


def _rec(op, module, ms, flops, nbytes, step=0, ins=(), outs=(), shapes=((8,),)):
    return OpRecord(op=op, module=module, shapes=shapes, dtypes=("bfloat16",), flops=flops, bytes=nbytes,
                    dtype_key="bf16", step=step, ms=ms, in_keys=tuple(k for k, _ in ins),
                    in_sizes=tuple(b for _, b in ins), out_keys=tuple(k for k, _ in outs),
                    out_sizes=tuple(b for _, b in outs))


def fixture_records():
    """A saved 'trace' of two steps: a big GEMM near peak, an eager RMSNorm chain (pow, mean, rsqrt, mul,
    mul) far off the roof, a softmax at the roof, and 200 tiny adds."""
    n = 16384 * 4096 * 2  # bytes of one bf16 activation
    recs = []
    for step in range(2):
        gemm_flops = 2 * 8192**3
        recs.append(_rec("aten::mm", "mlp:Linear", 1.60, gemm_flops, 3 * 8192 * 8192 * 2, step))
        # the chain: x -> pow -> mean -> rsqrt -> mul(x) -> mul(w)
        recs += [_rec("aten::pow", "norm:LlamaRMSNorm", 0.30, n / 2, 2 * n, step, ins=[("x", n)], outs=[("p", n)]),
                 _rec("aten::mean", "norm:LlamaRMSNorm", 0.20, n / 2, n, step, ins=[("p", n)], outs=[("m", 64)]),
                 _rec("aten::rsqrt", "norm:LlamaRMSNorm", 0.01, 32, 128, step, ins=[("m", 64)], outs=[("r", 64)]),
                 _rec("aten::mul", "norm:LlamaRMSNorm", 0.30, n / 2, 2 * n, step, ins=[("x", n), ("r", 64)], outs=[("y", n)]),
                 _rec("aten::mul", "norm:LlamaRMSNorm", 0.30, n / 2, 2 * n, step, ins=[("y", n), ("w", 8192)],
                      outs=[("z", n)])]
        recs.append(_rec("aten::mm", "attn:Linear", 1.60, gemm_flops, 3 * 8192 * 8192 * 2, step))
        recs.append(_rec("aten::_softmax", "attn:Softmax", 0.095, n / 2, 2 * n, step))
        recs.append(_rec("aten::mm", "out:Linear", 1.60, gemm_flops, 3 * 8192 * 8192 * 2, step))
        recs += [_rec("aten::add", "loop:Tiny", 0.002, 16, 128, step, shapes=((16,),)) for _ in range(200)]
    return recs


def test_analysis_on_a_saved_trace():
    recs = fixture_records()
    kernel_ms = sum(r.ms for r in recs) / 2
    rep = analyze(recs, H100, steps=2, measured=True, step_ms=kernel_ms * 1.02)
    by = {(r.op, r.module): r for r in rep.rows}
    gemm = by[("aten::mm", "mlp:Linear")]
    assert gemm.regime == "compute" and gemm.pct_roof > 60
    assert by[("aten::_softmax", "attn:Softmax")].regime == "memory"
    assert by[("aten::pow", "norm:LlamaRMSNorm")].regime == "memory"
    assert by[("aten::add", "loop:Tiny")].regime == "overhead"
    # the eager norm is hot, off the roof, stable, and the registry has a kernel for its module class
    pow_row = by[("aten::pow", "norm:LlamaRMSNorm")]
    assert pow_row.verdict.startswith("KERNEL") and pow_row.recommendation == "rms_norm"
    assert by[("aten::_softmax", "attn:Softmax")].verdict.startswith("leave")  # at the roof: no room
    assert rep.attributed_pct == pytest.approx(100 / 1.02, rel=1e-3)
    # the chain's fused floor counts only x in, w in, z out
    chain = next(c for c in rep.chains if "aten::pow" in c["ops"])
    assert chain["n"] == 5
    assert chain["bytes_fused"] == pytest.approx(16384 * 4096 * 2 * 2 + 8192)
    assert any("fusible chain of 5" in f for f in rep.findings)


def test_overhead_finding_from_kernel_gaps():
    recs = [_rec("aten::add", "m:Tiny", 0.002, 16, 128, shapes=((16,),)) for _ in range(100)]
    spans = [(i * 10.0, i * 10.0 + 2.0) for i in range(100)]  # 2 us kernels every 10 us: 80% idle
    rep = analyze(recs, H100, steps=1, measured=True, spans=spans, step_ms=(spans[-1][1] - spans[0][0]) / 1e3,
                  thresholds=Thresholds(overhead_pct=10))
    assert rep.overhead["bound"] and rep.overhead["idle_pct"] == pytest.approx(80, abs=1)
    assert any("CUDA graphs" in f for f in rep.findings)


def test_thresholds_change_the_verdict():
    recs = fixture_records()
    strict = analyze(recs, H100, steps=2, measured=True, step_ms=10, thresholds=Thresholds(hot_pct=50))
    assert not any(r.verdict.startswith("KERNEL") for r in strict.rows)


def test_predicted_mode_end_to_end_on_the_example(tmp_path):
    model, inputs = build_example("llama", device="meta", tiny=False)
    rep = profile(model, inputs, gpu="h100")
    assert not rep.measured and rep.gpu.startswith("NVIDIA H100")
    assert all(r.ms is None for r in rep.rows)
    ops = {r.op for r in rep.rows}
    assert {"aten::mm", "aten::embedding"} <= ops
    assert rep.rows[0].regime in ("compute", "memory")
    assert any(r.recommendation == "cross_entropy" or r.recommendation == "log_softmax" for r in rep.rows)
    from kernelkit.profile.report import write_reports

    paths = write_reports(rep, H100, tmp_path)
    doc = json.loads(paths["json"].read_text())
    assert doc["measured"] is False and len(doc["rows"]) == len(rep.rows)
    assert paths["png"].stat().st_size > 5000 and "data:image/png;base64," in paths["html"].read_text()


def test_cli_example_predicted(tmp_path):
    res = CliRunner().invoke(app, ["profile", "--example", "llama", "--gpu", "h100", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "PREDICTED" in res.output and (tmp_path / "report.html").exists()


def test_cli_reports_a_failing_model_clearly(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("import torch\n\ndef make():\n    m = torch.nn.Linear(4, 4)\n    return m, (torch.randn(2, 5),)\n")
    res = CliRunner().invoke(app, ["profile", f"{f}:make", "--gpu", "h100", "--out", str(tmp_path / "r")])
    assert res.exit_code == 2
    assert "failed" in res.output and "RuntimeError" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["profile", f"{f}:nope", "--gpu", "h100"])
    assert res.exit_code != 0 and "no function 'nope'" in res.output


@pytest.mark.gpu
def test_gpu_attribution_and_regimes():
    """On the GPU: per-op kernel time covers >= 95% of the step's GPU time; regimes on labelled cases."""
    class Labelled(torch.nn.Module):
        def forward(self, a, b, x):
            y = a @ b
            s = torch.softmax(x, -1)
            t = torch.ones(16, device=x.device)
            for _ in range(200):
                t = t + 1
            return y.float().mean() + s.float().mean() + t.mean()

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    rep = profile(Labelled(), (a, a, x), steps=3, backward=False)
    assert rep.attributed_pct >= 95, rep.attributed_pct
    by = {r.op: r for r in rep.rows}
    assert by["aten::mm"].regime == "compute" and by["aten::mm"].pct_roof > 70
    assert by["aten::_softmax"].regime == "memory"
    assert by["aten::add"].regime == "overhead"


def test_tensor_identity_survives_address_reuse():
    from kernelkit.profile.trace import _TensorIds

    ids = _TensorIds()
    a = torch.empty(1024)
    first = ids(a)
    assert ids(a) == first
    del a
    b = torch.empty(1024)  # the allocator may hand back the same address: identity must still differ
    assert ids(b) != first
