"""Attention backward through the Gluon dK / dV kernel, with the Triton dQ kernel and with dQ fused, on three small
shapes, against the Triton backward: run it under compute-sanitizer. KK_BWD_STAGES overrides hopper_bwd.STAGES."""
import os
import sys

import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    sys.exit("memcheck_attention_bwd: needs a CUDA GPU of sm_90 (the Gluon kernel is Hopper-only)")
from kernelkit.ops.attention import attention, backward as bwd_mod, hopper_bwd  # noqa: E402 - after the GPU check

hopper_bwd.STAGES = int(os.environ.get("KK_BWD_STAGES", hopper_bwd.STAGES))


def grads(q, k, v, do, causal, gluon, fused=False):
    bwd_mod.GLUON, bwd_mod.GLUON_FUSED_DQ = gluon, fused
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    attention(q, k, v, causal=causal).backward(do)
    return q.grad, k.grad, v.grad


bad = False
# the last: 16 key blocks x 16 heads, causal: `LONGEST_FIRST` walks two groups of 8 heads
for (b, sq, sk, hq, hk, d, causal) in [(1, 333, 1200, 8, 2, 128, True), (1, 1200, 333, 4, 1, 64, True),
                                       (2, 257, 129, 6, 3, 64, False), (2, 2048, 2048, 8, 8, 128, True)]:
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    want = grads(q, k, v, do, causal, False)
    for fused, bm in [(False, 32), (False, 64), (True, 32)]:
        if d != 128 and bm != 32:
            continue
        hopper_bwd.BLOCK_M[128] = bm  # with the Triton dQ kernel; dQ fused: BLOCK_M_FUSED queries, keys as rows
        got = grads(q, k, v, do, causal, True, fused)
        torch.cuda.synchronize()
        err = [float((g.float() - w.float()).abs().max() / w.float().abs().max()) for g, w in zip(got, want)]
        print("stages", hopper_bwd.STAGES, "dq fused" if fused else "dq triton", f"bm128 {bm}",
              (b, sq, sk, hq, hk, d, causal), "max |gluon - triton| / max |triton| (dq, dk, dv):",
              " ".join(f"{e:.1e}" for e in err), "OK" if max(err) < 2e-2 else "MISMATCH")
        bad = bad or max(err) >= 2e-2
sys.exit(1 if bad else 0)
