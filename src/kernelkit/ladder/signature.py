"""Each rung's profiler signature: the Nsight Compute counters that confirm a step landed.

A rung's `expect` says which numbers should move: sectors per global-load request (coalescing, vector width),
shared-memory bank conflicts, achieved occupancy and registers per thread, FMA or tensor pipe utilization,
DRAM throughput and L2 hit rate (tile order), and the warp-stall reason that dominates. `profile` reads them
by running the rung once more in a child process under

    ncu --clock-control none --profile-from-start off --launch-count 1 --csv --metrics ...

(`--clock-control none`: the GPU keeps its own clocks, as in the timed runs; the child brackets the one
profiled launch with cudaProfilerStart/Stop after a warm-up launch, so compilation and autotuning stay out).
When ncu is missing, the counters are not readable, or the run fails, it returns a sentence saying so.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from typing import Optional, Union

STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
# Warp-stall reasons, each as cycles a warp spends stalled for that reason per issued instruction.
# "selected" and "not_selected" are left out: they are not stalls (another warp issued instead).
STALL_REASONS = ("barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle",
                 "long_scoreboard", "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction",
                 "short_scoreboard", "sleeping", "tex_throttle", "wait")

METRICS = {
    "duration_ns": "gpu__time_duration.sum",
    "registers_per_thread": "launch__registers_per_thread",
    "grid_size": "launch__grid_size",
    "ld_sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "ld_requests": "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "st_sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "st_requests": "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
    "shared_ld_bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "shared_st_bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "fma_pipe_pct": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "tensor_hmma_pipe_pct": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "tensor_gmma_pipe_pct": "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",  # Hopper wgmma
    "dram_throughput_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_rate_pct": "lts__t_sector_hit_rate.pct",
    **{f"stall_{r}": f"{STALL_PREFIX}{r}{STALL_SUFFIX}" for r in STALL_REASONS},
}

NO_COUNTERS = ("ncu cannot read this GPU's performance counters (ERR_NVGPUCTRPERM): run as root or allow "
               "profiling for all users (nvidia driver option NVreg_RestrictProfilingToAdminUsers=0); "
               "the timings above do not depend on it")


def find_ncu() -> Optional[str]:
    for path in (os.environ.get("KERNELKIT_NCU"), shutil.which("ncu"), "/usr/local/cuda/bin/ncu"):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", ""))
    except ValueError:  # "n/a" and the like
        return None


def parse_csv(text: str) -> dict[str, dict]:
    """ncu's `--csv --page details` output (other lines, such as ==PROF== notices and the program's own output,
    are skipped) -> {kernel ID: {"kernel": name, "metrics": {metric name: float or None}}}."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID","')), None)
    if start is None:
        return {}
    rows = csv.DictReader(line for line in lines[start:] if line.startswith('"'))
    kernels: dict[str, dict] = {}
    for row in rows:
        if not row.get("Metric Name"):
            continue
        k = kernels.setdefault(row["ID"], {"kernel": row.get("Kernel Name", ""), "metrics": {}})
        k["metrics"][row["Metric Name"]] = _number(row.get("Metric Value", ""))
    return kernels


def summarize(metrics: dict[str, Optional[float]], kernel: str = "") -> dict:
    """The raw counters of one kernel -> the signature: ratios, the tensor pipe (whichever counter this GPU
    has), the top stall reason."""
    by_key = {key: metrics.get(name) for key, name in METRICS.items()}

    def ratio(num, den):
        return num / den if num is not None and den else None

    stalls = {r: by_key[f"stall_{r}"] for r in STALL_REASONS if by_key.get(f"stall_{r}") is not None}
    top = max(stalls, key=stalls.get) if stalls else None
    tensor = [v for v in (by_key["tensor_hmma_pipe_pct"], by_key["tensor_gmma_pipe_pct"]) if v is not None]
    return {
        "kernel": kernel,
        "ncu_ms": by_key["duration_ns"] / 1e6 if by_key["duration_ns"] is not None else None,
        "grid_size": by_key["grid_size"],
        "global_ld_sectors_per_request": ratio(by_key["ld_sectors"], by_key["ld_requests"]),
        "global_st_sectors_per_request": ratio(by_key["st_sectors"], by_key["st_requests"]),
        "shared_ld_bank_conflicts": by_key["shared_ld_bank_conflicts"],
        "shared_st_bank_conflicts": by_key["shared_st_bank_conflicts"],
        "achieved_occupancy_pct": by_key["achieved_occupancy_pct"],
        "registers_per_thread": by_key["registers_per_thread"],
        "fma_pipe_pct": by_key["fma_pipe_pct"],
        "tensor_pipe_pct": max(tensor) if tensor else None,
        "dram_throughput_pct": by_key["dram_throughput_pct"],
        "l2_hit_rate_pct": by_key["l2_hit_rate_pct"],
        "top_stall": top,
        "top_stall_cycles_per_issue": stalls.get(top) if top else None,
    }


def _failure(output: str, returncode: int) -> Optional[str]:
    """A plain reason when ncu's output says why nothing was measured, else None."""
    if "ERR_NVGPUCTRPERM" in output:
        return NO_COUNTERS
    if "No kernels were profiled" in output:
        return "ncu profiled no kernel (the rung launched nothing between cudaProfilerStart and Stop)"
    if returncode != 0:
        errors = [line for line in output.splitlines() if "==ERROR==" in line] or output.strip().splitlines()[-3:]
        return f"ncu failed (exit {returncode}): " + " | ".join(errors)[-400:]
    return None


def profile(kind: str, rung: str, shape: tuple[int, int, int], params: Optional[dict] = None,
            timeout: float = 600.0) -> Union[dict, str]:
    """The signature of `rung` (or "cublas") at M x N x K: a dict of `summarize`, or a sentence saying why not."""
    ncu = find_ncu()
    if ncu is None:
        return "ncu (Nsight Compute) is not on PATH: no profiler signature (set KERNELKIT_NCU to its path)"
    metrics = list(METRICS.values())
    child = [sys.executable, "-m", "kernelkit.ladder.run_one", "--kind", kind, "--rung", rung,
             "--shape", ",".join(map(str, shape)), "--params", json.dumps(params or {})]
    for _ in range(3):  # a metric this ncu or GPU does not know fails the whole run: drop it and retry
        cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--launch-count", "1",
               "--csv", "--page", "details", "--print-units", "base", "--metrics", ",".join(metrics), *child]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"ncu did not finish within {timeout:.0f} s"
        text = out.stdout + "\n" + out.stderr
        kernels = parse_csv(out.stdout)
        if kernels:
            first = kernels[min(kernels, key=lambda i: int(i) if i.isdigit() else 0)]
            return summarize(first["metrics"], first["kernel"])
        reason = _failure(text, out.returncode)
        errors = "\n".join(line for line in text.splitlines() if "==ERROR==" in line)
        unknown = [m for m in metrics if m.split(".")[0] in errors]  # ncu may name a metric without its suffix
        if not unknown or reason == NO_COUNTERS:
            return reason or "ncu printed no metrics: " + " | ".join(text.strip().splitlines()[-3:])[-400:]
        metrics = [m for m in metrics if m not in unknown]
    return reason


def _fmt(v, spec: str, suffix: str = "") -> str:
    return "-" if v is None else format(v, spec) + suffix


def describe(sig: Union[dict, str, None], kind: str) -> str:
    """One line of a signature, for the table."""
    if sig is None:
        return ""
    if isinstance(sig, str):
        return sig
    pipe = ("tensor " + _fmt(sig["tensor_pipe_pct"], ".0f", "%")) if kind == "hgemm" else \
        ("FMA " + _fmt(sig["fma_pipe_pct"], ".0f", "%"))
    conflicts = [sig["shared_ld_bank_conflicts"], sig["shared_st_bank_conflicts"]]
    return " | ".join([
        f"ld {_fmt(sig['global_ld_sectors_per_request'], '.1f')} sect/req",
        "bank conflicts ld/st " + "/".join(_fmt(c, ".3g") for c in conflicts),
        f"occ {_fmt(sig['achieved_occupancy_pct'], '.0f', '%')}",
        f"{_fmt(sig['registers_per_thread'], '.0f')} regs",
        pipe,
        f"DRAM {_fmt(sig['dram_throughput_pct'], '.0f', '%')}",
        f"L2 hit {_fmt(sig['l2_hit_rate_pct'], '.0f', '%')}",
        f"stall {sig['top_stall'] or '-'}",
    ])
