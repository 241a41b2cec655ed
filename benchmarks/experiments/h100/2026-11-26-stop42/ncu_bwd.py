import os, torch
from kernelkit.ops.attention import attention, backward as bwd_mod
bwd_mod.GLUON = os.environ.get("GLUON", "1") == "1"
b, s, h, d = 4, 4096, 16, 128
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
for _ in range(2):
    o = attention(q, k, v, causal=False)
    o.backward(torch.ones_like(o))
torch.cuda.synchronize()
