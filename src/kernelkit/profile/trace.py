"""Collect one neutral record per aten op call of a model step: op, module path, phase, shapes, dtypes,
FLOPs, ideal bytes, tensor identities and (on a GPU) the kernel intervals it caused.

Two collectors feed the same `Trace`, so the analysis never knows which one ran:
- `measure` (GPU): a TorchDispatchMode sees every op below autograd with its real arguments and wraps
  each call in a profiler range `kkop::<index>`; the kernels launched inside a range are that call's
  (kineto.py). A second, uninstrumented run of the same steps gives the timeline the launch-gap
  overhead is read from, since the dispatch mode's own CPU time would widen the gaps.
- `predict` (any machine): the same dispatch mode over one step on the CPU or the meta device, no
  timing; attention is recorded as one fused (flash) call, as it runs on a GPU.

kernelkit's own ops launch their Triton kernels outside the dispatcher, so no aten op holds them. While a
profiler records, each public kernelkit call runs in a range `kernelkit::<op>(<argument shapes>)` (and its
backward in `kernelkit::<op>.backward(...)`, ops/_dispatch.profiled_call); the dispatch mode sees the range
open (`profiler::_record_function_enter_new` is an op too), records the call with the registry's cost model
at those shapes, and nests a `kkop::<index>` range in it: every kernel inside, the op's own copies and
fills included, is that call's.
"""

from __future__ import annotations

import json
import os
import tempfile
import weakref
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import kineto
from ..hw.sustain import sustain
from .costs import attention_flops, extent_bytes, kernelkit_cost, op_cost, parse_range, tensors
from ..ops import registry
from ..patch.loss import observer
from ..roofline.model import Cost, dtype_key

TRACE_FORMAT = "kernelkit-trace/1"

# No kernel and no bytes of their own: factories of uninitialized memory and metadata queries.
# (Views are recognized from the schema: their output aliases an input; these two share storage too.)
_VIEWLIKE = {"aten::_unsafe_view", "aten::_reshape_alias"}
_FREE = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
         "aten::lift_fresh", "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::is_same_size",
         "aten::result_type", "aten::_has_compatible_shallow_copy_type", "aten::is_nonzero", "aten::size",
         "aten::stride", "aten::dim", "aten::resolve_conj", "aten::resolve_neg"}


@dataclass
class OpRecord:
    """One op call. `kernels` are (start_us, end_us) on the GPU clock; None when predicted."""

    op: str  # "aten::mm"
    module: str  # "layers.0.mlp.down_proj:Linear"; "" outside every module
    phase: str  # "fwd" or "bwd"
    step: int
    shapes: tuple  # input tensor shapes
    dtypes: tuple  # input tensor dtypes, "bfloat16"
    flops: float
    bytes: float
    dtype_key: str  # which matrix peak bounds it
    kernels: list | None = None
    # Tensor identities (serial numbers, views resolved to their base) and sizes in bytes: what the
    # fused-chain floor needs to find tensors produced and consumed inside a chain.
    in_keys: tuple = ()
    in_sizes: tuple = ()
    out_keys: tuple = ()
    out_sizes: tuple = ()

    @property
    def ms(self) -> float | None:
        return None if self.kernels is None else sum(e - s for s, e in self.kernels) / 1e3

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "OpRecord":
        d = dict(d)
        d["shapes"] = tuple(tuple(s) for s in d.get("shapes", ()))
        for k in ("dtypes", "in_keys", "in_sizes", "out_keys", "out_sizes"):
            d[k] = tuple(d.get(k, ()))
        d.setdefault("phase", "fwd")
        d.setdefault("step", 0)
        return cls(**d)


@dataclass
class Trace:
    """What a collector hands the analysis; JSON round-trips, so a saved trace can be analyzed again."""

    records: list[OpRecord]
    steps: int
    measured: bool
    # Per step, from the uninstrumented run: wall_us (step start to last kernel end), kernels [(s, e)] and comm,
    # the NCCL kernels among them with their collective and bytes (comms.comm_record).
    timeline: list[dict] = field(default_factory=list)
    device_us: float | None = None  # all kernel time in the instrumented steps, attributed or not
    unattributed: dict = field(default_factory=dict)  # "innermost op / kernel" -> us over all steps
    backward: bool = True
    notes: list[str] = field(default_factory=list)
    # kernelkit's implementation timed on this GPU at the trace's shapes (profile.projection.time_kernelkit):
    # "op:shape:dtype" -> {"fwd": ms, "bwd": ms} or {"error": why}
    kernel_times: dict = field(default_factory=dict)
    # what kernelkit.patch(model) would replace in this model (profile.projection.patch_coverage)
    patch: dict = field(default_factory=dict)
    # Under torch.distributed: rank, world_size, backend, fsdp, and link (doctor's sweep of this many GPUs, or None)
    distributed: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": TRACE_FORMAT, "distributed": self.distributed, "steps": self.steps, "measured": self.measured, "backward": self.backward,
                "device_us": self.device_us, "unattributed": self.unattributed, "timeline": self.timeline,
                "notes": self.notes, "kernel_times": self.kernel_times, "patch": self.patch,
                "records": [r.to_json() for r in self.records]}

    @classmethod
    def from_json(cls, d: dict) -> "Trace":
        if d.get("format") != TRACE_FORMAT:
            raise ValueError(f"not a kernelkit trace (format {d.get('format')!r}, expected {TRACE_FORMAT!r})")
        return cls(records=[OpRecord.from_json(r) for r in d["records"]], steps=int(d["steps"]),
                   measured=bool(d["measured"]), timeline=d.get("timeline") or [], device_us=d.get("device_us"),
                   unattributed=d.get("unattributed") or {}, backward=d.get("backward", True),
                   notes=d.get("notes") or [], kernel_times=d.get("kernel_times") or {}, patch=d.get("patch") or {},
                   distributed=d.get("distributed") or {})

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json()))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_json(json.loads(Path(path).read_text()))


class _TensorIds:
    """Serial numbers for tensors. Addresses are no identity: a freed tensor's storage address is reused
    by the next allocation (the caching allocator and meta storages alike). A view gets its base's id."""

    def __init__(self):
        self.refs: dict[int, tuple[int, weakref.ref]] = {}
        self.alias: dict[int, int] = {}
        self.next = 0

    def __call__(self, t: torch.Tensor) -> int:
        hit = self.refs.get(id(t))
        if hit is not None and hit[1]() is t:
            return self.alias.get(hit[0], hit[0])
        self.next += 1
        self.refs[id(t)] = (self.next, weakref.ref(t))
        return self.next

    def view_of(self, view: torch.Tensor, base: torch.Tensor) -> None:
        root = self(base)
        self(view)
        self.alias[self.refs[id(view)][0]] = root


_ONE_NODE = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)


def _path(label: str) -> str:
    return label.rsplit(":", 1)[0] if label else ""


def _inside(label: str, outer: str) -> bool:
    """Is module `label` inside module `outer` (the root "<model>" holds every module)?"""
    p, o = _path(label), _path(outer)
    return o == "<model>" or p.startswith(o + ".")


class _ModuleTracker:
    """The nn.Module an op runs under, forward and backward.

    Forward: a stack pushed and popped by module hooks. Backward: a module is entered when the
    gradients of its outputs are ready and left when those of its inputs are (multi-grad hooks), or,
    for a Linear or convolution, once its parameters' gradients are accumulated: one autograd node
    computes all its gradients, while its input's gradient may wait for other consumers. An op
    belongs to the most recently entered module not yet left; modules entered together (an output
    shared by a module and its last submodule) stack innermost on top.
    """

    def __init__(self, model):
        self.fwd: list[str] = []
        self.bwd: list[str] = []
        self.started = False
        self.handles, self.grad_hooks = [], []
        self.root = f"<model>:{type(model).__name__}" if isinstance(model, torch.nn.Module) else ""
        self.pending: dict[str, set] = {}
        self.waiting: dict[str, set] = {}
        if not isinstance(model, torch.nn.Module):
            return
        for name, mod in model.named_modules():
            label = f"{name or '<model>'}:{type(mod).__name__}"
            # Marked as observers: a patched model's fused loss still skips the lm_head they watch.
            self.handles.append(mod.register_forward_pre_hook(observer(partial(self._pre, label)), with_kwargs=True))
            self.handles.append(mod.register_forward_hook(observer(partial(self._post, label)), with_kwargs=True))
            params = [p for p in mod.parameters(recurse=False) if p.requires_grad]
            if params and isinstance(mod, _ONE_NODE):
                self.waiting[label] = {id(p) for p in params}
                for p in params:
                    self.handles.append(p.register_post_accumulate_grad_hook(partial(self._accumulated, label)))

    def _pre(self, label, mod, args, kwargs):
        self.fwd.append(label)
        ts = [t for t in tensors((args, kwargs)) if t.requires_grad]
        if ts and torch.is_grad_enabled():
            self.grad_hooks.append(torch.autograd.graph.register_multi_grad_hook(ts, partial(self._leave, label)))

    def _post(self, label, mod, args, kwargs, out):
        if label in self.fwd:
            del self.fwd[len(self.fwd) - 1 - self.fwd[::-1].index(label)]
        ts = [t for t in tensors(out) if t.requires_grad]
        if ts and torch.is_grad_enabled():
            self.grad_hooks.append(torch.autograd.graph.register_multi_grad_hook(ts, partial(self._enter, label)))

    def _enter(self, label, grads=None):
        i = len(self.bwd)
        while i > 0 and _inside(self.bwd[i - 1], label) and self.bwd[i - 1] != label:
            i -= 1
        self.bwd.insert(i, label)
        if label in self.waiting:
            self.pending[label] = set(self.waiting[label])

    def _leave(self, label, grads=None):
        if label in self.bwd:
            del self.bwd[len(self.bwd) - 1 - self.bwd[::-1].index(label)]

    def _accumulated(self, label, param):
        left = self.pending.get(label)
        if left is not None:
            left.discard(id(param))
            if not left:
                del self.pending[label]
                self._leave(label)

    def begin_backward(self):
        """The backward of the step starts: until a module enters, its ops are the whole model's."""
        self.started = True
        self.bwd = [self.root] if self.root else []

    def in_backward(self) -> bool:
        return self.started or torch._C._current_graph_task_id() != -1

    @property
    def path(self) -> str:
        stack = self.bwd if self.in_backward() else self.fwd
        return stack[-1] if stack else ""

    def end_step(self):
        for h in self.grad_hooks:
            h.remove()
        self.grad_hooks.clear()
        self.fwd.clear()
        self.bwd.clear()
        self.pending.clear()
        self.started = False

    def remove(self):
        self.end_step()
        for h in self.handles:
            h.remove()


class _Recorder(TorchDispatchMode):
    """Sees every op below autograd. With `ranges`, wraps each call in a profiler range `kkop::<index>`,
    so the kernels it launches are charged to exactly this record however the op decomposes."""

    def __init__(self, tracker: _ModuleTracker, step: int, sink: list, ids: _TensorIds, ranges: bool = False):
        super().__init__()
        self.tracker, self.step, self.sink, self.ids, self.ranges = tracker, step, sink, ids, ranges
        self.muted = 0
        # Per open kernelkit range: [the kkop range nested in it, ranges opened inside it and not yet closed].
        # Ranges nest, and an exit gets a fresh Python handle: the exit at depth 0 is the kernelkit range's.
        self.open: list[list] = []
        self.charged: set = set()  # forward records that took their backward's cost (_charge_forward)

    def make(self, name: str, ins, outs, cost: Cost) -> OpRecord:
        return OpRecord(
            op=name, module=self.tracker.path, phase="bwd" if self.tracker.in_backward() else "fwd", step=self.step,
            shapes=tuple(tuple(t.shape) for t in ins), dtypes=tuple(str(t.dtype).replace("torch.", "") for t in ins),
            flops=cost.flops, bytes=cost.bytes, dtype_key=cost.dtype,
            in_keys=tuple(self.ids(t) for t in ins), in_sizes=tuple(extent_bytes(t) for t in ins),
            out_keys=tuple(self.ids(t) for t in outs), out_sizes=tuple(extent_bytes(t) for t in outs))

    def record(self, name: str, ins, outs, cost: Cost) -> None:
        self.sink.append(self.make(name, ins, outs, cost))

    def kernelkit_call(self, label: str, func, args, kwargs):
        """A `kernelkit::` range opens: record the call and nest a `kkop::<index>` range in the kernelkit one.
        Until it closes, the op's own aten calls (allocations, copies, the fill of a partial sum) are muted:
        their kernels run inside the range and are the kernelkit call's."""
        call = parse_range(label)
        handle = func(*args, **kwargs)
        if call is None:
            return handle
        cost, _ = kernelkit_cost(call)
        ts = call.tensors
        if call.backward:
            cost = self._charge_forward(call, cost, tuple(t.shape for t in ts))
        index = len(self.sink)
        self.sink.append(OpRecord(
            op=f"kernelkit::{call.op}", module=self.tracker.path,
            phase="bwd" if call.backward or self.tracker.in_backward() else "fwd", step=self.step,
            shapes=tuple(t.shape for t in ts), dtypes=tuple(t.dtype for t in ts), flops=cost.flops, bytes=cost.bytes,
            dtype_key=cost.dtype, in_sizes=tuple(t.nbytes for t in ts)))
        self.open.append([torch.ops.profiler._record_function_enter_new(f"kkop::{index}", None), 0])
        self.muted += 1
        return handle

    def _charge_forward(self, call, cost: Cost, shapes: tuple) -> Cost:
        """For an op whose forward computes the gradients (OpSpec.grads_in_forward): the backward's cost goes to
        the latest forward record of the same op and shapes (where its GEMMs ran), and the backward keeps none.
        Otherwise the profile put a fused LM head's forward at a third of its work (29% of roof at Llama-3-8B
        shapes, "has room left") and its backward, a scale, at thousands of percent."""
        spec = registry.all_ops().get(call.op)
        pred = getattr(spec, "grads_in_forward", None)
        try:
            if pred is None or not pred(*call.args, **call.kwargs):
                return cost
        except TypeError:
            return cost
        name = f"kernelkit::{call.op}"
        fwd = next((r for r in reversed(self.sink) if r.op == name and r.phase == "fwd" and r.shapes == shapes
                    and id(r) not in self.charged), None)
        if fwd is None:
            return cost
        self.charged.add(id(fwd))
        fwd.flops += cost.flops
        fwd.bytes += cost.bytes
        return Cost(0.0, 0.0, cost.dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("profiler::"):  # ranges opening and closing: no kernels, no record of their own
            if name == "profiler::_record_function_enter_new":
                if self.open:
                    self.open[-1][1] += 1
                elif self.ranges and not self.muted and args and str(args[0]).startswith("kernelkit::"):
                    return self.kernelkit_call(args[0], func, args, kwargs)
            elif name == "profiler::_record_function_exit" and self.open:
                if self.open[-1][1]:
                    self.open[-1][1] -= 1
                else:
                    inner, _ = self.open.pop()
                    torch.ops.profiler._record_function_exit._RecordFunction(inner)
                    self.muted -= 1
            return func(*args, **kwargs)
        returns = func._schema.returns
        is_view = name in _VIEWLIKE or (bool(returns) and returns[0].alias_info is not None
                                         and not returns[0].alias_info.is_write)
        if self.muted or name in _FREE or is_view:
            out = func(*args, **kwargs)
            src = tensors((args, kwargs))
            if is_view and src and not self.muted:
                for o in tensors(out):
                    self.ids.view_of(o, src[0])
            return out
        index = None
        if self.ranges:
            # The range's index is this call's slot in the record list, reserved before the call.
            index = len(self.sink)
            self.sink.append(None)
            try:
                with torch.profiler.record_function(f"kkop::{index}"):
                    out = func(*args, **kwargs)
            except BaseException:
                del self.sink[index]
                raise
        else:
            out = func(*args, **kwargs)
        rec = self.make(name, tensors((args, kwargs)), tensors(out), op_cost(func, args, kwargs, out))
        if index is None:
            self.sink.append(rec)
        else:
            self.sink[index] = rec
        return out


class _FlashAttention(torch.autograd.Function):
    """Predicted mode: SDPA recorded as one fused call forward and one backward, as a GPU runs it,
    instead of the math decomposition (two bmm around a softmax of the full score matrix) that
    the CPU and the meta device run. The numbers are computed by that decomposition, muted."""

    @staticmethod
    def forward(ctx, q, k, v, recorder, kw):
        ctx.recorder, ctx.kw = recorder, kw
        recorder.muted += 1
        try:
            out = F.scaled_dot_product_attention(q, k, v, **kw)
        finally:
            recorder.muted -= 1
        ctx.save_for_backward(q, k, v, out)
        causal = bool(kw.get("is_causal"))
        b, h, s = q.shape[0], q.shape[-3] if q.dim() == 4 else 1, q.shape[-2]
        lse = 4 * b * h * s  # fp32 log-sum-exp per query row, kept for the backward
        recorder.record("aten::_scaled_dot_product_flash_attention", [q, k, v], [out],
                        Cost(attention_flops(q.shape, k.shape, v.shape, causal),
                             float(sum(extent_bytes(t) for t in (q, k, v, out)) + lse), dtype_key(q.dtype)))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out = ctx.saved_tensors
        recorder = ctx.recorder
        recorder.muted += 1
        try:
            with torch.enable_grad():
                q2, k2, v2 = (t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
                o = F.scaled_dot_product_attention(q2, k2, v2, **ctx.kw)
                need = [t for t in (q2, k2, v2) if t.requires_grad]
                got = iter(torch.autograd.grad(o, need, grad_out, allow_unused=True))
                grads = [next(got) if t.requires_grad else None for t in (q2, k2, v2)]
        finally:
            recorder.muted -= 1
        causal = bool(ctx.kw.get("is_causal"))
        b, h, s = q.shape[0], q.shape[-3] if q.dim() == 4 else 1, q.shape[-2]
        moved = sum(extent_bytes(t) for t in (q, k, v, out, grad_out)) + 4 * b * h * s
        moved += sum(extent_bytes(t) for t in (q, k, v))  # dq, dk, dv written
        recorder.record("aten::_scaled_dot_product_flash_attention_backward", [grad_out, q, k, v, out],
                        [g for g in grads if g is not None],
                        Cost(attention_flops(q.shape, k.shape, v.shape, causal, backward=True), float(moved),
                             dtype_key(q.dtype)))
        return grads[0], grads[1], grads[2], None, None


class _FusedAttention(TorchFunctionMode):
    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not self.recorder.muted:
            names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            kw = dict(zip(names, args[3:]), **kwargs)
            q, k, v = args[:3]
            if kw.get("attn_mask") is None and not kw.get("dropout_p") and q.dim() == k.dim() == v.dim() == 4:
                return _FlashAttention.apply(q, k, v, self.recorder, kw)
        return func(*args, **kwargs)


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    return model(*inputs)


def _loss_of(out) -> torch.Tensor | None:
    """The tensor to call backward on: a scalar loss, `.loss` of a model output, or the first tensor."""
    loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        loss = out.get("loss") if isinstance(out, dict) else None
    if not isinstance(loss, torch.Tensor):
        found = tensors(out)
        loss = found[0] if found else None
    if loss is None or not loss.requires_grad:
        return None
    return loss if loss.dim() == 0 else loss.float().sum()


def _run_step(model, inputs, backward: bool, tracker: _ModuleTracker | None = None) -> bool:
    """One forward (and backward); returns whether a backward ran."""
    out = _call(model, inputs)
    loss = _loss_of(out) if backward else None
    if loss is not None:
        if tracker is not None:
            tracker.begin_backward()
        loss.backward()
        return True
    return False


def _zero_grad(model):
    if isinstance(model, torch.nn.Module):
        model.zero_grad(set_to_none=True)


def predict(model: torch.nn.Module, inputs, backward: bool = True) -> Trace:
    """One step under the dispatch mode: every aten op with shapes, FLOPs and bytes, no timing."""
    records: list[OpRecord] = []
    tracker = _ModuleTracker(model)
    ran = False
    try:
        rec = _Recorder(tracker, 0, records, _TensorIds())
        with rec, _FusedAttention(rec):
            ran = _run_step(model, inputs, backward, tracker)
    finally:
        tracker.remove()
        _zero_grad(model)
    notes = [] if ran or not backward else ["no backward: the output does not require grad"]
    return Trace(records=records, steps=1, measured=False, backward=ran, notes=notes)


def _export(prof) -> list[dict]:
    fd, path = tempfile.mkstemp(suffix=".json", prefix="kernelkit-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return kineto.load_events(path)
    finally:
        os.unlink(path)


def profiled_steps(model, inputs, steps: int, backward: bool, instrument: bool, activities, sync):
    """Run `steps` steps under torch.profiler, each in a `kkstep::<s>` range that ends with `sync()`.
    With `instrument`, the dispatch mode records every call (in a `kkop::<index>` range).
    Returns (profiler, records, whether a backward ran)."""
    from torch.profiler import profile

    records: list[OpRecord] = []
    # The plain run carries no module hooks either: its gaps between kernels are the model's own.
    tracker, ids, ran = (_ModuleTracker(model) if instrument else None), _TensorIds(), False
    try:
        with profile(activities=activities) as prof:
            for s in range(steps):
                with torch.profiler.record_function(f"kkstep::{s}"):
                    if instrument:
                        with _Recorder(tracker, s, records, ids, ranges=True):
                            ran = _run_step(model, inputs, backward, tracker)
                        tracker.end_step()
                    else:
                        ran = _run_step(model, inputs, backward)
                    _zero_grad(model)
                    sync()
    finally:
        if tracker is not None:
            tracker.remove()
    return prof, records, ran


def measure(model: torch.nn.Module, inputs, steps: int = 3, warmup: int = 1, backward: bool = True) -> Trace:
    """Profile `steps` steps on the GPU (after `warmup` untimed ones, and at least `hw.sustain.SUSTAIN_S` of
    them), twice: once plain for the timeline (launch gaps), once under the dispatch mode for per-call kernel time,
    shapes, FLOPs and bytes."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]

    def step():
        _run_step(model, inputs, backward)
        _zero_grad(model)
    sustain(step, warmup)

    prof, _, ran = profiled_steps(model, inputs, steps, backward, False, activities, torch.cuda.synchronize)
    plain = kineto.attribute(_export(prof))
    timeline = [{"wall_us": max(st["last_end_us"] - st["start_us"], 0.0), "kernels": st["kernels"],
                 "comm": st["comm"]} for st in plain.steps]

    prof, records, _ = profiled_steps(model, inputs, steps, backward, True, activities, torch.cuda.synchronize)
    att = kineto.attribute(_export(prof))
    notes = []
    device_us = sum(e - s for st in att.steps for s, e in st["kernels"])
    if device_us == 0.0:
        raise RuntimeError("torch.profiler recorded no GPU kernels: is CUPTI available to this process, "
                           "and does the model run on the GPU?")
    for i, r in enumerate(records):
        r.kernels = [list(k) for k in att.per_op.get(i, [])]
    if not att.per_op:  # no launch could be tied to a range: fall back to the profiler's own event tree
        notes.append("kernels charged through the profiler's event tree (no correlation ids in the trace)")
        for evt in prof.events():
            if evt.name.startswith("kkop::"):
                i = int(evt.name.split("::")[1])
                us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
                if i < len(records) and us:
                    records[i].kernels = [[0.0, float(us)]]
    if backward and not ran:
        notes.append("no backward: the output does not require grad")
    return Trace(records=records, steps=steps, measured=True, timeline=timeline, device_us=device_us,
                 unattributed=dict(att.unattributed), backward=backward and ran, notes=notes)
