"""Attention backward through the Gluon kernel (dQ fused) on three small shapes: run it under compute-sanitizer."""
import torch
from kernelkit.ops.attention import attention, backward as bwd_mod
bwd_mod.GLUON = True
for (b, sq, sk, hq, hk, d, causal) in [(1, 333, 1200, 8, 2, 128, True), (1, 1200, 333, 4, 1, 64, True), (2, 257, 129, 6, 3, 64, False)]:
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    o = attention(q, k, v, causal=causal)
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    print("ok", b, sq, sk, hq, hk, d, causal, float(q.grad.float().abs().sum()))
