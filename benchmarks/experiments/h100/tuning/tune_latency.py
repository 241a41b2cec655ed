"""First-call latency of kernelkit ops with a cold and a warm tuning cache (kernelkit.tune.cache), on a GPU.

Each case runs in its own process (a process start is what the cache is for), one forward and backward at
the op's shape, with KERNELKIT_CACHE and TRITON_CACHE_DIR pointed at fresh or reused folders:

  cold          new tuning cache, new Triton cache: a new machine (every config compiled and timed)
  tuned, cold   the tuning cache of `cold`, a new Triton cache: the chosen configs compiled, none timed
  cold, compiled  new tuning cache, the Triton cache of `cold`: tuning alone (every config timed, none compiled)
  warm          both caches of the runs before: a restart on a machine that has tuned

    python benchmarks/experiments/h100/tuning/tune_latency.py   # rms_norm, cross_entropy, attention; prints a table
    python benchmarks/experiments/h100/tuning/tune_latency.py rms_norm --json out.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time

CASES = {"rms_norm": ((16384, 4096), "bfloat16"), "cross_entropy": ((8192, 32000), "bfloat16"),
         "attention": ((4, 2048, 16, 128, True), "bfloat16")}


def child(op: str, shape: tuple, dtype: str) -> dict:
    """In the measured process: first and second call of `op` (forward and backward), synchronized."""
    import torch

    from kernelkit import tune
    from kernelkit.ops import registry
    from kernelkit.tune.cli import run_call

    spec = registry.get(op)
    torch.cuda.init()
    torch.empty(1, device="cuda").sum().item()  # the CUDA context is not the op's cost
    t = time.perf_counter()
    run_call(spec, shape, dtype, "cuda")
    first = time.perf_counter() - t
    t = time.perf_counter()
    run_call(spec, shape, dtype, "cuda")
    second = time.perf_counter() - t
    sources = [r["source"] for r in tune.tune_log]
    return {"first_s": first, "second_s": second, "tuning_s": tune.tuning_seconds, "tuned": tune.tuned_keys,
            "from_cache": sources.count("cache"), "kernels": len(sources)}


def run_case(op: str, kk_cache: str, triton_cache: str) -> dict:
    shape, dtype = CASES[op]
    unset = ("KERNELKIT_TUNE", "KERNELKIT_TUNE_CACHE", "TRITON_INTERPRET")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(KERNELKIT_CACHE=kk_cache, TRITON_CACHE_DIR=triton_cache)
    out = subprocess.run([sys.executable, __file__, "--child", op, repr(shape), dtype], env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:  # the exception's line, not torch's hints after it (TORCH_USE_CUDA_DSA, ...)
        lines = (out.stderr or out.stdout).strip().splitlines()
        errors = [ln for ln in lines if "Error" in ln.split(":")[0]]
        return {"error": errors[-2:] or lines[-3:] or ["failed"]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ops", nargs="*", default=list(CASES))
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--cases", default="cold,tuned, cold,cold, compiled,warm".replace(", ", "~"),
                    help="which cases, comma-separated (a case's own ', ' written '~'): e.g. cold,warm")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        op, shape, dtype = a.child
        print(json.dumps(child(op, ast.literal_eval(shape), dtype)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for op in a.ops:
            d = {n: os.path.join(root, op, n) for n in ("kk_cold", "kk_fresh", "tr_cold", "tr_fresh")}
            for name, kk, tr in (("cold", d["kk_cold"], d["tr_cold"]),
                                 ("tuned, cold", d["kk_cold"], d["tr_fresh"]),
                                 ("cold, compiled", d["kk_fresh"], d["tr_cold"]),
                                 ("warm", d["kk_cold"], d["tr_cold"])):
                if name not in [c.replace("~", ", ") for c in a.cases.split(",")]:
                    continue
                rows.append({"op": op, "shape": str(CASES[op][0]), "case": name, **run_case(op, kk, tr)})
                print(json.dumps(rows[-1]), file=sys.stderr)
    head = f"{'op':14} {'shape':24} {'case':15} {'first call s':>12} {'2nd call ms':>11} {'tuning s':>9} " \
           f"{'tuned':>5} {'cached':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['op']:14} {r['shape']:24} {r['case']:15} error: {r['error']}")
            continue
        print(f"{r['op']:14} {r['shape']:24} {r['case']:15} {r['first_s']:12.2f} {r['second_s'] * 1e3:11.2f} "
              f"{r['tuning_s']:9.2f} {r['tuned']:5d} {r['from_cache']:6d}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
