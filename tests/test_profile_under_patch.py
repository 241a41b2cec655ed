"""`kernelkit profile --patch` profiles the model the user runs (CPU, Triton interpreter): the profiler's own
module hooks leave kernelkit.patch's fused linear cross-entropy in place (they made it fall back: the loss
was measured as log_softmax + nll_loss and the LM head's GEMMs, saving 0.000 ms), a hook of the user's
still makes it fall back, and every fallback shows its reason in the comparison and the patched report."""

from __future__ import annotations

import types

import pytest
import torch
from torch.profiler import ProfilerActivity

from kernelkit.hw import DATASHEETS, Ceilings
from kernelkit.profile import Trace, analyze
from kernelkit.profile import compare
from kernelkit.profile.report import print_patch_comparison, to_html
from kernelkit.profile.trace import profiled_steps
from tests.conftest import INTERPRET

pytest.importorskip("transformers")

from kernelkit.patch import patch, unpatch  # noqa: E402

from .test_patch import batch, close, tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="runs kernelkit's kernels: TRITON_INTERPRET=1")
H100 = Ceilings.from_spec(DATASHEETS["h100-sxm"])
FP32_ATTENTION = "dtype float32 (the kernel takes bfloat16 / float16)"


def _inputs():
    ids, labels = batch()
    return {"input_ids": ids, "labels": labels}


def _profiled(model, inputs, steps: int = 1, **_):
    """What `measure` records, on the CPU: the same module tracker and dispatch mode, no kernel times."""
    _, records, ran = profiled_steps(model, inputs, steps, True, True, [ProfilerActivity.CPU], lambda: None)
    return Trace(records, steps=steps, measured=False, backward=ran)


def test_profiler_hooks_leave_the_fused_loss_in_place():
    ref = tiny_model("llama", layers=1).train()
    model = tiny_model("llama", layers=1).train()
    report = patch(model, rms_norm=False, mlp=False, rope=False, attention=False)
    trace = _profiled(model, _inputs())
    assert report.fallbacks == {}, report.fallbacks
    ops = [r.op for r in trace.records]
    assert [r.phase for r in trace.records if r.op == "kernelkit::linear_cross_entropy"] == ["fwd", "bwd"]
    assert not [op for op in ops if "nll_loss" in op or "log_softmax" in op], ops
    assert not [r for r in trace.records if r.module.startswith("lm_head")]

    # A hook of the user's changes what lm_head computes: under the profiler too, the model's own forward runs.
    for m in (model, ref):
        m.lm_head.register_forward_hook(lambda mod, args, out: out * 1.5)
    trace = _profiled(model, _inputs())
    assert report.fallbacks == {("cross_entropy", "forward hooks on lm_head"): 1}
    assert not any(r.op == "kernelkit::linear_cross_entropy" for r in trace.records)
    close(model(**_inputs()).loss, ref(**_inputs()).loss, what="loss with a user hook")
    unpatch(model)


def test_patch_comparison_runs_the_fused_loss_and_names_each_fallback(monkeypatch):
    """The comparison's own patched runs: the loss runs fused (no fallback, the LM head's GEMMs gone), and
    fp32 attention, which the kernel does not take, falls back with its reason in the row, the total, the
    table, the HTML and the patched report's notes."""
    model, inputs = tiny_model("llama", layers=1).train(), _inputs()
    # Only the loss and the attention: two switches, three patched runs, few interpreted kernels.
    fast = types.SimpleNamespace(patch=lambda m, **sw: patch(m, **{**sw, "rms_norm": False, "mlp": False, "rope": False}),
                                 unpatch=unpatch)
    monkeypatch.setattr(compare, "patch_module", lambda: fast)
    before_trace = _profiled(model, inputs)
    before = analyze(before_trace, H100, tables=None)
    before.trace = before_trace
    comp, after = compare.patch_comparison(model, inputs, H100, before, steps=1, warmup=0, measure=_profiled)

    rows = {r["switch"]: r for r in comp["rows"]}
    assert set(rows) == {"attention", "cross_entropy"}
    assert rows["cross_entropy"]["fallbacks"] == 0 and rows["cross_entropy"]["fallback_reasons"] == []
    assert rows["attention"]["fallbacks"] == 1 and rows["attention"]["fallback_reasons"] == [[FP32_ATTENTION, 1]]
    assert comp["total"]["fallback_reasons"] == [[f"attention: {FP32_ATTENTION}", 1]]
    assert "lm_head" in rows["cross_entropy"]["modules"]  # its GEMMs moved into the fused loss
    ops = {r.op for r in after.rows}
    assert "kernelkit::linear_cross_entropy" in ops and not {o for o in ops if "nll_loss" in o or "log_softmax" in o}
    assert not [r for r in after.rows if r.module.startswith("lm_head")]
    assert after.notes[0] == f"kernelkit.patch ran the model's own code for attention (1 call): {FP32_ATTENTION}"
    assert "forward" not in vars(model) and not hasattr(model, "_kernelkit_patch")

    from rich.console import Console

    console = Console(width=400, record=True)
    print_patch_comparison(comp, console)
    text = " ".join(console.export_text().split())
    assert f"fallback: kernelkit.patch ran the model's own code (1 call): attention: {FP32_ATTENTION}" in text
    assert text.count("ran the model's own code") == 1  # nothing for the loss
    # which path each switch ran per shape (the tests force kernelkit: KERNELKIT_PATCH_CHOICE=kernelkit)
    assert [k for k, _, _ in comp["choices"]] == ["cross_entropy"] and comp["choices"][0][2] == "kernelkit (forced)"
    assert "kernelkit.patch chose for cross_entropy at" in text
    before.patch = comp
    assert f"attention: {FP32_ATTENTION} (1 call)" in to_html(before, None)
