"""Where fp8_linear's host time goes (issue 30/32): cProfile of 40 forward + backward calls at 16384 x 2048 -> 512,
the GPU kept ahead of the host (the calls are host-bound there), top functions by own time."""

import cProfile
import pstats

import torch

from kernelkit.ops.fp8_linear import fp8_linear

t, k, n = 16384, 2048, 512
x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5).requires_grad_()
dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)


def step():
    fp8_linear(x, w).backward(dy)


for _ in range(20):
    step()
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(40):
    step()
prof.disable()
torch.cuda.synchronize()
st = pstats.Stats(prof)
st.sort_stats("tottime").print_stats(28)
st.sort_stats("cumulative").print_stats(22)
