"""Read torch.profiler's chrome trace (Kineto JSON): which GPU kernels ran in which step, and under
which `kkop::<index>` range each was launched.

A kernel is tied to its launch on the CPU by the CUPTI correlation id (kernel and cudaLaunchKernel /
cuLaunchKernel event carry the same `correlation`); failing that, by `External id`, the innermost CPU
op that was running when it launched. The launch's thread and timestamp then fall inside exactly one
`kkop::` range, the op call the dispatch mode wrapped, and one `kkstep::<s>` range, its step (steps end
with a device synchronize, so an unlinked kernel is placed by its own start on the common clock).
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .comms import PARAM_COMMS, comm_record, is_nccl_kernel

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_NOT_CPU = DEVICE_CATS | {"gpu_user_annotation", "ac2g", "fwdbwd", "Trace"}


@dataclass
class Attribution:
    per_op: dict[int, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    # per step: start_us, end_us, kernels [(s, e)], last_end_us, comm (its NCCL kernels, comms.comm_record)
    steps: list[dict] = field(default_factory=list)
    unattributed: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # name -> us
    linked: int = 0  # kernels tied to a launch on the CPU


def load_events(path: str | Path) -> list[dict]:
    doc = json.loads(Path(path).read_text())
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def _index(name: str) -> int | None:
    try:
        return int(name.split("::", 1)[1])
    except (IndexError, ValueError):
        return None


class _Ranges:
    """Disjoint ranges per CPU thread; which one holds (thread, ts)."""

    def __init__(self):
        self.by_thread: dict[tuple, list[tuple[float, float, int]]] = defaultdict(list)

    def add(self, thread, start, end, idx):
        self.by_thread[thread].append((start, end, idx))

    def freeze(self):
        for v in self.by_thread.values():
            v.sort()
        self.starts = {k: [r[0] for r in v] for k, v in self.by_thread.items()}

    def find(self, thread, ts) -> int | None:
        rs = self.by_thread.get(thread)
        if not rs:
            return None
        i = bisect.bisect_right(self.starts[thread], ts) - 1
        # Ranges of one thread do not overlap, except a few nested ones: look back a little.
        for j in range(i, max(i - 4, -1), -1):
            s, e, idx = rs[j]
            if s <= ts <= e:
                return idx
        return None


def attribute(events: list[dict]) -> Attribution:
    """Split the device activity of a trace by step and by `kkop::` range."""
    att = Attribution()
    ops, launches, by_ext, steps = _Ranges(), {}, {}, []
    device, comms, comm_args, comm_by_ext = [], _Ranges(), [], {}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name, a = e.get("cat", ""), e.get("name", ""), e.get("args") or {}
        ts, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        if cat in DEVICE_CATS:
            device.append((ts, ts + dur, name, a))
            continue
        if cat in _NOT_CPU:
            continue
        thread = (e.get("pid"), e.get("tid"))
        if name.startswith("kkstep::"):
            steps.append((ts, ts + dur, _index(name)))
        elif name.startswith("kkop::"):
            idx = _index(name)
            if idx is not None:
                ops.add(thread, ts, ts + dur, idx)
        elif name == PARAM_COMMS:  # a collective's sizes, around its NCCL kernel's launch
            comms.add(thread, ts, ts + dur, len(comm_args))
            if "External id" in a:
                comm_by_ext[a["External id"]] = len(comm_args)
                by_ext.setdefault(a["External id"], (thread, ts, name))
            comm_args.append(a)
        elif "correlation" in a:  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, ...
            launches[a["correlation"]] = (thread, ts)
        elif "External id" in a and cat in ("cpu_op", "user_annotation", "operator"):
            by_ext.setdefault(a["External id"], (thread, ts, name))
    ops.freeze()
    comms.freeze()
    steps.sort()
    att.steps = [{"index": i, "start_us": s, "end_us": t, "kernels": [], "last_end_us": s, "comm": []}
                 for s, t, i in steps]
    starts = [s["start_us"] for s in att.steps]
    for ks, ke, name, a in sorted(device, key=lambda d: d[0]):
        where = launches.get(a.get("correlation"))
        if where is None and a.get("External id") in by_ext:
            where = by_ext[a["External id"]][:2]
        if att.steps:
            # The launch's CPU time places a kernel in its step; the kernel's own start, when unlinked.
            t = where[1] if where is not None else ks
            j = bisect.bisect_right(starts, t) - 1
            if j < 0 or t > att.steps[j]["end_us"]:
                continue  # outside every step (profiler warm-up, another caller's work)
            att.steps[j]["kernels"].append((ks, ke))
            att.steps[j]["last_end_us"] = max(att.steps[j]["last_end_us"], ke)
            if is_nccl_kernel(name):
                found = comms.find(*where) if where is not None else None
                found = comm_by_ext.get(a.get("External id")) if found is None else found
                att.steps[j]["comm"].append(comm_record(name, ks, ke, a, None if found is None else comm_args[found]))
        idx = ops.find(*where) if where is not None else None
        if where is not None:
            att.linked += 1
        if idx is None:
            ext = by_ext.get(a.get("External id"))
            att.unattributed[f"{ext[2]} / {name[:80]}" if ext else name[:80]] += ke - ks
        else:
            att.per_op[idx].append((ks, ke))
    return att
