"""What launching a Gluon kernel needs on the host, made once: the shared-memory layouts of TMA boxes.

`gl.NVMMASharedLayout.get_default_for` takes 10-20 us of host time a call; a kernel call that built its
descriptors' layouts afresh paid that three to six times (the attention forward: 161 us of host time a call on the
H100's host against the Triton kernel's 51).
"""
from __future__ import annotations

import torch
from triton.experimental.gluon import language as gl

GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5, torch.bfloat16: gl.bfloat16,
             torch.float16: gl.float16, torch.float32: gl.float32}
_LAYOUTS: dict = {}


def smem_layout(block: tuple, dtype: torch.dtype):
    """The default NVMMA shared layout of a (block) box of `dtype` elements, made once per (box, dtype)."""
    got = _LAYOUTS.get((block, dtype))
    if got is None:
        got = _LAYOUTS[(block, dtype)] = gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])
    return got
