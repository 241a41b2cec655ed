"""FLOPs and ideal bytes of one aten op call, from its real arguments.

FLOPs come from torch.utils.flop_counter's formulas where it has one (matmuls, convolutions, SDPA);
everything else is counted as one operation per output element (no matrix work). Ideal bytes: every input tensor
read once and every output written once (views of the same storage counted once).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ..roofline.model import Cost, dtype_key


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def tensor_bytes(tensors) -> float:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return float(total)


def attention_flops(q_shape, k_shape, causal: bool) -> float:
    """4·b·h·sq·sk·d for (b, h, s, d) q and k; halved when causal."""
    *bh, sq, d = q_shape
    sk = k_shape[-2]
    b_h = 1
    for x in bh:
        b_h *= x
    return 4.0 * b_h * sq * sk * d / (2.0 if causal else 1.0)


def _arg(func, args, kwargs, name: str):
    """An argument by schema name, positional or keyword."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return kwargs.get(name, args[i] if i < len(args) else None)
    return None


def op_cost(func, args, kwargs, out) -> Cost:
    ins = _tensors((args, kwargs))
    outs = _tensors(out)
    floating = [t for t in ins if t.is_floating_point()]
    dkey = dtype_key(floating[0].dtype) if floating else "fp32"
    flops = 0.0
    packet = func.overloadpacket
    name = func._schema.name
    if packet in flop_registry:
        try:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take these arguments: count bytes only
            flops = 0.0
    elif "scaled_dot_product" in name and len(ins) >= 2:
        flops = attention_flops(ins[0].shape, ins[1].shape, False)
    if "scaled_dot_product" in name and _arg(func, args, kwargs, "is_causal"):
        flops /= 2.0  # torch's formula counts the full square; causal attention computes half of it
    if flops == 0.0:  # elementwise / reductions: about one operation per output element
        flops = float(sum(o.numel() for o in outs))
    # In-place ops write an input: count that tensor once.
    written = [o for o in outs if not any(o is i for i in ins)]
    return Cost(flops=flops, bytes=tensor_bytes(ins) + tensor_bytes(written), dtype=dkey)


MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
              "aten::convolution", "aten::_scaled_mm", "aten::_scaled_dot_product_flash_attention",
              "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
              "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_flash_attention_forward",
              "aten::_efficient_attention_forward"}


def is_matmul(op: str) -> bool:
    return op in MATMUL_OPS or "scaled_dot_product" in op or "attention_backward" in op or op.endswith("mm")
