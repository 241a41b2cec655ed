"""Where the idle time of an un-profiled training step goes (issue 32 item 1's open question).

docs/profile.md (2026-11-25): the patched Llama-3.2-1B-shaped step takes 90.5 ms without the profiler while its
kernels are busy for 83.0 ms under the profiler, yet one CUDA graph of the step takes 89.9 ms. A graph keeps
~1 us between kernels, so either the kernels run longer when the GPU is never idle (clocks, power), or the
graph's own kernels differ. This script times the same step, patched and not, four ways and profiles two of
them, sampling the SM clock and power with nvidia-smi throughout:

- eager, no profiler (median of N steps), and eager under torch.profiler: busy time (union of kernels), idle
  gaps split by cause: the next kernel's launch came after the previous kernel ended (the GPU waited on the
  host) or before (device-side gap);
- one CUDA graph of the step replayed, no profiler, and replayed under torch.profiler (CUPTI records a graph's
  kernels): busy time inside the graph and its gaps;
- per kernel name, the time in eager-profiled against graph-profiled (which kernels got slower).

    python idle.py --out idle.json [--unpatched-too]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-25-overhead"))
from llama1b import build  # noqa: E402

STEPS = 8


def step(model, inputs):
    out = model(**inputs)
    out.loss.backward()
    model.zero_grad(set_to_none=False)


def median_ms(fn, n=STEPS):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts), ts


def trace_of(fn, n=3):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(path)
    doc = json.loads(Path(path).read_text())
    os.unlink(path)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def analyse(events, n):
    kernels, launches = [], {}
    for e in events:
        if e.get("ph") != "X":
            continue
        a = e.get("args") or {}
        if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"):
            kernels.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", ""), a.get("correlation")))
        elif "correlation" in a and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            launches[a["correlation"]] = float(e["ts"])
    kernels.sort()
    busy, host_gap, dev_gap, gaps = 0.0, 0.0, 0.0, []
    by_name = defaultdict(float)
    end = None
    for s, e, name, corr in kernels:
        by_name[name[:90]] += (e - s) / n
        if end is not None and s > end:
            gap = s - end
            gaps.append(gap)
            launched = launches.get(corr)
            if launched is not None and launched > end:
                host_gap += gap
            else:
                dev_gap += gap
        busy += max(e - max(s, end or s), 0.0)
        end = e if end is None else max(end, e)
    span = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0
    gaps.sort()
    q = lambda p: gaps[int(p * (len(gaps) - 1))] if gaps else 0.0  # noqa: E731
    return {"kernels_per_step": len(kernels) / n, "busy_ms": busy / n / 1e3, "span_ms": span / n / 1e3,
            "gap_host_ms": host_gap / n / 1e3, "gap_device_ms": dev_gap / n / 1e3,
            "gap_us_p50": q(0.5), "gap_us_p90": q(0.9), "gap_us_p99": q(0.99), "gap_us_max": gaps[-1] if gaps else 0.0,
            "by_name": dict(by_name)}


class Smi:
    """nvidia-smi sampling SM clock, power and throttle reasons every 20 ms; phases marked by wall time."""

    def __init__(self, path):
        self.path, self.phases = path, []
        self.p = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active,temperature.gpu",
                                   "--format=csv,noheader,nounits", "-lms", "20"], stdout=open(path, "w"),
                                  stderr=subprocess.DEVNULL)

    def phase(self, name, fn):
        t0 = time.time()
        out = fn()
        self.phases.append((name, t0, time.time()))
        return out

    def summary(self):
        self.p.terminate()
        self.p.wait()
        from datetime import datetime
        rows = []
        for line in Path(self.path).read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((t, float(parts[1]), float(parts[2]), parts[3], float(parts[4])))
            except (ValueError, IndexError):
                continue
        out = {}
        for name, t0, t1 in self.phases:
            sel = [r for r in rows if t0 <= r[0] <= t1]
            if sel:
                out[name] = {"samples": len(sel), "sm_mhz_median": statistics.median(r[1] for r in sel),
                             "sm_mhz_min": min(r[1] for r in sel), "power_w_median": statistics.median(r[2] for r in sel),
                             "throttle": sorted({r[3] for r in sel}), "temp_c_max": max(r[4] for r in sel)}
        return out


def run(label, model, inputs, smi):
    res = {}
    fn = lambda: step(model, inputs)  # noqa: E731
    for _ in range(3):
        fn()
    res["plain_ms"], res["plain_all"] = smi.phase(f"{label} plain", lambda: median_ms(fn))
    ev = smi.phase(f"{label} eager profiled", lambda: trace_of(fn))
    res["eager_profiled"] = analyse(ev, 3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    res["graph_ms"], res["graph_all"] = smi.phase(f"{label} graph", lambda: median_ms(g.replay))
    ev = smi.phase(f"{label} graph profiled", lambda: trace_of(g.replay))
    res["graph_profiled"] = analyse(ev, 3)
    # the eager step again after the graph: same clocks state as the graph had?
    res["plain_after_ms"], _ = smi.phase(f"{label} plain again", lambda: median_ms(fn))
    del g
    eb, gb = res["eager_profiled"].pop("by_name"), res["graph_profiled"].pop("by_name")
    diff = sorted(((gb.get(k, 0.0) - eb.get(k, 0.0), k, eb.get(k, 0.0), gb.get(k, 0.0)) for k in set(eb) | set(gb)),
                  reverse=True)
    res["slower_in_graph_us"] = [{"kernel": k, "eager_us": e, "graph_us": g_, "diff_us": d} for d, k, e, g_ in diff[:12]]
    res["faster_in_graph_us"] = [{"kernel": k, "eager_us": e, "graph_us": g_, "diff_us": d} for d, k, e, g_ in diff[-6:]]
    res["top_kernels_graph_us"] = sorted(({"kernel": k, "us": v} for k, v in gb.items()), key=lambda r: -r["us"])[:15]
    print(label, json.dumps({k: v for k, v in res.items() if not isinstance(v, list)}, indent=1), flush=True)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--unpatched-too", action="store_true")
    a = ap.parse_args()
    import kernelkit
    smi = Smi(a.out + ".smi.csv")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    model, inputs = build()
    if a.unpatched_too:
        out["unpatched"] = run("unpatched", model, inputs, smi)
    kernelkit.patch(model)
    out["patched"] = run("patched", model, inputs, smi)
    out["clocks"] = smi.summary()
    print(json.dumps(out["clocks"], indent=1))
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
