"""Host (CPU) time of one attention forward call, Gluon path against Triton path, and where the Gluon path's goes.

At 1k tokens a call's kernels take ~0.2 ms, and the end-to-end figure of `attention_vs_cudnn.py` falls well below
the kernel-only one when the host cannot keep up. This prints the host microseconds per call of each path (the
GPU kept busy: `scripts/host_time.py`'s method) and cProfile's top entries of the Gluon path.

    PYTHONPATH=src python benchmarks/attention_host_time.py [--d 128] [--seq 1024] [--causal] [--bwd]
        [--stages [--trace trace.json]]

`--bwd` times forward + backward (`torch.autograd.grad`) instead, kernelkit as shipped against SDPA (cuDNN), and
profiles kernelkit's. `--stages` splits a forward + backward into its parts (each timed alone, back to back, the
GPU kept busy): the public call's routes, the launchers, the descriptors, the launches with their arguments built
beforehand, and the bare torch allocations and copies the backward makes.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernelkit.ops.attention import ATTENTION, attention, backward as bwd_mod, forward as fwd_mod, hopper, hopper_bwd
from kernelkit.runtime import launch

sys.path.insert(0, "scripts")
from host_time import cprofile_top, cpu_us  # noqa: E402 - the shared method


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--bwd", action="store_true", help="forward + backward, kernelkit as shipped against SDPA")
    ap.add_argument("--stages", action="store_true", help="host time of each part of a forward + backward")
    ap.add_argument("--trace", default="", help="with --stages: write torch.profiler's trace of 3 fwd+bwd here")
    a = ap.parse_args(argv)
    b, h = 16384 // a.seq, 2048 // a.d
    q, k, v = (torch.randn(b, a.seq, h, a.d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if a.stages:
        return _stages(q, k, v, a)
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


def _stages(q, k, v, a) -> int:
    """Host microseconds of each part of kernelkit's forward + backward, each timed alone (see the docstring)."""
    hopper.TRITON_UP_TO.clear()
    causal, scale = a.causal, q.shape[-1] ** -0.5
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    o, lse = fwd_mod.attention_fwd(q, k, v, causal, scale=scale, checked=True)
    flags = (causal, -1, 0.0, 0, scale, False)
    n = lse.shape[-1]
    delta, lse2 = (torch.empty((*lse.shape[:-1], -(-n // 4) * 4), dtype=torch.float32, device=q.device)[..., :n]
                   for _ in range(2))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def fwd_launch_only():  # the forward kernel's launch with its descriptors built beforehand
        hopper.launch(hopper.attn_fwd_hopper_kernel, *_FWD_ARGS[0], **_FWD_ARGS[1])

    _FWD_ARGS = []
    real = hopper.launch
    hopper.launch = lambda kernel, grid, key, *args, **kw: _FWD_ARGS.extend([(grid, key, *args), kw])
    hopper.attention_fwd_hopper(q, k, v, o, lse, causal, scale * 1.4426950408889634)
    hopper.launch = real
    _BWD_ARGS = []
    real = hopper_bwd.launch
    hopper_bwd.launch = lambda kernel, grid, key, *args, **kw: _BWD_ARGS.extend([(grid, key, *args), kw])
    hopper_bwd.dkdv_hopper(q, k, v, do, dk, dv, lse2, delta, causal, scale, dq=torch.empty_like(q))
    hopper_bwd.launch = real

    def sdpa(grad):
        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(
                    *(t.transpose(1, 2) for t in ((qg, kg, vg) if grad else (q, k, v))), is_causal=causal)
            if grad:
                torch.autograd.grad(out.transpose(1, 2), (qg, kg, vg), do)
        return run

    stages = [
        ("sdpa-cudnn fwd (no grad)", sdpa(False), 300),
        ("sdpa-cudnn fwd+bwd", sdpa(True), 30),
        ("attention fwd (no grad)", lambda: attention(q, k, v, causal=causal), 300),
        ("attention fwd (grad: autograd.Function)", lambda: attention(qg, kg, vg, causal=causal), 100),
        ("attention fwd+bwd", lambda: torch.autograd.grad(attention(qg, kg, vg, causal=causal), (qg, kg, vg), do), 30),
        ("ATTENTION op (no grad)", lambda: ATTENTION(q, k, v, None, *flags), 300),
        ("forward.attention_fwd(checked)", lambda: fwd_mod.attention_fwd(q, k, v, causal, scale=scale, checked=True),
         300),
        ("hopper.attention_fwd_hopper", lambda: hopper.attention_fwd_hopper(q, k, v, o, lse, causal, 0.1), 300),
        ("4 x hopper._desc", lambda: [hopper._desc(t, 64) for t in (q, k, v, o)], 300),
        ("fwd kernel launch (args built)", fwd_launch_only, 300),
        ("backward.attention_bwd", lambda: bwd_mod.attention_bwd(do, None, q, k, v, o, lse, causal, None, None, None,
                                                                 0, scale), 100),
        ("hopper_bwd.dkdv_hopper (dq fused)", lambda: hopper_bwd.dkdv_hopper(q, k, v, do, dk, dv, lse2, delta, causal,
                                                                            scale, dq=dq), 100),
        ("bwd kernel launch (args built)", lambda: launch(hopper_bwd.attn_bwd_dkdv_hopper_kernel, *_BWD_ARGS[0],
                                                          **_BWD_ARGS[1]), 100),
        ("hopper_bwd.dq_buffer", lambda: hopper_bwd.dq_buffer(q.shape[0], q.shape[2], q.shape[1], q.shape[-1],
                                                              q.device), 300),
        ("torch.empty(q.shape)", lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device), 300),
        ("dq.copy_(q) (same layout)", lambda: dq.copy_(q), 300),
        ("4 x tma_compatible", lambda: [hopper._tma_ok(t) for t in (q, k, v, o)], 300),
        ("torch.cuda.get_device_capability", lambda: torch.cuda.get_device_capability(q.device), 300),
    ]
    for name, fn, calls in stages:
        print(f"{name:45s} {cpu_us(fn, n=calls):8.1f} us", flush=True)
    full = stages[4][1]
    print(f"{'attention fwd+bwd, 5 calls back to back':45s} {cpu_us(full, n=5):8.1f} us")
    print(f"{'attention fwd+bwd, GPU time (events, median)':45s} {triton.testing.do_bench(full) * 1e3:8.1f} us")
    tiny = [t[:1, :128].clone().requires_grad_() for t in (q, k, v)]
    tiny_do = do[:1, :128].clone()
    print(f"{'attention fwd+bwd at b1 s128 (GPU idle)':45s} "
          f"{cpu_us(lambda: torch.autograd.grad(attention(*tiny, causal=causal), tiny, tiny_do), n=30):8.1f} us")
    if a.trace:  # CPU ops and kernels on one timeline: where the GPU waits for the host
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                full()
            torch.cuda.synchronize()
        prof.export_chrome_trace(a.trace)
    torch.cuda.set_sync_debug_mode("error")  # a host synchronization torch makes raises
    try:
        full()
        print("fwd+bwd: no synchronizing torch call")
    except RuntimeError as e:
        print(f"fwd+bwd synchronizes: {e}")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
