"""Every kernel each registered op launches (forward and backward, fused and looped paths) compiles
for the H100 (sm_90) through Triton's real compiler, not only in the interpreter."""

import pytest
import torch

from kernelkit.ops import registry
from kernelkit.testing import compile_check
from tests.conftest import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="records launches through the Triton interpreter")

# One shape per path: a short row (multi-row tiles) and, via the monkeypatched thresholds, the looped kernels.
LOOPED = {"rms_norm": "kernelkit.ops.rms_norm", "add_rms_norm": "kernelkit.ops.rms_norm",
          "softmax": "kernelkit.ops.softmax", "log_softmax": "kernelkit.ops.softmax",
          "layer_norm": "kernelkit.ops.layer_norm"}


def _exercise(spec, dtype):
    gen = torch.Generator().manual_seed(0)
    shape = spec.test_shapes[min(2, len(spec.test_shapes) - 1)]
    args, kwargs = spec.make_inputs(shape, dtype, "cpu", gen)
    args = [a.requires_grad_(i in spec.grad_args) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for i, a in enumerate(args)]
    out = spec.fn(*args, **kwargs)
    outs = [o for o in ([out] if isinstance(out, torch.Tensor) else out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])


def test_all_kernels_compile_for_sm90(monkeypatch):
    records = []
    with compile_check.record_launches(records):
        for name, spec in sorted(registry.all_ops().items()):
            if name == "attention":  # its own sm_90 check sets the TMA path and real tiles (test_attention.py)
                continue
            for dtype in (torch.bfloat16, torch.float32):
                if str(dtype).removeprefix("torch.") in spec.dtypes:
                    _exercise(spec, dtype)
            if name in LOOPED:
                import importlib

                mod = importlib.import_module(LOOPED[name])
                with monkeypatch.context() as m:
                    m.setattr(mod, "MAX_FUSED_N", 256)
                    m.setattr(mod, "LOOP_BLOCK_N", 128)
                    _exercise(spec, torch.bfloat16)
    records = compile_check.unique(records)
    kernels = {r["kernel"] for r in records}
    assert len(kernels) >= 8, kernels
    failures = compile_check.compile_in_subprocess(records)
    assert not failures, "\n".join(failures)


def test_a_kernel_reading_a_plain_global_is_caught():
    # The bug class this check exists for: fine in the interpreter, rejected by the compiler.
    records = [{"kernel": "tests.fixtures.bad_kernel:reads_plain_global",
                "args": {"X": {"ptr": "fp32"}, "BLOCK": {"value": 16}}, "options": {"num_warps": 4}}]
    failures = compile_check.compile_in_subprocess(records)
    assert failures and "global variable" in failures[0]
