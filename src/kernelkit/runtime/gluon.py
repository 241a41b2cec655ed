"""What launching a Gluon kernel needs on the host, made once: the shared-memory layouts of TMA boxes; host TMA
descriptors without the constructor's re-validation (`descriptor`). And `tma_reduce_add`, the TMA reduce that Gluon's
builder has on Triton 3.6 but its language does not export.

`gl.NVMMASharedLayout.get_default_for` takes 10-20 us of host time a call; a kernel call that built its
descriptors' layouts afresh paid that three to six times (the attention forward: 161 us of host time a call on the
H100's host against the Triton kernel's 51).
"""
from __future__ import annotations

import torch
from triton._C.libtriton import ir
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5, torch.bfloat16: gl.bfloat16,
             torch.float16: gl.float16, torch.float32: gl.float32}
_LAYOUTS: dict = {}


def smem_layout(block: tuple, dtype: torch.dtype):
    """The default NVMMA shared layout of a (block) box of `dtype` elements, made once per (box, dtype)."""
    got = _LAYOUTS.get((block, dtype))
    if got is None:
        got = _LAYOUTS[(block, dtype)] = gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])
    return got


def descriptor(base: torch.Tensor, shape: list, strides: list, block: list, layout) -> TensorDescriptor:
    """Gluon's host TensorDescriptor without its __post_init__ checks (half of its 3-4 us of host time; an attention
    forward + backward builds 13). The caller must have checked what they cover: a 16-byte aligned base and strides,
    a unit last stride, positive sizes, a power-of-two box (`ops.attention.hopper._tma_ok`, or buffers it allocated).
    The fields are the constructor's, so Triton's launcher reads it the same way."""
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block, layout=layout, padding="zero")
    return d


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[tensor_desc box at coord] += src (a shared tile of the box's shape and layout), by the TMA unit
    (`cp.reduce.async.bulk.tensor ... .add`, sm_90), asynchronous like `tma.async_copy_shared_to_global`: wait with
    `tma.store_wait` before src is written again. fp32 add is done in L2, one reduce per box instead of one atomic
    per element from registers."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)
