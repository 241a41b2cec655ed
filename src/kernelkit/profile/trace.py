"""Collect one record per aten op call of a model step: shapes, dtypes, module path, FLOPs, ideal bytes,
and (on a GPU) the kernel time it caused.

Two collectors feed the same `OpRecord` list, so the analysis never knows which one ran:
- `measure` (GPU): torch.profiler over several steps; each aten op's kernels are found through the
  profiler's event tree, module paths through `record_function` ranges pushed by module hooks.
- `predict` (any machine): a TorchDispatchMode that sees every aten op of one step with real shapes
  and no timing; the roofline floor from a datasheet stands in for measured time.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .costs import op_cost

# Ops that move no bytes of their own (views, metadata) and never launch a kernel.
_FREE = {"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::expand", "aten::t", "aten::transpose",
         "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::as_strided",
         "aten::detach", "aten::alias", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind",
         "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::lift_fresh", "aten::_to_copy_noop",
         "aten::sym_size", "aten::sym_stride", "aten::is_same_size", "aten::result_type"}


@dataclass
class OpRecord:
    op: str  # aten op name, "aten::mm"
    module: str  # nn.Module path it ran under ("" at top level, "<backward>" in the backward)
    shapes: tuple  # input tensor shapes
    dtypes: tuple  # input tensor dtypes, as strings
    flops: float
    bytes: float
    dtype_key: str  # which matrix peak bounds it
    step: int = 0
    ms: float | None = None  # GPU kernel time caused by this call; None when predicted
    # Tensor identities (storage, offset, shape) and sizes, for finding a chain's true inputs/outputs.
    in_keys: tuple = ()
    in_sizes: tuple = ()
    out_keys: tuple = ()
    out_sizes: tuple = ()


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _ModulePaths:
    """Module hooks that keep the current nn.Module path, optionally as profiler ranges."""

    def __init__(self, model: torch.nn.Module, ranges: bool):
        self.stack: list[str] = []
        self.handles = []
        self.ranges = ranges
        self._open: list = []
        for name, mod in model.named_modules():
            # "layers.0.input_layernorm:LlamaRMSNorm": the path for people, the class for the registry
            self.handles.append(mod.register_forward_pre_hook(self._pre(f"{name or '<model>'}:{type(mod).__name__}")))
            self.handles.append(mod.register_forward_hook(self._post()))

    def _pre(self, name):
        def hook(mod, args):
            self.stack.append(name)
            if self.ranges:
                rf = torch.profiler.record_function(f"kkmodule::{name}")
                rf.__enter__()
                self._open.append(rf)
        return hook

    def _post(self):
        def hook(mod, args, out):
            if self.stack:
                self.stack.pop()
            if self.ranges and self._open:
                self._open.pop().__exit__(None, None, None)
        return hook

    @property
    def path(self) -> str:
        return self.stack[-1] if self.stack else ""

    def remove(self):
        for h in self.handles:
            h.remove()


class _Recorder(TorchDispatchMode):
    """Sees every op below autograd. With `ranges`, wraps each in a profiler range `kkop::<index>`, so
    the kernels it launches are attributed to exactly this record, however the op decomposes."""

    def __init__(self, paths: _ModulePaths, step: int, sink: list, in_backward: Callable[[], bool],
                 ranges: bool = False):
        super().__init__()
        self.paths, self.step, self.sink, self.in_backward, self.ranges = paths, step, sink, in_backward, ranges

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _FREE:
            return func(*args, **kwargs)
        if self.ranges:
            with torch.profiler.record_function(f"kkop::{len(self.sink)}"):
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        cost = op_cost(func, args, kwargs, out)
        self.sink.append(OpRecord(
            op=name, module="<backward>" if self.in_backward() else self.paths.path,
            shapes=tuple(tuple(t.shape) for t in ins), dtypes=tuple(str(t.dtype).replace("torch.", "") for t in ins),
            flops=cost.flops, bytes=cost.bytes, dtype_key=cost.dtype, step=self.step,
            in_keys=tuple(_key(t) for t in ins), in_sizes=tuple(_size(t) for t in ins),
            out_keys=tuple(_key(t) for t in outs), out_sizes=tuple(_size(t) for t in outs)))
        return out


class _TensorIds:
    """Serial numbers for tensor objects. Addresses are no identity: a freed tensor's storage address
    is reused by the next allocation (the caching allocator, and meta storages alike)."""

    def __init__(self):
        self.refs: dict[int, tuple[int, weakref.ref]] = {}
        self.next = 0

    def __call__(self, t: torch.Tensor) -> int:
        hit = self.refs.get(id(t))
        if hit is not None and hit[1]() is t:
            return hit[0]
        self.next += 1
        self.refs[id(t)] = (self.next, weakref.ref(t))
        return self.next


_ids = _TensorIds()


def _key(t: torch.Tensor) -> int:
    return _ids(t)


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _run_step(model, inputs, backward: bool):
    out = model(*inputs)
    loss = out if isinstance(out, torch.Tensor) else out[0]
    if backward:
        if loss.dim() != 0:
            loss = loss.float().sum()
        loss.backward()
    return loss


def predict(model: torch.nn.Module, inputs: tuple, backward: bool = True) -> list[OpRecord]:
    """One step under a dispatch mode: every aten op with shapes, FLOPs and bytes, no timing."""
    records: list[OpRecord] = []
    paths = _ModulePaths(model, ranges=False)
    phase = {"bwd": False}
    try:
        with _Recorder(paths, 0, records, lambda: phase["bwd"]):
            out = model(*inputs)
            loss = out if isinstance(out, torch.Tensor) else out[0]
            if backward:
                phase["bwd"] = True
                (loss if loss.dim() == 0 else loss.float().sum()).backward()
    finally:
        paths.remove()
    return records


def measure(model: torch.nn.Module, inputs: tuple, steps: int = 3, warmup: int = 1, backward: bool = True
            ) -> tuple[list[OpRecord], list[tuple[float, float]], float]:
    """Profile `steps` steps on the GPU.

    Returns (records with kernel ms, every kernel's (start_us, end_us), GPU time per step in ms from
    the first kernel's start to the last one's end). Shapes, FLOPs and bytes come from the dispatch
    mode running in the same steps; kernel times from torch.profiler, matched to those calls in
    order per (step, op name).
    """
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        _run_step(model, inputs, backward)
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    records: list[OpRecord] = []
    paths = _ModulePaths(model, ranges=False)
    phase = {"bwd": False}
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for s in range(steps):
                with torch.profiler.record_function(f"kkstep::{s}"):
                    phase["bwd"] = False
                    with _Recorder(paths, s, records, lambda: phase["bwd"], ranges=True):
                        out = model(*inputs)
                        loss = out if isinstance(out, torch.Tensor) else out[0]
                        if backward:
                            phase["bwd"] = True
                            (loss if loss.dim() == 0 else loss.float().sum()).backward()
                    model.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
    finally:
        paths.remove()
    spans = _attach_kernel_times(prof.events(), records)
    step_ms = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3 / steps if spans else 0.0
    return records, spans, step_ms


def _attach_kernel_times(events, records: list[OpRecord]) -> list[tuple[float, float]]:
    """Give each record the device time of the kernels under its `kkop::<index>` range; return every
    device kernel's (start, end) in us."""
    spans = []
    for evt in events:
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((evt.time_range.start, evt.time_range.end))
        elif evt.name.startswith("kkop::"):
            i = int(evt.name.split("::")[1])
            if i < len(records):
                records[i].ms = evt.device_time_total / 1e3
    for r in records:
        r.ms = r.ms or 0.0
    return sorted(spans)
