"""Cross-entropy over large vocabularies: online log-sum-exp in chunks, the gradient in the same pass.

A row of LM logits (V = 128256 at bf16 is 256 KB) does not fit in one program's registers, so the
forward sweeps the row in BLOCK_V chunks keeping a running max and a rescaled sum of exponentials in
fp32 (the online softmax). With label smoothing, class weights (torch's weighted definition, see
`cross_entropy`), z-loss (z * lse² per token) and a logit softcap (softcap * tanh(x / softcap), applied
before the softmax) fused into the same sweep. Losses are fp32 whatever the logits' dtype.

The bytes argument. Ideal traffic is one read of the logits for the forward and one read of the
logits plus one write of dlogits for the backward: 3 N·V·esize when the two run as separate ops
(torch.compile's fused forward and backward do exactly that, at best). With ``grad_in_forward``,
the forward sweeps each row twice: the first sweep reads it from HBM and finds lse, the second
re-reads it back to front, mostly from L2 (the chunks read last are re-read first), and writes
dlogits already scaled for the reduction. The backward is then a scale by grad_output, and when
grad_output is 1 (``loss.backward()``) a launch that reads one scalar and touches nothing else:
forward + backward move ~2 N·V·esize. When grad_output is not 1 (loss divided by the
accumulation steps, a GradScaler) the scale reads and writes dlogits once more, 4 N·V·esize in all,
and ``grad_in_forward=False`` is the better choice (forward reads once, backward recomputes the
softmax from the saved lse: 3 N·V·esize).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..roofline.model import Cost, dtype_key
from ..runtime.alloc import empty
from ..runtime import autotune, interpreting, launch, next_pow2, num_sms
from . import _validate
from ._ce_common import TARGET_DTYPES, class_weight_buffer, mean_divisor, weight_launch_args
from ._dispatch import Op, reference_vjp, traced, wants_grad
from .gemm.fp8 import e4m3_bits, fp8_clamp, fp8_scale
from .registry import OpSpec, optional_import, register

# Chunk of a row per loop step: 16 fp32 per thread at 16 warps, and 16 KB of bf16 in flight per chunk.
MAX_BLOCK_V = 8192


def _prune_warps(configs, named_args, **kwargs):
    """Keep configs with at least 2 elements per thread in a chunk (tiny vocabularies take the fewest
    warps); the L2 hint only matters when a second sweep follows."""
    block = kwargs.get("BLOCK_V", named_args.get("BLOCK_V"))
    second_sweep = kwargs.get("COMPUTE_GRAD", named_args.get("COMPUTE_GRAD", False))
    configs = [c for c in configs if second_sweep or not c.kwargs.get("L2_HINT", False)]
    keep = [c for c in configs if block / (32 * c.num_warps) >= 2]
    return keep or [min(configs, key=lambda c: (c.num_warps, c.kwargs["PROGRAMS_PER_SM"]))]


# Persistent grid of PROGRAMS_PER_SM programs per SM, each walking rows: fewer rows in flight keep
# more of each row in L2 for the second sweep, more hide more latency. (No num_stages: Triton does
# not pipeline these loops; sweep 1 prefetches its next chunk by hand.)
BWD_CONFIGS = [triton.Config({"PROGRAMS_PER_SM": k}, num_warps=w) for w in (16, 8, 32) for k in (2, 1)]
# L2_HINT: the first sweep loads with evict_last so the second finds the row in L2; measured, not assumed.
FWD_CONFIGS = [triton.Config({**c.kwargs, "L2_HINT": h}, num_warps=c.num_warps)
               for h in (True, False) for c in BWD_CONFIGS]


@triton.jit
def _softcap(x, softcap, inv_softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        # tanh(y) = 1 - 2 / (exp(2y) + 1): one exp and a fast division, exact limits at ±inf.
        x = softcap * (1.0 - tl.fdiv(2.0, tl.exp(2.0 * inv_softcap * x) + 1.0))
    return x


@triton.jit
def _load_chunk(x_row, cols, mask, KEEP_IN_L2: tl.constexpr):
    if KEEP_IN_L2:
        x = tl.load(x_row + cols, mask=mask, other=float("-inf"), eviction_policy="evict_last")
    else:
        x = tl.load(x_row + cols, mask=mask, other=float("-inf"), eviction_policy="evict_first")
    return x


@triton.jit
def _write_grad_row(x_row, d_row, w_row, t, valid, lse, scale, w_t, w_sum, V, label_smoothing, z2, softcap,
                    inv_softcap, HAS_SOFTCAP: tl.constexpr, HAS_Z: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                    REVERSE: tl.constexpr, BLOCK_V: tl.constexpr, q_row, scale8, FP8_OUT: tl.constexpr):
    """d_row = scale * (softmax(s) * (1 + 2 z lse) - eps / V - (1 - eps) onehot(t)) * ds/dx, zero if ignored; with
    FP8_OUT also its e4m3 bits / scale8 (clamped to +-448) to q_row.

    With class weights w (w_t the target's, W their sum; torch's smoothing term is eps / V * sum_c w_c
    (lse - s_c)): scale * (p * ((1 - eps) w_t + eps W / V + 2 z lse w_t) - eps w_c / V - (1 - eps) w_t onehot(t))."""
    z_coef = scale * z2 * lse * w_t
    smooth = scale * label_smoothing / V
    hit = scale * (1.0 - label_smoothing) * w_t
    p_coef = scale
    if HAS_WEIGHT:
        p_coef = scale * ((1.0 - label_smoothing) * w_t + label_smoothing / V * w_sum)
    n_chunks = tl.cdiv(V, BLOCK_V)
    for i in range(0, n_chunks):
        if REVERSE:  # back to front: the chunks the first sweep read last are still in L2
            start = (n_chunks - 1 - i) * BLOCK_V
        else:
            start = i * BLOCK_V
        cols = start + tl.arange(0, BLOCK_V)
        in_row = cols < V
        x = tl.load(x_row + cols, mask=in_row & valid, other=0.0, eviction_policy="evict_first").to(tl.float32)
        s = _softcap(x, softcap, inv_softcap, HAS_SOFTCAP)
        p = tl.exp(s - lse)
        if HAS_WEIGHT:  # the weights (V fp32, shared by every row) stay in L2
            g = p * p_coef - smooth * tl.load(w_row + cols, mask=in_row & valid, other=0.0)
        else:
            g = p * p_coef - smooth
        g -= tl.where(cols == t, hit, 0.0)
        if HAS_Z:  # added after p - 1 so that a near-one-hot row keeps the small z term exact
            g += p * z_coef
        if HAS_SOFTCAP:
            y = s * inv_softcap
            g = g * (1.0 - y * y)
        g = tl.where(valid, g, 0.0)
        tl.store(d_row + cols, g.to(d_row.dtype.element_ty), mask=in_row, eviction_policy="evict_first")
        if FP8_OUT:  # the e4m3 row of the fp32 gradient (bits: the GPU's convert, or encoded in the interpreter)
            tl.store(q_row + cols, e4m3_bits(fp8_clamp(g, scale8)), mask=in_row, eviction_policy="evict_first")


@triton.jit
def _target_weight(WEIGHT, t, V, ok, HAS_WEIGHT: tl.constexpr):
    """(w_t, W): the target's class weight and the sum of all of them (stored after the V weights);
    (1, 0) without weights, where neither is read."""
    if HAS_WEIGHT:
        return tl.load(WEIGHT + t, mask=ok, other=0.0), tl.load(WEIGHT + V)
    else:
        return 1.0, 0.0


# WEIGHT and HAS_WEIGHT come last, with defaults, so that callers launching these kernels without class
# weights (ops/linear_cross_entropy.py) keep their positional arguments.
@autotune(FWD_CONFIGS, key=["V", "BLOCK_V", "HAS_SOFTCAP", "HAS_SMOOTHING", "HAS_Z", "COMPUTE_GRAD", "MEAN",
                            "HAS_WEIGHT", "FP8_OUT"],
          prune_configs_by={"early_config_prune": _prune_warps})
@triton.jit
def cross_entropy_fwd_kernel(LOGITS, TARGET, COUNT, LOSS, ZLOSS, LSE, DLOGITS, stride_l, stride_d, N, V,
                             ignore_index, label_smoothing, z_loss, softcap, inv_softcap,
                             MEAN: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                             HAS_Z: tl.constexpr, COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
                             PROGRAMS_PER_SM: tl.constexpr, L2_HINT: tl.constexpr, WEIGHT=None,
                             HAS_WEIGHT: tl.constexpr = False, Q8=None, S8=None, stride_q8=0, tiny8=0.0,
                             FP8_OUT: tl.constexpr = False):
    """With FP8_OUT (plain rows: no smoothing, z-loss or softcap) the pass that writes dlogits also writes their
    float8_e4m3fn rows to Q8 (as bytes) and one fp32 scale per row to S8, for the fp8 LM head's dhidden GEMM. The
    row's amax is known before that pass: |dlogits| peaks at the target, where it is scale * w_t * (1 - p_t), and
    every other entry is scale * w_t * p_j <= that. 1 - p_t is taken as (sum of exp over the other classes) / (sum
    over all), both kept by the first sweep, so a near-certain row keeps its small amax exact instead of 1 - p_t
    cancelling. So the quantization costs one byte written per logit instead of a quantize_rows pass (two reads of
    the bf16 dlogits and the write)."""
    scale = 1.0
    if MEAN:
        if COMPUTE_GRAD:
            scale = 1.0 / tl.load(COUNT).to(tl.float32)
    for row in range(tl.program_id(0), N, tl.num_programs(0)):
        r64 = tl.cast(row, tl.int64)
        t = tl.load(TARGET + r64).to(tl.int64)
        # Ignored rows are predicated off rather than branched around: their loads are masked (no
        # traffic), their loss and gradient are selected to zero.
        valid = t != ignore_index
        in_range = (t >= 0) & (t < V)
        w_t, w_sum = _target_weight(WEIGHT, t, V, valid & in_range, HAS_WEIGHT)
        x_row = LOGITS + r64 * stride_l
        m = tl.full((), float("-inf"), tl.float32)
        acc = tl.zeros([BLOCK_V], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_V], dtype=tl.float32)  # FP8_OUT: the same sum without the target's term
        sum_s = tl.zeros([BLOCK_V], dtype=tl.float32)
        cols = tl.arange(0, BLOCK_V)
        x_next = _load_chunk(x_row, cols, (cols < V) & valid, COMPUTE_GRAD and L2_HINT)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = (cols < V) & valid
            # Issue the next chunk's load before reducing this one, so HBM latency overlaps the math
            # (past the row's end it is fully masked: no traffic).
            x = x_next
            x_next = _load_chunk(x_row, cols + BLOCK_V, (cols + BLOCK_V < V) & valid,
                                 COMPUTE_GRAD and L2_HINT)
            s = _softcap(x.to(tl.float32), softcap, inv_softcap, HAS_SOFTCAP)
            if HAS_SOFTCAP:
                s = tl.where(mask, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            # While every logit so far is -inf (masked vocab padding), rescale against 0, not -inf - -inf.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_ref)
            e = tl.exp(s - m_ref)
            acc = acc * alpha + e
            if FP8_OUT:
                acc_o = acc_o * alpha + tl.where(cols == t, 0.0, e)
            m = m_new
            if HAS_SMOOTHING:
                if HAS_WEIGHT:
                    sum_s += tl.where(mask, s * tl.load(WEIGHT + cols, mask=mask, other=0.0), 0.0)
                else:
                    sum_s += tl.where(mask, s, 0.0)
        lse = m + tl.log(tl.sum(acc, axis=0))
        # A class index outside [0, V) other than ignore_index gives its row a NaN loss and gradient.
        lse = tl.where(in_range | (t == ignore_index), lse, float("nan"))
        s_t = _softcap(tl.load(x_row + t, mask=valid & in_range, other=0.0).to(tl.float32),
                       softcap, inv_softcap, HAS_SOFTCAP)
        if HAS_WEIGHT:  # torch: (1 - eps) w_t (lse - s_t) + eps / V * sum_c w_c (lse - s_c)
            loss = (1.0 - label_smoothing) * w_t * (lse - s_t)
            if HAS_SMOOTHING:
                loss += label_smoothing / V * (w_sum * lse - tl.sum(sum_s, axis=0))
        else:
            loss = lse - (1.0 - label_smoothing) * s_t
            if HAS_SMOOTHING:
                loss -= label_smoothing / V * tl.sum(sum_s, axis=0)
        if HAS_Z:
            zl = z_loss * lse * lse * w_t
            loss += zl
            tl.store(ZLOSS + r64, tl.where(valid, zl, 0.0))
        tl.store(LOSS + r64, tl.where(valid, loss, 0.0))
        tl.store(LSE + r64, lse)
        if COMPUTE_GRAD:
            scale8 = 1.0
            q_row = DLOGITS  # (not written without FP8_OUT)
            if FP8_OUT:
                q_row = Q8 + r64 * stride_q8  # the row's |dlogits| max (see the docstring); NaN where the loss is NaN
                amax = tl.abs(scale * w_t) * (tl.sum(acc_o, axis=0) / tl.sum(acc, axis=0))
                amax = tl.where(valid, amax, 0.0)
                amax = tl.where(lse == lse, amax, float("nan"))
                scale8 = fp8_scale(amax, tiny8, DLOGITS.dtype.element_ty)
                tl.store(S8 + r64, scale8)
            _write_grad_row(x_row, DLOGITS + r64 * stride_d, WEIGHT, t.to(tl.int32), valid, lse, scale, w_t, w_sum,
                            V, label_smoothing, 2.0 * z_loss, softcap, inv_softcap, HAS_SOFTCAP, HAS_Z, HAS_WEIGHT,
                            True, BLOCK_V, q_row, scale8, FP8_OUT)


@autotune(BWD_CONFIGS, key=["V", "BLOCK_V", "HAS_SOFTCAP", "HAS_Z", "MEAN", "HAS_WEIGHT"],
          prune_configs_by={"early_config_prune": _prune_warps})
@triton.jit
def cross_entropy_bwd_kernel(LOGITS, TARGET, LSE, GRAD, COUNT, DLOGITS, stride_l, stride_d, stride_g, N, V,
                             ignore_index, label_smoothing, z2, softcap, inv_softcap, MEAN: tl.constexpr,
                             HAS_SOFTCAP: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_V: tl.constexpr,
                             PROGRAMS_PER_SM: tl.constexpr, WEIGHT=None, HAS_WEIGHT: tl.constexpr = False):
    """The recompute backward: one read of the logits, softmax rebuilt from the saved lse."""
    inv_count = 1.0
    if MEAN:
        inv_count = 1.0 / tl.load(COUNT).to(tl.float32)
    for row in range(tl.program_id(0), N, tl.num_programs(0)):
        r64 = tl.cast(row, tl.int64)
        t = tl.load(TARGET + r64).to(tl.int64)
        scale = tl.load(GRAD + r64 * stride_g).to(tl.float32) * inv_count
        valid = t != ignore_index
        w_t, w_sum = _target_weight(WEIGHT, t, V, valid & (t >= 0) & (t < V), HAS_WEIGHT)
        # An out-of-range t has a NaN lse, so truncating it to int32 for the one-hot compare is harmless.
        _write_grad_row(LOGITS + r64 * stride_l, DLOGITS + r64 * stride_d, WEIGHT, t.to(tl.int32), valid,
                        tl.load(LSE + r64), scale, w_t, w_sum, V, label_smoothing, z2, softcap, inv_softcap,
                        HAS_SOFTCAP, HAS_Z, HAS_WEIGHT, False, BLOCK_V, DLOGITS, 1.0, False)


@triton.jit
def _scale_row(src, dst, f, valid, V, BLOCK_V: tl.constexpr):
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        m = cols < V
        x = tl.load(src + cols, mask=m & valid, other=0.0, eviction_policy="evict_first").to(tl.float32)
        tl.store(dst + cols, tl.where(valid, x * f, 0.0).to(dst.dtype.element_ty), mask=m)


@triton.jit
def cross_entropy_grad_scale_kernel(DL, OUT, GRAD, APPLIED, TARGET, stride_dl, stride_out, stride_g, stride_a,
                                    V, ignore_index, HAS_APPLIED: tl.constexpr, IN_PLACE: tl.constexpr,
                                    BLOCK_V: tl.constexpr):
    """The grad_in_forward backward: dlogits *= grad_output / (the factor already applied, if any)."""
    row = tl.program_id(0).to(tl.int64)
    f = tl.load(GRAD + row * stride_g).to(tl.float32)
    if HAS_APPLIED:
        f = f / tl.load(APPLIED + row * stride_a)
    valid = tl.load(TARGET + row) != ignore_index
    if IN_PLACE:
        # A factor of 1 (loss.backward()) or an ignored row (already zero) moves no bytes.
        if valid & (f != 1.0):
            _scale_row(DL + row * stride_dl, DL + row * stride_dl, f, valid, V, BLOCK_V)
    else:
        _scale_row(DL + row * stride_dl, OUT + row * stride_out, f, valid, V, BLOCK_V)


# --- launchers ---

def _block_v(v: int) -> int:
    return min(MAX_BLOCK_V, max(16, next_pow2(v)))


def _validate_float(x, name):
    if isinstance(x, torch.Tensor) and x.is_meta and x.dtype in _validate.FLOAT_DTYPES:
        return x  # a meta call runs no kernel: only shapes and dtypes matter
    return _validate.tensor(x, name)


def _validate_tensors(logits, target, weight=None):
    _validate_float(logits, "logits")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (N, V), got shape {tuple(logits.shape)}; flatten (B, T, V) "
                         f"logits with logits.view(-1, V) and targets with target.view(-1)")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"target has dtype {str(target.dtype).replace('torch.', '')}; supported: int64, int32 "
                        f"(class indices; probability targets are not supported)")
    n, v = logits.shape
    if target.shape != (n,):
        raise ValueError(f"target must have shape ({n},) to match logits (N, V) = {tuple(logits.shape)}, "
                         f"got {tuple(target.shape)}")
    _validate.same_device(target, "target", logits, "logits")
    if v == 0 and n > 0:
        raise ValueError("logits has V = 0 classes; cross-entropy needs at least one")
    if weight is not None:
        _validate_float(weight, "weight")
        if weight.shape != (v,):
            raise ValueError(f"weight must have shape ({v},), one weight per class of logits (N, V) = "
                             f"{tuple(logits.shape)}, got {tuple(weight.shape)}")
        _validate.same_device(weight, "weight", logits, "logits")


def _reduce(rows: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return rows
    total = rows.sum()
    return total / count if reduction == "mean" else total


def cross_entropy_fwd(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int,
                      label_smoothing: float, z_loss: float, softcap: Optional[float], reduction: str,
                      grad_in_forward: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward. Returns (loss, z_loss, lse, dlogits): loss and z_loss fp32 (0-dim, or (N,) for
    reduction='none'), lse (N,) fp32, dlogits (N, V) in logits' dtype when grad_in_forward else (0,).
    Logits are read with their row stride (a row-padded or row-sliced view is not copied)."""
    _validate_tensors(logits, target, weight)
    ignore_index, label_smoothing, z_loss, softcap, reduction = _validate.loss_options(
        ignore_index, label_smoothing, z_loss, softcap, reduction)
    n, v = logits.shape
    _validate.target_values(target, v, ignore_index)
    x, t, wbuf = _validate.rows_2d(logits, v), _validate.unit_last(target), class_weight_buffer(weight, v)
    loss_rows = empty((n,), dtype=torch.float32, device=logits.device)
    lse = empty((n,), dtype=torch.float32, device=logits.device)
    z_rows = empty((n,), dtype=torch.float32, device=logits.device) if z_loss else None
    dlogits = empty((n, v), dtype=logits.dtype, device=logits.device) if grad_in_forward else logits.new_empty(0)
    count = mean_divisor(t, wbuf, v, ignore_index) if reduction == "mean" else t
    if n:
        block, sms = _block_v(v), num_sms(logits.device)
        grid = lambda meta: (min(n, meta["PROGRAMS_PER_SM"] * sms),)  # noqa: E731
        flags = dict(MEAN=reduction == "mean", HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing > 0,
                     HAS_Z=bool(z_loss), COMPUTE_GRAD=bool(grad_in_forward), BLOCK_V=block)
        weighted = weight_launch_args(flags, wbuf)
        launch(cross_entropy_fwd_kernel, grid, (v, logits.dtype, *flags.values()),
               x, t, count, loss_rows, z_rows if z_loss else loss_rows, lse, dlogits if grad_in_forward else x,
               x.stride(0), v, n, v, ignore_index, label_smoothing, z_loss, softcap or 1.0,
               1.0 / (softcap or 1.0), **flags, **weighted)
    loss = _reduce(loss_rows, count, reduction)
    zl = _reduce(z_rows, count, reduction) if z_loss else torch.zeros(loss.shape, device=logits.device)
    return loss, zl, lse, dlogits


def cross_entropy_bwd(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                      weight: Optional[torch.Tensor], ignore_index: int, label_smoothing: float, z_loss: float,
                      softcap: Optional[float], reduction: str, grad_in_forward: bool) -> torch.Tensor:
    """The recompute backward: dlogits (N, V) in logits' dtype from the logits and the saved lse. With
    grad_in_forward, `logits` holds the forward's dlogits, scaled by grad into a new tensor (`scale_grad`)."""
    if grad_in_forward:
        return scale_grad(logits, grad, target, ignore_index)
    n, v = logits.shape
    x, t, wbuf = _validate.rows_2d(logits, v), _validate.unit_last(target), class_weight_buffer(weight, v)
    dx = empty((n, v), dtype=logits.dtype, device=logits.device)
    if not dx.numel():
        return dx
    count = mean_divisor(t, wbuf, v, ignore_index) if reduction == "mean" else t
    stride_g = grad.stride(0) if grad.dim() else 0
    block, sms = _block_v(v), num_sms(logits.device)
    grid = lambda meta: (min(n, meta["PROGRAMS_PER_SM"] * sms),)  # noqa: E731
    flags = dict(MEAN=reduction == "mean", HAS_SOFTCAP=softcap is not None, HAS_Z=bool(z_loss), BLOCK_V=block)
    weighted = weight_launch_args(flags, wbuf)
    launch(cross_entropy_bwd_kernel, grid, (v, logits.dtype, grad.dtype, *flags.values()),
           x, t, lse, grad, count, dx, x.stride(0), v, stride_g, n, v, ignore_index, label_smoothing,
           2.0 * z_loss, softcap or 1.0, 1.0 / (softcap or 1.0), **flags, **weighted)
    return dx


def scale_grad(dlogits, grad, target, ignore_index=-100, applied=None, in_place=False):
    """dlogits * grad / applied per row (grad and applied 0-dim or (N,)); ignored rows stay zero.
    In place, rows whose factor is 1 are not touched, so ``loss.backward()`` costs one tiny launch."""
    n, v = dlogits.shape
    out = dlogits if in_place else empty((n, v), dtype=dlogits.dtype, device=dlogits.device)
    if not dlogits.numel():
        return out
    stride = lambda a: a.stride(0) if a is not None and a.dim() else 0  # noqa: E731
    launch(cross_entropy_grad_scale_kernel, (n,), None,
           dlogits, out, grad, applied if applied is not None else grad, _validate.unit_last(target),
           dlogits.stride(0), out.stride(0), stride(grad), stride(applied), v, ignore_index,
           HAS_APPLIED=applied is not None, IN_PLACE=in_place, BLOCK_V=_block_v(v), num_warps=8)
    return out


# --- the op, declared once: custom ops (torch.compile), fakes, autograd, the eager path ---

def _fake(logits, target, weight, ignore_index, label_smoothing, z_loss, softcap, reduction, grad_in_forward):
    _validate_tensors(logits, target, weight)
    _validate.loss_options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    n, v = logits.shape
    shape = (n,) if reduction == "none" else ()
    f32 = torch.float32
    return (logits.new_empty(shape, dtype=f32), logits.new_empty(shape, dtype=f32), logits.new_empty((n,), dtype=f32),
            logits.new_empty((n, v) if grad_in_forward else (0,)))


def _validate_no_weight_grad(ctx):
    if ctx.needs_input_grad[2]:  # as torch's: F.cross_entropy has no derivative for weight either
        raise NotImplementedError("kernelkit.cross_entropy has no gradient for `weight`: pass the class weights "
                                  "detached (torch.nn.functional.cross_entropy has none either)")


def _setup_context(ctx, inputs, output):
    logits, target, weight, *args = inputs  # args: ignore_index, ..., reduction, grad_in_forward
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(output[3] if args[-1] else logits, target, output[2], weight)
    ctx.args, ctx.applied = tuple(args), None


def _backward(ctx, kernels, dloss, _dz):
    _validate_no_weight_grad(ctx)
    saved, target, lse, weight = ctx.saved_tensors
    if ctx.args[-1] and kernels.bwd is cross_entropy_bwd:
        # Eager grad_in_forward: the saved dlogits are this call's own buffer (a compiled graph is functional
        # and takes the kernel's out-of-place scale instead).
        ignore_index = ctx.args[0]
        if ctx.applied is None:
            # First backward: scale the saved gradient in place and hand over that buffer.
            ctx.applied = dloss.detach().to(torch.float32, copy=True).contiguous()
            return (scale_grad(saved, dloss, target, ignore_index, in_place=True),) + (None,) * 8
        # Again through a retained graph: the buffer (and the gradient handed out before) holds
        # dlogits * first grad_output; divide that out into a fresh buffer. Exact unless the first
        # grad_output was 0 or non-finite, which gives NaN here.
        return (scale_grad(saved, dloss, target, ignore_index, applied=ctx.applied),) + (None,) * 8
    return (kernels.bwd(dloss, saved, target, lse, weight, *ctx.args),) + (None,) * 8


def _double_backward(ctx, dloss, _dz):
    """create_graph=True: the gradient of the PyTorch reference, differentiable (needs the saved logits)."""
    _validate_no_weight_grad(ctx)
    ignore_index, label_smoothing, z_loss, softcap, reduction, grad_in_forward = ctx.args
    if grad_in_forward:
        raise RuntimeError("kernelkit.cross_entropy has no double backward with grad_in_forward=True (the forward "
                           "kept dlogits, not the logits): call it with grad_in_forward=False for create_graph=True")
    logits, target, _, weight = ctx.saved_tensors
    ref = functools.partial(reference, target=target, weight=weight, ignore_index=ignore_index,
                            label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, reduction=reduction)
    return reference_vjp(ref, (logits,), (dloss,), 9)


CROSS_ENTROPY = Op("cross_entropy", cross_entropy_fwd, fake=_fake, setup_context=_setup_context, backward=_backward,
                   bwd=cross_entropy_bwd, bwd_fake=lambda grad, logits, *_: logits.new_empty(logits.shape),
                   double_backward=_double_backward, n_grad=3, public=(0, 1))


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, weight: Optional[torch.Tensor] = None,
                  ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                  softcap: Optional[float] = None, reduction: str = "mean", return_z_loss: bool = False,
                  grad_in_forward: Optional[bool] = None):
    """Cross-entropy of logits (N, V) against class indices target (N,), like ``F.cross_entropy``.

    logits: float32, bfloat16 or float16, any strides (rows are read with their stride; a view whose
    last dim is not unit-stride is copied); target: int64 (or int32), any strides, with ``ignore_index``
    marking tokens that get zero loss and gradient. Every option is keyword-only (F.cross_entropy's third
    positional argument is ``weight``: a positional slip must not land elsewhere). Fused in one kernel,
    fp32 throughout: ``weight`` (V,) class weights with torch's semantics (a token's loss and gradient
    scaled by its target's weight, 'mean' divided by the weights' sum over non-ignored tokens, and with
    ``label_smoothing`` the smoothing term ``eps / V * sum_c w_c (lse - s_c)``), ``softcap``
    (``softcap * tanh(logits / softcap)`` before the softmax, differentiated through), ``label_smoothing``
    (torch's definition), and ``z_loss`` (``z_loss * lse²`` added per token, times its weight if any).
    reduction 'mean' averages over non-ignored tokens (NaN when there are none, like torch), 'sum' adds,
    'none' gives (N,). The loss is fp32 whatever the logits' dtype, per-token losses included (as HF's
    loss on upcast logits; torch's F.cross_entropy on bf16 logits rounds to bf16). With
    ``return_z_loss`` returns (loss, z_part), z_part the z-loss share reduced the same way, for logging
    (no gradient). A class index outside [0, V) raises on CPU inputs; on the GPU (where checking costs
    a sync) it gives that token a NaN loss and gradient. No gradient for ``weight`` (as torch).

    ``grad_in_forward`` (default: when logits need a gradient and reduction is not 'none') writes
    dlogits during the forward and makes the backward a scale by grad_output, free when that is 1
    (see the module docstring for the bytes). Under torch.compile (a functional graph, where the
    scale cannot be done in place) and for reduction='none' (grad_output is a vector) the default
    is the recompute backward. A second backward through a retained graph is supported; a double
    backward (create_graph=True) differentiates the PyTorch reference when the logits were kept
    (``grad_in_forward=False``) and raises otherwise.
    """
    ignore_index, label_smoothing, z_loss, softcap, reduction = _validate.loss_options(
        ignore_index, label_smoothing, z_loss, softcap, reduction)
    if grad_in_forward is None:
        grad_in_forward = reduction != "none" and not traced(logits)
    loss, zl = CROSS_ENTROPY(logits, target, weight, ignore_index, label_smoothing, z_loss, softcap, reduction,
                             bool(grad_in_forward) and wants_grad(logits))
    return (loss, zl) if return_z_loss else loss


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """Drop-in for `torch.nn.CrossEntropyLoss` (same constructor and state_dict) with z_loss and softcap.

    Runs kernelkit's kernel on (N, V) logits with class-index targets, class weights included; the loss
    is fp32. Documented fallbacks to torch: probability targets, (N, C, d...) or unbatched inputs, and
    CPU tensors outside the interpreter.
    """

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: Optional[float] = None):
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.z_loss, self.softcap = z_loss, softcap

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if input.dim() != 2 or target.is_floating_point():
            if self.z_loss or self.softcap is not None:
                raise ValueError("z_loss and softcap need (N, V) logits and class-index targets")
            return super().forward(input, target)
        kw = dict(weight=self.weight, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                  z_loss=self.z_loss, softcap=self.softcap, reduction=self.reduction)
        if input.device.type != "cuda" and not interpreting() and not input.is_meta:
            return reference(input, target, **kw)
        return cross_entropy(input, target, **kw)


def reference(logits: torch.Tensor, target: torch.Tensor, *, weight: Optional[torch.Tensor] = None,
              ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
              softcap: Optional[float] = None, reduction: str = "mean", return_z_loss: bool = False,
              grad_in_forward: Optional[bool] = None):
    """Plain PyTorch: F.cross_entropy on fp32 (or fp64) logits, the way HF models compute the LM loss;
    the loss is fp32 (fp64 for fp64 logits), like the kernel's."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    target = target.long()
    w = None if weight is None else weight.detach().to(x.dtype)
    loss = F.cross_entropy(x, target, weight=w, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction="none")
    valid = target != ignore_index
    # 'mean' divides by the non-ignored tokens, or by their target weights' sum (torch's weighted mean).
    w_t = torch.where(valid, w[torch.where(valid, target, 0)], 0.0) if w is not None else valid.to(x.dtype)
    zl = None
    if z_loss or return_z_loss:
        zl = torch.where(valid, z_loss * torch.logsumexp(x, dim=-1).square() * w_t, 0.0)
        loss = loss + zl

    def reduce(rows):
        if reduction == "none":
            return rows
        return rows.sum() / w_t.sum() if reduction == "mean" else rows.sum()

    return (reduce(loss), reduce(zl)) if return_z_loss else reduce(loss)


def cost(logits: torch.Tensor, target: torch.Tensor, *, weight: Optional[torch.Tensor] = None,
         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None,
         reduction: str = "mean", backward: bool = False, **_) -> Cost:
    """Ideal traffic: forward reads logits once (and target); backward reads logits (and target) and
    writes dlogits. The fused grad_in_forward forward + backward can beat their sum: see the docstring.
    Class weights (V values, read by every row from L2) are not counted."""
    n, v = logits.shape
    nv, esize = n * v, logits.element_size()
    t_bytes = target.numel() * target.element_size()
    cap_flops = 5.0 if softcap is not None else 0.0
    if backward:
        return Cost(flops=(6.0 + cap_flops) * nv, bytes=2.0 * nv * esize + t_bytes, dtype=dtype_key(logits.dtype))
    return Cost(flops=(4.0 + cap_flops) * nv, bytes=1.0 * nv * esize + t_bytes, dtype=dtype_key(logits.dtype))


def make_inputs(shape, dtype, device, generator=None):
    n, v = shape
    # randn * 2: about the spread of real LM logits, so the softmax is neither flat nor one-hot.
    logits = (2.0 * torch.randn(shape, device=device, generator=generator)).to(dtype)
    target = torch.randint(0, v, (n,), device=device, generator=generator)
    # ~10% ignored tokens (padding, prompt), as in LM fine-tuning batches.
    target[torch.rand(n, device=device, generator=generator) < 0.1] = -100
    return (logits, target), {}


def _liger_loader():
    fn = optional_import("liger_kernel.transformers.functional", "liger_cross_entropy")()
    if fn is None:
        return None

    def liger(logits, target, *, weight=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
              reduction="mean"):
        return fn(logits, target, weight, None, ignore_index, None, reduction, label_smoothing, z_loss, softcap)

    return liger


def _quack_loader():
    """quack's cross-entropy (CuTe DSL; `quack-kernels`, where it imports): the plain loss only (no weight,
    smoothing, z-loss or softcap: None where those are asked for, so no row compares unlike work)."""
    fn = optional_import("quack.cross_entropy", "cross_entropy")()
    if fn is None:
        return None

    def quack(logits, target, *, weight=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
              reduction="mean"):
        if weight is not None or label_smoothing or z_loss or softcap is not None:
            raise NotImplementedError("quack's cross_entropy has no weight, label smoothing, z-loss or softcap")
        return fn(logits, target, ignore_index=ignore_index, reduction=reduction)

    return quack


register(OpSpec(
    name="cross_entropy", fn=cross_entropy, reference=reference, cost=cost, make_inputs=make_inputs,
    grad_args=(0,),
    test_shapes=[(37, 1), (37, 7), (37, 1000), (13, 4097)],
    bench_shapes=[(8192, 32000), (8192, 128256), (4096, 256000)],
    competitors={"liger": _liger_loader, "quack": _quack_loader},
    replaces=("aten::cross_entropy_loss", "aten::nll_loss_forward", "aten::_log_softmax", "CrossEntropyLoss"),
    doc="Cross-entropy over large vocabularies: chunked online log-sum-exp, ignore_index, class weights, label "
        "smoothing, z-loss, softcap; fp32 loss; dlogits computed in the forward pass.",
))
