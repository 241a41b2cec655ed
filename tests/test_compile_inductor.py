"""torch.compile with the real backend (inductor): values and gradients of a block of kernelkit ops,
compiled with fullgraph=True, against the float64 references — not just "it ran and is finite"."""

import pytest
import torch

import kernelkit
from kernelkit.ops import cross_entropy as ce
from kernelkit.ops import glu, layer_norm, rms_norm, rope, softmax


def _block(ops, x, w, b, r, cos, sin, target):
    h, s = ops["add_rms_norm"](x, r, w)
    h = ops["rms_norm"](h, w) + ops["layer_norm"](s, w, b)
    h = ops["swiglu"](h, ops["softmax"](h, dim=-1))
    q = h.view(2, 3, 2, 8)
    q, k = ops["rope"](q, q * 0.5, cos, sin)
    logits = (q + k).reshape(6, 16)
    return ops["cross_entropy"](logits, target) + ops["log_softmax"](logits, 0).mean()


KK = {"add_rms_norm": kernelkit.add_rms_norm, "rms_norm": kernelkit.rms_norm, "layer_norm": kernelkit.layer_norm,
      "swiglu": kernelkit.swiglu, "softmax": kernelkit.softmax, "log_softmax": kernelkit.log_softmax,
      "rope": kernelkit.rope, "cross_entropy": kernelkit.cross_entropy}
REF = {"add_rms_norm": rms_norm.add_reference, "rms_norm": rms_norm.reference, "layer_norm": layer_norm.reference,
       "swiglu": glu.swiglu_reference, "softmax": softmax.reference, "log_softmax": softmax.log_reference,
       "rope": rope.reference, "cross_entropy": ce.reference}


@pytest.mark.timeout(900)
def test_inductor_fullgraph_values_and_gradients(device):
    torch._dynamo.reset()
    g = torch.Generator(device=device).manual_seed(0)
    x, r = (torch.randn(6, 16, device=device, generator=g) for _ in range(2))
    w, b = (1 + 0.1 * torch.randn(16, device=device, generator=g) for _ in range(2))
    angle = torch.rand(2, 3, 8, device=device, generator=g) * 6
    cos, sin = angle.cos(), angle.sin()
    target = torch.randint(0, 16, (6,), device=device, generator=g)
    leaves = [t.requires_grad_() for t in (x, w, b, r)]

    compiled = torch.compile(lambda *a: _block(KK, *a), backend="inductor", fullgraph=True)
    # No cached graph: a cache hit would skip the fake implementations this test is about.
    with torch._inductor.config.patch(force_disable_caches=True):
        loss = compiled(x, w, b, r, cos, sin, target)
    grads = torch.autograd.grad(loss, leaves)

    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    want = _block(REF, *ref_leaves, cos.double(), sin.double(), target)
    want_grads = torch.autograd.grad(want, ref_leaves)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), exp, rtol=1e-4, atol=1e-5)
