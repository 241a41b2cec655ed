"""Host (CPU) time of an op's call path, where a small-shape benchmark is launch-bound: per op and mode,
microseconds of CPU per call and a cProfile of the hottest functions.

    python scripts/diag_host.py rope layer_norm softmax      # prints per op
"""
import cProfile
import io
import pstats
import sys

import torch

from kernelkit.ops import registry
from kernelkit.testing.suite import _call

from diagnose_launch import cpu_us  # scripts/ is on sys.path when run as a script


def main(ops):
    for op in ops:
        spec = registry.get(op)
        shape = spec.test_shapes[-1]
        args, kwargs = spec.make_inputs(shape, torch.bfloat16, "cuda")
        args = tuple(a.requires_grad_(True) if i in spec.grad_args else a for i, a in enumerate(args))
        for mode in ("fwd", "bwd"):
            if mode == "bwd" and not spec.grad_args:
                continue
            fn = _call(spec.fn, args, kwargs, mode)
            print(f"== {op} {shape} {mode}: {cpu_us(fn):.1f} us CPU per call")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
            print("\n".join(line for line in s.getvalue().splitlines()[6:] if line.strip()))


if __name__ == "__main__":
    main(sys.argv[1:] or ["rope", "layer_norm", "softmax", "rms_norm"])
