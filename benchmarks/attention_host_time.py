"""Host (CPU) time of one attention forward call, Gluon path against Triton path, and where the Gluon path's goes.

At 1k tokens a call's kernels take ~0.2 ms, and the end-to-end figure of `attention_vs_cudnn.py` falls well below
the kernel-only one when the host cannot keep up. This prints the host microseconds per call of each path (the
GPU kept busy: `scripts/host_time.py`'s method) and cProfile's top entries of the Gluon path.

    PYTHONPATH=src python benchmarks/attention_host_time.py [--d 128] [--seq 1024] [--causal] [--bwd]

`--bwd` times forward + backward (`torch.autograd.grad`) instead, kernelkit as shipped against SDPA (cuDNN), and
profiles kernelkit's.
"""
from __future__ import annotations

import argparse
import sys

import torch

from kernelkit.ops.attention import attention, forward as fwd_mod, hopper

sys.path.insert(0, "scripts")
from host_time import cprofile_top, cpu_us  # noqa: E402 - the shared method


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--bwd", action="store_true", help="forward + backward, kernelkit as shipped against SDPA")
    a = ap.parse_args(argv)
    b, h = 16384 // a.seq, 2048 // a.d
    q, k, v = (torch.randn(b, a.seq, h, a.d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if a.bwd:
        return _bwd(q, k, v, a)
    hopper.TRITON_UP_TO.clear()  # every call the Gluon kernel takes

    def run():
        return attention(q, k, v, causal=a.causal)

    for gluon in (True, False):
        fwd_mod.GLUON = gluon
        print(f"{'gluon' if gluon else 'triton'}: {cpu_us(run):.1f} us of host time a call", flush=True)
    fwd_mod.GLUON = True
    print(cprofile_top(run, top=a.top))
    return 0


def _bwd(q, k, v, a) -> int:
    """Host time of forward + backward: kernelkit as shipped, and SDPA with its own backend (cuDNN on the H100)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)

    def kk():
        torch.autograd.grad(attention(q, k, v, causal=a.causal), (q, k, v), do)

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                                 is_causal=a.causal)
        torch.autograd.grad(o.transpose(1, 2), (q, k, v), do)

    for name, fn in (("kernelkit", kk), ("sdpa-cudnn", sdpa)):  # few calls: the launch queue must not fill
        print(f"{name} fwd+bwd: {cpu_us(fn, n=30):.1f} us of host time a call", flush=True)
    print(cprofile_top(kk, calls=30, top=a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
