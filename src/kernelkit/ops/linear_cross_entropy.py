"""Fused LM head + cross-entropy: the loss of ``hidden @ weight.T + bias`` without the (T, V) logits.

At T = 8192 tokens and a 128256-token vocabulary the logits are 2 GiB in bf16 (4 GiB more once HF
upcasts them to fp32), for a loss that is one number. Here the tokens run in chunks: a chunk's logits
come from one cuBLAS GEMM, the cross-entropy kernel of ``ops/cross_entropy.py`` reads them, writes the
chunk's per-token losses in fp32 and overwrites the logits with dlogits in place (already scaled by
1 / the number of non-ignored tokens of the *whole* batch, counted once up front), and two more GEMMs
turn dlogits into the chunk's rows of dhidden and its share of dweight. Every gradient exists when the
forward returns; the backward multiplies them by grad_output, a launch that reads one scalar and
touches nothing when grad_output is 1 (``loss.backward()``).

FLOPs: 2·T·H·V for the logits, 2·T·H·V each for dhidden and dweight: compute-bound GEMMs, so the
design goal is GEMMs as large as memory allows. The one cost that grows with the number of chunks is
dweight: each chunk's GEMM (K = the chunk's rows) re-reads and re-writes all of dweight, V·H elements.
So a chunk is as many rows as fit ``MAX_CHUNK_BYTES`` of logits (see `chunk_rows`), not a fixed
fraction of T as in Liger (whose default is T·H elements of logits: 256-row chunks here, 32 chunks).
Measured on the H100 at T = 8192, H = 4096, V = 128256 bf16, forward + backward (experiments/h100/linear_cross_entropy/
linear_cross_entropy.json): 2048-row chunks (the 512 MiB default) 38.1 ms, 678 TFLOP/s, 1.53 GiB
beyond the inputs (1.04 of it the gradients themselves); 1024 rows 40.9 ms / 1.29 GiB; 512 rows
46.7 ms / 1.16 GiB; 4096 rows 39.0 ms / 2.02 GiB; the three GEMMs alone on materialized logits 37.0
ms. Liger 64.2 ms / 1.10 GiB; eager with the fp32 upcast 51.8 ms / 11.7 GiB.

dweight accumulates in its own dtype while a call runs at most ``MAX_LOWP_DWEIGHT_CHUNKS`` chunks:
cuBLAS adds each chunk's partial product to the running sum in fp32 and rounds once per chunk, and no
buffer beyond the gradient itself is needed. Measured against an fp32 computation at the shape above,
bf16 dweight's relative error is 3.1e-3 with one rounding (one chunk, or an fp32 running sum) and
3.6e-3 / 3.8e-3 / 3.9e-3 with 4 / 8 / 16 bf16 roundings (Liger's default, 32 chunks: 4.0e-3). The
fp32 running sum costs 2 GiB (V·H·4 bytes, 1.53 -> 3.49 GiB) and 8% (41.3 ms) there, so it is used
only past 16 chunks (T > 32768 at this V), through cuBLAS's bf16 x bf16 -> fp32 GEMM
(``addmm(out_dtype=float32)``), and cast once at the end.

reduction='none' needs the per-token grad_output before dweight sums over tokens, so there the
forward saves only lse and the backward recomputes each chunk's logits (a fourth GEMM) and runs the
cross-entropy backward kernel with the per-token grad_output.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import switches
from ..roofline.model import Cost, dtype_key
from ..runtime.alloc import empty
from ..runtime import cdiv, interpreting, launch, next_pow2, num_sms
from . import _validate
from ._ce_common import TARGET_DTYPES, class_weight_buffer, mean_divisor, weight_launch_args
from ._dispatch import Op
from .cross_entropy import MAX_BLOCK_V, cross_entropy_bwd_kernel, cross_entropy_fwd_kernel
from .cross_entropy import reference as cross_entropy_reference
from .gemm.fp8 import quantize_cols_t, quantize_rows
from .fp8_linear import ALIGN as FP8_ALIGN, DTYPES as FP8_DTYPES
from .scaled_matmul import fp8_device_unsupported, rowwise_gemm as _fp8_gemm
from .registry import OpSpec, optional_import, register

# A chunk's logits (rows x V in the activations' dtype) stay under this budget: the smallest that ran as
# fast as any larger one in the H100 chunk sweep (module docstring); a smaller chunk trades time for memory.
MAX_CHUNK_BYTES = 512 << 20
# fp8: each chunk's dlogits are quantized and multiplied into dhidden in this many parts of its rows
FP8_DH_SPLIT = 2
# Chunk rows are a multiple of this (when a chunk has more rows): no GEMM tile runs a ragged edge.
ROW_ALIGN = 128
# Up to this many chunks bf16/fp16 dweight accumulates in place (one rounding per chunk); beyond, in fp32.
MAX_LOWP_DWEIGHT_CHUNKS = 16
# Rows of the scratch copy on which the first launch of a cross-entropy kernel config key is autotuned:
# autotuning re-runs a kernel on its arguments, and here the kernel overwrites its input.
TUNE_ROWS = 1024
# The grad_output scale: a persistent 1-D sweep, 4096 elements (16 per thread at 8 warps) a step.
SCALE_BLOCK, SCALE_WARPS, SCALE_PROGRAMS_PER_SM = 4096, 8, 4


@triton.jit
def grad_scale_kernel(X, GRAD, numel, BLOCK: tl.constexpr):
    """X *= grad_output (a scalar), in place; a grad_output of exactly 1 moves no bytes."""
    g = tl.load(GRAD).to(tl.float32)
    if g != 1.0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, step):
            offs = start + tl.arange(0, BLOCK)
            m = offs < numel
            x = tl.load(X + offs, mask=m).to(tl.float32)
            tl.store(X + offs, (x * g).to(X.dtype.element_ty), mask=m)


# --- validation ---

PRECISIONS = ("bf16", "fp8")


def fp8_unsupported(hidden: torch.Tensor, weight: torch.Tensor, reduction: str) -> Optional[str]:
    """Why precision='fp8' cannot take this call (None when it can)."""
    if hidden.dtype not in FP8_DTYPES:
        return f"dtype {str(hidden.dtype)[6:]} (fp8 takes bf16 / fp16 hidden states and weight)"
    v, h = weight.shape
    if v % FP8_ALIGN or h % FP8_ALIGN:
        return f"V = {v} and H = {h} must be multiples of {FP8_ALIGN}"
    if reduction == "none":
        return "reduction='none' (its backward recomputes the logits; fp8 runs 'mean' and 'sum')"
    return fp8_device_unsupported(hidden)


def _validate_scalars(ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size):
    """cross_entropy's checks of the shared options, then chunk_size; returns them normalized."""
    scalars = _validate.loss_options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int (rows per chunk), got {chunk_size!r}")
    return (*scalars, chunk_size)


def _validate_tensors(hidden, weight, target, bias, ce_weight=None):
    _validate.tensor(hidden, "hidden", min_dim=1)
    _validate.tensor(weight, "weight")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (V, H) like nn.Linear's, got shape {tuple(weight.shape)}")
    v, h = weight.shape
    if hidden.shape[-1] != h:
        raise ValueError(f"hidden's last dim is {hidden.shape[-1]} but weight is (V, H) = {tuple(weight.shape)}; "
                         f"pass the LM head's weight as stored by nn.Linear (out_features, in_features)")
    if h == 0:
        raise ValueError(f"hidden has shape {tuple(hidden.shape)}: its last dim (H, the features the LM head "
                         f"reads) is 0, so the logits would not depend on it; pass hidden states with H >= 1")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"hidden is {str(hidden.dtype)[6:]} but weight is {str(weight.dtype)[6:]}; cast one "
                        f"so both share a dtype (the GEMMs run in it)")
    _validate.same_device(weight, "weight", hidden, "hidden")
    if bias is not None:
        _validate.tensor(bias, "bias")
        if tuple(bias.shape) != (v,):
            raise ValueError(f"bias must have shape ({v},) to match weight (V, H) = {tuple(weight.shape)}, "
                             f"got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias is {str(bias.dtype)[6:]} but weight is {str(weight.dtype)[6:]}")
        _validate.same_device(bias, "bias", hidden, "hidden")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"target has dtype {str(target.dtype)[6:]}; supported: int64, int32 (class indices)")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target must have shape {tuple(hidden.shape[:-1])} (hidden's leading dims), "
                         f"got {tuple(target.shape)}")
    _validate.same_device(target, "target", hidden, "hidden")
    if v == 0 and target.numel():
        raise ValueError("weight has V = 0 rows (classes); cross-entropy needs at least one")
    if ce_weight is not None:
        _validate.tensor(ce_weight, "ce_weight")
        if tuple(ce_weight.shape) != (v,):
            raise ValueError(f"ce_weight must have shape ({v},), one weight per class of weight (V, H) = "
                             f"{tuple(weight.shape)}, got {tuple(ce_weight.shape)}")
        _validate.same_device(ce_weight, "ce_weight", hidden, "hidden")


# --- launchers ---

def chunk_rows(t: int, v: int, esize: int, chunk_size: Optional[int] = None) -> int:
    """Rows per chunk: ``chunk_size`` if given, else the most rows whose logits fit ``MAX_CHUNK_BYTES``,
    evened out over the chunks T needs (8192 rows under a 2092-row cap: 4 x 2048, not 3 x 2092 + 1916)
    and rounded up to ``ROW_ALIGN`` where that stays within the cap."""
    if chunk_size is not None:
        return max(1, min(chunk_size, t))
    cap = max(1, MAX_CHUNK_BYTES // max(1, v * esize))
    if t <= cap:
        return max(t, 1)
    rows = cdiv(t, cdiv(t, cap))
    aligned = cdiv(rows, ROW_ALIGN) * ROW_ALIGN
    return aligned if aligned <= cap else rows


# float16 dlogits carry this power-of-two scale. Scaled by 1 / count as bf16's are, they underflow: at 8192
# tokens and a 128256-token vocabulary a typical softmax probability over the count is ~1e-9, below fp16's
# smallest subnormal (6e-8), so dhidden lost most of the softmax's mass (relative error 1.9e-2 measured on the
# H100, against bf16's 4e-3). Here the kernel writes (p - y) x 2^11 (|.| <= ~2^11, far from fp16's 65504; a
# probability down to 3e-8 stays a normal number), the GEMMs accumulate into fp32 outputs, and 2^-11 / count
# is applied there in fp32. Costs an fp32 dweight running sum (V x H x 4 bytes) and an fp32 chunk of dhidden.
FP16_GRAD_SCALE = 2.0 ** 11

_tuned: set = set()


def _launch_in_place(kernel, key, logits, run):
    """run(buf) launches `kernel` reading logits from buf and writing dlogits over them. The first launch
    of a config key on the GPU may autotune, re-running the kernel on its arguments: that one runs on a
    scratch copy of a few rows first, so the real chunk is overwritten exactly once."""
    if logits.is_cuda and not interpreting() and (kernel, key) not in _tuned:
        run(logits[:TUNE_ROWS].clone())
        _tuned.add((kernel, key))
    run(logits)


def _ce_forward(logits, target, count, loss_rows, lse_rows, z_rows, ignore_index, label_smoothing, z_loss, softcap,
                mean, compute_grad, wbuf, fp8_rows=None):
    """The cross-entropy forward kernel on one chunk of logits (rows, V): per-token fp32 loss and lse, and
    with compute_grad dlogits written over the logits, scaled by 1 / count for 'mean' (with count = 2^-11, a
    tensor: dlogits x 2^11, fp16's FP16_GRAD_SCALE); wbuf: the class weights (`class_weight_buffer`) or None.
    fp8_rows: (q, scale), a (rows, V) float8_e4m3fn and a (rows,) fp32 buffer the same pass fills with dlogits'
    e4m3 rows and their scales (`fused_dlogits_fp8` says when it can)."""
    v = logits.shape[1]
    block, sms = min(MAX_BLOCK_V, max(16, next_pow2(v))), num_sms(logits.device)
    flags = dict(MEAN=mean, HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing > 0,
                 HAS_Z=bool(z_loss), COMPUTE_GRAD=compute_grad, BLOCK_V=block)
    weighted = weight_launch_args(flags, wbuf)
    if fp8_rows is not None:
        q8, s8 = fp8_rows
        flags["FP8_OUT"] = True
        weighted.update(Q8=q8.view(torch.uint8), S8=s8, stride_q8=q8.stride(0),
                        tiny8=torch.finfo(logits.dtype).tiny)
    key = (v, logits.dtype, *flags.values())  # the key cross_entropy.py launches this kernel under

    def run(x):
        n = x.shape[0]
        grid = lambda meta: (min(n, meta["PROGRAMS_PER_SM"] * sms),)  # noqa: E731
        launch(cross_entropy_fwd_kernel, grid, key, x, target, count, loss_rows, z_rows, lse_rows, x,
               x.stride(0), x.stride(0), n, v, ignore_index, label_smoothing, z_loss, softcap or 1.0,
               1.0 / (softcap or 1.0), **flags, **weighted)

    if compute_grad:
        _launch_in_place(cross_entropy_fwd_kernel, key, logits, run)
    else:
        run(logits)


def _ce_backward(logits, target, lse_rows, grad_rows, ignore_index, label_smoothing, z_loss, softcap, wbuf,
                 inv_scale=None):
    """The cross-entropy backward kernel on one chunk: dlogits = per-token grad_output x dloss/dlogits,
    written over the (recomputed) logits; x 1 / inv_scale when given (a 0-dim fp32 tensor: fp16's scale)."""
    v = logits.shape[1]
    block, sms = min(MAX_BLOCK_V, max(16, next_pow2(v))), num_sms(logits.device)
    flags = dict(MEAN=inv_scale is not None, HAS_SOFTCAP=softcap is not None, HAS_Z=bool(z_loss), BLOCK_V=block)
    weighted = weight_launch_args(flags, wbuf)
    key = (v, logits.dtype, grad_rows.dtype, *flags.values())
    stride_g = grad_rows.stride(0) if grad_rows.dim() else 0

    def run(x):
        n = x.shape[0]
        grid = lambda meta: (min(n, meta["PROGRAMS_PER_SM"] * sms),)  # noqa: E731
        launch(cross_entropy_bwd_kernel, grid, key, x, target, lse_rows, grad_rows,
               target if inv_scale is None else inv_scale, x, x.stride(0),
               x.stride(0), stride_g, n, v, ignore_index, label_smoothing, 2.0 * z_loss, softcap or 1.0,
               1.0 / (softcap or 1.0), **flags, **weighted)

    _launch_in_place(cross_entropy_bwd_kernel, key, logits, run)


class _Grads:
    """Gradient buffers filled chunk by chunk: dhidden rows, dweight (in its dtype or an fp32 running
    sum, see the module docstring) and an fp32 dbias."""

    def __init__(self, hidden, weight, bias, n_chunks, need_dh, need_dw, need_db, rows=0, post=None, fp8=False):
        t, h = hidden.shape
        # fp8: dhidden = dlogits @ weight with dlogits per token and weight per hidden column in e4m3
        self.wt8 = quantize_cols_t(weight) if fp8 and need_dh else None
        dev = hidden.device
        # post: a 0-dim fp32 factor the fp32 sums are multiplied by before rounding (fp16, FP16_GRAD_SCALE)
        self.post = post
        self.dh = empty((t, h), dtype=hidden.dtype, device=dev) if need_dh else None
        self.dh32 = empty((min(rows, t), h), dtype=torch.float32, device=dev) if need_dh and post is not None \
            else None
        self.dw = empty(tuple(weight.shape), dtype=weight.dtype, device=dev) if need_dw else None
        self.dw32 = None
        if need_dw and weight.dtype != torch.float32 and (n_chunks > MAX_LOWP_DWEIGHT_CHUNKS or post is not None):
            self.dw32 = empty(tuple(weight.shape), dtype=torch.float32, device=dev)
        self.db32 = torch.zeros(bias.shape, dtype=torch.float32, device=dev) if need_db else None
        self.weight, self.first = weight, True

    @staticmethod
    def fp8_parts(n):
        """(start, end) row ranges of a chunk of n rows whose dlogits are quantized and multiplied one at a time:
        FP8_DH_SPLIT parts (1 byte a logit each), so that the chunk's peak stays near the bf16 path's (fewer
        rows per chunk would cost a pass over dweight per extra chunk instead)."""
        part = cdiv(n, FP8_DH_SPLIT) if n >= FP8_DH_SPLIT * ROW_ALIGN else n
        return [(p, min(p + part, n)) for p in range(0, n, part)]

    def add_dhidden_fp8(self, dq, ds, start):
        """dhidden's rows [start, start + len(dq)) from dlogits' e4m3 rows dq and their scales ds."""
        rows = self.dh[start:start + dq.shape[0]]
        if self.dh32 is not None:  # fp16: the fp32 product, scaled, then rounded once
            rows.copy_(_fp8_gemm(dq, ds, *self.wt8, None, torch.float32).mul_(self.post))
        else:
            rows.copy_(_fp8_gemm(dq, ds, *self.wt8, None, self.dh.dtype))

    def add_chunk(self, dlogits, h_chunk, start, dh_done=False):
        """The chunk's share of every gradient from its dlogits; dh_done: its dhidden rows are in already
        (add_dhidden_fp8 on the e4m3 rows the cross-entropy kernel wrote)."""
        if not dh_done:
            self._add_dhidden(dlogits, start)
        beta = 0.0 if self.first else 1.0  # beta = 0: the buffer's prior (uninitialized) contents are ignored
        if self.dw32 is not None:
            if self.dw32.is_cuda:  # cuBLAS bf16 x bf16 accumulated into an fp32 C
                torch.addmm(self.dw32, dlogits.t(), h_chunk, beta=beta, out_dtype=torch.float32, out=self.dw32)
            else:
                self.dw32.addmm_(dlogits.t().float(), h_chunk.float(), beta=beta)
        elif self.dw is not None:
            self.dw.addmm_(dlogits.t(), h_chunk, beta=beta)
        if self.db32 is not None:
            self.db32 += dlogits.sum(0, dtype=torch.float32)
        self.first = False

    def _add_dhidden(self, dlogits, start):
        if self.wt8 is not None:
            for p, q in self.fp8_parts(dlogits.shape[0]):
                dq, ds = quantize_rows(dlogits[p:q])
                self.add_dhidden_fp8(dq, ds, start + p)
                dq = ds = None
        elif self.dh32 is not None:  # fp32 product, scaled, then rounded once
            acc = self.dh32[:dlogits.shape[0]]
            if acc.is_cuda:
                torch.mm(dlogits, self.weight, out_dtype=torch.float32, out=acc)
            else:
                torch.mm(dlogits.float(), self.weight.float(), out=acc)
            self.dh[start:start + dlogits.shape[0]].copy_(acc.mul_(self.post))
        elif self.dh is not None:
            torch.mm(dlogits, self.weight, out=self.dh[start:start + dlogits.shape[0]])

    def result(self, hidden, weight, bias):
        dh, dw = self.dh, self.dw
        self.dh32 = self.wt8 = None
        if dw is not None:
            if self.first:  # no chunk ran (T = 0)
                dw.zero_()
            elif self.dw32 is not None:
                dw.copy_(self.dw32 if self.post is None else self.dw32.mul_(self.post))
            self.dw32 = None
        if self.db32 is not None and self.post is not None:
            self.db32.mul_(self.post)
        db = self.db32.to(bias.dtype) if self.db32 is not None else None
        none = hidden.new_empty(0)
        return (dh if dh is not None else none, dw if dw is not None else none.clone(),
                db if db is not None else none.clone())


def fused_dlogits_fp8(label_smoothing: float, z_loss: float, softcap: Optional[float]) -> bool:
    """Whether the cross-entropy kernel writes the fp8 LM head's e4m3 dlogits itself (it knows each row's amax
    before writing it only for the plain loss: no label smoothing, z-loss or softcap; those take a quantize_rows
    pass), unless KERNELKIT_FP8_CE_FUSE=0."""
    return not label_smoothing and not z_loss and softcap is None and switches.on("KERNELKIT_FP8_CE_FUSE")


def _chunk_logits_fp8(hidden, weight, bias, rows):
    """`_chunk_logits` with the logits GEMM in e4m3: hidden per token and weight per vocabulary row, quantized
    once per call; each chunk's logits are a fresh buffer (the consumer drops the last one first)."""
    hq, hs = quantize_rows(hidden)
    wq, ws = quantize_rows(weight)
    for s in range(0, hidden.shape[0], rows):
        e = min(s + rows, hidden.shape[0])
        logits = _fp8_gemm(hq[s:e], hs[s:e], wq, ws, bias, hidden.dtype)
        yield s, e, hidden[s:e], logits
        logits = None


def _chunk_logits(hidden, weight, bias, rows):
    """(start, end, hidden rows, logits) per chunk of `rows` tokens: one cuBLAS GEMM each into one buffer
    reused by every chunk (a chunk's logits are consumed before the next overwrites them)."""
    t, v = hidden.shape[0], weight.shape[0]
    buf = empty((min(rows, t), v), dtype=hidden.dtype, device=hidden.device)
    wt = weight.t()
    for s in range(0, t, rows):
        e = min(s + rows, t)
        h_c, logits = hidden[s:e], buf[:e - s]
        if bias is not None:
            torch.addmm(bias, h_c, wt, out=logits)
        else:
            torch.mm(h_c, wt, out=logits)
        yield s, e, h_c, logits


def linear_cross_entropy_fwd(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                             bias: Optional[torch.Tensor], ce_weight: Optional[torch.Tensor], ignore_index: int,
                             label_smoothing: float, z_loss: float, softcap: Optional[float], reduction: str,
                             chunk_size: Optional[int], need_dhidden: bool, need_dweight: bool, need_dbias: bool,
                             fp8: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunked forward on hidden (T, H), weight (V, H), target (T,), class weights ce_weight (V,) or None.
    Returns (loss, lse, dhidden, dweight, dbias): loss fp32 (0-dim, or (T,) for 'none'), lse (T,) fp32, and the
    gradients asked for (scaled for the reduction, for grad_output = 1; (0,) placeholders otherwise). 'none'
    computes none. fp8: the logits and dhidden GEMMs in e4m3 (`linear_cross_entropy`'s precision='fp8')."""
    ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size = _validate_scalars(
        ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size)
    _validate_tensors(hidden, weight, target, bias, ce_weight)
    if hidden.dim() != 2:
        raise ValueError(f"linear_cross_entropy_fwd takes 2-D hidden (T, H), got {tuple(hidden.shape)}")
    (t, _), v = hidden.shape, weight.shape[0]
    _validate.target_values(target, v, ignore_index)
    need = (need_dhidden, need_dweight, need_dbias and bias is not None)
    grad = reduction != "none" and any(need)
    rows = chunk_rows(t, v, hidden.element_size(), chunk_size)
    dev = hidden.device
    target = target.contiguous()
    loss_rows = empty((t,), dtype=torch.float32, device=dev)
    lse = empty((t,), dtype=torch.float32, device=dev)
    z_rows = empty((t,), dtype=torch.float32, device=dev) if z_loss else loss_rows
    wbuf = class_weight_buffer(ce_weight, v)
    count = mean_divisor(target, wbuf, v, ignore_index)  # the non-ignored tokens, or their class weights' sum
    kernel_count, mean, post = count, reduction == "mean", None
    if grad and hidden.dtype == torch.float16:  # see FP16_GRAD_SCALE
        kernel_count = torch.full((), 1.0 / FP16_GRAD_SCALE, dtype=torch.float32, device=dev)
        post = kernel_count / count if mean else kernel_count
        mean = True
    if fp8:
        why = fp8_unsupported(hidden, weight, reduction)
        if why is not None:
            raise ValueError(f"linear_cross_entropy: precision='fp8' cannot take this call: {why}")
    grads = _Grads(hidden, weight, bias, cdiv(t, rows), *need, rows=rows, post=post, fp8=fp8) if grad else None
    chunks = _chunk_logits_fp8 if fp8 else _chunk_logits
    fused8 = grads is not None and grads.wt8 is not None and fused_dlogits_fp8(label_smoothing, z_loss, softcap)
    for s, e, h_c, logits in chunks(hidden, weight, bias, rows):
        if fused8:  # the kernel writes each part's e4m3 dlogits too; its dhidden rows follow at once
            for p, q in grads.fp8_parts(e - s):
                dq = empty((q - p, v), dtype=torch.float8_e4m3fn, device=dev)
                ds = empty((q - p,), dtype=torch.float32, device=dev)
                a, b = s + p, s + q
                _ce_forward(logits[p:q], target[a:b], kernel_count, loss_rows[a:b], lse[a:b], z_rows[a:b],
                            ignore_index, label_smoothing, z_loss, softcap, mean, grad, wbuf, fp8_rows=(dq, ds))
                grads.add_dhidden_fp8(dq, ds, a)
                dq = ds = None
            grads.add_chunk(logits, h_c, s, dh_done=True)
        else:
            _ce_forward(logits, target[s:e], kernel_count, loss_rows[s:e], lse[s:e], z_rows[s:e], ignore_index,
                        label_smoothing, z_loss, softcap, mean, grad, wbuf)
            if grad:
                grads.add_chunk(logits, h_c, s)
        logits = None  # before the next chunk's logits exist
    logits = h_c = None  # the chunk buffer goes before the results are assembled (peak memory)
    if reduction == "none":
        loss = loss_rows
    else:
        loss = loss_rows.sum()
        if reduction == "mean":
            loss = loss / count
    none = hidden.new_empty(0)
    dh, dw, db = grads.result(hidden, weight, bias) if grad else (none, none.clone(), none.clone())
    return loss, lse, dh, dw, db


def linear_cross_entropy_bwd(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                             bias: Optional[torch.Tensor], ce_weight: Optional[torch.Tensor], lse: torch.Tensor,
                             ignore_index: int, label_smoothing: float, z_loss: float, softcap: Optional[float],
                             chunk_size: Optional[int], need_dhidden: bool, need_dweight: bool, need_dbias: bool
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recompute backward of reduction='none': grad (T,) per token; each chunk's logits are recomputed,
    the cross-entropy backward kernel writes grad x dloss/dlogits over them, and the same GEMMs as the
    fused forward follow. Returns (dhidden, dweight, dbias) with (0,) placeholders for those not asked for."""
    (t, _), v = hidden.shape, weight.shape[0]
    need = (need_dhidden, need_dweight, need_dbias and bias is not None)
    rows = chunk_rows(t, v, hidden.element_size(), chunk_size)
    inv_scale = None
    if hidden.dtype == torch.float16:  # see FP16_GRAD_SCALE
        inv_scale = torch.full((), 1.0 / FP16_GRAD_SCALE, dtype=torch.float32, device=hidden.device)
    grads = _Grads(hidden, weight, bias, cdiv(t, rows), *need, rows=rows, post=inv_scale)
    target, wbuf = target.contiguous(), class_weight_buffer(ce_weight, v)
    for s, e, h_c, logits in _chunk_logits(hidden, weight, bias, rows):
        _ce_backward(logits, target[s:e], lse[s:e], grad[s:e], ignore_index, label_smoothing, z_loss, softcap,
                     wbuf, inv_scale)
        grads.add_chunk(logits, h_c, s)
    logits = h_c = None  # the chunk buffer goes before the results are assembled (peak memory)
    return grads.result(hidden, weight, bias)


def scale_(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """x *= grad (0-dim) in place on the device, without reading grad on the host; no traffic when it is 1."""
    n = x.numel()
    if n:
        grid = (min(cdiv(n, SCALE_BLOCK), SCALE_PROGRAMS_PER_SM * num_sms(x.device)),)
        launch(grad_scale_kernel, grid, None, x, grad, n, BLOCK=SCALE_BLOCK, num_warps=SCALE_WARPS)
    return x


# --- the op, declared once: custom ops (torch.compile), fakes, autograd, the eager path ---

def _fake(hidden, weight, target, bias, ce_weight, ignore_index, label_smoothing, z_loss, softcap, reduction,
          chunk_size, need_dhidden, need_dweight, need_dbias, fp8=False):
    _validate_scalars(ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size)
    _validate_tensors(hidden, weight, target, bias, ce_weight)
    t = hidden.shape[0]
    grad = reduction != "none"
    f32 = dict(dtype=torch.float32)
    return (hidden.new_empty((t,) if reduction == "none" else (), **f32), hidden.new_empty((t,), **f32),
            hidden.new_empty(hidden.shape if grad and need_dhidden else (0,)),
            hidden.new_empty(weight.shape if grad and need_dweight else (0,)),
            hidden.new_empty(bias.shape if grad and need_dbias and bias is not None else (0,)))


def _bwd_fake(grad, hidden, weight, target, bias, ce_weight, lse, ignore_index, label_smoothing, z_loss, softcap,
              chunk_size, need_dhidden, need_dweight, need_dbias):
    return (hidden.new_empty(hidden.shape if need_dhidden else (0,)),
            hidden.new_empty(weight.shape if need_dweight else (0,)),
            hidden.new_empty(bias.shape if need_dbias and bias is not None else (0,)))


def _no_double_backward(ctx, *grads):
    # create_graph=True runs the backward in grad mode; gradients from GEMMs on saved buffers carry no graph.
    raise RuntimeError("kernelkit.linear_cross_entropy has no double backward: its gradients are computed "
                       "during the forward (and by a Triton kernel) and cannot carry a graph for "
                       "create_graph=True. Use the PyTorch reference (F.linear + F.cross_entropy) for "
                       "higher-order gradients.")


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, ce_weight, *scalars = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.reduction = scalars[4]
    ctx.args = tuple(scalars[:4]) + (scalars[5],)  # ignore_index, label_smoothing, z_loss, softcap, chunk_size
    ctx.need = (scalars[6], scalars[7], scalars[8] and bias is not None)  # need_dhidden, need_dweight, need_dbias
    ctx.applied = None
    if ctx.reduction == "none":
        ctx.save_for_backward(hidden, weight, target, bias, ce_weight, output[1])
    else:  # the gradients, computed by the forward for grad_output = 1
        ctx.save_for_backward(*output[2:])


def _backward(ctx, kernels, dloss):
    if torch.is_grad_enabled():  # create_graph=True through the custom op (the eager path refuses before)
        _no_double_backward(ctx)
    if ctx.reduction == "none":
        hidden, weight, target, bias, ce_weight, lse = ctx.saved_tensors
        grads = kernels.bwd(dloss, hidden, weight, target, bias, ce_weight, lse, *ctx.args, *ctx.need)
    elif kernels.bwd is not linear_cross_entropy_bwd:
        # A compiled graph is functional: it cannot scale the saved gradients in place. One multiply each.
        grads = tuple(g * dloss for g in ctx.saved_tensors)
    elif ctx.applied is None:
        # First eager backward: scale the saved gradients in place and hand the buffers over.
        ctx.applied = dloss.detach().to(torch.float32, copy=True)
        grads = tuple(scale_(g, ctx.applied) for g in ctx.saved_tensors)
    else:
        # Again through a retained graph: the buffers (handed out before) hold grad x the first
        # grad_output; divide it out into fresh tensors (NaN if the first grad_output was 0).
        f = dloss.detach().float() / ctx.applied
        grads = tuple((g.float() * f).to(g.dtype) for g in ctx.saved_tensors)
    dh, dw, db = (g if n else None for g, n in zip(grads, ctx.need))
    return (dh, dw, None, db) + (None,) * 11


LINEAR_CROSS_ENTROPY = Op("linear_cross_entropy", linear_cross_entropy_fwd, fake=_fake, setup_context=_setup_context,
                          backward=_backward, bwd=linear_cross_entropy_bwd, bwd_fake=_bwd_fake,
                          double_backward=_no_double_backward, n_grad=4, public=0)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, *, ce_weight: Optional[torch.Tensor] = None,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: Optional[float] = None, reduction: str = "mean",
                         chunk_size: Optional[int] = None, precision: str = "bf16") -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)`` without materializing the logits.

    hidden: (..., H) in float32, bfloat16 or float16, any strides; weight: (V, H) (nn.Linear's layout) and
    bias (V,) of hidden's dtype; target (...) int64 or int32 class indices, ``ignore_index`` marking tokens
    with no loss. ``ce_weight`` (V,): class weights, F.cross_entropy's ``weight`` under Liger's name (here
    ``weight`` is the LM head's), any float dtype, with torch's semantics as in kernelkit.cross_entropy: a
    token's loss and gradient scaled by its target's weight, 'mean' divided by the weights' sum over the
    non-ignored tokens, ``label_smoothing``'s term weighted per class; no gradient for it (one that requires
    grad raises). Fused per chunk of tokens: the logits GEMM, ``softcap`` (``c * tanh(x / c)``),
    ``label_smoothing``, ``z_loss`` (``z * lse²`` per token, times its class weight), and, when an input
    requires grad, dlogits and the dhidden / dweight / dbias GEMMs, all during the forward (see the module
    docstring). The loss is fp32 (a per-token (...) tensor for reduction='none'), accumulated in fp32 whatever
    the input dtype; 'mean' over non-ignored tokens is NaN when there are none, like torch. ``chunk_size`` overrides the
    rows per chunk (default: `chunk_rows`, from ``MAX_CHUNK_BYTES``). Under torch.autocast the inputs are
    cast to the autocast dtype first, as for F.linear. A class index outside [0, V) raises on CPU tensors
    and gives NaN on the GPU. No double backward (create_graph=True raises).

    ``precision="fp8"`` runs the logits GEMM and the dhidden GEMM in float8_e4m3fn with rowwise scales (hidden
    per token and weight per vocabulary row for the logits; dlogits per token and weight per hidden column for
    dhidden), fp32 accumulation; dweight stays in the inputs' dtype. It takes bf16 / fp16 inputs with H and V
    multiples of 16, reduction 'mean' or 'sum', on a GPU with fp8 tensor cores (or the interpreter); other calls
    raise ValueError with the reason (`fp8_unsupported`). It costs one byte per weight element twice (the two
    quantized copies of the weight) while the call runs. "bf16" (the default): every GEMM in the inputs' dtype.
    """
    scalars = _validate_scalars(ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size)
    if precision not in PRECISIONS:
        raise ValueError(f"linear_cross_entropy: precision={precision!r} is not one of "
                         f"{', '.join(map(repr, PRECISIONS))}")
    if isinstance(hidden, torch.Tensor) and not hidden.is_meta and torch.is_autocast_enabled(hidden.device.type):
        # The GEMMs run in the autocast dtype, as F.linear's would (fp32 master weights under bf16 autocast).
        dt = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight, bias = (x.to(dt) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                                for x in (hidden, weight, bias))
    _validate_tensors(hidden, weight, target, bias, ce_weight)
    if ce_weight is not None and ce_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("ce_weight requires grad, but class weights get no gradient (torch's F.cross_entropy has "
                         "no derivative for its weight either): pass ce_weight.detach(), or keep it in a buffer")
    # The gradients to compute during the forward: those of inputs that require grad, while grad mode is on.
    grad = torch.is_grad_enabled()
    loss = LINEAR_CROSS_ENTROPY(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias, ce_weight,
                                *scalars, grad and hidden.requires_grad, grad and weight.requires_grad,
                                grad and bias is not None and bias.requires_grad, precision == "fp8")
    return loss.view(target.shape) if reduction == "none" else loss


class LinearCrossEntropyLoss(torch.nn.Module):
    """The LM-head loss as a module: ``forward(hidden, weight, target, bias=None)`` is
    `linear_cross_entropy` with the options given here (pass ``lm_head.weight`` as weight).

    Documented fallback: CPU tensors outside the Triton interpreter run the PyTorch reference.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: Optional[float] = None, chunk_size: Optional[int] = None,
                 ce_weight: Optional[torch.Tensor] = None):
        super().__init__()
        _validate_scalars(ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size)
        if ce_weight is not None and not (isinstance(ce_weight, torch.Tensor) and ce_weight.dim() == 1):
            raise TypeError(f"ce_weight must be None or a 1-D tensor of class weights (V,), got "
                            f"{type(ce_weight).__name__}{tuple(getattr(ce_weight, 'shape', ()))}")
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss, self.softcap, self.chunk_size = z_loss, softcap, chunk_size
        self.register_buffer("ce_weight", ce_weight)  # as nn.CrossEntropyLoss keeps its weight: moves with .to()

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        kw = dict(ce_weight=self.ce_weight, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                  z_loss=self.z_loss, softcap=self.softcap, reduction=self.reduction)
        if hidden.device.type != "cuda" and not interpreting():
            return reference(hidden, weight, target, bias, **kw)
        return linear_cross_entropy(hidden, weight, target, bias, chunk_size=self.chunk_size, **kw)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing="
                f"{self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}")


def reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor] = None,
              *, ce_weight: Optional[torch.Tensor] = None, ignore_index: int = -100, label_smoothing: float = 0.0,
              z_loss: float = 0.0, softcap: Optional[float] = None, reduction: str = "mean", **_) -> torch.Tensor:
    """Plain PyTorch, the way HF computes the LM loss: ``F.cross_entropy(F.linear(h, w, b).float(), t,
    weight=ce_weight)`` (float64 inputs stay float64), with softcap and z-loss as kernelkit.cross_entropy's
    reference adds them."""
    logits = F.linear(hidden, weight, bias)
    loss = cross_entropy_reference(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), weight=ce_weight,
                                   ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                                   softcap=softcap, reduction=reduction)
    return loss.view(target.shape) if reduction == "none" else loss


def cost(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor] = None,
         *_, backward: bool = False, **__) -> Cost:
    """The three GEMMs: 2·T·H·V FLOPs forward (the logits), 4·T·H·V for the backward's share (dhidden and
    dweight; forward + backward = 6·T·H·V, however the fused op splits them between its passes). Ideal
    bytes: the forward reads hidden, weight (bias) and target once; the backward reads hidden and weight
    and writes dhidden and dweight (dbias) once. The logits never reach memory in the ideal."""
    h, v = hidden.shape[-1], weight.shape[0]
    t = hidden.numel() // max(h, 1)
    esize = hidden.element_size()
    b_bytes = bias.numel() * bias.element_size() if bias is not None else 0
    inputs = (t * h + v * h) * esize + b_bytes
    if backward:
        return Cost(flops=4.0 * t * h * v, bytes=2.0 * inputs, dtype=dtype_key(hidden.dtype))
    return Cost(flops=2.0 * t * h * v, bytes=inputs + target.numel() * target.element_size(),
                dtype=dtype_key(hidden.dtype))


def make_inputs(shape, dtype, device, generator=None):
    t, h, v = shape
    hidden = torch.randn((t, h), device=device, generator=generator).to(dtype)
    # std 2 / sqrt(H): logits of std ~2, about the spread of real LM logits.
    weight = (torch.randn((v, h), device=device, generator=generator) * (2.0 / math.sqrt(h))).to(dtype)
    target = torch.randint(0, v, (t,), device=device, generator=generator)
    target[torch.rand(t, device=device, generator=generator) < 0.1] = -100  # ~10% padding / prompt tokens
    return (hidden, weight, target), {}


def _liger_loader():
    fn = optional_import("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy")()
    if fn is None:
        return None

    def liger(hidden, weight, target, bias=None, ce_weight=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
              softcap=None, reduction="mean", **_):
        return fn(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), bias, ce_weight, ignore_index,
                  z_loss, label_smoothing, reduction, softcap)

    return liger


register(OpSpec(
    name="linear_cross_entropy", fn=linear_cross_entropy, reference=reference, cost=cost, make_inputs=make_inputs,
    grads_in_forward=lambda *_, reduction="mean", **__: reduction != "none",  # 'none' recomputes in its backward
    grad_args=(0, 1),
    test_shapes=[(3, 16, 100), (37, 24, 257), (45, 33, 1000)],
    bench_shapes=[(8192, 4096, 128256)],
    competitors={"liger": _liger_loader},
    replaces=("aten::linear+aten::cross_entropy_loss",),
    # A broadcast weight makes every class's logit equal: dhidden is exactly zero in the reference, and a
    # relative error against zero measures nothing (the hidden states' layouts are all fuzzed).
    layout_skip=((1, "expanded"),),
    doc="LM head + cross-entropy fused per chunk of tokens: cuBLAS GEMMs around the cross-entropy kernel, "
        "gradients in the forward, no (T, V) logits; ignore_index, class weights (ce_weight), label smoothing, "
        "z-loss, softcap, bias.",
))
