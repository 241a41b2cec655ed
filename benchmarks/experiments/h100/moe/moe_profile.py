"""Where the MoE layer's forward+backward spends its GPU time: torch.profiler over a few steps of kernelkit.moe and
of the torch._grouped_mm layer (benchmarks/moe.py's), CUDA kernels summed by name, beside the end-to-end time of a
step (do_bench median, L2 flushed): where the two differ, the step waits on the host (GPU).
Usage: python3 benchmarks/experiments/h100/moe/moe_profile.py [--shape mixtral] [--out FILE.json]"""

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench
from torch.profiler import ProfilerActivity, profile

import kernelkit
from kernelkit.ops import registry
from kernelkit.testing.bench import env_fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # benchmarks/, for moe.py
from moe import SHAPES, grouped_mm_layer  # noqa: E402


def kernels(fn, steps):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and ev.count:
            rows.append({"kernel": ev.key[:160], "calls": ev.count // steps, "ms_per_step": t / 1e3 / steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="mixtral")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    shape, scoring = SHAPES[a.shape]
    (x, router, gate_up, down, k), _ = registry.get("moe").make_inputs(
        shape, torch.bfloat16, "cuda", torch.Generator(device="cuda").manual_seed(0))
    leaves = [t.detach().requires_grad_() for t in (x, router, gate_up, down)]
    dy = torch.randn_like(x)
    out = {"env": env_fingerprint(), "shape": a.shape, "dims": list(shape)}
    for name, f in (("kernelkit", kernelkit.moe), ("grouped_mm_layer", grouped_mm_layer)):
        step = lambda: torch.autograd.grad(f(*leaves, k, scoring=scoring), leaves, dy)  # noqa: E731
        rows = kernels(step, a.steps)
        out[name] = {"total_ms_per_step": sum(r["ms_per_step"] for r in rows),
                     "end_to_end_ms": do_bench(step, rep=200, return_mode="median"), "kernels": rows}
        print(f"== {name}: {out[name]['total_ms_per_step']:.3f} ms of kernels per fwd+bwd step, "
              f"{out[name]['end_to_end_ms']:.3f} ms end to end")
        for r in rows[:14]:
            print(f"  {r['ms_per_step']:8.3f} ms  x{r['calls']:<3d} {r['kernel'][:110]}")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
