"""Linear / GEMM: out = residual + scale * act(x @ weight^T + bias), one Triton GEMM with the epilogue in its store.

Compute-bound at LLM sizes (2·M·N·K FLOPs against M·K + N·K + M·N elements of traffic), so the epilogue is
free only if it rides the GEMM's single store: unfused, `gelu(F.linear(x, w, b)) + residual` writes and
re-reads the M×N output twice more. The kernel is the plain pointer GEMM (grouped tile order for L2
reuse, fp32 accumulation, masks for ragged M/N/K, int64 offsets); both operands are read through their
strides, so a transposed or row-padded x and a weight (N, K) read as W^T reach it without a copy.
Persistent and TMA variants are the next step, once this one is measured on the H100.

The backward runs cuBLAS (torch.matmul) for dgrad (dz @ W) and wgrad (dz^T @ x) after applying the
activation's derivative to dy in PyTorch; the pre-activation z is recomputed with this kernel (see
`_grad_inputs`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch._C import _functorch

from ...roofline.model import Cost, dtype_key
from ...runtime.alloc import empty
from ...runtime import cdiv, ensure_tma_allocator, interpreting, launch, next_pow2, num_sms, tma_device
from .. import _validate
from ..gemm.tiles import GEMM_TMA, input_precision
from .._dispatch import differentiable_backward, dispatch, reference_vjp
from ..registry import OpSpec, register
from .kernels import GELU_CUBIC, INV_SQRT_2, TWO_SQRT_2_OVER_PI, linear_fwd_kernel, linear_tma_kernel

ACTIVATIONS = (None, "gelu", "gelu_tanh", "silu", "relu", "relu2", "swiglu")



# --- launcher ---

def _rows(x: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """x as (m, k) with any strides (the kernel takes both); leading dims that no single stride can walk
    are copied."""
    if x.dim() == 2:
        return x
    try:
        return x.view(m, k)
    except RuntimeError:
        return _validate._copied(x).reshape(m, k)


def _check(x, weight, bias, residual, activation, scale, out_dtype):
    """Validate the arguments once; returns (N_out, out_dtype)."""
    _validate.tensor(x, "x", min_dim=1)
    _validate.tensor(weight, "weight")
    _validate.same_device(weight, "weight", x, "x")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must have shape (out_features, {x.shape[-1]}) to match x's last dim "
                         f"(nn.Linear convention), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but x has {x.dtype}; cast one to the other")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    n = weight.shape[0]
    if activation == "swiglu":
        if n % 2:
            raise ValueError(f"activation='swiglu' needs an even out_features (gate and up halves), got {n}")
        n //= 2
    if bias is not None:
        _validate.tensor(bias, "bias")
        _validate.same_device(bias, "bias", x, "x")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},) to match weight's out_features, "
                             f"got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias has dtype {bias.dtype} but x has {x.dtype}; cast one to the other")
    if out_dtype is not None and out_dtype not in _validate.FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be None or one of float32, bfloat16, float16, got {out_dtype}")
    out_dtype = out_dtype or x.dtype
    if residual is not None:
        _validate.tensor(residual, "residual")
        _validate.same_device(residual, "residual", x, "x")
        want = (*x.shape[:-1], n)
        if tuple(residual.shape) != want:
            raise ValueError(f"residual must have the output's shape {want}, got {tuple(residual.shape)}")
    if scale is not None:
        _validate.number(scale, "scale")
    return n, out_dtype


# The TMA path: 16-bit inputs on a Hopper-or-newer GPU (or the interpreter), unit inner strides, 16-byte aligned
# bases and row strides (what a tensor descriptor takes). KERNELKIT_GEMM_TMA=0 turns it off (the pointer kernel;
# gemm/tiles.py reads it).


def _tma_layout(x2, weight, out2, n, activation):
    """(B_KMAJOR, the weight's non-unit stride) when linear_tma_kernel can take these operands, else None."""
    if not GEMM_TMA or x2.dtype not in (torch.bfloat16, torch.float16) or not tma_device(x2):
        return None
    esize = x2.element_size()

    def aligned(t, row_stride, esz):
        return t.data_ptr() % 16 == 0 and (row_stride * esz) % 16 == 0

    k = x2.shape[1]
    if x2.stride(1) != 1 or x2.stride(0) < k or not aligned(x2, x2.stride(0), esize):
        return None  # (a broadcast x, stride 0 along M, takes the pointer kernel)
    if out2.stride(1) != 1 or not aligned(out2, out2.stride(0), out2.element_size()):
        return None
    if weight.stride(1) == 1 and weight.stride(0) >= k:  # nn.Linear's (N, K): K-major boxes
        kmajor, stride_b = True, weight.stride(0)
        up_offset = n * stride_b
    elif weight.stride(0) == 1 and weight.stride(1) >= weight.shape[0]:  # a transposed (K, N), as matmul's b
        kmajor, stride_b = False, weight.stride(1)
        up_offset = n
    else:
        return None
    if not aligned(weight, stride_b, esize) or (activation == "swiglu" and (up_offset * esize) % 16):
        return None
    return kmajor, stride_b


def linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               residual: Optional[torch.Tensor] = None, activation: Optional[str] = None,
               scale: Optional[float] = None, out_dtype: Optional[torch.dtype] = None,
               allow_tf32: bool = False) -> torch.Tensor:
    """Launch the fused GEMM. Returns out of shape (*x.shape[:-1], N_out) in out_dtype (x's by default)."""
    n, out_dtype = _check(x, weight, bias, residual, activation, scale, out_dtype)
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    out = empty((*x.shape[:-1], n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    x2, out2 = _rows(x, m, k), out.view(m, n)
    r2 = _rows(residual, m, n) if residual is not None else out2  # dummy pointer, never read
    b = bias if bias is not None else x2
    precision = input_precision(x.dtype, allow_tf32)
    m_bucket = next_pow2(m)
    tma = _tma_layout(x2, weight, out2, n, activation)
    if tma is not None:
        b_kmajor, stride_b = tma
        if x.is_cuda:
            ensure_tma_allocator()  # descriptors made inside the kernel live in a scratch buffer Triton asks for
        sms = num_sms(x.device)
        grid = lambda meta: (min(sms, cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"])),)  # noqa: E731
        launch(linear_tma_kernel, grid,
               (m_bucket, n, k, x.dtype, out_dtype, r2.dtype, activation, bias is not None, residual is not None,
                precision, b_kmajor, sms),
               x2, weight, out2, b, r2, x2.stride(0), stride_b, out2.stride(0), r2.stride(0), r2.stride(1),
               b.stride(0) if bias is not None else 0,
               m, n, k, m_bucket, float(scale) if scale is not None else 1.0, NUM_SMS=sms, B_KMAJOR=b_kmajor,
               ACTIVATION=activation, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
               HAS_SCALE=scale is not None, INPUT_PRECISION=precision)
        return out
    grid = lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    launch(linear_fwd_kernel, grid, (m_bucket, n, k, x.dtype, out_dtype, r2.dtype, activation, bias is not None,
                                     residual is not None, precision),
           x2, weight, out2, b, r2,
           x2.stride(0), x2.stride(1),
           weight.stride(1), weight.stride(0),
           out2.stride(0), out2.stride(1),
           r2.stride(0), r2.stride(1),
           b.stride(0) if bias is not None else 0,
           m, n, k, m_bucket, float(scale) if scale is not None else 1.0,
           ACTIVATION=activation, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
           HAS_SCALE=scale is not None, INPUT_PRECISION=precision)
    return out


# --- backward: the activation's derivative in PyTorch, then cuBLAS for dgrad and wgrad ---

def _act_grad(z: torch.Tensor, dh: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    """dL/dz from dL/dh for h = act(z), in z's dtype (fp32 here); swiglu returns the (gate, up) halves joined."""
    if activation is None:
        return dh
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * INV_SQRT_2))
        return dh * (cdf + z * torch.exp(-0.5 * z * z) * 0.3989422804014327)  # 1/sqrt(2 pi)
    if activation == "gelu_tanh":
        inner = TWO_SQRT_2_OVER_PI * z * (1.0 + GELU_CUBIC * z * z)
        s = torch.sigmoid(inner)
        return dh * (s + z * s * (1.0 - s) * TWO_SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * z * z))
    if activation == "silu":
        s = torch.sigmoid(z)
        return dh * s * (1.0 + z * (1.0 - s))
    if activation == "relu":
        return dh * (z > 0)
    if activation == "relu2":
        return dh * 2.0 * z.clamp_min(0.0)
    gate, up = z.chunk(2, dim=-1)  # swiglu
    s = torch.sigmoid(gate)
    return torch.cat([dh * up * s * (1.0 + gate * (1.0 - s)), dh * gate * s], dim=-1)


def _act_grad_lowp(z: torch.Tensor, dh: torch.Tensor, activation: str) -> torch.Tensor:
    """dL/dz from dL/dh for h = act(z) in z's 16-bit dtype, through aten's fused activation backwards (eager's)."""
    if activation in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(dh, z, approximate="none" if activation == "gelu" else "tanh")
    if activation == "silu":
        return torch.ops.aten.silu_backward(dh, z)
    if activation == "relu":
        return torch.ops.aten.threshold_backward(dh, z, 0)
    return dh * (2.0 * torch.relu(z))  # relu2


def _grad_inputs(dy, x, weight, bias, residual, activation, scale, allow_tf32, needs, preact):
    """(dx, dweight, dbias, dresidual) for out = residual + scale * act(x @ W^T + b).

    The pre-activation z is recomputed (by `preact`, this kernel with no epilogue but the bias; in x's dtype for
    16-bit inputs, as eager keeps it, else in fp32) rather than saved: autograd then keeps only x, W and b, as
    F.linear without an activation does, at the price of a third GEMM in the backward. Whether saving z (one more M×N store in the forward) pays
    is a measurement for the H100."""
    k = x.shape[-1]
    m = x.numel() // k if k else math.prod(x.shape[:-1])  # explicit: reshape(-1, 0) of an empty tensor fails
    dy2 = dy.reshape(m, dy.shape[-1])
    if x.dtype != torch.float32 and activation != "swiglu":
        # 16-bit, as eager computes it: z in x's dtype and the activation's gradient in one torch kernel (the fp32
        # path below ran 0.34x eager's backward on the H100: an fp32 z and a chain of fp32 elementwise ops)
        dz = (dy2 if scale is None else dy2 * scale).to(x.dtype)
        if activation is not None:
            z = preact(x, weight, bias, None, None, None, x.dtype, allow_tf32).reshape(-1, weight.shape[0])
            dz = _act_grad_lowp(z, dz, activation)
        dh = dz
    else:
        dh = dy2.float() * scale if scale is not None else dy2.float()
        if activation is not None:
            z = preact(x, weight, bias, None, None, None, torch.float32, allow_tf32).reshape(-1, weight.shape[0])
            dh = _act_grad(z, dh, activation)
        dz = dh.to(x.dtype)
    dx = (dz @ weight).view(*x.shape[:-1], k) if needs[0] else None
    dw = (dz.t() @ x.reshape(m, k)).to(weight.dtype) if needs[1] else None
    db = dh.sum(0, dtype=torch.float32).to(bias.dtype) if bias is not None and needs[2] else None
    dr = dy.to(residual.dtype) if residual is not None and needs[3] else None
    return dx, dw, db, dr


# --- torch.library custom op: one graph node under torch.compile, autograd through the same backward ---

@torch.library.custom_op("kernelkit::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
               activation: Optional[str], scale: Optional[float], out_dtype: Optional[torch.dtype],
               allow_tf32: bool) -> torch.Tensor:
    return linear_fwd(x, weight, bias, residual, activation, scale, out_dtype, allow_tf32)


@_linear_op.register_fake
def _(x, weight, bias, residual, activation, scale, out_dtype, allow_tf32):
    n, out_dtype = _check(x, weight, bias, residual, activation, scale, out_dtype)
    return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, activation, scale, _out_dtype, allow_tf32 = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.residual = residual.detach() if residual is not None else None  # only its dtype is read
    ctx.activation, ctx.scale, ctx.allow_tf32 = activation, scale, allow_tf32


def _backward(ctx, dy):
    x, weight, bias = ctx.saved_tensors
    grads = _grad_inputs(dy, x, weight, bias, ctx.residual, ctx.activation, ctx.scale, ctx.allow_tf32,
                         ctx.needs_input_grad[:4], _linear_op)
    return (*grads, None, None, None, None)


_linear_op.register_autograd(_backward, setup_context=_setup_context)


@_linear_op.register_vmap
def _(info, in_dims, x, weight, bias, residual, activation, scale, out_dtype, allow_tf32):
    # torch.func.vmap: with one weight and bias for the batch, the batch dim joins x's leading dims (one GEMM);
    # a weight or bias per sample takes a GEMM each. (Without a rule vmap loops per sample and warns.)
    x_bd, w_bd, b_bd, r_bd = in_dims[:4]

    def batch_first(t, bd):
        return t.movedim(bd, 0) if bd is not None else t.expand(info.batch_size, *t.shape)

    if w_bd is None and b_bd is None:
        x = batch_first(x, x_bd)
        residual = batch_first(residual, r_bd) if residual is not None else None
        return _linear_op(x, weight, bias, residual, activation, scale, out_dtype, allow_tf32), 0

    def sample(t, bd, i):
        return t if t is None or bd is None else t.select(bd, i)

    return torch.stack([_linear_op(sample(x, x_bd, i), sample(weight, w_bd, i), sample(bias, b_bd, i),
                                   sample(residual, r_bd, i), activation, scale, out_dtype, allow_tf32)
                        for i in range(info.batch_size)]), 0


def _double_backward(ctx, dy):
    x, weight, bias = ctx.saved_tensors
    res = ctx.residual
    inputs = (x, weight, bias, ctx.activation, res, ctx.out_dtype, ctx.scale)
    dx, dw, db, _act, dr, *_ = reference_vjp(_reference_positional, inputs, (dy,), 7)
    if res is not None and dr is None and ctx.needs_input_grad[3]:
        dr = dy.to(res.dtype)
    return dx, dw, db, dr, None, None, None, None


def _reference_positional(x, weight, bias, activation, residual, out_dtype, scale):
    return reference(x, weight, bias, activation, residual, out_dtype=out_dtype, scale=scale)


class _LinearFunction(torch.autograd.Function):
    """The eager path: the same launcher and backward as the custom op, with less per-call overhead."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, activation, scale, out_dtype, allow_tf32):
        out = linear_fwd(x, weight, bias, residual, activation, scale, out_dtype, allow_tf32)
        ctx.save_for_backward(x, weight, bias)
        ctx.residual = residual.detach() if residual is not None else None
        ctx.activation, ctx.scale, ctx.out_dtype, ctx.allow_tf32 = activation, scale, out_dtype, allow_tf32
        return out

    @staticmethod
    @differentiable_backward(lambda ctx, dy: _double_backward(ctx, dy), "linear")
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        grads = _grad_inputs(dy, x, weight, bias, ctx.residual, ctx.activation, ctx.scale, ctx.allow_tf32,
                             ctx.needs_input_grad[:4], linear_fwd)
        return (*grads, None, None, None, None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           activation: Optional[str] = None, residual: Optional[torch.Tensor] = None, *,
           out_dtype: Optional[torch.dtype] = None, scale: Optional[float] = None) -> torch.Tensor:
    """``residual + scale * activation(x @ weight.T + bias)`` in one GEMM, the epilogue fused in its store.

    x: (..., K); weight: (N, K) (nn.Linear's (out_features, in_features)), both float32, bfloat16 or
    float16 of one dtype, any strides (a transposed weight view or row-padded x is read as it is);
    bias: (N,) of x's dtype. activation: None, "gelu" (erf), "gelu_tanh", "silu", "relu", "relu2"
    (relu squared) or "swiglu": the weight's rows are [gate; up] and the output is
    ``silu(gate) * up``, N/2 wide (N must be even). residual: (..., N_out), any float dtype, added last;
    scale multiplies the activation's output. The output is out_dtype (x's dtype by default).

    Accumulation is fp32. Like torch, fp32 inputs compute in true fp32 unless
    ``torch.backends.cuda.matmul.allow_tf32`` is set, which selects TF32 tensor-core math (read at call time).
    Under ``torch.autocast`` for x's device, x, weight and bias are cast to the autocast dtype first, as
    F.linear's are (the cast is differentiable: fp32 master weights get their gradients), and the output
    dtype is what ``act(F.linear(x, w, b)) * scale + residual`` gives there (promoted with the residual's).
    Differentiable in x, weight, bias and residual with torch.autograd; the backward GEMMs run on cuBLAS.
    ``torch.func.vmap`` is supported (one GEMM when only x and residual are batched, one per sample when the
    weight or bias is); torch.func's differentiating transforms (grad, vjp, jvp, jacrev, jacfwd, hessian)
    are not, and raise NotImplementedError.
    """
    if isinstance(x, torch.Tensor) and x.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x.device.type):
        return _autocast_linear(x, weight, bias, activation, residual, out_dtype, scale)
    allow_tf32 = bool(torch.backends.cuda.matmul.allow_tf32) and getattr(x, "dtype", None) == torch.float32
    if isinstance(scale, torch.Tensor) and scale.requires_grad and torch.is_grad_enabled():
        raise TypeError("scale is a tensor that requires grad, but kernelkit.linear's scale is a constant "
                        "(no gradient flows to it): pass a number or a detached tensor, or multiply the "
                        "output by it outside the call")
    args = (x, weight, bias, residual, activation, None if scale is None else _validate.number(scale, "scale"),
            out_dtype, allow_tf32)
    if not torch.compiler.is_compiling() and _functorch.peek_interpreter_stack() is not None \
            and _func_wrapped(args[:4]):
        return _linear_op(*args)  # vmap's batching rule (above) launches the kernel on the unwrapped tensors
    return dispatch(_linear_op, linear_fwd, _LinearFunction, 4, args)


def _func_wrapped(tensors) -> bool:
    """Whether a torch.func transform wraps any of `tensors`. vmap's (and functionalize's) wrappers are fine
    for the custom op; grad's and jvp's would reach the kernel or _LinearFunction, which cannot take them."""
    wrapped = False
    for t in tensors:
        while isinstance(t, torch.Tensor) and _functorch.is_functorch_wrapped_tensor(t):
            if _functorch.is_gradtrackingtensor(t):
                raise NotImplementedError(
                    "kernelkit.linear does not support torch.func.grad, vjp, jvp, jacrev, jacfwd or hessian (its "
                    "Triton kernels cannot read the tensors they wrap, and its backward has no functorch rule): "
                    "differentiate with torch.autograd (loss.backward(), torch.autograd.grad), or use "
                    "kernelkit.ops.linear.reference inside the transform. torch.func.vmap is supported.")
            wrapped = True
            t = _functorch.get_unwrapped(t)
    return wrapped


def _autocast_linear(x, weight, bias, activation, residual, out_dtype, scale):
    device = x.device.type
    dtype = torch.get_autocast_dtype(device)

    def cast(t):
        ok = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if ok else t

    if out_dtype is None and isinstance(residual, torch.Tensor):
        out_dtype = torch.promote_types(dtype, residual.dtype)
    with torch.autocast(device, enabled=False):
        return linear(cast(x), cast(weight), cast(bias), activation, residual, out_dtype=out_dtype, scale=scale)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a (..., K) and b (K, N) through kernelkit's GEMM (b is read through its strides, no copy);
    dtypes, precision, torch.autocast and torch.func.vmap as `linear`. Errors name a and b with their shapes."""
    if not isinstance(b, torch.Tensor) or b.dim() != 2:
        raise ValueError(f"b must be a 2-D (K, N) tensor, got "
                         f"{tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
    _validate.tensor(a, "a", min_dim=1)
    _validate.tensor(b, "b")
    _validate.same_device(b, "b", a, "a")
    if a.shape[-1] != b.shape[0]:  # checked here: linear's messages would name the weight, b transposed
        raise ValueError(f"a's last dim ({a.shape[-1]}) must equal b's first dim ({b.shape[0]}): a "
                         f"{tuple(a.shape)} @ b {tuple(b.shape)}")
    if a.dtype != b.dtype and not (a.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(a.device.type)):
        raise TypeError(f"b has dtype {b.dtype} but a has {a.dtype}; cast one to the other")
    return linear(a, b.t())


class Linear(torch.nn.Linear):
    """Drop-in for `torch.nn.Linear` (same constructor and state_dict) running kernelkit's fused GEMM, with an
    optional fused `activation` (see `kernelkit.linear`; with "swiglu" the output is out_features / 2 wide).
    Documented fallback: a CPU tensor outside the Triton interpreter runs the PyTorch definition. Under
    torch.autocast, x, weight and bias are cast to the autocast dtype as `torch.nn.Linear`'s are."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 activation: Optional[str] = None):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
        if activation == "swiglu" and out_features % 2:
            raise ValueError(f"activation='swiglu' needs an even out_features, got {out_features}")
        super().__init__(in_features, out_features, bias, device, dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda" and not interpreting():
            return reference(x, self.weight, self.bias, self.activation)
        return linear(x, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", activation={self.activation!r}" if self.activation else "")


# --- reference, cost, registry ---

def _torch_activation(z: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation is None:
        return z
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if activation == "silu":
        return F.silu(z)
    if activation == "relu":
        return F.relu(z)
    if activation == "relu2":
        return F.relu(z).square()
    if activation == "swiglu":
        gate, up = z.chunk(2, dim=-1)
        return F.silu(gate) * up
    raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")


def reference(x, weight, bias=None, activation=None, residual=None, *, out_dtype=None, scale=None):
    """Plain PyTorch: ``residual + scale * act(F.linear(x, weight, bias))``, in x's dtype, cast to out_dtype."""
    y = _torch_activation(F.linear(x, weight, bias), activation)
    if scale is not None:
        y = y * scale
    if residual is not None:
        y = y + residual.to(y.dtype)
    return y.to(out_dtype) if out_dtype is not None else y


def eager(x, weight, bias=None, activation=None, residual=None, *, out_dtype=None, scale=None):
    """What a model runs without kernelkit: F.linear (cuBLAS) then the torch activation: the "cuBLAS" row."""
    return reference(x, weight, bias, activation, residual, out_dtype=out_dtype, scale=scale)


def cost(x, weight, bias=None, activation=None, residual=None, *, out_dtype=None, scale=None,
         backward: bool = False) -> Cost:
    """2·M·N·K FLOPs (x2 for the two backward GEMMs, plus the recomputed z with an activation); ideal
    bytes: each input read once, the output written once."""
    k = x.shape[-1]
    m = x.numel() // max(k, 1)
    n_w = weight.shape[0]
    n = n_w // 2 if activation == "swiglu" else n_w
    es = x.element_size()
    out_es = torch.empty(0, dtype=out_dtype or x.dtype).element_size()
    b_bytes = bias.numel() * bias.element_size() if bias is not None else 0
    r_bytes = residual.numel() * residual.element_size() if residual is not None else 0
    dt = "tf32" if x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else dtype_key(x.dtype)
    if backward:  # reads dy, x, W (and b); writes dx, dW (and db, dresidual)
        flops = 4.0 * m * n_w * k + (2.0 * m * n_w * k if activation is not None else 0.0)
        return Cost(flops=flops, bytes=(2 * m * k + 2 * n_w * k) * es + m * n * out_es + 2 * b_bytes + r_bytes,
                    dtype=dt)
    return Cost(flops=2.0 * m * n_w * k, bytes=(m * k + n_w * k) * es + b_bytes + r_bytes + m * n * out_es, dtype=dt)


def make_inputs(shape, dtype, device, generator=None):
    """shape = (M, K, N): x (M, K), weight (N, K) scaled by 1/sqrt(K) (outputs of order 1), bias (N,)."""
    m, k, n = shape
    x = torch.randn((m, k), dtype=dtype, device=device, generator=generator)
    w = (torch.randn((n, k), dtype=torch.float32, device=device, generator=generator) / k ** 0.5).to(dtype)
    b = 0.1 * torch.randn(n, dtype=dtype, device=device, generator=generator)
    return (x, w, b), {"activation": "gelu"}


register(OpSpec(
    name="linear", fn=linear, reference=reference, cost=cost, make_inputs=make_inputs, grad_args=(0, 1, 2),
    test_shapes=[(37, 64, 100), (5, 129, 33), (1, 16, 8)],
    bench_shapes=[(8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096)],
    eager=eager, generic_rows=("eager",), baseline="eager",
    doc="GEMM with fused epilogue (bias, gelu/silu/relu/relu2/swiglu, scale, residual); backward on cuBLAS.",
))
