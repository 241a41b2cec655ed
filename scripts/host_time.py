"""Host (CPU) microseconds per eager call of kernelkit ops, fwd and bwd, at each op's last test shape (a small
one) in bf16: the launch-bound regime where the dispatch layer's overhead shows. Run with two source trees on
PYTHONPATH to compare them in one session (scripts/gpu_check.sh's host stage):

    PYTHONPATH=src python3 scripts/host_time.py rms_norm softmax    # one line per op and mode
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

import kernelkit
from kernelkit.ops import registry


def cpu_us(fn, n=300, repeats=9, device="cuda"):
    """Best over `repeats` of the mean CPU time of n back-to-back calls (the GPU kept busy, never waited on):
    the minimum, since the device's shared host only ever adds time (runs of one tree vary by 2x otherwise)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(min(20, n)):
        fn()
    sync()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
        sync()
    return min(runs)


def cprofile_top(fn, calls=200, top=25, sort="tottime") -> str:
    """cProfile's `top` entries by `sort` over `calls` back-to-back calls of fn (after one warm call)."""
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(top)
    return out.getvalue()


def main(ops, device="cuda", n=300, repeats=9):
    print("kernelkit from", kernelkit.__file__)

    def us(fn):
        return cpu_us(fn, n, repeats, device)

    for op in ops:
        spec = registry.get(op)
        args, kwargs = spec.make_inputs(spec.test_shapes[-1], torch.bfloat16, device)
        grads = [a for i, a in enumerate(args) if i in spec.grad_args]
        with torch.no_grad():
            fwd = us(lambda: spec.fn(*args, **kwargs))
        line = f"== {op} {spec.test_shapes[-1]} fwd {fwd:.1f} us"
        if grads:
            for g in grads:
                g.requires_grad_(True)
            outs = spec.fn(*args, **kwargs)
            outs = [outs] if isinstance(outs, torch.Tensor) else [o for o in outs if o.requires_grad]
            dys = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outs]
            line += f", fwd+grad-record {us(lambda: spec.fn(*args, **kwargs)):.1f} us"
            bwd = us(lambda: torch.autograd.grad(outs, grads, dys, retain_graph=True))
            line += f", bwd {bwd:.1f} us"
        print(line, flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ops", nargs="*", default=["rope", "layer_norm", "softmax", "rms_norm", "add_rms_norm", "swiglu"])
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the kernels in the interpreter "
                                                      "(TRITON_INTERPRET=1), to check the script, not to time it")
    ap.add_argument("--calls", type=int, default=300, help="back-to-back calls per timing")
    ap.add_argument("--repeats", type=int, default=9, help="timings per op and mode (the best is printed)")
    a = ap.parse_args()
    main(a.ops, a.device, a.calls, a.repeats)
