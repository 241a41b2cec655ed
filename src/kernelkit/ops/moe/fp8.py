"""kernelkit.moe with fp8 expert GEMMs as registry entries of their own (`kernelkit check moe_fp8 moe_mxfp8`,
`bench moe_fp8`): the layer against `reference_fp8` / `reference_mxfp8`, the quantized layer in float64. The
implementation is `moe`'s (`precision="fp8"` / `"mxfp8"`, ops/moe/__init__.py); this file holds what checks it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gemm.fp8 import quantize_cols_t_reference, quantize_rows_reference
from . import BENCH_SHAPES, cost, make_inputs, moe, reference_route
from ..mxfp8 import reference_dequantize, reference_quantize
from ..registry import OpSpec, register


def reference_fp8(x, router_weight, gate_up_weight, down_weight, top_k, *, scoring="softmax", renormalize=True):
    """`moe(..., precision="fp8")` in plain PyTorch: the router as `reference`'s (`reference_route`, in fp32 on x
    unquantized); x and the expert weights quantized per row (`quantize_rows_reference`) and the experts computed
    in float64 on their dequantized values, each expert's h rounded to x's dtype and quantized per row before the
    down projection. Output in x's dtype."""
    def dequantized(t):
        q, scale = quantize_rows_reference(t)
        return q.double() * scale.double().unsqueeze(-1)

    return _quantized_layer(x, router_weight, gate_up_weight, down_weight, top_k, scoring, renormalize, dequantized,
                            lambda h: dequantized(h.to(x.dtype)))


def reference_mxfp8(x, router_weight, gate_up_weight, down_weight, top_k, *, scoring="softmax", renormalize=True):
    """`moe(..., precision="mxfp8")` in plain PyTorch: the router on x unquantized; x and the expert weights
    quantized to MXFP8 along their reduction dim (`mxfp8.reference_quantize`, the spec's conversion), the experts
    in float64 on the dequantized values, each expert's h rounded to fp32 (the kernel's epilogue holds it in fp32)
    and quantized to MXFP8 before the down projection. Output in x's dtype."""
    def dequantized(t):
        return reference_dequantize(*reference_quantize(t), out_dtype=torch.float32).double()

    return _quantized_layer(x, router_weight, gate_up_weight, down_weight, top_k, scoring, renormalize, dequantized,
                            lambda h: dequantized(h.float()))


def _quantized_layer(x, router_weight, gate_up_weight, down_weight, top_k, scoring, renormalize, dequantized,
                     dequantized_h):
    x2 = x.reshape(-1, x.shape[-1])
    weights, experts = reference_route(x2.float(), router_weight, top_k, scoring, renormalize)
    xd, gud, dd = dequantized(x2), dequantized(gate_up_weight), dequantized(down_weight)
    out = torch.zeros(x2.shape, dtype=torch.float64, device=x.device)
    for e in range(gate_up_weight.shape[0]):
        token, slot = torch.where(experts == e)
        if token.numel():
            gate, up = (xd[token] @ gud[e].T).chunk(2, dim=-1)
            h = dequantized_h(F.silu(gate) * up)
            out.index_add_(0, token, (h @ dd[e].T) * weights[token, slot].double()[:, None])
    return out.to(x.dtype).reshape(x.shape)


def experts_grads_reference_fp8(dout, x, weights, gate_up_weight, down_weight, experts, fp8_wgrads: bool = True):
    """The gradients (dx, dweights, dgate_up, ddown) of `moe_experts(..., backward_precision="fp8")` in float64,
    one expert at a time, on the quantized operands the kernels read: dout per token and each expert's weights
    per input channel (`quantize_cols_t_reference`) dequantized for the two dgrads, d(gate, up) rounded to x's
    dtype and quantized per row before the gate-up dgrad; the routing weight's gradient from the dequantized
    down-dgrad; the weight gradients on operands quantized per expert and column along the expert's rows (the
    transposed quantization of `quantize_segments_t`): d(gate, up) and x's rows for the gate-up weight, dout times
    the routing weight (rounded to x's dtype) and h (in x's dtype) for the down weight; unquantized with
    `fp8_wgrads=False` (the layer's choice below FP8_WGRAD_MIN_ROWS rows an expert)."""
    def rows_dq(t):
        q, scale = quantize_rows_reference(t)
        return q.double() * scale.double().unsqueeze(-1)

    def segment_dq(t):  # (rows of one expert, C) quantized per column over the rows, dequantized
        if not fp8_wgrads:
            return t.double()
        q, scale = quantize_rows_reference(t.transpose(0, 1))
        return (q.double() * scale.double().unsqueeze(-1)).transpose(0, 1)

    def cols_dq(w):  # (E, R, C) -> its (E, C, R) transposed copy, dequantized
        q, scale = quantize_cols_t_reference(w)
        return q.double() * scale.double().unsqueeze(-1)

    xd, doutq = x.double(), rows_dq(dout)
    gu_t, down_t = cols_dq(gate_up_weight), cols_dq(down_weight)  # (E, H, 2I), (E, I, H)
    dx, dw = torch.zeros_like(xd), torch.zeros(weights.shape, dtype=torch.float64, device=x.device)
    dgu = torch.zeros(gate_up_weight.shape, dtype=torch.float64, device=x.device)
    dd = torch.zeros(down_weight.shape, dtype=torch.float64, device=x.device)
    inter = gate_up_weight.shape[1] // 2
    for e in range(gate_up_weight.shape[0]):
        token, slot = torch.where(experts == e)
        if token.numel() == 0:
            continue
        w = weights[token, slot].double()[:, None]
        z = xd[token] @ gate_up_weight[e].double().T
        gate, up = z[:, :inter], z[:, inter:]
        sig = torch.sigmoid(gate)
        h = gate * sig * up
        g = doutq[token] @ down_t[e].T  # d h / w, the down dgrad on fp8 operands
        dw[token, slot] = (g * h).sum(1)
        dh = g * w
        dz = torch.cat([dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig], 1).to(x.dtype)
        dx.index_add_(0, token, rows_dq(dz) @ gu_t[e].T)
        dgu[e] = segment_dq(dz).T @ segment_dq(x[token])
        dd[e] = segment_dq((dout[token].float() * w.float()).to(x.dtype)).T @ segment_dq(h.to(x.dtype))
    return dx, dw, dgu, dd


def _at_precision(precision):
    def fn(x, router_weight, gate_up_weight, down_weight, top_k, *, scoring="softmax", renormalize=True):
        return moe(x, router_weight, gate_up_weight, down_weight, top_k, scoring=scoring, renormalize=renormalize,
                   precision=precision)
    fn.__name__ = f"moe_{precision}"
    fn.__doc__ = (f'`moe(..., precision="{precision}")` (the registry\'s entry for `kernelkit check moe_{precision}` / '
                  f'`bench moe_{precision}`).')
    return fn


moe_fp8, moe_mxfp8 = _at_precision("fp8"), _at_precision("mxfp8")
# What both entries share with `moe`'s: the bench shapes, the eager-only rows, the layout fuzz's broadcast router
# skip. Forward only: the backward is `moe`'s (x's dtype, on the saved activations), checked under "moe".
_SHARED = dict(cost=cost, make_inputs=make_inputs, bench_shapes=BENCH_SHAPES, generic_rows=("eager",), baseline="eager", layout_skip=((1, "expanded"),))

register(OpSpec(
    name="moe_fp8", fn=moe_fp8, reference=reference_fp8, **_SHARED,
    test_shapes=[(37, 24, 20, 4, 2), (5, 16, 12, 3, 1), (9, 32, 16, 8, 8)], layout_shape=(13, 16, 12, 4, 2),
    # Against the quantized layer in float64: h is rounded to x's dtype before its quantization, so where the
    # kernel's fp32 sums and the float64 ones round h differently, elements land on the neighbouring e4m3 value
    # (2^-4 apart), more often in bf16 than in fp16; on the GPU the fp8 MMAs also sum in ~14 bits (fast
    # accumulation), which moves h further. `kernelkit check moe_fp8` on the H100 measured up to 3.8e-2 (bf16)
    # and 2.2e-2 (fp16); fp32 1.5-2.9e-3 in the tests. A wrong scale, expert or routing weight is off by O(1).
    tolerances={"float32": 5e-3, "bfloat16": 6e-2, "float16": 4e-2},
    doc="MoE layer with fp8 (e4m3, rowwise scales) forward GEMMs, against the quantized layer in float64.",
))

register(OpSpec(
    name="moe_mxfp8", fn=moe_mxfp8, reference=reference_mxfp8, **_SHARED,
    # MX blocks are 32 wide: hidden and intermediate in whole blocks, token counts odd.
    test_shapes=[(37, 64, 32, 4, 2), (5, 32, 64, 3, 1), (9, 32, 32, 8, 8)], layout_shape=(13, 32, 32, 4, 2),
    # Against the MX-quantized layer in float64: the products are exact (bf16 of the dequantized e4m3 values) and
    # summed in fp32, and h is quantized from fp32 as in the reference, so an element of h lands on the other
    # e4m3 neighbour only where fp32 and float64 sums straddle a rounding boundary; the output is then rounded
    # once to x's dtype.
    tolerances={"float32": 1e-3, "bfloat16": 2e-2, "float16": 1e-2},
    doc="MoE layer with MXFP8 (e4m3, E8M0 per 32) forward GEMMs and a quantizing SwiGLU epilogue, vs float64.",
))
