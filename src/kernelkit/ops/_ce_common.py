"""What the cross-entropy losses (ops/cross_entropy.py and the fused LM-head loss, ops/linear_cross_entropy.py)
share around the kernels: the target dtypes, and the class weights as the kernels read them."""

from __future__ import annotations

import torch

TARGET_DTYPES = (torch.int64, torch.int32)


def class_weight_buffer(weight, v):
    """The class weights as the kernels read them: V fp32 values, then their sum (torch's smoothing
    term needs it). A tiny copy, so any float dtype and layout of `weight` is taken."""
    if weight is None:
        return None
    w = weight.detach().to(torch.float32)
    return torch.cat([w, w.sum().reshape(1)])


def mean_divisor(t, wbuf, v, ignore_index):
    """What 'mean' divides by: the non-ignored tokens, or (with class weights, as torch) their weights' sum."""
    valid = t != ignore_index
    if wbuf is None:
        return valid.sum()
    return torch.where(valid, wbuf[torch.where(valid & (t >= 0) & (t < v), t, 0)], 0.0).sum()


def weight_launch_args(flags, wbuf):
    """The class-weight arguments of a cross-entropy kernel launch, HAS_WEIGHT set in `flags`. Only when
    weighted, so that an unweighted launch keeps the cache key that both losses share and the lean launch
    path (a tensor passed by keyword takes Triton's own launch path)."""
    if wbuf is None:
        return {}
    flags["HAS_WEIGHT"] = True
    return {"WEIGHT": wbuf}
