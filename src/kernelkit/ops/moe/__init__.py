"""Mixture-of-experts layer (Mixtral / Qwen3-MoE / DeepSeek-V3 routing, SwiGLU experts), forward and backward.

out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = idx[t, j], with (w, idx) the top-k of
softmax or sigmoid router probabilities (optionally renormalized to sum to one).

The experts run as grouped GEMMs over the (token, slot) pairs sorted by expert, every expert's rows one
contiguous group, with no Python loop over experts and no host sync (the host never reads a count):
- router: logits GEMM, softmax/sigmoid and top-k in torch ops, in fp32, under torch autograd (so the
  gradient of the routing weights reaches x and the router through torch);
- permute: a stable sort of the flattened expert ids and a searchsorted for each expert's first row;
- gate-up GEMM: A rows gathered from x through the permutation (inside the kernel's loads, or by a copy first
  for wide outputs on Hopper's persistent TMA kernel: see ops/gemm/grouped.py), SwiGLU in the epilogue (gate column j
  and up column I + j in one tile), h written in x's dtype;
- down GEMM: the routing weight multiplied in the epilogue, each row stored at its (token, slot) position;
  the combine is then a sum over the k slots of each token (deterministic, no atomics anywhere).
The backward reuses the grouped GEMM for the two dgrads (the weights read through transposed strides, or with
backward_precision="fp8" their transposed fp8 copies, dout and d(gate, up) quantized per row); the
per-expert wgrads are torch._grouped_mm's K-grouped GEMM for bf16 on Hopper and kernelkit's wgrad kernel
otherwise (each program loops over its expert's rows); the SwiGLU backward, h (which the forward does not keep)
and the routing weight's gradient ride the down-dgrad's epilogue. The eager path frees the saved gate/up
pre-activations as soon as that epilogue has read them (KERNELKIT_MOE_KEEP_SAVED=1 keeps them for a second
backward).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ... import switches
from ...roofline.model import Cost, dtype_key
from ...runtime.alloc import empty
from ...runtime import cdiv, interpreting, next_pow2
from .. import _validate
from .._dispatch import differentiable_backward, dispatch, reference_vjp, traced, wants_grad
from ..gemm import grouped
from ..gemm.fp8 import (drop_quantized_weights, keep_quantized_weights,  # noqa: F401 (re-exported)
                        quantize_cols_t, quantize_cols_t_reference, quantize_rows, quantize_rows_reference,
                        quantize_segments_t, quantize_segments_t_reference, quantized_weight)
from ..gemm.tiles import input_precision
from ..gemm.grouped import (MX_MODES, ROWDOT_BLOCK_N, grouped_gemm, tma_weight, wgrad, wgrad_fp8,  # noqa: F401
                            moe_grouped_gemm_kernel, moe_wgrad_kernel)
from ..mxfp8 import mxfp8_dequantize, mxfp8_quantize
from ..registry import OpSpec, register
from .router import _check_routing, expert_counts, load_balancing_loss, route  # noqa: F401 (re-exported)

SCORINGS = ("softmax", "sigmoid")
ROUTER_DTYPES = _validate.FLOAT_DTYPES + (torch.float64,)  # the router and routing weights: used in fp32
ID_DTYPES = (torch.int64, torch.int32)
PRECISIONS = ("bf16", "fp8", "mxfp8")
BACKWARD_PRECISIONS = ("bf16", "fp8")


def _permute(experts: torch.Tensor, n_experts: int):
    """(order, offs): the flattened (token, slot) pairs sorted by expert (stable, so each expert's rows stay in
    token order), and each expert's first row (offs[e]; offs[E] = T * k). On the device: no count is read."""
    flat = experts.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    bounds = torch.arange(n_experts + 1, device=flat.device, dtype=sorted_experts.dtype)
    offs = torch.searchsorted(sorted_experts, bounds, out_int32=True)
    return order, offs


def _sum_slots(y: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """(T * k, H) rows in (token, slot) order -> (T, H): the combine, a plain reduction over the k slots."""
    return y if k == 1 else y.view(tokens, k, y.shape[1]).sum(1, dtype=torch.float32).to(y.dtype)


def moe_experts_fwd(x, weights, gate_up_weight, down_weight, experts, allow_tf32: bool = False, save: bool = False,
                    precision: str = "bf16", backward_precision: str = "bf16"):
    """The expert part: x (T, H), weights (T, k) fp32 routing weights, experts (T, k) int64 expert ids.
    Returns (out (T, H), h (T*k, I) or empty, z (T*k, 2I) pre-activations or empty unless `save`, order, offs).
    "fp8": both GEMMs on float8_e4m3fn operands with rowwise scales (tokens and h rows; each expert's output
    channels), dequantized in the epilogues; h and z stay in x's dtype. "mxfp8": both GEMMs on MXFP8 operands
    (32-element blocks along K), dequantized in the main loop; the gate-up GEMM writes h already quantized (and
    z with `save`); h is then not returned (empty): the backward recomputes it from z."""
    t, hidden = x.shape
    k = experts.shape[1]
    n_exp, inter = gate_up_weight.shape[0], gate_up_weight.shape[1] // 2
    rows = t * k
    h = empty((rows, inter), dtype=x.dtype, device=x.device) if precision != "mxfp8" else x.new_empty(0)
    z = empty((rows, 2 * inter), dtype=x.dtype, device=x.device) if save else x.new_empty(0)
    y = empty((rows, hidden), dtype=x.dtype, device=x.device)
    order, offs = _permute(experts, n_exp)
    if rows == 0:
        return y.view(t, hidden), h, z, order, offs
    # An id outside [0, E) (expert parallelism's "not on this rank" sentinel, or a bug) belongs to no group: its
    # rows would stay unwritten. Checked on the device, no host sync: the error comes at the next synchronization.
    torch._assert_async(((experts >= 0) & (experts < n_exp)).all(),
                        "kernelkit.moe: an expert id is outside [0, experts) (expert-parallel sentinels are not supported)")
    dot_precision = input_precision(x.dtype, allow_tf32)
    tokens = order // k
    w_rows = weights.reshape(-1)[order].float()
    if precision == "mxfp8":
        xq, xs = mxfp8_quantize(x)
        hq = empty((rows, inter), dtype=torch.float8_e4m3fn, device=x.device)
        hs = empty((rows, inter // 32), dtype=torch.uint8, device=x.device)
        if grouped.MX_MODE == "upcast":
            # The MXFP8 operands dequantized to bf16 (exact) by memory-bound passes, the GEMMs on bf16 tensor cores:
            # the same products and fp32 sums as the in-loop modes, without redoing each tile's dequantization for
            # every tile of the other operand. h still leaves the epilogue as MXFP8.
            gud, _ = quantized_weight(gate_up_weight, "mxfp8_bf16")
            dd, _ = quantized_weight(down_weight, "mxfp8_bf16")
            grouped_gemm(mxfp8_dequantize(xq, xs, torch.bfloat16), gud.transpose(1, 2), hq, offs, inter,
                          a_idx=tokens, z=z if save else None, epilogue="swiglu", c_scales=hs)
            grouped_gemm(mxfp8_dequantize(hq, hs, torch.bfloat16), dd.transpose(1, 2), y, offs, hidden,
                          c_idx=order, scale=w_rows)
            return _sum_slots(y, t, k), x.new_empty(0), z, order, offs
        guq, gus = quantized_weight(gate_up_weight, "mxfp8")
        dq, ds = quantized_weight(down_weight, "mxfp8")
        grouped_gemm(xq, guq.transpose(1, 2), hq, offs, inter, a_idx=tokens, z=z if save else None,
                      epilogue="swiglu", a_scale=xs, b_scale=gus, mx=True, c_scales=hs)
        grouped_gemm(hq, dq.transpose(1, 2), y, offs, hidden, c_idx=order, scale=w_rows, a_scale=hs, b_scale=ds,
                      mx=True)
        return _sum_slots(y, t, k), x.new_empty(0), z, order, offs
    if precision == "fp8":
        # Quantized per call (quantize_rows: one kernel reading each row twice) for x and h, and for the weights
        # unless `keep_quantized_weights` holds them. The GEMMs run on the tensor cores' fp8 path with Triton's
        # default (fast) accumulation.
        xq, xs = quantize_rows(x)
        guq, gus = quantized_weight(gate_up_weight, "fp8")
        dq, ds = quantized_weight(down_weight, "fp8")
        grouped_gemm(xq, guq.transpose(1, 2), h, offs, inter, a_idx=tokens, z=z if save else None,
                      epilogue="swiglu", a_scale=xs, b_scale=gus)
        hq, hs = quantize_rows(h)
        grouped_gemm(hq, dq.transpose(1, 2), y, offs, hidden, c_idx=order, scale=w_rows, a_scale=hs, b_scale=ds)
        return _sum_slots(y, t, k), h, z, order, offs
    grouped_gemm(x, gate_up_weight.transpose(1, 2), h, offs, inter, a_idx=tokens, z=z if save else None,
                  epilogue="swiglu", precision=dot_precision)
    grouped_gemm(h, down_weight.transpose(1, 2), y, offs, hidden, c_idx=order, scale=w_rows,
                  precision=dot_precision)
    return _sum_slots(y, t, k), h, z, order, offs


# The weight gradients through torch._grouped_mm (CUTLASS's grouped GEMM with the groups along K: the wgrads of a
# torch._grouped_mm layer) where it is exact for this layer: bf16, 16-byte aligned rows, and Hopper, where its empty
# groups come back as zeros (pytorch/pytorch#172439: not on Blackwell). KERNELKIT_MOE_WGRAD=triton keeps kernelkit's
# per-expert kernel everywhere.
# Measured on the H100 (moe/moe-wgrad-bwd.json): faster for large experts (Mixtral's 117M and DeepSeek-V3's 29M
# gate-up elements each: layer fwd+bwd 1.18x / 1.16x), slower for Qwen3-30B-A3B's 3M (0.91x): used from
# CUBLAS_WGRAD_MIN elements of one expert's gate-up weight.
CUBLAS_WGRADS = switches.value("KERNELKIT_MOE_WGRAD") != "triton"
CUBLAS_WGRAD_MIN = 1 << 23


# backward_precision="fp8" runs the weight gradients in fp8 from this many (token, slot) rows an expert on average
# (known on the host: rows / experts): measured on the H100 (moe/moe_fp8_bwd_ab.json), the two wgrads with their
# quantization took 8.4 ms against 9.7 in bf16 at Mixtral (2048 rows an expert), and lost at Qwen3-30B-A3B (512:
# 3.1 vs 2.0 ms) and DeepSeek-V3 (256: 21.6 vs 14.8): each expert's transposed quantization costs about what the
# fp8 GEMM saves there, and the fp8 wgrad GEMM's few K steps an expert run below the bf16 one's speed.
FP8_WGRAD_MIN_ROWS = 1024


def _cublas_wgrads(x, gate_up_weight, down_weight) -> bool:
    return (CUBLAS_WGRADS and x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and gate_up_weight[0].numel() >= CUBLAS_WGRAD_MIN
            and gate_up_weight.dtype == down_weight.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) == (9, 0)
            and x.shape[1] % 8 == 0 and gate_up_weight.shape[1] % 16 == 0)


def moe_experts_bwd(dout, x, weights, gate_up_weight, down_weight, h, z, order, offs, allow_tf32: bool = False,
                    needs=(True, True, True, True), backward_precision: str = "bf16"):
    """Gradients (dx, dweights, dgate_up, ddown) of the expert part (None where `needs` says so). h may be empty
    (the forward did not keep it): the SwiGLU backward's epilogue then writes it again from z. z may come as a
    one-element list, emptied here: z is then freed as soon as the SwiGLU backward has read it.

    backward_precision "fp8": the two dgrad GEMMs on float8_e4m3fn operands with rowwise scales, dequantized in
    their epilogues: dout per token and d(gate, up) per row (`quantize_rows`), the expert weights per input
    channel (`quantize_cols_t`: the transposed quantization, written K-contiguous for the fp8 MMAs); and, from
    FP8_WGRAD_MIN_ROWS rows an expert on average, the two weight gradients on operands quantized per expert and
    column along the expert's rows (`quantize_segments_t`: d(gate, up) and x's rows, w * dout and h), dequantized
    in their epilogue (`wgrad_fp8`); below it they run in x's dtype."""
    t, hidden = x.shape
    k = weights.shape[1]
    rows, inter = order.shape[0], gate_up_weight.shape[1] // 2
    if isinstance(z, list):
        z = z.pop()
    if z.numel() != rows * 2 * inter:
        raise RuntimeError("kernelkit.moe: the forward ran without saving for a backward (no input required grad)")
    precision = input_precision(x.dtype, allow_tf32)
    tokens = order // k
    w_rows = weights.reshape(-1)[order].float()
    fp8 = backward_precision == "fp8"
    fp8_wgrads = fp8 and rows >= FP8_WGRAD_MIN_ROWS * gate_up_weight.shape[0]
    dx = dw = dgu = dd = None
    if rows and (needs[0] or needs[1] or needs[2]):
        dz = empty((rows, 2 * inter), dtype=x.dtype, device=x.device)
        rowdot = torch.zeros((rows, cdiv(inter, ROWDOT_BLOCK_N)), dtype=torch.float32, device=x.device)
        h_out = empty((rows, inter), dtype=x.dtype, device=x.device) if h.numel() == 0 and needs[3] else None
        if fp8:  # dout's rows per token (gathered with their scales), W_down^T per intermediate channel
            doutq, douts = quantize_rows(dout)
            dq, ds = quantized_weight(down_weight, "fp8_t")  # (E, I, H): as the (E, H, I) operand, K-contiguous
            grouped_gemm(doutq, dq.transpose(1, 2), dz, offs, inter, a_idx=tokens, scale=w_rows, z=z,
                          rowdot=rowdot, epilogue="swiglu_bwd", h_out=h_out, a_scale=douts, b_scale=ds)
            del doutq, douts, dq, ds
        else:
            grouped_gemm(dout, down_weight, dz, offs, inter, a_idx=tokens, scale=w_rows, z=z, rowdot=rowdot,
                          epilogue="swiglu_bwd", precision=precision, h_out=h_out)
        if h_out is not None:
            h = h_out
        z = None  # (the caller's last reference when it passed a list: freed here, before the weight gradients)
        if needs[1]:
            dw = torch.empty(rows, dtype=torch.float32, device=x.device).index_copy_(0, order, rowdot.sum(1))
            dw = dw.view(t, k).to(weights.dtype)
        if needs[0]:
            dxr = empty((rows, hidden), dtype=x.dtype, device=x.device)
            if fp8:  # d(gate, up) per row, W_gate_up^T per hidden channel
                dzq, dzs = quantize_rows(dz)
                guq, gus = quantized_weight(gate_up_weight, "fp8_t")  # (E, H, 2I): the (E, 2I, H) operand
                grouped_gemm(dzq, guq.transpose(1, 2), dxr, offs, hidden, c_idx=order, a_scale=dzs, b_scale=gus)
                del dzq, dzs, guq, gus
            else:
                grouped_gemm(dz, gate_up_weight, dxr, offs, hidden, c_idx=order, precision=precision)
            dx = _sum_slots(dxr, t, k)
            del dxr
        if needs[2]:
            if fp8_wgrads:
                dgu = empty(gate_up_weight.shape, dtype=gate_up_weight.dtype, device=x.device)
                wgrad_fp8(dz, x, dgu, offs, b_idx=tokens)
            elif _cublas_wgrads(x, gate_up_weight, down_weight):
                dgu = torch._grouped_mm(dz.t(), x[tokens], offs=offs[1:])
            else:
                dgu = empty(gate_up_weight.shape, dtype=gate_up_weight.dtype, device=x.device)
                wgrad(dz, x, dgu, offs, b_idx=tokens, precision=precision)
        del dz, rowdot  # freed before the down weight's gradient is allocated: the two never coexist
    elif h.numel() == 0 and rows and needs[3]:  # only the down weight's gradient: h from z in x's dtype
        h = (F.silu(z[:, :inter].float()) * z[:, inter:].float()).to(x.dtype)
    if needs[3]:
        if rows and fp8_wgrads:
            dd = empty(down_weight.shape, dtype=down_weight.dtype, device=x.device)
            wgrad_fp8(dout, h, dd, offs, a_idx=tokens, scale=w_rows)
        elif rows and _cublas_wgrads(x, gate_up_weight, down_weight):
            # in place: computed in fp32 and rounded once to dout's dtype, as the Triton wgrad rounds, with no fp32 copy
            scaled = dout[tokens].mul_(w_rows[:, None])
            dd = torch._grouped_mm(scaled.t(), h, offs=offs[1:])
        else:
            dd = empty(down_weight.shape, dtype=down_weight.dtype, device=x.device)
            if rows:
                wgrad(dout, h, dd, offs, a_idx=tokens, scale=w_rows, precision=precision)
            else:
                dd.zero_()
    if rows == 0:  # no pair routed: every gradient is zero
        dx = x.new_zeros(x.shape) if needs[0] else None
        dw = weights.new_zeros(weights.shape) if needs[1] else None
        dgu = gate_up_weight.new_zeros(gate_up_weight.shape) if needs[2] else None
    return dx, dw, dgu, dd


# --- torch.library custom ops (torch.compile) and the eager autograd path ---

@torch.library.custom_op("kernelkit::moe_experts", mutates_args=())
def _moe_experts_op(x: torch.Tensor, weights: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
                    experts: torch.Tensor, allow_tf32: bool, save: bool, precision: str, backward_precision: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return moe_experts_fwd(x, weights, gate_up_weight, down_weight, experts, allow_tf32, save, precision)


@_moe_experts_op.register_fake
def _(x, weights, gate_up_weight, down_weight, experts, allow_tf32, save, precision, backward_precision):
    rows, i2 = experts.numel(), gate_up_weight.shape[1]
    return (x.new_empty(x.shape), x.new_empty((rows, i2 // 2) if precision != "mxfp8" else (0,)), x.new_empty((rows, i2) if save else (0,)),
            experts.new_empty((rows,), dtype=torch.int64),
            experts.new_empty((gate_up_weight.shape[0] + 1,), dtype=torch.int32))


@torch.library.custom_op("kernelkit::moe_experts_bwd", mutates_args=())
def _moe_experts_bwd_op(dout: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, gate_up_weight: torch.Tensor,
                        down_weight: torch.Tensor, h: torch.Tensor, z: torch.Tensor, order: torch.Tensor,
                        offs: torch.Tensor, allow_tf32: bool, backward_precision: str
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return moe_experts_bwd(dout, x, weights, gate_up_weight, down_weight, h, z, order, offs, allow_tf32,
                           backward_precision=backward_precision)


@_moe_experts_bwd_op.register_fake
def _(dout, x, weights, gate_up_weight, down_weight, h, z, order, offs, allow_tf32, backward_precision):
    return x.new_empty(x.shape), weights.new_empty(weights.shape), gate_up_weight.new_empty(gate_up_weight.shape), \
        down_weight.new_empty(down_weight.shape)


def _setup_context(ctx, inputs, output):
    x, weights, gate_up_weight, down_weight, _experts, allow_tf32, _save, _precision, backward_precision = inputs
    _out, h, z, order, offs = output
    # h is not kept: the backward's SwiGLU epilogue writes it again from z (rows x intermediate less memory)
    ctx.save_for_backward(x, weights, gate_up_weight, down_weight, h.new_empty(0), z, order, offs)
    ctx.allow_tf32 = allow_tf32
    ctx.backward_precision = backward_precision


def _backward(ctx, dout, *_saved_grads):
    grads = _moe_experts_bwd_op(dout, *ctx.saved_tensors, ctx.allow_tf32, ctx.backward_precision)
    return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None, None, None, None, None)


_moe_experts_op.register_autograd(_backward, setup_context=_setup_context)


def _double_backward(ctx, dout):
    x, weights, gate_up_weight, down_weight, *_rest, experts = ctx.saved_tensors
    return reference_vjp(experts_reference, (x, weights, gate_up_weight, down_weight, experts), (dout,), 9)


class _MoEExpertsFunction(torch.autograd.Function):
    """The eager path: the same launchers as the custom op with less per-call host overhead."""

    @staticmethod
    def forward(ctx, x, weights, gate_up_weight, down_weight, experts, allow_tf32, save, precision,
                backward_precision):
        out, h, z, order, offs = moe_experts_fwd(x, weights, gate_up_weight, down_weight, experts, allow_tf32, True,
                                                 precision)
        # Kept: z (gate | up), not h (written again by the backward's SwiGLU epilogue). z is a ctx attribute, not a
        # saved tensor, so that the backward can free it once read (before the weight gradients are allocated):
        # the layer's peak memory then stays below a torch layer's. A second backward through the same graph
        # (retain_graph=True) needs KERNELKIT_MOE_KEEP_SAVED=1.
        ctx.save_for_backward(x, weights, gate_up_weight, down_weight, order, offs, experts)
        ctx.z = z
        ctx.allow_tf32 = allow_tf32
        ctx.backward_precision = backward_precision
        return out

    @staticmethod
    @differentiable_backward(_double_backward, "moe")
    def backward(ctx, dout):
        x, weights, gate_up_weight, down_weight, order, offs, _experts = ctx.saved_tensors
        z = ctx.z
        if z is None:
            raise RuntimeError("kernelkit.moe: a second backward through the same graph. The first one freed the "
                               "layer's saved activations (the memory of a torch layer's peak); set "
                               "KERNELKIT_MOE_KEEP_SAVED=1 to keep them for retain_graph=True.")
        if not KEEP_SAVED:
            ctx.z = None
            z = [z]
        grads = moe_experts_bwd(dout, x, weights, gate_up_weight, down_weight, x.new_empty(0), z, order, offs,
                                ctx.allow_tf32, ctx.needs_input_grad[:4], ctx.backward_precision)
        return (*grads, None, None, None, None, None)


KEEP_SAVED = switches.on("KERNELKIT_MOE_KEEP_SAVED")


def _check(x, router_weight, gate_up_weight, down_weight, top_k, scoring, renormalize) -> tuple[int, int]:
    """Validate the arguments once; returns (experts, intermediate)."""
    _validate.tensor(x, "x", min_dim=1)
    _validate.tensor(router_weight, "router_weight", dtypes=ROUTER_DTYPES)
    _validate.same_device(router_weight, "router_weight", x, "x")
    hidden = x.shape[-1]
    if router_weight.dim() != 2 or router_weight.shape[1] != hidden or router_weight.shape[0] < 1:
        raise ValueError(f"router_weight must have shape (experts, {hidden}) to match x's last dim, "
                         f"got {tuple(router_weight.shape)}")
    n_exp = router_weight.shape[0]
    inter = _check_expert_weights(x, gate_up_weight, down_weight, n_exp)
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= n_exp:
        raise ValueError(f"top_k must be between 1 and the number of experts ({n_exp}), got {top_k}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(map(repr, SCORINGS))}, got {scoring!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    return n_exp, inter


def _check_expert_weights(x, gate_up_weight, down_weight, n_exp: Optional[int] = None) -> int:
    """Validate the experts' weights against x and the number of experts (gate_up_weight's when None); returns
    intermediate."""
    for name, w in (("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        _validate.tensor(w, name)
        _validate.same_device(w, name, x, "x")
    hidden = x.shape[-1]
    gu = gate_up_weight.shape
    if gate_up_weight.dim() != 3 or n_exp is not None and gu[0] != n_exp or gu[2] != hidden or gu[1] % 2 \
            or gu[1] == 0:
        raise ValueError(f"gate_up_weight must have shape ({'experts' if n_exp is None else n_exp}, 2 * intermediate, "
                         f"{hidden}) (experts, gate rows then up rows, hidden: nn.Linear's (out, in) per expert), "
                         f"got {tuple(gu)}")
    n_exp = gu[0]
    inter = gu[1] // 2
    if down_weight.dim() != 3 or tuple(down_weight.shape) != (n_exp, hidden, inter):
        raise ValueError(f"down_weight must have shape ({n_exp}, {hidden}, {inter}) (experts, hidden, intermediate), "
                         f"got {tuple(down_weight.shape)}")
    for name, w in (("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {w.dtype} but x has {x.dtype}; cast one to the other")
    return inter


def _check_routing_tensors(x, weights, experts, n_exp: int) -> None:
    """Validate a routing computed elsewhere (moe_experts' weights and experts) against x (T, hidden). The ids'
    range is checked on the host where they are (CPU tensors: the interpreter); on a GPU, moe_experts_fwd asserts
    it on the device, without a host sync."""
    if not isinstance(experts, torch.Tensor):
        raise TypeError(f"experts must be a torch.Tensor of expert ids, got {type(experts).__name__}")
    if experts.dtype not in ID_DTYPES:
        raise TypeError(f"experts has dtype {str(experts.dtype)[6:]}; expert ids must be int64 or int32 "
                        f"(torch.topk's indices are int64)")
    _validate.tensor(weights, "weights", dtypes=ROUTER_DTYPES)
    t = x.shape[0]
    if experts.dim() != 2 or experts.shape[0] != t or experts.shape[1] < 1:
        raise ValueError(f"experts must have shape ({t}, top_k): one row of expert ids per token of x "
                         f"{tuple(x.shape)}, got {tuple(experts.shape)}")
    if weights.shape != experts.shape:
        raise ValueError(f"weights must have experts' shape {tuple(experts.shape)}: one routing weight per chosen "
                         f"expert, got {tuple(weights.shape)}")
    _validate.same_device(experts, "experts", x, "x")
    _validate.same_device(weights, "weights", x, "x")
    if experts.device.type == "cpu" and not traced(experts):
        bad = (experts < 0) | (experts >= n_exp)
        if bad.any():
            raise ValueError(f"experts holds the id {int(experts[bad][0])}, outside [0, {n_exp}) (the experts of "
                             f"gate_up_weight); expert-parallel sentinels are not supported: drop those slots or "
                             f"route them to a local expert with weight 0")


def _rows(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """x as (tokens, hidden) with any strides; leading dims that no single stride can walk are copied."""
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, hidden)
    except RuntimeError:
        return _validate._copied(x).reshape(-1, hidden)


def _first(out):
    return out[0]


def moe(x: torch.Tensor, router_weight: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
        top_k: int, *, scoring: str = "softmax", renormalize: bool = True, precision: str = "bf16",
        backward_precision: str = "bf16", expert_bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: Optional[int] = None,
        routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """A mixture-of-experts SwiGLU MLP: ``sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``.

    x: (..., hidden); router_weight: (experts, hidden); gate_up_weight: (experts, 2 * intermediate, hidden), gate
    rows first then up rows; down_weight: (experts, hidden, intermediate) (each expert in nn.Linear's (out, in)
    convention, as transformers' fused MoE experts store them). x and the expert weights float32, bfloat16 or
    float16 of one dtype, any strides; the router float32, bfloat16, float16 or float64, whatever x's dtype (other
    dtypes are a TypeError). Routing: logits = x @ router_weight.T in fp32, probabilities by `scoring` ("softmax":
    Mixtral, Qwen3-MoE; "sigmoid": DeepSeek-V3), the top_k largest, divided by their sum if `renormalize`;
    DeepSeek-V3's routing with `expert_bias` (E,) (added for the choice only), `n_group` / `topk_group`
    (group-limited top-k) and `routed_scaling_factor`: see `route`. Returns (..., hidden) in x's dtype.

    The router runs in torch ops; the experts are grouped GEMMs over the tokens sorted by expert (gather fused into
    the loads, SwiGLU and the routing weight fused into the epilogues, fp32 accumulation), with no host sync.
    Differentiable in x, router_weight (through the routing weights; the top-k choice is not differentiable),
    gate_up_weight and down_weight; the backward saves the gate/up pre-activations instead of recomputing them.

    precision: "bf16" (the default: the GEMMs run in x's dtype, whatever it is); "fp8": the two forward GEMMs
    on float8_e4m3fn with rowwise scales (per token, per row of h, per expert output channel; see
    `quantize_rows`), dequantized in their epilogues; "mxfp8": the two forward GEMMs on MXFP8 operands (e4m3, one
    E8M0 scale per 32 elements along the reduction: `mxfp8_quantize`'s format; hidden and intermediate divisible
    by 32) multiplied exactly (Hopper has no block-scaled MMA: the dequantized values are exact in bf16, and bf16
    MMAs with fp32 sums compute their products; by default the operands are dequantized by their own passes, see
    `grouped.MX_MODE`), the gate-up GEMM's SwiGLU epilogue writing h already in MXFP8 for the down GEMM.
    With either fp8 precision the backward differentiates the layer as if unquantized, on the saved gate/up
    pre-activations (a straight-through estimator of the quantization).

    backward_precision: "bf16" (the default: the backward GEMMs in x's dtype) or "fp8": the two dgrad GEMMs (of
    the down and the gate-up projection: the gradients reaching h and x) on float8_e4m3fn operands with rowwise
    scales, dequantized in their epilogues: dout per token and d(gate, up) per row, the expert weights per input
    channel (a transposed quantization, written K-contiguous for the fp8 MMAs: `quantize_cols_t`); and, where the
    experts get 1024 rows (token, slot pairs) or more on average, the two weight gradients (reductions over each
    expert's rows) on operands quantized per expert and column along those rows, also transposed
    (`quantize_segments_t`); with fewer rows an expert they run in x's dtype, where the measurements found them
    faster. Independent of `precision`. It pays when the weights' quantized copies are kept
    (`keep_quantized_weights`: frozen experts, or the micro-batches of a gradient accumulation): made every
    backward, the transposed copies cost about what the fp8 dgrads save at Mixtral's expert sizes and more at
    finer-grained experts (README, benchmarks/experiments/h100/moe/moe-fp8-bwd-layers.json).

    Inside `keep_quantized_weights()` the weights' quantized copies (forward and transposed) are reused across
    calls while the weights are unchanged.
    """
    n_exp, _inter = _check(x, router_weight, gate_up_weight, down_weight, top_k, scoring, renormalize)
    _check_routing(n_exp, top_k, expert_bias, n_group, topk_group, routed_scaling_factor, x)
    _check_precision(precision, backward_precision=backward_precision)  # before routing; moe_experts: the device
    hidden = x.shape[-1]
    x2 = _rows(x, hidden)
    weights, experts = route(x2, router_weight, top_k, scoring, renormalize, expert_bias=expert_bias,
                             n_group=n_group, topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)
    return _experts(x2, weights, gate_up_weight, down_weight, experts, precision, backward_precision).view(x.shape)


def _check_precision(precision, x: Optional[torch.Tensor] = None, gate_up_weight: Optional[torch.Tensor] = None,
                     backward_precision: str = "bf16") -> None:
    """precision is one of PRECISIONS and backward_precision one of BACKWARD_PRECISIONS; with the tensors: fp8
    tensor cores for "fp8" (either), and for "mxfp8" (fp8 tensor cores or the interpreter) hidden and intermediate
    sizes in whole 32-element MX blocks."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    if backward_precision not in BACKWARD_PRECISIONS:
        raise ValueError(f"backward_precision must be one of {', '.join(map(repr, BACKWARD_PRECISIONS))}, got "
                         f"{backward_precision!r}")
    if x is None or precision == backward_precision == "bf16":
        return
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9):
        name, value = ("precision", precision) if precision != "bf16" else ("backward_precision", backward_precision)
        raise TypeError(f"{name}={value!r} needs fp8 tensor cores (compute capability 8.9+); {x.device} is "
                        f"sm_{''.join(map(str, torch.cuda.get_device_capability(x.device)))}")
    if precision == "mxfp8" and gate_up_weight is not None:
        for name, size in (("hidden (x's last dim)", x.shape[-1]), ("intermediate", gate_up_weight.shape[1] // 2)):
            if size % 32:
                raise ValueError(f"precision='mxfp8' needs {name} divisible by the MX block size 32, got {size}; "
                                 f"use precision='fp8' (rowwise scales) for this layer")


def moe_experts(x: torch.Tensor, weights: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
                experts: torch.Tensor, *, precision: str = "bf16", backward_precision: str = "bf16") -> torch.Tensor:
    """The expert part of `moe` for a routing computed elsewhere (a Hugging Face router, say):
    ``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``, e = experts[t, j].

    x (T, hidden); weights (T, k) float32, bfloat16, float16 or float64 (multiplied in fp32); experts (T, k) int64
    or int32 ids in [0, E); gate_up_weight (E, 2 * intermediate, hidden), gate rows first; down_weight
    (E, hidden, intermediate); x and the expert weights of one dtype, any strides, all on one device.
    Differentiable in x, weights, gate_up_weight and down_weight. Validated (a ValueError or TypeError naming the
    argument); an id outside [0, E) is a ValueError for CPU tensors (the interpreter) and, on a GPU, a device-side
    assert at the next synchronization (no host sync here). precision and backward_precision as `moe`'s."""
    _validate.tensor(x, "x", min_dim=2)
    if x.dim() != 2:
        raise ValueError(f"x must be (tokens, hidden), got shape {tuple(x.shape)}; flatten the leading dims with "
                         f"x.reshape(-1, x.shape[-1]) (and the routing's with .reshape(-1, top_k))")
    _check_expert_weights(x, gate_up_weight, down_weight)
    _check_routing_tensors(x, weights, experts, gate_up_weight.shape[0])
    return _experts(x, weights, gate_up_weight, down_weight, experts, precision, backward_precision)


def _experts(x, weights, gate_up_weight, down_weight, experts, precision, backward_precision) -> torch.Tensor:
    """moe_experts on validated arguments (`moe` routes them itself)."""
    _check_precision(precision, x, gate_up_weight, backward_precision)
    allow_tf32 = bool(torch.backends.cuda.matmul.allow_tf32) and x.dtype == torch.float32
    save = wants_grad(x, weights, gate_up_weight, down_weight)
    return dispatch(_moe_experts_op, moe_experts_fwd, _MoEExpertsFunction, 4,
                    (x, weights, gate_up_weight, down_weight, experts, allow_tf32, save, precision, backward_precision),
                    pick=_first)


class MoE(torch.nn.Module):
    """A mixture-of-experts SwiGLU MLP running `kernelkit.moe`. Parameters as transformers' fused MoE blocks
    (MixtralSparseMoeBlock's state_dict): ``gate.weight`` (experts, hidden), ``experts.gate_up_proj``
    (experts, 2 * intermediate, hidden), ``experts.down_proj`` (experts, hidden, intermediate); initialized as
    nn.Linear would each expert. DeepSeek-V3 routing: `expert_bias=True` adds the buffer
    ``gate.e_score_correction_bias`` (E,) (zeros; a load balancer updates it), and n_group / topk_group /
    routed_scaling_factor as `route`'s; precision and backward_precision as `moe`'s. Documented fallback: a CPU tensor outside the Triton interpreter runs
    `reference`."""

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, scoring: str = "softmax",
                 renormalize: bool = True, device=None, dtype=None, precision: str = "bf16", *,
                 expert_bias: bool = False, n_group: int = 1, topk_group: Optional[int] = None,
                 routed_scaling_factor: float = 1.0, backward_precision: str = "bf16"):
        super().__init__()
        for name, v in (("hidden", hidden), ("intermediate", intermediate), ("experts", experts), ("top_k", top_k)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        _check_precision(precision, backward_precision=backward_precision)
        _check_routing(experts, top_k, None, n_group, topk_group, routed_scaling_factor)
        self.precision, self.backward_precision = precision, backward_precision
        self.routing = {"n_group": n_group, "topk_group": topk_group, "routed_scaling_factor": routed_scaling_factor}
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {', '.join(map(repr, SCORINGS))}, got {scoring!r}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be between 1 and experts ({experts}), got {top_k}")
        self.hidden, self.intermediate, self.num_experts, self.top_k = hidden, intermediate, experts, top_k
        self.scoring, self.renormalize = scoring, renormalize
        kw = {"device": device, "dtype": dtype}
        self.gate, self.experts = torch.nn.Module(), torch.nn.Module()  # parameter names as transformers'
        self.gate.weight = torch.nn.Parameter(torch.empty((experts, hidden), **kw))
        self.experts.gate_up_proj = torch.nn.Parameter(torch.empty((experts, 2 * intermediate, hidden), **kw))
        self.experts.down_proj = torch.nn.Parameter(torch.empty((experts, hidden, intermediate), **kw))
        if expert_bias:
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(experts, device=device,
                                                                             dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for p, fan_in in ((self.gate.weight, self.hidden), (self.experts.gate_up_proj, self.hidden),
                              (self.experts.down_proj, self.intermediate)):
                bound = 1.0 / fan_in ** 0.5  # nn.Linear's kaiming_uniform(a=sqrt(5)) bound
                p.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (x, self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj, self.top_k)
        kw = {"scoring": self.scoring, "renormalize": self.renormalize, **self.routing,
              "expert_bias": getattr(self.gate, "e_score_correction_bias", None)}
        if x.device.type != "cuda" and not interpreting():
            return reference(*args, **kw)
        return moe(*args, **kw, precision=self.precision, backward_precision=self.backward_precision)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, experts={self.num_experts}, "
                f"top_k={self.top_k}, scoring={self.scoring!r}, renormalize={self.renormalize}")


# --- reference, cost, registry ---

def experts_reference(x, weights, gate_up_weight, down_weight, experts):
    """The expert part in plain PyTorch, one expert at a time: x (T, H), weights and experts (T, k)."""
    out = torch.zeros_like(x)
    for e in range(gate_up_weight.shape[0]):
        token, slot = torch.where(experts == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up_weight[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_weight[e])
        out = out.index_add(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out


def reference_route(x, router_weight, top_k, scoring="softmax", renormalize=True, *, expert_bias=None, n_group=1,
                    topk_group=None, routed_scaling_factor=1.0):
    """`route` written from its definition, sharing none of its code (tests hold the two against each other):
    (weights (T, k), experts (T, k) int64) for x (T, H), in fp64 for fp64 inputs, else fp32. Ties break
    differently (a stable descending sort here, torch.topk there)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = x.to(acc) @ router_weight.to(acc).T
    probs = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = probs if expert_bias is None else probs + expert_bias.to(acc)  # the bias steers the choice only
    if n_group > 1:
        # A group scores the sum of its two best choices; experts outside the topk_group best groups drop out.
        groups = choice.unflatten(-1, (n_group, -1))
        group_score = groups.sort(dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
        rank = group_score.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        choice = groups.masked_fill((rank >= topk_group)[..., None], float("-inf")).flatten(-2)
    experts = choice.argsort(dim=-1, descending=True, stable=True)[..., :top_k]
    weights = probs.gather(-1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * routed_scaling_factor, experts


def reference(x, router_weight, gate_up_weight, down_weight, top_k, *, scoring="softmax", renormalize=True,
              **routing):
    """Plain PyTorch: the routing of `reference_route` (router logits in fp32, fp64 for fp64 inputs; softmax or
    sigmoid, top-k, renormalized if asked, route's DeepSeek-V3 options in `routing`), then every expert in a
    Python loop over the tokens routed to it. Output in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    weights, experts = reference_route(x2, router_weight, top_k, scoring, renormalize, **routing)
    return experts_reference(x2, weights, gate_up_weight, down_weight, experts).reshape(x.shape)


def cost(x, router_weight, gate_up_weight, down_weight, top_k, *, scoring="softmax", renormalize=True,
         backward: bool = False) -> Cost:
    """The expert GEMMs: 2·T·k·(2·I·H + I·H) FLOPs forward, twice that backward (dgrad and wgrad of each); the
    router's 2·T·E·H is left out (under 1% at the bench shapes). Ideal bytes: x, the router and the expert
    weights read once, the output written once (backward: dout, x and the weights read, dx and every weight
    gradient written)."""
    hidden = x.shape[-1]
    t = x.numel() // max(hidden, 1)
    i2 = gate_up_weight.shape[1]
    inter = i2 // 2
    es = x.element_size()
    expert_bytes = (gate_up_weight.numel() + down_weight.numel()) * es
    router_bytes = router_weight.numel() * router_weight.element_size()
    flops = 2.0 * t * top_k * (i2 * hidden + inter * hidden)
    dt = "tf32" if x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else dtype_key(x.dtype)
    if backward:
        return Cost(flops=2 * flops, bytes=3 * t * hidden * es + 2 * expert_bytes + 2 * router_bytes, dtype=dt)
    return Cost(flops=flops, bytes=2 * t * hidden * es + expert_bytes + router_bytes, dtype=dt)


def make_inputs(shape, dtype, device, generator=None):
    """shape = (tokens, hidden, intermediate, experts, top_k): x (T, H) standard normal, expert weights scaled by
    1/sqrt(fan_in) (outputs of order 1), and routing margins built in: the router is the identity on x's first E
    columns (plus a small dense part), and those columns hold, per token, a random permutation of E distinct
    levels (multiples of 2/next_pow2(E), exact in bf16 and fp16 up to 256 experts). Neighbouring logits are then
    one level apart up to the dense part, whose difference is a level / 11 standard deviation: the top-k choice
    cannot flip between the kernel path and the float64 reference on rounding noise (near-ties of random logits
    would make the routings, and then the outputs, differ). With hidden < experts the router is plain random.
    Top-1 inputs route without renormalizing (Switch Transformer): a renormalized top-1 weight is identically 1, so
    the router's gradient is exactly zero and a relative error against the float64 reference's rounding residue
    would mean nothing."""
    t, hidden, inter, n_exp, top_k = shape
    kw = {"device": device, "generator": generator}
    x = torch.randn((t, hidden), **kw)
    level = 4.0 / next_pow2(n_exp)
    router = torch.randn((n_exp, hidden), **kw) * (level / 16 / hidden ** 0.5)
    if hidden >= n_exp:
        rank = torch.rand((t, n_exp), **kw).argsort(dim=1)
        x[:, :n_exp] = (2 * rank - (n_exp - 1)).float() * (level / 2)
        router[:, :n_exp] = torch.eye(n_exp, device=device)
    # The expert weights drawn in the target dtype: DeepSeek-V3's are 22.5 GB in bf16, twice that in fp32.
    gate_up = torch.randn((n_exp, 2 * inter, hidden), dtype=dtype, **kw).mul_(hidden ** -0.5)
    down = torch.randn((n_exp, hidden, inter), dtype=dtype, **kw).mul_(inter ** -0.5)
    return (x.to(dtype), router.to(dtype), gate_up, down, top_k), {"renormalize": top_k > 1}


# First a medium shape: `kernelkit check` (make demo) runs bench_shapes[0] against a float64 reference on the GPU,
# which at Mixtral's shape needs ~30 GB; then the three layers (Mixtral, Qwen3-30B-A3B, DeepSeek-V3), which
# benchmarks/moe.py times against torch._grouped_mm. The fp8 / MXFP8 entries (moe/fp8.py) bench the same.
BENCH_SHAPES = [(2048, 1024, 1536, 16, 4), (8192, 4096, 14336, 8, 2), (8192, 2048, 768, 128, 8),
                (8192, 7168, 2048, 256, 8)]

register(OpSpec(
    name="moe", fn=moe, reference=reference, cost=cost, make_inputs=make_inputs, grad_args=(0, 1, 2, 3),
    test_shapes=[(37, 24, 20, 4, 2), (5, 16, 12, 3, 1), (9, 32, 16, 8, 8)],
    bench_shapes=BENCH_SHAPES,
    # torch.compile of the per-expert loop breaks its graph at every expert's torch.where: the eager row only.
    generic_rows=("eager",), baseline="eager",
    # A broadcast router gives every expert the same logit: the top-k of exact ties is arbitrary, and the kernel
    # path and the float64 reference may pick different experts (a routing, not a kernel, difference).
    layout_skip=((1, "expanded"),),
    # x expanded: every token is the same, routes to the same experts, and the bf16 rounding of h and of the
    # expert outputs repeats identically in every token, so its error reaches the router's gradient coherently
    # (through the softmax Jacobian's cancellation) instead of averaging out. Over 40 fresh grad_outputs in the
    # interpreter the router gradient's error reached 5.8e-2 in norm, as it did before this tolerance existed
    # (make demo failed once at 2.8e-2 against 2e-2). A wrong routing weight or expert is off by O(1).
    layout_tolerances={"args[0] expanded": {"bfloat16": 8e-2}},
    layout_shape=(13, 16, 12, 4, 2),
    # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: through the chain's four bf16
    # roundings (h, the expert outputs, d(gate, up), the weighted dout) that measured up to 1.05e-2 against
    # float64 at the test shapes, where torch's bf16 per-expert loop measures 4-7e-3. float16: the router's
    # gradient goes through the softmax/top-k Jacobian, which subtracts the selected experts' nearly equal
    # <dout, expert output> products, so the fp16 rounding of h (~5e-4) can grow several-fold there; with x
    # broadcast (every token the same, the errors add up coherently) it measured 7.2e-3 on the H100 in one of
    # two `check all` runs (fp32 and bf16 passed; the output and the other gradients stayed within 2e-3).
    tolerances={"bfloat16": 2e-2, "float16": 1e-2},
    doc="MoE SwiGLU MLP: torch router (softmax/sigmoid top-k), grouped-GEMM experts, forward+backward.",
))

from . import fp8  # noqa: E402,F401 (registers moe_fp8 and moe_mxfp8, which check the layer above)
