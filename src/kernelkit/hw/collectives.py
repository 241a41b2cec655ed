"""The link between GPUs, measured: all-gather and reduce-scatter through torch.distributed (NCCL on GPUs, gloo
on the CPU) over a sweep of message sizes, each read as algorithm and bus bandwidth by nccl-tests' convention.
The best bus bandwidth of the sweep is the link's ceiling; it is cached beside the other measured ceilings,
keyed by the device fingerprint and the number of ranks, and the profiler sets each collective of a trace
against it.

nccl-tests' convention (its doc/PERFORMANCE.md): a collective's size S is the whole buffer (all-gather: the
gathered output; reduce-scatter, all-reduce: the input), algbw = S / time, and busbw = algbw x a factor that
counts what each rank's link must carry whatever the algorithm: (n-1)/n for all-gather, reduce-scatter and
all-to-all, 2(n-1)/n for all-reduce, 1 for broadcast, reduce and send/recv. busbw is what compares with the
link's bandwidth, and with other rank counts.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

from .ceilings import _atomic_write, _kernelkit_version, cache_dir, device_fingerprint

# 1 MiB .. 1 GiB, x4: FSDP2 moves one flat buffer per unit, from a few MiB (a norm, a small layer) to ~1 GiB
# (Llama-3-8B's embedding in bf16 is 1 GiB unsharded).
SWEEP_BYTES = tuple(1 << p for p in range(20, 31, 2))
SWEPT = ("all_gather", "reduce_scatter")
LINK_CACHE_VERSION = 1

_BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n, "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "send_recv": lambda n: 1.0}
COLLECTIVES = tuple(_BUS_FACTORS)


def bus_factor(kind: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw for `kind` (a name of COLLECTIVES) over `ranks` ranks."""
    if kind not in _BUS_FACTORS:
        raise ValueError(f"kind={kind!r}: one of {', '.join(COLLECTIVES)}")
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    return _BUS_FACTORS[kind](ranks)


def bandwidth_gbps(kind: str, nbytes: float, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of one `kind` collective of size `nbytes` (nccl-tests' S) that took `seconds`."""
    alg = nbytes / seconds / 1e9
    return alg, alg * bus_factor(kind, ranks)


def _buffers(kind: str, nbytes: int, ranks: int, device, dtype):
    """(output, input) of a collective of size `nbytes`, the whole buffer split evenly over the ranks."""
    import torch

    per_rank = max(1, nbytes // dtype.itemsize // ranks)
    whole = torch.ones(per_rank * ranks, device=device, dtype=dtype)
    shard = torch.ones(per_rank, device=device, dtype=dtype)
    return (whole, shard) if kind == "all_gather" else (shard, whole)


def _timed_calls(fn, calls: int, device) -> float:
    """Seconds per call of `calls` calls back to back, this rank's view."""
    import torch

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def time_collective(kind: str, nbytes: int, calls: int = 0, warmup: int = 2) -> float:
    """Seconds per call of `kind` over the default process group at size `nbytes`: the slowest rank's time
    (a collective ends when its last rank does), after `warmup` untimed calls. `calls` 0: fewer as messages grow
    (20 at 1 MiB, 2 at 1 GiB)."""
    import torch
    import torch.distributed as dist

    ranks = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out, inp = _buffers(kind, nbytes, ranks, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    # torch 2.13 renamed them (*_single); FSDP2 calls the same c10d ops either way
    if kind == "all_gather":
        op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    else:
        op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls = calls or max(2, min(20, (2 << 30) // nbytes))
    for _ in range(warmup):
        op(out, inp)
    dist.barrier()
    seconds = torch.tensor([_timed_calls(lambda: op(out, inp), calls, device)], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def sweep(sizes=SWEEP_BYTES, kinds=SWEPT, progress: Callable[[str], None] | None = None, time_fn=None) -> dict:
    """Every rank of the default group calls this together. Rows of (collective, bytes, ms, algbw, busbw) and the
    peak busbw per collective and overall. `time_fn(kind, nbytes)` (default `time_collective`) gives seconds."""
    import torch.distributed as dist

    time_fn = time_fn or time_collective
    ranks = dist.get_world_size()
    rows = []
    for kind in kinds:
        for nbytes in sizes:
            if progress:
                progress(f"{kind.replace('_', '-')} {nbytes / 2**20:g} MiB")
            seconds = time_fn(kind, nbytes)
            alg, bus = bandwidth_gbps(kind, nbytes, seconds, ranks)
            rows.append({"collective": kind, "bytes": nbytes, "ms": seconds * 1e3, "algbw_gbps": alg,
                         "busbw_gbps": bus})
    return link_summary(rows, ranks, dist.get_backend())


def link_summary(rows: list[dict], ranks: int, backend: str) -> dict:
    """The sweep's document: its rows, the peak busbw per collective, and the link's ceiling (the best of all)."""
    peaks = {}
    for r in rows:
        peaks[r["collective"]] = max(peaks.get(r["collective"], 0.0), r["busbw_gbps"])
    return {"ranks": ranks, "backend": backend, "rows": rows, "peak_busbw_gbps": peaks,
            "busbw_gbps": max(peaks.values(), default=None),
            "convention": "nccl-tests: size = the whole buffer (all-gather: output, reduce-scatter: input); "
                          "algbw = size / time of the slowest rank; busbw = algbw x (n-1)/n"}


def sweep_on_rank(rank: int, world: int) -> dict:
    """`kernelkit.testing.distributed.spawn` entry: the sweep, from each rank of a freshly joined group."""
    return sweep()


def size_reaching(link: dict, kind: str, share: float = 0.8) -> int | None:
    """The smallest swept message size at which `kind` reached `share` of its peak busbw; None without rows."""
    rows = sorted((r for r in link.get("rows", []) if r["collective"] == kind), key=lambda r: r["bytes"])
    peak = (link.get("peak_busbw_gbps") or {}).get(kind)
    return next((r["bytes"] for r in rows if peak and r["busbw_gbps"] >= share * peak), None)


def _link_path(fp: dict, ranks: int) -> Path:
    keyed = {**fp, "ranks": ranks, "kernelkit": _kernelkit_version(), "link_cache_version": LINK_CACHE_VERSION,
             "sizes": list(SWEEP_BYTES)}
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "ceilings" / f"link-{key}.json"


def save_link(link: dict, fp: dict) -> Path:
    """Keep a sweep beside the measured ceilings (same directory, same fingerprint, plus the rank count)."""
    path = _link_path(fp, link["ranks"])
    _atomic_write(path, {**link, "fingerprint": fp})
    return path


def load_link(ranks: int, fp: dict | None = None) -> dict | None:
    """The cached sweep of `ranks` GPUs of this kind (None: never measured, or unreadable)."""
    try:
        fp = fp or device_fingerprint()
        doc = json.loads(_link_path(fp, ranks).read_text())
    except (OSError, ValueError, RuntimeError, AssertionError):
        return None
    ok = isinstance(doc, dict) and doc.get("fingerprint") == fp and isinstance(doc.get("busbw_gbps"), (int, float))
    return doc if ok else None
