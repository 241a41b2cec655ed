"""kernelkit profile on the GPU (run by the lead on the H100): per-op attribution covers the step, and the
regimes come out right on labelled cases: a large bf16 GEMM compute-bound near peak, softmax and norms
memory-bound, a loop of 200 tiny adds overhead-bound."""

import json

import pytest
import torch
import torch.nn as nn
from typer.testing import CliRunner

from kernelkit.profile import profile
from kernelkit.profile.examples import build_example
from kernelkit.profile.report import write_reports

pytestmark = pytest.mark.gpu


class _Gemm(nn.Module):
    def forward(self, a, b):
        return a @ b


class _Norms(nn.Module):
    def __init__(self, dim):
        super().__init__()
        kw = dict(device="cuda", dtype=torch.bfloat16)
        self.layer_norm = nn.LayerNorm(dim, **kw)
        self.rms_norm = nn.RMSNorm(dim, **kw)

    def forward(self, x):
        return torch.softmax(x, -1), self.layer_norm(x), self.rms_norm(x)


class _TinyLoop(nn.Module):
    def forward(self, x):
        for _ in range(200):
            x = x + 1
        return x


def test_large_bf16_gemm_is_compute_bound_near_peak():
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rep = profile(_Gemm(), (a, b), steps=3, backward=False)
    (mm,) = [r for r in rep.rows if r.op == "aten::mm"]
    assert mm.calls == 1 and mm.regime == "compute"
    assert mm.pct_roof > 75, f"{mm.tflops:.0f} TFLOP/s is {mm.pct_roof:.0f}% of the measured bf16 peak"
    assert mm.verdict.startswith("leave") and mm.room is False
    assert rep.attributed_pct >= 95


def test_softmax_and_norms_are_memory_bound():
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    rep = profile(_Norms(4096), (x,), steps=3, backward=False)
    soft = next(r for r in rep.rows if r.op == "aten::_softmax")
    assert soft.regime == "memory" and soft.pct_roof > 25 and soft.recommendation == "softmax"
    ln = next(r for r in rep.rows if r.module == "layer_norm:LayerNorm" and r.floor_ms > 0.01)
    assert ln.regime == "memory" and ln.recommendation == "layer_norm"
    rms = [r for r in rep.rows if r.module == "rms_norm:RMSNorm"]
    assert rms and all(r.regime in ("memory", "overhead") for r in rms) and any(r.regime == "memory" for r in rms)
    assert all(r.recommendation == "rms_norm" for r in rms)
    assert rep.attributed_pct >= 95


def test_a_loop_of_tiny_ops_is_overhead_bound():
    rep = profile(_TinyLoop(), (torch.zeros(16, device="cuda"),), steps=3, backward=False)
    adds = [r for r in rep.rows if r.op == "aten::add"]
    assert sum(r.calls for r in adds) == 200 and all(r.regime == "overhead" for r in adds)
    assert all(r.verdict.startswith("leave") for r in adds)
    assert rep.overhead["bound"] and rep.overhead["idle_pct"] > 50, rep.overhead
    assert rep.overhead["kernels_per_step"] >= 200 and rep.overhead["graph_gain_ms"] > 0
    assert any("CUDA graphs" in f for f in rep.findings)
    assert rep.attributed_pct >= 95


def test_attribution_covers_the_llama_step(tmp_path):
    model, inputs = build_example("llama", "cuda")
    rep = profile(model, inputs, steps=3)
    assert rep.measured and rep.attributed_pct >= 95, (rep.attributed_pct, rep.unattributed[:3])
    # the instrumented run's kernels against the plain run's busy time: the same kernels, timed twice
    kernel_ms = sum(r.ms for r in rep.rows)
    assert 0.85 < kernel_ms / rep.overhead["busy_ms"] < 1.15, (kernel_ms, rep.overhead)
    phases = {r.phase for r in rep.rows}
    assert phases == {"fwd", "bwd"}
    norm_bwd = [r for r in rep.rows if r.phase == "bwd" and r.module.endswith(":LlamaRMSNorm")]
    assert norm_bwd and all(r.recommendation == "rms_norm" for r in norm_bwd)
    attn = {r.op for r in rep.rows if r.module.endswith(":Attention")}
    assert any("attention" in op and "backward" not in op for op in attn), attn
    mms = [r for r in rep.rows if r.op == "aten::mm" and r.share_pct > 1]
    assert mms and all(r.regime == "compute" for r in mms)
    kernels = {k["kernel"]: k for k in rep.kernels}
    assert kernels["rms_norm"]["today_ms"] > kernels["rms_norm"]["fused_floor_ms"]
    paths = write_reports(rep, _ceilings(), tmp_path, trace=rep.trace)
    doc = json.loads(paths["json"].read_text())
    assert doc["measured"] and doc["attributed_pct"] >= 95 and doc["overhead"]["kernels_per_step"] > 100
    assert "data:image/png;base64," in paths["html"].read_text()


def test_cli_measures_the_example(tmp_path):
    from kernelkit.cli import app

    res = CliRunner().invoke(app, ["profile", "--example", "llama", "--steps", "2", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "measured" in res.output and (tmp_path / "report.html").exists()


def test_predicted_mode_with_cuda_tensors():
    model, inputs = build_example("llama", "cuda")
    rep = profile(model, inputs, gpu="h100")
    assert not rep.measured and any(r.op == "aten::_scaled_dot_product_flash_attention" for r in rep.rows)


def _ceilings():
    from kernelkit.hw.ceilings import ceilings_for

    return ceilings_for(None)[0]
