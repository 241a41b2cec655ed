"""FLOPs and ideal bytes of one aten op call, from its real arguments (or meta tensors of its shapes).

FLOPs: torch.utils.flop_counter's registered formulas where it has one (matmuls, convolutions, SDPA
forward and backward), causal attention halved (the formulas count the full square). Otherwise the
registry's per-element counts for the op families kernelkit has kernels for (softmax, norms), and about
one operation per element touched for everything else: elementwise ops and reductions are
memory-bound by orders of magnitude, so that count never decides a regime.

Ideal bytes: every input tensor read once and every output written once. Tensors passed twice count
once; broadcast (stride-0) dimensions are not counted; an in-place op reads and writes its target
except where the op only writes it (fill_, zero_, copy_ into it, random fills, out= arguments).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ..roofline.model import Cost, dtype_key
from ..ops import registry

# FLOPs per element of the (largest) input, as the registry's cost models count them: forward, backward.
PER_ELEMENT_FLOPS = {
    "aten::_softmax": 5.0, "aten::_log_softmax": 5.0,
    "aten::_softmax_backward_data": 4.0, "aten::_log_softmax_backward_data": 4.0,
    "aten::native_layer_norm": 7.0, "aten::native_layer_norm_backward": 10.0,
    "aten::_fused_rms_norm": 4.0, "aten::_fused_rms_norm_backward": 8.0,
}

# Inputs an op reads for their shape only: the fill ops, and nll_loss_backward, which zero-fills the
# gradient (inside its own call) and scatters one value per row into it.
SHAPE_ONLY = {"aten::zeros_like": "self", "aten::ones_like": "self", "aten::full_like": "self",
              "aten::rand_like": "self", "aten::randn_like": "self", "aten::randint_like": "self",
              "aten::new_zeros": "self", "aten::new_ones": "self", "aten::new_full": "self",
              "aten::nll_loss_backward": "self", "aten::nll_loss2d_backward": "self"}

# Gathers: of the input named here, only the elements the index selects are read (one row of the table
# per token for an embedding, one logit per row for nll_loss), not the whole tensor.
GATHERED = {"aten::embedding": ("weight", "indices"), "aten::nll_loss_forward": ("self", "target"),
            "aten::nll_loss2d_forward": ("self", "target"), "aten::gather": ("self", "index"),
            "aten::index_select": ("self", "index")}

# In-place ops that overwrite their target without reading it.
_WRITE_ONLY = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "exponential_", "bernoulli_",
               "geometric_", "cauchy_", "log_normal_", "set_", "resize_", "index_fill_", "masked_fill_"}

MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
              "aten::addbmm", "aten::convolution", "aten::convolution_backward", "aten::_scaled_mm",
              "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
              "aten::_flash_attention_backward", "aten::_efficient_attention_backward", "aten::_int_mm"}


def is_matmul(op: str) -> bool:
    """Ops on the tensor cores: matmuls, convolutions and fused attention (the ends of a fusible chain)."""
    return op in MATMUL_OPS or "scaled_dot_product" in op


def is_comm(op: str) -> bool:
    """torch.distributed's collectives as the dispatcher sees them (c10d::_allgather_base_, the functional
    _c10d_functional::all_gather_into_tensor, ...): communication, not work on this GPU's roofline."""
    return op.startswith(("c10d::", "_c10d_functional::", "c10d_functional::"))


def tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def extent_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel must touch to read or write `t` once: broadcast (stride-0) dims count once."""
    if t.numel() == 0:
        return 0
    try:
        n = 1
        for size, stride in zip(t.shape, t.stride()):
            if stride != 0:
                n *= size
        return n * t.element_size()
    except (RuntimeError, NotImplementedError):  # sparse, nested: no strides
        return t.numel() * t.element_size()


def _identity(t: torch.Tensor) -> tuple:
    try:
        base = t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        base = id(t)
    try:
        stride = tuple(t.stride())
    except (RuntimeError, NotImplementedError):
        stride = ()
    return base, t.storage_offset() if t.layout == torch.strided else 0, tuple(t.shape), stride, t.dtype


def tensor_bytes(ts) -> float:
    """Ideal bytes of a list of tensors, each distinct view counted once."""
    seen, total = set(), 0
    for t in ts:
        key = _identity(t)
        if key not in seen:
            seen.add(key)
            total += extent_bytes(t)
    return float(total)


def attention_flops(q_shape, k_shape, v_shape=None, causal: bool = False, backward: bool = False) -> float:
    """SDPA FLOPs for (b, h, s, d) q, k, v: 2·b·h·sq·sk·(d + dv) forward (QK^T and PV), 2·b·h·sq·sk·(3d + 2dv)
    backward (2.5x when d = dv: the scores recomputed, four more matmuls), as torch.utils.flop_counter counts them;
    halved when causal. GQA/MQA (fewer K/V heads) counts the query heads: every query head does the
    full work against its shared K/V head, which torch's own formula rejects as a shape mismatch."""
    v_shape = v_shape or k_shape
    *lead, sq, d = (int(x) for x in q_shape)
    sk, dv = int(k_shape[-2]), int(v_shape[-1])
    if int(k_shape[-1]) != d or int(v_shape[-2]) != sk:
        raise ValueError(f"attention_flops: q {tuple(q_shape)}, k {tuple(k_shape)}, v {tuple(v_shape)} do not fit")
    bh = 1
    for x in lead:
        bh *= x
    # backward: S = QK^T recomputed, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q
    flops = 2.0 * bh * sq * sk * ((3 * d + 2 * dv) if backward else (d + dv))
    return flops / (2.0 if causal else 1.0)


def arg(func, args, kwargs, name: str):
    """An argument of an aten call by its schema name, positional or keyword."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return kwargs.get(name, args[i] if i < len(args) else a.default_value if a.has_default_value() else None)
    return None


def matmul_dtype(dtype: torch.dtype) -> str:
    """fp32 matmuls run on the tf32 tensor cores when PyTorch allows it."""
    key = dtype_key(dtype)
    if key == "fp32" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return key


def op_cost(func, args, kwargs, out) -> Cost:
    """Cost of one call of the aten op `func` with these arguments and this result."""
    name = func._schema.name
    ins, outs = tensors((args, kwargs)), tensors(out)
    floating = [t for t in ins if t.is_floating_point()] or [t for t in outs if t.is_floating_point()]
    dkey = dtype_key(floating[0].dtype) if floating else "fp32"
    if is_matmul(name) and floating and "attention" not in name and "scaled_dot" not in name:
        dkey = matmul_dtype(floating[0].dtype)

    flops = 0.0
    if func.overloadpacket in flop_registry:
        try:
            flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take these arguments: fall through to the counts below
            flops = 0.0
    q, k, v = (arg(func, args, kwargs, n) for n in ("query", "key", "value"))
    if not flops and "attention" in name and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        try:  # the CPU's flash kernel, and any variant the formulas do not list
            flops = attention_flops(q.shape, k.shape, v.shape, backward="backward" in name)
        except Exception:
            flops = 0.0
    if flops and "attention" in name and arg(func, args, kwargs, "is_causal"):
        flops /= 2.0
    if not flops:
        elems = max([t.numel() for t in ins + outs], default=0)
        flops = PER_ELEMENT_FLOPS.get(name, 1.0) * elems

    # Reads: inputs, less in-place targets that are only written and out= buffers, inputs read for their
    # shape, and of a gathered table only the rows the index picks.
    skipped = set()
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = kwargs.get(a.name, args[i] if i < len(args) and not a.kwarg_only else None)
            base = func._schema.name.split("::")[-1]
            if isinstance(v, torch.Tensor) and (a.kwarg_only or base in _WRITE_ONLY):
                skipped.add(id(v))
    gathered = 0.0
    if name in SHAPE_ONLY:
        skipped.add(id(arg(func, args, kwargs, SHAPE_ONLY[name])))
    elif name in GATHERED:
        table, index = (arg(func, args, kwargs, n) for n in GATHERED[name])
        if isinstance(table, torch.Tensor) and isinstance(index, torch.Tensor) and table.dim():
            row = table.numel() // max(table.shape[0], 1) if name == "aten::embedding" else 1
            if name == "aten::index_select":
                row = table.numel() // max(table.shape[int(arg(func, args, kwargs, "dim"))], 1)
            picked = min(index.numel() * row, table.numel())
            skipped.add(id(table))
            gathered = float(picked * table.element_size())
            flops = float(picked)
    reads = [t for t in ins if id(t) not in skipped]
    return Cost(flops=flops, bytes=tensor_bytes(reads) + gathered + tensor_bytes(outs), dtype=dkey)


# --- kernelkit's own calls, named by the profiler range ops/_dispatch.profiled_call opens around them ---

_RANGE = re.compile(r"^kernelkit::(\w+?)(\.backward)?\((.*)\)$", re.S)
_TENSOR = re.compile(r"^(0d|\d+(?:x\d+)*):(\w+)$")
_FIELD = re.compile(r"^([A-Za-z_]\w*)=(.*)$", re.S)


def _split_fields(text: str) -> list[str]:
    """Split "a=1, b=(2, 3), c='x, y'" at the top-level commas."""
    out, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument of a kernelkit range: its shape and dtype, no values."""

    shape: tuple
    dtype: str

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=getattr(torch, self.dtype), device="meta")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * getattr(torch, self.dtype).itemsize


def _value(text: str):
    m = _TENSOR.match(text)
    if m and hasattr(torch, m.group(2)):
        return TensorSpec(() if m.group(1) == "0d" else tuple(int(d) for d in m.group(1).split("x")), m.group(2))
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # "<TypeName>": an argument the range could not spell


@dataclass(frozen=True)
class KernelkitCall:
    """One kernelkit call as a profiler range names it: the registry op, forward or backward, arguments."""

    op: str
    backward: bool
    args: tuple
    kwargs: dict

    @property
    def tensors(self) -> list[TensorSpec]:
        return [v for v in (*self.args, *self.kwargs.values()) if isinstance(v, TensorSpec)]


def parse_range(name: str) -> KernelkitCall | None:
    """`kernelkit::rms_norm(x=8192x4096:bfloat16, eps=1e-05)` (or `.backward(...)`) -> KernelkitCall; None
    for any other name. The format is written by ops/_dispatch.profiled_call."""
    m = _RANGE.match(name)
    if m is None:
        return None
    args, kwargs = [], {}
    for field in _split_fields(m.group(3)):
        kw = _FIELD.match(field)
        if kw:
            kwargs[kw.group(1)] = _value(kw.group(2))
        else:
            args.append(_value(field))
    return KernelkitCall(m.group(1), bool(m.group(2)), tuple(args), kwargs)


def kernelkit_cost(call: KernelkitCall) -> tuple[Cost, str]:
    """The registry's cost model for the call, with meta tensors of its shapes; (cost, "registry"). If the op
    is not registered or its cost model does not take these arguments: every tensor argument read once and
    the largest written once, one FLOP per element; (cost, "generic")."""
    ts = call.tensors
    floating = [t for t in ts if getattr(torch, t.dtype).is_floating_point]
    dkey = dtype_key(getattr(torch, floating[0].dtype)) if floating else "fp32"
    try:
        spec = registry.all_ops().get(call.op)
        if spec is not None:
            conv = [v.meta() if isinstance(v, TensorSpec) else v for v in call.args]
            kw = {k: v.meta() if isinstance(v, TensorSpec) else v for k, v in call.kwargs.items()}
            c = spec.cost(*conv, **kw, backward=call.backward)
            return Cost(float(c.flops), float(c.bytes), c.dtype), "registry"
    except Exception:  # a cost model that needs values (cu_seqlens.tolist()) or other arguments
        pass
    largest = max((t.nbytes for t in ts), default=0)
    elems = max((t.numel for t in ts), default=0)
    reads = sum(t.nbytes for t in ts) + (largest if call.backward else 0)  # backward: the output's gradient too
    return Cost(float(elems), float(reads + largest), dkey), "generic"
