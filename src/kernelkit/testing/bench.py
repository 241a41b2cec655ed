"""Bench harness: several implementations side by side in one process, against the measured ceiling.

Timing is `triton.testing.do_bench`'s median, which flushes L2 before every run. Inputs small
enough to sit in L2 are also rotated among several copies; tiny (latency-bound) shapes are timed
by replaying a CUDA graph, so launch gaps do not swamp the kernel.
"""

from __future__ import annotations

import itertools
import json
import math
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ..hw.ceilings import Ceilings, device_fingerprint
from ..roofline.model import Cost, place
from . import results


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    mode: str  # "fwd", "bwd", "fwd+bwd"
    impl: str
    ms: float | None
    gbps: float | None = None
    tflops: float | None = None
    pct_roof: float | None = None  # roofline floor / measured time, in %
    speedup: float | None = None  # baseline ms / this ms
    regime: str = ""
    error: str = ""
    max_err: float | None = None  # kernelkit rows, fwd: max |out - eager| / max |eager| on the timed inputs
    # GPU side only: the summed duration of the call's kernels (profiler), L2 flushed before each call.
    # Where `ms` is well above it, the call is host-bound: Python, launches and autograd outrun the GPU.
    kernel_ms: float | None = None
    kernel_gbps: float | None = None
    kernel_pct_roof: float | None = None  # roofline floor / kernel_ms, in %


def time_ms(fn: Callable[[], Any], *, cuda_graph: bool = False, rep_ms: int = 100) -> float:
    from triton.testing import do_bench, do_bench_cudagraph

    if cuda_graph:
        import torch

        with torch.cuda.stream(torch.cuda.Stream()):
            return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


_FLUSH_MARK = "bitwise_not"  # the flush kernel below, told apart from the timed call's kernels by name


def kernel_time_ms(fn: Callable[[], Any], reps: int = 20) -> float | None:
    """Mean summed device time of the kernels one call of fn launches, from torch.profiler's CUDA
    activity, with L2 flushed (a 256 MB bitwise_not) before each call. Host time is excluded."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.bitwise_not_()
            fn()
        torch.cuda.synchronize()
    # Less the GPU-side copies of profiler ranges (`is_user_annotation`): kernelkit's own calls open
    # ranges while a profiler records, and counting them would count their kernels twice.
    total = sum(e.device_time for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and _FLUSH_MARK not in e.name
                and not getattr(e, "is_user_annotation", False))
    return total / reps / 1e3 if total > 0 else None


def rotating(calls: list[Callable[[], Any]]) -> Callable[[], Any]:
    """One callable that cycles through calls bound to different input copies."""
    if len(calls) == 1:
        return calls[0]
    it = itertools.cycle(calls)
    return lambda: next(it)()


def rotation_count(input_bytes: int, l2_bytes: int, most: int = 8) -> int:
    """Copies of the inputs to rotate so the set is at least twice the L2 (1 for large inputs)."""
    if not l2_bytes or input_bytes >= 2 * l2_bytes:
        return 1
    return min(most, math.ceil(2 * l2_bytes / max(input_bytes, 1)))


def compare(op: str, shape: str, dtype: str, mode: str, impls: dict[str, Callable[[], Any] | Exception],
            cost: Cost, ceilings: Ceilings, baseline: str | None = None, cuda_graph: bool = False,
            kernel_time: bool = False) -> list[Row]:
    """Time each implementation and place it on the roofline.

    `impls` maps a name to a zero-argument callable (or to the exception that kept it from being
    built, which becomes a row with the error). The first entry is the default baseline.
    """
    rows = []
    for name, call in impls.items():
        if isinstance(call, Exception):
            rows.append(Row(op, shape, dtype, mode, name, None, error=f"{type(call).__name__}: {call}"[:200]))
            continue
        try:
            ms = time_ms(call, cuda_graph=cuda_graph)
        except Exception as e:  # a competitor that fails on this shape gets a row, not a crash
            rows.append(Row(op, shape, dtype, mode, name, None, error=f"{type(e).__name__}: {e}"[:200]))
            continue
        p = place(cost, ceilings, ms)
        rows.append(Row(op, shape, dtype, mode, name, ms, p.achieved_gbps, p.achieved_tflops, p.pct_of_roof,
                        regime=p.regime))
        if kernel_time:
            try:
                kms = kernel_time_ms(call)
            except Exception:  # noqa: BLE001 - the event timing stands on its own
                kms = None
            if kms:
                kp = place(cost, ceilings, kms)
                r = rows[-1]
                r.kernel_ms, r.kernel_gbps, r.kernel_pct_roof = kms, kp.achieved_gbps, kp.pct_of_roof
    base = baseline or next(iter(impls))
    base_ms = next((r.ms for r in rows if r.impl == base and r.ms), None)
    for r in rows:
        if base_ms and r.ms:
            r.speedup = base_ms / r.ms
    return rows


def env_fingerprint(ceilings: Ceilings | None = None) -> dict:
    import torch
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if torch.cuda.is_available():
        env.update(device_fingerprint())
    if ceilings is not None:
        env["ceilings"] = {"mem_gbps": ceilings.mem_gbps, "copy_gbps": ceilings.copy_gbps, "tflops": ceilings.tflops,
                           "launch_us": ceilings.launch_us}
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version

        env["liger_kernel"] = version("liger_kernel")
    except Exception:
        pass
    return env


def write_json(rows: list[Row], path: str | Path, ceilings: Ceilings | None = None, **extra) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"env": env_fingerprint(ceilings), **extra, "rows": [asdict(r) for r in rows]}
    path.write_text(json.dumps(doc, indent=1))
    return path


def git_commit(folder: str | Path = ".") -> str:
    """`git rev-parse --short HEAD` of the checkout holding `folder`; '' outside one (or without git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def table_rows(rows: list[Row], env: dict, commit: str) -> list[dict]:
    """The rows of a results table (testing.results) for bench rows: one per measured number; rows that
    failed (an error, no time) have none."""
    out = []
    for r in rows:
        if r.error or r.ms is None:
            continue
        for metric in results.METRICS:
            value = getattr(r, metric)
            if value is not None:
                out.append({"op": r.op, "impl": r.impl, "shape": r.shape, "dtype": r.dtype, "mode": r.mode,
                            "metric": metric, "value": float(value), "unit": results.METRICS[metric],
                            "gpu": env["gpu"], "torch": env.get("torch", ""), "triton": env.get("triton", ""),
                            "commit": commit, "timestamp": env["time"]})
    return out


def append_to_table(rows: list[Row], ceilings: Ceilings, root: str | Path | None = results.RESULTS) -> Path | None:
    """Append the rows to the results table of the GPU they ran on, `<root>/<gpu>.csv` (testing.results), with
    the checkout's commit and the time. None, writing nothing, where `root` is not a folder (an installed
    package has no benchmarks/results)."""
    if root is None or not Path(root).is_dir():
        return None
    env = {**env_fingerprint(), "gpu": ceilings.gpu}
    path = results.table_path(ceilings.gpu, root)
    results.append(path, table_rows(rows, env, git_commit(root)))
    return path


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def print_table(rows: list[Row], title: str = "", console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    kt = any(r.kernel_ms for r in rows)
    cols = ("shape", "mode", "impl", "ms", "GB/s", "TFLOP/s", "% roof", "speedup", "err")
    for col in cols + (("kernel ms", "kernel GB/s") if kt else ()):
        table.add_column(col, justify="right" if col not in ("shape", "mode", "impl") else "left")
    for r in rows:
        style = "bold green" if r.impl == "kernelkit" else None
        extra = (_fmt(r.kernel_ms, ".4f"), _fmt(r.kernel_gbps, ".0f")) if kt else ()
        table.add_row(r.shape, r.mode, r.impl, _fmt(r.ms, ".4f") or r.error[:40], _fmt(r.gbps, ".0f"),
                      _fmt(r.tflops, ".1f"), _fmt(r.pct_roof, ".1f"),
                      (_fmt(r.speedup, ".2f") + "x") if r.speedup else "", _fmt(r.max_err, ".1e"), *extra,
                      style=style)
    (console or Console()).print(table)


def plot(rows: list[Row], path: str | Path, metric: str = "gbps", ceiling: float | None = None,
         title: str = "") -> Path:
    """Grouped bars: one group per (shape, mode), one bar per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r.shape, r.mode) for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    width = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) + 2), 4.5))
    for j, impl in enumerate(impls):
        vals = []
        for g in groups:
            r = next((r for r in rows if (r.shape, r.mode) == g and r.impl == impl), None)
            vals.append(getattr(r, metric) or 0 if r else 0)
        ax.bar([i + j * width for i in range(len(groups))], vals, width, label=impl)
    if ceiling:
        ax.axhline(ceiling, color="k", ls="--", lw=1, label="measured ceiling")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{s}\n{m}" for s, m in groups], fontsize=7)
    ax.set_ylabel({"gbps": "GB/s (ideal bytes)", "tflops": "TFLOP/s"}.get(metric, metric))
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
