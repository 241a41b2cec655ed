"""Rotary position embedding (RoPE) of q and k in one launch, forward and backward.

Memory-bound: the floor is one read and one write of q and k (plus cos/sin once, or nothing when the
angles are computed in-kernel). A program owns BLOCK_T tokens × BLOCK_H heads of either q or k; the
head blocks of a token block are q's, then k's, so GQA (fewer k heads) costs no padding beyond one
partial head block. cos/sin are built once per program in fp32 and broadcast over its heads.
The backward is the same kernel rotating by -theta (sin negated).

cos/sin layouts accepted (converted to strides in the launcher, never copied):
- a table indexed by position, (max_pos, rotary_dim // 2): the documented layout, gathered with
  ``position_ids`` (B, S) or ``offset + s``; a duplicated (max_pos, rotary_dim) table also works;
- Hugging Face's per-token (B or 1, S, rotary_dim) (or (B, 1, S, rotary_dim)), duplicated halves
  ``cat(freqs, freqs)`` (or ``repeat_interleave(freqs, 2)`` when ``interleaved``);
- none: angles ``pos * inv_freq`` with inv_freq computed exactly as Hugging Face does, sin/cos in-kernel.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ..roofline.model import Cost, dtype_key
from ..runtime.alloc import empty
from ..runtime import autotune, capturing, cdiv, launch, next_pow2
from . import _validate
from ._dispatch import Op
from .registry import OpSpec, optional_import, register

COS_COMPUTED, COS_TABLE, COS_PER_TOKEN = 0, 1, 2


def _configs():
    return [triton.Config({"BLOCK_T": t, "BLOCK_H": h}, num_warps=w)
            for t in (16, 1, 2, 4, 8) for h in (4, 1, 2, 8, 16) for w in (4, 1, 2, 8)]


def _prune(configs, named_args, **kwargs):
    kw = {**named_args, **kwargs}
    per_head = 2 * kw["RD2_PAD"] + (kw["TAIL_PAD"] if kw["TAIL"] else 0)
    most_heads = next_pow2(max(kw["HQ"], kw["HK"], 1))
    keep = [c for c in configs
            if c.kwargs["BLOCK_H"] <= most_heads
            and 512 <= c.kwargs["BLOCK_T"] * c.kwargs["BLOCK_H"] * per_head <= 8192
            and 4 <= c.kwargs["BLOCK_T"] * c.kwargs["BLOCK_H"] * per_head / (32 * c.num_warps) <= 32]
    return keep or [min(configs, key=lambda c: (c.kwargs["BLOCK_T"] * c.kwargs["BLOCK_H"], c.num_warps))]


@triton.jit
def _rotate_heads(X, Y, xrow, yrow, sxh, syh, h0, H, c, sn, tok_ok,
                  ROT_HALF: tl.constexpr, RD2_PAD: tl.constexpr, TAIL: tl.constexpr, TAIL_PAD: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr):
    h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
    m = tok_ok[:, None, None] & (h < H)[None, :, None]
    xo = xrow[:, None, None] + h[None, :, None] * sxh
    yo = yrow[:, None, None] + h[None, :, None] * syh
    if INTERLEAVED:
        # Pairs (2i, 2i+1) are adjacent: load the rotary span contiguously (16-byte vectors) and split
        # in registers rather than issuing two stride-2 loads.
        d = tl.arange(0, 2 * RD2_PAD)[None, None, :]
        md = m & (d < 2 * ROT_HALF)
        x = tl.load(X + xo + d, mask=md, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_H, RD2_PAD, 2]))
        y = tl.join(x1 * c - x2 * sn, x2 * c + x1 * sn)
        tl.store(Y + yo + d, tl.reshape(y, [BLOCK_T, BLOCK_H, 2 * RD2_PAD]).to(Y.dtype.element_ty), mask=md)
    else:
        i = tl.arange(0, RD2_PAD)[None, None, :]
        mi = m & (i < ROT_HALF)
        x1 = tl.load(X + xo + i, mask=mi, other=0.0).to(tl.float32)
        x2 = tl.load(X + xo + ROT_HALF + i, mask=mi, other=0.0).to(tl.float32)
        tl.store(Y + yo + i, (x1 * c - x2 * sn).to(Y.dtype.element_ty), mask=mi)
        tl.store(Y + yo + ROT_HALF + i, (x2 * c + x1 * sn).to(Y.dtype.element_ty), mask=mi)
    if TAIL > 0:  # partial rotary: the pass-through dims are copied in the same pass
        j = tl.arange(0, TAIL_PAD)[None, None, :]
        mj = m & (j < TAIL)
        t = tl.load(X + xo + 2 * ROT_HALF + j, mask=mj, other=0.0)
        tl.store(Y + yo + 2 * ROT_HALF + j, t, mask=mj)


@autotune(_configs(), key=["HQ", "HK", "ROT_HALF", "TAIL", "INTERLEAVED", "COS_MODE", "T_BUCKET"],
          prune_configs_by={"early_config_prune": _prune})
@triton.jit
def rope_kernel(Q, K, QO, KO, COS, SIN, POS, INV_FREQ,
                T, S, HQ, HK, offset, max_pos, sign, T_BUCKET,
                sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sqo_b, sqo_s, sqo_h, sko_b, sko_s, sko_h,
                sc_b, sc_s, sc_i, ss_b, ss_s, ss_i, sp_b, sp_s,
                COS_MODE: tl.constexpr, HAS_POS: tl.constexpr, INTERLEAVED: tl.constexpr,
                ROT_HALF: tl.constexpr, RD2_PAD: tl.constexpr, TAIL: tl.constexpr, TAIL_PAD: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    # Head blocks vary fastest, so the programs of one token block run together and share its cos/sin
    # in cache (and, for (B, S, H, D) memory, stream one contiguous span).
    nh = tl.cdiv(HQ, BLOCK_H) + tl.cdiv(HK, BLOCK_H)
    pid = tl.program_id(0)
    pid_h = pid % nh
    tok = (pid // nh) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < T
    b = (tok // S).to(tl.int64)
    s = (tok % S).to(tl.int64)
    i = tl.arange(0, RD2_PAD)
    m = tok_ok[:, None] & (i < ROT_HALF)[None, :]
    if COS_MODE == 2:  # COS_PER_TOKEN
        c = tl.load(COS + b[:, None] * sc_b + s[:, None] * sc_s + i[None, :] * sc_i, mask=m, other=0.0)
        sn = tl.load(SIN + b[:, None] * ss_b + s[:, None] * ss_s + i[None, :] * ss_i, mask=m, other=0.0)
    else:
        if HAS_POS:
            pos = tl.load(POS + b * sp_b + s * sp_s, mask=tok_ok, other=0).to(tl.int64)
        else:
            pos = s + offset
        if COS_MODE == 0:  # COS_COMPUTED
            inv_freq = tl.load(INV_FREQ + i, mask=i < ROT_HALF, other=0.0)
            angle = pos.to(tl.float32)[:, None] * inv_freq[None, :]
            c = tl.cos(angle)
            sn = tl.sin(angle)
        else:  # COS_TABLE
            # A position outside the table reads nothing and yields NaN, visibly.
            mp = m & ((pos >= 0) & (pos < max_pos))[:, None]
            c = tl.load(COS + pos[:, None] * sc_s + i[None, :] * sc_i, mask=mp, other=float("nan"))
            sn = tl.load(SIN + pos[:, None] * ss_s + i[None, :] * ss_i, mask=mp, other=float("nan"))
    c = c.to(tl.float32)[:, None, :]
    sn = (sn.to(tl.float32) * sign)[:, None, :]
    nq = tl.cdiv(HQ, BLOCK_H)
    if pid_h < nq:
        _rotate_heads(Q, QO, b * sq_b + s * sq_s, b * sqo_b + s * sqo_s, sq_h, sqo_h, pid_h * BLOCK_H, HQ,
                      c, sn, tok_ok, ROT_HALF, RD2_PAD, TAIL, TAIL_PAD, BLOCK_T, BLOCK_H, INTERLEAVED)
    else:
        _rotate_heads(K, KO, b * sk_b + s * sk_s, b * sko_b + s * sko_s, sk_h, sko_h, (pid_h - nq) * BLOCK_H, HK,
                      c, sn, tok_ok, ROT_HALF, RD2_PAD, TAIL, TAIL_PAD, BLOCK_T, BLOCK_H, INTERLEAVED)


# --- launcher ---

@functools.lru_cache(maxsize=64)
def _inv_freq(rotary_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """Hugging Face's inv_freq bit for bit: computed in fp32 on the CPU, then moved (once per rotary_dim, base and
    device: the move synchronizes, so inside a CUDA graph capture a first call raises RuntimeError)."""
    if device.type == "cuda" and capturing():
        raise RuntimeError(f"kernelkit.rope computes cos/sin for rotary_dim={rotary_dim}, base={base} for the first "
                           f"time inside a CUDA graph capture, where moving its frequencies to the GPU would "
                           f"synchronize: run rope once eagerly with these before capturing")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return (1.0 / (base ** exponent)).to(device)


def _empty_same_layout(x: torch.Tensor, alloc=empty) -> torch.Tensor:
    """A dense output whose dims are laid out in x's stride order (like empty_like, also for slices), head_dim
    innermost; contiguous when x broadcasts a dim (stride 0: one batch's q for all, k shared by all heads),
    where the stride order says nothing about a dense layout."""
    if x.is_contiguous() or any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
        return alloc(x.shape, dtype=x.dtype, device=x.device)
    order = sorted(range(x.dim() - 1), key=lambda d: (-x.stride(d), -d)) + [x.dim() - 1]
    t = alloc(tuple(x.shape[d] for d in order), dtype=x.dtype, device=x.device)
    return t.permute([order.index(d) for d in range(x.dim())])


def _bshd(x: torch.Tensor, heads_first: bool) -> torch.Tensor:
    return x.transpose(1, 2) if heads_first else x


def _cos_view(cos: torch.Tensor, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """The rotary_dim // 2 informative columns of a cos/sin tensor, as a strided view."""
    if cos.shape[-1] == rotary_dim // 2:
        return cos
    return cos[..., ::2] if interleaved else cos[..., : rotary_dim // 2]


def resolve_rotary_dim(head_dim: int, cos: Optional[torch.Tensor], rotary_dim: Optional[int]) -> int:
    """rotary_dim when not given: head_dim without cos; 2 × width for a (max_pos, w) table (w when 2w
    would exceed head_dim: a duplicated table); the width of a Hugging Face (B, S, w) tensor."""
    if rotary_dim is None:
        if cos is None:
            rotary_dim = head_dim
        elif cos.dim() == 2 and 2 * cos.shape[-1] <= head_dim:
            rotary_dim = 2 * cos.shape[-1]
        else:
            rotary_dim = cos.shape[-1]
    if cos is not None and isinstance(cos, torch.Tensor) and cos.dim() >= 1 and cos.shape[-1] > head_dim:
        raise ValueError(f"the cos/sin table is {cos.shape[-1]} wide but head_dim is {head_dim}: a table holds at "
                         f"most head_dim columns (rotary_dim // 2, or rotary_dim with duplicated halves)")
    if rotary_dim is not None and head_dim % 2 and rotary_dim == head_dim:
        raise ValueError(f"head_dim {head_dim} is odd, so all of it cannot rotate in pairs: pass an even "
                         f"rotary_dim < head_dim (the remaining dims pass through)")
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be an even int in (0, head_dim={head_dim}], got {rotary_dim!r}")
    return rotary_dim


def _validate_inputs(q, k, cos, sin, position_ids, offset, rotary_dim, heads_first):
    _validate.tensor(q, "q", min_dim=4)
    _validate.tensor(k, "k", min_dim=4)
    _validate.same_device(k, "k", q, "q")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D {'(B, H, S, D)' if heads_first else '(B, S, H, D)'}, "
                         f"got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}; pass both in one dtype")
    qb, kb = _bshd(q, heads_first), _bshd(k, heads_first)
    if (qb.shape[0], qb.shape[1], qb.shape[3]) != (kb.shape[0], kb.shape[1], kb.shape[3]):
        raise ValueError(f"q and k must agree in batch, seq and head_dim (heads may differ), got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    B, S, _, D = qb.shape
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither (then the angles are computed from base)")
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be an int >= 0, got {offset!r}")
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError("position_ids must be an int32 or int64 tensor of shape (B, S)")
        _validate.same_device(position_ids, "position_ids", q, "q")
        if position_ids.dim() != 2 or position_ids.shape[0] not in (1, B) or position_ids.shape[1] != S:
            raise ValueError(f"position_ids must have shape ({B}, {S}) or (1, {S}), got {tuple(position_ids.shape)}")
        if offset:
            raise ValueError("pass position_ids or offset, not both")
    if cos is None:
        return
    _validate.tensor(cos, "cos", min_dim=2)
    _validate.tensor(sin, "sin", min_dim=2)
    _validate.same_device(cos, "cos", q, "q")
    _validate.same_device(sin, "sin", q, "q")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.shape[-1] not in (rotary_dim // 2, rotary_dim):
        raise ValueError(f"cos/sin last dim must be rotary_dim // 2 = {rotary_dim // 2} or rotary_dim = "
                         f"{rotary_dim} (duplicated halves), got {cos.shape[-1]}")
    if cos.dim() == 2:
        if position_ids is None and offset + S > cos.shape[0]:
            raise ValueError(f"offset + seq = {offset + S} exceeds the cos/sin table's {cos.shape[0]} positions")
        return
    if cos.dim() == 4 and cos.shape[1] != 1 or cos.dim() > 4:
        raise ValueError(f"cos/sin must be (max_pos, rotary_dim // 2), (B, S, rotary_dim) or (B, 1, S, rotary_dim), "
                         f"got {tuple(cos.shape)}")
    if cos.shape[0] not in (1, B) or cos.shape[-2] != S:
        raise ValueError(f"per-token cos/sin must have batch 1 or {B} and seq {S}, got {tuple(cos.shape)}")
    if position_ids is not None or offset:
        raise ValueError("per-token (B, S, rotary_dim) cos/sin already hold each token's angle: "
                         "position_ids and offset apply only to a (max_pos, rotary_dim // 2) table")


def rope_fwd(q: torch.Tensor, k: torch.Tensor, cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
             position_ids: Optional[torch.Tensor] = None, offset: int = 0, rotary_dim: Optional[int] = None,
             interleaved: bool = False, base: float = 10000.0, heads_first: bool = False, inverse: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the rotation of q and k (by -theta when `inverse`). Returns (q_out, k_out) laid out like q and k.
    Annotated: its signature is the schema of the custom op kernelkit::rope."""
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        rotary_dim = resolve_rotary_dim(q.shape[-1], cos, rotary_dim)
    _validate_inputs(q, k, cos, sin, position_ids, offset, rotary_dim, heads_first)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    qo, ko = _empty_same_layout(q), _empty_same_layout(k)
    qb, kb, qob, kob = (_bshd(t, heads_first) for t in (q, k, qo, ko))
    B, S, HQ, D = qb.shape
    HK = kb.shape[2]
    T = B * S
    if T == 0 or D == 0 or HQ + HK == 0:
        return qo, ko
    half = rotary_dim // 2
    dummy = qb
    pos_strides = (0, 0)
    if position_ids is not None:
        pos_strides = (position_ids.stride(0) if position_ids.shape[0] > 1 else 0, position_ids.stride(1))
    if cos is None:
        mode, c, s, inv = COS_COMPUTED, dummy, dummy, _inv_freq(rotary_dim, float(base), q.device)
        cs = ss = (0, 0, 0)
        max_pos = 0
    else:
        c, s = _cos_view(cos, rotary_dim, interleaved), _cos_view(sin, rotary_dim, interleaved)
        inv, max_pos = dummy, c.shape[0]
        if c.dim() == 2:
            mode = COS_TABLE
            cs, ss = (0, c.stride(0), c.stride(1)), (0, s.stride(0), s.stride(1))
        else:
            mode = COS_PER_TOKEN
            c, s = (t.squeeze(1) if t.dim() == 4 else t for t in (c, s))
            cs = (c.stride(0) if c.shape[0] > 1 else 0, c.stride(1), c.stride(2))
            ss = (s.stride(0) if s.shape[0] > 1 else 0, s.stride(1), s.stride(2))
    rd2_pad = next_pow2(half)
    tail = D - rotary_dim
    tail_pad = next_pow2(tail) if tail else 1
    t_bucket = min(next_pow2(T), 4096)
    grid = lambda meta: (cdiv(T, meta["BLOCK_T"])  # noqa: E731
                         * (cdiv(HQ, meta["BLOCK_H"]) + cdiv(HK, meta["BLOCK_H"])),)
    key = (HQ, HK, half, tail, interleaved, mode, t_bucket, q.dtype, c.dtype, position_ids is not None)
    launch(rope_kernel, grid, key,
           qb, kb, qob, kob, c, s, position_ids if position_ids is not None else dummy, inv,
           T, S, HQ, HK, offset, max_pos, -1.0 if inverse else 1.0, t_bucket,
           qb.stride(0), qb.stride(1), qb.stride(2), kb.stride(0), kb.stride(1), kb.stride(2),
           qob.stride(0), qob.stride(1), qob.stride(2), kob.stride(0), kob.stride(1), kob.stride(2),
           *cs, *ss, *pos_strides,
           COS_MODE=mode, HAS_POS=position_ids is not None, INTERLEAVED=bool(interleaved),
           ROT_HALF=half, RD2_PAD=rd2_pad, TAIL=tail, TAIL_PAD=tail_pad)
    return qo, ko


# --- the op, declared once: one graph node under torch.compile, autograd through the inverse rotation ---

def _setup_context(ctx, inputs, output):
    _q, _k, cos, sin, position_ids, *rest = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.rest = rest


def _backward(ctx, kernels, dq, dk):
    """Rotating back by -theta: the forward kernel with `inverse` flipped."""
    cos, sin, position_ids = ctx.saved_tensors
    *rest, inverse = ctx.rest
    return (*kernels.fwd(dq, dk, cos, sin, position_ids, *rest, not inverse), *(None,) * 9)


def _double_backward(ctx, dq, dk):
    """The backward through the op's own Function, which records a graph: rotating back is linear."""
    cos, sin, position_ids = ctx.saved_tensors
    *rest, inverse = ctx.rest
    return (*ROPE.function.apply(dq, dk, cos, sin, position_ids, *rest, not inverse), *(None,) * 9)


def _fake(q, k, *_):
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    return _empty_same_layout(q, torch.empty), _empty_same_layout(k, torch.empty)


ROPE = Op("rope", rope_fwd, fake=_fake, setup_context=_setup_context, backward=_backward,
          double_backward=_double_backward, n_grad=2)


def rope(q: torch.Tensor, k: torch.Tensor, cos: Optional[torch.Tensor] = None, sin: Optional[torch.Tensor] = None,
         position_ids: Optional[torch.Tensor] = None, offset: int = 0, rotary_dim: Optional[int] = None,
         interleaved: bool = False, base: float = 10000.0, layout: str = "bshd"):
    """Rotate q and k by their positions' angles in one launch. Returns (q_out, k_out).

    q: (B, S, Hq, D), k: (B, S, Hk, D) (Hk may differ from Hq: GQA/MQA) in float32, bfloat16 or
    float16, any strides with a unit stride along D; ``layout="bhsd"`` takes (B, H, S, D) instead
    (Hugging Face's convention). Outputs keep the inputs' memory layout and dtype.
    The first ``rotary_dim`` dims of each head rotate (default: all, or inferred from cos), the rest
    pass through. ``interleaved=False`` rotates halves (Llama/NeoX ``rotate_half``), ``True`` rotates
    pairs (2i, 2i+1) (GPT-J).
    Angles: ``cos``/``sin`` as a (max_pos, rotary_dim // 2) table gathered by ``position_ids`` (B, S)
    or by ``offset + s`` (decode), or Hugging Face's per-token (B or 1, S, rotary_dim); without them,
    ``pos * base ** (-2i / rotary_dim)`` with sin/cos computed in-kernel. Math in fp32, one rounding.
    Differentiable in q and k (the backward rotates by -theta); cos/sin get no gradient.
    """
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
    if position_ids is not None and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        rotary_dim = resolve_rotary_dim(q.shape[-1], cos, rotary_dim)
    args = (q, k, cos, sin, position_ids, offset, rotary_dim, bool(interleaved), float(base), layout == "bhsd")
    return ROPE(*args, False)


def _per_token_angles(q, cos, sin, position_ids, offset, rotary_dim, interleaved, base, wd):
    """(B, S, rotary_dim // 2) cos and sin of each token, in dtype wd."""
    B, S = q.shape[0], q.shape[1]
    half = rotary_dim // 2
    if cos is not None and cos.dim() >= 3:
        c, s = (t.squeeze(1) if t.dim() == 4 else t for t in (cos, sin))
        c, s = _cos_view(c, rotary_dim, interleaved), _cos_view(s, rotary_dim, interleaved)
        return c.to(wd).expand(B, S, half), s.to(wd).expand(B, S, half)
    if position_ids is None:
        pos = (torch.arange(S, device=q.device) + offset).expand(B, S)
    else:
        pos = position_ids.expand(B, S).long()
    if cos is None:
        # Hugging Face's angles: fp32 inv_freq times fp32 positions, then sin/cos (here in wd).
        inv = _inv_freq(rotary_dim, float(base), torch.device("cpu")).to(q.device)
        angle = (pos.float()[..., None] * inv).to(wd)
        return angle.cos(), angle.sin()
    c, s = _cos_view(cos, rotary_dim, interleaved), _cos_view(sin, rotary_dim, interleaved)
    return c.to(wd)[pos], s.to(wd)[pos]


def reference(q, k, cos=None, sin=None, position_ids=None, offset=0, rotary_dim=None, interleaved=False,
              base=10000.0, layout="bshd"):
    """Plain PyTorch RoPE on every supported input form (fp32 math, or fp64 for fp64 inputs)."""
    heads_first = layout == "bhsd"
    qb, kb = _bshd(q, heads_first), _bshd(k, heads_first)
    if position_ids is not None and position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    rd = resolve_rotary_dim(qb.shape[-1], cos, rotary_dim)
    wd = torch.float64 if q.dtype == torch.float64 else torch.float32
    c, s = _per_token_angles(qb, cos, sin, position_ids, offset, rd, interleaved, base, wd)
    c, s = c[:, :, None, :], s[:, :, None, :]

    def rotate(x):
        xf = x.to(wd)
        rot, tail = xf[..., :rd], xf[..., rd:]
        if interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            y = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        else:
            x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
            y = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        return _bshd(torch.cat((y, tail), dim=-1).to(x.dtype), heads_first)

    return rotate(qb), rotate(kb)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, cos=None, sin=None, position_ids=None, offset=0, rotary_dim=None, interleaved=False,
            base=10000.0, layout="bshd"):
    """Hugging Face's eager `apply_rotary_pos_emb` (partial rotary as in NeoX/Phi), in the inputs' dtype,
    for per-token (B, S, rotary_dim) cos/sin with halves rotated; other forms run `reference`."""
    if cos is None or cos.dim() != 3 or interleaved or position_ids is not None or offset:
        return reference(q, k, cos, sin, position_ids, offset, rotary_dim, interleaved, base, layout)
    rd = cos.shape[-1]
    cos, sin = cos.unsqueeze(1 if layout == "bhsd" else 2), sin.unsqueeze(1 if layout == "bhsd" else 2)

    def apply(x):
        rot, tail = x[..., :rd], x[..., rd:]
        return torch.cat(((rot * cos) + (_rotate_half(rot) * sin), tail), dim=-1)

    return apply(q), apply(k)


def cost(q, k, cos=None, sin=None, position_ids=None, offset=0, rotary_dim=None, interleaved=False,
         base=10000.0, layout="bshd", backward=False) -> Cost:
    """Ideal traffic: q and k (or dq and dk) read and written once, plus the cos/sin values the rotation
    needs (rotary_dim // 2 per position: the informative half of a duplicated tensor) and position ids."""
    qk = q.numel() * q.element_size() + k.numel() * k.element_size()
    rd = resolve_rotary_dim(q.shape[-1], cos, rotary_dim)
    B, S = _bshd(q, layout == "bhsd").shape[:2]
    table = 0
    if cos is not None:
        rows = cos.shape[0] * cos.shape[-2] if cos.dim() >= 3 else min(cos.shape[0], B * S)
        table = 2 * rows * (rd // 2) * cos.element_size()
    if position_ids is not None:
        table += position_ids.numel() * position_ids.element_size()
    flops = 3.0 * (q.numel() + k.numel()) * rd / q.shape[-1]
    return Cost(flops=flops, bytes=2.0 * qk + table, dtype=dtype_key(q.dtype))


def make_inputs(shape, dtype, device, generator=None):
    """shape = (batch, seq, q_heads, kv_heads, head_dim[, "positions"]); Hugging Face per-token cos/sin (B, S, D) in
    dtype, or with "positions" a (max_pos, D // 2) cos/sin table and kwargs {'position_ids'}: (B, S) int64
    positions drawn at random from the table's."""
    B, S, HQ, HK, D = shape[:5]
    q = torch.randn((B, S, HQ, D), dtype=dtype, device=device, generator=generator)
    k = torch.randn((B, S, HK, D), dtype=dtype, device=device, generator=generator)
    if shape[5:] == ("positions",):
        max_pos = 2 * S + 3
        inv = _inv_freq(D, 10000.0, torch.device("cpu")).to(device)
        angle = torch.arange(max_pos, device=device)[:, None].float() * inv
        pos = torch.randint(0, max_pos, (B, S), device=device, generator=generator)
        return (q, k, angle.cos().to(dtype), angle.sin().to(dtype)), {"position_ids": pos}
    start = torch.randint(0, 64, (B, 1), device=device, generator=generator)
    pos = start + torch.arange(S, device=device)
    angle = pos.float()[..., None] * _inv_freq(D, 10000.0, torch.device("cpu")).to(device)
    emb = torch.cat((angle, angle), dim=-1)
    return (q, k, emb.cos().to(dtype), emb.sin().to(dtype)), {}


def _liger_loader():
    fn = optional_import("liger_kernel.transformers.functional", "liger_rope")()
    if fn is None:
        return None

    def liger(q, k, cos=None, sin=None, position_ids=None, offset=0, rotary_dim=None, interleaved=False,
              base=10000.0, layout="bshd"):
        if cos is None or cos.dim() != 3 or interleaved or position_ids is not None or offset:
            raise NotImplementedError("Liger's rope takes per-token (B, S, D) cos/sin with halves rotated")
        # Liger wants (B, H, S, D) views of (B, S, H, D) memory (Hugging Face's) and rotates in place.
        qh, kh = (q, k) if layout == "bhsd" else (q.transpose(1, 2), k.transpose(1, 2))
        qo, ko = fn(qh, kh, cos, sin, None, 1, rotary_dim)
        return (qo, ko) if layout == "bhsd" else (qo.transpose(1, 2), ko.transpose(1, 2))

    return liger


register(OpSpec(
    name="rope", fn=rope, reference=reference, cost=cost, make_inputs=make_inputs, grad_args=(0, 1),
    test_shapes=[(1, 3, 2, 1, 8), (2, 37, 5, 3, 64), (3, 17, 4, 4, 80), (1, 129, 3, 1, 128),
                 (2, 9, 4, 2, 16, "positions")],
    # The table shape fuzzes position_ids's layouts too (read by index, through its strides).
    layout_shape=[(3, 17, 4, 4, 80), (2, 9, 4, 2, 16, "positions")],
    bench_shapes=[(4, 4096, 32, 8, 128), (1, 16384, 32, 8, 128), (8, 2048, 32, 32, 128)],
    latency_shapes=[(64, 1, 32, 8, 128)],
    competitors={"liger": _liger_loader},
    eager=hf_rope,
    replaces=("apply_rotary_pos_emb",),
    doc="RoPE of q and k in one launch: half or interleaved pairs, GQA, partial rotary, positions, fwd+bwd.",
))
