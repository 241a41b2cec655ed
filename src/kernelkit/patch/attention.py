"""kernelkit's attention as a Hugging Face attention implementation named "kernelkit".

Two functions are registered under that name: the attention function (`transformers.AttentionInterface`)
and the mask builder (`AttentionMaskInterface`), which the model's `create_causal_mask` calls once per
forward. The mask builder answers like flash-attention's: None for a plain causal (or sliding-window
causal) mask whose last key is the last query, or the (batch, keys) padding mask; anything else (packed
sequences, image-token overlays, static caches) becomes the dense 4-D boolean mask SDPA takes. The
attention function then runs:
- mask None: the kernel on (batch, seq, heads, head_dim) views, causal bottom-right as HF's cached
  decoding, the sliding window as HF's (``key > query - sliding_window``: the kernel's window is
  sliding_window - 1 keys left of the diagonal),
  softcap and scaling as the attention module passes them, GQA without repeating K/V;
- a padding mask whose valid tokens form one run per row (left or right padding), with as many queries
  as keys: unpad, the kernel's varlen path over cu_seqlens, pad back (zeros at padded queries);
- anything else (a 4-D mask, output_attentions, dropout in training, fp32 or head_dim > 256, CPU tensors
  outside the interpreter, a padding mask under torch.compile, where unpadding needs the lengths on the
  host): Hugging Face's SDPA function on the equivalent dense mask, or the model's own eager function
  when attention weights or a logit softcap are asked for (SDPA has no softcap) or when the model used
  eager attention before the patch. Counted in the report.

Fully masked query rows (a left-padded row's pad queries see no valid key; with a sliding window, right
padding far past the last token too) have no defined attention; implementations differ and the loss can
read them (a collator's labels make the last pad position predict the first token). kernelkit answers as
the implementation the model had before the patch: zeros as SDPA and flash-attention do, or, for a model
that used eager attention, eager's own function on those rows (uniform weights over every key, and the
gradient autograd gives it).
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from ..ops.attention import attention
from ..runtime import interpreting
from . import choose
from .modules import DTENSOR_REASON, any_dtensor

NAME = "kernelkit"
# What kernelkit.ops.attention.attention takes (its validate() raises otherwise): calls outside fall back.
MAX_HEAD_DIM = 256
# Calls timed back to back per sample of the attention trial (choose.Trial.in_flight): in a training step the host
# runs ahead of the GPU, so a call costs the longer of its host and GPU times, not their sum. Timed one at a time, the
# fused backward's host time (about 0.6 ms a forward + backward on the H100 machine's CPU, SDPA's 0.3) decided: the
# patch kept SDPA at the Llama-3.2-1B shape (1.33x) where forcing kernelkit made the step 1.4 ms faster (37.0 vs 35.6
# ms, benchmarks/experiments/h100/2026-11-27-stop46).
IN_FLIGHT = 8
DTYPES = (torch.bfloat16, torch.float16)
# Keyword arguments that change the math in ways the kernel does not compute (attention sinks, biases,
# flash-attention's flattened-batch offsets).
_UNSUPPORTED_KWARGS = ("s_aux", "position_bias", "cu_seq_lens_q", "cu_seq_lens_k")
_registered = False


@dataclass
class AttentionSettings:
    """Set on each patched attention module as `_kernelkit`: where its fallbacks are counted, and the
    attention implementation the model had before the patch ("eager", "sdpa", ...), whose answers on
    fully masked query rows kernelkit reproduces."""
    report: object
    original: Optional[str] = None
    token: Optional[int] = None  # the choose.Site deciding kernelkit or the original per shape


def register() -> None:
    """Register "kernelkit" with transformers (idempotent). Registration is global (a name in a table);
    a model uses it only once its config names it, which `kernelkit.patch` does per instance."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)
    _registered = True


# --- the mask builder ---

def _is_causal_or_sliding(mask_function, kwargs) -> bool:
    """Whether HF's mask function is its causal one, or causal and a sliding-window overlay (nothing else:
    packed-sequence, chunked, bidirectional or image-token functions are not a kernel's mask)."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is causal_mask_function:
        return True
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return False
    if torch.compiler.is_compiling():
        # Dynamo cannot read closure cells: recognize the call from create_sliding_window_causal_mask by
        # what it passes (local_size = the config's window; every overlay it adds clears
        # allow_is_causal_skip), and rule out chunked attention, which passes its chunk as local_size.
        config = kwargs.get("config")
        window = getattr(config, "sliding_window", None)
        return (kwargs.get("allow_is_causal_skip") is True and window is not None
                and kwargs.get("local_size") == window and not getattr(config, "attention_chunk_size", None))
    parts = mask_function.__closure__[mask_function.__code__.co_freevars.index("mask_functions")].cell_contents
    return (len(parts) == 2 and causal_mask_function in parts
            and any(getattr(p, "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask" for p in parts))


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, **kwargs):
    from transformers.masking_utils import flash_attention_mask, sdpa_mask

    # The kernel aligns causal masks bottom-right: right when the last key is the last query (no cache, or
    # a dynamic cache), wrong for a static cache's unfilled tail.
    aligned = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset + q_length == kv_offset + kv_length
    if aligned and _is_causal_or_sliding(mask_function, kwargs):
        return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask)
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)


# --- the attention function ---

def _wants_weights(module, kwargs) -> bool:
    return bool(kwargs.get("output_attentions") or getattr(getattr(module, "config", None), "output_attentions", False))


def _unsupported(module, query, key, value, mask, dropout, sliding_window, causal, kwargs) -> Optional[str]:
    """Why this call cannot run on the kernel exactly, or None."""
    if _wants_weights(module, kwargs):
        return "output_attentions"
    if any_dtensor(query, key, value, mask):
        return DTENSOR_REASON
    if dropout:
        return "attention dropout"
    if not (query.is_cuda or interpreting()):
        return "CPU tensor outside the Triton interpreter"
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtype {str(query.dtype).replace('torch.', '')} (the kernel takes bfloat16 / float16)"
    d = query.shape[-1]
    if d > MAX_HEAD_DIM or key.shape[-1] != d or value.shape[-1] != d:
        return f"head_dim {d} (the kernel takes up to {MAX_HEAD_DIM}, one for q, k and v)"
    if sliding_window and not causal:
        return "sliding window without causal mask"
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            return f"{name} argument"
    if mask is not None:
        if mask.dim() != 2:
            return "4-D attention mask (packed sequences, static cache or custom mask)"
        if tuple(mask.shape) != (query.shape[0], key.shape[2]):
            return "padding mask shorter than the keys (static cache)"
        if query.shape[2] != key.shape[2]:
            return "padding mask with cached keys"
        if torch.compiler.is_compiling():
            return "padding mask under torch.compile"
    return None


# Every layer of a forward gets the same mask object: the unpadding plan (and its host syncs) is made once.
_last_runs: tuple = (None, -1, None)


def _runs(mask: torch.Tensor):
    """(indices of valid tokens, cu_seqlens int32, longest length) of a (batch, seq) padding mask whose
    valid tokens are one contiguous run per row, else None. Reads the lengths on the host."""
    global _last_runs
    ref, version, plan = _last_runs
    if ref is not None and ref() is mask and version == mask._version:
        return plan
    plan = _plan_runs(mask)
    _last_runs = (weakref.ref(mask), mask._version, plan)
    return plan


def _plan_runs(mask: torch.Tensor):
    lens = mask.sum(1, dtype=torch.int32)
    first = mask.to(torch.int8).argmax(1)
    pos = torch.arange(mask.shape[1], device=mask.device)
    run = (pos >= first[:, None]) & (pos < (first + lens)[:, None])
    if not torch.equal(run, mask):
        return None
    indices = mask.reshape(-1).nonzero().squeeze(1)
    cu_seqlens = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    return _Plan(indices, cu_seqlens, int(lens.max()) if lens.numel() else 0, first, lens, {})


@dataclass
class _Plan:
    indices: torch.Tensor      # flat (batch * seq) positions of the valid tokens
    cu_seqlens: torch.Tensor   # int32 (batch + 1,)
    max_seqlen: int
    first: torch.Tensor        # (batch,) position of each row's first valid token
    lens: torch.Tensor         # (batch,) valid tokens per row
    empty_rows: dict           # (causal, sliding_window) -> [(batch index, query positions)] of fully masked queries

    def fully_masked(self, seq: int, causal: bool, sliding_window) -> list:
        """Per batch row with any, (row, positions) of the queries that see no valid key (read on the host
        once per mask and rule)."""
        key = (bool(causal), sliding_window)
        if key not in self.empty_rows:
            i = torch.arange(seq, device=self.first.device)[None, :]
            last = (self.first + self.lens - 1)[:, None]
            hi = torch.minimum(i, last) if causal else last.expand(-1, seq)
            lo = self.first[:, None].expand(-1, seq)
            if sliding_window:
                lo = torch.maximum(lo, i - sliding_window + 1)
            full = (lo > hi).cpu()
            self.empty_rows[key] = [(b, row.nonzero().squeeze(1)) for b, row in enumerate(full) if row.any()]
        return self.empty_rows[key]


def _dense_mask(pad: Optional[torch.Tensor], query, key, causal: bool, sliding_window,
                allow_none: bool = True) -> Optional[torch.Tensor]:
    """The (batch, 1, seq_q, seq_k) boolean mask HF's SDPA path would get, from a padding mask (or None)
    and the causal / sliding-window rule. With `allow_none`, None where SDPA's own is_causal is that mask."""
    b, sq, sk = query.shape[0], query.shape[2], key.shape[2]
    if pad is None and not sliding_window and (not causal or (allow_none and (sq == sk or sq == 1))):
        return None
    i = torch.arange(sq, device=query.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=query.device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=query.device)
    if causal:
        ok = ok & (j <= i)
    if sliding_window:
        ok = ok & (j > i - sliding_window)
    ok = ok[None, None].expand(b, 1, sq, sk)
    return ok & pad[:, None, None, :].to(torch.bool) if pad is not None else ok


def _eager_function(module):
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _was_eager(module) -> bool:
    return getattr(getattr(module, "_kernelkit", None), "original", None) == "eager"


def _fallback(module, query, key, value, mask, dropout, scaling, sliding_window, softcap, causal, kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    extra = dict(kwargs, sliding_window=sliding_window, softcap=softcap)
    eager = _eager_function(module)
    if (_wants_weights(module, kwargs) or softcap is not None or _was_eager(module)) and eager is not None:
        # The modeling file's own eager function (it applies the softcap where the model has one), on
        # the additive mask it expects.
        if mask is None or mask.dim() == 2:
            mask = _dense_mask(mask, query, key, causal, sliding_window, allow_none=False)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **extra)
    if mask is None or mask.dim() == 2:
        mask = _dense_mask(mask, query, key, causal, sliding_window)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                  is_causal=causal, **extra)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """HF's attention-function signature: query (batch, heads_q, seq_q, d), key/value (batch, heads_kv,
    seq_k, d), the mask `attention_mask` builds; returns (output (batch, seq_q, heads_q, d), None)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    reason = _unsupported(module, query, key, value, attention_mask, dropout, sliding_window, causal, kwargs)
    runs = None
    if reason is None and attention_mask is not None:
        runs = _runs(attention_mask)
        if runs is None:
            reason = "padding mask that is not one run of tokens per row"
    if reason is not None:
        report = getattr(getattr(module, "_kernelkit", None), "report", None)
        if report is not None:
            report.fell_back("attention", reason)
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                         causal, kwargs)
    token = getattr(getattr(module, "_kernelkit", None), "token", None)
    if token is not None:
        b, hq, sq, d = query.shape
        decision = (choose.bucket(b), hq, key.shape[1], choose.bucket(sq), choose.bucket(key.shape[2]), d,
                    choose.dtype_name(query.dtype), bool(causal), sliding_window, softcap, scaling,
                    attention_mask is not None, choose.needs_grad(query, key, value))
        if not choose.decide(token, decision):
            return _fallback(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                             causal, kwargs)
    return _kernel(module, query, key, value, runs, causal, scaling, sliding_window, softcap, kwargs)


def _kernel(module, query, key, value, runs, causal, scaling, sliding_window, softcap, kwargs):
    """kernelkit's kernel on HF's (batch, heads, seq, d) tensors: dense, or unpadded along `runs`."""
    window = sliding_window - 1 if sliding_window else None
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if runs is None:
        return attention(q, k, v, causal=causal, window=window, softcap=softcap, scale=scaling), None
    b, s, h, d = q.shape

    def packed(x):
        return x.reshape(b * s, x.shape[2], d).index_select(0, runs.indices)

    o = attention(packed(q), packed(k), packed(v), causal=causal, window=window, softcap=softcap,
                  cu_seqlens=runs.cu_seqlens, max_seqlen=runs.max_seqlen, scale=scaling)
    o = o.new_zeros(b * s, h, d).index_copy(0, runs.indices, o).view(b, s, h, d)
    eager = _eager_function(module)
    if _was_eager(module) and eager is not None:
        o = _eager_on_empty_rows(o, eager, module, query, key, value, runs.fully_masked(s, causal, sliding_window),
                                 scaling, sliding_window, softcap, kwargs)
    return o, None


def _eager_on_empty_rows(o, eager, module, query, key, value, empty, scaling, sliding_window, softcap, kwargs):
    """Eager attention's answer on the fully masked query rows (`empty`: (batch row, positions)), written
    into `o` (batch, seq, heads, d): the model's own eager function on those queries against every key,
    all masked, as Hugging Face's eager path computes them."""
    if not empty:
        return o
    rows, cols, vals = [], [], []
    for bi, pos in empty:
        pos = pos.to(query.device)
        q = query[bi:bi + 1].index_select(2, pos)
        mask = torch.full((1, 1, pos.numel(), key.shape[2]), torch.finfo(query.dtype).min, dtype=query.dtype,
                          device=query.device)
        out, _ = eager(module, q, key[bi:bi + 1], value[bi:bi + 1], mask, dropout=0.0, scaling=scaling,
                       **dict(kwargs, sliding_window=sliding_window, softcap=softcap))
        rows.append(torch.full_like(pos, bi))
        cols.append(pos)
        vals.append(out[0].to(o.dtype))
    return o.index_put((torch.cat(rows), torch.cat(cols)), torch.cat(vals))


# --- kernelkit or the model's own attention, per shape ---

def _trial(module, key) -> choose.Trial:
    b, hq, hk, sq, sk, d, dtype, causal, sliding_window, softcap, scaling, padded, grad = key
    dt, dev = getattr(torch, dtype), choose.device()
    g = choose.generator(dev)
    q = choose.randn((b, hq, sq, d), dt, dev, g, grad)
    k, v = (choose.randn((b, hk, sk, d), dt, dev, g, grad) for _ in range(2))
    mask, runs = None, None
    if padded:  # right padding, each row keeping between half and all of its tokens
        lens = torch.randint(max(1, sk // 2), sk + 1, (b,), device=dev, generator=g)
        mask = (torch.arange(sk, device=dev)[None, :] < lens[:, None]).to(torch.long)
        runs = _plan_runs(mask)
    return choose.Trial(
        lambda: _kernel(module, q, k, v, runs, causal, scaling, sliding_window, softcap, {})[0],
        lambda: _fallback(module, q, k, v, mask, 0.0, scaling, sliding_window, softcap, causal, {})[0],
        [q, k, v] if grad else [], in_flight=IN_FLIGHT)


def _shape(key) -> str:
    b, hq, hk, sq, sk, d, dtype, causal, sliding_window, softcap, scaling, padded, grad = key
    extra = [f"kv heads {hk}" if hk != hq else "", "causal" if causal else "",
             f"window {sliding_window}" if sliding_window else "", f"softcap {softcap:g}" if softcap else "",
             "padded" if padded else ""]
    return " ".join(x for x in (f"b{b} h{hq} s{sq}" + (f"/{sk}" if sk != sq else "") + f" d{d} {dtype}", *extra,
                                "fwd+bwd" if grad else "fwd") if x)


def site(module, modes: dict, report, original: Optional[str]) -> choose.Site:
    """The decision site of one patched attention class: kernelkit against `original` (what the model ran
    before: SDPA, eager, or another registered implementation, reached through `_fallback`)."""
    name = {"eager": "eager attention", None: "sdpa"}.get(original, original)
    if name not in ("eager attention", "sdpa"):
        name = f"sdpa (in place of {name})"  # _fallback runs SDPA for implementations other than eager
    return choose.Site("attention", modes, report, _trial, _shape, name, module)
