"""GPU diagnostic for RoPE: per config of the kernel, the forward timed three ways (do_bench with L2
flush, do_bench_cudagraph, the profiler's kernel time), plus the CPU time of one call; and the autograd
backward with the tuned config. Shows whether a slow figure is the kernel or the launch path.

    python benchmarks/experiments/h100/launch/diag_rope.py   # prints a table
"""
import time

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from kernelkit import tune
from kernelkit.ops import rope as R

CONFIGS = [(2, 4, 1), (8, 1, 1), (16, 1, 2), (1, 8, 4), (2, 8, 4), (4, 8, 4), (8, 4, 4), (4, 4, 4),
           (8, 8, 8), (16, 4, 8), (1, 16, 4), (2, 16, 8), (16, 8, 8), (32, 4, 8)]


def key_of(q, k):
    B, S, HQ, D = q.shape
    return (HQ, k.shape[2], D // 2, 0, False, R.COS_PER_TOKEN, min(triton.next_power_of_2(B * S), 4096),
            q.dtype, q.dtype, False)


def kernel_us(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.name == "rope_kernel"]
    return sum(e.device_time for e in ev) / max(len(ev), 1)


def main():
    torch.manual_seed(0)
    for shape in [(4, 4096, 32, 8, 128), (1, 16384, 32, 8, 128), (8, 2048, 32, 32, 128)]:
        (q, k, cos, sin), _ = R.make_inputs(shape, torch.bfloat16, "cuda")
        gb = 2 * 2 * (q.numel() + k.numel()) / 1e9
        key = key_of(q, k)
        print(f"shape {shape}: {gb * 1e3:.0f} MB moved; copy {do_bench(lambda: (q.clone(), k.clone())) * 1e3:.1f} us")
        for bt, bh, w in CONFIGS:
            cfg = triton.Config({"BLOCK_T": bt, "BLOCK_H": bh}, num_warps=w)
            tune._chosen[(R.rope_kernel, key)] = tune._Entry(R.rope_kernel.fn, cfg)
            f = lambda: R.rope(q, k, cos, sin)  # noqa: E731
            f()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                f()
            cpu = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            flush = do_bench(f, return_mode="median") * 1e3
            graph = do_bench_cudagraph(f, return_mode="median") * 1e3
            print(f"  T{bt:<3} H{bh:<3} w{w:<2} flush {flush:6.1f} us ({gb / flush * 1e6:5.0f} GB/s)  graph {graph:6.1f}"
                  f"  kernel {kernel_us(f):6.1f}  cpu/call {cpu:5.1f}")
        tune._chosen.pop((R.rope_kernel, key), None)
        qg, kg = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        qo, ko = R.rope(qg, kg, cos, sin)
        dq, dk = torch.randn_like(qo), torch.randn_like(ko)
        bwd = lambda: torch.autograd.grad([qo, ko], [qg, kg], [dq, dk], retain_graph=True)  # noqa: E731
        tuned = getattr(tune._chosen.get((R.rope_kernel, key)), "cfg", None)
        print(f"  tuned {tuned}: fwd {do_bench(lambda: R.rope(q, k, cos, sin)) * 1e3:.1f}"
              f" bwd {do_bench(bwd) * 1e3:.1f} bwd kernel {kernel_us(bwd):.1f} us")


if __name__ == "__main__":
    main()
