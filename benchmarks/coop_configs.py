"""Cooperative rows (ops/_coop.py): time chunk length, warps and programs per SM side by side (GPU), against the
two-pass paths they replace (COOP off), at the long-row shapes of issue 29. The cases and configs are those of the latest run (results in
benchmarks/results/h100/coop_configs.json and benchmarks/experiments/h100/2026-11-26-width-sweep/).

    PYTHONPATH=src python benchmarks/coop_configs.py --out coop.json

GB/s of ideal bytes (each op's `cost`), triton.testing.do_bench median with the L2 flushed; forward and backward
(autograd.grad through a kept graph) timed apart.
"""

import argparse
import itertools
import json

import torch
from triton.testing import do_bench

import kernelkit.ops.layer_norm as ln
import kernelkit.ops.rms_norm as rms
import kernelkit.ops.softmax as sm
from kernelkit.ops import registry

CASES = [("layer_norm", (1024, 65536), torch.bfloat16), ("layer_norm", (4096, 18432), torch.bfloat16),
         ("layer_norm", (2048, 32768), torch.float32), ("rms_norm", (2048, 32768), torch.float32),
         ("rms_norm", (1024, 65536), torch.bfloat16)]
CONFIGS = [dict(zip(("chunk", "bwd_chunk", "warps", "per_sm"), c)) for c in
           [(8192, 4096, 8, 2), (8192, 8192, 8, 2), (4096, 2048, 8, 2), (4096, 2048, 8, 3), (4096, 4096, 8, 2),
            (4096, 2048, 4, 4), (2048, 2048, 4, 4)]]


def _time(spec, shape, dtype):
    args, kw = spec.make_inputs(shape, dtype, "cuda")
    args = [a.detach().requires_grad_(i in spec.grad_args) if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a for i, a in enumerate(args)]
    out = spec.fn(*args, **kw)
    out = out[0] if isinstance(out, tuple) else out
    dy = torch.randn_like(out)
    ins = [args[i] for i in spec.grad_args]
    fwd = do_bench(lambda: spec.fn(*args, **kw), return_mode="median")
    bwd = do_bench(lambda: torch.autograd.grad(out, ins, dy, retain_graph=True), return_mode="median")
    cf, cb = spec.cost(*args, **kw), spec.cost(*args, backward=True, **kw)
    return {"fwd_gbps": cf.bytes / fwd / 1e6, "bwd_gbps": cb.bytes / bwd / 1e6, "fwd_ms": fwd, "bwd_ms": bwd}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="coop.json")
    args = ap.parse_args()
    rows = []
    for (op, shape, dtype), cfg in itertools.product(CASES, [None] + CONFIGS):
        mod = sm if "softmax" in op else ln if op == "layer_norm" else rms
        names = ("COOP", "COOP_CHUNK", "COOP_BWD_CHUNK", "COOP_WARPS", "COOP_PER_SM") + (
            ("COOP_BWD_CHUNK_FP32",) if mod is rms else ())
        saved = {k: getattr(mod, k) for k in names}
        if cfg is None:
            mod.COOP = False
        else:
            mod.COOP_CHUNK, mod.COOP_BWD_CHUNK, mod.COOP_WARPS, mod.COOP_PER_SM = (
                cfg["chunk"], cfg["bwd_chunk"], cfg["warps"], cfg["per_sm"])
            if mod is rms:
                mod.COOP_BWD_CHUNK_FP32 = cfg["bwd_chunk"]
        try:
            r = _time(registry.get(op), shape, dtype)
        except Exception as e:  # noqa: BLE001 - a config that does not fit is a row too
            r = {"error": repr(e)[:200]}
        finally:
            for k, v in saved.items():
                setattr(mod, k, v)
        row = {"op": op, "shape": list(shape), "dtype": str(dtype), "config": cfg or "two-pass (COOP off)", **r}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
