"""Host (CPU) microseconds per eager call of kernelkit ops, fwd and bwd, at each op's smallest-but-one test
shape in bf16: the launch-bound regime where the dispatch layer's overhead shows. Run with two source trees
on PYTHONPATH to compare them in one session (scripts/gpu_check.sh's host stage):

    PYTHONPATH=src python3 scripts/host_time.py rms_norm softmax    # one line per op and mode
"""
import sys
import time

import torch

import kernelkit
from kernelkit.ops import registry


def cpu_us(fn, n=300, repeats=9):
    """Best over `repeats` of the mean CPU time of n back-to-back calls (the GPU kept busy, never waited on):
    the minimum, since the device's shared host only ever adds time (runs of one tree vary by 2x otherwise)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return min(runs)


def main(ops):
    print("kernelkit from", kernelkit.__file__)
    for op in ops:
        spec = registry.get(op)
        args, kwargs = spec.make_inputs(spec.test_shapes[-1], torch.bfloat16, "cuda")
        grads = [a for i, a in enumerate(args) if i in spec.grad_args]
        with torch.no_grad():
            fwd = cpu_us(lambda: spec.fn(*args, **kwargs))
        line = f"== {op} {spec.test_shapes[-1]} fwd {fwd:.1f} us"
        if grads:
            for g in grads:
                g.requires_grad_(True)
            outs = spec.fn(*args, **kwargs)
            outs = [outs] if isinstance(outs, torch.Tensor) else [o for o in outs if o.requires_grad]
            dys = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outs]
            line += f", fwd+grad-record {cpu_us(lambda: spec.fn(*args, **kwargs)):.1f} us"
            bwd = cpu_us(lambda: torch.autograd.grad(outs, grads, dys, retain_graph=True))
            line += f", bwd {bwd:.1f} us"
        print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["rope", "layer_norm", "softmax", "rms_norm", "add_rms_norm", "swiglu"])
