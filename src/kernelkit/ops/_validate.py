"""Input validation shared by every launcher: one clear error that names the argument and the fix."""

from __future__ import annotations

import math
import sys

import torch

from ..runtime import capturing, interpreting

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _name(dt) -> str:
    return str(dt).replace("torch.", "")


def is_dtensor(x) -> bool:
    """Whether x is a torch.distributed DTensor. Free when torch.distributed.tensor was never imported (then no
    DTensor exists), one isinstance otherwise."""
    dt = sys.modules.get("torch.distributed.tensor")
    return dt is not None and isinstance(x, dt.DTensor)


def not_dtensor(x, name: str) -> None:
    """Refuse a torch.distributed DTensor: a Triton kernel reads its local shard's storage as if it were the whole
    tensor, which would be a silently wrong result."""
    if is_dtensor(x):
        raise TypeError(f"{name} is a DTensor (placements {tuple(x.placements)}); kernelkit's kernels take plain "
                        f"tensors: run the op on its local shards ({name}.to_local(), when the op is local along "
                        f"the sharded dim) or use a parallel plan that gives the op replicated/local inputs "
                        f"(use_local_output=True, no SequenceParallel on the modules kernelkit replaced)")


def tensor(x, name: str, dtypes=FLOAT_DTYPES, min_dim: int = 0) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter:  # the common cases skip the lookup
        not_dtensor(x, name)
    if x.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {_name(x.dtype)}; supported: {', '.join(map(_name, dtypes))}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s), got shape {tuple(x.shape)}")
    if not x.is_cuda and not x.is_meta and not interpreting():  # meta: shapes only, routed to the fake impl
        raise ValueError(f"{name} is on {x.device}, but kernelkit's Triton kernels need a CUDA tensor "
                         f"(move it with .cuda(), or set TRITON_INTERPRET=1 to run them slowly on the CPU)")
    return x


def number(v, name: str, *, low: float | None = None, finite: bool = True, allow_bool: bool = False) -> float:
    """A Python (or 0-dim tensor) real number as float, with an error naming the argument otherwise. Reading a CUDA
    tensor's value synchronizes with the host, which CUDA graph capture forbids: there it raises RuntimeError
    (pass a Python number)."""
    if type(v) is float and math.isfinite(v) and (low is None or v >= low):  # the common case, first
        return v
    if isinstance(v, bool) and not allow_bool or not isinstance(v, (int, float)):
        if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_complex() and not v.is_meta:
            if v.is_cuda and capturing():
                raise RuntimeError(f"{name} is a CUDA tensor, whose value cannot be read inside a CUDA graph capture "
                                   f"(it synchronizes with the host): pass a Python number")
            v = v.item()
        else:
            raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    v = float(v)
    if finite and not math.isfinite(v) or low is not None and not v >= low:
        raise ValueError(f"{name} must be a finite number{f' >= {low:g}' if low is not None else ''}, got {v!r}")
    return v


def same_device(x: torch.Tensor, name: str, other: torch.Tensor, other_name: str) -> None:
    if x.device != other.device:
        raise ValueError(f"{name} is on {x.device} but {other_name} is on {other.device}; put both on one device")


# --- layouts: what a kernel argument must look like, copying only where the kernel cannot take it ---
# Counts the layout copies made, so tests can prove that a layout a kernel takes natively (a row-padded
# activation, say) reached the kernel as it is instead of being copied first.
copies = 0


def _copied(x: torch.Tensor) -> torch.Tensor:
    global copies
    copies += 1
    return x.contiguous()


def rows_2d(x: torch.Tensor, n: int) -> torch.Tensor:
    """x as (rows, n) with a unit stride along n and any row stride (kernels take the row stride):
    a row-padded, row-sliced or row-broadcast (stride 0) activation is passed as it is; a copy is made
    only when the rows cannot be one strided dimension or n is not the innermost."""
    if x.dim() == 2:
        x2 = x
    else:
        try:
            x2 = x.view(-1, n)
        except RuntimeError:  # leading dims that no single stride can walk (x[:, ::2] of a 3-D x, say)
            x2 = _copied(x).reshape(-1, n)
    if n > 1 and x2.stride(-1) != 1:
        x2 = _copied(x2)
    return x2


def vector(w: torch.Tensor, name: str, n: int) -> torch.Tensor:
    """A (n,) parameter with unit stride, as kernels index it: a stepped slice, a column of a 2-D
    parameter or an expanded (stride-0) vector is copied; an offset view is taken as it is."""
    if w.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) to match x's last dim, got {tuple(w.shape)}")
    if n > 1 and w.stride(0) != 1:
        return _copied(w)
    return w


def unit_last(x: torch.Tensor) -> torch.Tensor:
    """x with a unit stride along its last dim (other strides as they are), copying only when it must."""
    if x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
        return _copied(x)
    return x


def dense(x: torch.Tensor) -> torch.Tensor:
    """A small index, offset or scale tensor that a kernel reads by element index, without strides (cu_seqlens,
    say): x itself when contiguous (an offset view included: the kernel's pointer starts at its first element),
    else a contiguous copy, so that the kernel reads the values the launcher validated, not the raw storage."""
    return x if x.is_contiguous() else _copied(x)


LOSS_REDUCTIONS = ("mean", "sum", "none")


def loss_options(ignore_index, label_smoothing, z_loss, softcap, reduction):
    """The cross-entropy losses' options, validated and normalized: (int, float, float, float | None, str)."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not (number(label_smoothing) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if not (number(z_loss) and math.isfinite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    if softcap is not None and not (number(softcap) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, LOSS_REDUCTIONS))}, got {reduction!r}")
    return ignore_index, float(label_smoothing), float(z_loss), (None if softcap is None else float(softcap)), reduction


def target_values(target: torch.Tensor, v: int, ignore_index: int) -> None:
    """The cross-entropy losses' class indices: in [0, V) or ignore_index. Checked only where it is free (CPU
    tensors): on the GPU it would cost a device sync per call, so there an out-of-range index gives its token a
    NaN loss (and gradient) instead."""
    if target.device.type == "cpu" and target.numel():
        bad = (target != ignore_index) & ((target < 0) | (target >= v))
        if bool(bad.any()):
            raise ValueError(f"target holds class index {int(target[bad][0])} outside [0, {v}) "
                             f"(and not ignore_index={ignore_index})")
