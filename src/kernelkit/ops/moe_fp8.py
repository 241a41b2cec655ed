"""kernelkit.moe with fp8 expert GEMMs as its own registry entry (`kernelkit check moe_fp8`, `bench moe_fp8`):
the layer against `reference_fp8`, the quantized layer in float64. The implementation is `moe`'s
(`precision="fp8"`, ops/moe.py); this file holds what checks it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._fp8 import quantize_rows_reference
from .moe import cost, make_inputs, moe
from .registry import OpSpec, register


def reference_fp8(x, router_weight, gate_up_weight, down_weight, top_k, *, scoring="softmax", renormalize=True):
    """`moe(..., precision="fp8")` in plain PyTorch: the router as `reference`'s (on x unquantized); x and the
    expert weights quantized per row (`quantize_rows_reference`) and the experts computed in float64 on their
    dequantized values, each expert's h rounded to x's dtype and quantized per row before the down projection.
    Output in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    logits = x2.float() @ router_weight.float().T
    probs = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)

    def dequantized(t):
        q, scale = quantize_rows_reference(t)
        return q.double() * scale.double().unsqueeze(-1)

    xd, gud, dd = dequantized(x2), dequantized(gate_up_weight), dequantized(down_weight)
    out = torch.zeros(x2.shape, dtype=torch.float64, device=x.device)
    for e in range(gate_up_weight.shape[0]):
        token, slot = torch.where(experts == e)
        if token.numel():
            gate, up = (xd[token] @ gud[e].T).chunk(2, dim=-1)
            h = (F.silu(gate) * up).to(x.dtype)
            out.index_add_(0, token, (dequantized(h) @ dd[e].T) * weights[token, slot].double()[:, None])
    return out.to(x.dtype).reshape(x.shape)


def moe_fp8(x, router_weight, gate_up_weight, down_weight, top_k, *, scoring="softmax", renormalize=True):
    """`moe(..., precision="fp8")` (the registry's entry for `kernelkit check moe_fp8` / `bench moe_fp8`)."""
    return moe(x, router_weight, gate_up_weight, down_weight, top_k, scoring=scoring, renormalize=renormalize,
               precision="fp8")


register(OpSpec(
    name="moe_fp8", fn=moe_fp8, reference=reference_fp8, cost=cost, make_inputs=make_inputs,
    # Forward only: the backward is `moe`'s (x's dtype, on the saved activations), checked under "moe".
    test_shapes=[(37, 24, 20, 4, 2), (5, 16, 12, 3, 1), (9, 32, 16, 8, 8)],
    bench_shapes=[(2048, 1024, 1536, 16, 4), (8192, 4096, 14336, 8, 2), (8192, 2048, 768, 128, 8),
                  (8192, 7168, 2048, 256, 8)],
    generic_rows=("eager",), baseline="eager", layout_skip=((1, "expanded"),), layout_shape=(13, 16, 12, 4, 2),
    # Against the quantized layer in float64: h is rounded to x's dtype before its quantization, so where the
    # kernel's fp32 sums and the float64 ones round h differently, elements land on the neighbouring e4m3 value
    # (2^-4 apart), more often in bf16 than in fp16; on the GPU the fp8 MMAs also sum in ~14 bits (fast
    # accumulation), which moves h further. `kernelkit check moe_fp8` on the H100 measured up to 3.8e-2 (bf16)
    # and 2.2e-2 (fp16); fp32 1.5-2.9e-3 in the tests. A wrong scale, expert or routing weight is off by O(1).
    tolerances={"float32": 5e-3, "bfloat16": 6e-2, "float16": 4e-2},
    doc="MoE layer with fp8 (e4m3, rowwise scales) forward GEMMs, against the quantized layer in float64.",
))

