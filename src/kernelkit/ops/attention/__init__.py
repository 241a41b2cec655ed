"""Flash attention: softmax(scale * q kᵀ + mask) v, forward, backward and split-KV decoding.

Layout (batch, seq, heads, head_dim), or packed (total_tokens, heads, head_dim) with `cu_seqlens`.
Compute-bound: the floor is the matmul FLOPs; the O(seq²) scores never leave registers.

Masks, in query position i and key position j, with shift = seq_k - seq_q:
- causal: j <= i + shift (aligned bottom-right as in flash-attn: the last query sees every key);
- window=w: j >= i + shift - w (w keys to the left plus the diagonal, flash-attn's window_size=(w, 0)
  with causal, (w, -1) without).
A query that sees no key (causal with seq_q > seq_k) gets output 0 and lse -inf.

The package: `tiles` (tile loads and stores through TMA descriptors or pointers, masks, block ranges,
configs, layout decisions), `forward` (kernel, split-KV decoding, checks, launcher), `backward` (dq, dk,
dv kernels and launcher); here the op's declaration, the public function, the reference and the cost
model.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from ...roofline.model import Cost, dtype_key
from .._dispatch import Op, reference_vjp
from ..registry import OpSpec, optional_import, register
from .backward import attention_bwd
from .forward import _validate_inputs, attention_fwd, lse_shape

__all__ = ["attention", "attention_fwd", "attention_bwd", "reference", "cost"]


# --- the op, declared once: one graph node under torch.compile, autograd through our backward ---
# None travels as window -1, softcap 0.0 and max_seqlen 0 (the schema has no Optional[float] defaults).

def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor], causal: bool,
         window: int, softcap: float, max_seqlen: int, scale: float, deterministic: bool
         ) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_fwd(q, k, v, causal, None if window < 0 else window, softcap or None, cu_seqlens,
                         max_seqlen if cu_seqlens is not None else None, scale, checked=True)


def _bwd(do: Optional[torch.Tensor], dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         o: torch.Tensor, lse: torch.Tensor, cu_seqlens: Optional[torch.Tensor], causal: bool, window: int,
         softcap: float, max_seqlen: int, scale: float, deterministic: bool
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_bwd(do, dlse, q, k, v, o, lse, causal, None if window < 0 else window, softcap or None,
                         cu_seqlens, max_seqlen, scale, deterministic)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, *ctx.flags = inputs
    ctx.set_materialize_grads(False)  # an unused o or lse sends None: the backward skips its term
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)


def _backward(ctx, kernels, do, dlse):
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    return (*kernels.bwd(do, dlse, q, k, v, o, lse, cu_seqlens, *ctx.flags), *(None,) * 7)


def _double_backward(ctx, do, dlse):
    """create_graph=True: gradients of the PyTorch reference (it materializes the seq_q x seq_k scores and
    repeated K/V: as slow and as large as eager attention), differentiable in q, k, v and do, dlse."""
    q, k, v, _, _, cu_seqlens = ctx.saved_tensors
    causal, window, softcap, max_seqlen, scale, _ = ctx.flags

    def ref(q, k, v):
        return reference(q, k, v, causal, None if window < 0 else window, softcap or None, cu_seqlens,
                         max_seqlen if cu_seqlens is not None else None, scale, return_lse=True)

    return reference_vjp(ref, (q, k, v), (do, dlse), 10)


ATTENTION = Op(
    "attention", _fwd, fake=lambda q, k, v, cu_seqlens, *_: (
        q.new_empty(q.shape), q.new_empty(lse_shape(q, cu_seqlens is not None), dtype=torch.float32)),
    setup_context=_setup_context, backward=_backward, bwd=_bwd,
    bwd_fake=lambda do, dlse, q, k, v, *_: (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)),
    double_backward=_double_backward, n_grad=3)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, window: Optional[int] = None,
              softcap: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None,
              max_seqlen: Optional[int] = None, scale: Optional[float] = None, deterministic: bool = False,
              return_lse: bool = False):
    """Flash attention ``softmax(scale * q kᵀ + mask) v`` over (batch, seq, heads, head_dim) tensors.

    q: (batch, seq_q, heads_q, d); k, v: (batch, seq_k, heads_kv, d), heads_kv dividing heads_q (GQA/MQA:
    query head h reads KV head h // (heads_q // heads_kv), never a repeated copy). Packed sequences:
    q, k, v of shape (total_tokens, heads, d) with ``cu_seqlens`` (int32 offsets [0, len0, len0+len1, ...],
    one for q and k, starting at 0, never decreasing, ending at total_tokens) and ``max_seqlen`` (the
    longest length; computed with a host sync when None, which also checks cu_seqlens on the host; when
    given, cu_seqlens is checked on the device without a sync: a bad one raises at once on the CPU and
    fails the next synchronization on CUDA, never leaving output rows unwritten). bfloat16 or float16,
    d up to 256 (64 and 128 at full speed). Any batch, sequence and head strides are read in place
    (slices of a packed qkv projection, (b, h, s, d).transpose(1, 2), k/v broadcast over batch or heads,
    offset views); only a head_dim that is not unit-stride is copied. Tensor descriptors (sm_90+) are
    used when every base and stride is 16-byte aligned, pointer loads otherwise.

    ``causal``: key j <= i + seq_k - seq_q (bottom-right aligned, as flash-attn); ``window``: also
    j >= i + seq_k - seq_q - window; ``softcap``: logits become softcap * tanh(logits / softcap) after the
    scale (Gemma-2); ``scale`` defaults to 1/sqrt(d). Fused: scores, masks, softcap, online softmax and
    the value product in one pass; up to 16 queries against >= 128 keys take split-KV decoding.
    Returns o like q, and with ``return_lse`` also the fp32 natural-log log-sum-exp of each row,
    (batch, heads_q, seq_q) or (heads_q, total_tokens) packed; rows that see no key get o = 0, lse = -inf.
    Differentiable in q, k, v (and through lse); ``deterministic`` computes dq without atomics. A double
    backward (create_graph=True) differentiates the PyTorch reference, which materializes the scores.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if isinstance(q, torch.Tensor) and q.dim() and q.shape[-1] else 1.0
    # Validated here once as given (the op's encodings, window -1 and softcap 0 for None, would hide bad values).
    _, _, max_len = _validate_inputs(q, k, v, causal, window, softcap, cu_seqlens, max_seqlen, scale)
    flags = (bool(causal), -1 if window is None else window, float(softcap or 0.0),
             max_len if cu_seqlens is not None else 0, float(scale), bool(deterministic))
    o, lse = ATTENTION(q, k, v, cu_seqlens, *flags)
    return (o, lse) if return_lse else o


# --- reference, cost, benchmark inputs ---

def _mask(sq: int, sk: int, causal: bool, window: Optional[int], device) -> torch.Tensor:
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= i + (sk - sq)
    if window is not None:
        ok &= j >= i + (sk - sq) - window
    return ok


def _reference_dense(q, k, v, causal, window, softcap, scale):
    ct = q.dtype if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = (x.to(ct).transpose(1, 2) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    ok = _mask(q.shape[1], k.shape[1], causal, window, q.device)
    # The max only stabilizes the exponentials: it cancels in o and lse, so no gradient flows through it.
    m = torch.where(ok, s, float("-inf")).amax(-1, keepdim=True).detach() if s.shape[-1] else s.new_zeros(
        (*s.shape[:-1], 1))
    m = torch.where(torch.isinf(m) & (m < 0), 0.0, m)
    p = torch.where(ok, torch.exp(s - m), 0.0)
    denom = p.sum(-1, keepdim=True)
    seen = denom > 0
    o = (p @ vf) / torch.where(seen, denom, 1.0)
    lse = torch.where(seen, m + torch.log(torch.where(seen, denom, 1.0)), float("-inf")).squeeze(-1)
    return o.transpose(1, 2).to(q.dtype), lse if q.dtype == torch.float64 else lse.float()


def reference(q, k, v, causal=False, window=None, softcap=None, cu_seqlens=None, max_seqlen=None, scale=None,
              deterministic=False, return_lse=False):
    """Plain PyTorch attention with the same masks (materializes the scores and repeated K/V)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if cu_seqlens is None:
        o, lse = _reference_dense(q, k, v, causal, window, softcap, scale)
    else:
        cu = cu_seqlens.tolist()
        parts = [_reference_dense(q[None, a:b], k[None, a:b], v[None, a:b], causal, window, softcap, scale)
                 for a, b in zip(cu, cu[1:])]
        o = torch.cat([p[0][0] for p in parts], 0)
        lse = torch.cat([p[1][0] for p in parts], 1)
    return (o, lse) if return_lse else o


def attended_pairs(seq_q: int, seq_k: int, causal: bool, window: Optional[int]) -> int:
    """How many (query, key) pairs the mask keeps for one head of one sequence."""
    i = torch.arange(seq_q, dtype=torch.int64)
    hi = (i + (seq_k - seq_q) + 1).clamp(0, seq_k) if causal else torch.full_like(i, seq_k)
    lo = (i + (seq_k - seq_q) - window).clamp(0, seq_k) if window is not None else torch.zeros_like(i)
    return int((hi - lo).clamp_min(0).sum())


def cost(q, k, v, causal=False, window=None, softcap=None, cu_seqlens=None, max_seqlen=None, scale=None,
         deterministic=False, return_lse=False, backward=False) -> Cost:
    """FLOPs 4·d per attended (query, key) pair and query head (the two matmuls; a causal mask halves
    them, a window counts its area); backward 2.5x. Ideal bytes: q, k, v read and o written once
    (backward: q, k, v, o, do read, dq, dk, dv written)."""
    if cu_seqlens is None:
        pairs = q.shape[0] * attended_pairs(q.shape[1], k.shape[1], causal, window)
    else:
        cu = cu_seqlens.tolist()
        pairs = sum(attended_pairs(b - a, b - a, causal, window) for a, b in zip(cu, cu[1:]))
    flops = 4.0 * q.shape[-2] * q.shape[-1] * pairs
    qb, kvb = q.numel() * q.element_size(), (k.numel() + v.numel()) * k.element_size()
    if backward:
        return Cost(flops=2.5 * flops, bytes=4.0 * qb + 2.0 * kvb, dtype=dtype_key(q.dtype))
    return Cost(flops=flops, bytes=2.0 * qb + kvb, dtype=dtype_key(q.dtype))


def make_inputs(shape, dtype, device, generator=None):
    """shape = (batch, seq, heads, head_dim[, causal[, seq_k[, heads_kv]]]): q, k, v and kwargs {'causal': ...};
    packed sequences: shape = ((len0, len1, ...), heads, head_dim[, causal[, heads_kv]]): q, k, v of shape
    (total_tokens, heads, head_dim) and kwargs {'causal', 'cu_seqlens' (int32), 'max_seqlen'}."""
    if isinstance(shape[0], tuple):
        lens, h, d, causal, h_k = (*shape, *(False, shape[1])[len(shape) - 3:])
        q = torch.randn((sum(lens), h, d), dtype=dtype, device=device, generator=generator)
        k, v = (torch.randn((sum(lens), h_k, d), dtype=dtype, device=device, generator=generator) for _ in range(2))
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
        return (q, k, v), {"causal": bool(causal), "cu_seqlens": cu, "max_seqlen": max(lens)}
    b, s, h, d, causal, s_k, h_k = (*shape, *(False, shape[1], shape[2])[len(shape) - 4:])
    q = torch.randn((b, s, h, d), dtype=dtype, device=device, generator=generator)
    k, v = (torch.randn((b, s_k, h_k, d), dtype=dtype, device=device, generator=generator) for _ in range(2))
    return (q, k, v), {"causal": bool(causal)}


def _bhsd(*xs):
    return [x.transpose(1, 2) for x in xs]


def _sdpa(backend=None):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal=False, window=None, softcap=None, cu_seqlens=None, max_seqlen=None, scale=None,
            deterministic=False, return_lse=False):
        if window is not None or softcap is not None or cu_seqlens is not None or return_lse:
            raise NotImplementedError("SDPA takes no window, softcap, cu_seqlens or lse output")
        if causal and q.shape[1] != k.shape[1]:
            raise NotImplementedError("SDPA's is_causal is aligned top-left; only seq_q == seq_k compares")
        qt, kt, vt = _bhsd(q, k, v)
        kw = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
        if backend is None:
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, **kw).transpose(1, 2)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, **kw).transpose(1, 2)

    return run


def _sdpa_loader(backend_name):
    def load():
        from torch.nn.attention import SDPBackend

        return _sdpa(getattr(SDPBackend, backend_name))

    return load


def _deterministic_loader():
    """kernelkit with deterministic=True: dq from its own kernel instead of fp32 atomics (bwd cost of it)."""
    return lambda *a, **kw: attention(*a, **kw, deterministic=True)


def _flex_loader():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v, causal=False, window=None, softcap=None, cu_seqlens=None, max_seqlen=None, scale=None,
            deterministic=False, return_lse=False):
        if window is not None or softcap is not None or cu_seqlens is not None or return_lse:
            raise NotImplementedError("the flex row runs plain and causal attention only")
        block_mask = None
        if causal:
            sq, sk = q.shape[1], k.shape[1]
            key = (sq, sk, q.device)
            if key not in masks:
                masks[key] = create_block_mask(lambda b, h, i, j: j <= i + (sk - sq), None, None, sq, sk,
                                               device=q.device)
            block_mask = masks[key]
        qt, kt, vt = _bhsd(q, k, v)
        return compiled(qt, kt, vt, block_mask=block_mask, scale=scale,
                        enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)

    return run


def _fa4_loader():
    """FlashAttention-4's CuTe-DSL kernels (`flash-attn-4`, where `flash_attn.cute` imports; they run on sm_90 and
    sm_100), with kernelkit's masks mapped onto its arguments: causal bottom-right (flash-attn's convention, as
    kernelkit's), window w as window_size (w, 0) with causal and (w, None) without, softcap, scale, packed
    sequences through its varlen entry. None where it is not installed; no lse row (its packed lse layout
    differs)."""
    dense = optional_import("flash_attn.cute", "flash_attn_func")()
    packed = optional_import("flash_attn.cute", "flash_attn_varlen_func")()
    if dense is None or packed is None:
        return None

    def run(q, k, v, causal=False, window=None, softcap=None, cu_seqlens=None, max_seqlen=None, scale=None,
            deterministic=False, return_lse=False):
        if return_lse:
            raise NotImplementedError("the fa4 row compares o only")
        kw = dict(softmax_scale=scale, causal=bool(causal), softcap=float(softcap or 0.0),
                  window_size=(None, None) if window is None else (window, 0 if causal else None),
                  deterministic=deterministic)
        if cu_seqlens is None:
            out = dense(q, k, v, **kw)
        else:
            out = packed(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                         max_seqlen_k=max_seqlen, **kw)
        return out[0] if isinstance(out, tuple) else out

    return run


register(OpSpec(
    name="attention", fn=attention, reference=reference, cost=cost, make_inputs=make_inputs, grad_args=(0, 1, 2),
    test_shapes=[(1, 1, 2, 32), (2, 37, 2, 32, True), (1, 70, 3, 64), (2, 19, 4, 64, True), (2, 5, 4, 32, True, 23, 2),
                 ((9, 0, 23), 4, 32, True, 2)],
    # The packed shape fuzzes cu_seqlens's layouts too (issue 26: a stepped view was read as raw storage).
    layout_shape=[(2, 5, 4, 32, True, 23, 2), ((5, 7, 8), 2, 32, True)],
    bench_shapes=[(16384 // s, s, 2048 // d, d, c) for d in (64, 128) for s in (512, 1024, 2048, 4096, 8192, 16384)
                  for c in (False, True)],
    latency_shapes=[(1, 1, 32, 128, False, 8192, 8), (16, 1, 32, 128, False, 4096, 8)],  # decoding, GQA 4:1
    dtypes=("bfloat16", "float16"), eager=_sdpa(), generic_rows=(), baseline="sdpa-cudnn",
    competitors={"sdpa-flash": _sdpa_loader("FLASH_ATTENTION"), "sdpa-cudnn": _sdpa_loader("CUDNN_ATTENTION"),
                 "flex": _flex_loader, "kk-deterministic": _deterministic_loader, "fa4": _fa4_loader},
    replaces=("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
              "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention"),
    doc="Flash attention fwd+bwd (b, s, h, d): causal (bottom-right), sliding window, softcap, GQA/MQA, "
        "packed varlen, lse output, deterministic bwd, split-KV decoding.",
))