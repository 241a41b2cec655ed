"""Input validation shared by every launcher: one clear error that names the argument and the fix."""

from __future__ import annotations

import torch

from ..tune import interpreting

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _name(dt) -> str:
    return str(dt).replace("torch.", "")


def tensor(x, name: str, dtypes=FLOAT_DTYPES, min_dim: int = 0) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {_name(x.dtype)}; supported: {', '.join(map(_name, dtypes))}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(x.shape)}")
    if not x.is_cuda and not interpreting():
        raise ValueError(f"{name} is on {x.device}, but kernelkit's Triton kernels need a CUDA tensor "
                         f"(move it with .cuda(), or set TRITON_INTERPRET=1 to run them slowly on the CPU)")
    return x


def wants_grad(*tensors) -> bool:
    """Whether a call must record an autograd node: grad mode is on and an input requires grad.
    Otherwise the public functions call their launcher directly, skipping `autograd.Function.apply`
    (microseconds of host time a call, which small inference-time ops feel)."""
    if torch.is_grad_enabled():
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return True
    return False


def same_device(x: torch.Tensor, name: str, other: torch.Tensor, other_name: str) -> None:
    if x.device != other.device:
        raise ValueError(f"{name} is on {x.device} but {other_name} is on {other.device}; put both on one device")


def rows_2d(x: torch.Tensor, n: int) -> torch.Tensor:
    """View x as (rows, n) with a unit stride along n, copying only when it must."""
    x2 = x.reshape(-1, n)
    if n > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2
