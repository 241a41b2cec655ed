"""Why fp8_linear's trial at narrow attention shapes (16384 x 2048 -> 512 / 2048, fwd + bwd) takes ~1 ms more than
its GEMMs and quantizations should: the kernels of one call, by name, with CUDA time, and the wall time of 8 calls
back to back (as the patch's trial times them) against nn.Linear's."""

import torch
from torch.profiler import ProfilerActivity, profile

from kernelkit.ops.fp8_linear import fp8_linear


def run(n, k=2048, t=16384):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5).requires_grad_()
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=g)

    def fp8():
        fp8_linear(x, w).backward(dy)

    def bf16():
        torch.nn.functional.linear(x, w).backward(dy)

    for f in (fp8, bf16):
        for _ in range(10):
            f()
    torch.cuda.synchronize()
    for name, f in (("fp8", fp8), ("bf16", bf16)):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(8):
            f()
        e.record()
        torch.cuda.synchronize()
        print(f"{t} x {k} -> {n} {name}: {s.elapsed_time(e) / 8:.3f} ms per fwd+bwd (8 in flight)")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        fp8()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


for n in (512, 2048):
    run(n)
